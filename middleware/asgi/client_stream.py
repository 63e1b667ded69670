"""Coalescing of the SSE frames sent to the client: one ASGI message per upstream read.

The stream paths (`middleware.loop.app`, `middleware.loop.agent`) hand every client event to an
`Outbox` instead of the ASGI ``send``. Body frames sent with ``more_body=True`` are buffered and go
out together, as one ``http.response.body`` message (one write, one syscall), when the gateway is
about to wait — for more upstream bytes, an upstream call, a tool call — or when ``flush_bytes``
are buffered; the final message carries whatever is buffered. The stream's first frame is sent
at once (the client's time to first event does not wait for the rest of its upstream read). Everything else
(``http.response.start``, bodies without ``more_body``) flushes what is buffered and passes straight
through, so the response is committed (``RequestContext.committed``) exactly when it was before.

What is buffered is at most ``flush_bytes`` plus one frame (by default 64 KiB plus one event: the
same order as one socket read, and less than the ASGI server's own write buffer). It is not
charged to the request's ledger: every frame was charged as it was parsed, and the buffer is
bounded per request by a constant. Whatever ends the request while frames are buffered (a raise,
the deadline, the drain), the middleware flushes them (``RequestContext.outbox``) before it writes
its error frame, so the client sees the events that preceded the failure, in order.

`last_sent` is the event-loop time of the last write to the client (or of the Outbox's creation):
keep-alives are due a keep-alive interval after it, whatever the upstream sends meanwhile.
"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Send

from middleware.upstream.sse import KEEPALIVE

FLUSH_BYTES = 64 * 1024  # buffered frame bytes that trigger a flush without waiting


class Outbox:
    """An ASGI ``send`` that coalesces SSE body frames (see the module docstring).

    ``await outbox(message)`` has the signature of ASGI ``send``; ``await outbox.flush()`` sends
    what is buffered now. Raises whatever the wrapped ``send`` raises.
    """

    __slots__ = ("_first", "_frames", "_loop", "_send", "_sent_at", "_size", "_started", "flush_bytes")

    def __init__(self, send: Send, *, flush_bytes: int = FLUSH_BYTES) -> None:
        self._loop = asyncio.get_running_loop()
        self._sent_at = self._loop.time()
        self._send = send
        self._frames: list[bytes] = []
        self._size = 0
        self._first = True  # the stream's first frame goes out at once (time to first event)
        self._started = False  # http.response.start went out (the response is committed)
        self.flush_bytes = flush_bytes

    def last_sent(self) -> float:
        """Event-loop time (seconds) of the last write to the client, or of the Outbox's creation."""
        return self._sent_at

    async def _write(self, message: Message) -> None:
        self._sent_at = self._loop.time()
        await self._send(message)

    async def keepalive(self) -> None:
        """Send what is buffered and a ``: keep-alive`` comment now, if the response is committed
        (before that there is no stream to keep alive: nothing is sent)."""
        if self._started:
            self._frames.append(KEEPALIVE)
            self._size += len(KEEPALIVE)
            await self.flush()

    @property
    def pending(self) -> int:
        """Bytes buffered and not yet sent."""
        return self._size

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.body":
            body = message.get("body", b"")
            if message.get("more_body", False):
                if body and self._first:
                    self._first = False
                    await self._write(message)
                elif body:
                    self._frames.append(body)
                    self._size += len(body)
                    if self._size >= self.flush_bytes:
                        await self.flush()
                return
            if self._frames:  # the last message carries what is buffered
                self._frames.append(body)
                body = b"".join(self._frames)
                self._frames.clear()
                self._size = 0
                message = {"type": "http.response.body", "body": body, "more_body": False}
            await self._write(message)
            return
        await self.flush()
        if message["type"] == "http.response.start":
            self._started = True
        await self._write(message)

    async def flush(self) -> None:
        """Send every buffered frame as one ``http.response.body`` message (nothing if empty)."""
        if not self._frames:
            return
        body = self._frames[0] if len(self._frames) == 1 else b"".join(self._frames)
        self._frames.clear()
        self._size = 0
        await self._write({"type": "http.response.body", "body": body, "more_body": True})
