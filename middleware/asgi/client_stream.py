"""`ClientStream`: the one writer to a request's ASGI ``send`` (DESIGN.md §2, §5).

It holds the facts every layer used to keep a copy of: whether the response is **committed**
(``http.response.start`` went out), whether it is **finished** (the last body went out; later
writes are dropped), the HTTP status, and the next ``sequence_number``. Everything the client
receives goes through it:

* `answer_json` — a whole JSON answer (a success, or an error envelope before commit);
* `event` / `forward` — SSE events, renumbered from 0 across rounds; `forward` passes the
  upstream's bytes unchanged when nothing needs rewriting, `forward_run` a run of such frames in
  one message (the stream fast path); every frame carries ``event: <type>``;
* `end` — the end of a stream: ``data: [DONE]`` (Open Responses: the terminal event of every stream);
* `fail` — a failure: the `middleware.outcomes` envelope before commit, its frames after
  (``error``, ``response.failed`` with the response so far from ``snapshot``, ``data: [DONE]``);
* `keepalive` — a ``: keep-alive`` comment, only once committed.

**Coalescing.** Body frames are buffered and go out together, as one ``http.response.body``
message, when the gateway is about to wait (`flush`: before an upstream read, an upstream call, a
tool call, the store) or when ``flush_bytes`` are buffered; the stream's first frame goes out at
once (time to first event). What is buffered is at most ``flush_bytes`` plus one frame (64 KiB
plus one event by default): bounded per request by a constant, and not charged to the ledger
(every frame was charged as it was parsed). Whatever ends a request while frames are buffered,
`fail` sends them first, so the client sees the events that preceded the failure, in order.

`last_sent()` is the event-loop time of the last write (or of creation): keep-alives are due
``keepalive_interval`` seconds after it, whatever the upstream sends meanwhile.

**Stalled clients.** `write_blocked_for()` is how long the write in progress has been waiting (0
when none is): under uvicorn a ``send`` waits only in flow control, while the transport's buffer
is above its high-water mark, and returns as soon as the client has read it down to the low-water
mark — a write that returns is progress. The guard (`middleware.asgi.guard`) ends a request whose
write has waited ``--client-write-timeout`` and marks the stream ``stalled``: from then on nothing
is sent (`fail` answers nothing; any other write raises `ClientStalled`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.types import Message, Send

from middleware import outcomes
from middleware.ops.request_id import REQUEST_ID
from middleware.upstream.reader import dumps_checked
from middleware.upstream.sse import KEEPALIVE, encode_event

FLUSH_BYTES = 64 * 1024  # buffered frame bytes that trigger a flush without waiting
SSE_HEADERS = outcomes.SSE_HEADERS
DONE = b"data: [DONE]\n\n"


class ClientStalled(Exception):
    """A write to a client that stopped reading: the stream was marked ``stalled`` (a write made
    no progress for ``--client-write-timeout``) and nothing more is sent to it."""


class ClientStream:
    """The one writer to ``send`` for one request (see the module docstring).

    ``send``: the ASGI send. ``keepalive_interval``: seconds of client silence before a
    keep-alive comment is due. ``on_final(status)``: called once, just before the last body
    message goes out (the request is counted before a client can see its end).
    ``await stream(message)`` is an ASGI ``send`` too (coalescing ``more_body`` frames).
    Raises whatever the wrapped ``send`` raises, and `ClientStalled` once ``stalled`` is set.
    """

    __slots__ = (
        "_blocked_at",
        "_first",
        "_frames",
        "_loop",
        "_on_final",
        "_send",
        "_sent_at",
        "_size",
        "committed",
        "finished",
        "flush_bytes",
        "keepalive_interval",
        "next_sequence",
        "snapshot",
        "stalled",
        "status",
    )

    def __init__(
        self,
        send: Send,
        *,
        keepalive_interval: float = 15.0,
        flush_bytes: int = FLUSH_BYTES,
        on_final: Callable[[int], None] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._sent_at = self._loop.time()
        self._blocked_at: float | None = None  # loop time the write in progress began
        self._send = send
        self._frames: list[bytes] = []
        self._size = 0
        self._first = True  # the stream's first frame goes out at once (time to first event)
        self._on_final = on_final
        self.flush_bytes = flush_bytes
        self.keepalive_interval = keepalive_interval
        self.committed = False  # http.response.start went out
        self.finished = False  # the last body message went out
        self.stalled = False  # the client stopped reading: nothing more is sent
        self.status = 0
        self.next_sequence = 0
        #: The response so far, for the ``response.failed`` event of a failure after commit
        #: (set by whoever streams: the stitcher or the pass-through).
        self.snapshot: Callable[[], dict[str, Any]] | None = None

    # -- low level ---------------------------------------------------------------------------
    def last_sent(self) -> float:
        """Event-loop time (seconds) of the last write to the client, or of creation."""
        return self._sent_at

    def write_blocked_for(self) -> float:
        """Seconds the write in progress has been waiting for the client (0.0 when none is)."""
        return 0.0 if self._blocked_at is None else self._loop.time() - self._blocked_at

    @property
    def pending(self) -> int:
        """Bytes buffered and not yet sent."""
        return self._size

    async def _write(self, message: Message) -> None:
        if self.finished:
            return
        if self.stalled:
            raise ClientStalled("the client stopped reading (--client-write-timeout); nothing more is sent")
        if message["type"] == "http.response.start":
            self.committed = True
            self.status = message["status"]
            rid = REQUEST_ID.get()
            if rid != "-":  # the request's id on every answer (RequestIdMiddleware keeps one)
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())],
                }
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
            if self._on_final is not None:
                self._on_final(self.status)
        self._sent_at = self._blocked_at = self._loop.time()
        try:
            await self._send(message)
        finally:
            self._blocked_at = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.body":
            body = message.get("body", b"")
            if message.get("more_body", False):
                if body:
                    await self._frame(body)
                return
            if self._frames:  # the last message carries what is buffered
                self._frames.append(body)
                body = b"".join(self._frames)
                self._frames.clear()
                self._size = 0
                message = {"type": "http.response.body", "body": body, "more_body": False}
            await self._write(message)
            return
        if self._frames:
            await self.flush()
        await self._write(message)

    async def _frame(self, body: bytes) -> None:
        """One non-empty ``more_body`` frame: the stream's first goes out at once, the others are
        buffered until `flush` (or ``flush_bytes``)."""
        if self._first:
            self._first = False
            await self._write({"type": "http.response.body", "body": body, "more_body": True})
            return
        self._frames.append(body)
        self._size += len(body)
        if self._size >= self.flush_bytes:
            await self.flush()

    async def flush(self) -> None:
        """Send every buffered frame as one ``http.response.body`` message (nothing if empty)."""
        if not self._frames:
            return
        body = self._frames[0] if len(self._frames) == 1 else b"".join(self._frames)
        self._frames.clear()
        self._size = 0
        await self._write({"type": "http.response.body", "body": body, "more_body": True})

    async def keepalive(self) -> None:
        """Send what is buffered and a ``: keep-alive`` comment now, if the response is committed
        (before that there is no stream to keep alive: nothing is sent)."""
        if self.committed and not self.finished:
            self._frames.append(KEEPALIVE)
            self._size += len(KEEPALIVE)
            await self.flush()

    # -- answers -----------------------------------------------------------------------------
    async def answer_json(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        """A whole JSON answer: `status`, `body` bytes (content type and length added)."""
        head = headers or [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if self._frames:  # not once committed: a JSON answer is the whole response
            await self.flush()
        await self._write({"type": "http.response.start", "status": status, "headers": head})
        await self._write({"type": "http.response.body", "body": body})

    async def start_stream(self) -> None:
        """Commit the response as a 200 SSE stream (once)."""
        if not self.committed:
            await self({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)})

    async def event(self, event_type: str, obj: dict[str, Any]) -> None:
        """One SSE event: `obj` gets the next ``sequence_number`` and is encoded as ``event_type``."""
        if not self.committed:
            await self.start_stream()
        obj["sequence_number"] = self.next_sequence
        self.next_sequence += 1
        data = dumps_checked(obj)  # what the upstream sent may not re-encode (1e999)
        await self._frame(encode_event(event_type, data))

    async def forward(
        self, event_type: str, data: bytes, obj: dict[str, Any], *, changed: bool = False
    ) -> None:
        """One upstream event: its bytes as they came when `obj` is unchanged and its
        ``sequence_number`` is already the next one (an ``int``; ``2.0`` / ``true`` are
        re-encoded), else `obj` re-encoded with the next number."""
        sequence = obj.get("sequence_number")
        if changed or type(sequence) is not int or sequence != self.next_sequence:
            await self.event(event_type, obj)
            return
        if not self.committed:
            await self.start_stream()
        self.next_sequence += 1
        await self._frame(encode_event(event_type, data))

    async def forward_run(self, frames: bytes, count: int) -> None:
        """`count` upstream frames as received, in one body message: whole ``event: T\ndata:
        D\n\n`` frames that `forward` would each have sent unchanged (their ``sequence_number``
        the next `count` ones; `middleware.upstream.fastpath` decides), so the client gets the same
        bytes."""
        if not self.committed:
            await self.start_stream()
        self.next_sequence += count
        await self._frame(frames)

    async def end(self) -> None:
        """End the stream: what is buffered, then ``data: [DONE]``, then the last message."""
        await self({"type": "http.response.body", "body": DONE, "more_body": False})

    def current_snapshot(self) -> dict[str, Any] | None:
        """The response so far (``snapshot``), or None when there is none or it cannot be built."""
        if self.snapshot is None:
            return None
        try:
            return self.snapshot()
        except Exception:  # the failure itself may have left the state half-built
            return None

    async def fail(self, outcome: outcomes.Outcome, *, retry_after: float = 1.0) -> None:
        """Answer `outcome` (`middleware.outcomes`): its envelope before commit, its frames after
        (buffered frames first). Nothing once the response is finished, or once the client
        stopped reading (``stalled``)."""
        if self.finished or self.stalled:
            return
        if not self.committed:
            status, headers, body = outcomes.render_json(outcome, retry_after=retry_after)
            await self.answer_json(status, body, headers)
            return
        frames = outcomes.render_stream(outcome, self.next_sequence, self.current_snapshot())
        self.next_sequence += 2
        await self({"type": "http.response.body", "body": frames, "more_body": False})
