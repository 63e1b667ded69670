"""The event log of a streamed background response, and the follower that streams it to a client.

`EventLog` keeps the SSE frames a streamed background response produced (the frames its
`ClientStream` wrote: ``sequence_number`` = the frame's position, 0..N), while it runs, in memory:
a window of at most ``limit`` bytes (the oldest frames are dropped first; the newest is always
kept, and so is every frame an attached reader has not sent yet), charged to the task's ledger as bytes kept (``Ledger.reserve``; released as frames leave
the window, and all of it when the task ends). Frames not yet copied to the store are handed out
by `EventLog.unsynced` (`middleware.loop.background` copies them on every heartbeat, so that
another worker or host can resume the stream from `middleware.store.background`).

`follow` streams a log to one client: the frames after ``starting_after`` (OpenAI's
``GET /v1/responses/{id}?stream=true&starting_after=N``: the events whose ``sequence_number`` is
greater than N), then the live ones, then ``data: [DONE]``. Its source is a `FrameSource`: the
in-memory log when the task runs on this worker, else the store (polled). A follower that falls
out of the window (the frames after N are gone) raises `EventGap` before anything is sent, or ends
its stream without ``[DONE]`` when it falls behind later.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from budget import Ledger
from middleware.asgi.client_stream import ClientStream

__all__ = ["TERMINAL_TYPES", "EventGap", "EventLog", "FrameSource", "PinnedReader", "follow", "frame_type"]

#: The ``event:`` names that end a stream.
TERMINAL_TYPES = frozenset({b"response.completed", b"response.failed", b"response.incomplete"})
_DONE = b"data: [DONE]"
log = logging.getLogger("loopwarden")


class EventGap(Exception):
    """The frames after ``after`` are no longer kept (the window moved past them, or the log was
    dropped after its retention); ``first`` is the oldest kept ``seq`` (None: nothing kept)."""

    def __init__(self, after: int, first: int | None) -> None:
        super().__init__(f"events after {after} are no longer kept (oldest kept: {first})")
        self.after = after
        self.first = first


def frame_type(frame: bytes) -> bytes:
    """The ``event:`` name of one SSE frame (b"" when it has none)."""
    head = frame.split(b"\n", 1)[0]
    return head[len(b"event: ") :].strip() if head.startswith(b"event:") else b""


class EventLog:
    """The frames of one streamed background response (see the module docstring).

    ``limit``: bytes the window may keep (the newest frame is kept whatever its size).
    ``ledger``: the task's ledger, charged ``len(frame)`` per kept frame while ``charging``
    (raises `budget.BudgetExceeded` from `feed` when a frame does not fit).
    """

    def __init__(self, limit: int, ledger: Ledger | None) -> None:
        self.limit = limit
        self.ledger = ledger
        self.charging = ledger is not None
        self.frames: collections.deque[tuple[int, bytes]] = collections.deque()
        self.size = 0  # bytes in the window
        self.charged = 0  # bytes of the window charged to the ledger
        self.next_seq = 0
        self.done = False
        self._unsynced: list[tuple[int, bytes]] = []
        self._changed = asyncio.Event()
        self._pins: dict[PinnedReader, int] = {}  # attached reader -> the last seq it sent

    @property
    def first(self) -> int:
        """The oldest kept ``seq`` (`next_seq` when empty)."""
        return self.frames[0][0] if self.frames else self.next_seq

    def feed(self, body: bytes) -> None:
        """What the task's `ClientStream` wrote: whole SSE frames; keep-alive comments are
        skipped, ``data: [DONE]`` closes the log."""
        for part in body.split(b"\n\n"):
            if not part or part.startswith(b":"):
                continue
            if part == _DONE:
                self.close()
                continue
            self._append(part + b"\n\n")

    def _append(self, frame: bytes) -> None:
        size = len(frame)
        if self.charging and self.ledger is not None:
            self.ledger.reserve(size)
            self.charged += size
        self.frames.append((self.next_seq, frame))
        self._unsynced.append((self.next_seq, frame))
        self.next_seq += 1
        self.size += size
        self._evict()
        self._wake()

    def _evict(self) -> None:
        """Drop the oldest frames while the window is over ``limit`` — but never one an attached
        reader (`reader`) has not sent yet: those stay, charged to the ledger, which bounds them."""
        read = min(self._pins.values(), default=self.next_seq)
        while self.size > self.limit and len(self.frames) > 1 and self.frames[0][0] <= read:
            _, old = self.frames.popleft()
            self.size -= len(old)
            self._uncharge(len(old))

    async def last_frame(self) -> tuple[int, bytes] | None:
        """The newest ``(seq, frame)`` of the log (None: it holds none)."""
        return self.frames[-1] if self.frames else None

    def reader(self) -> PinnedReader:
        """A `FrameSource` over this log that keeps the frames it has not sent yet (close it)."""
        return PinnedReader(self)

    def _uncharge(self, size: int) -> None:
        give = min(size, self.charged)
        if give and self.ledger is not None:
            self.ledger.release(give)
        self.charged -= give

    def close(self) -> None:
        """No more frames (the stream ended, or the task did)."""
        self.done = True
        self._wake()

    def forget_charges(self) -> None:
        """The ledger was released as a whole (the task ended): nothing here is charged now."""
        self.charging = False
        self.charged = 0

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def unsynced(self) -> tuple[list[tuple[int, bytes]], int]:
        """The frames not yet handed out, still in the window, and the window's oldest ``seq``."""
        frames, self._unsynced = self._unsynced, []
        first = self.first
        return [f for f in frames if f[0] >= first], first

    async def frames_after(self, after: int, wait: float) -> tuple[list[tuple[int, bytes]], bool]:
        """The frames with ``seq`` > ``after`` (waiting up to ``wait`` seconds for one) and
        whether the log is closed. Raises `EventGap` when some of them are gone."""
        if after + 1 < self.first:
            raise EventGap(after, self.first if self.frames else None)
        if after + 1 >= self.next_seq and not self.done:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)
            if after + 1 < self.first:
                raise EventGap(after, self.first if self.frames else None)
        start = after + 1 - self.first
        return [self.frames[i] for i in range(max(start, 0), len(self.frames))], self.done


