"""Every PromQL expression the dashboards and alerts use, checked against the metric contract.

The metric contract of DESIGN.md §8 (metric names, types, label names and allowed label values,
histogram bucket bounds: `METRICS`, `CAP_LIMITS`, `RETAINED_BYTES_BUCKETS`, ...) is defined once,
in `middleware.ops.metrics`, where the app creates its Prometheus metrics from it; this module
re-exports it (dashboards import middleware, never the reverse). What this module defines:

* the PromQL of every dashboard panel (`QUERIES`) and alert rule (`ALERTS`), so a live check
  against a real Prometheus can run them all (`all_expressions`), after `substitute`;
* `contract_problems`, which finds where an expression breaks the contract (what Prometheus
  would answer with zero series instead of an error);
* the series a query may select (`series_names`, `STANDARD_METRICS`, `TARGET_LABELS`) and the
  dashboard variables and alert thresholds.

Of the app it imports only `middleware.ops.metrics` (and so prometheus-client); nothing is
computed at import beyond constants.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from dashboards.promql import go_float, le_regex, selectors, substitute
from middleware.ops.metrics import (
    CAP_HIT_PAIRS,
    CAP_LIMITS,
    CAP_OUTCOMES,
    HTTP_STATUSES,
    LATENCY_BUCKETS,
    METRICS,
    OTHER_MODEL,
    RETAINED_BYTES_BUCKETS,
    ROUNDS_BUCKETS,
    STREAM_ERROR_CODES,
    TOOL_OUTCOMES,
    UPSTREAM_ERROR_KINDS,
    UTILIZATION_BUCKETS,
    MetricSpec,
    MetricType,
)

__all__ = [
    "ALERTS",
    "CANDIDATE_INFER_ITERS",
    "CANDIDATE_RETAINED_LIMITS",
    "CAP_HIT_PAIRS",
    "CAP_LIMITS",
    "CAP_OUTCOMES",
    "DASHBOARD_VARIABLES",
    "DEFAULT_MAX_RETAINED_BYTES",
    "HTTP_STATUSES",
    "JOB_VARIABLE_METRIC",
    "LATENCY_BUCKETS",
    "METRICS",
    "OTHER_MODEL",
    "QUANTILES",
    "QUERIES",
    "RETAINED_BYTES_BUCKETS",
    "ROUNDS_BUCKETS",
    "STANDARD_METRICS",
    "STREAM_ERROR_CODES",
    "TARGET_LABELS",
    "TOOL_OUTCOMES",
    "UPSTREAM_ERROR_KINDS",
    "UTILIZATION_BUCKETS",
    "WORKER_MEMORY_BYTES",
    "Alert",
    "Expression",
    "MetricSpec",
    "MetricType",
    "Query",
    "all_expressions",
    "contract_problems",
    "series_names",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Labels Prometheus attaches to every scraped series (allowed in any matcher or grouping).
TARGET_LABELS: tuple[str, ...] = ("job", "instance")


#: Standard series the dashboards may use beside §8: Prometheus' own ``up`` and the
#: prometheus-client process collector. Not exported in the client's multiprocess mode.
STANDARD_METRICS: Mapping[str, MetricType] = {
    "up": "gauge",
    "process_resident_memory_bytes": "gauge",
}


def series_names() -> Mapping[str, str]:
    """Every series name a query may select, mapped to the metric family it belongs to.

    Counters and gauges are selected by their name; a histogram only through its ``_bucket``,
    ``_count`` and ``_sum`` series.
    """
    names: dict[str, str] = {}
    for spec in METRICS.values():
        if spec.type == "histogram":
            for suffix in ("_bucket", "_count", "_sum"):
                names[spec.name + suffix] = spec.name
        else:
            names[spec.name] = spec.name
    for name in STANDARD_METRICS:
        names[name] = name
    return names


# --- dashboard variables -----------------------------------------------------------------------

#: The default ``max_retained_bytes`` (DESIGN.md §3): 64 MiB.
DEFAULT_MAX_RETAINED_BYTES = 64 * MiB
#: The memory one scrape target (all its workers) may use: the line "worker memory" on the
#: capacity dashboard and the threshold of `LoopwardenInflightRetainedNearWorkerMemory`. Set it to
#: your container's memory limit and rerun ``python -m dashboards.generate``.
WORKER_MEMORY_BYTES = 2 * GiB
#: Candidate ``max_retained_bytes`` values for "share of requests each limit would reject";
#: each is a bound in `RETAINED_BYTES_BUCKETS`.
CANDIDATE_RETAINED_LIMITS: tuple[int, ...] = (4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB)
#: Candidate ``max_infer_iters`` values; each is a bound in `ROUNDS_BUCKETS`.
CANDIDATE_INFER_ITERS: tuple[int, ...] = (3, 5, 10, 20)
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
#: The metric whose ``job`` label values feed the ``job`` variable.
JOB_VARIABLE_METRIC = "loopwarden_requests_total"

#: Dashboard variables and the value each gets outside Grafana (validation, the live check):
#: ``job`` matches every job; the others take their default.
#: The default ``max_infer_iters`` (DESIGN.md §3).
DEFAULT_MAX_INFER_ITERS = 10

DASHBOARD_VARIABLES: Mapping[str, str] = {
    "job": ".+",
    "max_retained_bytes": str(DEFAULT_MAX_RETAINED_BYTES),
    "max_infer_iters": str(DEFAULT_MAX_INFER_ITERS),
    "worker_memory_bytes": str(WORKER_MEMORY_BYTES),
}


# --- expressions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One dashboard query: PromQL with Grafana macros, its legend, and when it may be empty.

    `may_be_empty` is ``""`` when a running gateway must always give the query a series (for
    example a counter without labels, a gauge, or a label set the app pre-initialises), else
    the reason it can legitimately return nothing.
    """

    key: str
    expr: str
    legend: str = ""
    may_be_empty: str = ""


