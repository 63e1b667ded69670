"""Whole-request ledger runs, fed the way the gateway feeds it (agentic-api #288 and friends)."""

from __future__ import annotations

import json

import pytest

from budget import BudgetExceeded, ChargeModel, JsonNodeCounter, Ledger, Limits, count_json_nodes
from budget.costs import tool_definition

MiB = 1 << 20


def dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def sse(event: str, data: dict[str, object]) -> bytes:
    return f"event: {event}\ndata: ".encode() + dumps(data) + b"\n\n"


def response(output: list[object], status: str = "completed") -> dict[str, object]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1_730_000_000,
        "status": status,
        "model": "gpt-4o",
        "output": output,
        "usage": {"input_tokens": 10, "output_tokens": 5000, "total_tokens": 5010},
    }


def answer_stream(deltas: list[str]) -> tuple[bytes, dict[str, object]]:
    """A Responses SSE stream with one message streamed as ``deltas``; returns (wire, item)."""
    text = "".join(deltas)
    item = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    part = {"type": "output_text", "text": "", "annotations": []}
    frames = [
        sse(
            "response.created",
            {"type": "response.created", "sequence_number": 0, "response": response([], "in_progress")},
        ),
        sse(
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**item, "status": "in_progress", "content": []},
            },
        ),
        sse(
            "response.content_part.added",
            {
                "type": "response.content_part.added",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "part": part,
            },
        ),
    ]
    for i, delta in enumerate(deltas):
        frames.append(
            sse(
                "response.output_text.delta",
                {
                    "type": "response.output_text.delta",
                    "item_id": "msg_1",
                    "output_index": 0,
                    "content_index": 0,
                    "delta": delta,
                    "sequence_number": i + 3,
                },
            )
        )
    frames += [
        sse(
            "response.output_text.done",
            {"type": "response.output_text.done", "item_id": "msg_1", "text": text},
        ),
        sse(
            "response.content_part.done",
            {"type": "response.content_part.done", "item_id": "msg_1", "part": {**part, "text": text}},
        ),
        sse(
            "response.output_item.done",
            {"type": "response.output_item.done", "output_index": 0, "item": item},
        ),
        sse("response.completed", {"type": "response.completed", "response": response([item])}),
    ]
    return b"".join(frames), item


def run_stream(ledger: Ledger, wire: bytes, chunk: int) -> dict[str, object]:
    """Feed ``wire`` in network chunks of ``chunk`` bytes, as the gateway's SSE reader will.

    Raw bytes are charged when they arrive and released when their frame completes; each frame's
    payload is checked transiently before it is parsed; the accumulator keeps delta text, then
    the item's .done snapshot, then the terminal response, admitting each snapshot before
    releasing what it replaces. Returns the terminal response."""
    buffer = b""
    deltas: list[int] = []
    items: list[int] = []
    terminal: dict[str, object] = {}
    for start in range(0, len(wire), chunk):
        piece = wire[start : start + chunk]
        ledger.admit_stream_chunk(piece)
        buffer += piece
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            data = frame.split(b"\ndata: ", 1)[1]
            ledger.check_stream_frame(data)
            event = json.loads(data)
            ledger.release_stream_bytes(len(frame) + 2)
            kind = event["type"]
            if kind == "response.output_text.delta":
                deltas.append(ledger.admit_accumulated(event["delta"].encode(), nodes=0))
            elif kind == "response.output_item.done":
                items.append(ledger.admit_accumulated(dumps(event["item"])))
                for charge in deltas:
                    ledger.release(charge)
                deltas.clear()
            elif kind == "response.completed":
                terminal = event["response"]
                ledger.admit_accumulated(dumps(terminal))
                for charge in items:
                    ledger.release(charge)
                items.clear()
    assert buffer == b""
    return terminal


