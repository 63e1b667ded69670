"""Gateway-owned tools: MCP servers shown to the model as function tools, their calls run here.

DESIGN.md §6. The rest of the gateway imports from here only (`__all__`).

Per client request the loop controller calls ``resolved = await catalog.resolve(tools, tenant=...)``
(a `ToolCatalog` per process), asks ``resolved.gateway_tool(name)`` whether a function call is
gateway-owned (a `GatewayTool`) or the client's (None), runs the gateway-owned ones with ``await
run_tool_calls(resolved, calls, ledger=...)`` (one `ToolOutcome` per call, in call order) and
answers each call the client denied with ``refuse_tool_call(call, reason)``.

One job per module:

* `catalog` — `ToolCatalog.resolve`: a request's ``mcp`` tools become function tools (names,
  ``LABEL__name``, the ``tools/list`` cache), or the request is refused.
* `listing` — what a ``tools/list`` answer costs: `ListingMeter` (its charge while it is read)
  and `ListingCache` (the byte-bounded LRU of listings kept across requests).
* `resolved` — `ResolvedTools` and `GatewayTool`: what one request's tools resolved to.
* `policy` — the ``allowed_tools`` and ``require_approval`` filters.
* `execute` — `run_tool_calls` (window, timeout, cap, charge, retry) and `refuse_tool_call`.
* `endpoints` — ingress policy: `McpServerConfig`, `Endpoint`, `normalize_url`, `path_refusal`,
  `UrlAllowlist`, `validate_headers`.
* `session` — `open_session`, the HTTP transport under a session (it never follows a redirect),
  `SessionHealth`, `call_not_run`.
* `pool` — `SessionPool` and its `Lease`, `PoolLimits`, `PoolStats`.
* `text` — lone-surrogate scrubbing, MCP results as text, exception summaries.

Imports point one way: ``text``, ``policy`` and ``endpoints`` import no other tool module;
``session`` and ``listing`` use ``endpoints``; ``pool`` uses ``session``; ``resolved`` uses ``pool``;
``catalog`` (which also uses ``listing``) and ``execute`` use ``resolved`` and never each other.
"""

from middleware.tools.catalog import ToolCatalog
from middleware.tools.endpoints import McpServerConfig, UrlAllowlist
from middleware.tools.execute import ToolLedger, ToolOutcome, refuse_tool_call, run_tool_calls
from middleware.tools.pool import PoolLimits
from middleware.tools.resolved import GatewayTool, ResolvedTools

__all__ = [
    "GatewayTool",
    "McpServerConfig",
    "PoolLimits",
    "ResolvedTools",
    "ToolCatalog",
    "ToolLedger",
    "ToolOutcome",
    "UrlAllowlist",
    "refuse_tool_call",
    "run_tool_calls",
]
