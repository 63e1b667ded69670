"""Background responses (``background: true``, issue 23): run, poll, cancel, resume, across workers.

`BackgroundTasks` is one worker's set of running background responses. The guard
(`middleware.asgi.guard`) hands it an admitted create request with ``background: true``
(`launch`): the response is stored ``queued`` with its task row (`middleware.store.background`),
the request's ledger and admission reservation move to a task, and the client is answered at once
— the ``queued`` response object, or (``stream: true``) the task's events as they come
(`middleware.loop.eventlog.follow`). The task runs the same inner app as a foreground request
(`middleware.loop.app.ResponsesApp`: the upstream is always called in the foreground, and
``background`` is never forwarded), writing to a `ClientStream` whose ``send`` feeds the event log
instead of a socket; it is supervised like a foreground request (`_Supervisor`): the request
deadline, the drain, and a cancel end it, and every failure goes through `middleware.outcomes`
(counted, logged, stored ``failed`` with its error, the error frames in the event log).

A client that goes away does not cancel anything: the follower stops (a disconnect, or a write
that waited ``--client-write-timeout``), the task runs on.

Across workers and hosts (one SQLite file, one PostgreSQL): every ``tick`` seconds (at most 0.25,
a quarter of the lease) each worker copies new event-log frames to the store, renews the leases of
its tasks and reads their cancel flags in one transaction (`BackgroundStore.heartbeat`), and
stores ``failed`` (502 ``background_worker_lost``) every running task whose lease
(``--background-lease-seconds``) passed — a worker that died (checked every quarter lease, with a
read; the write transaction runs only when a lease has passed). Event logs are dropped
``--background-event-log-retention`` seconds after their task ended.

`cancel` (``POST /v1/responses/{id}/cancel``, from any worker) sets the task's cancel flag (and
wakes it at once when it runs here), waits up to ``CANCEL_WAIT`` seconds for its end to be stored,
and answers the stored response: ``cancelled`` with the output so far, or unchanged when it had
already ended (as OpenAI answers). `resume` (``GET /v1/responses/{id}?stream=true&starting_after=N``)
streams the events after N, then the live ones, from this worker's memory or from the store.

`close` (the app's lifespan shutdown) lets the tasks run until the drain deadline (SIGTERM's, else
``--drain-timeout`` from now), then they end ``failed`` with ``server_shutting_down``.

Metrics: ``loopwarden_background_tasks`` (running here) and
``loopwarden_background_outcomes_total{outcome}`` (the stored status each ended with).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Send

from budget import Ledger
from middleware import outcomes
from middleware.asgi.client_stream import ClientStream
from middleware.config import Settings
from middleware.errors import CallerShareFull, WorkerLost
from middleware.ids import new_id
from middleware.loop.context import RequestContext, RequestHooks
from middleware.loop.echo import normalise_response
from middleware.loop.eventlog import EventGap, EventLog
from middleware.loop.items import public_tools
from middleware.loop.resume import resume_response
from middleware.loop.supervise import Supervisor, serve_follower
from middleware.ops import metrics
from middleware.ops.admission import DRAIN, DrainState, RequestReservation
from middleware.store.background import PENDING, BackgroundStore, now_ms
from middleware.store.store import Store, StoredResponse

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from middleware.asgi.intake import Intake

__all__ = ["CANCEL_WAIT", "BackgroundTask", "BackgroundTasks", "queued_object", "worker_name"]

log = logging.getLogger("loopwarden")


def worker_name() -> str:
    """A worker's name in the task rows: host, process id and a random suffix (pids are reused;
    made per app, so a forked worker does not inherit its parent's)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


#: Seconds a cancel waits for the task's end to be stored before answering the response as it is.
CANCEL_WAIT = 10.0
_GC_EVERY = 60.0  # seconds between event-log clean-ups


def queued_object(response_id: str, request: dict[str, Any]) -> dict[str, Any]:
    """The ``queued`` response object of a background create request (spec-complete)."""
    previous = request.get("previous_response_id")
    response: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued",
        "model": request.get("model"),
        "output": [],
        "tools": public_tools(request.get("tools")),
        "tool_choice": request.get("tool_choice", "auto"),
        "store": True,
        "background": True,
        "previous_response_id": previous if isinstance(previous, str) else None,
    }
    normalise_response(response, request)
    return response