def test_200kb_answer_in_10000_deltas_fits_the_default_budget_with_store() -> None:
    ledger = Ledger(Limits().max_retained_bytes, ChargeModel(), store=True)
    ledger.admit_input(dumps({"model": "gpt-4o", "input": "Write a long essay.", "stream": True}))
    deltas = [f"word{i:05d} "[:20].ljust(20, ".") for i in range(10_000)]
    wire, item = answer_stream(deltas)
    assert len("".join(deltas)) == 200_000 and len(wire) > 2_000_000  # the envelopes are 10x the text
    for chunk in (16 * 1024, 1500):
        led = Ledger(ledger.limit, ChargeModel(), store=True)
        led.admit_input(dumps({"model": "gpt-4o", "input": "Write a long essay.", "stream": True}))
        terminal = run_stream(led, wire, chunk)
        led.admit_terminal(dumps(terminal))
        assert terminal["output"] == [item]
        assert led.charged < 24 * MiB, led.charged
        assert led.peak < 40 * MiB, led.peak
        # about 32 x 2 x the text for what is kept, not x the envelopes
        assert 12_800_000 < led.charged < 2 * 12_800_000


def test_counting_every_envelope_cumulatively_would_reject_it() -> None:
    """The failure mode of agentic-api #288, reproduced on purpose: keeping each envelope's
    charge instead of releasing it overflows the same budget."""
    wire, _ = answer_stream(["x" * 20] * 10_000)
    led = Ledger(Limits().max_retained_bytes, ChargeModel(), store=True)
    with pytest.raises(BudgetExceeded) as info:
        for frame in wire.split(b"\n\n")[:-1]:
            led.admit_accumulated(frame.split(b"\ndata: ", 1)[1])
    assert info.value.phase == "accumulated"


def test_ten_round_loop_echoing_50_tools_fits_the_default_limit_with_store() -> None:
    tools = [tool_definition(i) for i in range(50)]
    assert 1900 <= count_json_nodes(dumps(tools)) <= 2200  # "about 2,000 JSON nodes"
    request = {"model": "gpt-4o", "input": "Plan my week.", "tools": tools, "store": True}
    led = Ledger(Limits().max_retained_bytes, ChargeModel(), store=True)
    led.admit_input(dumps(request))
    kept: list[object] = []
    for round_no in range(10):
        last = round_no == 9
        item: dict[str, object] = (
            {
                "type": "message",
                "id": "msg_9",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Done. " * 200, "annotations": []}],
            }
            if last
            else {
                "type": "function_call",
                "id": f"fc_{round_no}",
                "call_id": f"call_{round_no}",
                "name": "get_weather_000",
                "arguments": '{"city":"Paris","units":"celsius"}',
                "status": "completed",
            }
        )
        body = dumps({**response([item]), "tools": tools, "instructions": "Be brief.", "tool_choice": "auto"})
        counter = JsonNodeCounter()  # the body arrives in chunks and is charged as it is read
        held = 0
        for start in range(0, len(body), 8192):
            piece = body[start : start + 8192]
            before = counter.nodes
            counter.feed(piece)
            held += led.admit_output(piece, nodes=counter.nodes - before)
        assert counter.nodes == count_json_nodes(body)
        kept.append(item)
        led.admit_accumulated(dumps(item))  # the round's kept output items
        led.release(held)  # then the body goes
        if not last:
            led.admit_tool_result(dumps({"temperature": 14.5, "summary": "mild"}))
    led.admit_terminal(dumps({**response(kept), "tools": tools}))
    assert led.peak <= led.limit
    assert led.charged < 8 * MiB  # what is kept is small; only one body is ever held at a time


def test_the_same_loop_without_releasing_bodies_overflows() -> None:
    tools = [tool_definition(i) for i in range(50)]
    body = dumps({**response([]), "tools": tools})
    led = Ledger(Limits().max_retained_bytes, ChargeModel(), store=True)
    with pytest.raises(BudgetExceeded) as info:
        for _ in range(10):
            led.admit_output(body)
    assert info.value.phase == "output"
