"""DESIGN.md §5 as data: the only place a failure becomes a status, a frame or a stored status.

`OUTCOMES` holds one `Row` per situation of the §5 table. `resolve(exc, committed=...)` finds the
row of any exception — a `middleware.errors.Failure`, an upstream failure, `budget.BudgetExceeded`
/ `PoolExhausted` / `CallerShareExhausted` (by ``phase``: the initial payload, restored history and
a lowered limit are 413, anything later 502), the store's `StoreUnavailable`, anything else (500 ``internal_error``,
a bug) — and returns an `Outcome`: the HTTP status, envelope ``type`` and ``code``, the message,
``param``, headers, the cap-hit label and the stored status. Then

* `render_json(outcome)` is the envelope answer before commit (status, headers, body bytes);
* `render_stream(outcome, sequence, response)` is what follows a committed stream: one ``error``
  event, one ``response.failed`` event carrying the response so far, and ``data: [DONE]``;
* `stored_status(outcome)` is what the store keeps (``failed`` with the error; ``cancelled`` when
  the client went away, `CLIENT_GONE`);
* `record_client_gone()` counts a request whose client went away — or stopped reading for
  ``--client-write-timeout`` (§5 "client stops reading"): nothing is answered then, the
  connection is closed, and the request is stored `CLIENT_GONE`;
* `record(outcome)` counts the metrics (§8) and writes the one structured log line of the failure
  (request id, row, status, code, limit label, whether a retry can help, whether a gateway tool
  with side effects ran, the failure's numbers, the caller's hash; never user content);
* `shielded(outcome)` says whether the retry shield (`middleware.ops.shield`) remembers it, and
  `shield_answer(outcome, snapshot)` is what it remembers: the envelope answer before commit, or
  for a committed stream ``response.created`` and the same ``error`` / ``response.failed`` frames.

Everything that answers a failure — the guard, the store routes, the app's handlers, 404/405 —
goes through these functions; raise sites never pick a status.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any, Final

from budget import BudgetExceeded, PoolExhausted
from middleware.errors import CallerShareExhausted, Failure, MethodNotAllowed, ShieldHit, ShuttingDown
from middleware.ops import metrics
from middleware.ops.request_id import REQUEST_ID
from middleware.store.backends import StoreUnavailable
from middleware.upstream.errors import UpstreamError, UpstreamStatus

log = logging.getLogger("loopwarden.outcome")

#: Phases of `BudgetExceeded` / `PoolExhausted` that happen before anything was sent upstream.
INITIAL_PHASES: Final = frozenset({"input", "history", "limit"})
#: Upstream statuses passed through with their own status (DESIGN.md §5); the rest become 502.
PASSED_STATUSES: Final = frozenset({400, 404, 409, 422, 429})
#: Upstream headers a passed-through upstream error keeps (rate limits and when to retry).
PASSED_HEADER_PREFIXES: Final = ("x-ratelimit-",)
PASSED_HEADERS: Final = frozenset({"retry-after", "retry-after-ms"})
#: The header of an answer the retry shield sent again (DESIGN.md §5, last row).
SHIELD_HEADER: Final = (b"loopwarden-retry-shield", b"hit")
#: The head of an SSE answer.
SSE_HEADERS: Final = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"))
#: The sentence a failure after a gateway tool with side effects ran ends with.
AFTER_TOOLS_NOTE: Final = (
    "A gateway tool that may have side effects already ran for this request, so it is not retried "
    "(x-should-retry: false): check what the tool did before sending the request again."
)


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One row of DESIGN.md §5.

    ``situation``: the §5 wording. ``status``: HTTP status before commit (0: the upstream's own,
    see `PASSED_STATUSES`). ``code``: the error code (None: the failure names it). ``cap``: the
    ``loopwarden_cap_hits_total`` ``limit`` label, when the row is a cap hit. ``deterministic``:
    the same request would fail again, so ``x-should-retry: false``. ``close``: ``Connection:
    close`` (the body was not read). ``retry_after``: send ``Retry-After``. ``after_commit``: the
    row can also happen once a stream is committed (then it is frames, not a status).
    ``upstream``: the row is an upstream failure (counted in ``loopwarden_upstream_errors_total``
    by the failure's ``kind``). ``named``: the codes a failure of a ``code``-less row may name.
    ``shield``: the retry shield remembers the answer when the whole body was read (the same
    request would meet it again; any row is shielded once a gateway tool with side effects ran).
    ``replay``: the row answers with a remembered answer (the retry shield's hit).
    """

    situation: str
    status: int
    code: str | None
    cap: str | None = None
    deterministic: bool = False
    close: bool = False
    retry_after: bool = False
    after_commit: bool = True
    upstream: bool = False
    named: tuple[str, ...] = ()
    shield: bool = False
    replay: bool = False


