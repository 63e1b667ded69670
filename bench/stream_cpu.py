"""App CPU per streamed event, in process: the pass-through stream path, exact and fast (a script).

Usage: ``python bench/stream_cpu.py [--rounds N] [--app [--requests N] [--json]]``

Feeds bench/upstream.py's ``small`` 100-event stream (the text deltas of one answer plus its
lifecycle and terminal events) through `middleware.upstream.reader.read_round` and a
`middleware.asgi.client_stream.ClientStream` with a no-op ``send``, as the pass-through forwards
it, with and without the fast path (``on_run``), in two framings: the whole stream in one upstream
read (what bench/upstream.py writes) and one event per read (a token-paced model server). Prints
the best of ``--rounds`` interleaved rounds in µs per event (process CPU time): per event of the
100-event stream (the stream's fixed cost included), and the marginal cost of one more delta (the
1000-event stream minus the 100-event one, per extra event).

``--app`` measures the whole app instead (issue 21): "app CPU per streamed event = (CPU of one
streamed request - CPU of one buffered request) / events". `middleware.app.create_app`'s app,
lifespan run, is called directly with an ASGI scope, ``receive`` and ``send`` (no sockets); its
upstream client (``upstream_factory``) is a `ScriptedUpstream` answering with bench/upstream.py's
``small`` scenario body bytes: buffered, the response object; streamed, the 100 SSE events all in
one read, one event per read, or in network reads (`NETWORK_READ` bytes each, most ending inside a
frame, as reads over TLS or a real network do). ``--requests`` sequential requests per kind and round (50), best
of ``--rounds`` interleaved rounds after one warm-up round; every answer is checked (a 200; the
stream's 100 events end in ``response.completed``; the buffered response object is completed, with
the scenario's text) so that the figure cannot measure an error path. Prints µs per event for each
framing and µs per buffered request (``--json``: one JSON object, `measure_app`'s keys). The app is
started in the main thread, as ``loopwarden serve`` starts it, so its start-up freezes the
collector's generations (`middleware.app.freeze_startup_objects`). Which tree's ``middleware`` is
measured is printed first: set ``PYTHONPATH`` to a tree to measure that one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Scope
from upstream import SMALL_DELTAS, Scripts  # bench/ is on sys.path when run as a script

import middleware
from budget import Ledger
from middleware.app import create_app
from middleware.asgi.client_stream import ClientStream
from middleware.config import Settings
from middleware.upstream.protocol import UpstreamResponse
from middleware.upstream.reader import UpstreamEvent, read_round

EVENTS = 100
#: Bytes per upstream read in the ``network reads`` framing: a TCP segment's payload (MSS 1448).
NETWORK_READ = 1448
#: The framings of the streamed answer `measure_app` measures.
FRAMINGS = ("one read", "one event per read", "network reads")


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
        self.headers: Mapping[str, str] = {"content-type": content_type}

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


# -- the whole app, in process (``--app``) --------------------------------------------------------

#: The upstream URL the app is configured with; `ScriptedUpstream` answers instead, nothing connects.
SCRIPTED_URL = "http://scripted.invalid/v1"
#: A minimal Responses request (JSON bytes) to the ``small`` scenario; ``%s``: ``true`` / ``false``.
APP_REQUEST = b'{"model":"small","input":"hi","stream":%s,"store":false}'
#: The scripted upstream answer: (content type, the body's reads).
Answer = tuple[str, list[bytes]]


def http_answer(raw: bytes) -> Answer:
    """One pre-encoded HTTP answer of bench/upstream.py as an HTTP client reads its body: the
    content type, and the body whole (``content-length``) or one read per chunk (chunked
    transfer encoding, decoded; the last, empty chunk dropped)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.lower().split(b"\r\n")[1:])
    content_type = fields[b"content-type"].decode()
    if fields.get(b"transfer-encoding") != b"chunked":
        return content_type, [body]
    reads: list[bytes] = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return content_type, reads
        reads.append(body[:size])
        body = body[size + 2 :]


