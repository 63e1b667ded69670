"""`StreamStitcher` alone (DESIGN.md §6): the SSE events of several rounds become one client stream.

A `ClientStream` over a list-appending ``send`` (no server): upstream events go in as
`UpstreamEvent` objects, the client's frames are parsed back out of the body messages.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.types import Message

from budget import BudgetExceeded, ChargeModel, Ledger
from middleware.asgi.client_stream import ClientStream
from middleware.loop.stitcher import StreamStitcher
from middleware.tools.resolved import GatewayTool, ResolvedTools
from middleware.upstream.reader import UpstreamEvent

GATEWAY_ID = "resp_gateway0001"
MCP_TOOL = {
    "type": "mcp",
    "server_label": "s",
    "server_url": "https://mcp.example/mcp",
    "authorization": "sk-x",
}
LIST_ITEM = {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "s", "tools": [{"name": "get"}]}


def resolved(request: dict[str, Any]) -> ResolvedTools:
    """With an ``mcp`` tool in `request`: one declared MCP server ``s`` whose tool ``get`` the
    upstream sees as function ``get``; without: no tools."""
    if not request.get("tools"):
        return ResolvedTools(
            upstream_tools=[], list_items=[], gateway_tools={}, endpoints={}, connect_timeout=1.0
        )
    return ResolvedTools(
        upstream_tools=[{"type": "function", "name": "get", "parameters": {}, "strict": False}],
        list_items=[LIST_ITEM],
        gateway_tools={
            "get": GatewayTool(server_label="s", name="get", function_name="get", require_approval=False)
        },
        endpoints={},
        connect_timeout=1.0,
    )


def up(obj: dict[str, Any]) -> UpstreamEvent:
    return UpstreamEvent(obj["type"], json.dumps(obj).encode(), obj)


def frames(sent: list[Message]) -> list[tuple[bytes, bytes]]:
    """(event line, data bytes) of every SSE frame the client got, in order."""
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    out = []
    for block in body.split(b"\n\n"):
        if block:
            lines = block.split(b"\n")
            event = lines[0] if lines[0].startswith(b"event: ") else b""
            out.append((event, lines[-1].removeprefix(b"data: ")))
    return out


def stitch(
    request: dict[str, Any], script: Callable[[StreamStitcher], Awaitable[None]]
) -> tuple[list[Message], StreamStitcher]:
    sent: list[Message] = []

    async def main() -> StreamStitcher:
        async def send(message: Message) -> None:
            sent.append(message)

        ledger = Ledger(1 << 30, ChargeModel.measured())
        stitcher = StreamStitcher(
            ClientStream(send), resolved(request), GATEWAY_ID, request, [], ledger=ledger
        )
        await script(stitcher)
        await stitcher.client.flush()  # what the loop does before it waits (the frames are buffered)
        return stitcher

    return sent, asyncio.run(main())


def round_one(index: int = 0) -> list[dict[str, Any]]:
    """An upstream round that calls the gateway tool ``get``."""
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get", "arguments": "{}"}
    response = {"id": "resp_upstream1", "object": "response", "model": "m", "created_at": 7}
    return [
        {"type": "response.created", "sequence_number": 0, "response": {**response, "status": "in_progress"}},
        {
            "type": "response.in_progress",
            "sequence_number": 1,
            "response": {**response, "status": "in_progress"},
        },
        {"type": "response.output_item.added", "sequence_number": 2, "output_index": index, "item": call},
        {
            "type": "response.function_call_arguments.delta",
            "sequence_number": 3,
            "output_index": index,
            "delta": "{}",
        },
        {"type": "response.output_item.done", "sequence_number": 4, "output_index": index, "item": call},
        {"type": "response.completed", "sequence_number": 5, "response": {**response, "status": "completed"}},
    ]


def round_two() -> list[dict[str, Any]]:
    """The next round: a message at upstream output_index 0."""
    msg = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
    response = {"id": "resp_upstream2", "object": "response", "model": "m"}
    return [
        {"type": "response.created", "sequence_number": 0, "response": response},
        {"type": "response.in_progress", "sequence_number": 1, "response": response},
        {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": msg},
        {"type": "response.output_text.delta", "sequence_number": 3, "output_index": 0, "delta": "hi"},
        {"type": "response.completed", "sequence_number": 4, "response": {**response, "status": "completed"}},
    ]


async def two_rounds(st: StreamStitcher) -> None:
    for obj in round_one():
        await st.forward(up(obj))
    call = round_one()[2]["item"]
    await st.announce_call(call)
    await st.finish_call(call, {"type": "mcp_call", "id": st.call_ids[id(call)], "status": "completed"})
    for obj in round_two():
        await st.forward(up(obj))
    await st.terminal({"id": GATEWAY_ID, "object": "response", "status": "completed", "output": []})


def test_two_rounds_are_one_stream_with_the_gateway_call_shown_as_mcp_call() -> None:
    sent, _ = stitch({"model": "m", "input": "x", "stream": True, "tools": [MCP_TOOL]}, two_rounds)
    got = frames(sent)
    assert [event for event, _ in got] == [
        b"event: response.created",
        b"event: response.in_progress",
        b"event: response.output_item.added",  # mcp_list_tools, client index 0
        b"event: response.mcp_list_tools.in_progress",
        b"event: response.mcp_list_tools.completed",
        b"event: response.output_item.done",
        b"event: response.output_item.added",  # mcp_call, index 1 (the function_call is hidden)
        b"event: response.mcp_call.in_progress",
        b"event: response.mcp_call.completed",
        b"event: response.output_item.done",
        b"event: response.output_item.added",  # round two's message: upstream index 0 -> 2
        b"event: response.output_text.delta",
        b"event: response.completed",  # the one terminal event (the upstream's two were held)
        b"",
    ]
    assert got[-1][1] == b"[DONE]"
    objs = [json.loads(data) for _, data in got[:-1]]
    assert [o["sequence_number"] for o in objs] == list(range(13))
    assert [o.get("output_index") for o in objs[2:12]] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert objs[2]["item"] == LIST_ITEM and objs[6]["item"]["type"] == "mcp_call"
    assert objs[6]["item"]["server_label"] == "s" and objs[6]["item"]["status"] == "in_progress"
    created = objs[0]["response"]
    assert created["id"] == GATEWAY_ID and created["status"] == "in_progress" and created["output"] == []
    assert created["tools"][0]["authorization"] is None  # an MCP secret is never echoed
    assert objs[1]["response"]["id"] == GATEWAY_ID


def test_an_event_that_needs_no_rewrite_goes_out_as_the_upstream_sent_it() -> None:
    delta = {"type": "response.output_text.delta", "sequence_number": 2, "output_index": 0, "delta": "x"}
    raw = b'{"type":"response.output_text.delta","sequence_number":2,"output_index":0,  "delta":"x"}'

    async def script(st: StreamStitcher) -> None:
        for obj in round_two()[:2]:
            await st.forward(up(obj))
        await st.forward(UpstreamEvent(delta["type"], raw, dict(delta)))

    # no tools: no mcp_list_tools item, so index 0 stays 0 and sequence 2 is the next one
    sent, _ = stitch({"model": "m", "input": "x", "stream": True}, script)
    assert frames(sent)[2] == (b"event: response.output_text.delta", raw)


def test_a_background_stream_opens_queued_then_in_progress() -> None:
    async def script(st: StreamStitcher) -> None:
        await st.ensure_started()

    sent, _ = stitch({"model": "m", "input": "x", "stream": True, "background": True}, script)
    got = [(event, json.loads(data)) for event, data in frames(sent)]
    assert [event for event, _ in got] == [
        b"event: response.created",
        b"event: response.queued",
        b"event: response.in_progress",
    ]
    assert [obj["response"]["status"] for _, obj in got] == ["queued", "queued", "in_progress"]
    assert all(obj["response"]["background"] is True for _, obj in got)


def test_the_snapshot_is_the_response_so_far_under_the_gateway_id() -> None:
    items: list[dict[str, Any]] = [{"type": "message", "id": "msg_0"}]

    async def script(st: StreamStitcher) -> None:
        st.items = items
        await st.forward(up(round_one()[0]))

    _, st = stitch({"model": "m", "input": "x", "stream": True, "store": False}, script)
    assert st.client.snapshot is not None
    snap = st.client.snapshot()
    assert snap["id"] == GATEWAY_ID and snap["output"] == items
    assert snap["created_at"] == 7  # the upstream's scalar kept from its response.created
    assert snap["store"] is False and snap["model"] == "m"


def test_a_buffered_answer_is_synthesized_without_the_gateway_calls() -> None:
    call = {"type": "function_call", "call_id": "c", "name": "get", "arguments": "{}"}
    client_call = {"type": "function_call", "call_id": "d", "name": "mine", "arguments": "{}"}
    message = {"type": "message", "id": "msg_1", "role": "assistant", "content": []}

    async def script(st: StreamStitcher) -> None:
        await st.synthesize({"id": "resp_up", "object": "response"}, [call, client_call, message])

    sent, _ = stitch({"model": "m", "input": "x", "stream": True, "tools": [MCP_TOOL]}, script)
    added = [json.loads(d) for e, d in frames(sent) if e == b"event: response.output_item.added"]
    assert [(o["output_index"], o["item"]["type"]) for o in added] == [
        (0, "mcp_list_tools"),
        (1, "function_call"),
        (2, "message"),
    ]
    assert added[1]["item"]["name"] == "mine"


BIG_ITEM = {"type": "message", "id": "msg_1", "role": "assistant", "content": [], "pad": ["ab"] * 20_000}
BIG_ADDED = {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": BIG_ITEM}


def _keep_big_added(ledger: Ledger) -> tuple[int, int, int]:
    """Forward a round's lifecycle events and `BIG_ADDED` to a stitcher charging `ledger`: what
    forwarding the item kept (bytes, tracemalloc), what the ledger then held, and what it held once
    the round ended."""
    import gc
    import tracemalloc

    from middleware.upstream.reader import loads_upstream

    request: dict[str, Any] = {"model": "m", "input": "hi", "stream": True}

    async def send(message: Message) -> None:
        return None

    async def main() -> tuple[int, int, int]:
        stitcher = StreamStitcher(
            ClientStream(send), resolved(request), GATEWAY_ID, request, [], ledger=ledger
        )
        for obj in round_two()[:2]:
            await stitcher.forward(up(obj))
        data = json.dumps(BIG_ADDED).encode()
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            event = UpstreamEvent(BIG_ADDED["type"], data, loads_upstream(data))
            await stitcher.forward(event)
            del event
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert stitcher.round_items[0]["id"] == "msg_1"
        charged = ledger.charged
        await stitcher.forward(up(round_two()[-1]))  # the round ends: the items are dropped
        return kept, charged, ledger.charged

    return asyncio.run(main())


def test_an_item_kept_as_added_is_charged_until_the_round_ends() -> None:
    """The stitcher keeps each visible item as it was added for the round (`seen_items`, when the
    client goes away before it finished): the request's ledger is charged for it (it was kept
    uncharged: an upstream's large ``output_item.added`` held memory outside the ledger), the
    charge covers what is kept and is released when the round ends; an item that does not fit is
    a cap hit (`BudgetExceeded`)."""
    for model in (ChargeModel.measured(), ChargeModel.reference()):
        kept, charged, after = _keep_big_added(Ledger(1 << 30, model))
        assert charged >= kept > 100_000, (model.name, charged, kept)
        assert after == 0
    with pytest.raises(BudgetExceeded):
        _keep_big_added(Ledger(200_000, ChargeModel.measured()))
