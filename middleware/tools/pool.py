"""The pool of open MCP sessions, kept across rounds and requests (DESIGN.md §6 "Execution").

`SessionPool.acquire(endpoint)` hands out a `Lease` on an open session to that server, opening one
(with `middleware.tools.session.open_session`) when none is free, and raises `SessionUnavailable`
when none can be had. `PoolLimits` bounds what is kept; `PoolStats` is what `SessionPool.stats`
counts. Each session is opened, held and closed by its own owner task (`_Entry`), and sessions
belong to the event loop that opened them (`_LoopPool`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import hmac
import json
import logging
import math
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import anyio
import mcp

from middleware.tools.endpoints import Endpoint
from middleware.tools.session import (
    DEFAULT_CLOSE_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    SessionHealth,
    open_session,
)
from middleware.tools.text import describe_exception

__all__ = ["Lease", "PoolLimits", "PoolStats", "SessionPool", "SessionUnavailable"]

log = logging.getLogger("loopwarden.tools")


@dataclass(frozen=True, kw_only=True)
class PoolLimits:
    """How `SessionPool` keeps MCP sessions open between rounds and requests.

    * ``idle_timeout`` — seconds a session with no call in flight stays open (> 0);
    * ``max_idle_per_server`` — idle sessions kept per server and credentials (>= 0; 0 closes every
      session as soon as its last call ends: no reuse across rounds);
    * ``max_idle`` — idle sessions kept in total, all servers (>= 0);
    * ``max_calls_per_session`` — calls in flight on one session (>= 1); a call past it opens
      another session.

    Raises ValueError naming the field.
    """

    idle_timeout: float = 60.0
    max_idle_per_server: int = 4
    max_idle: int = 64
    max_calls_per_session: int = 16

    def __post_init__(self) -> None:
        if not (self.idle_timeout > 0 and math.isfinite(self.idle_timeout)):
            raise ValueError(f"MCP pool idle_timeout must be > 0 seconds, got {self.idle_timeout!r}")
        for name in ("max_idle_per_server", "max_idle"):
            if getattr(self, name) < 0:
                raise ValueError(f"MCP pool {name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_calls_per_session < 1:
            raise ValueError(
                f"MCP pool max_calls_per_session must be >= 1, got {self.max_calls_per_session!r}"
            )


@dataclass(frozen=True)
class PoolStats:
    """Counters of a `SessionPool` since it was made (``opened``, ``failed`` opens, ``leases``
    handed out, of which ``reused`` went to an already open session, ``discarded`` sessions, and
    ``closed`` ones) and what it holds now (``open`` sessions, of which ``idle`` have no call)."""

    opened: int
    failed: int
    leases: int
    reused: int
    discarded: int
    closed: int
    open: int
    idle: int


class SessionUnavailable(Exception):
    """No session could be had: opening one failed (`cause` is why; a ``TimeoutError`` when it
    took longer than the pool's connect timeout), or the pool is closed (`cause` is None)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


# Keys the hash of a connection's URL and headers (`_pool_key`), so that it cannot be reversed by
# guessing low-entropy credentials even if it were seen.
_KEY_SALT: Final = secrets.token_bytes(16)


def _pool_key(endpoint: Endpoint, max_message_bytes: int) -> tuple[object, ...]:
    """What identifies a connection: the in-process server, the stdio argv, or the HTTP URL with
    every header value (credentials included) and the message bound — each with the tenant. URL and headers only enter
    as a keyed hash, so the key itself holds no secret."""
    if endpoint.app is not None:
        return ("app", id(endpoint.app), endpoint.tenant)
    if endpoint.command is not None:
        return ("stdio", tuple(endpoint.command), endpoint.tenant)
    identity = json.dumps([endpoint.url, list(endpoint.headers.items()), endpoint.tenant]).encode()
    return ("http", hmac.new(_KEY_SALT, identity, hashlib.sha256).hexdigest(), max_message_bytes)


class _Entry:
    """One pooled session: its owner task (which enters and exits the SDK's context managers, as
    anyio requires of one task), its state and its leases.

    States: ``opening`` -> ``open`` -> ``retired`` (no new leases; closed once the last ends) ->
    ``closed``. Only ``opening`` and ``open`` entries are in `_LoopPool.usable`.
    """

    def __init__(
        self, loop_pool: _LoopPool, key: tuple[object, ...], endpoint: Endpoint, max_message: int
    ) -> None:
        self.loop_pool = loop_pool
        self.key = key
        self.endpoint = endpoint
        self.max_message = max_message
        self.state = "opening"
        self.leases = 0
        self.idle_since = time.monotonic()
        self.client: mcp.Client | None = None
        self.error: BaseException | None = None
        self.ready = anyio.Event()
        self.health = SessionHealth(on_failure=self._on_failure)
        self.scope: anyio.CancelScope | None = None
        self.task: asyncio.Task[None] | None = None
        self._wake: anyio.Event | None = None

    def __repr__(self) -> str:
        return f"<MCP session {self.endpoint!r} {self.state}, {self.leases} calls>"

    def notify(self) -> None:
        """Wake the owner task to look at the state again."""
        if self._wake is not None:
            self._wake.set()

    async def wait(self, timeout: float) -> None:
        """(owner task) Sleep until `notify` or `timeout` seconds."""
        self._wake = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._wake.wait()

    def retire(self, *, discarded: bool = False) -> None:
        """No new leases; the owner closes the session once its calls have ended."""
        if self.state in ("opening", "open"):
            self.state = "retired"
            self.loop_pool.forget(self)
            if discarded:
                self.loop_pool.pool._count("discarded")
        self.notify()

    def _on_failure(self) -> None:
        log.debug("%r is unusable: %s", self, self.health.failure)
        self.retire(discarded=True)

    def unlease(self) -> None:
        self.leases -= 1
        if self.leases == 0:
            self.idle_since = time.monotonic()
            if self.state == "open":
                self.loop_pool.became_idle(self)
        self.notify()


class Lease:
    """One caller's use of a pooled session (`SessionPool.acquire`).

    ``client`` is the open ``mcp.Client``; ``reused`` says whether the session had been open before
    this lease. End it with exactly one of `release` (the session may serve other calls) or
    `discard` (it may not: it leaves the pool and closes once its other calls end). Both are
    synchronous and idempotent, so they are safe in ``finally`` blocks and under cancellation.
    """

    __slots__ = ("_done", "_entry", "reused")

    def __init__(self, entry: _Entry, reused: bool) -> None:
        self._entry = entry
        self.reused = reused
        self._done = False
        entry.leases += 1

    def __repr__(self) -> str:
        return f"Lease({self._entry!r}, reused={self.reused})"

    @property
    def client(self) -> mcp.Client:
        """The leased session's open ``mcp.Client`` (valid until the lease ends)."""
        assert self._entry.client is not None, "a lease is handed out once its session is open"
        return self._entry.client

    def release(self) -> None:
        """End the lease; the session stays in the pool."""
        if not self._done:
            self._done = True
            self._entry.unlease()

    def discard(self) -> None:
        """End the lease and take the session out of the pool (it closes once idle)."""
        if not self._done:
            self._entry.retire(discarded=True)
            self.release()


class _LoopPool:
    """The sessions of one event loop (anyio tasks and streams never cross loops)."""

    def __init__(self, pool: SessionPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.usable: dict[tuple[object, ...], list[_Entry]] = {}
        self.entries: set[_Entry] = set()
        self.closing = False

    def pick(self, key: tuple[object, ...]) -> _Entry | None:
        """The usable session for `key` with the most calls under the cap (the most recently used
        one among equals), so that spare sessions go idle and time out."""
        best: _Entry | None = None
        for entry in reversed(self.usable.get(key, ())):
            if entry.leases < self.pool.limits.max_calls_per_session and (
                best is None or entry.leases > best.leases
            ):
                best = entry
        return best

    def open(self, key: tuple[object, ...], endpoint: Endpoint, max_message: int) -> _Entry:
        entry = _Entry(self, key, endpoint, max_message)
        self.usable.setdefault(key, []).append(entry)
        self.entries.add(entry)
        # A fresh context: the owner outlives the request that happened to open the session, and
        # must not carry its context variables (request id, trace) into later requests' logs.
        entry.task = self.loop.create_task(self.pool._own(entry), context=contextvars.Context())
        return entry

    def forget(self, entry: _Entry) -> None:
        """Take `entry` out of `usable` (it gets no new leases)."""
        same = self.usable.get(entry.key)
        if same is not None and entry in same:
            same.remove(entry)
            if not same:
                del self.usable[entry.key]

    def became_idle(self, entry: _Entry) -> None:
        """Keep `entry` as the most recently used of its key, then retire the least recently used
        idle sessions past `max_idle_per_server` and `max_idle`."""
        same = self.usable[entry.key]
        same.remove(entry)
        same.append(entry)
        limits = self.pool.limits
        idle_same = [e for e in same if e.leases == 0 and e.state == "open"]
        for stale in idle_same[: max(0, len(idle_same) - limits.max_idle_per_server)]:
            stale.retire()
        idle = [e for es in self.usable.values() for e in es if e.leases == 0 and e.state == "open"]
        idle.sort(key=lambda e: e.idle_since)
        for stale in idle[: max(0, len(idle) - limits.max_idle)]:
            stale.retire()

    def close_nowait(self) -> None:
        """Retire every session, cutting off calls in flight; cancel the ones still connecting."""
        self.closing = True
        for entry in list(self.entries):
            entry.retire()
            if entry.client is None and entry.scope is not None:
                entry.scope.cancel()


class SessionPool:
    """Open MCP sessions kept between rounds and requests (DESIGN.md §6 "Execution": connecting,
    the handshake and a stdio server's start are paid once per session, not once per round).

    `acquire` hands out a `Lease` on an open session for `endpoint`, opening one when none is free.
    Sessions are keyed by everything that identifies the connection (`_pool_key`): two credentials
    never share one. One session serves up to ``limits.max_calls_per_session`` calls at once — the
    SDK's client multiplexes JSON-RPC ids over one session (a response stream per request id; over
    streamable HTTP each request is its own POST) — and calls from any task (each session is opened,
    held and closed by its own owner task, outside every request's task tree).

    A session leaves the pool when a call on it is cancelled or fails in a way that may have broken
    it (`Lease.discard`), when its transport reports it unusable (`SessionHealth`: 404 for its
    session id, a failed connection, a stdio server that exited), after ``limits.idle_timeout``
    seconds without a call, or past the idle bounds; it is closed once its last call has ended.
    `aclose` closes everything (call it at shutdown).

    Sessions belong to the event loop that opened them; a pool shared by several loops keeps them
    apart. asyncio only (the gateway runs on asyncio; owner tasks are asyncio tasks).
    `connect_timeout` bounds opening a session (seconds), `close_timeout` closing one.
    `on_tools_changed` (optional, synchronous) is called with a session's `Endpoint` each time its
    server sends ``notifications/tools/list_changed`` on it (`open_session`).
    """

    def __init__(
        self,
        limits: PoolLimits | None = None,
        *,
        connect_timeout: float = 10.0,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        on_tools_changed: Callable[[Endpoint], None] | None = None,
    ) -> None:
        if not connect_timeout > 0:
            raise ValueError(f"MCP connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        if not close_timeout > 0:
            raise ValueError(f"MCP close_timeout must be > 0 seconds, got {close_timeout!r}")
        self.limits = limits if limits is not None else PoolLimits()
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self._on_tools_changed = on_tools_changed
        self._loops: dict[asyncio.AbstractEventLoop, _LoopPool] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._counts: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"SessionPool({self.limits!r}, connect_timeout={self.connect_timeout!r})"

    def _count(self, name: str) -> None:
        self._counts[name] += 1

    def stats(self) -> PoolStats:
        """The counters and the sessions open now, over every loop."""
        with self._lock:
            loop_pools = list(self._loops.values())
        entries = [e for lp in loop_pools for e in list(lp.entries) if e.client is not None]
        return PoolStats(
            opened=self._counts["opened"],
            failed=self._counts["failed"],
            leases=self._counts["leases"],
            reused=self._counts["reused"],
            discarded=self._counts["discarded"],
            closed=self._counts["closed"],
            open=len(entries),
            idle=sum(1 for e in entries if e.leases == 0 and e.state == "open"),
        )

    def _loop_pool(self) -> _LoopPool:
        loop = asyncio.get_running_loop()
        with self._lock:
            for stale in [other for other in self._loops if other.is_closed()]:
                del self._loops[stale]  # asyncio.run() cancelled its tasks: the owners are gone
            loop_pool = self._loops.get(loop)
            if loop_pool is None:
                loop_pool = self._loops[loop] = _LoopPool(self, loop)
            return loop_pool

    async def acquire(
        self, endpoint: Endpoint, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, fresh: bool = False
    ) -> Lease:
        """A `Lease` on an open session to `endpoint` (`open_session`'s `max_message_bytes`).
        ``fresh``: on a session opened for this call, never one opened before (the retry of a call
        that was not run: the pooled siblings of a session the server forgot are likely forgotten
        too, e.g. after a restart).

        Waits for a session being opened (by this call or another) at most `connect_timeout`
        seconds. Raises `SessionUnavailable` when opening fails or the pool is closed; a
        cancellation while waiting leaves nothing behind.
        """
        if self._closed:
            raise SessionUnavailable("the MCP session pool is closed (the gateway is shutting down)")
        loop_pool = self._loop_pool()
        key = _pool_key(endpoint, max_message_bytes)
        for _ in range(3):
            entry = None if fresh else loop_pool.pick(key)
            if entry is None:
                entry = loop_pool.open(key, endpoint, max_message_bytes)
            lease = Lease(entry, reused=entry.state == "open")
            if not entry.ready.is_set():
                try:
                    async with asyncio.timeout(self.connect_timeout):
                        await entry.ready.wait()
                except TimeoutError:
                    # Not waiting for the owner to tear the half-open session down (a stdio
                    # server's shutdown takes seconds): it gets no new leases and closes alone.
                    entry.retire()
                    lease.release()
                    raise SessionUnavailable(
                        "opening an MCP session failed",
                        TimeoutError(f"no MCP session within {self.connect_timeout:g}s"),
                    ) from None
                except BaseException:
                    lease.release()
                    raise
            if entry.state == "open":
                self._count("leases")
                if lease.reused:
                    self._count("reused")
                return lease
            lease.release()
            if entry.client is None:
                raise SessionUnavailable("opening an MCP session failed", entry.error)
            # It broke between being picked and being ready: take another.
        raise SessionUnavailable("every MCP session opened for this server broke at once")

    async def _own(self, entry: _Entry) -> None:
        """(owner task) Open the session, serve its leases until it is done, close it."""
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + self.connect_timeout) as scope:
                entry.scope = scope
                async with open_session(
                    entry.endpoint,
                    connect_timeout=self.connect_timeout,
                    max_message_bytes=entry.max_message,
                    health=entry.health,
                    on_tools_changed=(
                        None
                        if self._on_tools_changed is None
                        else functools.partial(self._on_tools_changed, entry.endpoint)
                    ),
                ) as client:
                    scope.deadline = math.inf
                    entry.client = client
                    if entry.state == "opening":
                        entry.state = "open"
                    self._count("opened")
                    entry.idle_since = time.monotonic()
                    entry.ready.set()
                    if entry.leases == 0 and entry.state == "open":
                        # every caller that waited for it went away (cancelled): it is idle now,
                        # and the idle bounds apply to it as to any other
                        entry.loop_pool.became_idle(entry)
                    try:
                        await self._serve(entry)
                    finally:
                        entry.retire()
                        scope.deadline = anyio.current_time() + self.close_timeout
            if entry.client is None and scope.cancelled_caught and not entry.loop_pool.closing:
                entry.error = TimeoutError(f"no MCP session within {self.connect_timeout:g}s")
        except Exception as exc:
            if entry.client is None:
                entry.error = exc
            else:
                log.debug("%r closed with %s", entry, describe_exception(exc))
        finally:
            if entry.client is None:
                self._count("failed")
            else:
                self._count("closed")
            entry.state = "closed"
            entry.loop_pool.forget(entry)
            entry.loop_pool.entries.discard(entry)
            entry.ready.set()

    async def _serve(self, entry: _Entry) -> None:
        """(owner task) Return when the session should close: retired with no calls left, idle for
        `idle_timeout`, or the pool closing."""
        while not entry.loop_pool.closing:
            if entry.state != "open":
                if entry.leases == 0:
                    return
                await entry.wait(math.inf)
            elif entry.leases == 0:
                remaining = entry.idle_since + self.limits.idle_timeout - time.monotonic()
                if remaining <= 0:
                    log.debug("%r idle for %gs: closing", entry, self.limits.idle_timeout)
                    return
                await entry.wait(remaining)
            else:
                await entry.wait(math.inf)

    async def aclose(self) -> None:
        """Close every session (calls still in flight on them fail) and refuse new leases.

        Sessions of this event loop are closed before this returns (each within `close_timeout`
        seconds, then cancelled); those of other loops still running are told to close.
        """
        self._closed = True
        current = asyncio.get_running_loop()
        with self._lock:
            loops = list(self._loops.items())
        for loop, loop_pool in loops:
            if loop is current:
                loop_pool.close_nowait()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(loop_pool.close_nowait)
        mine = next((lp for loop, lp in loops if loop is current), None)
        tasks = [e.task for e in (mine.entries if mine is not None else ()) if e.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.close_timeout + 1)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1)
