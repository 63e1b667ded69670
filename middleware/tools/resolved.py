"""What one request's tools resolved to: `ResolvedTools` and its `GatewayTool`s.

`middleware.tools.catalog.ToolCatalog.resolve` makes a `ResolvedTools` once per client request; the
loop controller reads it (the upstream's tools, the ``mcp_list_tools`` items, which function calls
are gateway-owned) and `middleware.tools.execute.run_tool_calls` runs calls through it. Plain data:
no I/O, and neither of those modules is imported here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from middleware.tools.endpoints import Endpoint
from middleware.tools.pool import SessionPool

__all__ = ["GatewayTool", "ResolvedTools"]

_TOOLS_INDEX = re.compile(r"\btools\[(\d{1,9})\]")


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
    * `gateway_tool` — the `GatewayTool` behind a function name, or None (client-owned);
      `function_name` / `server_functions` — the other way, from a label (and MCP name);
    * `client_text` — an upstream error text re-indexed from ``upstream_tools`` to the client's
      ``tools`` (``origins[i]``: the client index ``upstream_tools[i]`` came from).

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
        origins: Sequence[int] | None = None,
    ) -> None:
        self.upstream_tools = upstream_tools
        # upstream_tools[i] stands for the client's tools[origins[i]] (default: the same index)
        self._origins = list(origins) if origins is not None else list(range(len(upstream_tools)))
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

    def function_name(self, server_label: str, name: str) -> str | None:
        """The upstream function name of MCP tool `name` of the server this request declared as
        `server_label`, or None when the request does not expose it (undeclared, or filtered out
        by ``allowed_tools``)."""
        for tool in self._gateway_tools.values():
            if tool.server_label == server_label and tool.name == name:
                return tool.function_name
        return None

    def server_functions(self, server_label: str) -> list[str]:
        """The upstream function names of every tool this request exposes from `server_label`
        (declaration order); empty when the label is not declared or exposes nothing."""
        return [t.function_name for t in self._gateway_tools.values() if t.server_label == server_label]

    def client_text(self, text: str) -> str:
        """`text` (an upstream error's ``param`` or message) with every ``tools[i]`` that indexes
        the expanded tools sent upstream rewritten to the client's own ``tools[j]`` (case B29:
        the client cannot find ``tools[48]`` in a request that declared three tools)."""

        def swap(match: re.Match[str]) -> str:
            index = int(match.group(1))
            if index < len(self._origins):
                return f"tools[{self._origins[index]}]"
            return match.group(0)

        return _TOOLS_INDEX.sub(swap, text)

    def argument_problem(self, function_name: str, arguments: dict[str, Any]) -> str | None:
        """Why the tool sent upstream as `function_name` refuses `arguments` (its input schema,
        JSON Schema, says so: the first error's message, at most 300 characters), or None when
        they are accepted (or the tool or its schema is unknown, or the schema itself is invalid:
        the MCP server then decides)."""
        schema = next(
            (
                t.get("parameters")
                for t in self.upstream_tools
                if t.get("type") == "function" and t.get("name") == function_name
            ),
            None,
        )
        if not isinstance(schema, dict):
            return None
        try:
            validator = jsonschema.validators.validator_for(schema)(schema)
            error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
        except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.UnknownType, RecursionError):
            return None
        return None if error is None else str(error.message)[:300]

    def endpoint(self, server_label: str) -> Endpoint:
        """How to reach the server this request declared as `server_label` (KeyError if none)."""
        return self._endpoints[server_label]
