"""SSE frame coalescing (issue 8): the events of one upstream read reach the client in one ASGI
message, nothing is reordered or lost, and frames handled before a failure precede its error frame.
Also the keep-alive timer of `read_stream_events` (one timer handle per read, no task per read)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
import pytest
from starlette.types import Message

from budget import Ledger
from middleware.asgi.client_stream import ClientStream as Outbox
from middleware.upstream.reader import read_stream_events
from tests.helpers import DONE, PRE, gateway, message_item, sdk, sse_events, text_delta
from tests.mock_upstream import E, MockUpstream, Reply


class Recorder:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)


def test_frames_are_held_until_flush_and_the_start_passes_straight_through() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        out = Outbox(rec)
        await out({"type": "http.response.start", "status": 200, "headers": []})
        assert [m["type"] for m in rec.messages] == ["http.response.start"]
        await out({"type": "http.response.body", "body": b"0", "more_body": True})
        assert len(rec.messages) == 2  # the first frame goes out at once (time to first event)
        await out({"type": "http.response.body", "body": b"a", "more_body": True})
        await out({"type": "http.response.body", "body": b"b", "more_body": True})
        assert len(rec.messages) == 2 and out.pending == 2
        await out.flush()
        await out.flush()  # nothing buffered: nothing sent
        await out({"type": "http.response.body", "body": b"c", "more_body": True})
        await out({"type": "http.response.body", "body": b"", "more_body": False})
        return rec

    rec = asyncio.run(main())
    bodies = [(m["body"], m["more_body"]) for m in rec.messages[1:]]
    assert bodies == [(b"0", True), (b"ab", True), (b"c", False)]


def test_a_full_buffer_flushes_without_waiting() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        out = Outbox(rec, flush_bytes=10)
        await out({"type": "http.response.body", "body": b"first", "more_body": True})
        for _ in range(5):
            await out({"type": "http.response.body", "body": b"1234", "more_body": True})
        return rec

    rec = asyncio.run(main())
    assert [m["body"] for m in rec.messages] == [b"first", b"123412341234"]  # 12 >= 10; 8 still held


def test_keepalive_is_sent_only_once_committed_and_after_what_is_buffered() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        out = Outbox(rec)
        await out.keepalive()  # nothing committed yet: no stream to keep alive
        assert rec.messages == []
        await out({"type": "http.response.start", "status": 200, "headers": []})
        await out({"type": "http.response.body", "body": b"first", "more_body": True})
        await out({"type": "http.response.body", "body": b"held", "more_body": True})
        await out.keepalive()
        return rec

    rec = asyncio.run(main())
    bodies = [(m["body"], m["more_body"]) for m in rec.messages[1:]]
    assert bodies == [(b"first", True), (b"held: keep-alive\n\n", True)]


class _Client:
    """The four parts of a `ClientStream` that `read_stream_events` uses, as test doubles."""

    def __init__(self, keepalive: Any, interval: float, idle: Any = None) -> None:
        self.keepalive = keepalive
        self.keepalive_interval = interval
        self._idle = idle
        self._start = asyncio.get_running_loop().time()

    def last_sent(self) -> float:
        return self._start

    async def flush(self) -> None:
        if self._idle is not None:
            await self._idle()


def _chunks(parts: list[bytes], gaps: float = 0.0) -> Any:
    class Response:
        status_code = 200
        headers: ClassVar[dict[str, str]] = {}

        async def chunks(self) -> AsyncIterator[bytes]:
            for part in parts:
                if gaps:
                    await asyncio.sleep(gaps)
                yield part

        async def aclose(self) -> None:
            return None

    return Response()


def test_keepalive_fires_only_while_the_upstream_is_quiet() -> None:
    beats: list[float] = []
    idles: list[int] = []

    async def main() -> list[str]:
        ledger = Ledger(1 << 22)
        parts = [*PRE(), DONE(2, [message_item("ok")])]

        async def keepalive() -> None:
            beats.append(asyncio.get_running_loop().time())

        async def idle() -> None:
            idles.append(len(beats))

        seen = []
        events = read_stream_events(_chunks(parts, gaps=0.35), ledger, client=_Client(keepalive, 0.1, idle))
        async for event in events:
            seen.append(event.type)
        return seen

    seen = asyncio.run(main())
    assert seen == ["response.created", "response.in_progress", "response.completed"]
    # 3 quiet gaps of 0.35 s at a 0.1 s interval: about 3 beats each (generous bounds: noisy machine)
    assert 3 <= len(beats) <= 12
    assert len(idles) == 4  # before each of the 3 reads and before the end of the stream


def test_no_keepalive_task_when_bytes_keep_coming() -> None:
    async def main() -> int:
        ledger = Ledger(1 << 22)
        parts = [*PRE(), *(text_delta(2 + i, "x") for i in range(50)), DONE(52, [message_item("x" * 50)])]
        before = len(asyncio.all_tasks())
        peak = before
        count = 0
        async for _ in read_stream_events(_chunks(parts), ledger, client=_Client(_never, 5.0)):
            peak = max(peak, len(asyncio.all_tasks()))
            count += 1
        assert peak == before  # no task per read (the old per-read task + asyncio.wait is gone)
        return count

    assert asyncio.run(main()) == 53


async def _never() -> None:
    raise AssertionError("no keep-alive is due while bytes keep coming")


def test_a_failing_keepalive_fails_the_read() -> None:
    async def main() -> None:
        ledger = Ledger(1 << 22)

        async def gone() -> None:
            raise OSError("client went away")

        async for _ in read_stream_events(_chunks(PRE(), gaps=0.3), ledger, client=_Client(gone, 0.05)):
            pass

    with pytest.raises(OSError, match="client went away"):
        asyncio.run(main())


def _stream_in_one_write(n: int) -> bytes:
    parts = [*PRE(), *(text_delta(2 + i, "x") for i in range(n)), DONE(2 + n, [message_item("x" * n)])]
    return b"".join(parts)


@pytest.mark.parametrize("store", [False, True], ids=["pass-through", "agent-loop"])
def test_one_upstream_read_is_one_client_message(upstream: MockUpstream, store: bool) -> None:
    n = 100
    upstream.push(Reply.sse([_stream_in_one_write(n)]))
    with gateway(upstream) as (url, app), sdk(url) as client:
        events = list(client.responses.create(model="m", input="x", stream=True, store=store))
    assert len(events) == n + 3
    assert [e.sequence_number for e in events] == list(range(n + 3))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "x" * n
    # 103 events arrived in one upstream write: a handful of messages, not one per event
    assert app.response_messages <= 4


def test_events_before_an_in_band_error_precede_the_error_frame(upstream: MockUpstream) -> None:
    parts = [*PRE(), text_delta(2, "a"), text_delta(3, "b")]
    error = {"type": "error", "sequence_number": 4, "code": "server_error", "message": "engine died"}
    upstream.push(Reply.sse([b"".join([*parts, E("error", error)])]))
    with gateway(upstream) as (url, _):
        body = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "stream": True, "store": False},
            timeout=30,
        ).content
    events = sse_events(body)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_text.delta",
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    assert [data["sequence_number"] for _, data in events] == [0, 1, 2, 3, 4, 5]
    assert json.dumps(events[-2][1]).count("engine died") >= 1


def test_frames_buffered_when_the_deadline_fires_precede_its_error_frame(
    upstream: MockUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline (or the drain) cancels the request while frames sit in the Outbox (here: the
    final save is slow): the middleware flushes them before its error frame, numbered 0..N."""
    from middleware.store import store as store_module

    original = store_module.Store.save_response

    async def slow_save(self: Any, response: Any, **kw: Any) -> Any:
        if response.status == "completed":
            await asyncio.sleep(3)  # a slow database
        return await original(self, response, **kw)

    monkeypatch.setattr(store_module.Store, "save_response", slow_save)
    body = b"".join([*PRE(), text_delta(2, "Hel"), text_delta(3, "lo"), DONE(4, [message_item("Hello")])])
    upstream.push(Reply.sse([body]))
    with gateway(upstream, request_deadline=1.0) as (url, _):
        raw = httpx.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=30
        ).content
    events = sse_events(raw)
    assert [name for name, _ in events][:4] == [
        "response.created",
        "response.in_progress",
        "response.output_text.delta",
        "response.output_text.delta",
    ]
    assert events[-2][0] == "error" and events[-2][1]["code"] == "request_deadline_exceeded"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))