def _sel(metric: str, *matchers: str) -> str:
    """``metric{job=~"$job", ...}``: every dashboard selector follows the ``job`` variable."""
    return metric + "{" + ", ".join(('job=~"$job"', *matchers)) + "}"


def _rate(metric: str, *matchers: str, window: str = "$__rate_interval") -> str:
    return f"rate({_sel(metric, *matchers)}[{window}])"


def _quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({_rate(histogram + '_bucket')}))"


def _share_above(histogram: str, bound: float, window: str, fn: str = "increase") -> str:
    """Share of observations above `bound` (which must be a bucket bound) over `window`."""
    bucket = _sel(histogram + "_bucket", f'le=~"{le_regex(bound)}"')
    count = _sel(histogram + "_count")
    return f"1 - sum({fn}({bucket}[{window}])) / sum({fn}({count}[{window}]))"


def _stopped_share(histogram: str, limit_name: str, bound: float, *, high: bool) -> str:
    """At least (`high` False) / at most (True) the share of requests a cap of `bound` would have
    stopped over ``$__range``, counting the requests the current cap ``$<limit_name>`` stopped as
    censored: they needed more than it (``middleware.ops.capacity``, which ``loopwarden capacity``
    uses). Rounds' censored requests are recorded at the cap itself; retained bytes' anywhere under
    it. `bound` must be a bucket bound."""
    n = f"sum(increase({_sel(histogram + '_count')}[$__range]))"
    le = _sel(histogram + "_bucket", f'le=~"{le_regex(bound)}"')
    above = f"({n} - sum(increase({le}[$__range])))"
    hits = _sel("loopwarden_cap_hits_total", 'limit="' + limit_name + '"')
    k = f"sum(increase({hits}[$__range]))"
    current = f"${limit_name}"
    b = f"{bound:g}" if bound < 1e6 else str(int(bound))
    if limit_name == "max_infer_iters":
        count = (
            f"{above} + {k} * ({b} >= bool {current})" if high else f"{above} + {k} * ({b} == bool {current})"
        )
    elif high:
        count = f"clamp_max({above} + {k}, scalar({n}))"
    else:
        count = f"clamp_min({above} + {k} * ({b} == bool {current}), scalar({k}) * ({b} < bool {current}))"
    return f"({count}) / {n}"


