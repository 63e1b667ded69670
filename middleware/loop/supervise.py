"""Supervising a background task, and serving its events to a client that may go away.

`Supervisor` runs one background response's inner app (`middleware.loop.background`) the way the
guard runs a foreground request (`middleware.asgi.guard`): the whole-request deadline, the drain
deadline and a cancel each end it; a failure is resolved by `middleware.outcomes` (counted and
logged once), stored ``failed`` with its error through the loop's ``persist_failure`` hook, and
answered into the task's own `ClientStream` (the error frames land in the event log, after a
``response.created`` + ``response.queued`` when it failed before its first event: a streamed
background response's failure is always SSE-framed); a cancel is stored ``cancelled`` with the
output so far (`outcomes.stored_status(None)`).

`serve_follower` streams an event log to one client (`middleware.loop.eventlog.follow`) and
detaches — the task runs on — when the client disconnects or one write waits
``write_timeout`` seconds (`ClientStream.write_blocked_for`, DESIGN.md §5 "client stops reading").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive

from middleware import outcomes
from middleware.asgi.client_stream import ClientStream
from middleware.errors import DeadlineExceeded, ShuttingDown
from middleware.loop.eventlog import FrameSource, follow

if TYPE_CHECKING:
    from middleware.loop.background import BackgroundTask, BackgroundTasks

__all__ = ["Supervisor", "serve_follower"]

log = logging.getLogger("loopwarden")


class Supervisor:
    """Runs one `BackgroundTask` to its stored end (see the module docstring)."""

    def __init__(self, tasks: BackgroundTasks, task: BackgroundTask) -> None:
        self.tasks = tasks
        self.task = task
        self.ctx = task.ctx

    async def run(self) -> None:
        """Mark the response ``in_progress``, run it, and settle how it ended."""
        task = self.task
        in_progress = {**task.queued, "status": "in_progress"}
        if not await self.tasks.tables.mark_in_progress(task.response_id, in_progress):
            return  # it ended before it started (a lease expiry stored it)
        work = asyncio.ensure_future(self._inner())
        ended, cancelled = await self._watch(work)
        if cancelled:
            await self._persist(None)
            return
        failure = ended if ended is not None else work.result()
        if failure is not None:
            await self._settle(failure)

    async def _watch(self, work: asyncio.Future[Exception | None]) -> tuple[Exception | None, bool]:
        """Wait for ``work``; end it at the deadline, the drain deadline or a cancel. Returns
        (the failure that ended it, whether a cancel did)."""
        task = self.task
        deadline = task.started + self.tasks.settings.loop.request_deadline
        ended: Exception | None = None
        cancelled = False
        try:
            while not work.done():
                now = time.monotonic()
                drain_at = self.tasks.drain_deadline()
                if drain_at is not None and now >= drain_at:
                    ended = ShuttingDown(
                        "the gateway is shutting down and this background response did not finish within "
                        "the drain timeout (--drain-timeout); create it again",
                        refused=False,
                    )
                    break
                if now >= deadline:
                    seconds = self.tasks.settings.loop.request_deadline
                    ended = DeadlineExceeded(
                        f"the background response did not finish within {seconds:g} s (--request-deadline); "
                        "ask for less work (fewer rounds, shorter answers) or raise the deadline",
                        seconds=seconds,
                    )
                    break
                if task.cancel_requested:
                    cancelled = True
                    break
                wake = min(deadline, drain_at if drain_at is not None else deadline) - now
                waker: asyncio.Future[Any] = asyncio.ensure_future(task.wake.wait())
                pending: set[asyncio.Future[Any]] = {work, waker}
                await asyncio.wait(pending, timeout=min(max(wake, 0.0), 1.0), return_when="FIRST_COMPLETED")
                waker.cancel()
                task.wake.clear()
        finally:
            if not work.done():
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        return ended, cancelled and not (work.done() and not work.cancelled() and work.result() is None)

    async def _inner(self) -> Exception | None:
        """Run the inner app; what it raised (None when it answered)."""
        scope = {"type": "http", "loopwarden": self.ctx}
        try:
            await self.tasks.app(scope, _no_receive, self.ctx.client)
        except Exception as exc:
            return exc
        return None

    async def _persist(self, outcome: outcomes.Outcome | None) -> None:
        """Store the true end (``failed`` with the error, or ``cancelled``): through the loop's
        recorder once it exists (with the output so far), else over the ``queued`` object."""
        status, error = outcomes.stored_status(outcome)
        persist = self.ctx.hooks.persist_failure
        try:
            if persist is not None:
                await asyncio.shield(persist(status, error))
            else:
                await asyncio.shield(self.tasks.store_end(self.task, status, error))
        except Exception:
            log.exception(
                "could not store the %s status of background response %s", status, self.task.response_id
            )

    async def _settle(self, exc: Exception) -> None:
        """The one answer to ``exc``: recorded, stored, and its frames into the event log."""
        client = self.ctx.client
        if self.task.log is not None:
            self.task.log.charging = False  # the error frames must go in, whatever the ledger says
            if not client.committed:
                await self._open_stream(client)
        try:
            outcome = outcomes.resolve(exc, committed=client.committed, after_tools=self.ctx.hooks.tools_ran)
        except Exception as defect:  # the table itself failed on this input: still one answer
            log.exception("could not resolve the outcome of %r", exc)
            outcome = outcomes.resolve(defect, committed=client.committed)
        outcomes.record(outcome, owner=self.ctx.owner)
        await self._persist(outcome)
        try:
            await client.fail(outcome)
        except Exception:
            log.exception("background response %s: its error frames could not be kept", self.task.response_id)

    async def _open_stream(self, client: ClientStream) -> None:
        """A streamed task that failed before its first event: its stream begins as a queued
        background stream begins (``response.created`` and ``response.queued`` with the
        ``queued`` object), so that the failure goes into the event log as the ``error`` +
        ``response.failed`` frames of a committed stream, never as a JSON envelope: the
        followers' 200 SSE responses are committed, and the response exists (DESIGN.md §5)."""
        queued = self.task.queued
        if client.snapshot is None:
            client.snapshot = lambda: {**queued, "status": "in_progress"}
        try:
            for kind in ("response.created", "response.queued"):
                await client.event(kind, {"type": kind, "response": dict(queued)})
        except Exception:
            log.exception("background response %s: its stream could not begin", self.task.response_id)


