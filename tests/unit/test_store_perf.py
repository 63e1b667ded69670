"""The store's cost model: under SQLite a transaction is ONE job of the worker thread, however
many statements it runs (a thread hop per statement cost ~40 µs of CPU each); what cancelling a
caller does to a transaction that is queued or already running; an item that is both output and
replay is encoded and counted once.

The functional behaviour of every store method is in tests/store/test_store.py (all three backends).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import middleware.store.store as store_module
from middleware.store.backends import SqliteBackend, single
from middleware.store.store import Store, StoredResponse, open_store


@pytest.fixture(params=["memory", "sqlite"])
def sqlite_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "memory" if request.param == "memory" else f"sqlite:///{tmp_path}/store.db"


def response(rid: str, conversation: str | None = None) -> StoredResponse:
    return StoredResponse(
        id=rid,
        owner="alice",
        created_at=1_700_000_000,
        status="completed",
        model="gpt-test",
        previous_response_id=None,
        conversation_id=conversation,
        response={"id": rid, "object": "response", "status": "completed", "output": []},
        request={"instructions": "be brief"},
    )


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def run(url: str, body: Callable[[Store], Awaitable[None]]) -> None:
    async def main() -> None:
        async with open_store(url) as store:
            await body(store)

    asyncio.run(main())


class CountingExecutor:
    """Wraps the backend's worker executor and counts the jobs submitted to it."""

    def __init__(self, inner: ThreadPoolExecutor) -> None:
        self.inner = inner
        self.futures: list[Future[Any]] = []

    @property
    def jobs(self) -> int:
        return len(self.futures)

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        future = self.inner.submit(fn, *args)
        self.futures.append(future)
        return future

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait=wait)


@pytest.fixture
def counted() -> Iterator[Callable[[Store], CountingExecutor]]:
    def install(store: Store) -> CountingExecutor:
        backend = store.backend
        assert isinstance(backend, SqliteBackend) and backend._executor is not None
        counter = CountingExecutor(backend._executor)
        backend._executor = counter  # type: ignore[assignment]
        return counter

    yield install


def test_every_transaction_is_one_worker_job(
    sqlite_url: str, counted: Callable[[Store], CountingExecutor]
) -> None:
    """save_response into a conversation runs 5 statements (BEGIN IMMEDIATE, COMMIT aside), a
    paged list 3: each method is still one job."""

    async def body(store: Store) -> None:
        statements: list[str] = []
        store.backend.on_statement = statements.append
        counter = counted(store)
        conv = await store.create_conversation("alice", items=[user("hi")], metadata=None)
        cid = conv["id"]
        assert counter.jobs == 1
        await store.save_response(
            response("resp_1", conversation=cid),
            input_items=[user("q")],
            output_items=[{"type": "message", "role": "assistant", "content": "a"}],
            replay_items=[{"type": "message", "role": "assistant", "content": "a"}],
        )
        assert counter.jobs == 2
        assert len(statements) == 2 + 4  # create: 2; save: response, items, allocate, conversation items
        added = await store.add_conversation_items(cid, "alice", [user("more"), user("again")])
        assert added is not None and counter.jobs == 3
        page = await store.list_conversation_items(cid, "alice", after=added[0]["id"], limit=1, order="asc")
        assert page is not None and [item["id"] for item in page.data] == [added[1]["id"]]
        assert counter.jobs == 4
        info = await store.chain_size("resp_1", "alice")
        assert info is not None and info.item_count == 2
        assert counter.jobs == 5

    run(sqlite_url, body)


def test_statements_run_off_the_event_loop(sqlite_url: str) -> None:
    async def body(store: Store) -> None:
        threads: set[int] = set()
        store.backend.on_statement = lambda sql: threads.add(threading.get_ident())
        await store.save_response(
            response("resp_1"), input_items=[user("q")], output_items=[], replay_items=[]
        )
        assert await store.get_response("resp_1", "alice") is not None
        assert threads and threading.get_ident() not in threads

    run(sqlite_url, body)


def test_a_cancelled_caller_drops_a_queued_transaction_and_finishes_a_running_one(
    sqlite_url: str, counted: Callable[[Store], CountingExecutor]
) -> None:
    """Cancelling the task of a running save cannot stop it halfway: it commits whole. Cancelling
    one still queued behind it drops it before its first statement."""

    async def body(store: Store) -> None:
        counter = counted(store)
        started, release = threading.Event(), threading.Event()

        def block_first_statement(sql: str) -> None:
            if not started.is_set():
                started.set()
                assert release.wait(10), "the test never released the worker"

        store.backend.on_statement = block_first_statement
        running = asyncio.create_task(
            store.save_response(
                response("resp_run"), input_items=[user("a")], output_items=[], replay_items=[]
            )
        )
        await asyncio.to_thread(started.wait, 10)
        queued = asyncio.create_task(
            store.save_response(
                response("resp_queued"), input_items=[user("b")], output_items=[], replay_items=[]
            )
        )
        await asyncio.sleep(0)  # submitted, waiting behind the running job
        running.cancel()
        queued.cancel()
        for _ in range(100):  # the cancellation reaches the worker's queue in a loop callback
            if counter.futures[-1].cancelled():
                break
            await asyncio.sleep(0)
        assert counter.jobs == 2 and counter.futures[-1].cancelled()
        assert not counter.futures[0].cancelled()  # already running: it cannot be cancelled
        release.set()
        for task in (running, queued):
            with pytest.raises(asyncio.CancelledError):
                await task
        store.backend.on_statement = None
        assert await store.load_chain("resp_run", "alice") == [user("a")]
        assert await store.get_response("resp_queued", "alice") is None

    run(sqlite_url, body)


def test_an_item_both_shown_and_replayed_is_encoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent appends the same message object to the output and the replay: one encoding and
    node count serve both rows."""
    prepared: list[object] = []
    real_prepare = store_module._prepare

    def counting_prepare(item: object) -> Any:
        prepared.append(item)
        return real_prepare(item)

    monkeypatch.setattr(store_module, "_prepare", counting_prepare)
    message = {"type": "message", "id": "msg_1", "role": "assistant", "content": "a"}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}

    async def body(store: Store) -> None:
        await store.save_response(
            response("resp_1"),
            input_items=[user("q")],
            output_items=[message, {"type": "mcp_call", "id": "mcp_1", "name": "f"}],
            replay_items=[call, {"type": "function_call_output", "call_id": "c1", "output": "x"}, message],
        )
        assert len(prepared) == 5
        rows = await store.backend.run(
            single("SELECT role, item_id, item FROM items WHERE item_id = ? ORDER BY role", ("msg_1",)),
            write=False,
        )
        assert [(role, item_id) for role, item_id, _ in rows] == [("output", "msg_1"), ("replay", "msg_1")]
        assert rows[0][2] == rows[1][2] == store_module.encode_json(message)

    run("memory", body)