def _mib(value: int) -> str:
    return f"{value // MiB} MiB"


_NOT_2XX = 'status!~"2.."'
_NOT_MAX_TOOL_CALLS = 'limit!="max_tool_calls"'
_CENSORING_LIMITS = 'limit=~"max_retained_bytes|max_infer_iters"'
_CAP_STATUSES = 'status=~"413|502|508"'
_TOOL_NOT_OK = 'outcome!="ok"'
_NOT_PREINIT = "empty until a request produces this label set, unless the app pre-initialises it"
_MULTIPROCESS = "prometheus-client's multiprocess mode (--workers > 1) exports no process_* metrics"

_QUERY_LIST: list[Query] = [
    # traffic
    Query(
        "requests_by_status",
        f"sum by (status) ({_rate('loopwarden_requests_total')})",
        "{{status}}",
        may_be_empty="empty until the first request is answered",
    ),
    Query(
        "requests_by_model",
        f"sum by (model) ({_rate('loopwarden_requests_total')})",
        "{{model}}",
        may_be_empty="empty until the first request is answered",
    ),
    Query(
        "non_2xx_ratio",
        f"sum({_rate('loopwarden_requests_total', _NOT_2XX)}) / sum({_rate('loopwarden_requests_total')})",
        "non-2xx share",
        may_be_empty="empty until a non-2xx answer",
    ),
    Query("targets_up", 'sum(up{job=~"$job"})', "targets up"),
    Query("targets_total", 'count(up{job=~"$job"})', "targets"),
    Query("inflight_requests", f"sum by (instance) ({_sel('loopwarden_inflight_requests')})", "{{instance}}"),
    Query("client_disconnects", f"sum({_rate('loopwarden_client_disconnects_total')})", "client disconnects"),
    Query(
        "dropped_writes",
        f"sum({_rate('loopwarden_dropped_writes_total')})",
        "dropped writes (closing connection)",
    ),
    Query(
        "retry_shield_hits",
        f"sum({_rate('loopwarden_retry_shield_hits_total')})",
        "retry shield hits",
    ),
    Query(
        "background_tasks_by_instance",
        f"sum by (instance) ({_sel('loopwarden_background_tasks')})",
        "{{instance}}",
    ),
    Query(
        "background_outcomes",
        f"sum by (outcome) ({_rate('loopwarden_background_outcomes_total')})",
        "{{outcome}}",
    ),
    # cap hits and failures
    Query(
        "cap_hits_by_limit_outcome",
        f"sum by (limit, outcome) ({_rate('loopwarden_cap_hits_total')})",
        "{{limit}} → {{outcome}}",
        may_be_empty=_NOT_PREINIT,
    ),
    Query(
        "cap_hit_ratio",
        f"sum({_rate('loopwarden_cap_hits_total', _NOT_MAX_TOOL_CALLS)})"
        f" / sum({_rate('loopwarden_requests_total')})",
        "cap hits per request (max_tool_calls excluded)",
        may_be_empty=_NOT_PREINIT,
    ),
    Query(
        "status_413_502_508",
        f"sum by (status) ({_rate('loopwarden_requests_total', _CAP_STATUSES)})",
        "HTTP {{status}}",
        may_be_empty="empty until a 413, 502 or 508 is answered",
    ),
    Query(
        "sse_errors",
        f"sum({_rate('loopwarden_stream_errors_total')})",
        "SSE error frames (after commit)",
        may_be_empty=_NOT_PREINIT,
    ),
    Query(
        "sse_errors_by_code",
        f"sum by (code) ({_rate('loopwarden_stream_errors_total')})",
        "{{code}}",
        may_be_empty=_NOT_PREINIT,
    ),
    # WebSocket mode
    Query(
        "websocket_connections",
        f"sum by (instance) ({_sel('loopwarden_websocket_connections')})",
        "{{instance}}",
    ),
    Query(
        "websocket_turns_by_outcome",
        f"sum by (outcome) ({_rate('loopwarden_websocket_turns_total')})",
        "{{outcome}}",
        may_be_empty=_NOT_PREINIT,
    ),
    Query(
        "cap_hits_by_transport",
        f"sum by (transport, limit) ({_rate('loopwarden_cap_hits_total')})",
        "{{transport}}: {{limit}}",
        may_be_empty=_NOT_PREINIT,
    ),
    # tools
    Query(
        "tool_calls_by_outcome",
        f"sum by (outcome) ({_rate('loopwarden_tool_calls_total')})",
        "{{outcome}}",
        may_be_empty=_NOT_PREINIT,
    ),
    Query(
        "tool_failure_ratio",
        f"sum by (outcome) ({_rate('loopwarden_tool_calls_total', _TOOL_NOT_OK)})"
        f" / ignoring (outcome) group_left sum({_rate('loopwarden_tool_calls_total')})",
        "{{outcome}}",
        may_be_empty=_NOT_PREINIT,
    ),
    *(
        Query(
            f"tool_duration_p{round(q * 100)}",
            _quantile(q, "loopwarden_tool_call_duration_seconds"),
            f"p{round(q * 100)}",
        )
        for q in QUANTILES
    ),
    # compaction
    Query(
        "compactions_by_mode_outcome",
        f"sum by (mode, outcome) ({_rate('loopwarden_compactions_total')})",
        "{{mode}} → {{outcome}}",
    ),
    # Chat Completions upstreams (issue 25)
    Query(
        "translation_failures_by_reason",
        f"sum by (reason) ({_rate('loopwarden_translation_failures_total')})",
        "{{reason}}",
    ),
    # upstream
    Query(
        "upstream_errors_by_kind",
        f"sum by (kind) ({_rate('loopwarden_upstream_errors_total')})",
        "{{kind}}",
        may_be_empty=_NOT_PREINIT,
    ),
    *(
        Query(
            f"upstream_duration_p{round(q * 100)}",
            _quantile(q, "loopwarden_upstream_duration_seconds"),
            f"p{round(q * 100)}",
        )
        for q in QUANTILES
    ),
    *(
        Query(
            f"upstream_ttfb_p{round(q * 100)}",
            _quantile(q, "loopwarden_upstream_ttfb_seconds"),
            f"p{round(q * 100)}",
        )
        for q in QUANTILES
    ),
    # capacity: retained bytes
    *(
        Query(
            f"retained_peak_p{round(q * 100)}",
            _quantile(q, "loopwarden_retained_bytes_peak"),
            f"p{round(q * 100)}",
        )
        for q in QUANTILES
    ),
    Query(
        "retained_peak_mean",
        f"sum({_rate('loopwarden_retained_bytes_peak_sum')}) / sum({_rate('loopwarden_retained_bytes_peak_count')})",
        "mean",
    ),
    Query("max_retained_bytes", "vector($max_retained_bytes)", "max_retained_bytes (configured)"),
    Query(
        "utilization_heatmap",
        f"sum by (le) (increase({_sel('loopwarden_retained_utilization_ratio_bucket')}[$__rate_interval]))",
        "{{le}}",
    ),
    *(
        Query(
            f"utilization_over_{round(bound * 100)}",
            _share_above("loopwarden_retained_utilization_ratio", bound, "$__rate_interval", fn="rate"),
            f"over {round(bound * 100)}% of the limit",
        )
        for bound in (0.5, 0.9)
    ),
    *(
        Query(
            f"rejected_at_{limit // MiB}mib{suffix}",
            _stopped_share("loopwarden_retained_bytes_peak", "max_retained_bytes", limit, high=high),
            f"max_retained_bytes = {_mib(limit)}{legend}",
        )
        for limit in CANDIDATE_RETAINED_LIMITS
        for suffix, high, legend in (("", False, " (at least)"), ("_max", True, " (at most)"))
    ),
    Query(
        "censored_share",
        f"sum by (limit) (increase({_sel('loopwarden_cap_hits_total', _CENSORING_LIMITS)}[$__range]))"
        f" / scalar(sum(increase({_sel('loopwarden_retained_bytes_peak_count')}[$__range])))",
        "stopped at the current {{limit}} (need unknown)",
    ),
    # capacity: rounds
    *(
        Query(f"rounds_p{round(q * 100)}", _quantile(q, "loopwarden_inference_rounds"), f"p{round(q * 100)}")
        for q in QUANTILES
    ),
    Query(
        "rounds_mean",
        f"sum({_rate('loopwarden_inference_rounds_sum')}) / sum({_rate('loopwarden_inference_rounds_count')})",
        "mean",
    ),
    *(
        Query(
            f"rejected_at_{iters}_iters{suffix}",
            _stopped_share("loopwarden_inference_rounds", "max_infer_iters", iters, high=high),
            f"max_infer_iters = {iters}{legend}",
        )
        for iters in CANDIDATE_INFER_ITERS
        for suffix, high, legend in (("", False, " (at least)"), ("_max", True, " (at most)"))
    ),
    # capacity: memory
    Query(
        "inflight_retained_by_instance",
        f"sum by (instance) ({_sel('loopwarden_inflight_retained_bytes')})",
        "{{instance}} retained (live ledgers)",
    ),
    Query(
        "resident_memory_by_instance",
        f"max by (instance) ({_sel('loopwarden_worker_resident_memory_bytes')})",
        "{{instance}} largest worker RSS",
    ),
    Query(
        "baseline_memory_by_instance",
        f"max by (instance) ({_sel('loopwarden_worker_baseline_resident_memory_bytes')})",
        "{{instance}} worker RSS at start (baseline)",
    ),
    Query("worker_memory", "vector($worker_memory_bytes)", "worker memory (WORKER_MEMORY_BYTES)"),
    Query(
        "inflight_retained_share",
        f"sum by (instance) ({_sel('loopwarden_inflight_retained_bytes')}) / $worker_memory_bytes",
        "{{instance}}",
    ),
    # capacity: admission
    Query(
        "admission_reserved_by_instance",
        f"sum by (instance) ({_sel('loopwarden_admission_reserved_bytes')})",
        "{{instance}} reserved",
    ),
    Query(
        "admission_budget_by_instance",
        f"sum by (instance) ({_sel('loopwarden_admission_budget_bytes')})",
        "{{instance}} admission pool",
    ),
    Query(
        "memory_pressure_by_instance",
        f"max by (instance) ({_sel('loopwarden_memory_pressure_ratio')})",
        "{{instance}}",
    ),
]

