"""Resolving a request's MCP tools: `ToolCatalog.resolve` (DESIGN.md §6 "Tool exposure").

`ToolCatalog` is created once per process from the operator's servers (`McpServerConfig`) and
``--mcp-allow`` prefixes (`UrlAllowlist`). Once per client request, ``resolved = await
catalog.resolve(request["tools"], tenant=owner, ledger=ledger, store=store)`` validates the
request's ``{"type": "mcp", ...}`` tools, lists each server's tools and returns a
`ResolvedTools`: function tools for the upstream (``upstream_tools``), ``mcp_list_tools`` output
items for the client (``list_items``) and, per function name, the `GatewayTool` behind a
gateway-owned call (``resolved.gateway_tool(name)``; None for a client-owned one). Running the
calls is `middleware.tools.execute.run_tool_calls`, which this module does not import.

**Memory.** A ``tools/list`` answer is charged to the request's ledger while it is read, before
the SDK parses a byte of it (`middleware.tools.listing.ListingMeter`, at the transport); an answer
the request cannot afford stops being read and fails the request through the outcome table
(`BudgetExceeded`, 502 ``max_retained_bytes_exceeded``). Once the tools are exposed, what the
request keeps of them (its ``mcp_list_tools`` items, × 2 with store) is charged instead and the
answer's charge is released. Listings are kept across requests in a `ListingCache` bounded in bytes
(``--mcp-list-cache-bytes``, least recently used evicted first) for ``--mcp-list-ttl`` seconds,
keyed by (server: operator label or normalised URL with its query, digest of the headers, caller):
no caller is ever served another caller's listing, and varying a ``server_url`` only evicts.
``notifications/tools/list_changed`` from a server (on any of its pooled sessions) drops every
entry of that server.

MCP sessions (listing and calls) come from the catalog's `SessionPool` (``catalog.pool``), which
keeps them open across rounds and requests; the app's lifespan ends with ``await catalog.aclose()``.

**Names.** The upstream sees each MCP tool under its own name. When two MCP servers declared in the
same request both expose a tool of the same name (after ``allowed_tools``), *both* are renamed
``LABEL__name`` (the server label, two underscores, the MCP name), so neither silently wins; other
tools keep their names. A name the upstream's grammar rejects (``calendar.get_time``; over 64
characters) is given a conforming one that no other tool of the request has, whatever the order
the servers list them in (`middleware.tools.names.upstream_names`, case B29). A client ``function`` tool whose name equals a
final MCP function name is refused (``duplicate_tool_name``). ``mcp_list_tools`` and ``mcp_call``
items always show the MCP names, and ``tools/call`` gets them; an upstream error whose ``param``
indexes the expanded tools is re-indexed to the client's (`ResolvedTools.client_param`).

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

A ``server_url`` whose path could be read as another path (``..%2F``, ``..;``, ``%2e%2e``, double
encoding, …: `middleware.tools.endpoints.path_refusal`) is "not on the allowlist" too, whatever the
prefixes; either way no request is sent to it. A server that answers a redirect is never followed
there (`middleware.tools.session`): a redirected ``tools/list`` is ``mcp_server_unavailable``.

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
import json
import logging
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
import mcp
import mcp_types

from budget import BudgetExceeded, Ledger, PoolExhausted, count_json_nodes
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
from middleware.tools.listing import (
    LISTING_MODEL,
    ListingCache,
    ListingMeter,
    listing_size,
    server_identity,
)
from middleware.tools.names import upstream_names
from middleware.tools.policy import ApprovalPolicy, ToolFilter, parse_allowed_tools, parse_approval
from middleware.tools.pool import PoolLimits, SessionPool, SessionUnavailable
from middleware.tools.resolved import GatewayTool, ResolvedTools
from middleware.tools.session import metering
from middleware.tools.text import describe_exception, scrub_json, scrub_text

__all__ = ["DEFAULT_LIST_CACHE_BYTES", "MAX_LIST_PAGES", "ToolCatalog"]

log = logging.getLogger("loopwarden.tools")

# A server whose tools/list needs more pages than this is treated as unavailable (a paginator
# that never ends must not hang a request).
MAX_LIST_PAGES: Final = 100

#: ``--mcp-list-cache-bytes``' default: 16 MiB (a quarter of one request's default budget).
DEFAULT_LIST_CACHE_BYTES: Final = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _ListedTool:
    """One entry of a server's ``tools/list``, JSON-ready and scrubbed of lone surrogates."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None
    read_only: bool
    retry_safe: bool = False  # readOnlyHint or idempotentHint: a second run changes nothing more