def small_answers() -> tuple[Answer, Answer]:
    """bench/upstream.py's ``small`` scenario, as written on the wire by its `Scripts`: the
    buffered answer (the response object, ~1.1 KB) and the streamed one (100 SSE events, one
    read each)."""
    scripts = Scripts()
    buffered = http_answer(scripts.buffered["small"])
    streamed = http_answer(scripts.streamed["small"])
    if len(streamed[1]) != EVENTS:
        raise RuntimeError(f"bench/upstream.py's small stream has {len(streamed[1])} events, not {EVENTS}")
    return buffered, streamed


class ScriptedUpstream:
    """An upstream client (`middleware.upstream.protocol.UpstreamClient`) in process: every
    ``post`` is answered with a `ScriptedResponse` of `buffered` (a buffered call) or `streamed`
    (``stream=True``; reassign it to change the framing); ``posts`` counts the calls. ``get``
    answers an empty model list."""

    def __init__(self, buffered: Answer, streamed: Answer) -> None:
        self.buffered = buffered
        self.streamed = streamed
        self.posts = 0

    async def post(self, path: str, body: bytes, *, stream: bool) -> UpstreamResponse:
        if path != "/responses":
            raise RuntimeError(f"the scripted upstream answers /responses only, not {path}")
        self.posts += 1
        content_type, reads = self.streamed if stream else self.buffered
        return ScriptedResponse(reads, content_type)

    async def get(self, path: str) -> UpstreamResponse:
        return ScriptedResponse([b'{"object":"list","data":[]}'], "application/json")

    async def aclose(self) -> None:
        return None


async def _lifespan_phase(
    inbox: asyncio.Queue[Message], outbox: asyncio.Queue[Message], task: asyncio.Future[None], phase: str
) -> None:
    """Send ``lifespan.<phase>`` and wait for the app's answer; raises RuntimeError (the app's
    message) unless it is ``lifespan.<phase>.complete``."""
    await inbox.put({"type": f"lifespan.{phase}"})
    reply = await outbox.get()
    if reply["type"] != f"lifespan.{phase}.complete":
        task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await task
        raise RuntimeError(f"the app's lifespan {phase} failed: {reply.get('message', reply)}")


@contextlib.asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run `app`'s ASGI lifespan around the block: start-up before, shut-down after (also when the
    block raises); raises RuntimeError with the app's message when either fails."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    scope: Scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, inbox.get, outbox.put))
    await _lifespan_phase(inbox, outbox, task, "startup")
    try:
        yield
    finally:
        await _lifespan_phase(inbox, outbox, task, "shutdown")
        await task


def _http_scope(length: int) -> Scope:
    """The scope uvicorn gives ``POST /v1/responses`` with a JSON body of `length` bytes."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/responses",
        "raw_path": b"/v1/responses",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(length).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def app_request(app: ASGIApp, body: bytes) -> tuple[int, list[bytes]]:
    """POST `body` (JSON bytes) to `app`'s ``/v1/responses`` as uvicorn calls it: one
    ``http.request`` message, then ``http.disconnect`` only once the response is complete.
    Returns the response's status and its body messages' bytes."""
    done = asyncio.Event()
    received = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(_http_scope(len(body)), receive, send)
    done.set()
    return status, chunks


def check_answer(status: int, body: bytes, stream: bool) -> None:
    """Raise RuntimeError unless `body` is the 200 answer of the ``small`` scenario: streamed,
    `EVENTS` SSE events, none an ``error``, the last ``response.completed``; buffered, a completed
    response object whose message is the scenario's text."""
    problem = "" if status == 200 else f"status {status}"
    if not problem and stream:
        events = [frame for frame in body.split(b"\n\n") if frame.startswith(b"event: ")]
        if len(events) != EVENTS or any(e.startswith(b"event: error\n") for e in events):
            problem = f"{len(events)} events, not {EVENTS} without an error"
        elif not events[-1].startswith(b"event: response.completed\n"):
            problem = "the last event is not response.completed"
    elif not problem:
        answer = json.loads(body)
        text = answer.get("output", [{}])[0].get("content", [{}])[0].get("text")
        if answer.get("status") != "completed" or text != "".join(SMALL_DELTAS):
            problem = "not the completed response object of the small scenario"
    if problem:
        raise RuntimeError(f"the app's answer is not the expected one ({problem}): {body[:300]!r}")