async def _no_receive() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")  # pragma: no cover


async def serve_follower(
    source: FrameSource,
    client: ClientStream,
    receive: Receive,
    *,
    after: int,
    write_timeout: float,
    on_end: Callable[[bool, int], Awaitable[None]] | None = None,
) -> None:
    """Stream ``source`` after ``after`` to ``client`` until its end; detach on a disconnect or a
    write blocked ``write_timeout`` seconds (counted as a client gone; nothing is stored).
    Raises `middleware.loop.eventlog.EventGap` when the events after ``after`` are gone."""
    work = asyncio.ensure_future(follow(source, client, after, on_end=on_end))
    watcher = asyncio.ensure_future(_disconnected(receive))
    stalled = gone = False
    try:
        while not work.done():
            done, _ = await asyncio.wait(
                {work, watcher}, timeout=min(1.0, write_timeout), return_when="FIRST_COMPLETED"
            )
            if work in done:
                break
            if watcher in done:
                gone = True
                break
            if client.write_blocked_for() >= write_timeout:
                stalled = client.stalled = True
                break
    finally:
        for future in (work, watcher):
            if not future.done():
                future.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await future
    if stalled:
        outcomes.record_client_gone(write_timeout=write_timeout, committed=client.committed)
    elif gone:
        outcomes.record_client_gone()
    else:
        work.result()  # raises EventGap / the writes' failures


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
