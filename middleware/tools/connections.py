"""Connections to MCP servers: operator server configs, URL allowlisting, sessions and their pool.

Part of the gateway-owned tool layer (`middleware.tools.catalog`, DESIGN.md §6 "Tool exposure"). This
module knows how to *reach* an MCP server; what to list and what to run lives in `tools` and
`tools_exec`.

* `McpServerConfig` — an operator-configured server (streamable HTTP URL, stdio command, or an
  in-process `MCPServer`).
* `normalize_url` / `UrlAllowlist` — the ``--mcp-allow`` check for client-declared ``server_url``s.
  URLs are compared *after* normalisation, and the normalised URL is the one connected to, so what
  was checked is what is called.
* `Endpoint` / `open_session` — one way to reach one server, and an ``async with`` that yields a
  connected ``mcp.Client``; its transport turns a failed or refused request into an error for that
  request alone and reports what it learnt about the session (`SessionHealth`, `call_not_run`).
* `SessionPool` — open sessions kept across rounds and requests (`PoolLimits`), leased per call.

Secrets: header values (operator or client-declared) and URL query strings never appear in a
``repr``, a log line or an error message; only header *names* and the URL as
`middleware.ops.redact.redact_url` shows it (``scheme://host/path?***``) do.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import ssl
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import anyio
import httpx2
import mcp
from mcp.client import Transport
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, METHOD_NOT_FOUND

from middleware.ops.redact import redact_url
from middleware.tools.text import SurrogateEscapeFixer, describe_exception

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Endpoint",
    "Lease",
    "McpServerConfig",
    "MessageTooLarge",
    "PoolLimits",
    "PoolStats",
    "SessionHealth",
    "SessionPool",
    "SessionUnavailable",
    "UrlAllowlist",
    "call_not_run",
    "normalize_url",
    "open_session",
    "session_failed",
    "validate_headers",
    "validate_label",
]

log = logging.getLogger("loopwarden.tools")

# OpenAI's server_label rule: a letter, then letters, digits, "-" and "_".
_LABEL_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
# RFC 9110 token characters: what a header field name may contain.
_TOKEN_RE: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HOST_RE: Final = re.compile(r"[a-z0-9.-]+|[0-9a-f:.]+")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
# The largest MCP message (an SSE event or a JSON body, bytes) `open_session` accepts by default.
DEFAULT_MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024
_UNRESERVED: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PERCENT_RE: Final = re.compile(r"%([0-9A-Fa-f]{2})")
# Header names a client-declared server may not set: transport framing and hop-by-hop fields
# (RFC 9110 §7.6.1), ``Host`` (virtual-host confusion behind an allowlisted front: the gateway
# must not become a proxy to other sites on the same address) and the MCP transport's own headers.
_FORBIDDEN_HEADERS: Final = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
        "mcp-session-id",
        "mcp-protocol-version",
        "last-event-id",
    }
)


def validate_label(label: object) -> str:
    """`label` if it is a valid server label (a letter, then up to 63 letters, digits, ``-``, ``_``).

    Raises ValueError saying what is allowed. The rule keeps ``LABEL__name`` a valid function name.
    """
    if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
        raise ValueError(
            f"server_label must be a letter followed by up to 63 letters, digits, '-' or '_', got {label!r}"
        )
    return label


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 for an absolute path: ``/a/b/../c`` -> ``/a/c``; never climbs above ``/``."""
    segments = path.split("/")[1:]
    out: list[str] = []
    for segment in segments:
        if segment == ".":
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment)
    if segments and segments[-1] in (".", ".."):
        out.append("")
    return "/" + "/".join(out)


def _normalize_escapes(path: str) -> str:
    """Decode percent-escapes of unreserved characters (``%2E`` -> ``.``), upper-case the rest."""

    def fix(match: re.Match[str]) -> str:
        char = chr(int(match.group(1), 16))
        return char if char in _UNRESERVED else "%" + match.group(1).upper()

    return _PERCENT_RE.sub(fix, path)