#: Every dashboard query by key (PromQL with Grafana macros; see `substitute`).
QUERIES: Mapping[str, Query] = {query.key: query for query in _QUERY_LIST}


@dataclass(frozen=True)
class Alert:
    """One Prometheus alerting rule.

    `expr` fires the alert; `signal` is the same measurement without threshold or traffic
    guard (what the live check expects to return series, and what to graph when tuning).
    `summary` and `description` may use Prometheus' alert templates.
    """

    name: str
    expr: str
    signal: str
    for_: str
    severity: Literal["warning", "critical"]
    summary: str
    description: str
    signal_may_be_empty: str = ""


#: Alerts on ratios need some traffic: under this many requests per second (15 per 5 min) one
#: cap hit is already a large share.
MIN_REQUEST_RATE = 0.05
CAP_HIT_RATIO_THRESHOLD = 0.05
LOOP_DETECTED_THRESHOLD = 10
UPSTREAM_TIMEOUT_RATIO_THRESHOLD = 0.02
SSE_ERROR_RATIO_THRESHOLD = 0.02
WORKER_MEMORY_FRACTION = 0.8

_REQUEST_RATE = "sum by (job) (rate(loopwarden_requests_total[5m]))"
_OK_RATE = 'sum by (job) (rate(loopwarden_requests_total{status="200"}[5m]))'


