"""The app's metric definitions agree with the dashboards' single source of truth."""

from __future__ import annotations

from dashboards import queries
from middleware.ops import metrics


def test_buckets_match_the_dashboards() -> None:
    assert tuple(metrics.RETAINED_BYTES_BUCKETS) == tuple(queries.RETAINED_BYTES_BUCKETS)
    assert tuple(metrics.UTILIZATION_BUCKETS) == tuple(queries.UTILIZATION_BUCKETS)
    assert tuple(metrics.LATENCY_BUCKETS) == tuple(queries.LATENCY_BUCKETS)
    assert tuple(metrics.ROUNDS_BUCKETS) == tuple(queries.ROUNDS_BUCKETS)


def test_stream_error_codes_match_the_dashboards() -> None:
    assert frozenset(queries.STREAM_ERROR_CODES) == metrics.STREAM_ERROR_CODES
    assert metrics.stream_error_label("overloaded_error") == "upstream_error"
    assert metrics.stream_error_label("max_infer_iters_exceeded") == "max_infer_iters_exceeded"


def test_preinitialised_label_sets_match_the_dashboards() -> None:
    assert tuple(metrics.CAP_HIT_PAIRS) == tuple(queries.CAP_HIT_PAIRS)
    assert tuple(metrics.TOOL_OUTCOMES) == tuple(queries.TOOL_OUTCOMES)
    assert tuple(metrics.UPSTREAM_ERROR_KINDS) == tuple(queries.UPSTREAM_ERROR_KINDS)
