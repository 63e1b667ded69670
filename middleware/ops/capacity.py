"""The arithmetic of ``loopwarden capacity``: stopped shares with censored observations, limits, memory.

Input is what the gateway exports (DESIGN.md §8), already reduced to counts over a window by
`middleware.ops.capacity_data`: the cumulative histograms ``loopwarden_inference_rounds`` and
``loopwarden_retained_bytes_peak``, and the cap hits of ``loopwarden_cap_hits_total``.

**Censoring.** A request stopped by a cap is a *censored* observation: it needed more than the
cap, by how much nobody knows. A request stopped at ``max_infer_iters=C`` is recorded with C
rounds but needed at least C + 1; one refused at ``max_retained_bytes=C`` is recorded with the
peak it reached before the refused charge (anywhere up to C) but needed more than C. So for a
candidate limit L the share of requests it would have stopped is an interval (`StopShare`):

* L = C: every censored request is stopped and none is recorded over C: exact, above(L) + K.
* L < C: every censored request is stopped; an uncensored one is stopped when its recorded value
  is over L. When the censored observations sit at the cap itself (rounds), the figure is exact;
  otherwise the histogram cannot tell which recorded values are censored and the share lies in
  [max(K, above(L)), min(N, K + above(L))] / N (K censored, N observed, above(L) recorded over L).
* L > C: the uncensored requests over L are stopped (none when C applied to all), and any of the
  K censored ones may be: [above(L), above(L) + K] / N.

A candidate that is not a bucket bound is rounded down to the bound under it (stopping more, never
less). Everything here is pure and deterministic; the property test (tests/unit/test_capacity.py)
checks it against simulated populations with known needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

MIB = 1024 * 1024
#: A recommended limit leaves this much room over the largest need observed.
HEADROOM = 1.25
#: Memory margin over the computed per-worker need.
MEMORY_MARGIN = 1.25
#: The admission pool's target peak fill: more workers are recommended above it.
POOL_TARGET_FILL = 0.8
#: Capped requests "look like runaway loops" when no request that finished on its own used more
#: than this fraction of the cap: the cap sits far above real work, so the capped ones are outliers.
RUNAWAY_FRACTION = 0.5
ROUNDS_CANDIDATES = (1, 2, 3, 5, 10, 15, 20, 30, 50, 100)
RETAINED_CANDIDATES = tuple(m * MIB for m in (1, 2, 4, 8, 16, 32, 64, 128, 256))
MIN_RETAINED, MAX_RETAINED = 4096, 256 * MIB
MAX_ITERS = 100


@dataclasses.dataclass(frozen=True)
class Distribution:
    """A cumulative histogram: ``buckets`` as (upper bound, cumulative count), ascending, +Inf last."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        """Observations in the window."""
        return self.buckets[-1][1] if self.buckets else 0.0

    def at_or_below(self, limit: float) -> float:
        """Observations recorded at or below the largest bucket bound <= `limit`."""
        below = 0.0
        for bound, cumulative in self.buckets:
            if bound <= limit:
                below = cumulative
        return below

    def above(self, limit: float) -> float:
        """Observations recorded over `limit` (see `at_or_below`)."""
        return self.count - self.at_or_below(limit)

    def in_bucket(self, bound: float) -> float:
        """Observations in the bucket whose upper bound is `bound` (0 when it is not a bound)."""
        previous = 0.0
        for upper, cumulative in self.buckets:
            if upper == bound:
                return cumulative - previous
            previous = cumulative
        return 0.0

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding quantile `q` (conservative, no interpolation)."""
        target = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= target and cumulative > 0:
                return bound
        return 0.0

    def maximum(self) -> float:
        """The upper bound of the highest non-empty bucket (0 when empty)."""
        previous, top = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative > previous:
                top = bound
            previous = cumulative
        return top

    def without(self, bound: float, n: float) -> Distribution:
        """This histogram with `n` observations taken out of the bucket `bound` (the censored ones
        recorded at the cap), so `maximum` and `quantile` describe the uncensored requests."""
        return Distribution(tuple((b, c - n if b >= bound else c) for b, c in self.buckets))


@dataclasses.dataclass(frozen=True)
class Censored:
    """The requests a cap stopped: `count` of them (cap hits), at limit `cap`; `at_cap` when each
    was recorded with the cap itself as its value (rounds), else anywhere up to it (retained bytes)."""

    count: float
    cap: float
    at_cap: bool