#: The codes an `InvalidRequest` names (the check that failed), for the ``invalid_request`` row.
CLIENT_CODES: Final = (
    "invalid_json",
    "duplicate_key",
    "json_too_deep",
    "invalid_unicode",
    "invalid_number",
    "invalid_type",
    "invalid_value",
    "invalid_request",
    "missing_required_parameter",
    "unknown_parameter",
    "unsupported_parameter",
    "integer_below_min_value",
    "integer_above_max_value",
    "mcp_server_not_allowed",
    "unknown_mcp_server",
    "duplicate_mcp_server",
    "duplicate_tool_name",
)
#: The code of an upstream failure that sent none of its own.
UPSTREAM_DEFAULT_CODE: Final = "upstream_error"


OUTCOMES: Final[Mapping[str, Row]] = {
    "request_too_large": Row(
        "raw body over the clamp (from Content-Length or while reading)",
        413, "request_too_large", cap="request_body", deterministic=True, close=True, after_commit=False,
    ),
    "request_timeout": Row(
        "client body not received within --client-body-timeout",
        408, "request_timeout", cap="client_body_timeout", deterministic=True, close=True, after_commit=False,
    ),
    "request_head_too_large": Row(
        "request head (request line and headers) over --max-header-bytes",
        431, "request_header_too_large", deterministic=True, close=True, after_commit=False,
    ),
    "budget_initial": Row(
        "ledger overflow on the initial payload or restored history",
        413, "max_retained_bytes_exceeded", cap="max_retained_bytes", deterministic=True, after_commit=False,
        shield=True,
    ),
    "store_read_too_large": Row(
        "a stored response or item larger than a store read's ledger (GET of a response, input_items, conversation items)",
        413, "max_retained_bytes_exceeded", cap="max_retained_bytes", deterministic=True, after_commit=False,
    ),
    "budget_later": Row(
        "ledger overflow later (upstream output, tool result, persistence)",
        502, "max_retained_bytes_exceeded", cap="max_retained_bytes", deterministic=True, shield=True,
    ),
    "upstream_body_too_large": Row(
        "buffered upstream Content-Length over its clamp",
        502, "upstream_response_too_large", cap="upstream_body", deterministic=True, upstream=True, shield=True,
    ),
    "max_infer_iters": Row(
        "model still calls gateway tools after max_infer_iters inference calls",
        508, "max_infer_iters_exceeded", cap="max_infer_iters", deterministic=True, shield=True,
    ),
    "upstream_timeout": Row(
        "upstream timeout (connect / first byte / idle read)", 504, "upstream_timeout", upstream=True
    ),
    "request_deadline": Row(
        "whole-request deadline (--request-deadline)", 504, "request_deadline_exceeded", cap="request_deadline"
    ),
    "upstream_incomplete": Row(
        "upstream stream/body ends early, no terminal event, bad framing or encoding",
        502, "upstream_incomplete", upstream=True,
    ),
    "upstream_invalid": Row(
        "upstream protocol violation or an answer that breaks the schema or cannot be re-encoded",
        502, "upstream_invalid_response", upstream=True,
    ),
    "translation_limit": Row(
        "a Chat Completions reply over a translation cap (tool calls, argument bytes, events)",
        502, "upstream_invalid_response", cap="translation", deterministic=True, upstream=True, shield=True,
    ),
    "upstream_auth_failed": Row(
        "upstream 401 / 403 (the operator's credentials)", 502, "upstream_auth_failed", upstream=True
    ),
    "upstream_5xx": Row("upstream 5xx", 502, None, upstream=True),
    "upstream_4xx": Row(
        "upstream 400 / 404 / 409 / 422 / 429 (Retry-After and x-ratelimit-* passed through)",
        0, None, upstream=True,
    ),
    "upstream_stream_error": Row("in-band upstream error event", 502, None, upstream=True),
    "upstream_unavailable": Row(
        "upstream unreachable (connect refused, DNS, reset before headers)",
        502, "upstream_unavailable", upstream=True,
    ),
    "invalid_request": Row(
        "malformed client JSON, duplicate keys, depth over the cap, invalid Unicode, out-of-range numbers, "
        "dangling or unknown call_id, MCP server_url outside the allowlist, unknown server_label, clashing tool names",
        400, None, deterministic=True, after_commit=False, named=CLIENT_CODES, shield=True,
    ),
    "invalid_header": Row(
        "limit-lowering header out of range", 400, "invalid_header", deterministic=True, after_commit=False
    ),
    "invalid_api_key": Row(
        "gateway API key missing or wrong", 401, "invalid_api_key", deterministic=True, after_commit=False
    ),
    "server_overloaded": Row(
        "process pool full (admission control)",
        503, "server_overloaded", cap="admission", close=True, retry_after=True, after_commit=False,
    ),
    "process_budget_exceeded": Row(
        "one request's reservation larger than the whole process pool",
        413, "process_budget_exceeded", cap="admission", deterministic=True, close=True, after_commit=False,
    ),
    "pool_initial": Row(
        "the process pool has no room for the initial payload's charge",
        413, "process_budget_exceeded", cap="admission", deterministic=True, after_commit=False,
    ),
    "pool_later": Row(
        "the process pool has no room for a later charge", 502, "process_budget_exceeded", cap="admission"
    ),
    "caller_share_full": Row(
        "one caller's share of the process pool full (--max-inflight-share-per-caller)",
        503, "server_overloaded", cap="caller_share", close=True, retry_after=True, after_commit=False,
    ),
    "caller_share_too_large": Row(
        "one request's reservation larger than a caller's whole share of the process pool",
        413, "process_budget_exceeded", cap="caller_share", deterministic=True, close=True, after_commit=False,
    ),
    "caller_share_initial": Row(
        "the caller's share of the process pool has no room for the initial payload's charge",
        413, "process_budget_exceeded", cap="caller_share", deterministic=True, after_commit=False,
    ),
    "caller_share_later": Row(
        "the caller's share of the process pool has no room for a later charge",
        502, "process_budget_exceeded", cap="caller_share",
    ),
    "model_not_found": Row(
        "unknown model (when models are configured)", 404, "model_not_found", deterministic=True, after_commit=False,
        shield=True,
    ),
    "server_shutting_down": Row("shutting down, drain timeout passed", 503, "server_shutting_down"),
    "server_shutting_down_refused": Row(
        "shutting down: a new request is refused, its body not read (or still being read when the drain timeout passes)",
        503, "server_shutting_down", close=True, retry_after=True, after_commit=False,
    ),
    "background_worker_lost": Row(
        "a background response's worker stopped renewing its lease (--background-lease-seconds)",
        502, "background_worker_lost", after_commit=False,
    ),
    "mcp_server_unavailable": Row("an MCP server's tools/list fails", 502, "mcp_server_unavailable"),
    "not_found": Row(
        "unknown or another caller's response / conversation / item", 404, "not_found", deterministic=True,
        after_commit=False,
    ),
    "unknown_url": Row("unknown path", 404, "unknown_url", deterministic=True, after_commit=False),
    "method_not_allowed": Row(
        "method not allowed (with Allow)", 405, "method_not_allowed", deterministic=True, after_commit=False
    ),
    "store_unavailable": Row("the response store's database fails", 503, "store_unavailable"),
    "previous_response_not_found": Row(
        "WebSocket: previous_response_id in neither connection memory nor (store on) the store",
        400, "previous_response_not_found", deterministic=True, after_commit=False,
    ),
    "websocket_lifetime": Row(
        "WebSocket connection older than --websocket-max-lifetime (then close 1001)",
        400, "websocket_connection_limit_reached", cap="websocket_lifetime", deterministic=True,
        after_commit=False,
    ),
    "websocket_idle": Row(
        "WebSocket: no message within --websocket-idle-timeout between turns (then close 1001)",
        408, "websocket_idle_timeout", cap="websocket_idle", deterministic=True, after_commit=False,
    ),
    "websocket_message_too_large": Row(
        "WebSocket message over the body clamp (then close 1009)",
        413, "request_too_large", cap="websocket_message_size", deterministic=True, after_commit=False,
    ),
    "internal": Row("a defect of the gateway (never caused by input)", 500, "internal_error", deterministic=True),
    "retry_shield": Row(
        "identical request (same caller, limits and body) within --retry-shield-seconds after a shielded failure",
        0, None, deterministic=True, after_commit=False, replay=True,
    ),
}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """The one answer to one failure: see the module docstring. ``error``: the exception;
    ``after_tools``: a gateway tool (which may have side effects) had already run."""

    row: str
    status: int
    code: str
    message: str
    param: str | None
    headers: tuple[tuple[bytes, bytes], ...]
    cap: str | None
    committed: bool
    error: BaseException | None
    after_tools: bool = False

    @property
    def type(self) -> str:
        """The envelope ``type``: ``invalid_request_error`` (4xx) or ``server_error`` (5xx)."""
        return error_type(self.status)

    @property
    def cap_outcome(self) -> str:
        """The ``outcome`` label of a cap hit: the status before commit, ``sse_error`` after."""
        return "sse_error" if self.committed else str(self.status)


