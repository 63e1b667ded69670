"""The metric contract of DESIGN.md §8, and the app's Prometheus metrics defined from it.

This module is the one definition of every ``loopwarden_*`` metric:

* `METRICS`: each metric's name, type, help text and label names, with the allowed values of each
  label (`CAP_LIMITS`, `CAP_OUTCOMES`, `HTTP_STATUSES`, `STREAM_ERROR_CODES`, ...);
* the histogram bucket bounds (`RETAINED_BYTES_BUCKETS`, `UTILIZATION_BUCKETS`, `ROUNDS_BUCKETS`,
  `LATENCY_BUCKETS`): a dashboard query that picks one bucket (``le``) is only right if the app
  uses exactly these;
* `CAP_HIT_PAIRS`, the (limit, outcome) label sets pre-initialised at import;
* the module-level singletons (`REQUESTS`, `CAP_HITS`, ...), each created from its `METRICS` entry.

``dashboards.queries`` imports the contract from here (dashboards import middleware, never the
reverse), so a dashboard, an alert and the app cannot disagree about a name, a label value or a
bucket bound.

Base units, bounded labels only: labels never carry ids, user strings, tool names or error
messages. The ``model`` label is one of the configured model names or `OTHER_MODEL` (the request
intake picks it once it has read the body's ``model``: ``middleware.asgi.intake.Intake.model_label``);
an error code becomes the ``code`` label through `stream_error_label`.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

KiB = 1024

# --- label values (DESIGN.md §8) ---------------------------------------------------------------

#: ``loopwarden_cap_hits_total{limit}``: which limit stopped or cut the request.
CAP_LIMITS: tuple[str, ...] = (
    "max_retained_bytes",
    "request_body",
    "upstream_body",
    "max_infer_iters",
    "max_tool_calls",
    "tool_timeout",
    "client_body_timeout",
    "request_deadline",
    "admission",
    "caller_share",
    "client_write_timeout",
    "header_timeout",
    "max_connections",
    "websocket_lifetime",
    "websocket_idle",
    "websocket_message_size",
    "translation",
)
#: ``loopwarden_cap_hits_total{transport}``: how the request came (HTTP, or a turn or the
#: connection of a WebSocket at ``/v1/responses``; `TRANSPORT` holds the current one).
TRANSPORTS: tuple[str, ...] = ("http", "websocket")
#: ``loopwarden_websocket_turns_total{outcome}``: how one WebSocket turn ended (its terminal
#: event, or ``cancelled`` when the client went away or stopped reading).
WEBSOCKET_TURN_OUTCOMES: tuple[str, ...] = ("completed", "incomplete", "failed", "cancelled")
#: ``loopwarden_translation_failures_total{reason}`` (README "Chat Completions upstreams"): why a
#: Chat Completions reply or request could not be translated (`middleware.upstream.chat.errors`).
TRANSLATION_REASONS: tuple[str, ...] = (
    "invalid_chunk",
    "invalid_completion",
    "missing_finish_reason",
    "unknown_finish_reason",
    "invalid_tool_stream",
    "legacy_function_call",
    "limit_tool_calls",
    "limit_tool_arguments",
    "limit_events",
    "invalid_reasoning",
    "unsupported_request",
)
#: ``loopwarden_compactions_total{mode, outcome}`` (README "Compaction").
COMPACT_MODES: tuple[str, ...] = ("upstream", "gateway")
COMPACT_OUTCOMES: tuple[str, ...] = ("ok", "failed", "fallback")
#: The (mode, outcome) pairs that occur, pre-initialised (``fallback`` is the upstream's only).
COMPACT_PAIRS: tuple[tuple[str, str], ...] = (
    ("upstream", "ok"),
    ("upstream", "failed"),
    ("upstream", "fallback"),
    ("gateway", "ok"),
    ("gateway", "failed"),
)
#: ``loopwarden_cap_hits_total{outcome}``: what the client got (status, SSE error frame, ...).
CAP_OUTCOMES: tuple[str, ...] = (
    "400",
    "408",
    "413",
    "502",
    "503",
    "504",
    "508",
    "sse_error",
    "incomplete",
    "tool_error",
    "closed",  # nothing could be answered: the client stopped reading (client_write_timeout)
)
#: The (limit, outcome) pairs pre-initialised at import, so dashboards show 0 instead of "No
#: data" and the live check sees a series for every cap-hit query: the cap-hit rows of DESIGN.md
#: §5, and the two the loop and the tools count (max_tool_calls, tool_timeout). A pair the
#: outcome table (``middleware.outcomes``) produces beyond these (e.g. ``admission`` with ``502``
#: when the pool refuses a later charge) appears on its first hit.
CAP_HIT_PAIRS: tuple[tuple[str, str], ...] = (
    ("max_retained_bytes", "413"),  # initial payload or restored history
    ("max_retained_bytes", "502"),  # later overflow, before commit
    ("max_retained_bytes", "sse_error"),  # later overflow, after commit
    ("request_body", "413"),  # raw body over limit // 32
    ("upstream_body", "502"),  # buffered upstream Content-Length over limit // 8
    ("upstream_body", "sse_error"),  # the same in a later round of a committed stream
    ("max_infer_iters", "508"),
    ("max_infer_iters", "sse_error"),
    ("max_tool_calls", "incomplete"),  # the request's own max_tool_calls: the client's choice
    ("tool_timeout", "tool_error"),  # fed back to the model as an error output
    ("client_body_timeout", "408"),
    ("request_deadline", "504"),
    ("request_deadline", "sse_error"),
    ("admission", "503"),  # process pool full
    ("admission", "413"),  # one reservation larger than the whole pool
    ("admission", "502"),  # the pool has no room for a later charge
    ("admission", "sse_error"),  # the same after commit
    ("caller_share", "503"),  # one caller's share of the pool full (--max-inflight-share-per-caller)
    ("caller_share", "413"),  # one reservation over a caller's whole share, or its initial payload
    ("caller_share", "502"),  # the caller's share has no room for a later charge
    ("caller_share", "sse_error"),  # the same after commit
    ("client_write_timeout", "closed"),  # a client that stopped reading: connection closed, stored cancelled
    # connection-level (middleware.ops.connections): nothing is sent, the connection is closed;
    # the outcome is the status the cap stands for
    ("header_timeout", "408"),  # no complete request head within --header-timeout
    ("max_connections", "503"),  # refused at accept: --max-connections open in this worker
    # WebSocket connections (middleware.asgi.websocket): an error envelope, then a close frame
    ("websocket_lifetime", "400"),  # websocket_connection_limit_reached, close 1001
    ("websocket_idle", "408"),  # no message within --websocket-idle-timeout, close 1001
    ("websocket_message_size", "413"),
    ("translation", "502"),  # a Chat translation cap (tool calls, argument bytes, events), before commit
    ("translation", "sse_error"),  # the same after commit  # a message over the body clamp, close 1009
)
#: Cap-hit limits that only a WebSocket connection hits (pre-initialised for that transport only).
WEBSOCKET_CAP_LIMITS: frozenset[str] = frozenset(
    {"websocket_lifetime", "websocket_idle", "websocket_message_size"}
)
#: ``loopwarden_upstream_errors_total{kind}``.
UPSTREAM_ERROR_KINDS: tuple[str, ...] = (
    "connect",
    "timeout",
    "eof",
    "protocol",
    "decode",
    "status_4xx",
    "status_5xx",
    "stream_error",
)
#: ``loopwarden_tool_calls_total{outcome}``.
TOOL_OUTCOMES: tuple[str, ...] = ("ok", "error", "timeout", "refused", "invalid_arguments", "too_large")
#: ``loopwarden_background_outcomes_total{outcome}``: the stored status a background response ended with.
BACKGROUND_OUTCOMES: tuple[str, ...] = ("completed", "incomplete", "failed", "cancelled")
#: ``loopwarden_stream_errors_total{code}``: the codes the gateway itself can send after commit,
#: i.e. ``middleware.outcomes.stream_error_codes()`` (its rows that can happen after commit).
#: Codes chosen by the upstream (its 4xx/5xx or in-band error codes) are unbounded strings and are
#: folded into ``upstream_error`` (`stream_error_label`). Spelled out here rather than derived from
#: the outcome table: ``middleware.outcomes`` imports this module to count, and the dashboards
#: must read the contract without importing the request path; tests/unit/test_metrics_contract.py
#: asserts the two are equal and cover DESIGN.md §5's after-commit codes.
STREAM_ERROR_CODES: tuple[str, ...] = (
    "max_retained_bytes_exceeded",
    "upstream_response_too_large",
    "max_infer_iters_exceeded",
    "upstream_timeout",
    "request_deadline_exceeded",
    "upstream_incomplete",
    "upstream_invalid_response",
    "upstream_auth_failed",
    "upstream_error",
    "upstream_unavailable",
    "process_budget_exceeded",
    "server_shutting_down",
    "mcp_server_unavailable",
    "store_unavailable",
    "internal_error",
)
#: ``loopwarden_requests_total{status}``: the statuses DESIGN.md §5 answers with, plus 404/405
#: from routing, 431 (a request head over --max-header-bytes, answered by the connection guard), 500 (a bug: no client input may cause it) and 499 (client went away before a
#: status was sent, the nginx convention).
HTTP_STATUSES: tuple[str, ...] = (
    "200",
    "400",
    "401",
    "403",
    "404",
    "405",
    "408",
    "409",
    "413",
    "422",
    "429",
    "431",
    "499",
    "500",
    "502",
    "503",
    "504",
    "508",
)
#: ``loopwarden_requests_total{model}`` holds the names configured under ``models:`` (not known
#: here) and this value for every other model.
OTHER_MODEL = "other"

# --- histogram buckets -------------------------------------------------------------------------

#: Bucket bounds per doubling of ``loopwarden_retained_bytes_peak`` and
#: ``loopwarden_retained_utilization_ratio``: a bound every 2**(1/8) (about 9 %), fine enough to
#: size a limit from the bucket under it (issue 20).
STEPS_PER_DOUBLING = 8


def _geometric(low: float, doublings: int, *, digits: int | None = None) -> tuple[float, ...]:
    """`low` x 2**(k / STEPS_PER_DOUBLING) for k in 0..=doublings x STEPS_PER_DOUBLING, each
    rounded to an integer (`digits` None) or to `digits` decimals; every power of two stays exact."""
    steps = doublings * STEPS_PER_DOUBLING
    values = (low * 2 ** (k / STEPS_PER_DOUBLING) for k in range(steps + 1))
    return tuple(float(round(v)) if digits is None else round(v, digits) for v in values)


#: ``loopwarden_retained_bytes_peak`` (bytes): 8 bounds per doubling from 4 KiB to 256 MiB, i.e.
#: the whole ``max_retained_bytes`` range (4096..=268435456); every power of two (so every
#: candidate limit a dashboard offers) is a bound. A peak never exceeds its limit, so +Inf holds
#: nothing above 256 MiB. 129 bounds.
RETAINED_BYTES_BUCKETS: tuple[float, ...] = _geometric(4 * KiB, 16)
#: ``loopwarden_retained_utilization_ratio`` (peak / limit, in 0..=1; a peak equal to the limit
#: is admitted and lands in the 1.0 bucket): 8 bounds per doubling from 1/128 to 1 (rounded to 4
#: decimals), plus 0.9, 0.95 and 0.99 for the alert thresholds. 60 bounds.
UTILIZATION_BUCKETS: tuple[float, ...] = tuple(sorted({*_geometric(1 / 128, 7, digits=4), 0.9, 0.95, 0.99}))
#: ``loopwarden_inference_rounds``: every integer from 1 to 100 (the largest ``max_infer_iters``),
#: so the share a cap of N would stop is exact for every N. 100 bounds.
ROUNDS_BUCKETS: tuple[float, ...] = tuple(float(i) for i in range(1, 101))
#: ``loopwarden_upstream_duration_seconds``, ``loopwarden_upstream_ttfb_seconds`` and
#: ``loopwarden_tool_call_duration_seconds`` (seconds, up to the 600 s default read timeout).
LATENCY_BUCKETS: tuple[float, ...] = (
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

# --- metrics -----------------------------------------------------------------------------------

MetricType = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric family of the contract (DESIGN.md §8).

    `documentation` is the help text the app exposes. `labels` maps each label name to its
    allowed values, or to ``None`` when the values are operator-defined (``model``: the
    configured model names and `OTHER_MODEL`). `buckets` are the upper bounds of a histogram
    (``None`` for counters and gauges).
    """

    name: str
    type: MetricType
    documentation: str
    labels: Mapping[str, tuple[str, ...] | None]
    buckets: tuple[float, ...] | None = None