@dataclass(frozen=True)
class _Declared:
    """One ``{"type": "mcp"}`` entry of a request, validated."""

    index: int
    label: str
    endpoint: Endpoint
    cache_key: tuple[str, ...]  # without the caller (`_key` adds it)
    allowed: ToolFilter
    approval: ApprovalPolicy


def _serialized(tools: Sequence[_ListedTool]) -> bytes:
    """A listing as compact JSON (UTF-8), what its charges and cache size are priced from."""
    return json.dumps(
        [[t.name, t.description, t.input_schema, t.annotations, t.read_only] for t in tools],
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode("utf-8", "surrogatepass")


def _about(exc: BudgetExceeded | PoolExhausted, what: str) -> BudgetExceeded | PoolExhausted:
    """`exc` with `what` (which part of the MCP tool listing did not fit, and what else helps)
    appended to its message; the outcome table answers it by its fields, as any ledger refusal."""
    exc.args = (f"{exc} ({what})",)
    return exc


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
        retry_safe=bool(
            tool.annotations is not None
            and (tool.annotations.read_only_hint or tool.annotations.idempotent_hint)
        ),
    )


def _exposed(
    declared: Sequence[_Declared], listings: Mapping[str, tuple[_ListedTool, ...]]
) -> dict[str, list[_ListedTool]]:
    """Per declared server label, the tools of its listing its ``allowed_tools`` lets through."""
    return {d.label: [t for t in listings[d.label] if d.allowed.matches(t)] for d in declared}


def _function_tool(name: str, tool: _ListedTool) -> dict[str, Any]:
    """The upstream function tool ``name`` for an MCP tool (its schema copied, non-strict)."""
    return {
        "type": "function",
        "name": name,
        "description": tool.description or "",
        "parameters": copy.deepcopy(tool.input_schema),
        "strict": False,
    }


def _name_functions(
    declared: Sequence[_Declared], exposed: Mapping[str, list[_ListedTool]], client_names: set[str]
) -> tuple[dict[str, GatewayTool], dict[str, list[dict[str, Any]]]]:
    """The function names the upstream sees (module docstring, "Names"): returns the
    `GatewayTool` behind each name and, per server label, its function tools in listing order.
    Raises `InvalidRequest` (``duplicate_tool_name``) when two MCP tools become one name."""
    counts = Counter(t.name for ts in exposed.values() for t in ts)
    gateway: dict[str, GatewayTool] = {}
    functions: dict[str, list[dict[str, Any]]] = {}
    wanted = [
        t.name if counts[t.name] == 1 else f"{d.label}__{t.name}" for d in declared for t in exposed[d.label]
    ]
    names = iter(upstream_names(wanted, client_names))
    for d in declared:
        functions[d.label] = []
        for t in exposed[d.label]:
            function_name = next(names)
            if function_name in gateway:
                other = gateway[function_name]
                raise _bad(
                    d.index,
                    f"MCP tool {t.name!r} of server {d.label!r} and tool {other.name!r} of server "
                    f"{other.server_label!r} both become function {function_name!r}; "
                    "narrow them with allowed_tools",
                    code="duplicate_tool_name",
                )
            gateway[function_name] = GatewayTool(
                d.label, t.name, function_name, d.approval.required(t), retry_safe=t.retry_safe
            )
            functions[d.label].append(_function_tool(function_name, t))
    return gateway, functions


def _refuse_clashing_functions(tools: Sequence[Any], gateway: Mapping[str, GatewayTool]) -> None:
    """Raise `InvalidRequest` (``duplicate_tool_name``) for a client ``function`` tool named like
    an MCP function."""
    for index, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "function" and tool.get("name") in gateway:
            mcp_tool = gateway[tool["name"]]
            raise _bad(
                index,
                f"function tool {tool['name']!r} has the same name as MCP tool {mcp_tool.name!r} of "
                f"server {mcp_tool.server_label!r}; rename the function or narrow allowed_tools",
                code="duplicate_tool_name",
            )


def _upstream_tools(
    tools: Sequence[Any], declared: Sequence[_Declared], functions: Mapping[str, list[dict[str, Any]]]
) -> tuple[list[Any], list[int]]:
    """The upstream's ``tools`` (each mcp entry expanded into its functions, the rest as they
    are) and, per upstream tool, the index of the client's tool it comes from."""
    upstream: list[Any] = []
    origins: list[int] = []  # upstream tools[i] comes from the client's tools[origins[i]]
    by_index = {d.index: d for d in declared}
    for index, tool in enumerate(tools):
        mcp_entry = by_index.get(index)
        entries = functions[mcp_entry.label] if mcp_entry is not None else [tool]
        upstream.extend(entries)
        origins.extend([index] * len(entries))
    return upstream, origins