def _ratio(numerator: str, denominator: str) -> str:
    return f"{numerator}\n/\n{denominator}"


def _guarded(signal: str, threshold: float, guard: str) -> str:
    """`signal` above `threshold`, only while `guard` (a request rate) shows enough traffic."""
    indented = signal.replace("\n", "\n  ")
    return f"(\n  {indented}\n) > {threshold}\nand\n{guard} > {MIN_REQUEST_RATE}"


_CAP_HIT_RATIO = _ratio(
    'sum by (job) (rate(loopwarden_cap_hits_total{limit!="max_tool_calls"}[5m]))', _REQUEST_RATE
)
_LOOP_DETECTED = 'sum by (job) (increase(loopwarden_cap_hits_total{limit="max_infer_iters"}[5m]))'
_UPSTREAM_TIMEOUT_RATIO = _ratio(
    'sum by (job) (rate(loopwarden_upstream_errors_total{kind="timeout"}[5m]))', _REQUEST_RATE
)
_SSE_ERROR_RATIO = _ratio("sum by (job) (rate(loopwarden_stream_errors_total[5m]))", _OK_RATE)
_INFLIGHT_RETAINED = "max by (job, instance) (loopwarden_inflight_retained_bytes)"
_INTERNAL_ERRORS = 'sum by (job) (increase(loopwarden_requests_total{status="500"}[10m]))'