def normalize_url(url: object) -> str:
    """The canonical form of an ``http(s)`` MCP server URL, as it will be connected to.

    Scheme and host are lower-cased, a trailing dot on the host and the scheme's default port are
    dropped, escapes of unreserved characters are decoded and dot segments removed (RFC 3986 §6.2.2),
    the fragment is dropped; the query is kept. Raises ValueError (the message never repeats the
    URL) for: not a string, another scheme, no host, credentials in the URL (``user:pw@`` — send
    them in ``headers``), a non-ASCII host (use the ``xn--`` form), an invalid port, whitespace,
    control characters or backslashes.
    """
    if not isinstance(url, str):
        raise ValueError(f"a server URL must be a string, got {type(url).__name__}")
    if "\\" in url or not url.isprintable() or any(c.isspace() for c in url):
        raise ValueError("a server URL must not contain whitespace, control characters or backslashes")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"a server URL must use http or https, got scheme {scheme!r}")
    if "@" in parts.netloc:
        raise ValueError("a server URL must not carry credentials (user:password@); send them in headers")
    host = parts.hostname or ""
    if host.endswith("."):
        host = host[:-1]
    if not host or not _HOST_RE.fullmatch(host):
        raise ValueError("a server URL needs an ASCII host name or IP address (use the xn-- form of IDNs)")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("a server URL has an invalid port") from None
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc += f":{port}"
    path = _remove_dot_segments(_normalize_escapes(parts.path or "/"))
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{netloc}{path}{query}"


class UrlAllowlist:
    """The operator's ``--mcp-allow PREFIX`` list for client-declared MCP servers.

    A URL is allowed when, after `normalize_url` on both sides, it has the prefix's scheme, host
    and port exactly, and its path equals the prefix's path or continues it at a ``/`` boundary:
    prefix ``http://good.example/mcp`` allows ``/mcp`` and ``/mcp/x`` but not ``/mcpx``, and prefix
    ``http://good.example`` never allows ``http://good.example.evil.com``. An empty list allows
    nothing (the gateway is never an open proxy). Prefixes with a query or fragment raise
    ValueError at construction, naming the prefix.
    """

    def __init__(self, prefixes: Sequence[str]) -> None:
        self._prefixes: list[tuple[str, str, str]] = []
        for prefix in prefixes:
            try:
                normal = normalize_url(prefix)
            except ValueError as exc:
                raise ValueError(f"MCP allowlist prefix {prefix!r} is invalid: {exc}") from None
            if "?" in normal or "#" in prefix:
                raise ValueError(f"MCP allowlist prefix {prefix!r} must not have a query or fragment")
            parts = urlsplit(normal)
            self._prefixes.append((parts.scheme, parts.netloc, parts.path.rstrip("/")))

    def __repr__(self) -> str:
        shown = [f"{scheme}://{netloc}{path}" for scheme, netloc, path in self._prefixes]
        return f"UrlAllowlist({shown!r})"

    def allows(self, normalized_url: str) -> bool:
        """Whether `normalized_url` (the output of `normalize_url`) matches one of the prefixes."""
        parts = urlsplit(normalized_url)
        for scheme, netloc, path in self._prefixes:
            if parts.scheme != scheme or parts.netloc != netloc:
                continue
            if not path or parts.path == path or parts.path.startswith(path + "/"):
                return True
        return False


def validate_headers(headers: object, *, client: bool) -> dict[str, str]:
    """`headers` as a plain ``dict[str, str]`` after checking names and values.

    Names must be RFC 9110 tokens, values strings without CR, LF or NUL. With ``client=True`` the
    transport-owned and hop-by-hop names (``Host``, ``Content-Length``, ``Mcp-Session-Id``, …) are
    refused too. Raises ValueError naming the header, never its value.
    """
    if not isinstance(headers, Mapping):
        raise ValueError(f"headers must be an object of strings, got {type(headers).__name__}")
    out: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not _TOKEN_RE.fullmatch(name):
            raise ValueError(f"header name {name!r} is not a valid HTTP field name")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
            raise ValueError(f"header {name!r} must have a string value without CR, LF or NUL")
        if client and name.lower() in _FORBIDDEN_HEADERS:
            raise ValueError(f"header {name!r} is set by the gateway and cannot be sent to an MCP server")
        out[name] = value
    return out


