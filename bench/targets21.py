"""The issue-21 targets and figures of one `bench/run.py` run: medians of per-rep ratios.

Every target of one cell ran side by side in each rep (`run.py` interleaves them), so a ratio is
taken rep by rep and the median of those is reported, with the reps' range. Figures per rep:
throughput (req/s), CPU seconds per request (the server process's own), TTFE p50, latency p99.
One figure is not a ratio: the app CPU per streamed event (µs, best of its rounds), measured in
process by ``bench/stream_cpu.py --app`` (``results["app_cpu"]``), one row per framing.

`rows(results)` gives one `Row` per figure; `print_rows` prints them; `markdown(rows)` is the
table for the README. Targets the run could not measure (a peer not installed, a cell not run)
say ``n/a`` and why.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

#: loopwarden store-on × bare aiohttp at 4100672, when issue 21 was filed (README): "today's".
STORE_ON_TODAY = {
    ("buffered", 1): 0.47,
    ("buffered", 16): 0.26,
    ("stream100", 1): 0.21,
    ("stream100", 16): 0.11,
}
BARE, FLOOR, LW = "bare aiohttp", "floor", "loopwarden"
#: The in-process figure of issue 21 (µs per event), its target, and its rows: scenario label ->
#: the framing's key in ``bench/stream_cpu.py``'s `measure_app` figures.
APP_CPU = "app CPU per streamed event (in-process, stream − buffered)"
APP_CPU_TARGET = "<= 2"
APP_FRAMINGS = {
    "one read": "one read",
    "event per read": "one event per read",
    "network reads": "network reads",
}
FAST = " fast"  # the suffix of the httptools + uvloop targets


@dataclasses.dataclass(frozen=True)
class Row:
    """One figure: ``value`` the median per-rep ratio (None if not measured), ``reps`` the per-rep
    values, ``target`` a text such as ``">= 0.65"`` (empty: reported only), ``met`` True / False
    / None (no target or not measured), ``note`` why it is n/a; ``unit`` empty for a ratio, else
    the unit of a value that is not one (``"µs"``: the app CPU rows, best of rounds)."""

    what: str
    scenario: str
    c: int
    value: float | None
    reps: tuple[float, ...]
    target: str = ""
    met: bool | None = None
    note: str = ""
    unit: str = ""


def _met(value: float, check: str) -> bool | None:
    """Whether `value` meets `check` (``">= 0.65"``, ``"<= 2"``); None without a check."""
    if not check:
        return None
    op, _, threshold = check.partition(" ")
    return value >= float(threshold) if op == ">=" else value <= float(threshold)


def _p99(samples: list[Any]) -> float | None:
    values = sorted(s.latency for s in samples if s.ok)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else None


def _ttfe(samples: list[Any]) -> float | None:
    values = [s.ttfe for s in samples if s.ok and s.ttfe is not None]
    return statistics.median(values) if values else None


def _figure(burst: Any, name: str) -> float | None:
    """One rep's figure of a cell: rps, cpu (s/request), ttfe (s), p99 (s)."""
    if name == "rps":
        return sum(1 for s in burst.samples if s.ok) / burst.elapsed if burst.elapsed else None
    if name == "cpu":
        return burst.cpu / len(burst.samples) if burst.samples and not burst.cut else None
    return _ttfe(burst.samples) if name == "ttfe" else _p99(burst.samples)


def per_rep(a: Any, b: Any, figure: str) -> list[float]:
    """a / b of `figure` rep by rep, for two cells of one (scenario, c); reps where either is
    missing are left out. For ``cpu`` the ratio is b / a (a capacity ratio: higher is better)."""
    out = []
    for x, y in zip(a.bursts, b.bursts, strict=False):
        fx, fy = _figure(x, figure), _figure(y, figure)
        if fx and fy:
            out.append(fy / fx if figure == "cpu" else fx / fy)
    return out


def _row(
    what: str, key: tuple[str, int], cells: dict[str, Any], a: str, b: str, figure: str, check: str = ""
) -> Row:
    """The row for `a` / `b` (target names) in one cell; `check` like ``">= 0.65"``."""
    scenario, conc = key
    ca, cb = cells.get(a), cells.get(b)
    if ca is None or cb is None:
        missing = a if ca is None else b
        return Row(what, scenario, conc, None, (), check, None, f"{missing} not run")
    reps = per_rep(ca, cb, figure)
    if not reps:
        return Row(what, scenario, conc, None, (), check, None, "no rep with both figures")
    value = statistics.median(reps)
    return Row(what, scenario, conc, value, tuple(reps), check, _met(value, check))


def app_rows(figures: dict[str, float] | str | None) -> list[Row]:
    """The app CPU per streamed event rows (µs, c=1: sequential requests), one per framing, from
    `bench/stream_cpu.py`'s `measure_app` figures; a str is why they were not measured (None:
    not run)."""
    out = []
    for scenario, key in APP_FRAMINGS.items():
        if isinstance(figures, dict) and key in figures:
            value = figures[key]
            met = _met(value, APP_CPU_TARGET)
            out.append(Row(APP_CPU, scenario, 1, value, (value,), APP_CPU_TARGET, met, unit="µs"))
        else:
            note = figures if isinstance(figures, str) else "not run"
            out.append(Row(APP_CPU, scenario, 1, None, (), APP_CPU_TARGET, None, note, unit="µs"))
    return out


