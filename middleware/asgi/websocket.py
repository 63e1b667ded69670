"""WebSocket mode of ``/v1/responses`` (Open Responses, "WebSocket Transport"; OpenAI's WebSocket mode).

``GET /v1/responses`` with a WebSocket upgrade opens a persistent connection; each turn is one
``response.create`` text message (the create-request body minus the HTTP-only fields) and is
answered with the same streaming event objects as SSE — same order, ``sequence_number`` and
terminal events — one WebSocket text message per event.

**Built on the HTTP path, not beside it.** Every turn runs through `BudgetMiddleware.serve_turn`
as a ``POST /v1/responses`` would: a synthetic HTTP scope (the upgrade's headers, so the API key
and the ``loopwarden-max-*`` headers apply), the message bytes as the body (the body clamp, the
ledger charge before parsing, the strict parse, the caller's pool share, admission, the
deadline, the drain, the write bound), `middleware.asgi.wsturn` for the WebSocket rules, the
agent loop, the store and the outcome table. The only new writer is `WebSocketStream`, the
`ClientStream` of a turn: the SSE frames the stitcher produces become WebSocket messages (the
``data:`` payload of each, byte for byte; comments and ``[DONE]`` dropped), and failures become
the spec's JSON ``error`` envelope with ``status`` (and, after the first event, the
``response.failed`` that follows it on SSE too).

**One turn at a time** (a spec MUST): the connection reads the next message only when the turn
in flight has ended; while it runs, at most one further message is held (uvicorn pauses reading
until it is taken), and a disconnect ends the turn as a client gone.

**Connection bounds and close codes**: the API key (1008 after a 401 envelope), the drain (1001
after ``server_shutting_down``) and admission (1013 after ``server_overloaded`` when the pool is
saturated) are checked at the upgrade; ``--websocket-max-lifetime`` (1001 after
``websocket_connection_limit_reached``; a turn in flight then finishes first, bounded by its own
deadline), ``--websocket-idle-timeout`` between turns (1001 after ``websocket_idle_timeout``), a
message over the body clamp (1009 after ``request_too_large``; uvicorn itself closes 1009 on one
over ``ws_max_size``, which `uvicorn_websocket_options` sets to the server's clamp), a client
that stops reading (the turn's write bound ends it and the transport's bounded close aborts the
socket), and the connection counts toward ``--max-connections`` (uvicorn's connection set).
A failed turn leaves the connection open; its continuation id is evicted from connection memory
(`middleware.loop.memory`).

Metrics: ``loopwarden_websocket_connections``, ``loopwarden_websocket_turns_total{outcome}``, and
every cap hit of a connection or its turns with ``transport="websocket"`` (`metrics.TRANSPORT`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Final

from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from budget import ChargeModel, Ledger, Limits
from middleware import outcomes
from middleware.asgi.auth import Authenticator
from middleware.asgi.client_stream import ClientStream
from middleware.asgi.guard import BudgetMiddleware
from middleware.asgi.intake import effective_limits
from middleware.asgi.wsturn import SCOPE_KEY, WebSocketTurn
from middleware.config import Settings
from middleware.errors import (
    Failure,
    Overloaded,
    ShuttingDown,
    Unauthenticated,
    WebSocketIdle,
    WebSocketLifetimeReached,
    WebSocketMessageTooLarge,
)
from middleware.loop.memory import ConnectionMemory
from middleware.ops import metrics
from middleware.ops.admission import DRAIN, DrainState, ProcessPool, RequestReservation
from middleware.ops.request_id import REQUEST_ID, request_id_of
from middleware.upstream.reader import TERMINAL_EVENTS

log = logging.getLogger("loopwarden")

#: Close codes (RFC 6455 §7.4.1): going away (lifetime, idle, drain), policy violation (the API
#: key), message too big, try again later (overload).
CLOSE_GOING_AWAY: Final = 1001
CLOSE_POLICY: Final = 1008
CLOSE_TOO_BIG: Final = 1009
CLOSE_TRY_LATER: Final = 1013
#: Seconds between two checks of the drain and the lifetime while waiting for a message.
TICK: Final = 1.0
#: The terminal event type -> ``loopwarden_websocket_turns_total`` outcome.
_TURN_OUTCOMES: Final = {
    "response.completed": "completed",
    "response.incomplete": "incomplete",
    "response.failed": "failed",
}


def websocket_max_size(settings: Settings) -> int:
    """The largest WebSocket message any turn can send (bytes): the body clamp of the most
    permissive configured charge model at ``max_retained_bytes`` (lowering headers and model
    routes only lower it; `WebSocketResponses` checks the turn's own)."""
    names = {settings.loop.charge_model} | {r.charge_model for r in settings.model_routes if r.charge_model}
    model = ChargeModel.named("measured" if "measured" in names else "reference")
    return model.body_clamp(settings.loop.max_retained_bytes)


def uvicorn_websocket_options(settings: Settings) -> dict[str, Any]:
    """The ``uvicorn.Config`` keywords of WebSocket mode: ``ws`` (`DrainingWebSocketProtocol`, the
    sans-I/O implementation both HTTP stacks hand upgrades to, by import path: picklable for
    ``--workers``), ``ws_max_size`` (bytes, `websocket_max_size`: uvicorn closes 1009 past it
    before the message is buffered)."""
    return {
        "ws": "middleware.asgi.websocket:DrainingWebSocketProtocol",
        "ws_max_size": websocket_max_size(settings),
    }


class DrainingWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, except that at shutdown during a drain an open
    connection is left to the app: it closes 1001 once its turn in flight has ended (within the
    drain timeout), where uvicorn would close 1012 at once and cut the turn."""

    def shutdown(self) -> None:
        if DRAIN.draining and self.handshake_complete and not self.close_sent and not self.disconnected:
            return
        super().shutdown()


@dataclasses.dataclass(frozen=True, kw_only=True)
class WebSocketConfig:
    """What every connection of one gateway shares. ``max_lifetime``, ``idle_timeout``,
    ``write_timeout``, ``keepalive_interval``, ``retry_after``: seconds. ``limits``: the
    server's. ``charge_model``: the server's (the connection ledger's prices)."""

    limits: Limits
    authenticator: Authenticator
    pool: ProcessPool
    charge_model: ChargeModel
    max_lifetime: float = 3600.0
    idle_timeout: float = 300.0
    write_timeout: float = 30.0
    keepalive_interval: float = 15.0
    retry_after: float = 1.0
    drain: DrainState = DRAIN


class WebSocketResponses:
    """The pure ASGI app of the ``websocket`` scope at ``/v1/responses`` (module docstring).
    ``responses``: the guard around the Responses app (the HTTP route's own instance)."""

    def __init__(self, responses: BudgetMiddleware, config: WebSocketConfig) -> None:
        self.responses = responses
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":  # pragma: no cover - routed for websocket scopes only
            return
        token = metrics.TRANSPORT.set("websocket")
        metrics.WEBSOCKET_CONNECTIONS.inc()
        try:
            await _Connection(self, scope, receive, send).run()
        finally:
            metrics.WEBSOCKET_CONNECTIONS.dec()
            metrics.TRANSPORT.reset(token)


class WebSocketStream(ClientStream):
    """The `ClientStream` of one WebSocket turn: what the guard and the loop write as SSE goes
    out as WebSocket text messages (one per event: the frame's ``data:`` payload as it is);
    keep-alive comments and ``data: [DONE]`` are dropped (WebSocket pings keep the connection
    alive); an ``error`` event gets the failure's ``status``; an answer before commit (an error
    envelope) becomes the spec's ``{"type": "error", "status", "error"}``. A send to a connection
    that is gone is dropped (as uvicorn drops HTTP sends) and sets ``gone``.

    ``ws_send``: the connection's ASGI send. ``terminal``: the terminal event type sent, if any;
    ``failure``: the outcome answered, if any; ``error_status``: the status of the error sent.
    """

    def __init__(
        self,
        ws_send: Send,
        *,
        keepalive_interval: float,
        on_final: Callable[[int], None],
        gone: asyncio.Event,
    ) -> None:
        super().__init__(self._translate, keepalive_interval=keepalive_interval, on_final=on_final)
        self._ws_send = ws_send
        self._json = False
        self._answer = b""
        self.gone = gone
        self.terminal: str | None = None
        self.failure: outcomes.Outcome | None = None
        self.error_status: int | None = None

    async def fail(self, outcome: outcomes.Outcome, *, retry_after: float = 1.0) -> None:
        """As `ClientStream.fail`, remembering `outcome` (its status goes into the ``error`` event)."""
        self.failure = outcome
        await super().fail(outcome, retry_after=retry_after)

    async def _translate(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = dict(message.get("headers", []))
            self._json = not headers.get(b"content-type", b"").startswith(b"text/event-stream")
            return
        if kind != "http.response.body":
            return
        body = message.get("body", b"")
        if self._json:
            self._answer += body
            if not message.get("more_body", False):
                await self._answer_json(self.status, self._answer)
            return
        for frame in body.split(b"\n\n"):
            event, data = _frame(frame)
            if data is None or data == b"[DONE]":
                continue
            if event == "error":
                data = self._error_event(json.loads(data))
            elif event in TERMINAL_EVENTS:
                self.terminal = event
            await self._emit(data)

    async def _emit(self, data: bytes) -> None:
        if self.gone.is_set():
            return
        try:
            await self._ws_send({"type": "websocket.send", "text": data.decode()})
        except OSError:  # uvicorn's ClientDisconnected: the connection is gone
            self.gone.set()

    def _error_event(self, event: dict[str, Any]) -> bytes:
        status = self.failure.status if self.failure is not None else 500
        self.error_status = status
        return _dumps({"type": "error", "status": status, **{k: v for k, v in event.items() if k != "type"}})

    async def _answer_json(self, status: int, body: bytes) -> None:
        """A whole JSON answer: an error envelope (before commit), or a response object."""
        obj = json.loads(body)
        if status >= 400 and isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            self.error_status = status
            await self._emit(_dumps(error_envelope(status, obj["error"])))
            return
        kind = "response.incomplete" if obj.get("status") == "incomplete" else "response.completed"
        self.terminal = kind
        await self._emit(_dumps({"type": kind, "sequence_number": self.next_sequence, "response": obj}))


def error_envelope(status: int, error: dict[str, Any]) -> dict[str, Any]:
    """The spec's WebSocket error envelope for an OpenAI ``error`` object: ``type``, ``status``
    (the HTTP status the outcome table gives), the ``error`` object, and its ``code``, ``message``
    and ``param`` flat too (the SDKs' ``ResponseErrorEvent``)."""
    return {
        "type": "error",
        "status": status,
        "code": error.get("code"),
        "message": error.get("message"),
        "param": error.get("param"),
        "error": error,
    }


def _frame(frame: bytes) -> tuple[str, bytes | None]:
    """(event name, data payload) of one SSE frame; None data for a comment or an empty frame.
    Multi-line data (`middleware.upstream.sse.encode_event`) is joined with newlines, as SSE
    clients read it."""
    event, data = "message", []
    for line in frame.split(b"\n"):
        if line.startswith(b"event: "):
            event = line[7:].decode()
        elif line.startswith(b"data: "):
            data.append(line[6:])
    return event, b"\n".join(data) if data else None


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=str).encode()


class _Connection:
    """Per-connection responder of `WebSocketResponses` (its state lives here, not on the app)."""

    def __init__(self, app: WebSocketResponses, scope: Scope, receive: Receive, send: Send) -> None:
        self.app = app
        self.config = app.config
        self.scope = scope
        self.receive = receive
        self.send = send
        self.opened = time.monotonic()
        self.owner = ""
        self.limits = self.config.limits
        self.reservation: RequestReservation | None = None
        self.memory: ConnectionMemory | None = None
        self.pending: Message | None = None  # a message received while a turn ran
        self.pending_held = 0  # pool bytes drawn for it (`_hold_pending`)
        self.refused: Failure | None = None  # a message the pool could not hold: close after the turn
        self.caller = ""
        self.gone = asyncio.Event()

    async def run(self) -> None:
        message = await self.receive()
        if message["type"] != "websocket.connect":
            return
        rid = request_id_of(self.scope)  # the connection's: its refusals and closes carry it
        token = REQUEST_ID.set(rid)
        try:
            refusal = self._refusal()
            await self.send({"type": "websocket.accept", "headers": [(b"x-request-id", rid.encode())]})
            if refusal is not None:
                await self._close_with(*refusal)
                return
            await self._run_accepted()
        finally:
            REQUEST_ID.reset(token)

    async def _run_accepted(self) -> None:
        caller = self.caller = self.config.authenticator.caller(self.scope, self.owner)
        self.reservation = self.config.pool.connection_share(caller=caller)
        ledger = Ledger(self.limits.max_retained_bytes, self.config.charge_model, pool=self.reservation)
        self.memory = ConnectionMemory(ledger)
        try:
            await self._serve()
        finally:
            self._release_pending()
            self.memory.forget()
            ledger.release_all()
            self.reservation.close()

    def _refusal(self) -> tuple[Failure, int] | None:
        """Why the upgrade is refused (the failure and the close code), checked before accepting
        anything: the API key, the drain, the pool."""
        try:
            self.owner = self.config.authenticator.owner(self.scope)
        except Unauthenticated as exc:
            return exc, CLOSE_POLICY
        with contextlib.suppress(Failure):  # else every turn answers the header's 400 (the intake)
            self.limits, _ = effective_limits(self.config.limits, self.scope.get("headers", []))
        if self.config.drain.draining:
            return ShuttingDown("the gateway is shutting down; connect to another instance", refused=True), (
                CLOSE_GOING_AWAY
            )
        if self.config.pool.saturated:
            return Overloaded(
                "the gateway is overloaded (its process pool, request slots or memory): retry the "
                f"connection after {self.config.retry_after:g} s"
            ), CLOSE_TRY_LATER
        return None

    async def _serve(self) -> None:
        """The turns, one at a time, until the connection ends."""
        clamp = self.app.responses.intake.permissive_model.body_clamp(self.limits.max_retained_bytes)
        while True:
            if self.refused is not None:
                await self._close_with(self.refused, CLOSE_TRY_LATER)
                return
            message = self.pending or await self._next_message()
            self.pending = None
            if message is None:
                return
            data = message.get("text")
            raw = data.encode() if isinstance(data, str) else message.get("bytes") or b""
            self._release_pending()  # from here the turn's own intake charges it
            ending = self._ending()
            if ending is not None:
                await self._close_with(*ending)
                return
            if len(raw) > clamp:
                await self._close_with(_too_large(len(raw), clamp, self.limits), CLOSE_TOO_BIG)
                return
            del message, data
            await self._turn(raw)
            del raw
            if self.gone.is_set():
                return
            if self.config.drain.draining:
                await self._close_with(*self._ending_drain())
                return

    def _ending(self) -> tuple[Failure, int] | None:
        """The lifetime or the drain, when either ends the connection before its next turn."""
        age = time.monotonic() - self.opened
        if age >= self.config.max_lifetime:
            return WebSocketLifetimeReached(
                f"Responses WebSocket connection limit reached ({self.config.max_lifetime:g} s, "
                "--websocket-max-lifetime): open a new WebSocket connection to continue (store: true "
                "responses continue with previous_response_id; store: false ones need the full input)",
                seconds=self.config.max_lifetime,
            ), CLOSE_GOING_AWAY
        if self.config.drain.draining:
            return self._ending_drain()
        return None

    def _ending_drain(self) -> tuple[Failure, int]:
        return ShuttingDown(
            "the gateway is shutting down: open a new WebSocket connection (to another instance) to continue",
            refused=True,
        ), CLOSE_GOING_AWAY

    async def _next_message(self) -> Message | None:
        """The next ``websocket.receive`` message; None once the client has gone. Raises nothing:
        the idle timeout, the lifetime and the drain end the connection here (closed)."""
        task = asyncio.ensure_future(self.receive())
        idle_since = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                ending = self._ending()
                if ending is None and now - idle_since >= self.config.idle_timeout:
                    ending = (
                        WebSocketIdle(
                            f"no message within {self.config.idle_timeout:g} s (--websocket-idle-timeout) "
                            "between turns: the connection is closed; open a new one when there is work",
                            seconds=self.config.idle_timeout,
                        ),
                        CLOSE_GOING_AWAY,
                    )
                if ending is not None:
                    task.cancel()
                    await self._close_with(*ending)
                    return None
                wake = min(
                    TICK,
                    self.config.idle_timeout - (now - idle_since),
                    self.config.max_lifetime - (now - self.opened),
                )
                done, _ = await asyncio.wait({task}, timeout=max(wake, 0.0))
                if done:
                    message = task.result()
                    if message["type"] == "websocket.receive":
                        return message
                    self._disconnected(message)
                    return None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _disconnected(self, message: Message) -> None:
        """The client went (or uvicorn closed it: 1009 is a message over ``ws_max_size``)."""
        self.gone.set()
        if message.get("code") == CLOSE_TOO_BIG:
            metrics.cap_hit("websocket_message_size", "413")
            log.warning(
                "outcome row=websocket_message_too_large status=413 code=request_too_large committed=False "
                "cap=websocket_message_size caller=%s (closed by uvicorn: over ws_max_size)",
                self.owner[:12] or "-",
            )

    async def _turn(self, raw: bytes) -> None:
        """One turn through the guard (`BudgetMiddleware.serve_turn`); its metrics and eviction."""
        assert self.memory is not None
        turn = WebSocketTurn(self.memory)
        self.memory.referenced = None
        stream: list[WebSocketStream] = []

        def make_stream(on_final: Callable[[int], None]) -> ClientStream:
            made = WebSocketStream(
                self.send,
                keepalive_interval=self.config.keepalive_interval,
                on_final=on_final,
                gone=self.gone,
            )
            stream.append(made)
            return made

        token = REQUEST_ID.set("req_" + secrets.token_hex(16))
        try:
            await self.app.responses.serve_turn(
                self._turn_scope(turn, len(raw)), self._turn_receive(raw), make_stream
            )
        finally:
            REQUEST_ID.reset(token)
        client = stream[0]
        if client.error_status is not None:
            outcome = "failed"
        elif client.terminal is not None:
            outcome = _TURN_OUTCOMES.get(client.terminal, "failed")
        else:
            outcome = "cancelled"  # the client went away or stopped reading: nothing terminal was sent
        metrics.WEBSOCKET_TURNS.labels(outcome=outcome).inc()
        if client.stalled:
            self.gone.set()  # the client stopped reading: nothing more is sent; uvicorn closes the socket
        if client.error_status is not None and client.error_status >= 400:
            # Open Responses: a continuation turn that fails with a 4xx or 5xx evicts the id it
            # continued from; a message that failed before it could be parsed names none we know
            self.memory.evict(self.memory.referenced if turn.parsed else None)

    def _turn_scope(self, turn: WebSocketTurn, size: int) -> Scope:
        headers = [(k, v) for k, v in self.scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(size).encode()))
        return {
            "type": "http",
            "asgi": self.scope.get("asgi", {"version": "3.0"}),
            "http_version": "1.1",
            "method": "POST",
            "scheme": "https" if self.scope.get("scheme") == "wss" else "http",
            "path": "/v1/responses",
            "raw_path": b"/v1/responses",
            "root_path": self.scope.get("root_path", ""),
            "query_string": b"",
            "headers": headers,
            "client": self.scope.get("client"),
            "server": self.scope.get("server"),
            "state": self.scope.get("state", {}),
            SCOPE_KEY: turn,
        }

    def _turn_receive(self, raw: bytes) -> Receive:
        """The turn's ``receive``: the message as the body, then ``http.disconnect`` once the
        connection is gone. A message that arrives meanwhile is held (`pending`) for the next
        turn; after it nothing more is read until the turn ends (uvicorn pauses reading)."""
        body: list[bytes] = [raw]

        async def receive() -> Message:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            while True:
                if self.pending is not None or self.refused is not None or self.gone.is_set():
                    await self.gone.wait()
                    return {"type": "http.disconnect"}
                reading = asyncio.ensure_future(self.receive())
                closed = asyncio.ensure_future(self.gone.wait())
                try:
                    await asyncio.wait({reading, closed}, return_when=asyncio.FIRST_COMPLETED)
                finally:  # also when the guard cancels this watcher: a message read is never lost
                    for task in (reading, closed):
                        if not task.done():
                            task.cancel()
                    if reading.done() and not reading.cancelled() and reading.exception() is None:
                        message = reading.result()
                        if message["type"] == "websocket.receive":
                            self._hold_pending(message)
                        else:
                            self._disconnected(message)

        return receive

    def _hold_pending(self, message: Message) -> None:
        """Keep a message that arrived while a turn runs for the next turn, its memory drawn from
        the pool under the connection's caller: the message (at the widest text width, 4 bytes a
        character) plus one more of ``ws_max_size`` that uvicorn may read into its own queue
        meanwhile. When the pool (or the caller's share) has no room, the message is dropped and
        the connection closes 1013 once the turn in flight has ended."""
        data = message.get("text")
        size = 4 * len(data) if isinstance(data, str) else len(message.get("bytes") or b"")
        cost = size + self.app.responses.intake.permissive_model.body_clamp(
            self.config.limits.max_retained_bytes
        )
        refused = self.config.pool.draw(cost, caller=self.caller)
        if refused is None:
            self.pending, self.pending_held = message, cost
            return
        self.refused = Overloaded(
            f"a message sent while a turn ran would need {cost} budget bytes held until its turn, and the "
            f"process pool has no room ({refused}); send the next response.create after the current turn's "
            f"terminal event, and reconnect after {self.config.retry_after:g} s"
        )

    def _release_pending(self) -> None:
        if self.pending_held:
            self.config.pool.give(self.pending_held, caller=self.caller)
            self.pending_held = 0

    async def _close_with(self, failure: Failure, code: int) -> None:
        """Answer ``failure`` (the outcome table: counted, logged) with the WebSocket error
        envelope, then close with ``code``; bounded by ``--client-write-timeout``."""
        outcome = outcomes.resolve(failure)
        outcomes.record(outcome, owner=self.owner)
        envelope = error_envelope(outcome.status, outcomes.envelope(outcome)["error"])
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(self.config.write_timeout):
                await self.send({"type": "websocket.send", "text": _dumps(envelope).decode()})
                await self.send({"type": "websocket.close", "code": code, "reason": outcome.code[:100]})


def _too_large(size: int, clamp: int, limits: Limits) -> WebSocketMessageTooLarge:
    return WebSocketMessageTooLarge(
        f"the WebSocket message is {size} bytes, over the {clamp}-byte clamp (the largest create body "
        f"max_retained_bytes={limits.max_retained_bytes} admits): send less (continue with "
        "previous_response_id and only the new items), or raise max_retained_bytes",
        param="input",
        size=size,
        clamp=clamp,
    )