def _metrics(*specs: MetricSpec) -> Mapping[str, MetricSpec]:
    return {spec.name: spec for spec in specs}


METRICS: Mapping[str, MetricSpec] = _metrics(
    MetricSpec(
        "loopwarden_requests_total",
        "counter",
        "Client requests answered, by HTTP status and model.",
        {"status": HTTP_STATUSES, "model": None},
    ),
    MetricSpec(
        "loopwarden_cap_hits_total",
        "counter",
        "Requests stopped or cut by a limit, by limit, outcome and transport.",
        {"limit": CAP_LIMITS, "outcome": CAP_OUTCOMES, "transport": TRANSPORTS},
    ),
    MetricSpec(
        "loopwarden_stream_errors_total",
        "counter",
        "SSE error frames sent after a stream was committed, by error code.",
        {"code": STREAM_ERROR_CODES},
    ),
    MetricSpec(
        "loopwarden_upstream_errors_total",
        "counter",
        "Failures of the upstream model server, by kind.",
        {"kind": UPSTREAM_ERROR_KINDS},
    ),
    MetricSpec(
        "loopwarden_client_disconnects_total",
        "counter",
        "Requests whose client went away before the answer was complete.",
        {},
    ),
    MetricSpec(
        "loopwarden_dropped_writes_total",
        "counter",
        "Writes to a client connection that was already closing (a reset or closed client): dropped"
        " without asyncio's per-write warning.",
        {},
    ),
    MetricSpec(
        "loopwarden_retry_shield_hits_total",
        "counter",
        "Requests answered by the retry shield: identical to one that failed deterministically "
        "within --retry-shield-seconds, answered again without an upstream call.",
        {},
    ),
    MetricSpec(
        "loopwarden_tool_calls_total",
        "counter",
        "Gateway-owned tool calls, by outcome (ok, error, timeout, refused, invalid_arguments, too_large).",
        {"outcome": TOOL_OUTCOMES},
    ),
    MetricSpec(
        "loopwarden_tool_call_duration_seconds",
        "histogram",
        "Wall time of one gateway-owned tool call (seconds).",
        {},
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "loopwarden_inference_rounds",
        "histogram",
        "Inference calls (rounds) one client request made.",
        {},
        ROUNDS_BUCKETS,
    ),
    MetricSpec(
        "loopwarden_retained_bytes_peak",
        "histogram",
        "Peak retained bytes charged to one request's ledger.",
        {},
        RETAINED_BYTES_BUCKETS,
    ),
    MetricSpec(
        "loopwarden_retained_utilization_ratio",
        "histogram",
        "Peak retained bytes of a request divided by its max_retained_bytes limit.",
        {},
        UTILIZATION_BUCKETS,
    ),
    MetricSpec(
        "loopwarden_inflight_requests",
        "gauge",
        "Requests being served now.",
        {},
    ),
    MetricSpec(
        "loopwarden_inflight_retained_bytes",
        "gauge",
        "Budget bytes charged by every request being served now (the sum of live ledgers).",
        {},
    ),
    MetricSpec(
        "loopwarden_upstream_duration_seconds",
        "histogram",
        "Wall time of one upstream inference call, request sent to body closed (seconds).",
        {},
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "loopwarden_upstream_ttfb_seconds",
        "histogram",
        "Time from sending an upstream request to its first body byte (seconds).",
        {},
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "loopwarden_admission_reserved_bytes",
        "gauge",
        "Budget bytes reserved by requests in flight from this worker's admission pool.",
        {},
    ),
    MetricSpec(
        "loopwarden_admission_budget_bytes",
        "gauge",
        "The worker's admission pool (--max-inflight-retained-bytes).",
        {},
    ),
    MetricSpec(
        "loopwarden_websocket_connections",
        "gauge",
        "WebSocket connections open now at /v1/responses.",
        {},
    ),
    MetricSpec(
        "loopwarden_websocket_turns_total",
        "counter",
        "WebSocket turns (response.create messages) served, by how they ended.",
        {"outcome": WEBSOCKET_TURN_OUTCOMES},
    ),
    MetricSpec(
        "loopwarden_worker_resident_memory_bytes",
        "gauge",
        "Resident set size of the largest live worker process (bytes; /proc/self/statm, updated at"
        " every request end and scrape).",
        {},
    ),
    MetricSpec(
        "loopwarden_worker_baseline_resident_memory_bytes",
        "gauge",
        "Resident set size of the largest live worker process when it started serving, before any"
        " request (bytes): the gateway's own baseline.",
        {},
    ),
    MetricSpec(
        "loopwarden_translation_failures_total",
        "counter",
        "Chat Completions translations that failed, by bounded reason (a request it cannot express, "
        "a reply it cannot translate, a translation cap).",
        {"reason": TRANSLATION_REASONS},
    ),
    MetricSpec(
        "loopwarden_compactions_total",
        "counter",
        "POST /v1/responses/compact requests, by who compacted (upstream, gateway) and outcome "
        "(ok, failed; fallback: auto mode found no upstream compact route and the gateway compacted).",
        {"mode": COMPACT_MODES, "outcome": COMPACT_OUTCOMES},
    ),
    MetricSpec(
        "loopwarden_background_tasks",
        "gauge",
        "Background responses (background: true) running on this worker now.",
        {},
    ),
    MetricSpec(
        "loopwarden_background_outcomes_total",
        "counter",
        "Background responses ended, by stored status (completed, incomplete, failed, cancelled).",
        {"outcome": BACKGROUND_OUTCOMES},
    ),
    MetricSpec(
        "loopwarden_memory_pressure_ratio",
        "gauge",
        "Used / allowed memory (cgroup memory.current / memory.max, else RSS / RAM), as last polled.",
        {},
    ),
)


