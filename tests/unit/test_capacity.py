"""The capacity arithmetic (issue 20, item 1): stopped shares with censored requests, recommendations.

Property tests simulate populations whose needs are known, record them as the gateway would
(a request over the cap is stopped and recorded at the cap, or with a peak somewhere under it),
histogram them with the app's own bucket bounds, and check `stop_share` and the recommendations
against the known answer.
"""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.ops import capacity as cap
from middleware.ops import capacity_data
from middleware.ops.capacity import Censored, Distribution, stop_share
from middleware.ops.metrics import RETAINED_BYTES_BUCKETS, ROUNDS_BUCKETS
from tests.servers import serve_asgi

EPS = 1e-9


def histogram(values: list[float], bounds: tuple[float, ...]) -> Distribution:
    """Cumulative counts of `values` per bound, +Inf last (what Prometheus' buckets hold)."""
    return Distribution(
        tuple((b, float(sum(v <= b for v in values))) for b in (*bounds, math.inf)),
    )


def record_rounds(needs: list[int], cap_: int) -> tuple[Distribution, Censored]:
    """A request needing more than the cap is stopped at it and recorded with the cap (the loop)."""
    recorded = [float(min(n, cap_)) for n in needs]
    return histogram(recorded, ROUNDS_BUCKETS), Censored(sum(n > cap_ for n in needs), cap_, at_cap=True)


needs_rounds = st.lists(st.integers(1, 40), min_size=1, max_size=200)


@settings(max_examples=200, deadline=None)
@given(needs=needs_rounds, cap_=st.integers(1, 30))
def test_rounds_share_is_exact_below_the_cap_and_brackets_the_truth_above(
    needs: list[int], cap_: int
) -> None:
    dist, censored = record_rounds(needs, cap_)
    n = len(needs)
    for limit in range(1, 101):
        truth = sum(x > limit for x in needs) / n
        share = stop_share(dist, censored, limit)
        assert share.low - EPS <= truth <= share.high + EPS, (limit, share, truth)
        if limit <= cap_ or censored.count == 0:
            assert share.exact and math.isclose(share.low, truth, abs_tol=EPS), (limit, share, truth)
        else:  # above the cap: only the stopped requests are in doubt
            assert math.isclose(share.high - share.low, censored.count / n, abs_tol=EPS)


@settings(max_examples=150, deadline=None)
@given(
    needs=st.lists(st.integers(1, 2**28), min_size=1, max_size=150),
    cap_index=st.integers(8, len(RETAINED_BYTES_BUCKETS) - 1),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=150, max_size=150),
)
def test_retained_share_brackets_the_truth_when_refused_peaks_lie_anywhere_under_the_limit(
    needs: list[int], cap_index: int, fractions: list[float]
) -> None:
    limit_now = RETAINED_BYTES_BUCKETS[cap_index]
    # a refused request is recorded with the peak it reached before the refused charge
    recorded = [float(x) if x <= limit_now else f * limit_now for x, f in zip(needs, fractions, strict=False)]
    k = sum(x > limit_now for x in needs)
    dist = histogram(recorded, RETAINED_BYTES_BUCKETS)
    censored = Censored(k, limit_now, at_cap=False)
    for candidate in RETAINED_BYTES_BUCKETS[::3]:
        truth = sum(x > candidate for x in needs) / len(needs)
        share = stop_share(dist, censored, candidate)
        assert share.low - EPS <= truth <= share.high + EPS, (candidate, share, truth)
        assert share.high - share.low <= k / len(needs) + EPS
        if k == 0 or candidate == limit_now:
            assert share.exact and math.isclose(share.low, truth, abs_tol=EPS)


def test_the_issue_example_126_requests_12_stopped_at_10() -> None:
    """The bug report: 12 of 126 stopped with 508 at max_infer_iters=10 were reported as 0.00 %."""
    needs = [2] * 60 + [3] * 54 + [1000] * 12  # the 12 loop until stopped
    dist, censored = record_rounds(needs, 10)
    assert censored.count == 12 and dist.count == 126
    at_10 = stop_share(dist, censored, 10)
    assert at_10.exact and f"{100 * at_10.low:.2f}" == "9.52"
    at_20 = stop_share(dist, censored, 20)
    assert (at_20.low, round(at_20.high, 4)) == (0.0, round(12 / 126, 4)) and at_20.text() == "0.00 .. 9.52 %"
    assert stop_share(dist, censored, 2).low == (54 + 12) / 126
    rec = cap.recommend_iters(dist, censored)
    assert rec.value == 10, rec  # never raised silently: they look like runaway loops
    assert "runaway" in rec.reason and "keeping max_infer_iters=10" in rec.reason


