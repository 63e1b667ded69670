"""Ingress policy for MCP servers: which server a request may name, and how it will be reached.

Pure: no I/O, no state. Every check raises ValueError naming the field and the rule, never a
header value or a URL's query (`middleware.tools.catalog` turns it into an ``InvalidRequest``
naming the request's ``tools[i]``).

* `validate_label` — the ``server_label`` rule (it keeps ``LABEL__name`` a valid function name).
* `normalize_url` / `path_refusal` / `UrlAllowlist` — the ``--mcp-allow`` check for
  client-declared ``server_url``s. A path that could be read as another path (encoded slashes or
  dots, ``..``, ``;`` parameters, backslashes, double encoding, control characters) is refused
  outright; the rest are compared *after* normalisation and percent-decoding, and the normalised
  URL is the one connected to, so what was checked is what is called.
* `validate_headers` — header names and values sent to a server; a client-declared server may not
  set the transport-owned or hop-by-hop ones (``Host``, ``Content-Length``, ``Mcp-Session-Id``, …).
* `McpServerConfig` — an operator-configured server (streamable HTTP URL, stdio command, or an
  in-process ``MCPServer``).
* `Endpoint` — one way to reach one server for one request (what `middleware.tools.session`
  connects to and `middleware.tools.pool` keys sessions by).

Secrets: header values (operator or client-declared) and URL query strings never appear in a
``repr`` or an error message; only header *names* and the URL as `middleware.ops.redact.redact_url`
shows it (``scheme://host/path?***``) do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import unquote_to_bytes, urlsplit

from mcp.server.mcpserver import MCPServer

from middleware.ops.redact import redact_url

__all__ = [
    "Endpoint",
    "McpServerConfig",
    "UrlAllowlist",
    "normalize_url",
    "path_refusal",
    "validate_headers",
    "validate_label",
]

# OpenAI's server_label rule: a letter, then letters, digits, "-" and "_".
_LABEL_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
# RFC 9110 token characters: what a header field name may contain.
_TOKEN_RE: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HOST_RE: Final = re.compile(r"[a-z0-9.-]+|[0-9a-f:.]+")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_UNRESERVED: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PERCENT_RE: Final = re.compile(r"%([0-9A-Fa-f]{2})")
_BAD_PERCENT_RE: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")
_ENCODED_SLASH_RE: Final = re.compile(r"%2[Ff]")
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


def path_refusal(url: str) -> str | None:
    """Why the path of `url` (as given, before `normalize_url`) could be read as another path, or
    None when it cannot. The reason is a phrase completing "its path …".

    A server, or a proxy in front of it, may decode, split or strip a path differently from the
    allowlist check (``/mcp/..%2Fadmin``, ``/mcp/..;/admin``), so such paths are refused rather
    than normalised. On the path only (the query is not routed on), in this order:

    1. every ``%`` starts a ``%XX`` escape;
    2. no escaped ``/`` (``%2F``, ``%2f``): decoding must not change the segments;
    3. after decoding every escape once, the path is printable ASCII: no NUL or other control
       character, no byte >= 0x80 (overlong UTF-8 such as ``%C0%AE``, full-width dots or slashes);
    4. the decoded path holds no ``%`` (double encoding: ``%252F``, ``%252e``), no ``\\`` (raw or
       ``%5C``), no ``;`` (path parameters, raw or ``%3B``: ``..;``), no ``?`` or ``#``;
    5. no decoded segment is ``.`` or ``..`` (``..``, ``%2e%2e``, ``.%2e``, ``%2e.``).

    Never raises; `url` is not checked otherwise (`normalize_url` does that).
    """
    path = urlsplit(url).path
    if _BAD_PERCENT_RE.search(path):
        return "has a '%' that does not start a %XX escape"
    if _ENCODED_SLASH_RE.search(path):
        return "has an encoded '/' (%2F)"
    decoded = unquote_to_bytes(path.encode("utf-8"))
    if any(byte < 0x20 or byte >= 0x7F for byte in decoded):
        return "has a control or non-ASCII character once decoded"
    for char, what in (
        (b"%", "is encoded twice (%25 decodes to '%')"),
        (b"\\", "has a backslash (raw or %5C)"),
        (b";", "has a ';' path parameter (raw or %3B)"),
        (b"?", "has an encoded '?'"),
        (b"#", "has an encoded '#'"),
    ):
        if char in decoded:
            return what
    if any(segment in (b".", b"..") for segment in decoded.split(b"/")):
        return "has a '.' or '..' segment (raw or encoded)"
    return None


def _decoded_path(normalized_url: str) -> str:
    """The path of a `normalize_url` output that `path_refusal` passed, every escape decoded once
    (unambiguous then: no escape decodes to ``/`` or ``%``), without trailing slashes."""
    return unquote_to_bytes(urlsplit(normalized_url).path).decode("ascii").rstrip("/")


class UrlAllowlist:
    """The operator's ``--mcp-allow PREFIX`` list for client-declared MCP servers.

    A client's ``server_url`` is allowed when (`refusal`):

    * it is a usable URL (`normalize_url`, which raises ValueError otherwise: another scheme,
      credentials ``user:pw@`` — so ``http://good.example@evil/`` never reaches a host check —, a
      non-ASCII host, a bad port, whitespace, control characters, raw backslashes);
    * its path, as given, cannot be read as another path (`path_refusal`: no encoded ``/``, no
      ``.``/``..`` segment, raw or encoded, no ``;``, ``\\``, double encoding, control or
      non-ASCII characters once decoded);
    * after `normalize_url` it has a prefix's scheme, host and port exactly (``:80`` for http and
      ``:443`` for https are the same as none), and its percent-decoded path equals the prefix's
      (trailing ``/`` ignored) or continues it at a ``/`` boundary: prefix
      ``http://good.example/mcp`` allows ``/mcp``, ``/mcp/`` and ``/mcp/x`` (with any query) but
      not ``/mcpx``, and prefix ``http://good.example`` never allows ``http://good.example.evil.com``.

    An empty list allows nothing (the gateway is never an open proxy). Prefixes must pass the same
    rules and have no query or fragment, else ValueError at construction, naming the prefix.
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
            reason = path_refusal(prefix)
            if reason is not None:
                raise ValueError(f"MCP allowlist prefix {prefix!r} is invalid: its path {reason}")
            parts = urlsplit(normal)
            self._prefixes.append((parts.scheme, parts.netloc, _decoded_path(normal)))

    def __repr__(self) -> str:
        shown = [f"{scheme}://{netloc}{path}" for scheme, netloc, path in self._prefixes]
        return f"UrlAllowlist({shown!r})"

    def refusal(self, url: str) -> str | None:
        """Why `url` (a ``server_url`` as the client gave it) is not allowed, or None if it is.

        The reason says what to change; it names neither the URL nor its query. Raises ValueError
        (from `normalize_url`) when `url` is not a usable URL at all.
        """
        normal = normalize_url(url)
        reason = path_refusal(url)
        if reason is not None:
            return (
                f"its path {reason}, which the server or a proxy in front of it may read as another "
                "path than the one the --mcp-allow allowlist checked; send the endpoint's plain "
                "path ('/'-separated, without '.' or '..' segments, ';', backslashes or escaped "
                "'/' or '%')"
            )
        parts = urlsplit(normal)
        path = _decoded_path(normal)
        for scheme, netloc, allowed in self._prefixes:
            if parts.scheme != scheme or parts.netloc != netloc:
                continue
            if not allowed or path == allowed or path.startswith(allowed + "/"):
                return None
        return (
            "is not on this gateway's MCP allowlist (--mcp-allow); ask the operator to allow it, "
            "or use an operator-configured server_label"
        )

    def allows(self, url: str) -> bool:
        """Whether `url` (a ``server_url`` as given, or its `normalize_url` form) is allowed:
        `refusal` is None; False for a URL `normalize_url` refuses."""
        try:
            return self.refusal(url) is None
        except ValueError:
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
