"""What one request's tools resolved to: `ResolvedTools` and its `GatewayTool`s.

`middleware.tools.catalog.ToolCatalog.resolve` makes a `ResolvedTools` once per client request; the
loop controller reads it (the upstream's tools, the ``mcp_list_tools`` items, which function calls
are gateway-owned) and `middleware.tools.execute.run_tool_calls` runs calls through it. Plain data:
no I/O, and neither of those modules is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from middleware.tools.endpoints import Endpoint
from middleware.tools.pool import SessionPool

__all__ = ["GatewayTool", "ResolvedTools"]


@dataclass(frozen=True)
class GatewayTool:
    """One MCP tool as this request exposes it.

    ``server_label`` — the request's label for its server; ``name`` — the tool's real MCP name
    (what ``tools/call`` gets); ``function_name`` — the name the upstream model sees (``name``, or
    ``LABEL__name`` when two declared servers share ``name``); ``require_approval`` — whether a call
    must be approved by the client before it runs; ``retry_safe`` — its MCP annotations declare
    ``readOnlyHint`` or ``idempotentHint`` (MCP 2025-06-18, ``ToolAnnotations``), so running it again
    on a retry has no further effect (absent: false, it may have side effects).
    """

    server_label: str
    name: str
    function_name: str
    require_approval: bool
    retry_safe: bool = False


class ResolvedTools:
    """The tools of one request after `ToolCatalog.resolve`.

    * ``upstream_tools`` — the request's ``tools`` with each ``mcp`` entry replaced, in place, by one
      ``{"type": "function", "name", "description", "parameters", "strict": False}`` per exposed MCP
      tool (``parameters`` is the tool's ``inputSchema``); every other tool passed through unchanged;
    * ``list_items`` — one ``{"type": "mcp_list_tools", "id": "mcpl_…", "server_label", "tools":
      [{"name", "description", "input_schema", "annotations"}]}`` output item per declared server,
      in declaration order, listing the tools that ``allowed_tools`` lets through;
    * `gateway_tool` — the `GatewayTool` behind a function name, or None (client-owned).

    It also carries, for `run_tool_calls`, how to reach each declared server (`endpoint`), secrets
    included, and the catalog's session ``pool`` (None: `run_tool_calls` uses a pool of its own,
    opening sessions within ``connect_timeout`` seconds); its ``repr`` shows labels and function
    names only.
    """

    def __init__(
        self,
        *,
        upstream_tools: list[dict[str, Any]],
        list_items: list[dict[str, Any]],
        gateway_tools: Mapping[str, GatewayTool],
        endpoints: Mapping[str, Endpoint],
        connect_timeout: float,
        pool: SessionPool | None = None,
    ) -> None:
        self.upstream_tools = upstream_tools
        self.list_items = list_items
        self._gateway_tools = dict(gateway_tools)
        self._endpoints = dict(endpoints)
        self.connect_timeout = connect_timeout
        self.pool = pool

    def __repr__(self) -> str:
        return (
            f"ResolvedTools(servers={list(self._endpoints)!r}, gateway_tools={list(self._gateway_tools)!r})"
        )

    @property
    def gateway_tools(self) -> Mapping[str, GatewayTool]:
        """Function name -> `GatewayTool`, for every gateway-owned tool of this request."""
        return self._gateway_tools

    def gateway_tool(self, function_name: str) -> GatewayTool | None:
        """The gateway-owned tool the upstream knows as `function_name`, or None (client-owned)."""
        return self._gateway_tools.get(function_name)

    def endpoint(self, server_label: str) -> Endpoint:
        """How to reach the server this request declared as `server_label` (KeyError if none)."""
        return self._endpoints[server_label]
