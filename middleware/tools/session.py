"""Opening one MCP session: `open_session`, the HTTP transport under it, and what it learns.

`open_session(endpoint)` is an ``async with`` that yields a connected ``mcp.Client`` over streamable
HTTP, stdio or the SDK's in-memory path. Over HTTP its transport (`_GatewayTransport`) turns a
failed or refused request into an error for that request alone, instead of letting it tear the
whole session down, and records what it learnt about the session in `SessionHealth`; a stdio
server's exit is recorded there too. `call_not_run` and `session_failed` read such an error back:
was the request proven never to have run (safe to send again)? may the session be broken?

No redirect is ever followed (the SDK follows same-origin ones itself, and another path on the
same host may be outside the allowlist): a 3xx fails the request it answers, naming the status.
Answers are bounded (`DEFAULT_MAX_MESSAGE_BYTES` per MCP message; `MessageTooLarge`, marked with
`ANSWER_TOO_LARGE`), compressed answers are refused, and lone surrogate escapes are rewritten
before the SDK parses them (`middleware.tools.text.SurrogateEscapeFixer`). A request sent inside
``with metering(meter):`` has every byte of its HTTP answer shown to `meter` (an `AnswerMeter`)
before the SDK sees it, so the answer can be charged, or refused, before it is parsed.
"""

from __future__ import annotations

import contextvars
import functools
import json
import secrets
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final, Protocol

import anyio
import anyio.lowlevel
import httpx2
import mcp
from mcp.client import Transport
from mcp.client.session import IncomingMessage, MessageHandlerFnT
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, METHOD_NOT_FOUND, ToolListChangedNotification

from middleware.tools.endpoints import Endpoint
from middleware.tools.text import SurrogateEscapeFixer

__all__ = [
    "ANSWER_TOO_LARGE",
    "DEFAULT_CLOSE_TIMEOUT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "AnswerMeter",
    "AnswerRefused",
    "MessageTooLarge",
    "SessionHealth",
    "call_not_run",
    "metering",
    "open_session",
    "session_failed",
]

# The largest MCP message (an SSE event or a JSON body, bytes) `open_session` accepts by default.
DEFAULT_MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024

# Marks the transport's refusal of an oversized answer in the error the SDK hands back.
ANSWER_TOO_LARGE = "answer is over the per-call answer bound"

# Marks the JSON-RPC errors this module's transport makes up for a request the server did not answer
# (`_failure_response`). Random per process, so a server cannot forge it: it never leaves the process.
_FAILURE_MARK: Final = secrets.token_hex(16)
# Transport errors raised before a byte of the request reached the server.
_NOT_SENT: Final = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)


class MessageTooLarge(httpx2.StreamError):
    """A JSON answer from an MCP server passed `open_session`'s ``max_message_bytes``.

    A ``StreamError`` because that is what the SDK turns into a JSON-RPC error for the one request
    concerned (code -32700, "Failed to parse JSON response: …"), leaving the session usable.
    """


class AnswerRefused(httpx2.StreamError):
    """An `AnswerMeter` refused an answer while it was read (its ``feed`` raised; the reason is
    the ``__cause__``). A ``StreamError``, like `MessageTooLarge`, so that the SDK fails only the
    request it answers and the session stays usable."""


class AnswerMeter(Protocol):
    """Sees every byte of the HTTP answers to the requests sent inside ``with metering(meter):``.

    `feed` is called with each chunk of an answer body (JSON or SSE, bytes as received, before
    the SDK buffers or parses them); raising any ``Exception`` refuses the answer: reading stops,
    and the request fails with `AnswerRefused`. Called synchronously, from the task that sends
    the request's HTTP POST (the SDK runs it in a copy of the sender's context).
    """

    def feed(self, chunk: bytes) -> None:
        """Account for `chunk` (bytes), or raise to refuse the answer."""
        ...


# The meter of the requests the current task sends (`metering`). The SDK's streamable-HTTP client
# runs each request's POST in a copy of the context of the task that sent the request
# (``ContextSendStream``), so the transport, deep in the session's own tasks, sees the sender's.
_METER: contextvars.ContextVar[AnswerMeter | None] = contextvars.ContextVar(
    "loopwarden_mcp_meter", default=None
)