def _counter(name: str) -> Counter:
    spec = METRICS[name]
    assert spec.type == "counter", name
    return Counter(spec.name, spec.documentation, list(spec.labels))


def _gauge(name: str, multiprocess_mode: Literal["livesum", "livemax"]) -> Gauge:
    """A gauge; `multiprocess_mode` says how ``--workers`` > 1 aggregates it over live workers."""
    spec = METRICS[name]
    assert spec.type == "gauge" and not spec.labels, name
    return Gauge(spec.name, spec.documentation, multiprocess_mode=multiprocess_mode)


def _histogram(name: str) -> Histogram:
    spec = METRICS[name]
    assert spec.type == "histogram" and spec.buckets is not None and not spec.labels, name
    return Histogram(spec.name, spec.documentation, buckets=spec.buckets)


REQUESTS = _counter("loopwarden_requests_total")
CAP_HITS = _counter("loopwarden_cap_hits_total")
STREAM_ERRORS = _counter("loopwarden_stream_errors_total")
UPSTREAM_ERRORS = _counter("loopwarden_upstream_errors_total")
CLIENT_DISCONNECTS = _counter("loopwarden_client_disconnects_total")
RETRY_SHIELD_HITS = _counter("loopwarden_retry_shield_hits_total")
TOOL_CALLS = _counter("loopwarden_tool_calls_total")
DROPPED_WRITES = _counter("loopwarden_dropped_writes_total")
TOOL_DURATION = _histogram("loopwarden_tool_call_duration_seconds")
INFERENCE_ROUNDS = _histogram("loopwarden_inference_rounds")
RETAINED_PEAK = _histogram("loopwarden_retained_bytes_peak")
RETAINED_UTILIZATION = _histogram("loopwarden_retained_utilization_ratio")
INFLIGHT = _gauge("loopwarden_inflight_requests", "livesum")
INFLIGHT_RETAINED = _gauge("loopwarden_inflight_retained_bytes", "livesum")
UPSTREAM_DURATION = _histogram("loopwarden_upstream_duration_seconds")
UPSTREAM_TTFB = _histogram("loopwarden_upstream_ttfb_seconds")
ADMISSION_RESERVED = _gauge("loopwarden_admission_reserved_bytes", "livesum")
ADMISSION_BUDGET = _gauge("loopwarden_admission_budget_bytes", "livesum")
COMPACTIONS = _counter("loopwarden_compactions_total")
TRANSLATION_FAILURES = _counter("loopwarden_translation_failures_total")
MEMORY_PRESSURE = _gauge("loopwarden_memory_pressure_ratio", "livemax")
WORKER_RSS = _gauge("loopwarden_worker_resident_memory_bytes", "livemax")
WORKER_BASELINE_RSS = _gauge("loopwarden_worker_baseline_resident_memory_bytes", "livemax")
WEBSOCKET_CONNECTIONS = _gauge("loopwarden_websocket_connections", "livesum")
WEBSOCKET_TURNS = _counter("loopwarden_websocket_turns_total")

