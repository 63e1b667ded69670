"""``loopwarden capacity --prometheus URL``: size limits and workers from observed traffic.

Reads the histograms the gateway exports (``loopwarden_retained_bytes_peak``,
``loopwarden_inference_rounds``) and the in-flight gauge from a Prometheus server over a window,
and prints: observed p50 / p99 / max (the max is the upper bound of the highest non-empty bucket)
retained bytes per request and rounds per request, the share of requests each candidate limit
would have rejected, and a recommended ``max_retained_bytes`` and ``max_infer_iters`` with the
worker memory they imply (the recommended limit × the peak number of requests in flight).

The histograms carry no ``model`` label (DESIGN.md §8 keeps labels bounded), so the figures are
for all models together. Errors: `CapacityError` when Prometheus cannot be reached or has no data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import httpx

from middleware.ops.plot import bar_chart_png

MIB = 1024 * 1024
RETAINED_CANDIDATES = tuple(m * MIB for m in (8, 16, 32, 64, 128, 256))
ROUNDS_CANDIDATES = (1, 2, 3, 5, 10, 20, 50, 100)
HEADROOM = 1.25  # recommended limit >= observed max x this


class CapacityError(RuntimeError):
    """Prometheus could not be queried, or holds no loopwarden data for the window."""


@dataclasses.dataclass(frozen=True)
class Distribution:
    """A cumulative histogram: ``buckets`` as (upper bound, cumulative count), ascending, +Inf last."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        """Observations in the window."""
        return self.buckets[-1][1] if self.buckets else 0.0

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding quantile `q` (conservative, no interpolation)."""
        target = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= target:
                return bound
        return math.inf

    def maximum(self) -> float:
        """The upper bound of the highest non-empty bucket."""
        previous = 0.0
        top = 0.0
        for bound, cumulative in self.buckets:
            if cumulative > previous:
                top = bound
            previous = cumulative
        return top

    def share_above(self, limit: float) -> float:
        """Share of observations above `limit` (uses the largest bucket bound <= limit)."""
        if not self.count:
            return 0.0
        below = 0.0
        for bound, cumulative in self.buckets:
            if bound <= limit:
                below = cumulative
        return max(0.0, 1.0 - below / self.count)


def _query(client: httpx.Client, url: str, promql: str) -> list[dict[str, object]]:
    try:
        r = client.get(url.rstrip("/") + "/api/v1/query", params={"query": promql})
        r.raise_for_status()
        body = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CapacityError(f"cannot query Prometheus at {url}: {exc}") from None
    if body.get("status") != "success":
        raise CapacityError(f"Prometheus refused the query {promql!r}: {body.get('error')}")
    result: list[dict[str, object]] = body["data"]["result"]
    return result


def distribution(client: httpx.Client, url: str, metric: str, window: str) -> Distribution:
    """The cumulative buckets of histogram `metric` increased over `window` (e.g. ``1h``)."""
    rows = _query(client, url, f"sum by (le) (increase({metric}_bucket[{window}]))")
    buckets = []
    for row in rows:
        labels = row["metric"]
        value = row["value"]
        assert isinstance(labels, dict) and isinstance(value, list)
        buckets.append((float(labels["le"]), float(value[1])))
    return Distribution(tuple(sorted(buckets)))


def recommend(values: Sequence[float], observed_max: float, low: float, high: float) -> float:
    """The smallest candidate >= observed max x HEADROOM (clamped to [low, high])."""
    for value in values:
        if value >= observed_max * HEADROOM:
            return max(low, min(value, high))
    return high


def report(url: str, *, window: str = "1h", timeout: float = 10.0, plot: str | None = None) -> str:
    """The capacity report as text; with `plot`, also a PNG bar chart of the share of requests in
    each ``loopwarden_retained_utilization_ratio`` bucket (peak / limit), buckets over 0.9 in red.
    Raises `CapacityError`."""
    with httpx.Client(timeout=timeout) as client:
        if plot is not None:
            utilization = distribution(client, url, "loopwarden_retained_utilization_ratio", window)
            shares, previous = [], 0.0
            for _, cumulative in utilization.buckets:
                shares.append((cumulative - previous) / utilization.count if utilization.count else 0.0)
                previous = cumulative
            warn = next((i for i, (bound, _) in enumerate(utilization.buckets) if bound > 0.9), None)
            bar_chart_png(shares or [0.0], plot, warn_from=warn)
        retained = distribution(client, url, "loopwarden_retained_bytes_peak", window)
        rounds = distribution(client, url, "loopwarden_inference_rounds", window)
        inflight_rows = _query(client, url, f"max_over_time(sum(loopwarden_inflight_requests)[{window}:5s])")
    if not retained.count:
        raise CapacityError(f"no loopwarden_retained_bytes_peak observations in the last {window}")
    inflight = 1.0
    if inflight_rows:
        value = inflight_rows[0]["value"]
        assert isinstance(value, list)
        inflight = max(1.0, float(value[1]))
    lines = [f"loopwarden capacity over the last {window} ({int(retained.count)} requests, all models)", ""]
    lines.append("retained bytes per request (peak of its ledger):")
    for name, value in (
        ("p50", retained.quantile(0.5)),
        ("p99", retained.quantile(0.99)),
        ("max", retained.maximum()),
    ):
        lines.append(f"  {name:>4} <= {value / MIB:10.3f} MiB")
    lines.append("share of requests each max_retained_bytes would have rejected:")
    for candidate in RETAINED_CANDIDATES:
        lines.append(f"  {candidate // MIB:>4} MiB  {100 * retained.share_above(candidate):6.2f} %")
    if rounds.count:
        lines.append("inference rounds per request:")
        for name, value in (
            ("p50", rounds.quantile(0.5)),
            ("p99", rounds.quantile(0.99)),
            ("max", rounds.maximum()),
        ):
            lines.append(f"  {name:>4} <= {value:g}")
        lines.append("share of requests each max_infer_iters would have stopped:")
        for cap in ROUNDS_CANDIDATES:
            lines.append(f"  {cap:>4}  {100 * rounds.share_above(cap):6.2f} %")
    limit = recommend(RETAINED_CANDIDATES, retained.maximum(), 4096, 256 * MIB)
    iters = recommend(ROUNDS_CANDIDATES, rounds.maximum() if rounds.count else 1, 1, 100)
    lines += [
        "",
        f"recommended: max_retained_bytes={int(limit)} ({limit / MIB:g} MiB), max_infer_iters={int(iters)}",
        f"  peak requests in flight: {inflight:g}; worker memory they imply: "
        f"{inflight:g} x {limit / MIB:g} MiB = {inflight * limit / MIB:g} MiB of ledger budget per worker",
    ]
    return "\n".join(lines)
