"""CPU of the Chat Completions translation (issue 25) against the Responses path, in process.

Usage: ``python bench/chat_cpu.py [--rounds N] [--deltas N]``

The same scripted content — one answer of ``--deltas`` text deltas (``"word "``) with usage — is
read the way the loop reads a round (`middleware.upstream.reader.read_round` with a
`StreamAccumulator`, and `read_response_object` for a buffered round), once as a Responses
upstream sends it and once as a Chat Completions upstream sends it through
`middleware.upstream.chat.client.ChatResponse` (which translates it to Responses bytes that the
same reader then reads). Whole body in one upstream read, and one frame per read (a token-paced
server). Prints the best of ``--rounds`` in µs of process CPU: per streamed *Responses event* the
client would get (the translated stream has the same events plus ``content_part``/``.done``
closers), and per buffered request; and the translation's overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from stream_cpu import ScriptedResponse  # bench/ is on sys.path when run as a script

from budget import Ledger
from middleware.upstream.chat.client import ChatResponse
from middleware.upstream.chat.dialect import ChatDialect
from middleware.upstream.reader import StreamAccumulator, read_response_object, read_round

USAGE = {"prompt_tokens": 10, "completion_tokens": 100, "total_tokens": 110}


def _sse(kind: str | None, obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return (b"event: " + kind.encode() + b"\n" if kind else b"") + b"data: " + data + b"\n\n"


def responses_frames(deltas: int) -> list[bytes]:
    """The Responses SSE of the answer: lifecycle, item, part, deltas, closers, completed."""
    resp: dict[str, Any] = {
        "id": "resp_1",
        "object": "response",
        "status": "in_progress",
        "model": "m",
        "output": [],
    }
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": resp},
        {"type": "response.in_progress", "response": resp},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.content_part.added", **where, "part": part},
    ]
    events += [{"type": "response.output_text.delta", **where, "delta": "word ", "logprobs": []}] * deltas
    text = "word " * deltas
    done_part = {**part, "text": text}
    done_item = {**item, "status": "completed", "content": [done_part]}
    usage = {"input_tokens": 10, "output_tokens": 100, "total_tokens": 110}
    events += [
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": done_part},
        {"type": "response.output_item.done", "output_index": 0, "item": done_item},
        {
            "type": "response.completed",
            "response": {**resp, "status": "completed", "output": [done_item], "usage": usage},
        },
    ]
    return [_sse(e["type"], {**e, "sequence_number": i}) for i, e in enumerate(events)]


def chat_frames(deltas: int) -> list[bytes]:
    """The Chat SSE of the same answer: role chunk, deltas, finish, usage, [DONE]."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse(None, {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    frames = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"content": "word "})] * deltas
    frames += [chunk({}, "stop"), _sse(None, {**head, "choices": [], "usage": USAGE}), b"data: [DONE]\n\n"]
    return frames


def responses_body(deltas: int) -> bytes:
    item = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant"}
    item["content"] = [{"type": "output_text", "text": "word " * deltas, "annotations": [], "logprobs": []}]
    body = {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": [item]}
    return json.dumps(
        {**body, "usage": {"input_tokens": 10, "output_tokens": 100, "total_tokens": 110}}
    ).encode()


def chat_body(deltas: int) -> bytes:
    message = {"role": "assistant", "content": "word " * deltas}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [choice],
            "usage": USAGE,
        }
    ).encode()


async def _stream(reads: list[bytes], chat: bool) -> int:
    ledger = Ledger(64 << 20)
    inner = ScriptedResponse(reads, "text/event-stream")
    response = ChatResponse(inner, ChatDialect(), ledger, sse=True) if chat else inner
    acc = StreamAccumulator(ledger)
    count = 0

    async def on_event(event: Any) -> None:
        nonlocal count
        count += 1

    await read_round(response, ledger, acc=acc, on_event=on_event)  # type: ignore[arg-type]
    acc.release_all()
    return count


async def _buffered(body: bytes, chat: bool) -> None:
    ledger = Ledger(64 << 20)
    inner = ScriptedResponse([body], "application/json")
    response = ChatResponse(inner, ChatDialect(), ledger, sse=False) if chat else inner
    await read_response_object(response, ledger)  # type: ignore[arg-type]


def _best(rounds: int, repeat: int, make: Any) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()

        async def run() -> None:
            for _ in range(repeat):
                await make()

        asyncio.run(run())
        best = min(best, (time.process_time() - start) / repeat * 1e6)
    return best


def measure(rounds: int = 7, deltas: int = 100, repeat: int = 50) -> dict[str, float]:
    """µs of CPU: per streamed Responses event (both framings) and per buffered request, for the
    Responses path and the translated Chat path."""
    out: dict[str, float] = {}
    events = asyncio.run(_stream(responses_frames(deltas), chat=False))
    for framing in ("one read", "one frame per read"):
        for name, frames, chat in (
            ("responses", responses_frames(deltas), False),
            ("chat", chat_frames(deltas), True),
        ):
            reads = [b"".join(frames)] if framing == "one read" else frames
            total = _best(rounds, repeat, lambda reads=reads, chat=chat: _stream(reads, chat))
            out[f"streamed, {framing}, {name}: per event"] = total / events
    for name, body, chat in (("responses", responses_body(deltas), False), ("chat", chat_body(deltas), True)):
        out[f"buffered, {name}: per request"] = _best(
            rounds, repeat * 4, lambda body=body, chat=chat: _buffered(body, chat)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--deltas", type=int, default=100)
    args = parser.parse_args()
    for key, value in measure(args.rounds, args.deltas).items():
        print(f"{key:48s} {value:8.2f} µs")


if __name__ == "__main__":
    main()