#: ``REQUESTS`` children by (status, model label): both labels are bounded (DESIGN.md §8), and a
#: child looked up once costs no lock and no label check on every later request.
_REQUEST_CHILDREN: dict[tuple[int, str], Any] = {}


def count_request(status: int, model: str) -> None:
    """Count one request in ``loopwarden_requests_total{status, model}`` (`model` a bounded label
    value: a configured model name or `OTHER_MODEL`)."""
    child = _REQUEST_CHILDREN.get((status, model))
    if child is None:
        child = _REQUEST_CHILDREN[status, model] = REQUESTS.labels(status=str(status), model=model)
    child.inc()


#: The transport of the request being served (the ``transport`` label of a cap hit): ``http``
#: unless the WebSocket endpoint set it for its connection's task (and the tasks it starts).
TRANSPORT: contextvars.ContextVar[str] = contextvars.ContextVar("loopwarden_transport", default="http")


def cap_hit(limit: str, outcome: str) -> None:
    """Count one cap hit (``loopwarden_cap_hits_total``) of ``limit`` with ``outcome``, labelled
    with the current `TRANSPORT`."""
    CAP_HITS.labels(limit=limit, outcome=outcome, transport=TRANSPORT.get()).inc()


BACKGROUND_TASKS = _gauge("loopwarden_background_tasks", "livesum")
BACKGROUND_OUTCOMES_TOTAL = _counter("loopwarden_background_outcomes_total")