#: Stored status of a request whose client went away (no error, nothing answered).
CLIENT_GONE: Final = "cancelled"
#: The cap-hit ``limit`` of a client that stopped reading (DESIGN.md §5, §8), and its ``outcome``:
#: nothing could be answered, the connection is closed.
WRITE_TIMEOUT_CAP: Final = "client_write_timeout"
CLOSED: Final = "closed"


def error_type(status: int) -> str:
    """The envelope ``type`` for a status: ``invalid_request_error`` (4xx) or ``server_error`` (5xx)."""
    return "invalid_request_error" if status < 500 else "server_error"


def row_of(exc: BaseException) -> str:
    """The `OUTCOMES` key of an exception (see the module docstring)."""
    if isinstance(exc, ShuttingDown):
        return "server_shutting_down_refused" if exc.refused else "server_shutting_down"
    if isinstance(exc, UpstreamStatus):
        if exc.status in (401, 403):
            return "upstream_auth_failed"
        if exc.status in PASSED_STATUSES:
            return "upstream_4xx"
        return "upstream_5xx"
    if isinstance(exc, CallerShareExhausted):
        return "caller_share_initial" if exc.phase in INITIAL_PHASES else "caller_share_later"
    if isinstance(exc, Failure):
        return exc.row
    if isinstance(exc, BudgetExceeded):
        return "budget_initial" if exc.phase in INITIAL_PHASES else "budget_later"
    if isinstance(exc, PoolExhausted):
        return "pool_initial" if exc.phase in INITIAL_PHASES else "pool_later"
    if isinstance(exc, StoreUnavailable):
        return "store_unavailable"
    return "internal"


