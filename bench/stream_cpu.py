"""App CPU per streamed event, in process: the pass-through stream path, exact and fast (a script).

Usage: ``python bench/stream_cpu.py [--rounds N]``

Feeds bench/upstream.py's ``small`` 100-event stream (the text deltas of one answer plus its
lifecycle and terminal events) through `middleware.upstream.reader.read_round` and a
`middleware.asgi.client_stream.ClientStream` with a no-op ``send``, as the pass-through forwards
it, with and without the fast path (``on_run``), in two framings: the whole stream in one upstream
read (what bench/upstream.py writes) and one event per read (a token-paced model server). Prints
the best of ``--rounds`` interleaved rounds in µs per event (process CPU time): per event of the
100-event stream (the stream's fixed cost included), and the marginal cost of one more delta (the
1000-event stream minus the 100-event one, per extra event).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from budget import Ledger
from middleware.asgi.client_stream import ClientStream
from middleware.upstream.reader import UpstreamEvent, read_round

EVENTS = 100


def _frame(obj: dict[str, Any]) -> bytes:
    return (
        b"event: "
        + obj["type"].encode()
        + b"\ndata: "
        + json.dumps(obj, separators=(",", ":")).encode()
        + b"\n\n"
    )


def stream_frames(events: int = EVENTS) -> list[bytes]:
    """``events`` frames: created, in_progress, deltas, completed (numbered 0..events-1)."""
    resp = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "small", "output": []}
    frames = [
        _frame({"type": "response.created", "sequence_number": 0, "response": resp}),
        _frame({"type": "response.in_progress", "sequence_number": 1, "response": resp}),
    ]
    for seq in range(2, events - 1):
        frames.append(
            _frame(
                {
                    "type": "response.output_text.delta",
                    "sequence_number": seq,
                    "item_id": "msg_1",
                    "output_index": 0,
                    "content_index": 0,
                    "delta": "word ",
                    "logprobs": [],
                }
            )
        )
    frames.append(_frame({"type": "response.completed", "sequence_number": events - 1, "response": resp}))
    return frames


class ScriptedResponse:
    """An upstream response (`middleware.upstream.protocol.UpstreamResponse`) whose body arrives
    as `reads` (bytes, one per ``chunks()`` item), status 200 with `content_type`."""

    def __init__(self, reads: list[bytes], content_type: str = "text/event-stream") -> None:
        self._reads = reads
        self.status_code = 200
        self.headers = {"content-type": content_type}

    async def _gen(self) -> AsyncIterator[bytes]:
        for read in self._reads:
            yield read

    def chunks(self) -> AsyncIterator[bytes]:
        return self._gen()

    async def aclose(self) -> None:
        return None


async def _one(reads: list[bytes], fast: bool) -> None:
    async def send(message: Any) -> None:
        return None

    client = ClientStream(send)
    ledger = Ledger(64 << 20)

    async def on_event(event: UpstreamEvent) -> None:
        await client.forward(event.type, event.data, event.obj, changed=event.changed)

    await read_round(
        ScriptedResponse(reads),
        ledger,
        client=client,
        on_event=on_event,
        on_run=client.forward_run if fast else None,
    )
    await client.end()


def measure(rounds: int = 15, streams: int = 100) -> dict[str, float]:
    """Best-of-`rounds` µs of CPU per event for each (framing, path, events per stream), and the
    marginal µs per extra event."""
    best: dict[str, float] = {}

    async def run(reads: list[bytes], fast: bool) -> None:
        for _ in range(streams):
            await _one(reads, fast)

    for _ in range(rounds):
        for events in (EVENTS, 10 * EVENTS):
            frames = stream_frames(events)
            for name, reads in {"one read": [b"".join(frames)], "one event per read": frames}.items():
                for fast in (False, True):
                    start = time.process_time()
                    asyncio.run(run(reads, fast))
                    key = f"{name}, {'fast' if fast else 'exact'}, {events} events"
                    best[key] = min(
                        best.get(key, float("inf")), (time.process_time() - start) / streams * 1e6
                    )
    out: dict[str, float] = {}
    for key, total in best.items():
        if key.endswith(f" {EVENTS} events"):
            name = key.removesuffix(f", {EVENTS} events")
            out[f"{name}: per event of a {EVENTS}-event stream"] = total / EVENTS
            out[f"{name}: marginal per delta"] = (best[f"{name}, {10 * EVENTS} events"] - total) / (
                9 * EVENTS
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for key, value in measure(args.rounds).items():
        print(f"{key:56s} {value:6.2f} µs")


if __name__ == "__main__":
    main()
