"""The charts of ``loopwarden capacity --plot DIR / --report FILE.html``, drawn with matplotlib.

matplotlib is the optional extra ``loopwarden[plots]`` (``make run`` and ``make test`` install
it); without it `chart` raises `PlotUnavailable` saying what to install. Each chart is a bar per
histogram bucket (the share of the window's requests or calls in it), with: a title naming the
window and the count, labelled axes with units, bucket bounds as tick labels, the current limit
(solid red line) and the recommended one (dashed green line), the censored requests (stopped at
the cap: their need is unknown, at least the cap) as a hatched bar past the cap, and a legend.
`chart` writes ``NAME.png`` and ``NAME.svg`` (SVG text kept as text, so it can be searched).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (``pip install 'loopwarden[plots]'``)."""


@dataclasses.dataclass(frozen=True)
class ChartSpec:
    """One chart: `bars` as (upper bound, count) per non-cumulative bucket, ascending; `censored`
    observations drawn past `current` (`censored_in_bars`: they are also among `bars`, at the value
    recorded when they were stopped, so they do not add to the total); `fmt` formats a bound for a tick label; `log_x` spaces the
    bars by log of their bound (bytes, seconds) instead of evenly (rounds)."""

    name: str
    title: str
    xlabel: str
    bars: tuple[tuple[float, float], ...]
    fmt: Callable[[float], str]
    current: float | None = None
    current_label: str = ""
    recommended: float | None = None
    recommended_label: str = ""
    censored: float = 0.0
    censored_in_bars: bool = False
    ylabel: str = "share of requests (%)"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "charts need matplotlib: pip install 'loopwarden[plots]' (make run and make test install it)"
        ) from None
    return plt


def _trim(bars: Sequence[tuple[float, float]], keep: Sequence[float]) -> list[tuple[float, float]]:
    """The bars from the first non-empty one (or marked limit) to the last, so a chart is not 120
    empty buckets wide; always at least one."""
    marks = {next((b for b, _ in bars if b >= k), None) for k in keep}
    nonzero = [i for i, (b, n) in enumerate(bars) if n > 0 or b in marks]
    if not nonzero:
        return list(bars[:1])
    return list(bars[max(0, nonzero[0] - 1) : nonzero[-1] + 2])


def _position(bars: Sequence[tuple[float, float]], value: float) -> int:
    """The x position (bar index) of `value`: the bar whose bound is the first >= value."""
    for i, (bound, _) in enumerate(bars):
        if bound >= value:
            return i
    return len(bars)


def chart(spec: ChartSpec, directory: Path) -> tuple[Path, Path]:
    """Draw `spec` and write ``DIR/NAME.png`` and ``DIR/NAME.svg``; returns both paths.
    Raises `PlotUnavailable`."""
    plt = _pyplot()
    import matplotlib as mpl

    mpl.rcParams["svg.fonttype"] = "none"  # text stays text in the SVG
    total = sum(n for _, n in spec.bars) + (0.0 if spec.censored_in_bars else spec.censored)
    bars = _trim(spec.bars, [v for v in (spec.current, spec.recommended) if v is not None])
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=100)
    xs = list(range(len(bars)))
    shares = [100 * n / total if total else 0.0 for _, n in bars]
    ax.bar(xs, shares, width=0.8, color="#3465a4", label="observed (share per bucket)")
    marked = {_position(bars, v) for v in (spec.current, spec.recommended) if v is not None}
    regular = [i for i in xs[:: max(1, len(bars) // 24)] if all(abs(i - m) > 1 or i == m for m in marked)]
    shown = sorted({*regular, *(i for i in marked if i < len(bars))})  # marked limits always labelled
    ticks: list[float] = [float(i) for i in shown]
    labels = [spec.fmt(bars[i][0]) for i in shown]
    if spec.censored:
        x = len(bars) + 0.5
        ticks, labels = [*ticks, x], [*labels, f"> {spec.fmt(spec.current or 0)}"]
        ax.bar(
            [x],
            [100 * spec.censored / total],
            width=0.8,
            color="#cc0000",
            hatch="//",
            alpha=0.6,
            label=f"stopped at the cap: {spec.censored:g} (need unknown, over {spec.fmt(spec.current or 0)})"
            + (" - also drawn at their recorded peak" if spec.censored_in_bars else ""),
        )
    for value, label, style, color in (
        (spec.current, spec.current_label, "-", "#cc0000"),
        (spec.recommended, spec.recommended_label, "--", "#4e9a06"),
    ):
        if value is not None:
            ax.axvline(_position(bars, value) + 0.45, linestyle=style, color=color, linewidth=2, label=label)
    ax.set_xticks(ticks, labels, rotation=60, ha="right", fontsize=8)
    ax.set_xlabel(spec.xlabel)
    ax.set_ylabel(spec.ylabel)
    ax.set_title(spec.title)
    ax.set_ylim(0, max([*shares, 100 * spec.censored / total if total else 0, 1.0]) * 1.15)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    png, svg = directory / f"{spec.name}.png", directory / f"{spec.name}.svg"
    fig.savefig(png, format="png")
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    svg.write_text(buffer.getvalue())
    plt.close(fig)
    return png, svg