@contextmanager
def metering(meter: AnswerMeter | None) -> Iterator[None]:
    """Show the HTTP answers to the MCP requests this task sends inside the block to `meter`.

    Only streamable-HTTP sessions have answers to show; in-process and stdio sessions never call
    `meter`. Requests the session sends on its own (the handshake, the SDK's own background
    work) are not metered: they are sent from the session's owner task.
    """
    token = _METER.set(meter)
    try:
        yield
    finally:
        _METER.reset(token)


class _BodyReadFailed(httpx2.StreamError):
    """The connection failed while a JSON answer was being read: a ``StreamError`` for the same
    reason as `MessageTooLarge` (the SDK fails that one request instead of the whole session)."""


class SessionHealth:
    """What the transport of one session has learnt about it, for `SessionPool`.

    ``established`` — the session's handshake is done (set by `open_session`); ``failure`` — None
    while the session looks usable, else why it is not (the server answered 404 for its
    ``Mcp-Session-Id``, a request's connection failed, or the transport's read side ended).
    `on_failure` (optional) is called once, synchronously, when ``failure`` is first set.
    """

    __slots__ = ("established", "failure", "on_failure")

    def __init__(self, on_failure: Callable[[], None] | None = None) -> None:
        self.established = False
        self.failure: str | None = None
        self.on_failure = on_failure

    def fail(self, reason: str) -> None:
        """Record `reason` (the first one is kept) and tell `on_failure`."""
        if self.failure is None:
            self.failure = reason
            if self.on_failure is not None:
                self.on_failure()


def _failure_response(request: httpx2.Request, message: str, *, not_run: bool) -> httpx2.Response:
    """A JSON-RPC error answer standing in for one the server did not give.

    The SDK hands it to the one request concerned as an ``MCPError`` (code -32000) instead of
    letting the exception tear down the whole session; `call_not_run` reads ``not_run`` back.
    """
    error = {
        "code": CONNECTION_CLOSED,
        "message": message,
        "data": {"loopwarden": _FAILURE_MARK, "not_run": not_run},
    }
    return httpx2.Response(502, json={"jsonrpc": "2.0", "id": None, "error": error}, request=request)


async def _small_json_body(response: httpx2.Response, limit: int = 65_536) -> dict[str, Any] | None:
    """The JSON object of an uncompressed JSON `response` of at most `limit` bytes, else None; the
    response is read (up to `limit` bytes) and closed either way."""
    body = b""
    try:
        kind = response.headers.get("content-type", "").lower()
        encoding = response.headers.get("content-encoding", "identity").lower()
        if not kind.startswith("application/json") or encoding != "identity":
            return None
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        async for chunk in response.stream:
            body += chunk
            if len(body) > limit:
                return None
    finally:
        await response.aclose()
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def call_not_run(exc: BaseException) -> bool:
    """Whether `exc`, raised by a request on a session from `open_session`, proves that the server
    never acted on that request, so that sending it again cannot run it twice.

    True only for the gateway's own stand-in errors for a request that was never sent (connecting
    failed) or that the server refused with HTTP 404 for an unknown or expired ``Mcp-Session-Id``
    (MCP spec, streamable HTTP "Session Management": the client must start a new session). Every
    other failure — a connection lost mid-request, a timeout, a server error — is not proof.
    """
    if not isinstance(exc, MCPError) or not isinstance(exc.error.data, dict):
        return False
    return exc.error.data.get("loopwarden") == _FAILURE_MARK and exc.error.data.get("not_run") is True


def session_failed(exc: BaseException) -> bool:
    """Whether `exc`, raised by a request on a session from `open_session`, says the *session*
    (not just the request) may be unusable: the connection closed or failed, or the server forgot
    the session. A tool error, a JSON-RPC error from the server or an oversized answer is not."""
    if isinstance(exc, MCPError):
        return exc.error.code == CONNECTION_CLOSED
    return not isinstance(exc, RuntimeError | ValueError)  # the SDK's result validation errors


