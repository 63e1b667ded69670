"""Connections to MCP servers: operator server configs, URL allowlisting, opening one session.

Part of the gateway-owned tool layer (`middleware.tools`, DESIGN.md §6 "Tool exposure"). This
module knows how to *reach* an MCP server; what to list and what to run lives in `tools` and
`tools_exec`.

* `McpServerConfig` — an operator-configured server (streamable HTTP URL, stdio command, or an
  in-process `MCPServer`).
* `normalize_url` / `UrlAllowlist` — the ``--mcp-allow`` check for client-declared ``server_url``s.
  URLs are compared *after* normalisation, and the normalised URL is the one connected to, so what
  was checked is what is called.
* `Endpoint` / `open_session` — one way to reach one server, and an ``async with`` that yields a
  connected ``mcp.Client``.

Secrets: header values (operator or client-declared) and URL query strings never appear in a
``repr``, a log line or an error message; only header *names* and ``scheme://host/path`` do.
"""

from __future__ import annotations

import functools
import logging
import re
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import httpx2
import mcp
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer

from middleware.tools_text import SurrogateEscapeFixer

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Endpoint",
    "McpServerConfig",
    "MessageTooLarge",
    "UrlAllowlist",
    "normalize_url",
    "open_session",
    "redact_url",
    "validate_headers",
    "validate_label",
]

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


_URL_QUERY_RE: Final = re.compile(r"(https?://[^\s?#'\"]*)\?[^\s#'\"]*")


class RedactUrlQueries(logging.Filter):
    """Replaces the query of every ``http(s)://`` URL in a log record with ``?<redacted>``.

    Installed on the loggers of the MCP SDK's HTTP stack (``httpx2``, which logs every request URL
    at INFO, and ``mcp.client.streamable_http``): a client-declared ``server_url`` may carry a
    token in its query, and it must not reach the gateway's logs.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "?" in message:
            record.msg = _URL_QUERY_RE.sub(r"\1?<redacted>", message)
            record.args = None
        return True


for _name in ("httpx2", "mcp.client.streamable_http"):
    logging.getLogger(_name).addFilter(RedactUrlQueries())


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


def redact_url(url: str) -> str:
    """``scheme://host[:port]/path`` of `url`: the query (which may hold a token) is left out."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


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
    * ``command`` — argv of a stdio server the gateway launches (one process per tool-running round);
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
    ``repr`` and comparisons (the repr shows the header names only).
    """

    url: str | None = None
    command: Sequence[str] | None = None
    app: MCPServer[Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict, compare=False)

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


class MessageTooLarge(httpx2.StreamError):
    """A JSON answer from an MCP server passed `open_session`'s ``max_message_bytes``.

    A ``StreamError`` because that is what the SDK turns into a JSON-RPC error for the one request
    concerned (code -32700, "Failed to parse JSON response: …"), leaving the session usable.
    """


class _FixedStream(httpx2.AsyncByteStream):
    """A response body passed through `SurrogateEscapeFixer`; when `limit` is set, more than
    `limit` bytes raise `MessageTooLarge` (the body is never held whole past it)."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int | None) -> None:
        self._inner = inner
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        fixer = SurrogateEscapeFixer()
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if self._limit is not None and seen > self._limit:
                raise MessageTooLarge(
                    f"the MCP server's {ANSWER_TOO_LARGE} of {self._limit:,} bytes "
                    "(--tool-max-result-bytes sets this bound)"
                )
            if fixed := fixer.feed(chunk):
                yield fixed
        if tail := fixer.flush():
            yield tail

    async def aclose(self) -> None:
        await self._inner.aclose()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx2's default verifying context, built once: building it costs about 20 ms, which a
    per-session transport would otherwise pay on every `open_session`."""
    return httpx2.create_ssl_context()


class _SurrogateSafeTransport(httpx2.AsyncBaseTransport):
    """Passes JSON and SSE response bodies through `SurrogateEscapeFixer` (uncompressed ones
    only), and bounds JSON bodies to `max_json_bytes` (SSE events have the SDK's own bound)."""

    def __init__(self, max_json_bytes: int) -> None:
        self._inner = httpx2.AsyncHTTPTransport(verify=_ssl_context())
        self._max_json_bytes = max_json_bytes

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
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
                response.stream, self._max_json_bytes if kind.startswith("application/json") else None
            ),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


@asynccontextmanager
async def open_session(
    endpoint: Endpoint, *, connect_timeout: float, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> AsyncIterator[mcp.Client]:
    """Connect to `endpoint` and yield an initialised ``mcp.Client``; close it on exit.

    The caller bounds the time to connect (wrap the whole ``async with`` in a cancel scope); the
    HTTP client's own connect, write and pool timeouts are `connect_timeout` seconds and reads are
    unbounded here (each call is bounded by its caller). Over streamable HTTP, `max_message_bytes`
    bounds one MCP message — one SSE event, or one JSON answer body (the SDK bounds only the
    former) — and a message over it fails only the request it answers; lone surrogate escapes in
    answers are rewritten to U+FFFD before the SDK parses them (`SurrogateEscapeFixer`). The SDK's
    response cache is off: the catalog caches ``tools/list`` itself, and call results are never
    cached. Raises whatever the SDK raises when the connection fails (often an ``ExceptionGroup``).
    """
    if endpoint.app is not None:
        async with mcp.Client(endpoint.app, cache=None) as client:
            yield client
    elif endpoint.command is not None:
        params = mcp.StdioServerParameters(
            command=endpoint.command[0], args=list(endpoint.command[1:]), encoding_error_handler="replace"
        )
        async with mcp.Client(params, cache=None) as client:
            yield client
    else:
        assert endpoint.url is not None
        timeout = httpx2.Timeout(connect_timeout, read=None)
        transport = _SurrogateSafeTransport(max_message_bytes)
        async with httpx2.AsyncClient(
            headers={"accept-encoding": "identity", **dict(endpoint.headers)},
            timeout=timeout,
            transport=transport,
        ) as http:
            streams = streamable_http_client(
                endpoint.url, http_client=http, max_sse_event_size=max_message_bytes
            )
            async with mcp.Client(streams, cache=None) as client:
                yield client