@dataclasses.dataclass(frozen=True)
class StopShare:
    """The share of observed requests (0..1) candidate `limit` would have stopped: at least `low`,
    at most `high` (equal when the censored requests leave no doubt)."""

    limit: float
    low: float
    high: float

    @property
    def exact(self) -> bool:
        """True when the figure is known, not a range."""
        return math.isclose(self.low, self.high, abs_tol=1e-12)

    def text(self) -> str:
        """``"9.52 %"`` or ``"0.00 .. 9.52 %"``."""
        if self.exact:
            return f"{100 * self.low:.2f} %"
        return f"{100 * self.low:.2f} .. {100 * self.high:.2f} %"


def stop_share(dist: Distribution, censored: Censored | None, limit: float) -> StopShare:
    """The share of `dist`'s requests a cap of `limit` would have stopped (module docstring).

    `dist` counts every request, censored ones with their recorded value; `censored` is None or has
    ``count`` 0 when no request hit the cap."""
    n = dist.count
    if n <= 0:
        return StopShare(limit, 0.0, 0.0)
    above = dist.above(limit)
    k = min(censored.count, n) if censored is not None else 0.0
    if k <= 0 or censored is None:
        low = high = above
    elif limit < censored.cap:
        low = above if censored.at_cap else max(k, above)
        high = above if censored.at_cap else min(n, k + above)
    elif limit == censored.cap:  # every censored request is stopped, and none is recorded over L
        low = high = min(n, above + k)
    else:
        low, high = above, min(n, above + k)
    return StopShare(limit, low / n, high / n)


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """A recommended limit `value` and the sentence that says why (shown verbatim in the report)."""

    value: float
    reason: str


def _round_up_bytes(value: float) -> int:
    """Up to a whole MiB from 1 MiB, else a whole 4 KiB; within [MIN_RETAINED, MAX_RETAINED]."""
    step = MIB if value >= MIB else 4096
    return int(min(MAX_RETAINED, max(MIN_RETAINED, math.ceil(value / step) * step)))


def recommend_iters(rounds: Distribution, censored: Censored) -> Recommendation:
    """``max_infer_iters`` from the rounds histogram and the requests stopped at the cap.

    No cap hits: the largest observed need x `HEADROOM`, rounded up. Cap hits that look like
    runaway loops (no finished request used more than `RUNAWAY_FRACTION` of the cap): keep the cap
    and say why. Cap hits among requests that used most of the cap: double it, saying that the
    capped requests' need is unknown."""
    cap, k = censored.cap, censored.count
    finished = rounds.without(cap, k) if k else rounds
    need = finished.maximum()
    fits = max(1, math.ceil(need * HEADROOM))
    if k <= 0:
        return Recommendation(
            min(MAX_ITERS, fits), f"no request hit a cap; the most rounds one used was {need:g}, +25 %"
        )
    if need <= RUNAWAY_FRACTION * cap:
        return Recommendation(
            cap,
            f"keeping max_infer_iters={cap:g}: the {k:g} requests stopped at it look like runaway loops "
            f"(every request that finished used at most {need:g} rounds, under {RUNAWAY_FRACTION:.0%} of the "
            f"cap); raising it would only let them run longer (a cap of {min(cap, fits):g} still fits "
            "every finished request with 25 % headroom)",
        )
    raised = min(MAX_ITERS, max(fits, 2 * cap))
    return Recommendation(
        raised,
        f"raising max_infer_iters from {cap:g} to {raised:g}: {k:g} requests were stopped at the cap while "
        f"finished requests used up to {need:g} rounds, so the cap cuts into real work; how many rounds "
        "the stopped ones needed is unknown (at least "
        f"{cap + 1:g}), so check again after a window at the new cap",
    )


def recommend_retained(peaks: Distribution, censored: Censored) -> Recommendation:
    """``max_retained_bytes`` from the peak histogram and the requests refused at the limit.

    Same rules as `recommend_iters`; refused requests' recorded peaks cannot be told apart from
    the others, so "the largest observed peak" includes them (conservative)."""
    cap, k = censored.cap, censored.count
    need = peaks.maximum()
    fits = _round_up_bytes(need * HEADROOM)
    if k <= 0:
        return Recommendation(
            fits, f"no request was refused at the limit; the largest peak was {need / MIB:.3f} MiB, +25 %"
        )
    if need <= RUNAWAY_FRACTION * cap:
        return Recommendation(
            cap,
            f"keeping max_retained_bytes={int(cap)}: the {k:g} requests refused at it look like outliers "
            f"(every other peak was at most {need / MIB:.3f} MiB, under {RUNAWAY_FRACTION:.0%} of the limit); "
            "raising it would only admit them",
        )
    raised = _round_up_bytes(max(fits, 2 * cap))
    return Recommendation(
        raised,
        f"raising max_retained_bytes from {int(cap)} to {raised}: {k:g} requests were refused while others "
        f"peaked at up to {need / MIB:.3f} MiB; how much the refused ones needed is unknown (more than "
        "the limit), so check again after a window at the new limit",
    )