def _cell_rows(key: tuple[str, int], cells: dict[str, Any]) -> list[Row]:
    scenario, conc = key
    out: list[Row] = []
    if scenario == "stream1mb":  # no issue-21 figure; its loopwarden targets are the 256 MiB pair
        return out
    add: Callable[..., None] = lambda *args: out.append(_row(*args))  # noqa: E731
    stream = scenario != "buffered"
    lw_check = {("stream100", 1): ">= 0.65", ("stream100", 16): ">= 0.65"}
    lw_check.update({("buffered", 1): ">= 0.65", ("buffered", 16): ">= 0.60"})
    add("loopwarden x bare (req/s)", key, cells, LW, BARE, "rps", lw_check.get(key, ""))
    add("loopwarden / floor (req/s)", key, cells, LW, FLOOR, "rps")
    add("floor / bare (req/s)", key, cells, FLOOR, BARE, "rps")
    add(
        "loopwarden CPU capacity x bare",
        key,
        cells,
        LW,
        BARE,
        "cpu",
        ">= 0.85" if key == ("paced50us", 16) else "",
    )
    add("floor CPU capacity x bare", key, cells, FLOOR, BARE, "cpu")
    if key in STORE_ON_TODAY:
        target = f">= {2 * STORE_ON_TODAY[key]:.2f}"
        add(
            f"store on x bare (2 x today's {STORE_ON_TODAY[key]})",
            key,
            cells,
            f"{LW} store=memory",
            BARE,
            "rps",
            target,
        )
    if conc == 1 and stream:
        add(
            "TTFE p50 loopwarden / bare",
            key,
            cells,
            LW,
            BARE,
            "ttfe",
            "<= 1.4" if scenario == "stream100" else "",
        )
        add("TTFE p50 floor / bare", key, cells, FLOOR, BARE, "ttfe")
    if conc == 16 and scenario in ("buffered", "stream100"):
        add("p99 loopwarden / bare", key, cells, LW, BARE, "p99", "<= 2.0")
    if stream:
        add(
            "loopwarden x LiteLLM (req/s)",
            key,
            cells,
            LW,
            "litellm",
            "rps",
            ">= 35" if scenario == "stream100" else "",
        )
    else:
        add("loopwarden x LiteLLM (req/s)", key, cells, LW, "litellm", "rps")
    add("loopwarden x Portkey (req/s)", key, cells, LW, "portkey", "rps", "" if stream else ">= 2")
    add("fast stack: loopwarden req/s / h11's", key, cells, LW + FAST, LW, "rps", ">= 1.3")
    add("fast stack: loopwarden x bare (fast)", key, cells, LW + FAST, BARE + FAST, "rps")
    add("fast stack: floor x bare (fast)", key, cells, FLOOR + FAST, BARE + FAST, "rps")
    add("fast stack: bare req/s / h11's", key, cells, BARE + FAST, BARE, "rps")
    return out


def _loop_rows(key: tuple[str, int], cells: dict[str, Any]) -> list[Row]:
    mode, conc = key
    lkey = (f"loop-{mode}", conc)
    return [
        _row(
            "MCP loop: loopwarden x client loop via bare",
            lkey,
            cells,
            "loopwarden (MCP)",
            "bare aiohttp (client loop)",
            "rps",
            ">= 1.0",
        ),
        _row(
            "MCP loop, fast stack: loopwarden x client loop via bare (fast)",
            lkey,
            cells,
            "loopwarden fast (MCP)",
            "bare aiohttp fast (client loop)",
            "rps",
        ),
        _row(
            "MCP loop: fast stack loopwarden loops/s / h11's",
            lkey,
            cells,
            "loopwarden fast (MCP)",
            "loopwarden (MCP)",
            "rps",
            ">= 1.3",
        ),
    ]


def rows(results: dict[str, Any]) -> list[Row]:
    """Every issue-21 figure of a run (`run.run`'s results: ``cells`` and ``loop``, each a dict of
    (scenario, c) -> {target name: Cell}; ``app_cpu``, `app_rows`' figures). A peer that was not
    run gets its `Row` with the note from ``results["peers"]``."""
    out = [r for key, cells in results["cells"].items() for r in _cell_rows(key, cells)]
    out += [r for key, cells in results["loop"].items() for r in _loop_rows(key, cells)]
    out += app_rows(results.get("app_cpu"))
    notes = results.get("peers", {})
    for i, row in enumerate(out):
        for peer, label in (("litellm", "LiteLLM"), ("portkey", "Portkey")):
            if row.value is None and label in row.what and peer in notes:
                out[i] = dataclasses.replace(row, note=notes[peer])
    return [r for r in out if r.value is not None or r.target]


def _verdict(row: Row) -> str:
    if not row.target:
        return ""
    if row.met is None:
        return f"{row.target}: n/a ({row.note})"
    return f"{row.target}: {'met' if row.met else 'not met'}"


def _value(row: Row) -> str:
    if row.value is None:
        return "-"
    if row.unit:
        return f"{row.value:.2f} {row.unit}"
    spread = f" ({min(row.reps):.2f}-{max(row.reps):.2f})" if len(row.reps) > 1 else ""
    return f"{row.value:.3f}{spread}"


def print_rows(found: list[Row]) -> None:
    """Print the figures grouped by scenario: what, c, median per-rep ratio (range) or a value
    with its unit, target."""
    print("\nIssue 21: figures and targets (median of per-rep ratios; reps' range in brackets)")
    for row in found:
        print(f"  {row.scenario:<14} c={row.c:<2} {row.what:<62} {_value(row):>20}  {_verdict(row)}")


def markdown(found: list[Row]) -> str:
    """The figures as a Markdown table (scenario, c, figure, median per-rep ratio or a value with
    its unit, target)."""
    lines = ["| scenario | c | figure | median (reps' range) | target |", "|---|---:|---|---:|---|"]
    lines += [f"| {r.scenario} | {r.c} | {r.what} | {_value(r)} | {_verdict(r)} |" for r in found]
    return "\n".join(lines)