_STREAM_ERROR_CODES = frozenset(STREAM_ERROR_CODES)


def stream_error_label(code: str) -> str:
    """The bounded ``code`` label of ``loopwarden_stream_errors_total`` for an error code."""
    return code if code in _STREAM_ERROR_CODES else "upstream_error"


def _preinitialise() -> None:
    for limit, outcome in CAP_HIT_PAIRS:
        for transport in TRANSPORTS:
            if transport == "websocket" or limit not in WEBSOCKET_CAP_LIMITS:
                CAP_HITS.labels(limit=limit, outcome=outcome, transport=transport)
    for outcome in WEBSOCKET_TURN_OUTCOMES:
        WEBSOCKET_TURNS.labels(outcome=outcome)
    for kind in UPSTREAM_ERROR_KINDS:
        UPSTREAM_ERRORS.labels(kind=kind)
    for outcome in TOOL_OUTCOMES:
        TOOL_CALLS.labels(outcome=outcome)
    for code in STREAM_ERROR_CODES:
        STREAM_ERRORS.labels(code=code)
    for mode, outcome in COMPACT_PAIRS:
        COMPACTIONS.labels(mode=mode, outcome=outcome)
    for outcome in BACKGROUND_OUTCOMES:
        BACKGROUND_OUTCOMES_TOTAL.labels(outcome=outcome)
    for reason in TRANSLATION_REASONS:
        TRANSLATION_FAILURES.labels(reason=reason)