async def _app_rounds(rounds: int, requests: int) -> dict[str, float]:
    """Best-of-`rounds` CPU seconds per request of each kind (``buffered`` and the `FRAMINGS`),
    after one warm-up round; raises RuntimeError on an unexpected answer."""
    buffered, (content_type, frames) = small_answers()
    whole = b"".join(frames)
    framings = {
        "one read": [whole],
        "one event per read": frames,
        # reads as a network delivers them (a TCP segment's payload): most end inside a frame
        "network reads": [whole[i : i + NETWORK_READ] for i in range(0, len(whole), NETWORK_READ)],
    }
    client = ScriptedUpstream(buffered, (content_type, frames))
    settings = Settings(upstream=SCRIPTED_URL, store="memory")
    app = create_app(settings, upstream_factory=lambda settings, base_url: client)
    kinds: list[tuple[str, list[bytes] | None]] = [("buffered", None), *framings.items()]
    best: dict[str, float] = {}
    async with lifespan(app):
        for round_ in range(rounds + 1):  # round 0 warms up
            for kind, reads in kinds:
                if reads is not None:
                    client.streamed = (content_type, reads)
                body = APP_REQUEST % (b"false" if reads is None else b"true")
                start = time.process_time()
                answers = [await app_request(app, body) for _ in range(requests)]
                seconds = (time.process_time() - start) / requests
                for status, chunks in answers:
                    check_answer(status, b"".join(chunks), reads is not None)
                if round_:
                    best[kind] = min(best.get(kind, float("inf")), seconds)
    if client.posts != (rounds + 1) * len(kinds) * requests:
        raise RuntimeError(f"{client.posts} upstream calls, not one per request: the figure is not the app's")
    return best


def measure_app(rounds: int = 15, requests: int = 50) -> dict[str, float]:
    """The whole app's CPU in process (see the module docstring), best of `rounds` interleaved
    rounds of `requests` sequential requests each: ``buffered`` µs per buffered request, and for
    each of the `FRAMINGS` µs per streamed event, (streamed request
    - buffered request) / `EVENTS`. Raises RuntimeError on an unexpected answer."""
    best = asyncio.run(_app_rounds(rounds, requests))
    out = {"buffered": best["buffered"] * 1e6}
    for kind in FRAMINGS:
        out[kind] = (best[kind] - best["buffered"]) / EVENTS * 1e6
    return out


def print_app(rounds: int, requests: int, as_json: bool) -> None:
    """Print `measure_app`'s figures (µs), after the tree the app is imported from."""
    figures = measure_app(rounds, requests)
    if as_json:
        print(json.dumps(figures))
        return
    print(f"app: middleware from {Path(middleware.__file__).resolve().parent.parent}")
    print(f"app: best of {rounds} rounds of {requests} sequential requests of each kind, process CPU")
    print(f"{'app, buffered: per request':64s} {figures['buffered']:8.2f} µs")
    for kind in FRAMINGS:
        print(f"{f'app, streamed, {kind}: per event (stream − buffered)':64s} {figures[kind]:8.2f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--app", action="store_true", help="the whole app in process (issue 21)")
    parser.add_argument("--requests", type=int, default=50, help="--app: requests per kind and round")
    parser.add_argument("--json", action="store_true", help="--app: print the figures as one JSON object")
    args = parser.parse_args()
    if args.app:
        print_app(args.rounds, args.requests, args.json)
        return
    for key, value in measure(args.rounds).items():
        print(f"{key:56s} {value:6.2f} µs")


if __name__ == "__main__":
    main()
