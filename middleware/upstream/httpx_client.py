"""The upstream (model server) HTTP client, behind a small interface.

`UpstreamClient.post(path, body, stream=...)` opens one request to the Responses-compatible model
server and returns an `UpstreamResponse` whose body is read incrementally with `chunks()`.
Transport failures are raised as `UpstreamError` subclasses whose ``kind`` is the
``loopwarden_upstream_errors_total`` label (DESIGN.md §8) — never a bare httpx exception — so the
outcome authority can map them to DESIGN.md §5 (timeouts -> 504 ``upstream_timeout``, the rest ->
502). Two implementations: `HttpxUpstream` here and `middleware.upstream.aiohttp_client.AiohttpUpstream`
(the default, several times cheaper in CPU), chosen with the ``upstream_client`` setting.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import httpx

from middleware.errors import GatewayError, redact
from middleware.ops import metrics
from middleware.ops.request_id import REQUEST_ID


class UpstreamError(Exception):
    """Base of every upstream transport failure.

    ``kind`` is one of connect, timeout, eof, protocol, decode (the metric label);
    ``code`` is the DESIGN.md §5 error code.
    """

    kind = "protocol"
    code = "upstream_invalid_response"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UpstreamTimeout(UpstreamError):
    """Connect, first-byte, idle-read or whole-call deadline passed. ``phase`` says which."""

    kind = "timeout"
    code = "upstream_timeout"

    def __init__(self, message: str, *, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


class UpstreamConnectError(UpstreamError):
    """The model server could not be reached (refused, DNS, TLS)."""

    kind = "connect"
    code = "upstream_unavailable"


class UpstreamIncomplete(UpstreamError):
    """The body or stream ended early (connection closed before the declared end)."""

    kind = "eof"
    code = "upstream_incomplete"


class UpstreamDecodeError(UpstreamError):
    """The body could not be decoded, or came with a content encoding the gateway refuses."""

    kind = "decode"
    code = "upstream_invalid_response"


class UpstreamResponse(Protocol):
    """One upstream answer: status, lower-cased headers, and its body read incrementally."""

    status_code: int
    headers: Mapping[str, str]

    def chunks(self) -> AsyncIterator[bytes]:
        """Yield decoded body bytes as they arrive; raises UpstreamError subclasses."""
        ...

    async def aclose(self) -> None:
        """Release the connection (idempotent)."""
        ...


class UpstreamClient(Protocol):
    """A process-wide client for one model server."""

    async def post(self, path: str, body: bytes, *, stream: bool) -> UpstreamResponse:
        """POST `body` (JSON bytes) to ``base_url + path``; raises UpstreamError subclasses."""
        ...

    async def get(self, path: str) -> UpstreamResponse:
        """GET ``base_url + path`` (e.g. ``/models``); raises UpstreamError subclasses."""
        ...

    async def aclose(self) -> None:
        """Close every pooled connection."""
        ...


def _translate(exc: httpx.HTTPError, *, during: str, timeouts: httpx.Timeout) -> UpstreamError:
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return UpstreamTimeout(
            f"upstream did not accept the connection within {timeouts.connect} s", phase="connect"
        )
    if isinstance(exc, httpx.TimeoutException):
        phase = "first_byte" if during == "headers" else "read"
        what = "send response headers" if during == "headers" else "send more of its body"
        return UpstreamTimeout(f"upstream did not {what} within {timeouts.read} s", phase=phase)
    if isinstance(exc, httpx.ConnectError):
        return UpstreamConnectError(f"cannot connect to the upstream: {exc}")
    if isinstance(exc, httpx.DecodingError):
        return UpstreamDecodeError(f"upstream body could not be decoded: {exc}")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return UpstreamIncomplete(f"upstream closed the connection early: {exc}")
    return UpstreamError(f"upstream request failed: {exc}")


class CallTiming:
    """The timing metrics of one upstream call, each observed once: ``first_byte()`` at the first
    body byte (``loopwarden_upstream_ttfb_seconds``), ``done()`` when the response is closed
    (``loopwarden_upstream_duration_seconds``; True the first time). ``started``: monotonic seconds."""

    __slots__ = ("_done", "_first_byte", "_started")

    def __init__(self, started: float) -> None:
        self._started = started
        self._first_byte = False
        self._done = False

    def first_byte(self) -> None:
        if not self._first_byte:
            self._first_byte = True
            metrics.UPSTREAM_TTFB.observe(time.monotonic() - self._started)

    def done(self) -> bool:
        if self._done:
            return False
        self._done = True
        metrics.UPSTREAM_DURATION.observe(time.monotonic() - self._started)
        return True


class _HttpxResponse:
    """`UpstreamResponse` over an httpx streaming response, with the whole-call deadline."""

    def __init__(
        self, response: httpx.Response, deadline: float, timeouts: httpx.Timeout, started: float
    ) -> None:
        self._response = response
        self._timing = CallTiming(started)
        self._deadline = deadline
        self._timeouts = timeouts
        self.status_code = response.status_code
        self.headers: Mapping[str, str] = {k.lower(): v for k, v in response.headers.items()}

    async def chunks(self) -> AsyncIterator[bytes]:
        iterator = self._response.aiter_raw()
        while True:
            try:
                async with asyncio.timeout_at(self._deadline):
                    chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise UpstreamTimeout(
                    "upstream call passed its whole-call deadline (--upstream-deadline)", phase="deadline"
                ) from None
            except httpx.HTTPError as exc:
                raise _translate(exc, during="body", timeouts=self._timeouts) from None
            if chunk:
                self._timing.first_byte()
                yield chunk

    async def aclose(self) -> None:
        self._timing.done()
        await self._response.aclose()


class HttpxUpstream:
    """`UpstreamClient` on httpx: one pooled AsyncClient per process, explicit limits and timeouts.

    ``connect_timeout``: seconds to open a connection. ``read_timeout``: seconds allowed for the
    first byte and between any two reads. ``deadline``: seconds for the whole call, headers and
    body. ``api_key``: sent as ``Authorization: Bearer`` (the operator's credential, never the
    client's). No cookies are kept: an upstream's Set-Cookie is never replayed for another client.
    ``keepalive``: reuse connections (False: one connection per call, for an upstream whose
    framing cannot be trusted, see `AiohttpUpstream`).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        deadline: float = 1800.0,
        max_connections: int = 100,
        keepalive: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeouts = httpx.Timeout(
            connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout
        )
        self._deadline = deadline
        # identity: a compressed body could inflate past every clamp before a byte is checked
        headers = {
            "content-type": "application/json",
            "user-agent": "loopwarden",
            "accept-encoding": "identity",
        }
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(
            timeout=self._timeouts,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections if keepalive else 0
            ),
            headers=headers,
            follow_redirects=False,
            trust_env=False,
            # keep no cookies: an upstream's Set-Cookie must never be replayed for another client
            cookies=http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[])),
        )

    async def post(self, path: str, body: bytes, *, stream: bool) -> UpstreamResponse:
        accept = "text/event-stream" if stream else "application/json"
        return await self._send(
            self._client.build_request("POST", self.base_url + path, content=body, headers={"accept": accept})
        )

    async def get(self, path: str) -> UpstreamResponse:
        return await self._send(
            self._client.build_request("GET", self.base_url + path, headers={"accept": "application/json"})
        )

    async def _send(self, request: httpx.Request) -> UpstreamResponse:
        rid = REQUEST_ID.get()
        if rid != "-":
            request.headers["x-request-id"] = rid  # correlate the upstream's logs with ours
        started = time.monotonic()
        deadline = asyncio.get_running_loop().time() + self._deadline
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._client.send(request, stream=True)
        except TimeoutError:
            raise UpstreamTimeout(
                "upstream call passed its whole-call deadline (--upstream-deadline)", phase="deadline"
            ) from None
        except httpx.HTTPError as exc:
            raise _translate(exc, during="headers", timeouts=self._timeouts) from None
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            await response.aclose()
            raise UpstreamDecodeError(
                f"upstream sent Content-Encoding {encoding!r} though the gateway asked for identity; "
                "compressed bodies are refused (they could inflate past the read clamps)"
            )
        return _HttpxResponse(response, deadline, self._timeouts, started)

    async def aclose(self) -> None:
        await self._client.aclose()


def upstream_status_error(status: int, body: bytes) -> GatewayError:
    """Normalise an upstream HTTP error answer into the §5 outcome (status, code, message).

    Counts ``loopwarden_upstream_errors_total{kind="status_4xx"|"status_5xx"}``.
    """
    metrics.UPSTREAM_ERRORS.labels(kind="status_5xx" if status >= 500 else "status_4xx").inc()
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
            code = raw_code if isinstance(raw_code, str) else None
            param = err.get("param") if isinstance(err.get("param"), str) else None
        elif isinstance(err, str):
            message = err
    message = redact(message)
    if status in (401, 403):
        return GatewayError(
            f"the upstream refused the gateway's credentials (HTTP {status}): {message}; "
            "check --upstream-api-key",
            status=502,
            code="upstream_auth_failed",
        )
    if status >= 500:
        return GatewayError(message, status=502, code=code or "upstream_error")
    if status in (400, 404, 409, 422, 429):
        return GatewayError(
            message, status=status, code=code or "upstream_error", param=param, retryable=status in (409, 429)
        )
    return GatewayError(message, status=502, code=code or "upstream_error")
