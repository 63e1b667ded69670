"""Resolving a request's MCP tools: `ToolCatalog.resolve` (DESIGN.md §6 "Tool exposure").

`ToolCatalog` is created once per process from the operator's servers (`McpServerConfig`) and
``--mcp-allow`` prefixes (`UrlAllowlist`). Once per client request, ``resolved = await
catalog.resolve(request["tools"], tenant=owner)`` validates the request's ``{"type": "mcp", ...}``
tools, lists each server's tools (cached across requests for ``--mcp-list-ttl`` seconds; the
caller's ``tenant`` keys the pooled sessions) and returns a `ResolvedTools`: function tools for
the upstream (``upstream_tools``), ``mcp_list_tools`` output items for the client (``list_items``)
and, per function name, the `GatewayTool` behind a gateway-owned call
(``resolved.gateway_tool(name)``; None for a client-owned one). Running the calls is
`middleware.tools.execute.run_tool_calls`, which this module does not import.

MCP sessions (listing and calls) come from the catalog's `SessionPool` (``catalog.pool``), which
keeps them open across rounds and requests; the app's lifespan ends with ``await catalog.aclose()``.

**Names.** The upstream sees each MCP tool under its own name. When two MCP servers declared in the
same request both expose a tool of the same name (after ``allowed_tools``), *both* are renamed
``LABEL__name`` (the server label, two underscores, the MCP name), so neither silently wins; other
tools keep their names. A client ``function`` tool whose name equals a final MCP function name is
refused (``duplicate_tool_name``). ``mcp_list_tools`` items always show the MCP names.

**Filters and approval.** ``allowed_tools`` narrows what a server exposes and ``require_approval``
decides which calls the client must approve, as `middleware.tools.policy` describes; the catalog
records the decision in `GatewayTool.require_approval` and the loop controller acts on it.

**Errors.** `ToolCatalog.resolve` raises failures of `middleware.errors` before anything is sent
upstream; `middleware.outcomes` answers them (the status column is its table's, for reference):

==================================  ========================  ==========================  ======
situation                           raised                    ``code``                    status
==================================  ========================  ==========================  ======
``server_label`` names no server    ``InvalidRequest``        ``unknown_mcp_server``      400
``server_url`` not on the allowlist ``InvalidRequest``        ``mcp_server_not_allowed``  400
function tool name clashes          ``InvalidRequest``        ``duplicate_tool_name``     400
a label declared twice              ``InvalidRequest``        ``duplicate_mcp_server``    400
malformed field (label, url, …)     ``InvalidRequest``        ``invalid_value``           400
``tools/list`` fails or times out   ``McpServerUnavailable``  ``mcp_server_unavailable``  502
==================================  ========================  ==========================  ======

All carry ``param="tools"``. An ``InvalidRequest`` message starts with the entry at fault
(``tools[i]: …``); ``McpServerUnavailable`` names the server's label and its ``code`` is left to
its row.

A server that cannot be listed fails the whole request (502, retryable) rather than being dropped:
the model would otherwise run without tools the client asked for and answer as if they did not
exist. Messages name the server label, never a header value or a URL's query string.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
import mcp
import mcp_types

from middleware.errors import InvalidRequest, McpServerUnavailable
from middleware.ops.redact import redact_url
from middleware.tools.endpoints import (
    Endpoint,
    McpServerConfig,
    UrlAllowlist,
    normalize_url,
    validate_headers,
    validate_label,
)
from middleware.tools.policy import ApprovalPolicy, ToolFilter, parse_allowed_tools, parse_approval
from middleware.tools.pool import PoolLimits, SessionPool, SessionUnavailable
from middleware.tools.resolved import GatewayTool, ResolvedTools
from middleware.tools.text import describe_exception, scrub_json, scrub_text

__all__ = ["MAX_LIST_PAGES", "ToolCatalog"]

log = logging.getLogger("loopwarden.tools")

# A server whose tools/list needs more pages than this is treated as unavailable (a paginator
# that never ends must not hang a request).
MAX_LIST_PAGES: Final = 100


@dataclass(frozen=True)
class _ListedTool:
    """One entry of a server's ``tools/list``, JSON-ready and scrubbed of lone surrogates."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None
    read_only: bool


@dataclass(frozen=True)
class _Declared:
    """One ``{"type": "mcp"}`` entry of a request, validated."""

    index: int
    label: str
    endpoint: Endpoint
    cache_key: tuple[str, ...]
    allowed: ToolFilter
    approval: ApprovalPolicy