class PinnedReader:
    """One attached follower of an `EventLog`: the frames after the last one it asked past stay
    in the log until it has them (a follower that detaches — a disconnect, a stalled write —
    `close`s and stops holding them)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        log._pins[self] = log.first - 1

    async def frames_after(self, after: int, wait: float) -> tuple[list[tuple[int, bytes]], bool]:
        """`EventLog.frames_after`, holding the frames after ``after``."""
        self.log._pins[self] = after
        self.log._evict()
        return await self.log.frames_after(after, wait)

    async def last_frame(self) -> tuple[int, bytes] | None:
        """`EventLog.last_frame`."""
        return await self.log.last_frame()

    def close(self) -> None:
        """Stop holding frames."""
        self.log._pins.pop(self, None)
        self.log._evict()


class FrameSource(Protocol):
    """Where a follower reads frames: ``frames_after(after, wait)`` as `EventLog.frames_after`,
    ``last_frame()`` as `EventLog.last_frame`."""

    async def frames_after(self, after: int, wait: float) -> tuple[list[tuple[int, bytes]], bool]: ...

    async def last_frame(self) -> tuple[int, bytes] | None: ...


async def follow(
    source: FrameSource,
    client: ClientStream,
    after: int,
    *,
    on_end: Callable[[bool, int], Awaitable[None]] | None = None,
) -> None:
    """Stream ``source``'s frames after ``after`` to ``client``, then ``data: [DONE]``.

    Keep-alive comments go out every ``client.keepalive_interval`` of silence.
    ``on_end(log_has_terminal, last_seq)`` runs before ``[DONE]``: whether the log holds a
    terminal event and the ``seq`` of its newest frame (-1: none), whether or not this follower
    sent them (``after`` may be at or past the end); it may send the frames of an end the log
    does not hold, e.g. a lease expiry. Raises `EventGap` before anything was sent (the
    caller answers it); a follower that falls out of the window later just stops, without
    ``[DONE]``. Raises whatever the client's writes raise.
    """
    terminal = False
    while True:
        try:
            frames, done = await source.frames_after(after, client.keepalive_interval)
        except EventGap:
            if not client.committed:
                raise
            log.warning("a background stream's follower fell behind the event log after event %d", after)
            return
        for seq, frame in frames:
            await client.start_stream()
            await client({"type": "http.response.body", "body": frame, "more_body": True})
            after = seq
            terminal = terminal or frame_type(frame) in TERMINAL_TYPES
        await client.start_stream()
        if frames:
            await client.flush()
        elif not done:
            await client.keepalive()
        if done and not frames:
            break
    if on_end is not None:
        tail = await source.last_frame()
        last = tail[0] if tail is not None else -1
        terminal = terminal or (tail is not None and frame_type(tail[1]) in TERMINAL_TYPES)
        await on_end(terminal, last)
    await client.end()
