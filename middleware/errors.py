"""The gateway's exception tree and the OpenAI error envelope (DESIGN.md §5).

Every failure inside the gateway is raised as a `GatewayError` carrying its HTTP status, error
``code``, ``param`` and whether a retry can help; only the outcome authority turns one into an
answer — a JSON envelope before the response is committed, one SSE ``error`` frame after.
"""

from __future__ import annotations

import json
from typing import Any

from middleware.ops.request_id import REQUEST_ID


class GatewayError(Exception):
    """Base of every failure the gateway reports to its client.

    ``status``: HTTP status before commit. ``code``: the §5 error code. ``param``: the request
    field at fault, or None. ``retryable``: False for deterministic failures (400, 408, 413, 508,
    budget 502s), which then carry ``x-should-retry: false`` so SDKs do not multiply their cost.
    ``limit``: the ``loopwarden_cap_hits_total`` ``limit`` label when this failure is a cap hit.
    ``close_connection``: answer with ``Connection: close`` (the body was not read).
    ``retry_after``: seconds for a ``Retry-After`` header (overload refusals).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str,
        param: str | None = None,
        retryable: bool | None = None,
        limit: str | None = None,
        close_connection: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.close_connection = close_connection
        self.retry_after = retry_after
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.retryable = (status >= 500 and status != 508) if retryable is None else retryable


class InvalidRequest(GatewayError):
    """The client's request is malformed or names something invalid (400 by default)."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message, status=400, code=code, param=param, retryable=False)


_SECRETS: set[str] = set()


def register_secret(value: str | None) -> None:
    """Remember an operator secret (an upstream or gateway API key) so `redact` hides it."""
    if value and len(value) >= 6:
        _SECRETS.add(value)


def redact(text: str) -> str:
    """`text` with every registered secret replaced by ``***`` (upstream messages can echo keys)."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, "***")
    return text


def error_type(status: int) -> str:
    """The envelope ``type`` for a status: invalid_request_error (4xx) or server_error (5xx)."""
    return "invalid_request_error" if status < 500 else "server_error"


def with_request_id(message: str) -> str:
    """`message` with `` [request id <id>]`` appended when a request id is set (once)."""
    rid = REQUEST_ID.get()
    if rid == "-" or "[request id" in message:
        return message
    return f"{message} [request id {rid}]"


def envelope(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope ``{"error": {"message", "type", "param", "code"}}``; the message
    carries the request id (`with_request_id`), whichever route answers."""
    message = with_request_id(message)
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def envelope_bytes(error: GatewayError) -> bytes:
    """`envelope` of `error` as compact JSON bytes."""
    body = envelope(error.status, error.code, error.message, error.param)
    return json.dumps(body, separators=(",", ":")).encode()


def error_headers(
    error: GatewayError, *, extra: list[tuple[bytes, bytes]] | None = None
) -> list[tuple[bytes, bytes]]:
    """Response headers for a JSON error answer (content type, and x-should-retry when deterministic)."""
    headers = [(b"content-type", b"application/json")]
    if not error.retryable:
        headers.append((b"x-should-retry", b"false"))
    return headers + (extra or [])


def sse_error_frame(error: GatewayError, sequence_number: int) -> bytes:
    """The single terminal SSE error frame of DESIGN.md §5 (flat ResponseErrorEvent + nested error)."""
    data = {
        "type": "error",
        "sequence_number": sequence_number,
        "code": error.code,
        "message": error.message,
        "param": error.param,
        "error": {"type": error_type(error.status), "code": error.code, "message": error.message},
    }
    return b"event: error\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
