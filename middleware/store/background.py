"""The store's side of background responses (``background: true``, issue 23): task rows and event logs.

Two tables of schema version 3 (`middleware.store.schema`), on SQLite and PostgreSQL alike:

``background_tasks``
    one row per background response: the ``worker`` running it (``host:pid:random``), ``state``
    (``running`` until it ended, then ``done``), ``stream`` (1: it keeps an event log), its
    ``lease_until`` (epoch milliseconds; the worker renews it on every heartbeat), the
    ``cancel_requested`` flag any worker may set, and ``finished_at`` (epoch milliseconds).
``background_events``
    the SSE frames of a streamed background response, ``seq`` = the event's ``sequence_number``
    (a bounded window: the oldest frames are dropped first), for resuming with ``starting_after``.

How the pieces use them (`middleware.loop.background` runs the tasks):

* create: `BackgroundStore.create` stores the response ``queued`` and its task row in one
  transaction; the worker then marks it ``in_progress`` (`mark_in_progress`) and, at its end,
  stores the final object over it (`Store.save_response` with ``replace_pending``: first writer
  wins) and, once its event log is copied, marks the task row ``done`` (`finish`);
* cancel: `request_cancel` sets the flag from any worker or host; the running worker sees it on its
  next heartbeat (`heartbeat`: one transaction that renews its leases and reads the flags);
* a dead worker: `expire_leases` (run by every worker's heartbeat) stores the response of every
  running task whose lease passed ``failed`` with the given error, first writer wins;
* events: `append_events` (batched, with the window's new low end), `read_events`, `first_event`,
  `last_event`, `gc` (drops the logs of tasks that ended more than the retention ago; task rows
  stay).

Errors: `StoreUnavailable` (the database fails), as every `Store` method.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from middleware.store.backends import ExecuteMany, Fetch, Work, single
from middleware.store.store import Store, StoredResponse, encode_json

__all__ = ["PENDING", "BackgroundStore", "TaskRow", "now_ms"]

#: Response statuses of a background response that has not ended.
PENDING = ("queued", "in_progress")

_INSERT_TASK = """
INSERT INTO background_tasks (response_id, owner, worker, state, stream, lease_until)
VALUES (?, ?, ?, 'running', ?, ?)
"""
_FINISH = "UPDATE background_tasks SET state = 'done', finished_at = ? WHERE response_id = ?"
_SET_STATUS = (
    "UPDATE responses SET status = ?, response = ?, size_bytes = ? "
    "WHERE id = ? AND status IN ('queued', 'in_progress') RETURNING id"
)


def now_ms() -> int:
    """Wall-clock epoch milliseconds (leases and retention are compared across hosts)."""
    return int(time.time() * 1000)


@dataclasses.dataclass(frozen=True)
class TaskRow:
    """One ``background_tasks`` row: ``worker``, ``state`` (``running`` / ``done``), ``stream``,
    ``lease_until`` / ``finished_at`` (epoch ms), ``cancel_requested``."""

    response_id: str
    worker: str
    state: str
    stream: bool
    lease_until: int
    cancel_requested: bool
    finished_at: int | None


def _encoded(response: dict[str, Any]) -> tuple[str, int]:
    text = encode_json(response)
    return text, len(text.encode("utf-8"))


class BackgroundStore:
    """The background tables of one `Store` (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def create(self, resp: StoredResponse, *, worker: str, stream: bool, lease_until: int) -> None:
        """Store ``resp`` (status ``queued``, no items yet) and its task row, owned by ``worker``
        with a lease until ``lease_until`` (epoch ms), in one transaction. Raises `DuplicateId`,
        `StoreUnavailable`."""
        task = Fetch(_INSERT_TASK, (resp.id, resp.owner, worker, int(stream), lease_until))
        await self.store.save_response(resp, input_items=[], output_items=[], replay_items=[], extra=(task,))

    async def mark_in_progress(self, response_id: str, response: dict[str, Any]) -> bool:
        """Store ``response`` (status ``in_progress``) over the ``queued`` one; False when the
        response has ended meanwhile (cancelled before it started)."""
        text, size = _encoded(response)
        rows = await self.store.backend.run(
            single(_SET_STATUS, ("in_progress", text, size, response_id)), write=True
        )
        return bool(rows)

    async def task(self, response_id: str, owner: str) -> TaskRow | None:
        """The task row of a background response of ``owner``; None for a foreground one, an
        unknown id or another owner's."""
        rows = await self.store.backend.run(
            single(
                "SELECT response_id, worker, state, stream, lease_until, cancel_requested, finished_at "
                "FROM background_tasks WHERE response_id = ? AND owner = ?",
                (response_id, owner),
            ),
            write=False,
        )
        if not rows:
            return None
        r = rows[0]
        return TaskRow(
            r[0], r[1], r[2], bool(r[3]), int(r[4]), bool(r[5]), None if r[6] is None else int(r[6])
        )

    async def finish(self, response_id: str) -> None:
        """Mark the task ``done`` (its end is stored and its event log copied)."""
        await self.store.backend.run(single(_FINISH, (now_ms(), response_id)), write=True)

    async def request_cancel(self, response_id: str, owner: str) -> bool:
        """Set the cancel flag of a running task; False when it is not running (ended, or unknown)."""
        rows = await self.store.backend.run(
            single(
                "UPDATE background_tasks SET cancel_requested = 1 "
                "WHERE response_id = ? AND owner = ? AND state = 'running' RETURNING response_id",
                (response_id, owner),
            ),
            write=True,
        )
        return bool(rows)

    async def heartbeat(self, worker: str, lease_until: int) -> set[str]:
        """Renew the leases of ``worker``'s running tasks to ``lease_until`` (epoch ms) and return
        the ids of those whose cancel was requested; one transaction."""

        def work() -> Work[set[str]]:
            yield Fetch(
                "UPDATE background_tasks SET lease_until = ? WHERE worker = ? AND state = 'running'",
                (lease_until, worker),
            )
            rows = yield Fetch(
                "SELECT response_id FROM background_tasks "
                "WHERE worker = ? AND state = 'running' AND cancel_requested = 1",
                (worker,),
            )
            return {str(row[0]) for row in rows}

        return await self.store.backend.run(work(), write=True)

    async def any_expired(self, now: int) -> bool:
        """Whether any running task's lease ended before ``now`` (epoch ms); a read."""
        rows = await self.store.backend.run(
            single(
                "SELECT response_id FROM background_tasks WHERE state = 'running' AND lease_until < ? LIMIT 1",
                (now,),
            ),
            write=False,
        )
        return bool(rows)

    async def expire_leases(self, now: int, error: dict[str, Any]) -> list[str]:
        """Store ``failed`` with ``error`` the response of every running task whose lease ended
        before ``now`` (epoch ms) and mark the task ``done``; the ids, in one transaction. A
        response that already ended keeps its status (only the task row is closed)."""

        def work() -> Work[list[str]]:
            expired = yield Fetch(
                "SELECT response_id FROM background_tasks WHERE state = 'running' AND lease_until < ?",
                (now,),
            )
            failed: list[str] = []
            for (response_id,) in expired:
                rows = yield Fetch(
                    "SELECT response FROM responses WHERE id = ? AND status IN ('queued', 'in_progress')",
                    (response_id,),
                )
                if rows:
                    response = json.loads(rows[0][0])
                    response.update(status="failed", error=error)
                    text, size = _encoded(response)
                    yield Fetch(
                        "UPDATE responses SET status = 'failed', error = ?, response = ?, size_bytes = ? WHERE id = ?",
                        (encode_json(error), text, size, response_id),
                    )
                    failed.append(str(response_id))
                yield Fetch(_FINISH, (now, response_id))
            return failed

        return await self.store.backend.run(work(), write=True)

    async def append_events(self, response_id: str, frames: Sequence[tuple[int, bytes]], low: int) -> None:
        """Append ``frames`` (``(seq, SSE frame bytes)``) to the event log and drop the frames
        below ``low`` (the window's oldest kept seq); one transaction."""

        def work() -> Work[None]:
            if frames:
                yield ExecuteMany(
                    "INSERT INTO background_events (response_id, seq, frame) VALUES (?, ?, ?)",
                    [(response_id, seq, frame.decode("utf-8")) for seq, frame in frames],
                )
            yield Fetch("DELETE FROM background_events WHERE response_id = ? AND seq < ?", (response_id, low))

        await self.store.backend.run(work(), write=True)

    async def read_events(self, response_id: str, after: int, limit: int = 200) -> list[tuple[int, bytes]]:
        """Up to ``limit`` frames with ``seq`` > ``after``, in order."""
        rows = await self.store.backend.run(
            single(
                "SELECT seq, frame FROM background_events WHERE response_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (response_id, after, limit),
            ),
            write=False,
        )
        return [(int(r[0]), str(r[1]).encode("utf-8")) for r in rows]

    async def last_event(self, response_id: str) -> tuple[int, bytes] | None:
        """The newest ``(seq, frame)`` of the event log (None: empty)."""
        rows = await self.store.backend.run(
            single(
                "SELECT seq, frame FROM background_events WHERE response_id = ? ORDER BY seq DESC LIMIT 1",
                (response_id,),
            ),
            write=False,
        )
        return (int(rows[0][0]), str(rows[0][1]).encode("utf-8")) if rows else None

    async def first_event(self, response_id: str) -> int | None:
        """The oldest kept ``seq`` of the event log (None: empty)."""
        rows = await self.store.backend.run(
            single("SELECT MIN(seq) FROM background_events WHERE response_id = ?", (response_id,)),
            write=False,
        )
        return None if not rows or rows[0][0] is None else int(rows[0][0])

    async def gc(self, before: int) -> None:
        """Drop the event logs of tasks that ended before ``before`` (epoch ms); their task rows
        stay (a later cancel still answers the response unchanged)."""
        await self.store.backend.run(
            single(
                "DELETE FROM background_events WHERE response_id IN "
                "(SELECT response_id FROM background_tasks WHERE state = 'done' AND finished_at < ?)",
                (before,),
            ),
            write=True,
        )
