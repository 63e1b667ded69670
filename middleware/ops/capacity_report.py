"""The capacity report: text (`render_text`), charts and one self-contained HTML page (`write_report`).

Figures come from `middleware.ops.capacity_data.Observations`; the arithmetic (stopped shares with
censored requests, recommendations, memory) from `middleware.ops.capacity`. The HTML page holds
the four charts as inline SVG, the table of candidate limits and the recommendations: no external
file, script or font.
"""

from __future__ import annotations

import dataclasses
import html
import math
from pathlib import Path

from middleware.ops import capacity as cap
from middleware.ops.capacity import MIB, Distribution
from middleware.ops.capacity_data import Observations
from middleware.ops.plot import ChartSpec, chart

TOOL_TIMEOUT_CANDIDATES = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def fmt_bytes(value: float) -> str:
    """``4 KiB``, ``1.5 MiB``, ``256 MiB`` (binary units, 3 significant digits)."""
    for unit, size in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", 1024)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The recommendations for one window of `Observations`."""

    iters: cap.Recommendation
    retained: cap.Recommendation
    tool_timeout: cap.Recommendation
    memory: cap.MemoryPlan


def _recommend_tool_timeout(obs: Observations) -> cap.Recommendation:
    """Timeouts hit: keep the current value (the calls' need is unknown); else the slowest call x 2."""
    current = obs.tool_censored.cap
    if obs.tool_censored.count > 0:
        return cap.Recommendation(
            current,
            f"keeping tool_timeout={current:g} s: {obs.tool_censored.count:g} calls timed out and how long "
            "they would have run is unknown; a tool that hangs is what the timeout is for",
        )
    slowest = obs.tool_duration.maximum()
    if not obs.tool_duration.count:
        return cap.Recommendation(
            current, "no gateway-owned tool calls in the window: keep the current value"
        )
    value = max(1.0, math.ceil(slowest * 2))
    return cap.Recommendation(value, f"no call timed out; the slowest took up to {slowest:g} s, x 2")


def plan(obs: Observations) -> Plan:
    """The recommendations (`middleware.ops.capacity`) for `obs`."""
    retained = cap.recommend_retained(obs.peaks, obs.retained_censored)
    return Plan(
        iters=cap.recommend_iters(obs.rounds, obs.rounds_censored),
        retained=retained,
        tool_timeout=_recommend_tool_timeout(obs),
        memory=cap.plan_memory(obs.memory, retained.value),
    )


def _qs(dist: Distribution) -> list[tuple[str, float]]:
    return [("p50", dist.quantile(0.5)), ("p99", dist.quantile(0.99)), ("max", dist.maximum())]


def _censored_line(what: str, c: cap.Censored, unit_value: str, n: float) -> str:
    if c.count <= 0:
        return f"  no request was stopped at {what}={unit_value}: every figure below is exact"
    return (
        f"  {c.count:g} of {n:g} requests ({100 * c.count / n:.2f} %) were stopped at {what}={unit_value}: "
        f"censored observations (they needed more than {unit_value}, how much is unknown), so a limit at or "
        "above the current one shows a range"
    )


def rows(obs: Observations) -> dict[str, list[cap.StopShare]]:
    """The candidate-limit tables: ``max_retained_bytes`` and ``max_infer_iters`` (the current
    limits included as candidates)."""
    retained = sorted({*cap.RETAINED_CANDIDATES, obs.retained_censored.cap})
    iters = sorted({*cap.ROUNDS_CANDIDATES, obs.rounds_censored.cap})
    return {
        "max_retained_bytes": cap.table(obs.peaks, obs.retained_censored, retained),
        "max_infer_iters": cap.table(obs.rounds, obs.rounds_censored, iters),
    }


def render_text(obs: Observations, p: Plan | None = None) -> str:
    """The report printed by ``loopwarden capacity``."""
    p = p or plan(obs)
    n, table = obs.peaks.count, rows(obs)
    out = [
        f"loopwarden capacity over the last {obs.window} ({n:g} requests, all models; {obs.limits_source})",
        "",
        "retained bytes per request (peak of its ledger): "
        + "  ".join(f"{k} <= {fmt_bytes(v)}" for k, v in _qs(obs.peaks)),
        _censored_line("max_retained_bytes", obs.retained_censored, str(int(obs.retained_censored.cap)), n),
    ]
    if obs.body_clamp_hits:
        out.append(
            f"  {obs.body_clamp_hits:g} more hit request_body / upstream_body, clamps that scale with it"
        )
    out.append("share of requests each max_retained_bytes would have stopped:")
    out += [f"  {fmt_bytes(s.limit):>9}  {s.text()}" for s in table["max_retained_bytes"]]
    finished = obs.rounds.without(obs.rounds_censored.cap, obs.rounds_censored.count)
    out += [
        "inference rounds per request (requests that finished): "
        + "  ".join(f"{k} <= {v:g}" for k, v in _qs(finished)),
        _censored_line(
            "max_infer_iters", obs.rounds_censored, f"{obs.rounds_censored.cap:g}", obs.rounds.count
        ),
        "share of requests each max_infer_iters would have stopped:",
    ]
    out += [f"  {s.limit:>9g}  {s.text()}" for s in table["max_infer_iters"]]
    if obs.tool_duration.count:
        out.append(
            f"tool-call duration ({obs.tool_duration.count:g} calls, {obs.tool_censored.count:g} timed out): "
            + "  ".join(f"{k} <= {v:g} s" for k, v in _qs(obs.tool_duration))
        )
    out += [
        "",
        f"recommended: max_retained_bytes={int(p.retained.value)} ({fmt_bytes(p.retained.value)}), "
        f"max_infer_iters={int(p.iters.value)}, tool_timeout={p.tool_timeout.value:g}, "
        f"workers={p.memory.workers}, memory per worker={p.memory.memory_per_worker // MIB} MiB, "
        f"max_inflight_retained_bytes={p.memory.pool_per_worker}",
        f"  max_retained_bytes: {p.retained.reason}",
        f"  max_infer_iters: {p.iters.reason}",
        f"  tool_timeout: {p.tool_timeout.reason}",
        *(f"  {line}" for line in p.memory.lines),
    ]
    return "\n".join(out)


