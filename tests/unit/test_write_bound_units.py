"""Units of issue 17 items 1 and 3 with fake ``receive`` / ``send`` (no server): the guard ends a
request whose write makes no progress for ``client_write_timeout``, the `ClientStream` sends
nothing more to a stalled client, and the drain deadline ends a body read that waits for bytes
that never come. tests/asgi/test_slow_clients.py holds the same on real uvicorn servers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from budget import Limits
from middleware.asgi.client_stream import ClientStalled, ClientStream
from middleware.asgi.guard import BudgetMiddleware
from middleware.errors import DeadlineExceeded
from middleware.loop.context import context_of
from middleware.ops.admission import DrainState
from tests.helpers import MetricDelta

BODY = json.dumps({"model": "m", "input": "x", "stream": True}).encode()
SCOPE = {"type": "http", "method": "POST", "path": "/v1/responses"}


def _scope(length: int) -> dict[str, Any]:
    return {**SCOPE, "headers": [(b"content-length", str(length).encode())]}


class StuckClient:
    """A client whose connection never drains: ``send`` of the messages after the first
    ``accepted`` ones waits forever (as uvicorn's flow control does)."""

    def __init__(self, accepted: int) -> None:
        self.accepted = accepted
        self.sent: list[Message] = []
        self.blocked = 0

    async def send(self, message: Message) -> None:
        if len(self.sent) >= self.accepted:
            self.blocked += 1
            await asyncio.Event().wait()
        self.sent.append(message)


async def _receive_once(messages: list[Message]) -> Message:
    if messages:
        return messages.pop(0)
    await asyncio.Event().wait()  # connected, silent
    raise AssertionError("unreachable")


def serve(app: Any, client: StuckClient, **guard: Any) -> tuple[float, list[tuple[str, Any]], bool]:
    """One request through the guard around `app(ctx)`; (seconds taken, stored statuses, whether
    the app was cancelled)."""
    stored: list[tuple[str, Any]] = []
    cancelled = False

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal cancelled
        ctx = context_of(scope)

        async def persist(status: str, error: Any) -> None:
            stored.append((status, error))

        ctx.hooks.persist_failure = persist
        try:
            await app(ctx)
        except asyncio.CancelledError:
            cancelled = True
            raise

    async def main() -> float:
        messages: list[Message] = [{"type": "http.request", "body": BODY, "more_body": False}]
        started = time.monotonic()
        mw = BudgetMiddleware(inner, limits=Limits(max_retained_bytes=1 << 22), drain=DrainState(), **guard)
        await mw(_scope(len(BODY)), lambda: _receive_once(messages), client.send)
        return time.monotonic() - started

    took = asyncio.run(main())
    return took, stored, cancelled


def test_a_write_that_makes_no_progress_ends_the_request_as_gone() -> None:
    async def app(ctx: Any) -> None:
        for i in range(1_000):
            await ctx.client.event(
                "response.output_text.delta", {"type": "response.output_text.delta", "i": i}
            )
            await ctx.client.flush()

    m = MetricDelta()
    client = StuckClient(accepted=3)
    took, stored, cancelled = serve(app, client, client_write_timeout=0.3)
    assert 0.3 <= took < 2.5
    assert stored == [("cancelled", None)] and cancelled
    assert len(client.sent) == 3 and client.blocked == 1  # nothing more was tried once it stalled
    assert m.delta("loopwarden_cap_hits_total", limit="client_write_timeout", outcome="closed") == 1
    assert m.delta("loopwarden_client_disconnects_total") == 1


def test_a_stalled_response_head_is_bounded_too() -> None:
    """Before commit (a keep-alive connection whose previous answer was never read)."""

    async def app(ctx: Any) -> None:
        await ctx.client.answer_json(200, b"{}")

    m = MetricDelta()
    took, stored, _ = serve(app, StuckClient(accepted=0), client_write_timeout=0.3)
    assert took < 2.5 and stored == [("cancelled", None)]
    assert m.delta("loopwarden_cap_hits_total", limit="client_write_timeout", outcome="closed") == 1


def test_the_error_frame_of_a_failure_gets_the_write_timeout_and_no_more() -> None:
    async def app(ctx: Any) -> None:
        await ctx.client.start_stream()
        raise DeadlineExceeded("late", seconds=1)

    m = MetricDelta()
    client = StuckClient(accepted=1)  # the head went out; the client never read again
    took, stored, _ = serve(app, client, client_write_timeout=0.3)
    assert 0.3 <= took < 2.5
    assert [status for status, _ in stored] == ["failed"]  # the true outcome, stored before the answer
    assert m.delta("loopwarden_cap_hits_total", limit="request_deadline", outcome="sse_error") == 1
    assert m.delta("loopwarden_cap_hits_total", limit="client_write_timeout", outcome="closed") == 1


def test_a_slow_write_that_completes_is_not_a_stall() -> None:
    async def app(ctx: Any) -> None:
        await ctx.client.answer_json(200, b"{}")

    sent: list[Message] = []

    class Slow(StuckClient):
        async def send(self, message: Message) -> None:
            await asyncio.sleep(0.2)  # progress, within the timeout
            sent.append(message)

    m = MetricDelta()
    _, stored, _ = serve(app, Slow(accepted=0), client_write_timeout=0.5)
    assert [msg["type"] for msg in sent] == ["http.response.start", "http.response.body"] and stored == []
    assert m.delta("loopwarden_cap_hits_total", limit="client_write_timeout", outcome="closed") == 0


def test_a_stalled_stream_sends_nothing_more() -> None:
    async def main() -> None:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        stream = ClientStream(send)
        assert stream.write_blocked_for() == 0.0
        await stream.start_stream()
        stream.stalled = True
        with pytest.raises(ClientStalled):
            await stream.event("response.in_progress", {"type": "response.in_progress"})
            await stream.flush()
        await stream.fail(_outcome())  # nothing: it cannot be written
        assert [m["type"] for m in sent] == ["http.response.start"]

    asyncio.run(main())


def test_write_blocked_for_counts_the_write_in_progress_only() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        async def send(message: Message) -> None:
            await gate.wait()

        stream = ClientStream(send)
        task = asyncio.ensure_future(stream.start_stream())
        await asyncio.sleep(0.1)
        assert stream.write_blocked_for() >= 0.1
        gate.set()
        await task
        assert stream.write_blocked_for() == 0.0

    asyncio.run(main())


def _outcome() -> Any:
    from middleware import outcomes

    return outcomes.resolve(DeadlineExceeded("late", seconds=1), committed=True)


# -- the drain deadline ends a body read --------------------------------------------------------
def test_the_drain_deadline_cuts_a_body_read_that_waits_for_bytes() -> None:
    drain = DrainState()

    async def main() -> tuple[list[Message], float]:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            raise AssertionError("the body never completes")

        part: list[Message] = [{"type": "http.request", "body": BODY[:10], "more_body": True}]
        loop = asyncio.get_running_loop()
        # the signal arrives from outside the loop (uvicorn's handler, or another thread)
        loop.call_later(
            0.2, lambda: threading.Thread(target=drain.start, args=(0.3, time.monotonic())).start()
        )
        started = time.monotonic()
        mw = BudgetMiddleware(inner, limits=Limits(max_retained_bytes=1 << 22), drain=drain)
        await mw(_scope(len(BODY)), lambda: _receive_once(part), send)
        return sent, time.monotonic() - started

    sent, took = asyncio.run(main())
    assert 0.5 <= took < 2.0  # the drain deadline, not the 30 s body timeout
    head = dict(sent[0]["headers"])
    assert sent[0]["status"] == 503 and head[b"connection"] == b"close" and b"retry-after" in head
    assert json.loads(sent[1]["body"])["error"]["code"] == "server_shutting_down"


def test_a_body_read_that_started_during_the_drain_is_cut_at_its_deadline() -> None:
    drain = DrainState()
    drain.start(0.2, time.monotonic())

    async def main() -> bool:
        try:
            async with asyncio.timeout(30) as bound:
                with drain.bounding(bound) as read:
                    await asyncio.Event().wait()
        except TimeoutError:
            return read.cut
        raise AssertionError("unreachable")

    started = time.monotonic()
    assert asyncio.run(main()) is True
    assert time.monotonic() - started < 1.0


def test_a_body_timeout_earlier_than_the_drain_deadline_is_the_body_timeout() -> None:
    drain = DrainState()
    drain.start(30.0, time.monotonic())

    async def main() -> bool:
        try:
            async with asyncio.timeout(0.1) as bound:
                with drain.bounding(bound) as read:
                    await asyncio.Event().wait()
        except TimeoutError:
            return read.cut
        raise AssertionError("unreachable")

    assert asyncio.run(main()) is False