def test_upstream_comments_do_not_starve_the_client_of_keepalives(upstream: MockUpstream) -> None:
    """Keep-alives are due an interval after the last client write: upstream bytes that complete
    no event (comments every 0.5 s for 4 s) must not put them off (DESIGN.md §5)."""
    parts = [
        b"".join(PRE()),
        *[x for _ in range(8) for x in (0.5, b": ping\n\n")],
        DONE(2, [message_item("ok")]),
    ]
    upstream.push(Reply.sse(parts))
    with gateway(upstream, keepalive_interval=1.0) as (url, _):
        body = b""
        with httpx.stream(
            "POST",
            url + "/v1/responses",
            json={"model": "m", "input": "x", "stream": True, "store": False},
            timeout=30,
        ) as r:
            for raw in r.iter_raw():
                body += raw
    # ~4 s of upstream comments at a 1 s interval: about 3-4 keep-alives (generous bounds)
    assert 2 <= body.count(b": keep-alive") <= 6
    assert [name for name, _ in sse_events(body)][-1] == "response.completed"


def test_a_non_integer_sequence_number_is_renumbered(upstream: MockUpstream) -> None:
    """Only an int equal to the next number is forwarded as received: 2.0 or true are re-encoded."""
    created = {"id": "resp_up", "object": "response", "status": "in_progress", "output": []}
    parts = [
        E("response.created", {"type": "response.created", "sequence_number": 0.0, "response": created}),
        E(
            "response.in_progress",
            {"type": "response.in_progress", "sequence_number": True, "response": created},
        ),
        DONE(2, [message_item("ok")]),
    ]
    for store in (False, True):
        upstream.push(Reply.sse([b"".join(parts)]))
        with gateway(upstream) as (url, _):
            raw = httpx.post(
                url + "/v1/responses",
                json={"model": "m", "input": "x", "stream": True, "store": store},
                timeout=30,
            ).content
        numbers = [data["sequence_number"] for _, data in sse_events(raw)]
        assert numbers == [0, 1, 2] and all(type(n) is int for n in numbers)