def with_request_id(message: str) -> str:
    """`message` with `` [request id <id>]`` appended when a request id is set."""
    rid = REQUEST_ID.get()
    return message if rid == "-" else f"{message} [request id {rid}]"


def _header(name: str, value: str) -> tuple[bytes, bytes] | None:
    # an upstream header passed on: visible ASCII only (anything else is dropped, never a raise)
    if value.isascii() and value.isprintable() and name.isascii():
        return name.encode(), value.encode()
    return None


def resolve(
    exc: BaseException, *, committed: bool = False, note: str = "", after_tools: bool = False
) -> Outcome:
    """The `Outcome` of `exc` (any exception), before or after commit.

    ``note``: a sentence appended to the message (e.g. that the request lowered the limit itself).
    ``after_tools``: a gateway tool with side effects (not annotated ``readOnlyHint`` or
    ``idempotentHint``) already ran for this request, so a retry would run it again: the failure
    is deterministic whatever its row (DESIGN.md §5), and its message says so (`AFTER_TOOLS_NOTE`).
    A `ShieldHit` takes the status and code of the answer it sends again.
    """
    key = row_of(exc)
    row = OUTCOMES[key]
    status = row.status
    code = row.code
    message, param = _message_of(exc, key)
    if isinstance(exc, Failure):
        code = code or exc.code
    headers = _passed_headers(exc)
    if isinstance(exc, UpstreamStatus) and key == "upstream_4xx":
        status = exc.status
    if isinstance(exc, ShieldHit):
        status = exc.answer.status
    if note:
        message = f"{message} {note}"
    if after_tools and not row.replay:
        end = "" if message.rstrip().endswith((".", "!", "?")) else "."
        message = f"{message.rstrip()}{end} {AFTER_TOOLS_NOTE}"
    return Outcome(
        row=key,
        status=status,
        code=code or UPSTREAM_DEFAULT_CODE,
        message=with_request_id(message),
        param=param,
        headers=tuple(headers),
        cap=row.cap,
        committed=committed,
        error=exc,
        after_tools=after_tools,
    )