class _FixedStream(httpx2.AsyncByteStream):
    """A response body passed through `SurrogateEscapeFixer`; when `limit` is set, more than
    `limit` bytes raise `MessageTooLarge` (the body is never held whole past it); when `meter` is
    set, each chunk is shown to it first, and its refusal raises `AnswerRefused`."""

    def __init__(
        self,
        inner: httpx2.AsyncByteStream,
        limit: int | None,
        health: SessionHealth,
        meter: AnswerMeter | None = None,
    ) -> None:
        self._inner = inner
        self._limit = limit
        self._health = health
        self._meter = meter

    async def __aiter__(self) -> AsyncIterator[bytes]:
        fixer = SurrogateEscapeFixer()
        seen = 0
        try:
            async for chunk in self._inner:
                seen += len(chunk)
                if self._limit is not None and seen > self._limit:
                    raise MessageTooLarge(
                        f"the MCP server's {ANSWER_TOO_LARGE} of {self._limit:,} bytes "
                        "(--tool-max-result-bytes sets this bound)"
                    )
                if self._meter is not None:
                    try:
                        self._meter.feed(chunk)
                    except Exception as exc:
                        raise AnswerRefused(f"the answer was refused while it was read: {exc}") from exc
                if fixed := fixer.feed(chunk):
                    yield fixed
        except httpx2.TransportError as exc:
            if self._limit is None:  # an SSE body: the SDK fails the one request itself
                raise
            self._health.fail(f"the connection failed while an answer was read ({type(exc).__name__})")
            raise _BodyReadFailed(
                f"the connection failed while the answer was read ({type(exc).__name__})"
            ) from exc
        if tail := fixer.flush():
            yield tail

    async def aclose(self) -> None:
        await self._inner.aclose()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx2's default verifying context, built once: building it costs about 20 ms, which a
    per-session transport would otherwise pay on every `open_session`."""
    return httpx2.create_ssl_context()


class _GatewayTransport(httpx2.AsyncBaseTransport):
    """The HTTP transport under one MCP session.

    * JSON and SSE response bodies (uncompressed ones only) pass through `SurrogateEscapeFixer`;
      JSON bodies are bounded to `max_json_bytes` (SSE events have the SDK's own bound).
    * Once the session is established, a POST whose connection fails does not raise (the SDK would
      tear the whole session down, failing every call on it): it is answered with a JSON-RPC error
      for that one request (`_failure_response`), and `health` records the failure.
    * A 404 to a request carrying an ``Mcp-Session-Id`` marks the session expired; a POST gets the
      not-run error (`call_not_run`).
    * A redirect (any 3xx) is never followed, by the SDK or anyone (`_refuse_redirect`): a POST's
      becomes a JSON-RPC error naming the status, and the session is marked failed.
    * A DELETE (ending the session) is bounded to `close_timeout` seconds.
    """

    def __init__(self, max_json_bytes: int, *, health: SessionHealth, close_timeout: float) -> None:
        self._inner = httpx2.AsyncHTTPTransport(verify=_ssl_context())
        self._max_json_bytes = max_json_bytes
        self._health = health
        self._close_timeout = close_timeout

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        """Send `request`; what the SDK sees is never a redirect, a compressed body or an unbounded
        JSON body, and a failure that says whether the request ran becomes a JSON-RPC error
        (`_failure_response`). Raises `MessageTooLarge` for a compressed answer."""
        try:
            response = await self._send(request)
        except httpx2.TransportError as exc:
            if request.method != "POST" or not self._health.established:
                raise
            not_sent = isinstance(exc, _NOT_SENT)
            self._health.fail(f"a request's connection failed ({type(exc).__name__})")
            message = (
                f"could not reach the MCP server ({type(exc).__name__}); the request was not sent"
                if not_sent
                else f"the connection to the MCP server failed ({type(exc).__name__}) with the request in flight"
            )
            return _failure_response(request, message, not_run=not_sent)
        if 300 <= response.status_code < 400:
            return await self._refuse_redirect(request, response)
        if response.status_code == 404 and "mcp-session-id" in request.headers and request.method != "DELETE":
            return await self._session_404(request, response)
        return await self._bounded(response)

    async def _send(self, request: httpx2.Request) -> httpx2.Response:
        """The inner transport's response; a session's closing DELETE within ``close_timeout`` s."""
        if request.method == "DELETE":
            with anyio.fail_after(self._close_timeout):
                return await self._inner.handle_async_request(request)
        return await self._inner.handle_async_request(request)

    async def _session_404(self, request: httpx2.Request, response: httpx2.Response) -> httpx2.Response:
        """A 404 to a request on a session: a JSON-RPC "method not found" passes through; an
        answer to this very request may have run it; otherwise the session is gone (not run)."""
        body = await _small_json_body(response)
        answer = body.get("error") if body is not None else None
        if isinstance(answer, dict) and answer.get("code") == METHOD_NOT_FOUND:
            return httpx2.Response(404, json={"jsonrpc": "2.0", "id": None, "error": answer}, request=request)
        if request.method == "POST" and body is not None and body.get("id") is not None:
            # An answer to this very request (its id), not the session layer's refusal (the
            # SDK's "Session not found" carries id null): the server's dispatcher saw the
            # request, so it may have run — never proof that it did not.
            self._health.fail("the server answered HTTP 404 to a request on the session")
            return _failure_response(
                request,
                "the MCP server answered the request with HTTP 404; it may have been run",
                not_run=False,
            )
        self._health.fail("the server answered 404 for the session (it expired or the server restarted)")
        if request.method == "POST":
            return _failure_response(
                request,
                "the MCP server does not know this session any more (HTTP 404); the request was not run",
                not_run=True,
            )
        return httpx2.Response(404, request=request)

    async def _bounded(self, response: httpx2.Response) -> httpx2.Response:
        """`response` with its JSON body bounded by ``max_json_bytes`` and its JSON and SSE bodies
        metered (`_FixedStream`); raises `MessageTooLarge` for a compressed answer."""
        kind = response.headers.get("content-type", "").lower()
        encoding = response.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            # A compressed answer could inflate past every bound before a byte is checked: refuse it
            # (the request asked for identity), failing only the MCP request it answers.
            await response.aclose()
            raise MessageTooLarge(
                f"the MCP server sent Content-Encoding {encoding!r} though identity was asked for; "
                "compressed answers are refused"
            )
        if not kind.startswith(("application/json", "text/event-stream")):
            return response
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_FixedStream(
                response.stream,
                self._max_json_bytes if kind.startswith("application/json") else None,
                self._health,
                _METER.get(),
            ),
            extensions=response.extensions,
        )

    async def _refuse_redirect(self, request: httpx2.Request, response: httpx2.Response) -> httpx2.Response:
        """What the client sees instead of a 3xx `response`: never a redirect it could follow.

        The SDK follows a redirect within the endpoint's origin itself (whatever the client's
        ``follow_redirects``), and another path on the same host may be outside the allowlist;
        so the 3xx is closed unread here. A POST gets a JSON-RPC error for its one request (the
        server saw the request, so it may have run: never retried); a GET (the standalone stream)
        or a DELETE gets a bare 502. The message names the status only, never the ``Location``.
        """
        await response.aclose()
        status = response.status_code
        if request.method != "POST":
            return httpx2.Response(502, request=request)
        if self._health.established:
            self._health.fail(f"the server answered a request with HTTP {status} (a redirect)")
        return _failure_response(
            request,
            f"the MCP server answered HTTP {status} (a redirect); redirects are not followed: "
            "use the URL the server answers at itself",
            not_run=False,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _WatchedReadStream:
    """A transport's read stream that tells `health` when it ends (the server process exited, the
    connection closed): the SDK's session otherwise only notices on its next request."""

    def __init__(self, inner: Any, health: SessionHealth) -> None:
        self._inner = inner
        self._health = health

    @property
    def last_context(self) -> Any:
        """The inner stream's sender context, which the SDK's dispatcher reads when it is there."""
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._health.fail("the transport's read side ended")
            raise

    def __aiter__(self) -> _WatchedReadStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _WatchedReadStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@asynccontextmanager
