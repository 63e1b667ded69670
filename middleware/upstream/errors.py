"""The upstream's failures, as one tree (DESIGN.md §5 upstream rows).

```
UpstreamError (Failure)          kind = the loopwarden_upstream_errors_total label
├── UpstreamTimeout              connect / first byte / idle read / whole-call deadline (``phase``)
├── UpstreamConnectError         unreachable: refused, DNS, TLS, reset before headers
├── UpstreamIncomplete           the body or stream ended early; bad framing or encoding
├── UpstreamInvalid              a protocol violation: not JSON, wrong types, duplicate call_ids
│   └── UpstreamDecodeError      undecodable body, or a content encoding the gateway refuses
├── UpstreamBodyTooLarge         a buffered body's Content-Length over its clamp
├── UpstreamStatus               an HTTP error answer (``status``, the upstream's code, param, headers)
└── UpstreamStreamError          an in-band ``error`` event (the upstream's code and message)
```

Each library's exceptions are translated into this tree by its client module
(`middleware.upstream.httpx_client`, `middleware.upstream.aiohttp_client`); `status_failure`,
`stream_error_failure` and `read_limited` build the two answer-shaped failures. The HTTP status of
each row is `middleware.outcomes`'s to decide.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from middleware.errors import Failure
from middleware.ops.redact import redact
from middleware.upstream.protocol import UpstreamResponse

ERROR_BODY_LIMIT = 64 * 1024  # bytes of an upstream error body read for its message


class UpstreamError(Failure):
    """Base of every upstream failure; ``kind`` is one of connect, timeout, eof, protocol,
    decode, status_4xx, status_5xx, stream_error (the metric label)."""

    kind = "protocol"
    row = "upstream_invalid"
    code: str | None = "upstream_invalid_response"


class UpstreamTimeout(UpstreamError):
    """Connect, first-byte, idle-read or whole-call deadline passed. ``phase`` says which."""

    kind = "timeout"
    row = "upstream_timeout"
    code = "upstream_timeout"

    def __init__(self, message: str, *, phase: str) -> None:
        super().__init__(message, phase=phase)
        self.phase = phase


class UpstreamConnectError(UpstreamError):
    """The model server could not be reached (refused, DNS, TLS)."""

    kind = "connect"
    row = "upstream_unavailable"
    code = "upstream_unavailable"


class UpstreamIncomplete(UpstreamError):
    """The body or stream ended early, or its framing or encoding is broken."""

    kind = "eof"
    row = "upstream_incomplete"
    code = "upstream_incomplete"


class UpstreamInvalid(UpstreamError):
    """The upstream broke the protocol: not JSON, wrong types in fields the gateway relies on,
    duplicate ``call_id``s, an answer that cannot be re-encoded."""

    kind = "protocol"
    row = "upstream_invalid"


class UpstreamDecodeError(UpstreamInvalid):
    """The body could not be decoded, or came with a content encoding the gateway refuses."""

    kind = "decode"


class UpstreamBodyTooLarge(UpstreamError):
    """A buffered body declares more bytes than its clamp (facts ``size``, ``clamp``)."""

    kind = "protocol"
    row = "upstream_body_too_large"
    code = "upstream_response_too_large"


class UpstreamStatus(UpstreamError):
    """The upstream answered an HTTP error. ``status``: its status; ``code`` / ``param``: from its
    envelope when it sent one; ``passed_headers``: its lower-cased headers (the outcome table
    passes ``Retry-After`` and ``x-ratelimit-*`` on)."""

    code = None

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code, param=param, upstream_status=status)
        self.status = status
        self.kind = "status_5xx" if status >= 500 else "status_4xx"
        self.passed_headers: tuple[tuple[str, str], ...] = tuple((headers or {}).items())


class UpstreamStreamError(UpstreamError):
    """An in-band upstream ``error`` event; ``code`` and message are the upstream's."""

    kind = "stream_error"
    row = "upstream_stream_error"
    code = None


async def read_limited(response: UpstreamResponse, limit: int = ERROR_BODY_LIMIT) -> bytes:
    """At most `limit` bytes of an upstream body (for error messages)."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.chunks():
        parts.append(chunk[: limit - size])
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)


def status_failure(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> UpstreamStatus:
    """An upstream HTTP error answer as `UpstreamStatus`: its envelope's message, code and param
    when it sent one (else its text), secrets redacted, 401/403 explained as the gateway's
    credentials."""
    message, code, param = f"upstream answered HTTP {status}", None, None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
        text = body[:500].decode("utf-8", "replace").strip()
        if text:
            message = f"{message}: {text}"
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        if isinstance(err, dict):
            if isinstance(err.get("message"), str):
                message = err["message"]
            raw_code = err.get("code") or err.get("type")
            code = raw_code[:200] if isinstance(raw_code, str) else None
            param = err.get("param") if isinstance(err.get("param"), str) else None
        elif isinstance(err, str):
            message = err
    message = redact(message)[:4000]
    if status in (401, 403):
        message = f"the upstream refused the gateway's credentials (HTTP {status}): {message}; check --upstream-api-key"
    return UpstreamStatus(message, status=status, code=code, param=param, headers=headers)


def stream_error_failure(obj: Mapping[str, Any]) -> UpstreamStreamError:
    """An in-band upstream ``error`` event (the flat ``ResponseErrorEvent`` shape or the nested
    ``{"error": {...}}`` one) as `UpstreamStreamError`, its code and message kept."""
    raw_nested = obj.get("error")
    nested: Mapping[str, Any] = raw_nested if isinstance(raw_nested, dict) else {}
    message = obj.get("message") or nested.get("message") or "upstream reported an error"
    code = obj.get("code") or nested.get("code") or nested.get("type") or "upstream_error"
    return UpstreamStreamError(redact(str(message))[:4000], code=str(code)[:200])