def _message_of(exc: BaseException, key: str) -> tuple[str, str | None]:
    """The client-facing message and ``param`` of `exc` in row `key`: a `Failure`'s own, a
    ledger refusal's (the process budget's says what to change), the store's, else a generic
    sentence that reveals nothing of an unexpected exception."""
    if isinstance(exc, Failure):
        return exc.message, exc.param
    if isinstance(exc, PoolExhausted):
        return (
            f"the worker's process budget (--max-inflight-retained-bytes) has no room for {exc.requested} "
            f"more budget bytes for this request ({exc.phase}); retry later"
        ), None
    if isinstance(exc, BudgetExceeded):
        return str(exc), None
    if key == "store_unavailable":
        return f"the response store is unavailable: {exc}", None
    return "the gateway failed while serving this request", None


def _passed_headers(exc: BaseException) -> list[tuple[bytes, bytes]]:
    """The response headers of `exc`'s answer: an upstream status's passed-on headers
    (`PASSED_HEADERS`, `PASSED_HEADER_PREFIXES`, visible ASCII only), a 405's ``allow``."""
    headers: list[tuple[bytes, bytes]] = []
    if isinstance(exc, UpstreamStatus):
        passed = (
            _header(name, value)
            for name, value in exc.passed_headers
            if name in PASSED_HEADERS or name.startswith(PASSED_HEADER_PREFIXES)
        )
        headers = [header for header in passed if header is not None]
    if isinstance(exc, MethodNotAllowed):
        headers.append((b"allow", exc.allow.encode("ascii", "replace")))
    return headers


def retryable(outcome: Outcome) -> bool:
    """Whether a retry can help: not for deterministic rows, not once a gateway tool has run, nor
    for passed-through upstream 4xx other than 409 / 429."""
    row = OUTCOMES[outcome.row]
    if row.deterministic or outcome.after_tools:
        return False
    if outcome.row == "upstream_4xx":
        return outcome.status in (409, 429)
    return True