@settings(max_examples=150, deadline=None)
@given(needs=needs_rounds, cap_=st.integers(2, 30))
def test_rounds_recommendation_never_silently_raises_a_cap_and_fits_every_finished_request(
    needs: list[int], cap_: int
) -> None:
    dist, censored = record_rounds(needs, cap_)
    rec = cap.recommend_iters(dist, censored)
    finished = [x for x in needs if x <= cap_]
    if censored.count == 0:
        assert rec.value >= max(needs) and rec.value <= max(1, math.ceil(max(needs) * cap.HEADROOM))
        assert stop_share(dist, censored, rec.value).high == 0.0
    elif not finished or max(finished) <= cap.RUNAWAY_FRACTION * cap_:
        assert rec.value == cap_ and "runaway" in rec.reason
    else:
        assert rec.value > cap_ and rec.reason.startswith(f"raising max_infer_iters from {cap_}")
        assert "unknown" in rec.reason
    assert rec.value <= cap.MAX_ITERS


def test_retained_recommendation_fits_the_largest_peak_and_keeps_a_limit_against_outliers() -> None:
    mib = cap.MIB
    peaks = [0.5 * mib] * 90 + [3 * mib] * 10
    dist = histogram(peaks, RETAINED_BYTES_BUCKETS)
    rec = cap.recommend_retained(dist, Censored(0, 64 * mib, at_cap=False))
    assert rec.value == 4 * mib  # 3 MiB x 1.25 = 3.75 -> whole MiB
    refused = cap.recommend_retained(dist, Censored(5, 64 * mib, at_cap=False))
    assert refused.value == 64 * mib and "keeping max_retained_bytes=67108864" in refused.reason
    near = histogram([60 * mib] * 10, RETAINED_BYTES_BUCKETS)
    raised = cap.recommend_retained(near, Censored(5, 64 * mib, at_cap=False))
    assert raised.value == 128 * mib and "unknown" in raised.reason


def test_memory_plan_says_not_sampled_rather_than_a_zero_peak() -> None:
    """A short run between two scrapes: every scrape of the live ledger sum read 0."""
    mib = cap.MIB
    m = cap.MemoryInputs(None, 512 * mib, 1, 90 * mib, 80 * mib, 0.0, admission_refusals=0)
    plan = cap.plan_memory(m, 8 * mib)
    assert plan.lines[0].startswith("peak live ledger sum not sampled (no scrape of"), plan.lines[0]
    assert "0.00 MiB" not in plan.lines[0] and "peak fill not sampled" in plan.lines[0]
    assert plan.memory_per_worker == math.ceil(max(90, 80 + 8) * 1.25) * mib  # one request at the limit
    sampled = cap.plan_memory(cap.MemoryInputs(3 * mib, 512 * mib, 1, 90 * mib, 80 * mib, 0.0, 0), 8 * mib)
    assert sampled.lines[0].startswith("peak live ledger sum 3.00 MiB over 1 worker(s)")


def _scripted_prometheus(inflight: float) -> Any:
    """A scripted Prometheus query API (a stand-in, like the model server): every instant query
    answers one sample, ``inflight`` for the live ledger sum's ``max_over_time``, else 1."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        query = parse_qs(scope["query_string"].decode())["query"][0]
        value = inflight if "loopwarden_inflight_retained_bytes" in query else 1.0
        body = {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, str(value)]}]},
        }
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    return serve_asgi(app, lifespan="off")


@pytest.mark.parametrize(("scraped", "peak"), [(0.0, None), (2.5 * cap.MIB, 2.5 * cap.MIB)])
def test_a_zero_live_ledger_peak_over_a_window_with_requests_is_not_sampled(
    scraped: float, peak: float | None
) -> None:
    with _scripted_prometheus(scraped) as url, httpx.Client(timeout=10) as client:
        m = capacity_data._memory_inputs(client, url, "5m", 1)
    assert m.inflight_retained_peak == peak


def test_memory_plan_states_workers_memory_and_margin() -> None:
    mib = cap.MIB
    m = cap.MemoryInputs(
        inflight_retained_peak=300 * mib,
        pool_bytes=2048 * mib,
        workers=2,
        rss_peak=400 * mib,
        rss_baseline=80 * mib,
        pool_fill_peak=0.9,
        admission_refusals=0,
    )
    plan = cap.plan_memory(m, 64 * mib)
    assert plan.workers == 3  # ceil(2 x 0.9 / 0.8)
    # ledger need: max(300 / 3 x 1.25, 64) = 125 MiB; max(400, 80 + 125) x 1.25 = 500 MiB
    assert plan.memory_per_worker == 500 * mib and plan.pool_per_worker == 420 * mib
    assert "x 1.25 margin = 500 MiB" in plan.lines[2]
    assert "lets ledgers charge more than this memory holds" in plan.lines[-1]  # 1024 MiB per worker now
    small = cap.plan_memory(
        cap.MemoryInputs(0, 512 * mib, 1, 90 * mib, 80 * mib, 0.1, admission_refusals=3), 8 * mib
    )
    assert small.workers == 2  # refusals: one more worker
    assert small.memory_per_worker == math.ceil(max(90, 80 + 8) * 1.25) * mib