ALERTS: tuple[Alert, ...] = (
    Alert(
        name="LoopwardenCapHitRatioHigh",
        expr=_guarded(_CAP_HIT_RATIO, CAP_HIT_RATIO_THRESHOLD, _REQUEST_RATE),
        signal=_CAP_HIT_RATIO,
        for_="10m",
        severity="warning",
        summary="{{ $value | humanizePercentage }} of requests on {{ $labels.job }} hit a loopwarden cap",
        description=(
            f"Over 5 m more than {CAP_HIT_RATIO_THRESHOLD:.0%} of requests were stopped or cut by a limit"
            " (max_tool_calls, the client's own choice, is not counted). The operations dashboard's"
            " 'Cap hits by limit and outcome' shows which limit. max_retained_bytes: check the capacity"
            " dashboard (peak retained bytes, 'Requests each max_retained_bytes would reject') and raise"
            " --max-retained-bytes or the model's override only if legitimate traffic is rejected."
            " request_body: clients send bodies over max_retained_bytes // 32. max_infer_iters: see"
            " LoopwardenLoopDetectedSpike. tool_timeout: a gateway tool (MCP server) is slow or down."
            " admission: the process pool is full; add workers or instances."
        ),
        signal_may_be_empty=_NOT_PREINIT,
    ),
    Alert(
        name="LoopwardenLoopDetectedSpike",
        expr=f"{_LOOP_DETECTED} > {LOOP_DETECTED_THRESHOLD}",
        signal=_LOOP_DETECTED,
        for_="2m",
        severity="warning",
        summary="{{ $value | humanize }} requests on {{ $labels.job }} hit max_infer_iters in 5 m (508 / SSE error)",
        description=(
            "Models keep calling gateway tools after max_infer_iters inference calls: runaway tool loops,"
            " answered with 508 or an SSE error frame max_infer_iters_exceeded. Find the model on"
            " 'Requests by model' and the failing tool on 'Tool calls by outcome'; a tool that keeps"
            " failing or a looping prompt is the usual cause, fix that first. Raise --max-infer-iters"
            " (or the model's override, 1..=100) only if the capacity dashboard's 'Rounds per request'"
            " shows that legitimate requests need more rounds."
        ),
        signal_may_be_empty=_NOT_PREINIT,
    ),
    Alert(
        name="LoopwardenUpstreamTimeouts",
        expr=_guarded(_UPSTREAM_TIMEOUT_RATIO, UPSTREAM_TIMEOUT_RATIO_THRESHOLD, _REQUEST_RATE),
        signal=_UPSTREAM_TIMEOUT_RATIO,
        for_="10m",
        severity="warning",
        summary="{{ $value | humanizePercentage }} of requests on {{ $labels.job }} saw an upstream timeout",
        description=(
            "The model server did not connect, send its first byte or keep sending within the configured"
            " timeouts (504 upstream_timeout, or an SSE error frame after commit). Check 'Upstream latency'"
            " and 'Upstream time to first byte': if the model server is overloaded, scale it or shed load;"
            " if long generations are legitimate, raise --upstream-read-timeout (first byte and between"
            " reads, default 600 s) or --upstream-connect-timeout (default 10 s)."
        ),
        signal_may_be_empty=_NOT_PREINIT,
    ),
    Alert(
        name="LoopwardenInflightRetainedNearWorkerMemory",
        expr=f"{_INFLIGHT_RETAINED} > {WORKER_MEMORY_FRACTION} * {WORKER_MEMORY_BYTES}",
        signal=_INFLIGHT_RETAINED,
        for_="5m",
        severity="critical",
        summary=(
            "Live ledgers on {{ $labels.instance }} hold {{ $value | humanize1024 }}B,"
            f" over {WORKER_MEMORY_FRACTION:.0%} of the {WORKER_MEMORY_BYTES // GiB} GiB worker memory"
        ),
        description=(
            "The requests in flight on this instance may keep that much memory alive; near the worker's"
            " memory the process risks an OOM kill that drops every request on it. Compare with resident"
            " memory on the capacity dashboard. Lower --max-retained-bytes (or the heavy models' overrides),"
            " serve fewer concurrent requests per instance (more instances), or give workers more memory"
            " and set WORKER_MEMORY_BYTES in dashboards/queries.py to match (then rerun"
            " python -m dashboards.generate)."
        ),
    ),
    Alert(
        name="LoopwardenSseErrorRateHigh",
        expr=_guarded(_SSE_ERROR_RATIO, SSE_ERROR_RATIO_THRESHOLD, _OK_RATE),
        signal=_SSE_ERROR_RATIO,
        for_="10m",
        severity="warning",
        summary="{{ $value | humanizePercentage }} of 200 responses on {{ $labels.job }} ended in an SSE error frame",
        description=(
            "Errors after a stream is committed keep HTTP status 200, so only loopwarden_stream_errors_total"
            " shows them. See 'SSE errors by code': max_retained_bytes_exceeded - a round's output or a tool"
            " result overflowed the ledger, raise --max-retained-bytes if the capacity dashboard shows"
            " legitimate traffic near the limit; upstream_timeout or upstream_incomplete - the model server"
            " stalls or drops streams, raise --upstream-read-timeout or fix the model server;"
            " max_infer_iters_exceeded - see LoopwardenLoopDetectedSpike."
        ),
        signal_may_be_empty=_NOT_PREINIT,
    ),
    Alert(
        name="LoopwardenInternalErrors",
        expr=f"{_INTERNAL_ERRORS} > 0",
        signal=_INTERNAL_ERRORS,
        for_="1m",
        severity="warning",
        summary="{{ $labels.job }} answered {{ $value | humanize }} requests with HTTP 500 in 10 m",
        description=(
            "A 500 is a gateway bug: every failure should map to a documented status (DESIGN.md §5)."
            " Find 'internal error while serving a request' with its traceback in the gateway's logs"
            " and report it; no setting fixes this."
        ),
        signal_may_be_empty="empty unless a request was answered with 500 (a bug)",
    ),
)


