"""``loopwarden capacity --prometheus URL``: read a window of the gateway's metrics, size limits and workers.

`gather` reads from a Prometheus server (HTTP API ``/api/v1/query``), over a window such as
``1h``: the raw samples of each histogram bucket and of the cap-hit counters, turned into exact
increases here (reset-aware, no extrapolation: Prometheus' ``increase()`` stretches a window's
first and last samples to its edges, which turns 12 cap hits into 12.6); and the peaks of the
memory gauges (``max_over_time``). `render_text` prints the report; `write_report` adds the
charts (`middleware.ops.plot`) and the HTML page. The arithmetic is `middleware.ops.capacity`.

Every query sums over every label it does not name (``limit``, ``le``), so added labels (a
``transport`` on the cap hits, more instances) change nothing. The histograms carry no ``model``
label (DESIGN.md §8), so the figures are for all models together. Errors: `CapacityError` when
Prometheus cannot be reached, refuses a query, or holds no loopwarden data for the window.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import httpx

from middleware.ops import capacity as cap
from middleware.ops.capacity import MIB, Censored, Distribution

DEFAULT_MAX_INFER_ITERS = 10
DEFAULT_MAX_RETAINED_BYTES = 64 * MIB
DEFAULT_TOOL_TIMEOUT = 60.0


class CapacityError(RuntimeError):
    """Prometheus could not be queried, or holds no loopwarden data for the window."""


def _query(client: httpx.Client, url: str, promql: str) -> list[dict[str, Any]]:
    try:
        r = client.get(url.rstrip("/") + "/api/v1/query", params={"query": promql})
        body = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CapacityError(f"cannot query Prometheus at {url}: {exc}") from None
    if body.get("status") != "success":
        raise CapacityError(f"Prometheus refused the query {promql!r}: {body.get('error')}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _increase(values: list[list[Any]]) -> float:
    """Exact increase of one counter series from its raw samples; a drop is a reset (restart)."""
    total, previous = 0.0, None
    for _, text in values:
        value = float(text)
        if previous is not None:
            total += value - previous if value >= previous else value
        previous = value
    return total


def increases(client: httpx.Client, url: str, selector: str, window: str, by: str | None) -> dict[str, float]:
    """Sum of the exact increases of every series matching `selector` over `window`, grouped by
    label `by` (key ``""`` when `by` is None)."""
    out: dict[str, float] = defaultdict(float)
    for row in _query(client, url, f"{selector}[{window}]"):
        key = row["metric"].get(by, "") if by else ""
        out[key] += _increase(row.get("values", []))
    return dict(out)


def distribution(client: httpx.Client, url: str, metric: str, window: str) -> Distribution:
    """The cumulative buckets of histogram `metric` over `window` (exact increases, summed by ``le``)."""
    by_le = increases(client, url, f"{metric}_bucket", window, "le")
    return Distribution(tuple(sorted((float(le), round(n, 6)) for le, n in by_le.items())))


def _peak(client: httpx.Client, url: str, promql: str) -> float:
    rows = _query(client, url, promql)
    values = [float(r["value"][1]) for r in rows if not math.isnan(float(r["value"][1]))]
    return max(values, default=0.0)


def _cap_hits(client: httpx.Client, url: str, limit: str, window: str) -> float:
    return sum(increases(client, url, f'loopwarden_cap_hits_total{{limit="{limit}"}}', window, None).values())


@dataclasses.dataclass(frozen=True)
class Observations:
    """One window of the gateway's metrics, reduced (see the module docstring)."""

    window: str
    rounds: Distribution
    peaks: Distribution
    utilization: Distribution
    tool_duration: Distribution
    rounds_censored: Censored
    retained_censored: Censored
    tool_censored: Censored
    body_clamp_hits: float
    memory: cap.MemoryInputs
    limits_source: str


def _current_retained_limit(client: httpx.Client, url: str, window: str) -> float | None:
    """sum(peak) / sum(peak / limit) over the window: the limit in force when it was one value."""
    peak_sum = sum(increases(client, url, "loopwarden_retained_bytes_peak_sum", window, None).values())
    ratio_sum = sum(
        increases(client, url, "loopwarden_retained_utilization_ratio_sum", window, None).values()
    )
    return round(peak_sum / ratio_sum) if peak_sum > 0 and ratio_sum > 0 else None