@dataclass(frozen=True, kw_only=True)
class McpServerConfig:
    """One operator-configured MCP server, reached by exactly one of `url`, `command` or `app`.

    * ``label`` — how requests name it: ``{"type": "mcp", "server_label": LABEL}``; a letter, then
      up to 63 letters, digits, ``-`` or ``_``;
    * ``url`` — a streamable HTTP endpoint (``http(s)://…``), stored normalised (`normalize_url`);
    * ``command`` — argv of a stdio server the gateway launches (kept running between rounds and
      requests by `SessionPool`, restarted when it exits);
    * ``app`` — an in-process ``MCPServer``, served through the SDK's in-memory path;
    * ``headers`` — sent with every HTTP request to ``url`` only; values are hidden from ``repr``.

    Raises ValueError from ``__post_init__`` naming the label and the problem.
    """

    label: str
    url: str | None = None
    command: Sequence[str] | None = None
    app: MCPServer[Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        try:
            validate_label(self.label)
        except ValueError as exc:
            raise ValueError(f"MCP server config: {exc}") from None
        given = [name for name in ("url", "command", "app") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"MCP server {self.label!r} needs exactly one of url, command or app, got {given or 'none'}"
            )
        if self.url is not None:
            try:
                object.__setattr__(self, "url", normalize_url(self.url))
            except ValueError as exc:
                raise ValueError(f"MCP server {self.label!r}: {exc}") from None
        if self.command is not None:
            if isinstance(self.command, str) or not self.command:
                raise ValueError(f"MCP server {self.label!r}: command must be a non-empty list of strings")
            if not all(isinstance(arg, str) for arg in self.command):
                raise ValueError(f"MCP server {self.label!r}: command must be a list of strings")
            object.__setattr__(self, "command", tuple(self.command))
        if self.app is not None and not isinstance(self.app, MCPServer):
            raise ValueError(f"MCP server {self.label!r}: app must be an mcp MCPServer")
        if self.headers and self.url is None:
            raise ValueError(f"MCP server {self.label!r}: headers apply to a url server only")
        try:
            object.__setattr__(self, "headers", validate_headers(self.headers, client=False))
        except ValueError as exc:
            raise ValueError(f"MCP server {self.label!r}: {exc}") from None

    def __repr__(self) -> str:
        target = (
            f"url={redact_url(self.url)!r}"
            if self.url is not None
            else f"command={list(self.command)!r}"
            if self.command is not None
            else f"app={type(self.app).__name__}"
        )
        hidden = {name: "***" for name in self.headers}
        return f"McpServerConfig(label={self.label!r}, {target}, headers={hidden!r})"

    def endpoint(self) -> Endpoint:
        """The `Endpoint` for this server."""
        return Endpoint(url=self.url, command=self.command, app=self.app, headers=dict(self.headers))


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """How to reach one MCP server for one request: exactly one of url / command / app.

    ``url`` is already normalised and allowed; ``headers`` hold secrets and are excluded from
    ``repr`` and comparisons (the repr shows the header names only). ``tenant``: whose calls these
    are (the caller's owner hash, `middleware.asgi.auth`); pooled sessions are never shared between
    tenants, so a stateful MCP server never carries one caller's state into another's calls.
    """

    url: str | None = None
    command: Sequence[str] | None = None
    app: MCPServer[Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict, compare=False)
    tenant: str = field(default="", compare=False)

    def __repr__(self) -> str:
        target = (
            redact_url(self.url)
            if self.url is not None
            else f"command={list(self.command)!r}"
            if self.command is not None
            else "in-process"
        )
        return f"Endpoint({target}, headers={sorted(self.headers)!r})"


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
    `limit` bytes raise `MessageTooLarge` (the body is never held whole past it)."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int | None, health: SessionHealth) -> None:
        self._inner = inner
        self._limit = limit
        self._health = health

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
    * A DELETE (ending the session) is bounded to `close_timeout` seconds.
    """

    def __init__(self, max_json_bytes: int, *, health: SessionHealth, close_timeout: float) -> None:
        self._inner = httpx2.AsyncHTTPTransport(verify=_ssl_context())
        self._max_json_bytes = max_json_bytes
        self._health = health
        self._close_timeout = close_timeout

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            if request.method == "DELETE":
                with anyio.fail_after(self._close_timeout):
                    response = await self._inner.handle_async_request(request)
            else:
                response = await self._inner.handle_async_request(request)
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
        if response.status_code == 404 and "mcp-session-id" in request.headers and request.method != "DELETE":
            body = await _small_json_body(response)
            answer = body.get("error") if body is not None else None
            if isinstance(answer, dict) and answer.get("code") == METHOD_NOT_FOUND:
                return httpx2.Response(
                    404, json={"jsonrpc": "2.0", "id": None, "error": answer}, request=request
                )
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
            ),
            extensions=response.extensions,
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
    itself, and call results are never cached. Raises whatever the SDK raises when the connection
    fails (often an ``ExceptionGroup``).
    """
    health = health if health is not None else SessionHealth()
    if endpoint.app is not None:
        async with mcp.Client(endpoint.app, cache=None) as client:
            health.established = True
            yield client
    elif endpoint.command is not None:
        params = mcp.StdioServerParameters(
            command=endpoint.command[0], args=list(endpoint.command[1:]), encoding_error_handler="replace"
        )
        async with mcp.Client(_watched(stdio_client(params), health), cache=None) as client:
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
        ) as http:
            streams = streamable_http_client(
                endpoint.url, http_client=http, max_sse_event_size=max_message_bytes
            )
            async with mcp.Client(_watched(streams, health), cache=None) as client:
                health.established = True
                yield client


