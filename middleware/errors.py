"""The gateway's failure tree: what went wrong, never how it is answered (DESIGN.md §5).

Raise sites raise a `Failure` that carries facts — the request field at fault (``param``), the
numbers (``facts``: bytes charged and the limit, seconds, inference calls) — and no HTTP status.
`middleware.outcomes` alone maps a failure (and whether the response is committed) to its status,
``code``, headers, SSE frames, stored status, metrics and log line.

```
Failure                          base: ``message``, ``param``, ``code`` (rows that let it name one), ``facts``
├── InvalidRequest               the client's request is malformed (400; ``code`` names the check)
├── InvalidHeader                a limit-lowering header out of range (400 invalid_header)
├── Unauthenticated              gateway API key missing or wrong (401 invalid_api_key)
├── NotFound                     unknown or another caller's response / conversation / item (404)
├── ModelNotFound                a model this gateway does not configure (404 model_not_found)
├── UnknownRoute                 no such path (404 unknown_url)
├── MethodNotAllowed             wrong method (405, ``allow``)
├── BodyTooLarge                 the raw body passes the clamp (413 request_too_large)
├── BodyTimeout                  the body did not arrive in time (408 request_timeout)
├── HeadTooLarge                 the request head passes --max-header-bytes (431 request_header_too_large)
├── HistoryTooLarge              the stored history does not fit the ledger (413 max_retained_bytes_exceeded)
├── StoredReadTooLarge           a stored response or item does not fit a read's ledger (413 max_retained_bytes_exceeded)
├── LoopLimitReached             gateway tools still called after max_infer_iters calls (508)
├── Overloaded                   the process pool is full (503 server_overloaded)
│   └── CallerShareFull          the caller's share of the pool is full (503 server_overloaded)
├── ProcessBudgetExceeded        one reservation larger than the whole pool (413)
│   └── CallerShareTooLarge      one reservation larger than a caller's whole share (413)
├── CallerShareExhausted         growth refused mid-request by the caller's share (413 / 502, by ``phase``)
├── ShuttingDown                 draining: refused, or the drain timeout passed (503)
├── WorkerLost                   a background response's worker stopped renewing its lease (502, stored failed)
├── DeadlineExceeded             --request-deadline passed (504)
├── McpServerUnavailable         an MCP server's tools/list failed (502)
├── PreviousResponseNotFound     a WebSocket turn's previous_response_id is in neither connection memory nor the store (400)
├── WebSocketLifetimeReached     a WebSocket connection passed --websocket-max-lifetime (400 websocket_connection_limit_reached)
├── WebSocketIdle                no message on a WebSocket within --websocket-idle-timeout (408 websocket_idle_timeout)
├── WebSocketMessageTooLarge     a WebSocket message over the body clamp (413 request_too_large)
├── ShieldHit                    the retry shield answers a repeated failed request (its original status)
└── UpstreamError                (middleware.upstream.errors) the model server failed
```

`budget.BudgetExceeded`, `budget.PoolExhausted` and the store's `StoreUnavailable` are failures too; the outcome table maps them
by their ``phase`` (the initial payload and restored history are 413, anything later 502).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from middleware.ops.shield import Remembered


class Failure(Exception):
    """Base of every failure the gateway reports to its client.

    ``message``: what went wrong and what to change (never user content beyond a short excerpt).
    ``param``: the request field or header at fault, or None. ``code``: the error code, for the
    rows whose code the failure names itself (validation checks, an upstream's own code); None
    takes the row's. ``facts``: numbers for the structured log line (bytes, seconds, calls).
    ``row``: the key of its row in `middleware.outcomes.OUTCOMES` (a class attribute).
    """

    row: ClassVar[str] = "internal"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, **facts: int | float | str
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.facts = facts


class InvalidRequest(Failure):
    """The client's request is malformed or names something invalid; ``code`` names the check
    (``invalid_value``, ``invalid_type``, ``json_too_deep``, ``mcp_server_not_allowed``, …)."""

    row = "invalid_request"

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message, code=code, param=param)


class InvalidHeader(Failure):
    """A ``loopwarden-max-*`` header that is not an integer in its limit's range."""

    row = "invalid_header"


class Unauthenticated(Failure):
    """The gateway API key is missing or wrong (when keys are configured)."""

    row = "invalid_api_key"


class NotFound(Failure):
    """An unknown id, or another caller's object (answered exactly alike)."""

    row = "not_found"


class ModelNotFound(Failure):
    """The request's ``model`` is not one of the configured models."""

    row = "model_not_found"


class UnknownRoute(Failure):
    """No route has this path."""

    row = "unknown_url"


class MethodNotAllowed(Failure):
    """The path exists but not with this method; ``allow`` is the ``Allow`` header value."""

    row = "method_not_allowed"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow


class BodyTooLarge(Failure):
    """The raw body passes its clamp (facts ``size`` and ``clamp``, bytes)."""

    row = "request_too_large"


class BodyTimeout(Failure):
    """The whole body was not received within ``--client-body-timeout`` (fact ``seconds``)."""

    row = "request_timeout"


class HeadTooLarge(Failure):
    """The request head (request line and headers) passes ``--max-header-bytes`` (facts ``size``
    and ``limit``, bytes); answered by the connection guard (`middleware.ops.connections`)
    before any request exists."""

    row = "request_head_too_large"


class HistoryTooLarge(Failure):
    """The history named by ``previous_response_id`` or ``conversation`` (``param``) does not fit
    the request's ledger; nothing of it was decoded. Facts ``requested``, ``charged``, ``limit``
    (budget bytes) are those of the ledger's `budget.BudgetExceeded`."""

    row = "budget_initial"


class StoredReadTooLarge(Failure):
    """A stored response, or the first item of a page, does not fit the ledger of the read
    (``GET /v1/responses/{id}``, ``…/input_items``, ``GET /v1/conversations/{id}/items``;
    `middleware.store.reads`); nothing of it was fetched or decoded. Facts ``requested``,
    ``charged``, ``limit`` (budget bytes) are those of the ledger's `budget.BudgetExceeded`."""

    row = "store_read_too_large"


class LoopLimitReached(Failure):
    """The model still called gateway tools after ``max_infer_iters`` inference calls."""

    row = "max_infer_iters"


class Overloaded(Failure):
    """Admission control: the worker's pool (bytes, requests or memory pressure) is full."""

    row = "server_overloaded"


class ProcessBudgetExceeded(Failure):
    """One request's reservation is larger than the whole process pool."""

    row = "process_budget_exceeded"


class CallerShareFull(Overloaded):
    """Admission control: the caller's share of the pool (``--max-inflight-share-per-caller``) is
    full; refused before its body is read. Facts: ``requested``, ``held``, ``share`` (bytes)."""

    row = "caller_share_full"


class CallerShareTooLarge(ProcessBudgetExceeded):
    """One request's reservation is larger than a caller's whole share of the pool: no caller can
    ever send it. Facts: ``requested``, ``limit`` (the share, bytes)."""

    row = "caller_share_too_large"


class CallerShareExhausted(Failure):
    """A ledger charge mid-request was refused because the caller's share of the pool is full:
    the `budget.PoolExhausted` the ledger raised, explained (``middleware.asgi.intake.Intake.explain``).

    ``phase``: the ledger phase (``budget.Phase``); the outcome table answers 413 for the initial
    payload, restored history and a lowered limit, 502 (or an SSE error frame) later. Facts:
    ``requested``, ``held``, ``share`` (bytes).
    """

    row = "caller_share_later"

    def __init__(self, message: str, *, phase: str, requested: int, held: int, share: int) -> None:
        super().__init__(message, phase=phase, requested=requested, held=held, share=share)
        self.phase = phase


class ShuttingDown(Failure):
    """The gateway is draining: a new request is refused, or one still running passed the drain
    timeout (``refused`` tells which: a refused request's body was not read)."""

    row = "server_shutting_down"

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class WorkerLost(Failure):
    """A background response's worker stopped renewing its lease (it died or lost the store) for
    ``--background-lease-seconds`` (fact ``seconds``): another worker stores it ``failed``."""

    row = "background_worker_lost"


class DeadlineExceeded(Failure):
    """The whole request did not finish within ``--request-deadline`` (fact ``seconds``)."""

    row = "request_deadline"


class McpServerUnavailable(Failure):
    """An MCP server's ``tools/list`` failed (unreachable, timeout, protocol error)."""

    row = "mcp_server_unavailable"


class PreviousResponseNotFound(Failure):
    """A WebSocket turn's ``previous_response_id`` is neither the connection's most recent
    response (connection-local memory) nor, with ``store`` on, a stored response of the caller
    (Open Responses, "WebSocket Continuation": ``previous_response_not_found``)."""

    row = "previous_response_not_found"


class WebSocketLifetimeReached(Failure):
    """A WebSocket connection is older than ``--websocket-max-lifetime`` (fact ``seconds``); the
    spec's ``websocket_connection_limit_reached``, then the connection closes (1001)."""

    row = "websocket_lifetime"


class WebSocketIdle(Failure):
    """No message arrived on a WebSocket connection between turns within
    ``--websocket-idle-timeout`` (fact ``seconds``); then the connection closes (1001)."""

    row = "websocket_idle"


class WebSocketMessageTooLarge(Failure):
    """A WebSocket message is larger than the body clamp of the request it would be (facts
    ``size`` and ``clamp``, bytes); then the connection closes (1009)."""

    row = "websocket_message_too_large"


class ShieldHit(Failure):
    """The same caller sent a request identical to one that failed deterministically within
    ``--retry-shield-seconds`` (`middleware.ops.shield.RetryShield`): ``answer`` is the remembered
    answer, sent again as it was. Facts: ``original_row``, ``original_request_id``, ``age``
    (seconds since the failure)."""

    row = "retry_shield"

    def __init__(self, answer: Remembered, *, age: float) -> None:
        super().__init__(
            f"an identical request from this caller failed {age:.1f} s ago; the same answer is sent again",
            code=answer.code,
            original_row=answer.row,
            original_request_id=answer.request_id,
            age=round(age, 3),
        )
        self.answer = answer


def choices_text(choices: tuple[str, ...]) -> str:
    """The allowed values of a setting or field as every "must be …" message lists them:
    ``a``, ``a or b``, ``a, b or c`` (in the given order, however many)."""
    if len(choices) < 2:
        return "".join(choices)
    return ", ".join(choices[:-1]) + " or " + choices[-1]