_preinitialise()


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # read once


def resident_memory_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``, field 2 x page size);
    0 where ``/proc`` is missing (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def publish_resident_memory(*, baseline: bool = False) -> None:
    """Set ``loopwarden_worker_resident_memory_bytes`` to this worker's RSS now; with `baseline`
    (once, when the worker starts serving) also ``loopwarden_worker_baseline_resident_memory_bytes``."""
    rss = resident_memory_bytes()
    WORKER_RSS.set(rss)
    if baseline:
        WORKER_BASELINE_RSS.set(rss)


_RSS_EVERY = 0.05  # seconds: the multiprocess files get this worker's RSS at most this often
_rss_written_at = float("-inf")


def publish_resident_memory_after_request() -> None:
    """A request ended: with ``--workers`` > 1 (`MULTIPROCESS`) write this worker's RSS to its
    gauge file, at most every 50 ms (`time.monotonic`); in one process nothing, as `exposition`
    reads it at scrape time (issue 21: gauges are read at scrape time, not written per request)."""
    global _rss_written_at
    if not MULTIPROCESS:
        return
    now = time.monotonic()
    if now - _rss_written_at >= _RSS_EVERY:
        _rss_written_at = now
        publish_resident_memory()


_before_scrape: Callable[[], None] | None = None

#: prometheus-client's multiprocess mode (``--workers`` > 1): read once at import, as
#: prometheus-client itself decides its value class then; the per-request paths use this, not
#: an environment look-up each time.
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def publish_before_scrape(publish: Callable[[], None]) -> None:
    """Have `exposition` call `publish` first, so gauges that are not written on every change
    (the admission pool's) are current in this process's files. One callback: a later call
    replaces it."""
    global _before_scrape
    _before_scrape = publish


def exposition() -> bytes:
    """The Prometheus text page: this process's registry, or — with ``--workers`` > 1, when
    ``PROMETHEUS_MULTIPROC_DIR`` is set — every worker's metrics aggregated (counters summed,
    in-flight gauges summed over live workers; a worker other than the one answering the scrape
    contributes the admission gauges as of its last request start or end)."""
    publish_resident_memory()
    if _before_scrape is not None:
        _before_scrape()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest(REGISTRY)


def worker_exited() -> None:
    """Drop this worker's live gauges from the multiprocess files (called when a worker stops)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