def _list_items(
    declared: Sequence[_Declared], exposed: Mapping[str, list[_ListedTool]]
) -> list[dict[str, Any]]:
    """One ``mcp_list_tools`` output item per declared server (MCP names, schemas copied)."""
    return [
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


def _charge_list_items(ledger: Ledger, list_items: list[dict[str, Any]], store: bool) -> None:
    """Reserve what the request keeps of its listings (as parsed objects) for every round, × 2
    with `store` (they are persisted with the response); raises `BudgetExceeded` / `PoolExhausted`
    saying so."""
    listed = json.dumps(list_items, separators=(",", ":")).encode()
    try:
        ledger.reserve(LISTING_MODEL.accumulated_charge(len(listed), count_json_nodes(listed), store))
    except (BudgetExceeded, PoolExhausted) as exc:
        raise _about(
            exc,
            "for the mcp_list_tools items of this request; or narrow its MCP servers with allowed_tools",
        ) from None


def _client_headers(index: int, tool: Mapping[str, Any]) -> dict[str, str]:
    """The validated ``headers`` of a client-declared server, with ``authorization`` as a bearer
    ``Authorization`` header; raises `InvalidRequest` naming ``tools[index]``."""
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
    return headers


def _listing_failure(d: _Declared, exc: BaseException, connect_timeout: float) -> McpServerUnavailable:
    """The 502 of a server whose ``tools/list`` failed (logged), naming its label, never its URL."""
    detail = (
        f"no answer within {connect_timeout:g}s" if isinstance(exc, TimeoutError) else describe_exception(exc)
    )
    log.warning("MCP server %r: tools/list failed: %s", d.label, detail)
    return McpServerUnavailable(
        f"MCP server {d.label!r} is unavailable: listing its tools failed "
        f"({detail}); retry later, or leave it out of tools",
        param="tools",
    )


class _Lister:
    """Lists the declared servers' tools for `ToolCatalog.resolve`: from the `ListingCache`
    (``cache``), else on sessions of the `SessionPool` (``pool``, which it creates: a server's
    ``notifications/tools/list_changed`` drops that server's cached listings), each server within
    ``connect_timeout`` seconds."""

    def __init__(
        self, cache: ListingCache[tuple[_ListedTool, ...]], limits: PoolLimits | None, connect_timeout: float
    ):
        self.cache = cache
        self.connect_timeout = connect_timeout
        self.pool = SessionPool(limits, connect_timeout=connect_timeout, on_tools_changed=self._tools_changed)

    def _tools_changed(self, endpoint: Endpoint) -> None:
        """A server said ``notifications/tools/list_changed`` on a session to `endpoint`."""
        dropped = self.cache.invalidate(server_identity(endpoint))
        log.info("MCP server %s: tools/list_changed, %d cached listing(s) dropped", endpoint, dropped)

    @staticmethod
    def _key(d: _Declared, tenant: str) -> tuple[str, ...]:
        """The cache key of `d` for caller `tenant`."""
        return (*d.cache_key, tenant)

    async def list_all(
        self,
        declared: Sequence[_Declared],
        tenant: str,
        ledger: Ledger | None,
        meters: list[ListingMeter],
    ) -> dict[str, tuple[_ListedTool, ...]]:
        """Each declared server's tools, from the cache or listed concurrently (each within
        `connect_timeout` seconds), the answers charged to `ledger` by meters appended to
        `meters` (the caller releases them). Raises `BudgetExceeded` / `PoolExhausted` when an
        answer did not fit, else `McpServerUnavailable` naming the first server that failed."""
        found: dict[str, tuple[_ListedTool, ...]] = {}
        failures: dict[str, BaseException] = {}
        missing: list[_Declared] = []
        for d in declared:
            cached = self.cache.get(self._key(d, tenant))
            if cached is not None:
                found[d.label] = cached
            else:
                missing.append(d)
        if missing:
            async with anyio.create_task_group() as tg:
                for d in missing:
                    tg.start_soon(self._list_one, d, tenant, ledger, meters, found, failures)
        for d in missing:
            exc = failures.get(d.label)
            if isinstance(exc, BudgetExceeded | PoolExhausted):
                log.info("MCP server %r: tools/list refused by the request's ledger", d.label)
                raise _about(
                    exc,
                    f"while reading the tools/list answer of MCP server {d.label!r}, which lists more "
                    "tools than this request can hold; or leave that server out of tools",
                )
        for d in missing:
            if d.label in failures:
                raise _listing_failure(d, failures[d.label], self.connect_timeout)
        return found

    async def _list_one(
        self,
        d: _Declared,
        tenant: str,
        ledger: Ledger | None,
        meters: list[ListingMeter],
        found: dict[str, tuple[_ListedTool, ...]],
        failures: dict[str, BaseException],
    ) -> None:
        """List `d` into ``found[d.label]`` (its failure into ``failures``, never raised) and
        cache it unless the server's listings were invalidated meanwhile."""
        meter = ListingMeter(ledger) if ledger is not None else None
        if meter is not None:
            meters.append(meter)
        since = self.cache.epoch()
        try:
            listed = await self.fetch(d.endpoint, meter)
        except Exception as exc:
            failures[d.label] = exc
            return
        found[d.label] = listed
        if self.cache.enabled:
            key = self._key(d, tenant)
            size = listing_size(_serialized(listed), key)
            if not self.cache.put(key, server_identity(d.endpoint), listed, size, since=since):
                log.debug("MCP server %r: listing of %d bytes not cached", d.label, size)

    async def fetch(self, endpoint: Endpoint, meter: ListingMeter | None) -> tuple[_ListedTool, ...]:
        """List every tool of `endpoint` (all pages) on a pooled session, within `connect_timeout`
        seconds in total. ``tools/list`` has no side effects: when it fails on a reused session,
        it is tried once more on a new one (the pooled one may have died since its last use).

        `meter` (None: nothing is charged) sees the answers' bytes before the SDK parses them
        (`metering`); in-process and stdio answers are charged once parsed. When it refuses an
        answer, its `BudgetExceeded` / `PoolExhausted` is raised (no retry: the session is fine).
        """
        with anyio.fail_after(self.connect_timeout):
            for attempt in range(2):
                try:
                    lease = await self.pool.acquire(endpoint, fresh=attempt > 0)
                except SessionUnavailable as exc:
                    raise exc.cause or exc from None
                try:
                    with metering(meter):
                        tools = await self._list_pages(lease.client)
                except BaseException as exc:
                    if isinstance(exc, Exception) and meter is not None and meter.refused is not None:
                        lease.release()  # the answer was refused, the session is not at fault
                        raise meter.refused from None
                    lease.discard()
                    if attempt == 0 and lease.reused and isinstance(exc, Exception):
                        log.info(
                            "MCP tools/list failed on a reused session (%s); retrying",
                            describe_exception(exc),
                        )
                        if meter is not None:
                            meter.restart()  # that answer is gone
                        continue
                    raise
                lease.release()
                if meter is not None and meter.wire_bytes == 0:
                    meter.charge_parsed(_serialized(tools))  # no HTTP answer to meter: in-process or stdio
                return tools
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _list_pages(client: mcp.Client) -> tuple[_ListedTool, ...]:
        """Every page of ``tools/list`` on `client` (the first of a repeated name kept); raises
        RuntimeError past `MAX_LIST_PAGES` pages."""
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


class ToolCatalog:
    """The process-wide registry of MCP servers and their cached tool lists.

    * `servers` — the operator-configured servers, by label (ValueError on a repeated label);
    * `allow_prefixes` — ``--mcp-allow`` URL prefixes a client-declared ``server_url`` must match
      (`UrlAllowlist`; ValueError names an invalid prefix); empty = no client-declared servers;
    * `list_ttl` — seconds a server's ``tools/list`` answer is reused across requests (>= 0;
      0 = never cached); failures are not cached. Entries are kept per (server, digest of the
      headers, caller), so no caller ever gets another caller's listing (ValueError if < 0);
    * `connect_timeout` — seconds to connect to a server and list its tools, also the bound on
      opening a session in `run_tool_calls`;
    * `list_cache_bytes` — the bytes all cached listings may keep alive together (>= 0; 0 = never
      cached; default `DEFAULT_LIST_CACHE_BYTES`), least recently used evicted first; a listing
      larger than this is not cached (`middleware.tools.listing.ListingCache`, sizes from
      `middleware.tools.listing.listing_size`); ValueError if < 0;
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
        list_cache_bytes: int = DEFAULT_LIST_CACHE_BYTES,
        pool_limits: PoolLimits | None = None,
    ) -> None:
        self._servers: dict[str, McpServerConfig] = {}
        for server in servers:
            if server.label in self._servers:
                raise ValueError(f"MCP server label {server.label!r} is configured twice")
            self._servers[server.label] = server
        self._allowlist = UrlAllowlist(allow_prefixes)
        if not connect_timeout > 0:
            raise ValueError(f"MCP connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        self._lister = _Lister(ListingCache(list_cache_bytes, list_ttl), pool_limits, connect_timeout)
        self.list_ttl = list_ttl
        self.connect_timeout = connect_timeout
        self.pool = self._lister.pool

    def __repr__(self) -> str:
        return (
            f"ToolCatalog(servers={list(self._servers)!r}, allow={self._allowlist!r}, "
            f"list_ttl={self.list_ttl!r}, connect_timeout={self.connect_timeout!r})"
        )

    @property
    def servers(self) -> Mapping[str, McpServerConfig]:
        """The operator-configured servers, by label."""
        return self._servers

    @property
    def cache(self) -> ListingCache[tuple[_ListedTool, ...]]:
        """The listing cache (read its ``bytes`` and ``entries``; `ListingCache`)."""
        return self._lister.cache

    async def aclose(self) -> None:
        """Close the pooled MCP sessions (`SessionPool.aclose`); later calls get no session."""
        await self.pool.aclose()

    async def resolve(
        self,
        tools: list[dict[str, Any]] | None,
        *,
        tenant: str = "",
        ledger: Ledger | None = None,
        store: bool = False,
    ) -> ResolvedTools:
        """Expose a request's ``tools`` (see the module docstring for names, approval and errors).

        ``tenant`` (the caller's owner hash) keys the pooled sessions the request's tool calls run
        on, and the cached listings: callers with different API keys never share an MCP session
        or a cached listing.

        ``ledger`` (the request's; None: nothing is charged) pays for the listings: each answer
        is charged while it is read (`ListingMeter`), then, once the tools are exposed, what the
        request keeps — its ``mcp_list_tools`` items, at ``LISTING_MODEL.accumulated_charge``
        (× 2 with ``store``) — is reserved and the answers' charges are released. A charge that
        does not fit raises `BudgetExceeded` (or `PoolExhausted`) and stops that answer's reading.

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
        meters: list[ListingMeter] = []
        try:
            listings = await self._lister.list_all(declared, tenant, ledger, meters)
            return self._expose(tools, declared, listings, tenant, ledger, store)
        finally:
            for meter in meters:
                meter.release()

    def _expose(
        self,
        tools: list[dict[str, Any]],
        declared: Sequence[_Declared],
        listings: Mapping[str, tuple[_ListedTool, ...]],
        tenant: str,
        ledger: Ledger | None,
        store: bool,
    ) -> ResolvedTools:
        """The `ResolvedTools` of `declared` from their `listings`; charges `ledger` for the
        ``mcp_list_tools`` items the request keeps (raises `BudgetExceeded` / `PoolExhausted`),
        refuses clashing names (`InvalidRequest`, ``duplicate_tool_name``)."""
        exposed = _exposed(declared, listings)
        client_names = {
            str(t.get("name")) for t in tools if isinstance(t, dict) and t.get("type") == "function"
        }
        gateway, functions = _name_functions(declared, exposed, client_names)
        _refuse_clashing_functions(tools, gateway)
        upstream, origins = _upstream_tools(tools, declared, functions)
        list_items = _list_items(declared, exposed)
        if ledger is not None and list_items:
            _charge_list_items(ledger, list_items, store)
        return ResolvedTools(
            upstream_tools=upstream,
            list_items=list_items,
            gateway_tools=gateway,
            endpoints={d.label: dataclasses.replace(d.endpoint, tenant=tenant) for d in declared},
            connect_timeout=self.connect_timeout,
            pool=self.pool,
            origins=origins,
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
        refusal = self._allowlist.refusal(url)
        if refusal is not None:
            # The URL as given (no credentials: normalize_url refused those; query hidden): its
            # normal form may already have resolved the very dot segments that are refused.
            raise _bad(index, f"server_url {redact_url(url)} {refusal}", code="mcp_server_not_allowed")
        headers = _client_headers(index, tool)
        digest = hashlib.sha256(repr(sorted((k.lower(), v) for k, v in headers.items())).encode()).hexdigest()
        endpoint = Endpoint(url=normal, headers=headers)
        return _Declared(index, label, endpoint, ("client", normal, digest), allowed, approval)