@dataclass(frozen=True)
class Expression:
    """One PromQL expression for the live check: where it comes from and whether it may be empty."""

    key: str
    expr: str
    may_be_empty: str


def all_expressions(variables: Mapping[str, str] | None = None) -> list[Expression]:
    """Every dashboard query and alert expression, Grafana macros substituted.

    `variables` overrides `DASHBOARD_VARIABLES` (for example ``{"job": "loopwarden"}``).
    Keys are ``query:<key>``, ``alert:<name>`` (may be empty: it fires only under fault) and
    ``signal:<name>`` (the alert's measurement without its threshold).
    """
    values = {**DASHBOARD_VARIABLES, **(variables or {})}
    found = [
        Expression(f"query:{q.key}", substitute(q.expr, values), q.may_be_empty) for q in QUERIES.values()
    ]
    for alert in ALERTS:
        found.append(Expression(f"alert:{alert.name}", alert.expr, "fires only when the condition holds"))
        found.append(Expression(f"signal:{alert.name}", alert.signal, alert.signal_may_be_empty))
    return found


def contract_problems(expr: str) -> list[str]:
    """Every way `expr` (already `substitute`d) breaks the metric contract; empty when it keeps it.

    Catches what a real Prometheus answers with an empty result instead of an error: a metric
    name not in `METRICS` or `STANDARD_METRICS` (or a histogram selected without its ``_bucket``
    / ``_count`` / ``_sum`` suffix), a label the metric does not have, a label value outside the
    allowed ones (for ``=~``/``!~``: a regex matching none of them), an ``le`` matcher that is
    not exactly one bucket bound of that histogram, and a selector without a metric name.
    """
    names = series_names()
    problems: list[str] = []
    for selector in selectors(expr):
        if selector.metric is None:
            problems.append(f"selector without a metric name: {selector.matchers}")
            continue
        family = names.get(selector.metric)
        if family is None:
            problems.append(
                f"{selector.metric} is not a metric of DESIGN.md §8 nor an allowed standard metric"
            )
            continue
        spec = METRICS.get(family)
        labels: Mapping[str, tuple[str, ...] | None] = spec.labels if spec is not None else {}
        for label, op, value in selector.matchers:
            if label in TARGET_LABELS:
                continue
            if (
                label == "le"
                and spec is not None
                and spec.buckets is not None
                and selector.metric.endswith("_bucket")
            ):
                bounds = [*spec.buckets, float("inf")]
                # The form prometheus-client writes (and Prometheus 3 normalises to).
                hits = [b for b in bounds if _matches(op, value, go_float(b))]
                if op in {"=", "=~"} and len(hits) != 1:
                    problems.append(
                        f"{selector.metric}{{le{op}{value!r}}} selects {len(hits)} bucket bounds, not 1"
                    )
                continue
            if label not in labels:
                problems.append(
                    f"{selector.metric} has no label {label!r} (it has {sorted(labels) or 'none'})"
                )
                continue
            allowed = labels[label]
            if allowed is None:
                continue
            if op in {"=", "!="} and value not in allowed:
                problems.append(
                    f"{selector.metric}{{{label}{op}{value!r}}}: {value!r} is not one of {allowed}"
                )
            if op in {"=~", "!~"} and not any(_matches("=~", value, v) for v in allowed):
                problems.append(
                    f"{selector.metric}{{{label}{op}{value!r}}}: the regex matches none of {allowed}"
                )
    return problems


def _matches(op: str, pattern: str, value: str) -> bool:
    """Whether matcher `op` `pattern` selects `value` (PromQL regexes are fully anchored)."""
    if op == "=":
        return value == pattern
    if op == "!=":
        return value != pattern
    try:
        hit = re.fullmatch(pattern, value) is not None
    except re.error:
        return False
    return hit if op == "=~" else not hit
