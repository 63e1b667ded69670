"""Units of background mode without a server: the event log's window and ledger charges, and the
store's background tables (first writer wins, leases, cancel flags) on SQLite in memory."""

from __future__ import annotations

import asyncio
import json

import pytest

from budget import BudgetExceeded, ChargeModel, Ledger
from middleware.loop.background import queued_object
from middleware.loop.eventlog import EventGap, EventLog, frame_type
from middleware.store.background import BackgroundStore, now_ms
from middleware.store.store import StoredResponse, open_store
from tests import spec_schema


def frame(seq: int, size: int = 100) -> bytes:
    delta = "x" * (size - len(str(seq)))  # every frame the same length
    data = json.dumps({"type": "response.output_text.delta", "sequence_number": seq, "delta": delta})
    return f"event: response.output_text.delta\ndata: {data}\n\n".encode()


def test_frames_are_numbered_keepalives_skipped_and_done_closes() -> None:
    log = EventLog(1 << 20, None)
    log.feed(frame(0) + b": keep-alive\n\n" + frame(1))
    log.feed(b"data: [DONE]\n\n")
    assert [seq for seq, _ in log.frames] == [0, 1] and log.done
    assert frame_type(log.frames[0][1]) == b"response.output_text.delta"


def test_the_window_drops_the_oldest_and_releases_their_charge() -> None:
    ledger = Ledger(1 << 20, ChargeModel.measured())
    size = len(frame(0))
    log = EventLog(3 * size, ledger)
    for seq in range(10):
        log.feed(frame(seq))
    assert [seq for seq, _ in log.frames] == [7, 8, 9]
    assert ledger.charged == log.charged == log.size == 3 * size
    frames, first = log.unsynced()
    assert first == 7 and [seq for seq, _ in frames] == [7, 8, 9]  # what the store must hold now

    async def read() -> None:
        with pytest.raises(EventGap):
            await log.frames_after(2, 0.01)
        got, done = await log.frames_after(7, 0.01)
        assert [seq for seq, _ in got] == [8, 9] and not done

    asyncio.run(read())


def test_an_attached_reader_holds_what_it_has_not_sent_and_the_ledger_bounds_it() -> None:
    size = len(frame(0))
    ledger = Ledger(8 * size, ChargeModel.measured())
    log = EventLog(size, ledger)

    async def main() -> None:
        reader = log.reader()
        for seq in range(6):
            log.feed(frame(seq))
        assert [seq for seq, _ in log.frames] == list(range(6))  # nothing sent yet: all kept
        got, _ = await reader.frames_after(-1, 0.01)
        assert len(got) == 6
        await reader.frames_after(5, 0.01)  # sent: the window applies again
        assert [seq for seq, _ in log.frames] == [5]
        for seq in range(6, 14):
            log.feed(frame(seq))  # the reader is 8 frames behind: what it holds is charged
        with pytest.raises(BudgetExceeded):
            log.feed(frame(14))
        reader.close()
        assert len(log.frames) == 1 and ledger.charged == size

    asyncio.run(main())


def _stored(response_id: str) -> StoredResponse:
    request = {"model": "m", "input": "hi", "background": True}
    queued = queued_object(response_id, request)
    return StoredResponse(
        response_id, "alice", queued["created_at"], "queued", "m", None, None, queued, {"model": "m"}
    )


def test_the_queued_object_conforms() -> None:
    spec_schema.require_spec()
    queued = queued_object("resp_1", {"model": "m", "input": "hi", "background": True, "tools": []})
    spec_schema.assert_response(queued)
    assert (queued["status"], queued["background"], queued["store"]) == ("queued", True, True)


def test_store_first_writer_wins_and_expired_leases_fail_only_pending_rows() -> None:
    async def main() -> None:
        async with open_store("memory") as store:
            tables = BackgroundStore(store)
            for rid in ("resp_a", "resp_b"):
                await tables.create(_stored(rid), worker="w1", stream=True, lease_until=now_ms() - 1)
            assert await tables.mark_in_progress("resp_a", {"id": "resp_a", "status": "in_progress"})
            final = StoredResponse(
                "resp_b", "alice", 1, "completed", "m", None, None, {"status": "completed"}, {}
            )
            kwargs = {"input_items": [], "output_items": [], "replay_items": []}
            assert await store.save_response(final, replace_pending=True, **kwargs)
            error = {"code": "background_worker_lost", "message": "gone"}
            assert await tables.any_expired(now_ms())
            assert await tables.expire_leases(now_ms(), error) == ["resp_a"]  # resp_b had ended
            assert await store.response_status("resp_a", "alice") == "failed"
            assert await store.response_status("resp_b", "alice") == "completed"
            late = StoredResponse(
                "resp_a", "alice", 1, "completed", "m", None, None, {"status": "completed"}, {}
            )
            assert not await store.save_response(late, replace_pending=True, **kwargs)  # the reaper was first
            assert not await tables.any_expired(now_ms())
            row = await tables.task("resp_a", "alice")
            assert row is not None and row.state == "done"
            assert await tables.task("resp_a", "mallory") is None

    asyncio.run(main())


def test_store_cancel_flags_reach_the_owning_workers_heartbeat() -> None:
    async def main() -> None:
        async with open_store("memory") as store:
            tables = BackgroundStore(store)
            await tables.create(_stored("resp_c"), worker="w1", stream=False, lease_until=now_ms() + 1000)
            assert await tables.heartbeat("w1", now_ms() + 5000) == set()
            assert not await tables.request_cancel("resp_c", "mallory")  # another owner's: nothing
            assert await tables.request_cancel("resp_c", "alice")
            assert await tables.heartbeat("w2", now_ms() + 5000) == set()
            assert await tables.heartbeat("w1", now_ms() + 5000) == {"resp_c"}
            row = await tables.task("resp_c", "alice")
            assert row is not None and row.lease_until > now_ms() + 4000 and row.cancel_requested
            await tables.finish("resp_c")
            assert not await tables.request_cancel("resp_c", "alice")  # ended: nothing to cancel

    asyncio.run(main())


def test_store_event_log_window_and_retention() -> None:
    async def main() -> None:
        async with open_store("memory") as store:
            tables = BackgroundStore(store)
            await tables.create(_stored("resp_e"), worker="w1", stream=True, lease_until=now_ms() + 1000)
            await tables.append_events("resp_e", [(i, frame(i)) for i in range(5)], low=0)
            await tables.append_events("resp_e", [(5, frame(5))], low=3)
            assert [seq for seq, _ in await tables.read_events("resp_e", 3)] == [4, 5]
            assert await tables.first_event("resp_e") == 3
            await tables.gc(now_ms() + 10)  # still running: kept
            assert await tables.first_event("resp_e") == 3
            await tables.finish("resp_e")
            await tables.gc(now_ms() + 10)
            assert await tables.first_event("resp_e") is None

    asyncio.run(main())