@dataclass(frozen=True)
class _CacheEntry:
    expires: float
    tools: tuple[_ListedTool, ...]


def _bad(index: int, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"tools[{index}]: {message}", code=code, param="tools")


def _listed(tool: mcp_types.Tool) -> _ListedTool:
    annotations = (
        None
        if tool.annotations is None
        else tool.annotations.model_dump(mode="json", by_alias=True, exclude_none=True)
    )
    return _ListedTool(
        name=scrub_text(tool.name),
        description=None if tool.description is None else scrub_text(tool.description),
        input_schema=scrub_json(tool.input_schema),
        annotations=None if annotations is None else scrub_json(annotations),
        read_only=bool(tool.annotations is not None and tool.annotations.read_only_hint),
    )


class ToolCatalog:
    """The process-wide registry of MCP servers and their cached tool lists.

    * `servers` — the operator-configured servers, by label (ValueError on a repeated label);
    * `allow_prefixes` — ``--mcp-allow`` URL prefixes a client-declared ``server_url`` must match
      (`UrlAllowlist`; ValueError names an invalid prefix); empty = no client-declared servers;
    * `list_ttl` — seconds a server's ``tools/list`` answer is reused across requests (0 = never);
      failures are not cached. Client-declared servers are cached per (normalised URL, headers),
      so one client's credentials never decide what another client sees;
    * `connect_timeout` — seconds to connect to a server and list its tools, also the bound on
      opening a session in `run_tool_calls`;
    * `max_cached_lists` — entries kept (least recently stored evicted first): client-declared
      URLs must not grow the cache without bound;
    * `pool_limits` — how open MCP sessions are kept for reuse (`PoolLimits`: idle timeout, idle
      sessions per server and in total, calls per session).

    Holds the process's `SessionPool` (``pool``), used by `resolve` for ``tools/list`` and by
    `run_tool_calls`: call `aclose` at shutdown to close the sessions. Safe to share between
    requests and event loops (each loop gets its own sessions).
    """

    def __init__(
        self,
        servers: Sequence[McpServerConfig],
        *,
        allow_prefixes: Sequence[str] = (),
        list_ttl: float = 300.0,
        connect_timeout: float = 10.0,
        max_cached_lists: int = 256,
        pool_limits: PoolLimits | None = None,
    ) -> None:
        self._servers: dict[str, McpServerConfig] = {}
        for server in servers:
            if server.label in self._servers:
                raise ValueError(f"MCP server label {server.label!r} is configured twice")
            self._servers[server.label] = server
        self._allowlist = UrlAllowlist(allow_prefixes)
        if not list_ttl >= 0:
            raise ValueError(f"mcp_list_ttl must be >= 0 seconds, got {list_ttl!r}")
        if not connect_timeout > 0:
            raise ValueError(f"MCP connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        if max_cached_lists < 1:
            raise ValueError(f"max_cached_lists must be >= 1, got {max_cached_lists!r}")
        self.list_ttl = list_ttl
        self.connect_timeout = connect_timeout
        self._max_cached = max_cached_lists
        self._cache: OrderedDict[tuple[str, ...], _CacheEntry] = OrderedDict()
        self.pool = SessionPool(pool_limits, connect_timeout=connect_timeout)

    def __repr__(self) -> str:
        return (
            f"ToolCatalog(servers={list(self._servers)!r}, allow={self._allowlist!r}, "
            f"list_ttl={self.list_ttl!r}, connect_timeout={self.connect_timeout!r})"
        )

    @property
    def servers(self) -> Mapping[str, McpServerConfig]:
        """The operator-configured servers, by label."""
        return self._servers

    async def aclose(self) -> None:
        """Close the pooled MCP sessions (`SessionPool.aclose`); later calls get no session."""
        await self.pool.aclose()

    async def resolve(self, tools: list[dict[str, Any]] | None, *, tenant: str = "") -> ResolvedTools:
        """Expose a request's ``tools`` (see the module docstring for names, approval and errors).

        ``tenant`` (the caller's owner hash) keys the pooled sessions the request's tool calls run
        on: callers with different API keys never share an MCP session. Listings (side-effect
        free, cached for ``--mcp-list-ttl``) are shared.

        Every ``{"type": "mcp"}`` entry is validated first (`InvalidRequest`, no I/O); then the servers whose
        lists are not cached are listed concurrently, each bounded by `connect_timeout` seconds
        (`McpServerUnavailable` if any fails). Non-mcp tools pass through unchanged. With no
        mcp entries this does no I/O at all.
        """
        tools = tools or []
        declared: list[_Declared] = []
        seen: dict[str, int] = {}
        for index, tool in enumerate(tools):
            if isinstance(tool, dict) and tool.get("type") == "mcp":
                entry = self._declare(index, tool)
                if entry.label in seen:
                    raise _bad(
                        index,
                        f"server_label {entry.label!r} is already declared by tools[{seen[entry.label]}]; "
                        "declare each MCP server once",
                        code="duplicate_mcp_server",
                    )
                seen[entry.label] = index
                declared.append(entry)
        listings = await self._list_all(declared)

        exposed = {d.label: [t for t in listings[d.label] if d.allowed.matches(t)] for d in declared}
        counts = Counter(t.name for ts in exposed.values() for t in ts)
        gateway: dict[str, GatewayTool] = {}
        functions: dict[str, list[dict[str, Any]]] = {}
        for d in declared:
            functions[d.label] = []
            for t in exposed[d.label]:
                function_name = t.name if counts[t.name] == 1 else f"{d.label}__{t.name}"
                if function_name in gateway:
                    other = gateway[function_name]
                    raise _bad(
                        d.index,
                        f"MCP tool {t.name!r} of server {d.label!r} and tool {other.name!r} of server "
                        f"{other.server_label!r} both become function {function_name!r}; "
                        "narrow them with allowed_tools",
                        code="duplicate_tool_name",
                    )
                gateway[function_name] = GatewayTool(d.label, t.name, function_name, d.approval.required(t))
                functions[d.label].append(
                    {
                        "type": "function",
                        "name": function_name,
                        "description": t.description or "",
                        "parameters": copy.deepcopy(t.input_schema),
                        "strict": False,
                    }
                )
        for index, tool in enumerate(tools):
            if isinstance(tool, dict) and tool.get("type") == "function" and tool.get("name") in gateway:
                mcp_tool = gateway[tool["name"]]
                raise _bad(
                    index,
                    f"function tool {tool['name']!r} has the same name as MCP tool {mcp_tool.name!r} of "
                    f"server {mcp_tool.server_label!r}; rename the function or narrow allowed_tools",
                    code="duplicate_tool_name",
                )

        upstream: list[dict[str, Any]] = []
        by_index = {d.index: d for d in declared}
        for index, tool in enumerate(tools):
            mcp_entry = by_index.get(index)
            upstream.extend(functions[mcp_entry.label] if mcp_entry is not None else [tool])
        list_items = [
            {
                "type": "mcp_list_tools",
                "id": f"mcpl_{uuid.uuid4().hex}",
                "server_label": d.label,
                "tools": [
                    {
                        "name": t.name,
                        "description": t.description,
                        "input_schema": copy.deepcopy(t.input_schema),
                        "annotations": copy.deepcopy(t.annotations),
                    }
                    for t in exposed[d.label]
                ],
            }
            for d in declared
        ]
        return ResolvedTools(
            upstream_tools=upstream,
            list_items=list_items,
            gateway_tools=gateway,
            endpoints={d.label: dataclasses.replace(d.endpoint, tenant=tenant) for d in declared},
            connect_timeout=self.connect_timeout,
            pool=self.pool,
        )

    def _declare(self, index: int, tool: Mapping[str, Any]) -> _Declared:
        """Validate one ``{"type": "mcp"}`` entry (raises `InvalidRequest` only, no I/O)."""
        try:
            label = validate_label(tool.get("server_label"))
        except ValueError as exc:
            raise _bad(index, str(exc)) from None
        try:
            allowed = parse_allowed_tools(tool.get("allowed_tools"))
            approval = parse_approval(tool.get("require_approval"))
        except ValueError as exc:
            raise _bad(index, str(exc)) from None
        headers_given = tool.get("headers") not in (None, {}) or tool.get("authorization") is not None
        url = tool.get("server_url")
        if url is None:
            if headers_given:
                raise _bad(
                    index,
                    "headers and authorization can only be sent to a client-declared server_url, "
                    f"not to the operator's server {label!r}",
                )
            server = self._servers.get(label)
            if server is None:
                known = ", ".join(self._servers) or "none"
                raise _bad(
                    index,
                    f"no MCP server is configured with server_label {label!r} (configured: {known}); "
                    "use a configured label, or give a server_url the gateway allows",
                    code="unknown_mcp_server",
                )
            return _Declared(index, label, server.endpoint(), ("operator", label), allowed, approval)
        try:
            normal = normalize_url(url)
        except ValueError as exc:
            raise _bad(index, f"server_url is invalid: {exc}") from None
        if not self._allowlist.allows(normal):
            raise _bad(
                index,
                f"server_url {redact_url(normal)} is not on this gateway's MCP allowlist (--mcp-allow); "
                "ask the operator to allow it, or use an operator-configured server_label",
                code="mcp_server_not_allowed",
            )
        try:
            headers = validate_headers(tool.get("headers") or {}, client=True)
        except ValueError as exc:
            raise _bad(index, str(exc)) from None
        authorization = tool.get("authorization")
        if authorization is not None:
            if not isinstance(authorization, str) or any(c in authorization for c in "\r\n\0"):
                raise _bad(index, "authorization must be a string token without CR, LF or NUL")
            if any(name.lower() == "authorization" for name in headers):
                raise _bad(index, "give either authorization or an Authorization header, not both")
            headers["Authorization"] = f"Bearer {authorization}"
        digest = hashlib.sha256(repr(sorted((k.lower(), v) for k, v in headers.items())).encode()).hexdigest()
        endpoint = Endpoint(url=normal, headers=headers)
        return _Declared(index, label, endpoint, ("client", normal, digest), allowed, approval)

    async def _list_all(self, declared: Sequence[_Declared]) -> dict[str, tuple[_ListedTool, ...]]:
        """Each declared server's tools, from the cache or listed concurrently (each within
        `connect_timeout` seconds); raises `McpServerUnavailable` naming the first that failed."""
        found: dict[str, tuple[_ListedTool, ...]] = {}
        failures: dict[str, BaseException] = {}
        now = time.monotonic()
        missing: list[_Declared] = []
        for d in declared:
            entry = self._cache.get(d.cache_key)
            if entry is not None and entry.expires > now:
                found[d.label] = entry.tools
            else:
                missing.append(d)

        async def fetch(d: _Declared) -> None:
            try:
                found[d.label] = await self._fetch(d.endpoint)
            except Exception as exc:
                failures[d.label] = exc

        if missing:
            async with anyio.create_task_group() as tg:
                for d in missing:
                    tg.start_soon(fetch, d)
        for d in missing:
            if d.label in failures:
                exc = failures[d.label]
                detail = (
                    f"no answer within {self.connect_timeout:g}s"
                    if isinstance(exc, TimeoutError)
                    else describe_exception(exc)
                )
                log.warning("MCP server %r: tools/list failed: %s", d.label, detail)
                raise McpServerUnavailable(
                    f"MCP server {d.label!r} is unavailable: listing its tools failed "
                    f"({detail}); retry later, or leave it out of tools",
                    param="tools",
                )
            if self.list_ttl > 0:
                self._cache[d.cache_key] = _CacheEntry(time.monotonic() + self.list_ttl, found[d.label])
                self._cache.move_to_end(d.cache_key)
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
        return found

    async def _fetch(self, endpoint: Endpoint) -> tuple[_ListedTool, ...]:
        """List every tool of `endpoint` (all pages) on a pooled session, within `connect_timeout`
        seconds in total. ``tools/list`` has no side effects: when it fails on a reused session,
        it is tried once more on a new one (the pooled one may have died since its last use)."""
        with anyio.fail_after(self.connect_timeout):
            for attempt in range(2):
                try:
                    lease = await self.pool.acquire(endpoint, fresh=attempt > 0)
                except SessionUnavailable as exc:
                    raise exc.cause or exc from None
                try:
                    tools = await self._list_pages(lease.client)
                except BaseException as exc:
                    lease.discard()
                    if attempt == 0 and lease.reused and isinstance(exc, Exception):
                        log.info(
                            "MCP tools/list failed on a reused session (%s); retrying",
                            describe_exception(exc),
                        )
                        continue
                    raise
                lease.release()
                return tools
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _list_pages(client: mcp.Client) -> tuple[_ListedTool, ...]:
        tools: dict[str, _ListedTool] = {}
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                tools.setdefault(tool.name, _listed(tool))
            cursor = page.next_cursor
            if cursor is None:
                return tuple(tools.values())
        raise RuntimeError(f"tools/list did not end within {MAX_LIST_PAGES} pages")
