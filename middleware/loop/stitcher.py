"""`StreamStitcher`: the SSE events of every round as one logical client stream (DESIGN.md §6).

One ``response.created`` and ``response.in_progress`` (the gateway's response id, the client's
tools echoed with MCP secrets as null; a background response's ``response.created`` is
``queued`` and a ``response.queued`` follows it, as OpenAI streams them), ``sequence_number`` from 0 (the `ClientStream` numbers),
``output_index`` offset by earlier rounds, gateway ``function_call`` events hidden and replaced by
``mcp_call`` lifecycle events, upstream terminal events held back, and exactly one terminal event
(`terminal`) — then ``data: [DONE]``. Runs of frames it would forward unchanged go out as received
(`fast_count`, the stream fast path of `middleware.upstream.reader`). It sets the `ClientStream`'s ``snapshot`` to the response so
far (its items), for the ``response.failed`` event of a failure after commit.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import Any

from budget import Ledger
from middleware.asgi.client_stream import ClientStream
from middleware.ids import new_id
from middleware.loop.echo import normalise_response
from middleware.loop.items import call_arguments, public_tools, response_summary, terminal_event
from middleware.tools import ResolvedTools
from middleware.upstream.reader import LIFECYCLE_EVENTS, TERMINAL_EVENTS, UpstreamEvent


class StreamStitcher:
    """Turns the SSE events of every round into one logical client stream (DESIGN.md §6)."""

    def __init__(
        self,
        client: ClientStream,
        resolved: ResolvedTools,
        response_id: str,
        request: dict[str, Any],
        items: list[dict[str, Any]],
        *,
        ledger: Ledger,
        created_at: int | None = None,
    ) -> None:
        """``client``: the writer; ``resolved``: the request's tools; ``response_id``: the gateway's
        id; ``request``: the client's request; ``items``: the client-visible output so far (the
        loop's list, read for the failure snapshot); ``created_at``: see `normalise_response`;
        ``ledger``: the request's, which charges the items kept as added (`round_items`) until the
        round ends."""
        self.client = client
        self.ledger = ledger
        self._added_charge = 0  # what `ledger` holds for `round_items` (bytes)
        self.resolved = resolved
        self.response_id = response_id
        self.request = request
        self.created_at = created_at
        self.items = items
        self.model = request.get("model")
        self.summary: dict[str, Any] = {}  # the upstream's scalar fields (response.created)
        client.snapshot = self.snapshot
        self.next_index = 0
        self.created = False  # response.created sent
        self.started = False  # the first round's lifecycle events are through; mcp_list_tools sent
        self.listed = False
        self.round_map: dict[int, int | None] = {}  # upstream output_index -> client index (None: hidden)
        self.round_items: dict[int, dict[str, Any]] = {}  # upstream output_index -> visible item as added
        self.call_ids: dict[int, str] = {}  # id(function_call item) -> mcp_call item id
        self.call_index: dict[int, int] = {}

    async def _emit(self, event_type: str, obj: dict[str, Any]) -> None:
        await self.client.event(event_type, obj)

    def _public_response(self, response: dict[str, Any]) -> dict[str, Any]:
        public = dict(response)
        public["id"] = self.response_id
        public["tools"] = public_tools(self.request.get("tools"))
        public["tool_choice"] = self.request.get("tool_choice", "auto")
        public["previous_response_id"] = self.request.get("previous_response_id")
        public["store"] = self.request.get("store") is not False  # the client's, not the upstream call's
        public["background"] = self.request.get("background") is True
        normalise_response(public, self.request, created_at=self.created_at)
        return public

    def snapshot(self) -> dict[str, Any]:
        """The response so far: the upstream's scalar fields (`response_summary` of its
        ``response.created``), the gateway's id, the client's tools, the items."""
        base = {"object": "response", "model": self.model, **self.summary}
        return {**self._public_response(base), "output": list(self.items)}

    async def _list_tools(self) -> None:
        if self.listed:
            return
        self.listed = True
        for item in self.resolved.list_items:
            index = self.next_index
            self.next_index += 1
            await self._item_event("response.output_item.added", index, item)
            for kind in ("response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed"):
                await self._emit(kind, {"type": kind, "output_index": index, "item_id": item["id"]})
            await self._item_event("response.output_item.done", index, item)

    async def ensure_started(self) -> None:
        """Open the client stream before any upstream event (work done ahead of the first round)."""
        if not self.started:
            response = {
                "id": self.response_id,
                "object": "response",
                "model": self.request.get("model"),
            }
            await self._start(response)
            self.started = True
            await self._emit(
                "response.in_progress",
                {
                    "type": "response.in_progress",
                    "response": {**self._public_response(response), "status": "in_progress", "output": []},
                },
            )
            await self._list_tools()

    async def _start(self, response: dict[str, Any]) -> None:
        if not self.created:
            self.created = True
            self.summary = response_summary(response)
            background = self.request.get("background") is True
            status = "queued" if background else "in_progress"
            created = {**self._public_response(response), "status": status, "output": []}
            await self._emit("response.created", {"type": "response.created", "response": created})
            if background:  # OpenAI's background stream: created (queued), queued, then in_progress
                await self._emit("response.queued", {"type": "response.queued", "response": dict(created)})

    async def forward(self, event: UpstreamEvent) -> None:
        """Forward, rewrite or hide one upstream event of the current round (terminal events are held)."""
        obj = event.obj
        raw_response = obj.get("response")
        response: dict[str, Any] = raw_response if isinstance(raw_response, dict) else {}
        if event.type in LIFECYCLE_EVENTS:
            if self.started:
                return  # later rounds: one response.created / in_progress per client request
            if event.type == "response.created":
                await self._start(response)
                return
            await self._start(response)
            obj["response"] = self._public_response(response)
            await self._emit(event.type, obj)
            if event.type == "response.in_progress":
                self.started = True
                await self._list_tools()
            return
        if event.type in TERMINAL_EVENTS:
            self.round_map = {}
            self.round_items = {}
            self._release_added()
            await self.ensure_started()  # an upstream that sent nothing before its terminal event
            return
        if not self.started:
            await self._start(response)
            self.started = True
            await self._list_tools()
        index = obj.get("output_index")
        if event.type == "response.output_item.added" and isinstance(index, int):
            item = obj.get("item")
            hidden = (
                isinstance(item, dict)
                and item.get("type") == "function_call"
                and self.resolved.gateway_tool(str(item.get("name"))) is not None
            )
            if hidden:
                self.round_map[index] = None
                return
            self.round_map[index] = self.next_index
            self.next_index += 1
            if isinstance(item, dict):
                # kept until the round ends (`seen_items`): charged as the accumulator charges a
                # finished item, on the frame's bytes (at least the item's); `BudgetExceeded`
                # when it does not fit
                self._added_charge += self.ledger.admit_accumulated(event.data)
                self.round_items[index] = item
        changed = event.changed
        if isinstance(index, int):
            if index not in self.round_map:  # an upstream that skipped output_item.added
                self.round_map[index] = self.next_index
                self.next_index += 1
            mapped = self.round_map[index]
            if mapped is None:
                return
            if mapped != index:
                obj["output_index"] = mapped
                changed = True
        if isinstance(obj.get("response"), dict):
            obj["response"] = self._public_response(obj["response"])
            changed = True
        # nothing to rewrite (most deltas of a first round): the upstream's bytes go out as they are
        await self.client.forward(event.type, event.data, obj, changed=changed)

    def fast_count(self, heads: list[dict[str, Any]]) -> int:
        """How many of the leading frames `heads` (decoded JSON objects of regular frames, no
        lifecycle, item or terminal event: `middleware.upstream.fastpath`) `forward` would send
        unchanged: none before the stream has started (`forward` would open it first); then up to
        the first that carries a ``response`` or an ``output_index`` that is not an ``int`` this
        round maps to itself (offset by earlier rounds, hidden, or not yet added). The fast path
        forwards those as received (`middleware.upstream.reader.FastRun`)."""
        if not self.started:
            return 0
        round_map = self.round_map
        indexes = list(map(dict.get, heads, repeat("output_index")))
        if not any(map(dict.__contains__, heads, repeat("response"))) and all(
            [
                index is None or (type(index) is int and round_map.get(index) == index)
                for index in set(indexes)
            ]
        ):
            return len(heads)  # the usual run: one item's deltas, at its own index
        for i, (head, index) in enumerate(zip(heads, indexes, strict=True)):
            if "response" in head or (
                index is not None and (type(index) is not int or round_map.get(index) != index)
            ):
                return i
        return len(heads)

    def _release_added(self) -> None:
        """Release the charge of the items kept as added (the round ended: they are dropped)."""
        if self._added_charge:
            self.ledger.release(self._added_charge)
        self._added_charge = 0

    def seen_items(
        self, delta_text: Callable[[int], str], done: dict[int, dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The current round's visible items as far as the client saw them, in client order, for
        a response stored before the round ended (client gone, a failure): each finished item
        (`done`, by upstream ``output_index``) as it finished, else the item as it was added,
        ``incomplete``, with the delta text streamed for it so far (`delta_text(index)`) as its
        text (a message) or ``arguments`` (a function call)."""
        seen = []
        for index, item in sorted(
            self.round_items.items(), key=lambda pair: self.round_map.get(pair[0]) or 0
        ):
            if index in done:
                seen.append(done[index])
                continue
            partial = {**item, "status": "incomplete"}
            text = delta_text(index)
            if item.get("type") == "message" and text:
                partial["content"] = [{"type": "output_text", "text": text, "annotations": []}]
            elif item.get("type") == "function_call" and text:
                partial["arguments"] = text
            seen.append(partial)
        return seen

    async def synthesize(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Emit events for a buffered upstream answer (a server that ignored ``stream``)."""
        if not self.started:
            await self._start(response)
            self.started = True
            await self._list_tools()
        for item in items:
            if (
                item.get("type") == "function_call"
                and self.resolved.gateway_tool(str(item.get("name"))) is not None
            ):
                continue
            await self.add_item(item)

    async def _item_event(self, kind: str, index: int, item: dict[str, Any]) -> None:
        """``response.output_item.added`` / ``.done`` for `item` at client `index`."""
        await self._emit(kind, {"type": kind, "output_index": index, "item": item})

    async def add_item(self, item: dict[str, Any]) -> None:
        """A complete item (an approval request, an item of a buffered answer): added and done."""
        index = self.next_index
        self.next_index += 1
        await self._item_event("response.output_item.added", index, item)
        await self._item_event("response.output_item.done", index, item)

    async def announce_call(self, call: dict[str, Any]) -> None:
        """An ``mcp_call`` item is added (in progress) for a gateway call about to run."""
        await self.ensure_started()
        tool = self.resolved.gateway_tool(str(call.get("name")))
        assert tool is not None
        item_id = new_id("mcp")
        index = self.next_index
        self.next_index += 1
        self.call_ids[id(call)] = item_id
        self.call_index[id(call)] = index
        item = {
            "type": "mcp_call",
            "id": item_id,
            "server_label": tool.server_label,
            "name": tool.name,
            "arguments": call_arguments(call),
            "status": "in_progress",
        }
        await self._item_event("response.output_item.added", index, item)
        await self._emit(
            "response.mcp_call.in_progress",
            {"type": "response.mcp_call.in_progress", "output_index": index, "item_id": item_id},
        )

    async def finish_call(self, call: dict[str, Any], item: dict[str, Any]) -> None:
        """The ``mcp_call`` of an executed gateway call completes (or fails)."""
        index = self.call_index[id(call)]
        kind = "response.mcp_call.completed" if item["status"] == "completed" else "response.mcp_call.failed"
        await self._emit(kind, {"type": kind, "output_index": index, "item_id": item["id"]})
        await self._item_event("response.output_item.done", index, item)

    async def terminal(self, final: dict[str, Any]) -> None:
        """The one terminal event, then the end of the stream."""
        kind = terminal_event(final.get("status"))
        await self._emit(kind, {"type": kind, "response": final})
        await self.client.end()