def _bars(dist: Distribution) -> tuple[tuple[float, float], ...]:
    out, previous = [], 0.0
    for bound, cumulative in dist.buckets:
        out.append((bound, cumulative - previous))
        previous = cumulative
    return tuple(out)


def chart_specs(obs: Observations, p: Plan) -> list[ChartSpec]:
    """The four charts: retained-bytes peak, utilization ratio, inference rounds, tool-call duration."""
    n, w = obs.peaks.count, obs.window
    rc, ic, tc = obs.retained_censored, obs.rounds_censored, obs.tool_censored
    finished = obs.rounds.without(ic.cap, ic.count)
    return [
        ChartSpec(
            "retained_bytes_peak",
            f"Retained bytes per request (ledger peak), last {w}, {n:g} requests",
            "peak retained bytes (bucket upper bound, bytes)",
            _bars(obs.peaks),
            fmt_bytes,
            rc.cap,
            f"current max_retained_bytes = {fmt_bytes(rc.cap)} ({rc.count:g} refused)",
            p.retained.value,
            f"recommended = {fmt_bytes(p.retained.value)}",
            censored=rc.count,
            censored_in_bars=True,
        ),
        ChartSpec(
            "retained_utilization_ratio",
            f"Retained-bytes utilization (peak / limit), last {w}, {obs.utilization.count:g} requests",
            "peak / max_retained_bytes (bucket upper bound, ratio)",
            _bars(obs.utilization),
            lambda v: f"{v:.3g}" if math.isfinite(v) else "+Inf",
            1.0,
            "current limit (ratio 1)",
            p.retained.value / rc.cap,
            f"recommended limit (ratio {p.retained.value / rc.cap:.3g})",
        ),
        ChartSpec(
            "inference_rounds",
            f"Inference rounds per request, last {w}, {obs.rounds.count:g} requests ({ic.count:g} stopped at the cap)",
            "inference rounds (calls to the model per request)",
            _bars(finished),
            lambda v: f"{v:g}" if math.isfinite(v) else "+Inf",
            ic.cap,
            f"current max_infer_iters = {ic.cap:g}",
            p.iters.value,
            f"recommended = {p.iters.value:g}",
            censored=ic.count,
        ),
        ChartSpec(
            "tool_call_duration",
            f"Gateway-owned tool-call duration, last {w}, {obs.tool_duration.count:g} calls ({tc.count:g} timed out)",
            "wall time of one tool call (bucket upper bound, seconds)",
            _bars(obs.tool_duration),
            lambda v: f"{v:g} s" if math.isfinite(v) else "+Inf",
            tc.cap,
            f"current tool_timeout = {tc.cap:g} s",
            p.tool_timeout.value,
            f"recommended = {p.tool_timeout.value:g} s",
            ylabel="share of tool calls (%)",
        ),
    ]


def write_charts(obs: Observations, directory: Path, p: Plan | None = None) -> list[tuple[Path, Path]]:
    """Write every chart of `chart_specs` as PNG and SVG into `directory`."""
    p = p or plan(obs)
    return [chart(spec, directory) for spec in chart_specs(obs, p)]


def write_html(obs: Observations, path: Path, charts_dir: Path) -> str:
    """Write the self-contained HTML report to `path` (charts into `charts_dir` too); returns the
    text report it embeds."""
    p = plan(obs)
    text = render_text(obs, p)
    svgs = [svg.read_text() for _, svg in write_charts(obs, charts_dir, p)]
    tables = []
    for name, shares in rows(obs).items():
        fmt = fmt_bytes if name == "max_retained_bytes" else (lambda v: f"{v:g}")
        body = "".join(
            f"<tr><td>{html.escape(fmt(s.limit))}</td><td>{100 * s.low:.2f} %</td><td>{100 * s.high:.2f} %</td>"
            f"<td>{'exact' if s.exact else 'range: censored requests'}</td></tr>"
            for s in shares
        )
        tables.append(
            f"<h2>Share of requests each {name} would have stopped</h2><table><tr><th>{name}</th>"
            f"<th>at least</th><th>at most</th><th></th></tr>{body}</table>"
        )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>loopwarden capacity</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}pre{background:#f4f4f4;padding:1em;"
        "white-space:pre-wrap}</style></head><body>"
        f"<h1>loopwarden capacity: last {html.escape(obs.window)}, {obs.peaks.count:g} requests</h1>"
        f"<h2>Recommendations</h2><pre>{html.escape(text.split(chr(10) + chr(10))[-1])}</pre>"
        + "".join(tables)
        + "<h2>Charts</h2>"
        + "".join(f"<div>{svg[svg.find('<svg') :]}</div>" for svg in svgs)
        + f"<h2>Full text report</h2><pre>{html.escape(text)}</pre></body></html>"
    )
    path.write_text(page)
    return text
