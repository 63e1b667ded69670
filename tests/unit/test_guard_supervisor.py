"""The guard's supervision (`middleware.asgi.guard._Supervisor`, issue 21 item 2): the inner app runs
in the request's own task, with one timer handle and — past `_Supervisor.WATCH_AFTER` — one watcher
task, and whatever ends it (the deadline, a disconnect, a cancellation from outside) ends as
before. Fake ``receive`` / ``send``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY
from starlette.types import Message, Receive, Scope, Send

from budget import Limits
from middleware.asgi.guard import BudgetMiddleware
from tests.unit.test_guard_supervision import client_receive

BODY = json.dumps({"model": "m", "input": "x"}).encode()
SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/v1/responses",
    "headers": [(b"content-length", str(len(BODY)).encode())],
}

Inner = Callable[[Scope, Receive, Send], Awaitable[None]]


async def serve(
    inner: Inner, *, disconnect_after: float | None = None, deadline: float = 1800.0
) -> list[Message]:
    """One POST through the guard around `inner`; the messages sent. The client disconnects
    `disconnect_after` seconds after the body (None: it stays)."""
    sent: list[Message] = []
    receive = client_receive(BODY, disconnect_after)

    async def send(message: Message) -> None:
        sent.append(message)

    guard = BudgetMiddleware(inner, limits=Limits(max_retained_bytes=1 << 22), request_deadline=deadline)
    await guard(dict(SCOPE), receive, send)
    return sent


def status_of(sent: list[Message]) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def error_code(sent: list[Message]) -> str:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return str(json.loads(body)["error"]["code"])


@pytest.mark.parametrize(("work", "tasks"), [(0.0, 1), (0.1, 2)])
def test_the_app_runs_in_the_requests_own_task_and_the_watcher_only_past_its_delay(
    work: float, tasks: int
) -> None:
    """A request over within `_Supervisor.WATCH_AFTER` runs with no extra task; a longer one gets
    the one disconnect watcher, gone once the request ends."""
    seen: dict[str, Any] = {}

    async def main() -> list[Message]:
        outer = asyncio.current_task()

        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            seen["same_task"] = asyncio.current_task() is outer
            await asyncio.sleep(work)
            seen["tasks"] = len(asyncio.all_tasks())  # this one (and the disconnect watcher)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        sent = await serve(inner)
        await asyncio.sleep(0)  # the watcher's cancellation runs
        seen["after"] = len(asyncio.all_tasks())
        return sent

    sent = asyncio.run(main())
    assert status_of(sent) == 200
    assert seen == {"same_task": True, "tasks": tasks, "after": 1}


def test_the_deadline_cancels_the_app_and_answers_504() -> None:
    cleaned: list[bool] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    async def main() -> tuple[list[Message], int]:
        sent = await serve(inner, deadline=0.2)
        task = asyncio.current_task()
        assert task is not None
        return sent, task.cancelling()

    sent, cancelling = asyncio.run(asyncio.wait_for(main(), 10))
    assert status_of(sent) == 504
    assert error_code(sent) == "request_deadline_exceeded"
    assert cleaned == [True]  # the app's clean-up ran (in this task) before the answer
    assert cancelling == 0  # the guard uncancelled its own cancellation


def test_a_disconnect_cancels_the_app_and_answers_nothing() -> None:
    before = REGISTRY.get_sample_value("loopwarden_client_disconnects_total") or 0.0

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(30)

    sent = asyncio.run(asyncio.wait_for(serve(inner, disconnect_after=0.05), 10))
    assert sent == []
    assert REGISTRY.get_sample_value("loopwarden_client_disconnects_total") == before + 1


def test_an_app_that_swallows_the_cancellation_still_ends_as_the_deadline() -> None:
    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # a defect: the answer is still the deadline's
            await asyncio.sleep(30)

    async def main() -> tuple[list[Message], int]:
        sent = await serve(inner, deadline=0.2)
        task = asyncio.current_task()
        assert task is not None
        return sent, task.cancelling()

    sent, cancelling = asyncio.run(asyncio.wait_for(main(), 10))
    assert status_of(sent) == 504
    assert cancelling == 0


def test_a_cancellation_from_outside_propagates() -> None:
    started = asyncio.Event()

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        started.set()
        await asyncio.sleep(30)

    async def main() -> None:
        request = asyncio.ensure_future(serve(inner))
        await started.wait()
        request.cancel()  # e.g. the server shutting down
        with pytest.raises(asyncio.CancelledError):
            await request

    asyncio.run(asyncio.wait_for(main(), 10))
