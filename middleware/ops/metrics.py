"""Prometheus metrics (DESIGN.md §8): module-level singletons, base units, bounded labels only.

Labels never carry ids, user strings, tool names or error messages; the ``model`` label is one of
the configured model names or ``other`` (the request intake picks it once it has read the body's
``model``: ``middleware.asgi.intake.Intake.model_label``); an error code becomes the ``code`` label
through `stream_error_label`.
"""

from __future__ import annotations

import os

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

REQUESTS = Counter(
    "loopwarden_requests_total",
    "Client requests answered, by HTTP status and model.",
    ["status", "model"],
)
CLIENT_DISCONNECTS = Counter(
    "loopwarden_client_disconnects_total",
    "Requests whose client went away before the answer was complete.",
)
UPSTREAM_ERRORS = Counter(
    "loopwarden_upstream_errors_total",
    "Failures of the upstream model server, by kind.",
    ["kind"],
)
STREAM_ERRORS = Counter(
    "loopwarden_stream_errors_total",
    "SSE error frames sent after a stream was committed, by error code.",
    ["code"],
)
INFLIGHT = Gauge("loopwarden_inflight_requests", "Requests being served now.", multiprocess_mode="livesum")


# Codes the gateway itself sends after commit (DESIGN.md §5); an upstream's own code is folded
# into "upstream_error" so the label set stays bounded.
STREAM_ERROR_CODES = frozenset(
    {
        "max_retained_bytes_exceeded",
        "max_infer_iters_exceeded",
        "upstream_timeout",
        "request_deadline_exceeded",
        "upstream_incomplete",
        "upstream_invalid_response",
        "upstream_auth_failed",
        "upstream_error",
        "server_shutting_down",
        "internal_error",
    }
)


def stream_error_label(code: str) -> str:
    """The bounded ``code`` label of ``loopwarden_stream_errors_total`` for an error code."""
    return code if code in STREAM_ERROR_CODES else "upstream_error"


CAP_HITS = Counter(
    "loopwarden_cap_hits_total",
    "Requests stopped or cut by a limit, by limit and outcome.",
    ["limit", "outcome"],
)
# Powers of two from 4 KiB to 256 MiB (bytes).
RETAINED_BYTES_BUCKETS = tuple(float(4096 * 2**i) for i in range(17))
RETAINED_PEAK = Histogram(
    "loopwarden_retained_bytes_peak",
    "Peak retained bytes charged to one request's ledger.",
    buckets=RETAINED_BYTES_BUCKETS,
)
UTILIZATION_BUCKETS = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
RETAINED_UTILIZATION = Histogram(
    "loopwarden_retained_utilization_ratio",
    "Peak retained bytes of a request divided by its max_retained_bytes limit.",
    buckets=UTILIZATION_BUCKETS,
)
# Seconds, up to the 600 s read timeout; rounds 1..100 (the max_infer_iters range).
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
ROUNDS_BUCKETS = (
    *(float(i) for i in range(1, 11)),
    12.0,
    15.0,
    20.0,
    25.0,
    30.0,
    40.0,
    50.0,
    60.0,
    80.0,
    100.0,
)
TOOL_CALLS = Counter(
    "loopwarden_tool_calls_total",
    "Gateway-owned tool calls, by outcome (ok, error, timeout, refused, invalid_arguments, too_large).",
    ["outcome"],
)
TOOL_DURATION = Histogram(
    "loopwarden_tool_call_duration_seconds",
    "Wall time of one gateway-owned tool call (seconds).",
    buckets=LATENCY_BUCKETS,
)
INFERENCE_ROUNDS = Histogram(
    "loopwarden_inference_rounds",
    "Inference calls (rounds) one client request made.",
    buckets=ROUNDS_BUCKETS,
)
INFLIGHT_RETAINED = Gauge(
    "loopwarden_inflight_retained_bytes",
    "Budget bytes charged by every request being served now (the sum of live ledgers).",
    multiprocess_mode="livesum",
)
UPSTREAM_DURATION = Histogram(
    "loopwarden_upstream_duration_seconds",
    "Wall time of one upstream inference call, request sent to body closed (seconds).",
    buckets=LATENCY_BUCKETS,
)
UPSTREAM_TTFB = Histogram(
    "loopwarden_upstream_ttfb_seconds",
    "Time from sending an upstream request to its first body byte (seconds).",
    buckets=LATENCY_BUCKETS,
)

ADMISSION_RESERVED = Gauge(
    "loopwarden_admission_reserved_bytes",
    "Budget bytes reserved by requests in flight from this worker's admission pool.",
    multiprocess_mode="livesum",
)
ADMISSION_BUDGET = Gauge(
    "loopwarden_admission_budget_bytes",
    "The worker's admission pool (--max-inflight-retained-bytes).",
    multiprocess_mode="livesum",
)
MEMORY_PRESSURE = Gauge(
    "loopwarden_memory_pressure_ratio",
    "Used / allowed memory (cgroup memory.current / memory.max, else RSS / RAM), as last polled.",
    multiprocess_mode="livemax",
)

# (limit, outcome) pairs DESIGN.md §5 can produce; pre-initialised so dashboards show 0, not "No data".
CAP_HIT_PAIRS = (
    ("max_retained_bytes", "413"),
    ("max_retained_bytes", "502"),
    ("max_retained_bytes", "sse_error"),
    ("request_body", "413"),
    ("upstream_body", "502"),
    ("max_infer_iters", "508"),
    ("max_infer_iters", "sse_error"),
    ("max_tool_calls", "incomplete"),
    ("tool_timeout", "tool_error"),
    ("client_body_timeout", "408"),
    ("request_deadline", "504"),
    ("request_deadline", "sse_error"),
    ("admission", "503"),
    ("admission", "413"),
)
UPSTREAM_ERROR_KINDS = (
    "connect",
    "timeout",
    "eof",
    "protocol",
    "decode",
    "status_4xx",
    "status_5xx",
    "stream_error",
)
TOOL_OUTCOMES = ("ok", "error", "timeout", "refused", "invalid_arguments", "too_large")


def _preinitialise() -> None:
    for limit, outcome in CAP_HIT_PAIRS:
        CAP_HITS.labels(limit=limit, outcome=outcome)
    for kind in UPSTREAM_ERROR_KINDS:
        UPSTREAM_ERRORS.labels(kind=kind)
    for outcome in TOOL_OUTCOMES:
        TOOL_CALLS.labels(outcome=outcome)
    for code in STREAM_ERROR_CODES:
        STREAM_ERRORS.labels(code=code)


_preinitialise()


def exposition() -> bytes:
    """The Prometheus text page: this process's registry, or — with ``--workers`` > 1, when
    ``PROMETHEUS_MULTIPROC_DIR`` is set — every worker's metrics aggregated (counters summed,
    in-flight gauges summed over live workers)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest(REGISTRY)


def worker_exited() -> None:
    """Drop this worker's live gauges from the multiprocess files (called when a worker stops)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
