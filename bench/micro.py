"""Micro-benchmarks behind the profile findings, with prototypes of the fixes (a script, not a test).

Usage: ``python bench/micro.py [--repeat N]``

Everything runs in this one process, side by side, best of ``--repeat``:

1. `middleware.upstream.sse.SSEParser` against `LinearSSEParser` (a prototype in this file: same events,
   same ``pending``, but the unfinished line is kept in a ``bytearray`` and only the new bytes are
   scanned for line ends) on the 1 MiB text stream and the 100-event stream of `bench/upstream.py`,
   fed in 4 KiB slices as `middleware.upstream.reader.read_stream_events` does. The two parsers are first
   checked to give identical events and ``pending`` on every prefix of tricky input.
2. What awaiting one upstream chunk costs in `read_stream_events` (a task + ``asyncio.wait`` per
   chunk for the keep-alive timer) and in `middleware.upstream.httpx_client._HttpxResponse.chunks`
   (``asyncio.timeout_at`` per chunk), against a plain ``async for``.
3. The synchronous per-event work of the streamed pass-through (ledger charges, SSE parse, node
   count, ``json.loads``, type check, accumulator, re-encoding the frame): the floor of what
   loopwarden must spend per event, to compare with the per-event CPU that `bench/run.py` measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import upstream

from budget import Ledger
from middleware.upstream.sse import SSEEvent, SSEParser

SLICE = 4096


class LinearSSEParser:
    """Prototype of the fix for `middleware.upstream.sse.SSEParser.feed` being quadratic in the length of a
    line: the unfinished line is held here in a ``bytearray`` (appending is amortised
    O(len(chunk)), where ``self._buf + chunk`` copies the whole buffer every time) and only the new
    bytes are searched for a line end; the wrapped `SSEParser` is handed whole lines only, so its
    own buffer stays empty and its regex never re-scans a long line. Same events, same
    ``pending`` (the parser is chunking-independent by contract). The same two changes belong
    inside `SSEParser.feed` itself.
    """

    __slots__ = ("_cr", "_held", "_parser")

    def __init__(self) -> None:
        self._parser = SSEParser()
        self._held = bytearray()
        self._cr = False  # the parser was last handed a CR: the next byte says whether CRLF

    @property
    def pending(self) -> int:
        return len(self._held) + self._parser.pending

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        held = self._held
        start = len(held)
        held += chunk
        cut = max(held.rfind(b"\n", start), held.rfind(b"\r", start))  # held[:start] has no line end
        if cut < 0:
            if self._cr and held:  # settle the parser's CR with the next byte
                self._cr = False
                first = bytes(held[:1])
                del held[:1]
                return self._parser.feed(first)
            return []
        if held[cut] == 0x0D and cut + 1 < len(held):
            cut += 1  # a lone CR: one more byte lets the parser settle it now
        lines = bytes(held[: cut + 1])
        del held[: cut + 1]
        self._cr = lines.endswith(b"\r")
        return self._parser.feed(lines)


def stream_body(events: list[dict[str, object]]) -> bytes:
    return b"".join(upstream.sse_frame({**e, "sequence_number": n}) for n, e in enumerate(events))


def check_equivalent(seed: int = 7, cases: int = 300) -> None:
    """Identical events and pending for random splits of input with LF, CR, CRLF, comments."""
    rng = random.Random(seed)
    pieces = [
        b"data: x\n",
        b"data: y\r\n",
        b"data: z\r",
        b"\n",
        b"\r\n",
        b": c\n",
        b"event: e\n",
        b"data:",
        b" 1",
        b"\r",
        b"\n",
        b"id: 3\n",
        b"data: " + b"q" * 5000 + b"\n",
        b"\n\n",
    ]
    for _ in range(cases):
        raw = b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        cuts = sorted(rng.sample(range(len(raw) + 1), min(len(raw) + 1, rng.randint(0, 12))))
        a, b = SSEParser(), LinearSSEParser()
        last = 0
        for cut in [*cuts, len(raw)]:
            chunk = raw[last:cut]
            last = cut
            assert a.feed(chunk) == b.feed(chunk), raw
            assert a.pending == b.pending, raw
    print(f"LinearSSEParser == SSEParser on {cases} random splits: ok")


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def feed_all(parser_cls: type[SSEParser] | type[LinearSSEParser], body: bytes) -> int:
    parser = parser_cls()
    n = 0
    for offset in range(0, len(body), SLICE):
        n += len(parser.feed(body[offset : offset + SLICE]))
    return n


def parsers(repeat: int) -> None:
    mb = stream_body(upstream.message_events("text1mb", upstream.MB_DELTAS))
    small = stream_body(upstream.message_events("small", upstream.SMALL_DELTAS))
    print("\n1. SSE parser, 4 KiB slices (ms per stream, best of runs)")
    for label, body, rep in (
        ("1 MiB text stream (265 events, 5.0 MiB)", mb, max(1, repeat // 5)),
        ("100-event stream (29 KiB)", small, repeat * 20),
    ):
        old = best(lambda b=body: feed_all(SSEParser, b), rep)
        new = best(lambda b=body: feed_all(LinearSSEParser, b), rep)
        assert feed_all(SSEParser, body) == feed_all(LinearSSEParser, body)
        print(
            f"   {label:<42} SSEParser {old * 1000:10.2f}   LinearSSEParser {new * 1000:8.2f}   "
            f"x{old / new:,.0f}"
        )


async def chunk_source(n: int, chunk: bytes) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield chunk
        await asyncio.sleep(0)  # a socket read would suspend too


async def await_costs(n: int) -> None:
    async def plain() -> None:
        async for _ in chunk_source(n, b"x"):
            pass

    async def task_and_wait() -> None:  # middleware/upstream/reader.py read_stream_events
        it = chunk_source(n, b"x")
        while True:
            pending = asyncio.ensure_future(anext(it))
            _done, _ = await asyncio.wait({pending}, timeout=15.0)
            try:
                await pending
            except StopAsyncIteration:
                return

    async def timeout_each() -> None:  # middleware/upstream/httpx_client.py _HttpxResponse.chunks
        it = chunk_source(n, b"x")
        deadline = asyncio.get_running_loop().time() + 1800
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    await anext(it)
            except StopAsyncIteration:
                return

    results = {}
    for name, fn in (
        ("plain async for", plain),
        ("task + asyncio.wait per chunk", task_and_wait),
        ("asyncio.timeout_at per chunk", timeout_each),
    ):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - t)
        results[name] = min(times) / n
    base = results["plain async for"]
    print("\n2. Awaiting one upstream chunk (us per chunk; the extra over a plain async for)")
    for name, per in results.items():
        print(f"   {name:<32} {per * 1e6:7.2f}   +{(per - base) * 1e6:6.2f}")


def per_event_work(repeat: int) -> None:
    """The pass-through's synchronous work per event, as read_stream_events + _forward_stream do it."""
    import re

    from middleware.upstream import reader as stream
    from middleware.upstream.reader import StreamAccumulator, UpstreamEvent
    from middleware.upstream.sse import encode_event

    event_type = getattr(stream, "EVENT_TYPE", re.compile(r"[A-Za-z0-9_.:-]{1,128}"))

    body = stream_body(upstream.message_events("small", upstream.SMALL_DELTAS))

    def run_once(parser_cls: type[SSEParser] | type[LinearSSEParser]) -> int:
        ledger = Ledger(64 << 20, store=False)
        parser = parser_cls()
        acc = StreamAccumulator(ledger)
        out = 0
        for offset in range(0, len(body), SLICE):
            piece = body[offset : offset + SLICE]
            before = parser.pending
            ledger.admit_stream_chunk(piece)
            events = parser.feed(piece)
            ledger.release_stream_bytes(before + len(piece) - parser.pending)
            for event in events:
                data = event.data
                if not data.strip() or data == b"[DONE]":
                    continue
                ledger.check_stream_frame(data)
                obj = json.loads(data)
                kind = obj.get("type")
                assert event_type.fullmatch(kind)
                acc.apply(UpstreamEvent(kind, data, obj))
                out += len(encode_event(kind, data))
        return out

    for cls in (SSEParser, LinearSSEParser):
        t = best(lambda c=cls: run_once(c), repeat * 20)
        print(
            f"   {cls.__name__:<16} {t * 1e6:8.1f} us per 100-event stream = {t * 1e6 / 100:5.2f} us per event"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    check_equivalent()
    parsers(args.repeat)
    asyncio.run(await_costs(20_000))
    print(
        "\n3. Synchronous per-event work of the streamed pass-through (ledger, parse, count, loads, "
        "accumulate, encode)"
    )
    per_event_work(args.repeat)


if __name__ == "__main__":
    main()
