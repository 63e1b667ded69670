"""The Responses app behind `BudgetMiddleware`: one client request, its upstream rounds, one answer.

Requests with gateway-owned (MCP) tools, and requests that use the store (``store`` on,
``previous_response_id``, ``conversation``) run in `AgentLoop`; the rest — one stateless round
with nothing for the gateway to change — take the pass-through path here.

It reads the `RequestContext` the middleware admitted, calls the upstream (mirroring the client's
``stream`` flag; an SSE answer to a buffered call is aggregated), charges everything it keeps to
the request's ledger (`middleware.upstream.reader`), and either forwards the stream to the client or
answers the final response as JSON. It never answers an error itself: it raises, and the
middleware — the single outcome authority — answers (DESIGN.md §2, §5).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Receive, Scope, Send

from middleware.asgi.client_stream import Outbox
from middleware.asgi.guard import context_of
from middleware.errors import GatewayError
from middleware.loop.agent import AgentLoop, read_limited, upstream_error_event
from middleware.loop.context import RequestContext
from middleware.ops import metrics
from middleware.state import GatewayState
from middleware.upstream.httpx_client import UpstreamResponse, upstream_status_error
from middleware.upstream.reader import (
    TERMINAL_EVENTS,
    StreamAccumulator,
    UpstreamEvent,
    read_response_object,
    read_stream_events,
)
from middleware.upstream.sse import encode_event

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


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
            ctx.store
            or ctx.request.get("previous_response_id") is not None
            or ctx.request.get("conversation") is not None
        )
        # SSE frames are coalesced; on any failure (a raise, the deadline, the drain) the
        # middleware flushes ctx.outbox before its error frame
        outbox = ctx.outbox = Outbox(send)
        if has_mcp or stateful:
            assert self.state.catalog is not None, "the lifespan creates the tool catalog"
            resolved = await self.state.catalog.resolve(
                tools if isinstance(tools, list) else None, tenant=ctx.owner
            )
            await AgentLoop(self.state, ctx, outbox, resolved).run()
        else:
            await _Exchange(self.state, ctx, outbox).run()


class _Exchange:
    """The pass-through path: one stateless round, nothing for the gateway to rewrite."""

    def __init__(self, state: GatewayState, ctx: RequestContext, send: Outbox) -> None:
        self.state = state
        self.ctx = ctx
        self.send = send

    async def run(self) -> None:
        upstream = self.state.upstream_for(self.ctx.route)
        self.ctx.rounds += 1
        metrics.INFERENCE_ROUNDS.observe(1)  # the pass-through path makes exactly one inference call
        response = await upstream.post("/responses", self.ctx.raw, stream=self.ctx.stream)
        try:
            if response.status_code >= 400:
                raise upstream_status_error(response.status_code, await read_limited(response))
            is_sse = response.headers.get("content-type", "").lower().startswith("text/event-stream")
            if self.ctx.stream and is_sse:
                await self._forward_stream(response)
            elif is_sse:
                final = await self._aggregate_stream(response)
                await self._answer_json(json.dumps(final, separators=(",", ":")).encode())
            else:
                body, parsed = await self._read_buffered(response)
                if self.ctx.stream:  # a server that ignored "stream": the client still gets SSE
                    await self._synthesize_stream(parsed)
                else:
                    await self._answer_json(body)
        finally:
            await response.aclose()

    # -- buffered ------------------------------------------------------------------------------
    async def _read_buffered(self, response: UpstreamResponse) -> tuple[bytes, dict[str, Any]]:
        """The upstream's JSON body and its parse (its output stays charged for the request)."""
        answer = await read_response_object(response, self.ctx.ledger)
        return answer.body, answer.parsed

    async def _synthesize_stream(self, response: dict[str, Any]) -> None:
        """The SSE events of a complete response object: created, each item added and done, the
        terminal event its status names."""
        items = [item for item in response.get("output") or [] if isinstance(item, dict)]
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": {**response, "status": "in_progress", "output": []}})
        ]
        for index, item in enumerate(items):
            events.append(("response.output_item.added", {"output_index": index, "item": item}))
            events.append(("response.output_item.done", {"output_index": index, "item": item}))
        status = response.get("status")
        terminal = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
            str(status), "response.completed"
        )
        events.append((terminal, {"response": response}))
        await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for kind, payload in events:
            obj = {"type": kind, "sequence_number": self.ctx.next_sequence, **payload}
            self.ctx.next_sequence += 1
            data = json.dumps(obj, separators=(",", ":")).encode()
            await self.send(
                {"type": "http.response.body", "body": encode_event(kind, data), "more_body": True}
            )
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _answer_json(self, raw: bytes) -> None:
        self.ctx.ledger.admit_terminal(raw)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.send({"type": "http.response.body", "body": raw})

    # -- streamed ------------------------------------------------------------------------------
    def _events(self, response: UpstreamResponse) -> Any:
        return read_stream_events(
            response,
            self.ctx.ledger,
            keepalive=self.send.keepalive,
            keepalive_interval=self.state.settings.keepalive_interval,
            idle=self.send.flush,
            last_sent=self.send.last_sent,
        )

    async def _aggregate_stream(self, response: UpstreamResponse) -> dict[str, Any]:
        acc = StreamAccumulator(self.ctx.ledger)
        async for event in self._events(response):
            if event.type == "error":
                raise upstream_error_event(event.obj)
            acc.apply(event)
            if event.type in TERMINAL_EVENTS:
                break
        if acc.terminal is None:
            raise GatewayError(
                "upstream stream ended without a terminal event", status=502, code="upstream_incomplete"
            )
        final = dict(acc.terminal)
        final["output"] = acc.output()
        return final

    async def _emit(self, event: UpstreamEvent) -> None:
        """Forward one event with the next client sequence number (re-encoded only if it differs)."""
        data = event.data
        sequence = event.obj.get("sequence_number")
        if type(sequence) is not int or sequence != self.ctx.next_sequence:  # 2.0 / true: re-encoded
            event.obj["sequence_number"] = self.ctx.next_sequence
            data = json.dumps(event.obj, separators=(",", ":")).encode()
        self.ctx.next_sequence += 1
        await self.send(
            {"type": "http.response.body", "body": encode_event(event.type, data), "more_body": True}
        )

    async def _forward_stream(self, response: UpstreamResponse) -> None:
        # Forwarded and dropped: nothing of the stream is kept on this path, so nothing is
        # accumulated (the parser's bytes and each frame's parse are still charged).
        async for event in self._events(response):
            if event.type == "error":
                raise upstream_error_event(event.obj)
            if not self.ctx.committed:
                await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await self._emit(event)
            if event.type in TERMINAL_EVENTS:
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        raise GatewayError(
            "upstream stream ended without a terminal event", status=502, code="upstream_incomplete"
        )