# --- the session pool ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PoolLimits:
    """How `SessionPool` keeps MCP sessions open between rounds and requests.

    * ``idle_timeout`` — seconds a session with no call in flight stays open (> 0);
    * ``max_idle_per_server`` — idle sessions kept per server and credentials (>= 0; 0 closes every
      session as soon as its last call ends: no reuse across rounds);
    * ``max_idle`` — idle sessions kept in total, all servers (>= 0);
    * ``max_calls_per_session`` — calls in flight on one session (>= 1); a call past it opens
      another session.

    Raises ValueError naming the field.
    """

    idle_timeout: float = 60.0
    max_idle_per_server: int = 4
    max_idle: int = 64
    max_calls_per_session: int = 16

    def __post_init__(self) -> None:
        if not (self.idle_timeout > 0 and math.isfinite(self.idle_timeout)):
            raise ValueError(f"MCP pool idle_timeout must be > 0 seconds, got {self.idle_timeout!r}")
        for name in ("max_idle_per_server", "max_idle"):
            if getattr(self, name) < 0:
                raise ValueError(f"MCP pool {name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_calls_per_session < 1:
            raise ValueError(
                f"MCP pool max_calls_per_session must be >= 1, got {self.max_calls_per_session!r}"
            )


@dataclass(frozen=True)
class PoolStats:
    """Counters of a `SessionPool` since it was made (``opened``, ``failed`` opens, ``leases``
    handed out, of which ``reused`` went to an already open session, ``discarded`` sessions, and
    ``closed`` ones) and what it holds now (``open`` sessions, of which ``idle`` have no call)."""

    opened: int
    failed: int
    leases: int
    reused: int
    discarded: int
    closed: int
    open: int
    idle: int


class SessionUnavailable(Exception):
    """No session could be had: opening one failed (`cause` is why; a ``TimeoutError`` when it
    took longer than the pool's connect timeout), or the pool is closed (`cause` is None)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


# Keys the hash of a connection's URL and headers (`_pool_key`), so that it cannot be reversed by
# guessing low-entropy credentials even if it were seen.
_KEY_SALT: Final = secrets.token_bytes(16)


def _pool_key(endpoint: Endpoint, max_message_bytes: int) -> tuple[object, ...]:
    """What identifies a connection: the in-process server, the stdio argv, or the HTTP URL with
    every header value (credentials included) and the message bound — each with the tenant. URL and headers only enter
    as a keyed hash, so the key itself holds no secret."""
    if endpoint.app is not None:
        return ("app", id(endpoint.app), endpoint.tenant)
    if endpoint.command is not None:
        return ("stdio", tuple(endpoint.command), endpoint.tenant)
    identity = json.dumps([endpoint.url, list(endpoint.headers.items()), endpoint.tenant]).encode()
    return ("http", hmac.new(_KEY_SALT, identity, hashlib.sha256).hexdigest(), max_message_bytes)


class _Entry:
    """One pooled session: its owner task (which enters and exits the SDK's context managers, as
    anyio requires of one task), its state and its leases.

    States: ``opening`` -> ``open`` -> ``retired`` (no new leases; closed once the last ends) ->
    ``closed``. Only ``opening`` and ``open`` entries are in `_LoopPool.usable`.
    """

    def __init__(
        self, loop_pool: _LoopPool, key: tuple[object, ...], endpoint: Endpoint, max_message: int
    ) -> None:
        self.loop_pool = loop_pool
        self.key = key
        self.endpoint = endpoint
        self.max_message = max_message
        self.state = "opening"
        self.leases = 0
        self.idle_since = time.monotonic()
        self.client: mcp.Client | None = None
        self.error: BaseException | None = None
        self.ready = anyio.Event()
        self.health = SessionHealth(on_failure=self._on_failure)
        self.scope: anyio.CancelScope | None = None
        self.task: asyncio.Task[None] | None = None
        self._wake: anyio.Event | None = None

    def __repr__(self) -> str:
        return f"<MCP session {self.endpoint!r} {self.state}, {self.leases} calls>"

    def notify(self) -> None:
        """Wake the owner task to look at the state again."""
        if self._wake is not None:
            self._wake.set()

    async def wait(self, timeout: float) -> None:
        """(owner task) Sleep until `notify` or `timeout` seconds."""
        self._wake = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._wake.wait()

    def retire(self, *, discarded: bool = False) -> None:
        """No new leases; the owner closes the session once its calls have ended."""
        if self.state in ("opening", "open"):
            self.state = "retired"
            self.loop_pool.forget(self)
            if discarded:
                self.loop_pool.pool._count("discarded")
        self.notify()

    def _on_failure(self) -> None:
        log.debug("%r is unusable: %s", self, self.health.failure)
        self.retire(discarded=True)

    def unlease(self) -> None:
        self.leases -= 1
        if self.leases == 0:
            self.idle_since = time.monotonic()
            if self.state == "open":
                self.loop_pool.became_idle(self)
        self.notify()


class Lease:
    """One caller's use of a pooled session (`SessionPool.acquire`).

    ``client`` is the open ``mcp.Client``; ``reused`` says whether the session had been open before
    this lease. End it with exactly one of `release` (the session may serve other calls) or
    `discard` (it may not: it leaves the pool and closes once its other calls end). Both are
    synchronous and idempotent, so they are safe in ``finally`` blocks and under cancellation.
    """

    __slots__ = ("_done", "_entry", "reused")

    def __init__(self, entry: _Entry, reused: bool) -> None:
        self._entry = entry
        self.reused = reused
        self._done = False
        entry.leases += 1

    def __repr__(self) -> str:
        return f"Lease({self._entry!r}, reused={self.reused})"

    @property
    def client(self) -> mcp.Client:
        assert self._entry.client is not None, "a lease is handed out once its session is open"
        return self._entry.client

    def release(self) -> None:
        """End the lease; the session stays in the pool."""
        if not self._done:
            self._done = True
            self._entry.unlease()

    def discard(self) -> None:
        """End the lease and take the session out of the pool (it closes once idle)."""
        if not self._done:
            self._entry.retire(discarded=True)
            self.release()


class _LoopPool:
    """The sessions of one event loop (anyio tasks and streams never cross loops)."""

    def __init__(self, pool: SessionPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.usable: dict[tuple[object, ...], list[_Entry]] = {}
        self.entries: set[_Entry] = set()
        self.closing = False

    def pick(self, key: tuple[object, ...]) -> _Entry | None:
        """The usable session for `key` with the most calls under the cap (the most recently used
        one among equals), so that spare sessions go idle and time out."""
        best: _Entry | None = None
        for entry in reversed(self.usable.get(key, ())):
            if entry.leases < self.pool.limits.max_calls_per_session and (
                best is None or entry.leases > best.leases
            ):
                best = entry
        return best

    def open(self, key: tuple[object, ...], endpoint: Endpoint, max_message: int) -> _Entry:
        entry = _Entry(self, key, endpoint, max_message)
        self.usable.setdefault(key, []).append(entry)
        self.entries.add(entry)
        # A fresh context: the owner outlives the request that happened to open the session, and
        # must not carry its context variables (request id, trace) into later requests' logs.
        entry.task = self.loop.create_task(self.pool._own(entry), context=contextvars.Context())
        return entry

    def forget(self, entry: _Entry) -> None:
        """Take `entry` out of `usable` (it gets no new leases)."""
        same = self.usable.get(entry.key)
        if same is not None and entry in same:
            same.remove(entry)
            if not same:
                del self.usable[entry.key]

    def became_idle(self, entry: _Entry) -> None:
        """Keep `entry` as the most recently used of its key, then retire the least recently used
        idle sessions past `max_idle_per_server` and `max_idle`."""
        same = self.usable[entry.key]
        same.remove(entry)
        same.append(entry)
        limits = self.pool.limits
        idle_same = [e for e in same if e.leases == 0 and e.state == "open"]
        for stale in idle_same[: max(0, len(idle_same) - limits.max_idle_per_server)]:
            stale.retire()
        idle = [e for es in self.usable.values() for e in es if e.leases == 0 and e.state == "open"]
        idle.sort(key=lambda e: e.idle_since)
        for stale in idle[: max(0, len(idle) - limits.max_idle)]:
            stale.retire()

    def close_nowait(self) -> None:
        """Retire every session, cutting off calls in flight; cancel the ones still connecting."""
        self.closing = True
        for entry in list(self.entries):
            entry.retire()
            if entry.client is None and entry.scope is not None:
                entry.scope.cancel()


class SessionPool:
    """Open MCP sessions kept between rounds and requests (DESIGN.md §6 "Execution": connecting,
    the handshake and a stdio server's start are paid once per session, not once per round).

    `acquire` hands out a `Lease` on an open session for `endpoint`, opening one when none is free.
    Sessions are keyed by everything that identifies the connection (`_pool_key`): two credentials
    never share one. One session serves up to ``limits.max_calls_per_session`` calls at once — the
    SDK's client multiplexes JSON-RPC ids over one session (a response stream per request id; over
    streamable HTTP each request is its own POST) — and calls from any task (each session is opened,
    held and closed by its own owner task, outside every request's task tree).

    A session leaves the pool when a call on it is cancelled or fails in a way that may have broken
    it (`Lease.discard`), when its transport reports it unusable (`SessionHealth`: 404 for its
    session id, a failed connection, a stdio server that exited), after ``limits.idle_timeout``
    seconds without a call, or past the idle bounds; it is closed once its last call has ended.
    `aclose` closes everything (call it at shutdown).

    Sessions belong to the event loop that opened them; a pool shared by several loops keeps them
    apart. asyncio only (the gateway runs on asyncio; owner tasks are asyncio tasks).
    `connect_timeout` bounds opening a session (seconds), `close_timeout` closing one.
    """

    def __init__(
        self,
        limits: PoolLimits | None = None,
        *,
        connect_timeout: float = 10.0,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    ) -> None:
        if not connect_timeout > 0:
            raise ValueError(f"MCP connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        if not close_timeout > 0:
            raise ValueError(f"MCP close_timeout must be > 0 seconds, got {close_timeout!r}")
        self.limits = limits if limits is not None else PoolLimits()
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self._loops: dict[asyncio.AbstractEventLoop, _LoopPool] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._counts: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"SessionPool({self.limits!r}, connect_timeout={self.connect_timeout!r})"

    def _count(self, name: str) -> None:
        self._counts[name] += 1

    def stats(self) -> PoolStats:
        """The counters and the sessions open now, over every loop."""
        with self._lock:
            loop_pools = list(self._loops.values())
        entries = [e for lp in loop_pools for e in list(lp.entries) if e.client is not None]
        return PoolStats(
            opened=self._counts["opened"],
            failed=self._counts["failed"],
            leases=self._counts["leases"],
            reused=self._counts["reused"],
            discarded=self._counts["discarded"],
            closed=self._counts["closed"],
            open=len(entries),
            idle=sum(1 for e in entries if e.leases == 0 and e.state == "open"),
        )

    def _loop_pool(self) -> _LoopPool:
        loop = asyncio.get_running_loop()
        with self._lock:
            for stale in [other for other in self._loops if other.is_closed()]:
                del self._loops[stale]  # asyncio.run() cancelled its tasks: the owners are gone
            loop_pool = self._loops.get(loop)
            if loop_pool is None:
                loop_pool = self._loops[loop] = _LoopPool(self, loop)
            return loop_pool

    async def acquire(
        self, endpoint: Endpoint, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, fresh: bool = False
    ) -> Lease:
        """A `Lease` on an open session to `endpoint` (`open_session`'s `max_message_bytes`).
        ``fresh``: on a session opened for this call, never one opened before (the retry of a call
        that was not run: the pooled siblings of a session the server forgot are likely forgotten
        too, e.g. after a restart).

        Waits for a session being opened (by this call or another) at most `connect_timeout`
        seconds. Raises `SessionUnavailable` when opening fails or the pool is closed; a
        cancellation while waiting leaves nothing behind.
        """
        if self._closed:
            raise SessionUnavailable("the MCP session pool is closed (the gateway is shutting down)")
        loop_pool = self._loop_pool()
        key = _pool_key(endpoint, max_message_bytes)
        for _ in range(3):
            entry = None if fresh else loop_pool.pick(key)
            if entry is None:
                entry = loop_pool.open(key, endpoint, max_message_bytes)
            lease = Lease(entry, reused=entry.state == "open")
            if not entry.ready.is_set():
                try:
                    async with asyncio.timeout(self.connect_timeout):
                        await entry.ready.wait()
                except TimeoutError:
                    # Not waiting for the owner to tear the half-open session down (a stdio
                    # server's shutdown takes seconds): it gets no new leases and closes alone.
                    entry.retire()
                    lease.release()
                    raise SessionUnavailable(
                        "opening an MCP session failed",
                        TimeoutError(f"no MCP session within {self.connect_timeout:g}s"),
                    ) from None
                except BaseException:
                    lease.release()
                    raise
            if entry.state == "open":
                self._count("leases")
                if lease.reused:
                    self._count("reused")
                return lease
            lease.release()
            if entry.client is None:
                raise SessionUnavailable("opening an MCP session failed", entry.error)
            # It broke between being picked and being ready: take another.
        raise SessionUnavailable("every MCP session opened for this server broke at once")

    async def _own(self, entry: _Entry) -> None:
        """(owner task) Open the session, serve its leases until it is done, close it."""
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + self.connect_timeout) as scope:
                entry.scope = scope
                async with open_session(
                    entry.endpoint,
                    connect_timeout=self.connect_timeout,
                    max_message_bytes=entry.max_message,
                    health=entry.health,
                ) as client:
                    scope.deadline = math.inf
                    entry.client = client
                    if entry.state == "opening":
                        entry.state = "open"
                    self._count("opened")
                    entry.idle_since = time.monotonic()
                    entry.ready.set()
                    if entry.leases == 0 and entry.state == "open":
                        # every caller that waited for it went away (cancelled): it is idle now,
                        # and the idle bounds apply to it as to any other
                        entry.loop_pool.became_idle(entry)
                    try:
                        await self._serve(entry)
                    finally:
                        entry.retire()
                        scope.deadline = anyio.current_time() + self.close_timeout
            if entry.client is None and scope.cancelled_caught and not entry.loop_pool.closing:
                entry.error = TimeoutError(f"no MCP session within {self.connect_timeout:g}s")
        except Exception as exc:
            if entry.client is None:
                entry.error = exc
            else:
                log.debug("%r closed with %s", entry, describe_exception(exc))
        finally:
            if entry.client is None:
                self._count("failed")
            else:
                self._count("closed")
            entry.state = "closed"
            entry.loop_pool.forget(entry)
            entry.loop_pool.entries.discard(entry)
            entry.ready.set()

    async def _serve(self, entry: _Entry) -> None:
        """(owner task) Return when the session should close: retired with no calls left, idle for
        `idle_timeout`, or the pool closing."""
        while not entry.loop_pool.closing:
            if entry.state != "open":
                if entry.leases == 0:
                    return
                await entry.wait(math.inf)
            elif entry.leases == 0:
                remaining = entry.idle_since + self.limits.idle_timeout - time.monotonic()
                if remaining <= 0:
                    log.debug("%r idle for %gs: closing", entry, self.limits.idle_timeout)
                    return
                await entry.wait(remaining)
            else:
                await entry.wait(math.inf)

    async def aclose(self) -> None:
        """Close every session (calls still in flight on them fail) and refuse new leases.

        Sessions of this event loop are closed before this returns (each within `close_timeout`
        seconds, then cancelled); those of other loops still running are told to close.
        """
        self._closed = True
        current = asyncio.get_running_loop()
        with self._lock:
            loops = list(self._loops.items())
        for loop, loop_pool in loops:
            if loop is current:
                loop_pool.close_nowait()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(loop_pool.close_nowait)
        mine = next((lp for loop, lp in loops if loop is current), None)
        tasks = [e.task for e in (mine.entries if mine is not None else ()) if e.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.close_timeout + 1)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1)