@dataclasses.dataclass(frozen=True)
class MemoryInputs:
    """What memory sizing reads (bytes unless said): the peak of the live ledger sum per target
    (None: not sampled, no scrape fell while a request was served), the admission pool per target
    (all its `workers`), the largest worker's peak RSS and baseline RSS, the peak share of the
    pool reserved, and admission cap hits (503 refusals)."""

    inflight_retained_peak: float | None
    pool_bytes: float
    workers: int
    rss_peak: float
    rss_baseline: float
    pool_fill_peak: float
    admission_refusals: float


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Recommended `workers` per target, `memory_per_worker` and the admission pool per worker
    (`pool_per_worker`, ``--max-inflight-retained-bytes``), bytes, with the lines explaining them."""

    workers: int
    memory_per_worker: int
    pool_per_worker: int
    lines: tuple[str, ...]


def plan_memory(m: MemoryInputs, max_retained_bytes: float) -> MemoryPlan:
    """Size workers and their memory from what was observed (bytes; `max_retained_bytes` is the
    recommended per-request limit).

    Workers: enough that the admission pool's peak fill stays under `POOL_TARGET_FILL`, one more
    when admission refused requests. Ledger need per worker: the peak live ledger sum over the
    workers x `MEMORY_MARGIN` (not sampled: 0, and the line says so), at least one request at
    `max_retained_bytes`. Memory per worker: the larger of the observed peak RSS and baseline RSS + ledger need, x `MEMORY_MARGIN`. The
    pool per worker is what that memory holds beyond the baseline, so ledgers cannot outgrow it."""
    workers = max(1, math.ceil(m.workers * m.pool_fill_peak / POOL_TARGET_FILL))
    if m.admission_refusals > 0:
        workers = max(workers, m.workers + 1)
    peak = m.inflight_retained_peak
    ledger_need = max((peak or 0.0) / workers * MEMORY_MARGIN, max_retained_bytes)
    need = max(m.rss_peak, m.rss_baseline + ledger_need)
    memory = int(math.ceil(need * MEMORY_MARGIN / MIB) * MIB)
    pool = int(memory - m.rss_baseline)
    current_pool = m.pool_bytes / max(1, m.workers)
    if peak is None:
        sampled = (
            "peak live ledger sum not sampled (no scrape of loopwarden_inflight_retained_bytes fell while a"
            " request was served: use a longer window or a shorter scrape interval)"
        )
        fill = "peak fill not sampled"
    else:
        sampled = f"peak live ledger sum {peak / MIB:.2f} MiB"
        fill = f"peak fill {100 * m.pool_fill_peak:.1f} %"
    lines = [
        f"{sampled} over {m.workers} worker(s); admission pool {current_pool / MIB:.1f} MiB per worker, {fill}"
        f" (more workers above {POOL_TARGET_FILL:.0%}), {m.admission_refusals:g} admission refusals",
        f"worker RSS: baseline {m.rss_baseline / MIB:.1f} MiB (before any request), peak {m.rss_peak / MIB:.1f} MiB",
        f"memory per worker = max(peak RSS {m.rss_peak / MIB:.1f}, baseline {m.rss_baseline / MIB:.1f} + ledger need"
        f" {ledger_need / MIB:.1f} MiB) x {MEMORY_MARGIN:g} margin = {memory / MIB:.0f} MiB; ledger need = max(peak"
        f" ledger sum per worker x {MEMORY_MARGIN:g}, one request at max_retained_bytes)",
        f"admission pool per worker (--max-inflight-retained-bytes): {pool} ({pool / MIB:.0f} MiB, the memory"
        " beyond the baseline)",
    ]
    if current_pool > pool:
        lines.append(
            f"  the current pool ({current_pool / MIB:.0f} MiB per worker) lets ledgers charge more than this memory"
            " holds: lower --max-inflight-retained-bytes, or give each worker more memory"
        )
    return MemoryPlan(workers, memory, pool, tuple(lines))


def table(dist: Distribution, censored: Censored, candidates: Sequence[float]) -> list[StopShare]:
    """`stop_share` for each candidate limit, in order."""
    return [stop_share(dist, censored, c) for c in candidates]