async def _watched(transport: Transport, health: SessionHealth) -> AsyncIterator[tuple[Any, Any]]:
    """`transport` with its read stream watched (`_WatchedReadStream`)."""
    async with transport as (read_stream, write_stream):
        yield _WatchedReadStream(read_stream, health), write_stream


def _notification_handler(on_tools_changed: Callable[[], None] | None) -> MessageHandlerFnT | None:
    """The SDK ``message_handler`` calling `on_tools_changed` for ``notifications/tools/list_changed``
    (None without one: the SDK's default handler). Everything else it receives is ignored, as
    the default handler does."""
    if on_tools_changed is None:
        return None
    tools_changed = on_tools_changed

    async def handle(message: IncomingMessage) -> None:
        if isinstance(message, ToolListChangedNotification):
            tools_changed()
        await anyio.lowlevel.checkpoint()

    return handle


# Seconds the DELETE that ends a streamable-HTTP session may take (it is bounded by `SessionPool`'s
# close timeout as well).
DEFAULT_CLOSE_TIMEOUT: Final = 5.0


@asynccontextmanager
async def open_session(
    endpoint: Endpoint,
    *,
    connect_timeout: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    health: SessionHealth | None = None,
    on_tools_changed: Callable[[], None] | None = None,
) -> AsyncIterator[mcp.Client]:
    """Connect to `endpoint` and yield an initialised ``mcp.Client``; close it on exit.

    The caller bounds the time to connect (wrap the whole ``async with`` in a cancel scope); the
    HTTP client's own connect, write and pool timeouts are `connect_timeout` seconds and reads are
    unbounded here (each call is bounded by its caller). Over streamable HTTP, `max_message_bytes`
    bounds one MCP message — one SSE event, or one JSON answer body (the SDK bounds only the
    former) — and a message over it fails only the request it answers; lone surrogate escapes in
    answers are rewritten to U+FFFD before the SDK parses them (`SurrogateEscapeFixer`). After the
    handshake, a request whose connection fails, or that the server answers with 404 for the
    session, fails alone with an ``MCPError`` (`call_not_run` tells whether it was never run) and
    `health` records that the session is no longer usable; `health` also learns when a stdio
    server's output ends. The SDK's response cache is off: the catalog caches ``tools/list``
    itself, and call results are never cached. `on_tools_changed` (optional, synchronous) is
    called for each ``notifications/tools/list_changed`` the server sends on the session — on a
    request's stream or the standalone one. Raises whatever the SDK raises when the connection
    fails (often an ``ExceptionGroup``).
    """
    health = health if health is not None else SessionHealth()
    handler = _notification_handler(on_tools_changed)
    if endpoint.app is not None:
        async with mcp.Client(endpoint.app, cache=None, message_handler=handler) as client:
            health.established = True
            yield client
    elif endpoint.command is not None:
        params = mcp.StdioServerParameters(
            command=endpoint.command[0], args=list(endpoint.command[1:]), encoding_error_handler="replace"
        )
        async with mcp.Client(
            _watched(stdio_client(params), health), cache=None, message_handler=handler
        ) as client:
            health.established = True
            yield client
    else:
        assert endpoint.url is not None
        timeout = httpx2.Timeout(connect_timeout, read=None)
        transport = _GatewayTransport(
            max_message_bytes, health=health, close_timeout=min(connect_timeout, DEFAULT_CLOSE_TIMEOUT)
        )
        async with httpx2.AsyncClient(
            headers={"accept-encoding": "identity", **dict(endpoint.headers)},
            timeout=timeout,
            transport=transport,
            follow_redirects=False,  # the default, said out loud; the transport refuses 3xx anyway
        ) as http:
            streams = streamable_http_client(
                endpoint.url, http_client=http, max_sse_event_size=max_message_bytes
            )
            async with mcp.Client(_watched(streams, health), cache=None, message_handler=handler) as client:
                health.established = True
                yield client