def _memory_inputs(client: httpx.Client, url: str, window: str, workers: int) -> cap.MemoryInputs:
    """The peaks of the memory gauges over `window` (the largest over targets) and admission refusals.

    Called once requests were observed (`gather`). ``loopwarden_inflight_retained_bytes`` is read
    at scrape time, so a peak of 0 means no scrape fell while a request was served (a short run
    between two scrapes), not that ledgers charged nothing: it is None, not sampled."""
    inflight = _peak(client, url, f"max_over_time(loopwarden_inflight_retained_bytes[{window}])")
    return cap.MemoryInputs(
        inflight_retained_peak=inflight if inflight > 0 else None,
        pool_bytes=_peak(client, url, f"max_over_time(loopwarden_admission_budget_bytes[{window}])"),
        workers=workers,
        rss_peak=_peak(client, url, f"max_over_time(loopwarden_worker_resident_memory_bytes[{window}])"),
        rss_baseline=_peak(
            client, url, f"max_over_time(loopwarden_worker_baseline_resident_memory_bytes[{window}])"
        ),
        pool_fill_peak=_peak(
            client,
            url,
            "max_over_time((sum by (instance) (loopwarden_admission_reserved_bytes) / sum by (instance) "
            f"(loopwarden_admission_budget_bytes))[{window}:1s])",
        ),
        admission_refusals=_cap_hits(client, url, "admission", window),
    )


def gather(
    url: str,
    *,
    window: str = "1h",
    timeout: float = 10.0,
    workers: int = 1,
    max_infer_iters: int | None = None,
    max_retained_bytes: int | None = None,
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT,
) -> Observations:
    """Read `window` from the Prometheus at `url`. Current limits not given are inferred: the cap
    of ``max_infer_iters`` is the rounds bucket its stopped requests sit in, ``max_retained_bytes``
    is sum(peak) / sum(utilization); else the gateway defaults. Raises `CapacityError`."""
    with httpx.Client(timeout=timeout) as client:
        rounds = distribution(client, url, "loopwarden_inference_rounds", window)
        peaks = distribution(client, url, "loopwarden_retained_bytes_peak", window)
        if not peaks.count:
            raise CapacityError(f"no loopwarden_retained_bytes_peak observations in the last {window}")
        iter_hits = _cap_hits(client, url, "max_infer_iters", window)
        sources = []
        if max_infer_iters is None:
            max_infer_iters = int(rounds.maximum()) if iter_hits > 0 else DEFAULT_MAX_INFER_ITERS
            sources.append(
                "max_infer_iters " + ("inferred from its cap hits" if iter_hits > 0 else "default")
            )
        if max_retained_bytes is None:
            inferred = _current_retained_limit(client, url, window)
            max_retained_bytes = int(inferred or DEFAULT_MAX_RETAINED_BYTES)
            sources.append(
                "max_retained_bytes " + ("inferred from peak / utilization" if inferred else "default")
            )
        memory = _memory_inputs(client, url, window, workers)
        return Observations(
            window=window,
            rounds=rounds,
            peaks=peaks,
            utilization=distribution(client, url, "loopwarden_retained_utilization_ratio", window),
            tool_duration=distribution(client, url, "loopwarden_tool_call_duration_seconds", window),
            rounds_censored=Censored(iter_hits, float(max_infer_iters), at_cap=True),
            retained_censored=Censored(
                _cap_hits(client, url, "max_retained_bytes", window), float(max_retained_bytes), at_cap=False
            ),
            tool_censored=Censored(
                _cap_hits(client, url, "tool_timeout", window), tool_timeout, at_cap=False
            ),
            body_clamp_hits=_cap_hits(client, url, "request_body", window)
            + _cap_hits(client, url, "upstream_body", window),
            memory=memory,
            limits_source="; ".join(sources) or "as given",
        )