def envelope(outcome: Outcome) -> dict[str, Any]:
    """The OpenAI error envelope ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": outcome.message,
            "type": outcome.type,
            "param": outcome.param,
            "code": outcome.code,
        }
    }


def render_json(
    outcome: Outcome, *, retry_after: float = 1.0
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer before commit: ``(status, headers, body)``, the body the envelope as compact
    JSON. ``retry_after``: seconds for a ``Retry-After`` header, on the rows that send one."""
    row = OUTCOMES[outcome.row]
    if row.replay and isinstance(outcome.error, ShieldHit):
        answer = outcome.error.answer
        return answer.status, [*answer.headers, SHIELD_HEADER], answer.body
    body = json.dumps(envelope(outcome), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if not retryable(outcome):
        headers.append((b"x-should-retry", b"false"))
    if row.close:
        headers.append((b"connection", b"close"))
    if row.retry_after:
        headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    headers.extend(outcome.headers)
    return outcome.status, headers, body


def shielded(outcome: Outcome) -> bool:
    """Whether the retry shield remembers `outcome` (its row's ``shield``, or any row once a
    gateway tool with side effects ran; never a shield hit itself). The caller checks that the
    whole body was read."""
    row = OUTCOMES[outcome.row]
    return not row.replay and (row.shield or outcome.after_tools)


def shield_answer(
    outcome: Outcome, snapshot: Mapping[str, Any] | None, *, retry_after: float = 1.0
) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
    """What the retry shield sends again for `outcome`: ``(status, headers, body)``.

    Before commit, the envelope answer (`render_json`). After commit (a stream), a 200 SSE body:
    ``response.created`` with `snapshot` (the response so far) as it began — ``in_progress``, no
    output, no error — then the same ``error`` and ``response.failed`` frames (`render_stream`,
    numbered 1 and 2) and ``data: [DONE]``.
    """
    if not outcome.committed:
        status, headers, body = render_json(outcome, retry_after=retry_after)
        return status, tuple(headers), body
    created = {
        "type": "response.created",
        "sequence_number": 0,
        "response": {**(snapshot or {}), "status": "in_progress", "output": [], "error": None},
    }
    body = (
        b"event: response.created\ndata: " + _dumps(created) + b"\n\n" + render_stream(outcome, 1, snapshot)
    )
    return 200, SSE_HEADERS, body


def error_object(outcome: Outcome) -> dict[str, Any]:
    """The ``error`` of a failed response object (``code``, ``message``), as stored and streamed."""
    return {"code": outcome.code, "message": outcome.message}


def render_stream(outcome: Outcome, sequence: int, response: Mapping[str, Any] | None) -> bytes:
    """The frames that end a committed stream (DESIGN.md §5): one ``error`` event (the spec's flat
    ``ResponseErrorEvent`` fields plus a nested ``error`` so the SDKs raise), one
    ``response.failed`` event with `response` (the response so far) failed, and ``data: [DONE]``.
    ``sequence``: the error event's ``sequence_number``."""
    error = {
        "type": "error",
        "sequence_number": sequence,
        "code": outcome.code,
        "message": outcome.message,
        "param": outcome.param,
        "error": {
            "type": outcome.type,
            "code": outcome.code,
            "message": outcome.message,
            "param": outcome.param,
        },
    }
    failed = {
        "type": "response.failed",
        "sequence_number": sequence + 1,
        "response": {**(response or {}), "status": "failed", "error": error_object(outcome)},
    }
    return b"".join(
        (
            b"event: error\ndata: ",
            _dumps(error),
            b"\n\nevent: response.failed\ndata: ",
            _dumps(failed),
            b"\n\ndata: [DONE]\n\n",
        )
    )


def _dumps(obj: Any) -> bytes:
    # the response so far may hold what the upstream sent (lone surrogates, numbers that overflow
    # to infinity): never a raise here, and never a token that is not JSON
    try:
        return json.dumps(
            obj, separators=(",", ":"), ensure_ascii=True, default=str, allow_nan=False
        ).encode()
    except ValueError:
        if isinstance(obj, dict) and isinstance(obj.get("response"), dict):
            kept = {k: obj["response"].get(k) for k in ("id", "object", "status", "error")}
            return _dumps({**obj, "response": kept})
        raise


def stored_status(outcome: Outcome | None) -> tuple[str, dict[str, Any] | None]:
    """What the store keeps for a request that ended this way: ``("failed", error)``, or
    ``(CLIENT_GONE, None)`` for None (the client went away)."""
    if outcome is None:
        return CLIENT_GONE, None
    return "failed", error_object(outcome)


def record_client_gone(
    *, write_timeout: float | None = None, owner: str = "", committed: bool = False
) -> None:
    """Count a request whose client went away (``loopwarden_client_disconnects_total``): nothing
    is answered and it is stored `CLIENT_GONE` (``stored_status(None)``).

    ``write_timeout`` (seconds): the client did not go, it stopped reading — one write made no
    progress for that long (DESIGN.md §5 "client stops reading for --client-write-timeout"): also
    a cap hit ``limit="client_write_timeout"``, ``outcome="closed"``, and one log line (``owner``:
    the caller's hash, its first 12 characters logged; ``committed``: the response had started).
    """
    metrics.CLIENT_DISCONNECTS.inc()
    if write_timeout is None:
        return
    metrics.cap_hit(WRITE_TIMEOUT_CAP, CLOSED)
    log.warning(
        "outcome row=client_write_timeout status=- code=- committed=%s cap=%s caller=%s seconds=%g",
        committed,
        WRITE_TIMEOUT_CAP,
        owner[:12] or "-",
        write_timeout,
    )


def stream_error_codes() -> frozenset[str]:
    """The codes the gateway itself can send after commit (the bounded ``code`` label of
    ``loopwarden_stream_errors_total``; an upstream's own code is folded into ``upstream_error``)."""
    return frozenset({row.code or UPSTREAM_DEFAULT_CODE for row in OUTCOMES.values() if row.after_commit})


def record(outcome: Outcome, *, owner: str = "", limit: int | None = None) -> None:
    """Count `outcome` (cap hits, stream errors, upstream errors) and write its one log line.

    ``owner``: the caller's hash (its first 12 characters are logged); ``limit``: the limit in
    force for the row (bytes or calls), logged with the failure's numbers.
    """
    row = OUTCOMES[outcome.row]
    if row.replay:
        metrics.RETRY_SHIELD_HITS.inc()
    if outcome.cap is not None:
        metrics.cap_hit(outcome.cap, outcome.cap_outcome)
    if outcome.committed:
        metrics.STREAM_ERRORS.labels(code=metrics.stream_error_label(outcome.code)).inc()
    if row.upstream and isinstance(outcome.error, UpstreamError):
        metrics.UPSTREAM_ERRORS.labels(kind=outcome.error.kind).inc()
    facts: dict[str, Any] = {}
    error = outcome.error
    if isinstance(error, Failure):
        facts.update(error.facts)
    elif isinstance(error, BudgetExceeded):
        facts.update(phase=error.phase, requested=error.requested, charged=error.charged, limit=error.limit)
    elif isinstance(error, PoolExhausted):
        facts.update(phase=error.phase, requested=error.requested)
    if limit is not None:
        facts.setdefault("limit", limit)
    line = " ".join(f"{k}={v}" for k, v in facts.items())
    level = logging.ERROR if outcome.row == "internal" else logging.WARNING
    log.log(
        level,
        "outcome row=%s status=%s code=%s committed=%s cap=%s retry=%s side_effects=%s caller=%s%s",
        outcome.row,
        outcome.status,
        outcome.code,
        outcome.committed,
        outcome.cap or "-",
        "yes" if retryable(outcome) else "no",
        outcome.after_tools,
        owner[:12] or "-",
        f" {line}" if line else "",
        exc_info=error if outcome.row == "internal" and error is not None else None,
    )


def markdown_table() -> str:
    """The README's outcome table, generated from `OUTCOMES` (``python -m middleware.outcomes``
    prints it; a test keeps the README equal to it)."""
    lines = [
        "| situation | before commit | after commit | code | cap hit (`limit`) | retry |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in OUTCOMES.items():
        status = "upstream's own" if row.status == 0 else str(row.status)
        if row.replay:
            status = "the original's (same body and headers, `loopwarden-retry-shield: hit`)"
        extras = [
            name
            for name, on in (("`Connection: close`", row.close), ("`Retry-After`", row.retry_after))
            if on
        ]
        before = status + (f" ({', '.join(extras)})" if extras else "")
        after = "`error` + `response.failed`" if row.after_commit else "—"
        if row.code:
            code = f"`{row.code}`"
        elif row.replay:
            code = "the original's"
        elif row.upstream:
            code = f"the upstream's, else `{UPSTREAM_DEFAULT_CODE}`"
        else:
            code = ", ".join(f"`{c}`" for c in row.named)
        cap = f"`{row.cap}`" if row.cap else "—"
        retry = (
            "no (`x-should-retry: false`)"
            if row.deterministic
            else ("409/429 only" if key == "upstream_4xx" else "yes")
        )
        if row.shield:
            retry += "; shielded"
        lines.append(f"| {row.situation} | {before} | {after} | {code} | {cap} | {retry} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - a documentation helper
    print(markdown_table(), end="")
