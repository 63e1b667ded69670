"""`BudgetMiddleware`: the guard around ``POST /v1/responses`` and its one outcome authority.

Pure ASGI (DESIGN.md §2, STYLE.md). For each request it creates the `ClientStream` (the one writer
to ``send``), runs `Intake` (DESIGN.md §3 checks, a `RequestContext` in ``scope["loopwarden"]``),
then supervises the inner app, which runs in the request's own task (`_Supervisor`: one
disconnect watcher task, one timer handle): the whole-request deadline, the drain timeout, the
client's disconnect and a write to the client that has waited ``--client-write-timeout`` (the
client stopped reading) each cancel it. Whatever ends a request — a raise, the deadline, the drain, a
disconnect — is settled here, once, through `middleware.outcomes`: its metrics and log line
(`outcomes.record`), its stored status (`outcomes.stored_status`, through the loop's
``ctx.hooks.persist_failure``), and its answer (`ClientStream.fail`: the envelope before commit,
``error`` + ``response.failed`` + ``[DONE]`` after). That answer is bounded too: it gets at most
``client_write_timeout`` seconds, so a request whose deadline fires while its client has stopped
reading ends within ``request_deadline + client_write_timeout``. A failure the outcome table
shields (`outcomes.shielded`) of a request whose whole body was read is remembered by the retry
shield (`middleware.ops.shield`) with the answer it gets, and the intake answers the same
caller's identical request with it again (`middleware.errors.ShieldHit`). A client that stopped reading
gets nothing more: it is counted and stored as gone (`outcomes.record_client_gone`,
``cancelled``), and uvicorn closes the connection when the app returns.

An admitted ``background: true`` request is handed to the worker's `BackgroundTasks`
(`middleware.loop.background`): it stores the response ``queued``, takes over the ledger and the
reservation, and supervises the task itself; the guard only answers the client from it (and
settles a failure to store the ``queued`` row, e.g. 503 ``store_unavailable``).

Every request is counted (``loopwarden_requests_total`` before its last byte leaves,
``loopwarden_inflight_requests``, ``loopwarden_client_disconnects_total``, the retained-bytes peak
and utilisation histograms).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from budget import ChargeModel, Limits
from middleware import outcomes
from middleware.asgi.auth import Authenticator
from middleware.asgi.client_stream import ClientStream
from middleware.asgi.intake import LIMIT_HEADERS, ClientGone, Intake, IntakeConfig
from middleware.asgi.models import ModelRouter
from middleware.asgi.validate import validate_request
from middleware.errors import DeadlineExceeded, ShuttingDown
from middleware.loop.context import RequestContext
from middleware.ops import metrics
from middleware.ops.admission import DRAIN, DrainState, ProcessPool
from middleware.ops.request_id import REQUEST_ID
from middleware.ops.shield import Remembered, RetryShield

if TYPE_CHECKING:
    from middleware.loop.background import BackgroundTasks

log = logging.getLogger("loopwarden")

#: Makes the `ClientStream` of a WebSocket turn, given the guard's ``on_final(status)`` counter.
StreamFactory = Callable[[Callable[[int], None]], ClientStream]

#: Error codes whose limit a request can lower itself: the message then says so.
_LOWERABLE = {
    "max_retained_bytes_exceeded": "max_retained_bytes",
    "max_infer_iters_exceeded": "max_infer_iters",
}


class BudgetMiddleware:
    """Wraps the Responses app; see the module docstring for what it enforces.

    ``limits``: the server-wide `Limits`. ``router``: the configured models (their limits, and the
    ``model`` metric label; unknown models are a 404 when any is configured).
    ``client_body_timeout``: seconds to receive the whole body. ``pool``: the worker's admission
    pool. ``request_deadline``: seconds for the whole request. ``retry_after``: seconds in a 503.
    ``keepalive_interval``: seconds of client silence before a ``: keep-alive`` comment.
    ``client_write_timeout``: seconds one write to the client may wait (make no progress) before
    the request ends as a client disconnect. ``validate`` and ``create``: what the body is
    (`IntakeConfig`; the defaults: a create request).
    ``shield``: the worker's retry shield (None: off).
    ``background``: the worker's background tasks (`middleware.loop.background`), which take
    over an admitted ``background: true`` request (None: such a request runs as a foreground one
    would — the app always passes it).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        limits: Limits,
        client_body_timeout: float = 30.0,
        router: ModelRouter | None = None,
        authenticator: Authenticator | None = None,
        pool: ProcessPool | None = None,
        request_deadline: float = 1800.0,
        retry_after: float = 1.0,
        keepalive_interval: float = 15.0,
        client_write_timeout: float = 30.0,
        drain: DrainState = DRAIN,
        charge_model: ChargeModel | None = None,
        validate: Callable[[dict[str, Any]], None] = validate_request,
        create: bool = True,
        shield: RetryShield | None = None,
        background: BackgroundTasks | None = None,
    ) -> None:
        self.app = app
        self.shield = shield
        self.background = background
        self.authenticator = authenticator or Authenticator(())
        self.pool = pool or ProcessPool(1 << 62)
        self.request_deadline = request_deadline
        self.retry_after = retry_after
        self.keepalive_interval = keepalive_interval
        self.client_write_timeout = client_write_timeout
        self.drain = drain
        self.limits = limits
        self.client_body_timeout = client_body_timeout
        self.router = router or ModelRouter(())
        self.intake = IntakeConfig(
            limits=limits,
            authenticator=self.authenticator,
            router=self.router,
            pool=self.pool,
            drain=drain,
            client_body_timeout=client_body_timeout,
            retry_after=retry_after,
            charge_model=charge_model or ChargeModel.measured(),
            validate=validate,
            create=create,
            shield=shield,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await _Guard(self, scope, receive, send).run()

    async def serve_turn(self, scope: Scope, receive: Receive, stream: StreamFactory) -> None:
        """Serve one WebSocket turn (`middleware.asgi.websocket`) exactly as a ``POST
        /v1/responses``: ``scope`` is its synthetic HTTP scope, ``receive`` yields the message as
        the body, and ``stream(on_final)`` makes the turn's `ClientStream` (a subclass that writes
        WebSocket messages), ``on_final`` being the guard's request counter."""
        await _Guard(self, scope, receive, None, stream=stream).run()


class _Guard:
    """Per-request responder of `BudgetMiddleware`."""

    def __init__(
        self,
        mw: BudgetMiddleware,
        scope: Scope,
        receive: Receive,
        send: Send | None,
        *,
        stream: StreamFactory | None = None,
    ) -> None:
        self.mw = mw
        self.scope = scope
        self.receive = receive
        self.started_at = time.monotonic()
        self.counted = False
        if stream is not None:
            self.client = stream(self._count)
        else:
            assert send is not None
            self.client = ClientStream(send, keepalive_interval=mw.keepalive_interval, on_final=self._count)
        self.intake = Intake(scope, receive, mw.intake)

    def _count(self, status: int) -> None:
        if not self.counted:
            self.counted = True
            metrics.count_request(status or 499, self.intake.model_label)

    async def run(self) -> None:
        metrics.INFLIGHT.inc()
        try:
            try:
                ctx = await self.intake.admit(self.client)
            except ClientGone:
                outcomes.record_client_gone()
                return
            except Exception as exc:
                await self._settle(exc, None)
                return
            if self.mw.background is not None and ctx.request.get("background") is True:
                await self._background(self.mw.background, ctx)
                return
            await self._run_inner(ctx)
        finally:
            metrics.INFLIGHT.dec()
            self._count(self.client.status)
            ledger = self.intake.ledger
            if ledger is not None:
                ledger.release_all()  # the request is over: nothing it charged is retained
                metrics.RETAINED_PEAK.observe(ledger.peak)
                metrics.RETAINED_UTILIZATION.observe(ledger.peak / ledger.limit)
            metrics.publish_resident_memory_after_request()
            if self.intake.reservation is not None:
                self.intake.reservation.close()

    async def _run_inner(self, ctx: RequestContext) -> None:
        """Run the inner app in this task under a `_Supervisor`, then settle how it ended: a
        stalled client, a client gone, the deadline or the drain, or what the app raised."""
        scope = {**self.scope, "loopwarden": ctx}
        watch = _Supervisor(self.mw, self.client, self.receive, self.started_at)
        failure = await watch.run(self.mw.app, scope, self._no_receive, self.client)
        if watch.stalled:
            self._stalled()
            await self._persist(ctx, None)
            return
        if watch.gone:
            outcomes.record_client_gone()
            await self._persist(ctx, None)
            return
        failure = watch.ended if watch.ended is not None else failure
        if failure is not None:
            await self._settle(failure, ctx)

    async def _background(self, background: BackgroundTasks, ctx: RequestContext) -> None:
        """Hand the admitted request to a background task (it takes the ledger and the
        reservation once its ``queued`` row is stored), then answer the client from it."""
        try:
            task = await background.launch(ctx, self.intake)
        except Exception as exc:
            await self._settle(exc, ctx)
            return
        await background.answer(task, self.client, self.receive)

    def _stalled(self) -> None:
        """The client stopped reading: nothing more is sent to it; count it (a disconnect and a
        ``client_write_timeout`` cap hit)."""
        self.client.stalled = True
        outcomes.record_client_gone(
            write_timeout=self.mw.client_write_timeout,
            owner=self.intake.owner,
            committed=self.client.committed,
        )

    async def _no_receive(self) -> Message:
        # The body has been consumed; the guard alone watches for http.disconnect.
        await asyncio.Event().wait()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _persist(self, ctx: RequestContext, outcome: outcomes.Outcome | None) -> None:
        """Store the request's true status through the loop's hook (best effort: a store that
        fails now must not stop the client's answer)."""
        persist = ctx.hooks.persist_failure
        if persist is None:
            return
        status, error = outcomes.stored_status(outcome)
        try:
            await asyncio.shield(persist(status, error))
        except Exception:
            log.exception("could not store the %s status of this response", status)

    def _remember(self, outcome: outcomes.Outcome) -> None:
        """Have the retry shield remember the answer to `outcome` when the table shields it and
        the whole body was read (best effort: never a second failure)."""
        shield = self.mw.shield
        if shield is None or not outcomes.shielded(outcome):
            return
        try:
            key = self.intake.shield_key()
            if key is None:
                return
            snapshot = self.client.current_snapshot() if outcome.committed else None
            status, headers, body = outcomes.shield_answer(outcome, snapshot, retry_after=self.mw.retry_after)
            answer = Remembered(
                status,
                headers,
                body,
                outcome.row,
                outcome.code,
                REQUEST_ID.get(),
                shield.clock(),
                caller=self.intake.shield_identity,
            )
            shield.remember(key, answer)
        except Exception:
            log.exception("the retry shield could not remember this failure")

    async def _settle(self, exc: Exception, ctx: RequestContext | None) -> None:
        """The one answer to `exc`: record it, store it, then answer it."""
        if self.client.finished:
            return
        exc = self.intake.explain(exc)  # a pool refusal the caller's share made says so
        after_tools = ctx is not None and ctx.hooks.tools_ran
        committed = self.client.committed
        try:
            # a limit the request lowered with its own header: the message says so
            field = _LOWERABLE.get(outcomes.OUTCOMES[outcomes.row_of(exc)].code or "")
            note = ""
            if field is not None and field in self.intake.lowered:
                header = next(name for name, f in LIMIT_HEADERS.items() if f == field).decode()
                note = f"(this request lowered {field} with its {header} header: send a larger value or none)"
            outcome = outcomes.resolve(exc, committed=committed, note=note, after_tools=after_tools)
        except Exception as defect:  # the table itself failed on this input: still one answer
            log.exception("could not resolve the outcome of %r", exc)
            outcome, field = outcomes.resolve(defect, committed=committed), None
        code_limit = getattr(ctx.limits, field) if ctx is not None and field is not None else None
        outcomes.record(outcome, owner=self.intake.owner, limit=code_limit)
        if ctx is not None:
            await self._persist(ctx, outcome)
        self._remember(outcome)
        try:
            # bounded like every write: the deadline or the drain may have fired because the
            # client stopped reading, and then this answer cannot be written either
            async with asyncio.timeout(self.mw.client_write_timeout) as bound:
                await self.client.fail(outcome, retry_after=self.mw.retry_after)
        except TimeoutError:
            if not bound.expired():
                return  # the transport's own (an OSError): the client is gone
            self._stalled()
        except OSError:
            pass


class _Supervisor:
    """Runs one request's inner app in the request's own task and ends it when it must.

    What ends it, as `_Guard` used to poll for it with two extra tasks per request: the
    whole-request deadline (``started_at + request_deadline``, `time.monotonic` seconds), the drain
    timeout (`DrainState`), a write to the client that has waited ``client_write_timeout`` seconds
    (``stalled``; the stream is marked before the app is cancelled, so no clean-up writes again),
    and the client's ``http.disconnect`` (``gone``). One timer handle (``loop.call_later``,
    re-armed at most every second, or sooner when the deadline, the drain or a blocked write is
    due) checks the rest, and at its first check, `WATCH_AFTER` seconds in, starts the one watcher
    task that reads ``receive``: a request over by then never needed it (most buffered requests
    to a fast upstream; a task costs a create, a cancel and an await), and a disconnect before it
    is noticed `WATCH_AFTER` seconds late at most (the server records it meanwhile; the watcher's
    first ``receive`` returns it at once). Either cancels the request's task; the
    `asyncio.CancelledError` is caught here and the task uncancelled, so the guard settles the
    outcome in the same task. A cancellation from outside (server shutdown) propagates.
    """

    #: Seconds into the request before the disconnect watcher starts (see the class docstring).
    WATCH_AFTER = 0.02

    __slots__ = (
        "_cancelled",
        "_client",
        "_deadline",
        "_loop",
        "_mw",
        "_receive",
        "_task",
        "_timer",
        "_watcher",
        "ended",
        "gone",
        "stalled",
    )

    def __init__(
        self, mw: BudgetMiddleware, client: ClientStream, receive: Receive, started_at: float
    ) -> None:
        self._mw = mw
        self._client = client
        self._receive = receive
        self._deadline = started_at + mw.request_deadline
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._cancelled = False  # this supervisor cancelled the task (not yet uncancelled)
        self.ended: Exception | None = None  # the deadline or the drain ended the request
        self.gone = False  # the client disconnected first
        self.stalled = False  # the client stopped reading

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> Exception | None:
        """Run ``app(scope, receive, send)`` in this task; return what it raised (None when it
        returned, or when a reason above ended it: see ``ended``, ``gone``, ``stalled``)."""
        wake = self._due()
        if wake is None:  # over before the app ran (the deadline passed during the intake)
            return None
        task = self._task = asyncio.current_task()
        assert task is not None
        self._timer = self._loop.call_later(min(wake, self.WATCH_AFTER), self._fire)
        failure: Exception | None = None
        try:
            await app(scope, receive, send)
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
            self._cancelled = False
            if task.uncancel() > 0:
                raise  # cancelled from outside as well
        except Exception as exc:
            failure = exc
        finally:
            if self._timer is not None:
                self._timer.cancel()
            if self._watcher is not None:
                self._watcher.cancel()
                # awaited: a receive's own clean-up runs before the request ends (a WebSocket
                # turn's keeps a message that arrived meanwhile for the next turn, in order)
                with contextlib.suppress(asyncio.CancelledError):
                    await self._watcher
        if self._cancelled:  # the app swallowed the cancellation: undo it all the same
            task.uncancel()
        return failure

    def _due(self) -> float | None:
        """Seconds until the next check, or None when the request must end now (``ended`` or
        ``stalled`` is set)."""
        now = time.monotonic()
        mw = self._mw
        drain_at = mw.drain.deadline if mw.drain.draining else None
        if drain_at is not None and now >= drain_at:
            self.ended = ShuttingDown(
                "the gateway is shutting down and this request did not finish within the drain timeout "
                "(--drain-timeout); retry it",
                refused=False,
            )
            return None
        if now >= self._deadline:
            self.ended = DeadlineExceeded(
                f"the request did not finish within {mw.request_deadline:g} s (--request-deadline); "
                "ask for less work (fewer rounds, shorter answers) or raise the deadline",
                seconds=mw.request_deadline,
            )
            return None
        write_timeout = mw.client_write_timeout
        blocked = self._client.write_blocked_for()
        if blocked >= write_timeout:
            # the client stopped reading: this write made no progress. Marked before the work is
            # cancelled, so that no clean-up of it writes (and waits) again
            self.stalled = self._client.stalled = True
            return None
        wake = min(self._deadline, drain_at if drain_at is not None else self._deadline) - now
        if blocked:
            wake = min(wake, write_timeout - blocked)
        return min(max(wake, 0.0), 1.0, write_timeout)

    def _fire(self) -> None:
        """The timer: end the request, or re-arm for the next check (the first check starts the
        disconnect watcher)."""
        self._timer = None
        if self._watcher is None:
            self._watcher = self._loop.create_task(self._watch())
        wake = self._due()
        if wake is None:
            self._cancel()
        else:
            self._timer = self._loop.call_later(wake, self._fire)

    async def _watch(self) -> None:
        """Read ``receive`` until ``http.disconnect`` (or a failing ``receive``): the client is gone."""
        with contextlib.suppress(Exception):
            while (await self._receive())["type"] != "http.disconnect":
                pass
        if self.ended is None and not self.stalled:
            self.gone = True
            self._cancel()

    def _cancel(self) -> None:
        if not self._cancelled and self._task is not None:
            self._cancelled = True
            self._task.cancel()