@dataclasses.dataclass(eq=False)
class BackgroundTask:
    """One background response running on this worker: its id, owner, context (whose ``client``
    feeds ``log``), the ``queued`` object, and its ledger and reservation (released at its end)."""

    response_id: str
    ctx: RequestContext
    queued: dict[str, Any]
    log: EventLog | None
    ledger: Ledger
    reservation: RequestReservation | None
    caller: str = ""  # the admission caller (`Intake.caller`), for the per-caller task cap
    started: float = dataclasses.field(default_factory=time.monotonic)
    cancel_requested: bool = False
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None

    def request_cancel(self) -> None:
        """Ask the task to stop (it stores ``cancelled`` with the output so far)."""
        self.cancel_requested = True
        self.wake.set()


class BackgroundTasks:
    """One worker's background responses (see the module docstring).

    ``app``: the inner Responses app the tasks run; ``get_store()``: the open `Store`;
    ``settings``: lease, event-log bound and retention, request deadline, drain timeout,
    keep-alive interval and client write timeout.
    """

    def __init__(
        self, app: ASGIApp, get_store: Callable[[], Store], settings: Settings, *, drain: DrainState = DRAIN
    ) -> None:
        self.app = app
        self.get_store = get_store
        self.settings = settings
        self.drain = drain
        self.lease_ms = int(settings.background.lease_seconds * 1000)
        self.tick = min(0.25, settings.background.lease_seconds / 4)
        self.worker = worker_name()
        self.expire_every = max(self.tick, settings.background.lease_seconds / 4)
        self.tasks: dict[str, BackgroundTask] = {}
        self.shutdown_at: float | None = None  # time.monotonic() after which tasks are ended
        self._beat: asyncio.Task[None] | None = None

    @property
    def store(self) -> Store:
        """The open store."""
        return self.get_store()

    @property
    def tables(self) -> BackgroundStore:
        """The store's background tables."""
        return BackgroundStore(self.store)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the heartbeat (the lifespan calls it once the store is open)."""
        if self._beat is None:
            self._beat = asyncio.create_task(self._heartbeat())

    def drain_deadline(self) -> float | None:
        """``time.monotonic()`` after which running tasks end ``server_shutting_down`` (None: not draining)."""
        deadlines = [d for d in (self.shutdown_at, self.drain.deadline if self.drain.draining else None) if d]
        return min(deadlines) if deadlines else None

    async def close(self) -> None:
        """Drain: the tasks run until the drain deadline, then end ``failed``
        (``server_shutting_down``); then the heartbeat stops."""
        self.shutdown_at = time.monotonic() + self.settings.transport.drain_timeout
        for task in tuple(self.tasks.values()):
            task.wake.set()
        runners = {t.runner for t in self.tasks.values() if t.runner is not None}
        if runners:
            await asyncio.wait(runners, timeout=self.settings.transport.drain_timeout + 10)
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
            self._beat = None
        with contextlib.suppress(Exception):
            await self._sync_logs()

    # -- create --------------------------------------------------------------------------------
    async def launch(self, ctx: RequestContext, intake: Intake) -> BackgroundTask:
        """Store the request's response ``queued`` with its task row, take over the request's
        ledger and reservation from ``intake`` and start its task. Raises `CallerShareFull` when
        the caller already runs its share of the upstream connections as background tasks on this
        worker (`caller_task_cap`), and what the store raises (nothing is taken over then)."""
        self._check_caller_share(intake.caller)
        response_id = new_id("resp")
        queued = queued_object(response_id, ctx.request)
        previous = queued["previous_response_id"]
        stored = StoredResponse(
            id=response_id,
            owner=ctx.owner,
            created_at=int(queued["created_at"]),
            status="queued",
            model=str(ctx.request.get("model")),
            previous_response_id=previous,
            conversation_id=None,
            response=queued,
            request={k: v for k, v in ctx.request.items() if k not in ("input", "stream")},
        )
        await self.tables.create(
            stored, worker=self.worker, stream=ctx.stream, lease_until=now_ms() + self.lease_ms
        )
        ledger, reservation = ctx.ledger, intake.reservation
        intake.ledger = None  # the task releases them at its end, not the guard
        intake.reservation = None
        event_log = EventLog(self.settings.background.event_log_bytes, ledger) if ctx.stream else None
        sink = ClientStream(_sink(event_log), keepalive_interval=self.settings.transport.keepalive_interval)
        task_ctx = dataclasses.replace(ctx, client=sink, hooks=RequestHooks(), response_id=response_id)
        task = BackgroundTask(response_id, task_ctx, queued, event_log, ledger, reservation, intake.caller)
        self.tasks[response_id] = task
        task.runner = asyncio.create_task(self._run(task))
        return task

    @property
    def caller_task_cap(self) -> int:
        """Background tasks one caller may run at once on this worker: its share
        (``--max-inflight-share-per-caller``) of ``--upstream-max-connections``, at least 1. A
        background task outlives its client, so the pool's byte share alone (about 0.5 MB a
        task) would let one caller hold every upstream connection and starve the others."""
        settings = self.settings
        return max(
            1, int(settings.admission.max_inflight_share_per_caller * settings.upstream.max_connections)
        )

    def _check_caller_share(self, caller: str) -> None:
        running = sum(1 for task in self.tasks.values() if task.caller == caller)
        cap = self.caller_task_cap
        if running >= cap:
            raise CallerShareFull(
                f"the gateway refuses this caller for now: it already runs {running} background responses "
                f"on this worker, its share (--max-inflight-share-per-caller × --upstream-max-connections = "
                f"{cap}) of the upstream connections; retry after {self.settings.admission.retry_after:g} s, once "
                "one has ended (or cancel one)",
                requested=1,
                held=running,
                share=cap,
            )

    async def answer(self, task: BackgroundTask, client: ClientStream, receive: Receive) -> None:
        """Answer the create request: the ``queued`` object, or the task's events as they come
        (a client that goes away or stops reading detaches; the task runs on)."""
        if task.log is None:
            body = json.dumps(task.queued, separators=(",", ":")).encode()
            await client.answer_json(200, body)
            return
        reader = task.log.reader()  # before the task first runs: the follower misses nothing
        try:
            await serve_follower(
                reader, client, receive, after=-1, write_timeout=self.settings.transport.client_write_timeout
            )
        except EventGap:  # pragma: no cover - the reader holds what it has not sent
            log.warning("background response %s: its stream lost events", task.response_id)
        finally:
            reader.close()

    # -- one task ------------------------------------------------------------------------------
    async def _run(self, task: BackgroundTask) -> None:
        metrics.BACKGROUND_TASKS.inc()
        try:
            await Supervisor(self, task).run()
        except Exception:
            log.exception("background response %s: its supervision failed", task.response_id)
        finally:
            ledger = task.ledger
            ledger.release_all()
            metrics.RETAINED_PEAK.observe(ledger.peak)
            metrics.RETAINED_UTILIZATION.observe(ledger.peak / ledger.limit)
            if task.reservation is not None:
                task.reservation.close()
            if task.log is not None:
                task.log.forget_charges()
                task.log.close()
            try:
                await asyncio.shield(self._end(task))
            except Exception:
                log.exception("background response %s: its end could not be stored", task.response_id)
            finally:
                self.tasks.pop(task.response_id, None)
                metrics.BACKGROUND_TASKS.dec()
                task.ended.set()

    async def _end(self, task: BackgroundTask) -> None:
        """After the task: its event log copied, a stored end guaranteed, its row ``done``, counted."""
        if task.log is not None:
            await self._sync_log(task)
        status = await self.store.response_status(task.response_id, task.ctx.owner)
        if status in PENDING:  # the loop ended without storing (the store refused the object)
            outcome = outcomes.resolve(RuntimeError("the background response ended without a stored result"))
            await self.store_end(task, "failed", outcomes.error_object(outcome))
            status = "failed"
        await self.tables.finish(task.response_id)
        if status in metrics.BACKGROUND_OUTCOMES:
            metrics.BACKGROUND_OUTCOMES_TOTAL.labels(outcome=status).inc()

    async def store_end(self, task: BackgroundTask, status: str, error: dict[str, Any] | None) -> None:
        """Store ``status`` (with ``error``) over the pending row, output empty: for a task that
        ended before its loop could store anything (the loop's own recorder stores the rest)."""
        response = {**task.queued, "status": status, "error": error}
        stored = StoredResponse(
            id=task.response_id,
            owner=task.ctx.owner,
            created_at=int(task.queued["created_at"]),
            status=status,
            model=str(task.queued.get("model")),
            previous_response_id=task.queued.get("previous_response_id"),
            conversation_id=None,
            response=response,
            request={k: v for k, v in task.ctx.request.items() if k not in ("input", "stream")},
        )
        await self.store.save_response(
            stored, input_items=[], output_items=[], replay_items=[], replace_pending=True
        )

    # -- heartbeat -----------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        last_gc = last_expiry = 0.0
        while True:
            await asyncio.sleep(self.tick)
            try:
                await self._sync_logs()
                if self.tasks:
                    for response_id in await self.tables.heartbeat(self.worker, now_ms() + self.lease_ms):
                        task = self.tasks.get(response_id)
                        if task is not None:
                            task.request_cancel()
                if time.monotonic() - last_expiry >= self.expire_every:
                    last_expiry = time.monotonic()
                    await self._expire()
                if time.monotonic() - last_gc >= _GC_EVERY:
                    last_gc = time.monotonic()
                    retention_ms = int(self.settings.background.event_log_retention * 1000)
                    await self.tables.gc(now_ms() - retention_ms)
            except Exception:
                log.exception("background heartbeat failed; retrying in %g s", self.tick)

    async def _expire(self) -> None:
        """Store ``failed`` the tasks of workers whose lease passed."""
        seconds = self.settings.background.lease_seconds
        failure = WorkerLost(
            f"the worker running this background response stopped renewing its lease for {seconds:g} s "
            "(--background-lease-seconds): it died or lost the store; create the response again",
            seconds=seconds,
        )
        outcome = outcomes.resolve(failure)
        now = now_ms()
        if not await self.tables.any_expired(now):  # a read: no write lock while nothing expired
            return
        for _ in await self.tables.expire_leases(now, outcomes.error_object(outcome)):
            outcomes.record(outcome)
            metrics.BACKGROUND_OUTCOMES_TOTAL.labels(outcome="failed").inc()

    async def _sync_logs(self) -> None:
        for task in tuple(self.tasks.values()):
            if task.log is not None:
                await self._sync_log(task)

    async def _sync_log(self, task: BackgroundTask) -> None:
        assert task.log is not None
        frames, first = task.log.unsynced()
        if frames:
            await self.tables.append_events(task.response_id, frames, first)

    # -- cancel and resume (the store routes) ------------------------------------------------------
    async def cancel(self, response_id: str, owner: str) -> bytes | None:
        """``POST /v1/responses/{id}/cancel``: the stored response after the cancel (see the
        module docstring); None when it is not a background response of ``owner`` (the route
        answers 400 for a foreground one, 404 for an unknown one)."""
        row = await self.tables.task(response_id, owner)
        if row is None:
            return None
        if row.state == "running" and row.lease_until < now_ms():
            await self._expire()  # its worker is gone: store that now rather than wait for it
        if row.state == "running" and await self.tables.request_cancel(response_id, owner):
            local = self.tasks.get(response_id)
            if local is not None:
                local.request_cancel()
            deadline = time.monotonic() + CANCEL_WAIT
            while time.monotonic() < deadline:
                if await self.store.response_status(response_id, owner) not in PENDING:
                    break
                if local is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(local.ended.wait(), self.tick)
                else:
                    await asyncio.sleep(self.tick)
        return await self.store.response_json(response_id, owner)

    async def resume(self, request: Request, owner: str) -> Response:
        """``GET /v1/responses/{id}?stream=true&starting_after=N`` (`middleware.loop.resume`)."""
        return await resume_response(self, request, owner)


def _sink(event_log: EventLog | None) -> Send:
    """The ``send`` of a task's `ClientStream`: the body bytes of an SSE answer feed the event
    log (a buffered task's answer is dropped: it is stored, and polled). A JSON answer of a
    streamed task is a defect (`Supervisor` begins the stream before a failure): it is logged
    and never fed, so no follower's committed SSE stream carries a bare envelope."""
    sse = False

    async def send(message: Message) -> None:
        nonlocal sse
        if event_log is None:
            return
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            if sse:
                event_log.feed(message.get("body", b""))
            else:
                log.error("a streamed background task answered JSON; not kept in its event log")

    return send
