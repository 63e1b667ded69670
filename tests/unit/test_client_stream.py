"""`ClientStream`, the one writer to ``send`` (DESIGN.md §2, §5), over a list-appending ``send``.

Numbering, byte-exact forwarding, coalescing, the end of a stream and failures before and after
commit. The stall bound (``--client-write-timeout``) is tests/unit/test_write_bound_units.py's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Message

from budget import BudgetExceeded
from middleware import outcomes
from middleware.asgi.client_stream import DONE, ClientStream


def run(
    script: Callable[[ClientStream], Awaitable[None]], **kw: Any
) -> tuple[list[Message], list[int], ClientStream]:
    """(messages sent, statuses passed to ``on_final``, the stream) after `script` ran."""
    sent: list[Message] = []
    finals: list[int] = []

    async def main() -> ClientStream:
        async def send(message: Message) -> None:
            sent.append(message)

        stream = ClientStream(send, on_final=finals.append, **kw)
        await script(stream)
        return stream

    return sent, finals, asyncio.run(main())


def bodies(sent: list[Message]) -> list[bytes]:
    return [m["body"] for m in sent if m["type"] == "http.response.body"]


def data_of(frame: bytes) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(frame.split(b"data: ", 1)[1])
    return loaded


def test_events_are_numbered_from_zero_and_the_first_goes_out_at_once() -> None:
    async def script(s: ClientStream) -> None:
        await s.event("response.created", {"type": "response.created"})
        await s.event("response.in_progress", {"type": "response.in_progress"})
        await s.event("response.output_text.delta", {"type": "response.output_text.delta", "delta": "a"})

    pending: list[int] = []

    async def then_flush(s: ClientStream) -> None:
        await script(s)
        pending.append(s.pending)
        await s.flush()

    sent, finals, s = run(then_flush)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
    first, flushed = bodies(sent)  # the first frame at once; the next two waited for the flush
    assert data_of(first) == {"type": "response.created", "sequence_number": 0}
    assert pending == [len(flushed)] and flushed.count(b"\n\n") == 2
    assert [data_of(f)["sequence_number"] for f in flushed.split(b"\n\n") if f] == [1, 2]
    assert s.committed and not s.finished and s.next_sequence == 3 and finals == []


def test_end_sends_the_buffered_frames_and_done_in_the_last_message() -> None:
    async def script(s: ClientStream) -> None:
        for i in range(3):
            await s.event(
                "response.output_text.delta", {"type": "response.output_text.delta", "delta": str(i)}
            )
        await s.end()

    sent, finals, s = run(script)
    first, last = bodies(sent)
    assert sent[-1].get("more_body", False) is False and sent[1]["more_body"] is True
    frames = [f for f in last.split(b"\n\n") if f]
    assert [data_of(f)["sequence_number"] for f in frames[:-1]] == [1, 2]
    assert frames[-1] + b"\n\n" == DONE and data_of(first)["sequence_number"] == 0
    assert finals == [200] and s.finished and s.pending == 0


def test_forward_keeps_the_upstream_bytes_when_the_number_is_already_right() -> None:
    raw = b'{"type": "response.output_text.delta",  "sequence_number": 0, "delta": "x"}'
    renumber = b'{"type":"response.output_text.delta","sequence_number":5,"delta":"y"}'

    async def script(s: ClientStream) -> None:
        await s.forward("response.output_text.delta", raw, json.loads(raw))
        await s.forward("response.output_text.delta", renumber, json.loads(renumber))
        await s.forward("response.output_text.delta", raw, {**json.loads(raw), "sequence_number": 2.0})
        await s.flush()

    sent, _, s = run(script)
    first, rest = bodies(sent)
    assert first == b"event: response.output_text.delta\ndata: " + raw + b"\n\n"
    frames = [f for f in rest.split(b"\n\n") if f]
    assert [data_of(f)["sequence_number"] for f in frames] == [1, 2]  # re-encoded with the next number
    assert data_of(frames[0])["delta"] == "y" and type(data_of(frames[1])["sequence_number"]) is int
    assert s.next_sequence == 3


def test_forward_run_passes_a_run_of_frames_and_advances_the_numbers() -> None:
    run_bytes = b"event: a\ndata: {}\n\nevent: b\ndata: {}\n\n"

    async def script(s: ClientStream) -> None:
        await s.forward_run(run_bytes, 2)
        await s.event("c", {"type": "c"})
        await s.flush()

    sent, _, s = run(script)
    assert bodies(sent)[0] == run_bytes
    assert data_of(bodies(sent)[1])["sequence_number"] == 2 and s.next_sequence == 3


def test_flush_bytes_buffered_go_out_without_waiting_for_a_flush() -> None:
    async def script(s: ClientStream) -> None:
        for i in range(4):
            await s.event("d", {"type": "d", "delta": "x" * 100, "i": i})

    sent, _, s = run(script, flush_bytes=250)
    # frame 0 at once; frames 1 and 2 reach 250 bytes together and go out as one message
    got = bodies(sent)
    assert len(got) == 2 and got[1].count(b"event: d") == 2
    assert s.pending == len(got[1]) // 2  # frame 3 (the same size as 1 and 2) waits


def test_keepalive_is_sent_only_once_committed() -> None:
    async def script(s: ClientStream) -> None:
        await s.keepalive()  # nothing: there is no stream yet
        await s.start_stream()
        await s.keepalive()

    sent, _, _ = run(script)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert bodies(sent) == [b": keep-alive\n\n"]


def test_a_failure_before_commit_is_the_outcome_tables_envelope() -> None:
    outcome = outcomes.resolve(BudgetExceeded("input", 10, 0, 5))

    async def script(s: ClientStream) -> None:
        await s.fail(outcome)

    sent, finals, s = run(script)
    status, headers, body = outcomes.render_json(outcome)
    assert sent[0]["status"] == status == 413 and list(sent[0]["headers"]) == list(headers)
    assert bodies(sent) == [body] and json.loads(body)["error"]["code"] == "max_retained_bytes_exceeded"
    assert finals == [413] and s.finished


def test_a_failure_after_commit_sends_the_buffered_frames_then_error_failed_done() -> None:
    outcome = outcomes.resolve(BudgetExceeded("accumulated", 10, 0, 5), committed=True)

    async def script(s: ClientStream) -> None:
        s.snapshot = lambda: {"id": "resp_1", "object": "response", "output": [{"type": "message"}]}
        await s.event("response.created", {"type": "response.created"})
        await s.event("response.output_text.delta", {"type": "response.output_text.delta", "delta": "a"})
        await s.fail(outcome)
        await s.event("late", {"type": "late"})  # after the last message: dropped

    sent, finals, s = run(script)
    last = bodies(sent)[-1]
    frames = [f for f in last.split(b"\n\n") if f]
    assert [f.split(b"\n")[0] for f in frames] == [
        b"event: response.output_text.delta",
        b"event: error",
        b"event: response.failed",
        b"data: [DONE]",
    ]
    assert [data_of(f)["sequence_number"] for f in frames[:3]] == [1, 2, 3]
    failed = data_of(frames[2])["response"]
    assert (
        failed["id"] == "resp_1"
        and failed["status"] == "failed"
        and failed["output"] == [{"type": "message"}]
    )
    assert finals == [200] and s.finished and b"event: late" not in b"".join(bodies(sent))


def test_a_snapshot_that_raises_is_no_snapshot() -> None:
    async def script(s: ClientStream) -> None:
        def broken() -> dict[str, Any]:
            raise KeyError("half-built")

        s.snapshot = broken

    _, _, s = run(script)
    assert s.current_snapshot() is None
