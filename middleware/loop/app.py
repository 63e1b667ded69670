"""`ResponsesApp`: ``POST /v1/responses`` behind the guard — which path serves the request.

Requests with gateway-owned (MCP) tools, requests that use the store (``store`` on,
``previous_response_id``, ``conversation``), and requests whose input holds items only the gateway
understands (`middleware.loop.lowering.GATEWAY_INPUT_TYPES`, ``compaction`` items) run in
`AgentLoop`; the rest — one stateless round with nothing for the gateway to change — take
`Passthrough`. Every WebSocket turn runs in `AgentLoop` (its response is kept in connection memory
for the next turn, `middleware.loop.memory`). Both read the admitted `RequestContext`
from the scope, write only through its `ClientStream`, and raise failures for the guard
(`middleware.asgi.guard`) to settle: they never answer an error themselves (DESIGN.md §2, §5).
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from middleware.loop.agent import AgentLoop
from middleware.loop.compaction import has_compaction
from middleware.loop.context import context_of
from middleware.loop.lowering import carries_gateway_items
from middleware.loop.passthrough import Passthrough
from middleware.state import GatewayState


class ResponsesApp:
    """Pure ASGI app for ``POST /v1/responses`` (needs `BudgetMiddleware` around it)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = context_of(scope)
        tools = ctx.request.get("tools")
        has_mcp = isinstance(tools, list) and any(
            isinstance(t, dict) and t.get("type") == "mcp" for t in tools
        )
        stateful = self.state.store is not None and (
            ctx.memory is not None  # a WebSocket turn: kept in connection memory
            or ctx.store
            or ctx.request.get("previous_response_id") is not None
            or ctx.request.get("conversation") is not None
        )
        # input the client got from the gateway (mcp_* items, item_references) needs lowering, and
        # so do compaction items
        input_items = ctx.request.get("input")
        if has_mcp or stateful or carries_gateway_items(input_items) or has_compaction(input_items):
            assert self.state.catalog is not None, "the lifespan creates the tool catalog"
            resolved = await self.state.catalog.resolve(
                tools if isinstance(tools, list) else None,
                tenant=ctx.owner,
                ledger=ctx.ledger,
                store=ctx.store,
            )
            await AgentLoop(self.state, ctx, resolved).run()
        else:
            await Passthrough(self.state, ctx).run()
