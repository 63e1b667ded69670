"""Connection bounds: what a client can hold at the connection level, before any request exists.

Without these, 320 idle TCP connections that never send a byte (no API key needed) exhaust a
worker's file descriptors (``accept() … [Errno 24]``) and every request times out. Three bounds,
the same on both of uvicorn's HTTP/1.1 stacks (``--http h11`` and ``--http httptools``):

* **Request head.** A connection that has not sent a complete request head (request line and
  headers) within ``--header-timeout`` seconds is closed, nothing answered (cap hit
  ``limit="header_timeout"``). The clock starts at accept, and on a kept-alive connection at the
  first byte of its next head; the idle time before that byte is uvicorn's own keep-alive timeout
  (``--keepalive-timeout``, uvicorn's ``timeout_keep_alive``: it is armed after every response and
  closes a connection that sends nothing more).
* **Head size.** A head over ``--max-header-bytes`` (default 64 KiB) is answered 431
  ``request_header_too_large`` in the envelope (DESIGN.md §5) and the connection closed, before
  the parser holds more than that. A head the parser rejects is answered 400 ``invalid_request``
  in the envelope, not uvicorn's plain text.
* **Connections.** At most ``--max-connections`` open connections per worker (default derived
  from the file-descriptor limit, `resolve_max_connections`); one more is aborted in
  ``connection_made``, before any byte of it is read (cap hit ``limit="max_connections"``).
  asyncio accepts up to ``backlog`` sockets per wake-up before any ``connection_made`` runs, so
  the descriptors of a flood peak at ``max_connections + backlog``: ``--backlog`` (uvicorn's
  setting, the listen queue too) is derived with it, and both fit the limit with `fd_headroom`.

uvicorn (checked against 0.54.0, `CHECKED_UVICORN`) has no header timeout and no head-size bound
on httptools; its ``limit_concurrency`` counts connections but acts only once a request head has
arrived (a plain-text 503), so idle sockets still hold their descriptors; and its keep-alive timer
is armed only after a response, never on a fresh connection. So its own settings are used where
they suffice (``timeout_keep_alive``, ``backlog``; ``h11_max_incomplete_event_size`` as h11's own
second line) and a small subclass of each protocol adds the rest: `BoundedH11Protocol`,
`BoundedHttpToolsProtocol` (``tests/ops/test_connection_bounds.py`` asserts the uvicorn names they
rely on still exist and are called). `connection_options` gives the ``uvicorn.Config`` keywords
``loopwarden serve`` uses; ``http=`` is a `functools.partial` of the class, so that the
``--workers`` > 1 path can pickle it to its spawned workers.

No status is sent for the two connection-level cap hits; their ``outcome`` label is the status
they stand for (``408`` header timeout, ``503`` refused connection), DESIGN.md §8 having no
"closed" outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import resource
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any, Final

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from middleware import outcomes
from middleware.config import Settings, SettingsError
from middleware.errors import Failure, HeadTooLarge, InvalidRequest
from middleware.ops import metrics

log = logging.getLogger("loopwarden.connections")

#: The uvicorn release the protocol subclasses were checked against.
CHECKED_UVICORN: Final = "0.54.0"
#: Descriptors kept free beside the client connections and the upstream pools: MCP sessions, the
#: store (SQLite and its journal, or the PostgreSQL pool), the listening socket, the event loop,
#: log and metric files.
FD_MARGIN: Final = 64
#: The smallest derived ``max_connections`` accepted; below it the fd limit is too low to serve.
MIN_DERIVED_CONNECTIONS: Final = 16
#: The largest derived ``backlog`` (uvicorn's default).
MAX_DERIVED_BACKLOG: Final = 2048
#: Seconds between two log lines about the same connection-level cap (the counters count each).
LOG_INTERVAL: Final = 10.0
#: Seconds a connection answered 431 / 400 is still read (and what it sends dropped) after the
#: answer, so that closing with unread bytes does not reset the connection before the client has
#: read the answer (nginx's lingering close); then it is aborted.
LINGER: Final = 2.0
#: The end of a request head: an empty line (CRLF or bare LF line endings, as h11 and llhttp read).
_HEAD_END = re.compile(rb"\n\r?\n")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConnectionBounds:
    """The per-worker connection bounds, resolved (see the module docstring).

    ``header_timeout``: seconds to send a complete request head. ``max_connections``: open
    connections per worker (>= 1). ``max_header_bytes``: bytes of one request head (request line,
    headers, line endings). ``write_timeout``: seconds a closed connection may keep unsent bytes
    without the client reading any (``--client-write-timeout``). Raises SettingsError for a value
    out of range.
    """

    header_timeout: float
    max_connections: int
    max_header_bytes: int
    write_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.header_timeout > 0:
            raise SettingsError(
                f"header_timeout must be a positive number of seconds, got {self.header_timeout}"
            )
        if self.max_connections < 1:
            raise SettingsError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_header_bytes < 1:
            raise SettingsError(f"max_header_bytes must be >= 1, got {self.max_header_bytes}")


def fd_headroom(settings: Settings) -> int:
    """File descriptors one worker keeps free for everything but client connections: every
    upstream pool full (``upstream_max_connections`` per pool; one pool, plus one per configured
    model, at most), twice when the embedded development model answers in this process (both
    ends of each connection), plus `FD_MARGIN`."""
    pools = 1 + len(settings.model_routes)
    upstream = settings.upstream.max_connections * pools * (2 if settings.upstream.url is None else 1)
    return upstream + FD_MARGIN


def fd_limit() -> int:
    """This process's soft file-descriptor limit (``RLIMIT_NOFILE``; unlimited counts as
    1,000,000)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1_000_000 if soft == resource.RLIM_INFINITY else soft


def resolve_backlog(settings: Settings, nofile: int | None = None) -> int:
    """``settings.backlog``, or when it is 0 the default: ``min(2048, nofile // 8)`` (2048 is
    uvicorn's default). ``nofile``: the soft file-descriptor limit (None: `fd_limit`)."""
    if settings.transport.backlog:
        return settings.transport.backlog
    return max(1, min(MAX_DERIVED_BACKLOG, (fd_limit() if nofile is None else nofile) // 8))


def resolve_max_connections(settings: Settings, nofile: int | None = None) -> int:
    """``settings.max_connections``, or when it is 0 the default: the soft file-descriptor limit
    (``nofile``; None: `fd_limit`) minus `fd_headroom` and the accept batch (`resolve_backlog`).

    Raises SettingsError when the derived value is under `MIN_DERIVED_CONNECTIONS` (the limit is
    too low for the upstream pools): the message says to raise ``ulimit -n``, lower
    ``--upstream-max-connections`` or set ``--max-connections``.
    """
    if settings.transport.max_connections:
        return settings.transport.max_connections
    nofile = fd_limit() if nofile is None else nofile
    reserved = fd_headroom(settings) + resolve_backlog(settings, nofile)
    derived = nofile - reserved
    if derived < MIN_DERIVED_CONNECTIONS:
        raise SettingsError(
            f"max_connections: the file-descriptor limit (ulimit -n) is {nofile}, which leaves {derived} "
            f"connections after {reserved} for the upstream pools, the accept batch (--backlog) and the "
            "rest; raise ulimit -n, lower --upstream-max-connections or set --max-connections"
        )
    return derived


def fd_overcommit(settings: Settings, nofile: int | None = None) -> int:
    """How many descriptors the bounds may need beyond the soft limit (``max_connections`` +
    ``backlog`` + `fd_headroom` − ``nofile``; 0: they fit). Only explicit settings overcommit."""
    nofile = fd_limit() if nofile is None else nofile
    need = (
        resolve_max_connections(settings, nofile) + resolve_backlog(settings, nofile) + fd_headroom(settings)
    )
    return max(0, need - nofile)


def connection_options(settings: Settings, nofile: int | None = None) -> dict[str, Any]:
    """The ``uvicorn.Config`` keywords of the connection bounds, as ``loopwarden serve`` passes
    them (single worker and ``--workers`` > 1 alike): ``http`` (the bounded protocol of
    ``settings.http``, bound to its `ConnectionBounds`; picklable, so spawned workers get it),
    ``timeout_keep_alive`` (seconds), ``backlog`` (sockets; `resolve_backlog`) and
    ``h11_max_incomplete_event_size`` (bytes), ``loop`` (``settings.loop``, named: the bounds hold on
    asyncio's and uvloop's transports), and WebSocket mode's ``ws`` and ``ws_max_size``
    (`middleware.asgi.websocket.uvicorn_websocket_options`: an upgraded connection keeps its slot
    in uvicorn's connection set, so it counts toward ``max_connections``, and its transport keeps
    the bounded close).

    ``nofile``: see `resolve_max_connections`. Raises SettingsError as it does.
    """
    bounds = ConnectionBounds(
        header_timeout=settings.transport.header_timeout,
        max_connections=resolve_max_connections(settings, nofile),
        max_header_bytes=settings.transport.max_header_bytes,
        write_timeout=settings.transport.client_write_timeout,
    )
    from middleware.asgi.websocket import uvicorn_websocket_options

    return {
        **uvicorn_websocket_options(settings),
        "http": protocol_factory(settings.transport.http, bounds),
        # the event loop is always named (never uvicorn's "auto"): the bounds hold on both, uvloop's C
        # transports through `BoundedTransport`
        "loop": settings.transport.loop,
        "timeout_keep_alive": settings.transport.keepalive_timeout,
        "backlog": resolve_backlog(settings, nofile),
        "h11_max_incomplete_event_size": settings.transport.max_header_bytes,
    }


def protocol_factory(stack: str, bounds: ConnectionBounds) -> Callable[..., asyncio.Protocol]:
    """What ``uvicorn.Config(http=...)`` calls per connection: the bounded protocol of `stack`
    (``h11`` or ``httptools``) bound to `bounds`, as a `functools.partial` (picklable, unlike a
    class made at run time). Raises SettingsError for another stack."""
    if stack == "h11":
        return functools.partial(BoundedH11Protocol, bounds=bounds)
    if stack == "httptools":
        return functools.partial(BoundedHttpToolsProtocol, bounds=bounds)
    raise SettingsError(f"http must be h11 or httptools, got {stack!r}")


class _Throttle:
    """At most one log line per `LOG_INTERVAL` seconds per connection-level cap, with the count
    since the previous line (a flood of sockets must not become a flood of log lines)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def hit(self, limit: str, message: str) -> None:
        self._count[limit] = self._count.get(limit, 0) + 1
        now = time.monotonic()
        if now - self._last.get(limit, -LOG_INTERVAL) >= LOG_INTERVAL:
            log.warning("%s (cap=%s, %d since the last line)", message, limit, self._count[limit])
            self._last[limit] = now
            self._count[limit] = 0


_THROTTLE = _Throttle()


class ConnectionGuard:
    """One connection's bounds: the cap at accept, the header deadline, the head-size count.

    The protocol subclasses call it from their uvicorn hooks and tell it whether the connection
    is waiting for (or reading) a request head: ``awaiting``. It closes or answers the transport
    itself. ``refused``: aborted at accept (uvicorn never saw the connection); ``answered``: a
    431 / 400 was sent and what the client still sends is dropped.
    """

    __slots__ = ("_head_bytes", "_tail", "_timer", "answered", "bounds", "loop", "refused", "transport")

    def __init__(self, bounds: ConnectionBounds, loop: asyncio.AbstractEventLoop) -> None:
        self.bounds = bounds
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.refused = False
        self.answered = False
        self._head_bytes = 0
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None

    def admit(self, transport: asyncio.Transport, open_connections: int) -> asyncio.Transport | None:
        """At accept: None, and the transport aborted before anything is read, when
        `open_connections` already reach ``max_connections``; else the transport the protocol
        should use (`transport` itself with a bounded ``close`` and ``write``, or, when its class
        does not allow that, as uvloop's C transports do not, a `BoundedTransport` around it), and
        the header deadline starts."""
        self.transport = transport
        if open_connections >= self.bounds.max_connections:
            self.refused = True
            metrics.cap_hit("max_connections", "503")
            _THROTTLE.hit(
                "max_connections",
                f"refused a connection at accept: {open_connections} open, --max-connections "
                f"{self.bounds.max_connections} per worker",
            )
            transport.abort()
            return None
        self._arm()
        original_close, original_write = transport.close, transport.write
        try:
            transport.close = functools.partial(self.close, original_close, transport)  # type: ignore[method-assign]
            transport.write = functools.partial(self.write, original_write, transport)  # type: ignore[method-assign]
        except AttributeError:
            self.transport = BoundedTransport(transport, self)
        return self.transport

    @staticmethod
    def write(
        original: Callable[[Any], None],
        transport: asyncio.BaseTransport,
        data: bytes | bytearray | memoryview,
    ) -> None:
        """``transport.write``, except that every write to a transport that is closing is dropped
        (and counted in ``loopwarden_dropped_writes_total``): after a client reset the socket,
        asyncio's transport logs ``socket.send() raised exception.`` for each further write, and a
        streamed answer writes many before uvicorn hears of the disconnect (one loop turn later);
        nothing written then can reach the client."""
        if transport.is_closing():
            metrics.DROPPED_WRITES.inc()
            return
        original(data)

    def close(self, original: Callable[[], None], transport: asyncio.Transport) -> None:
        """``transport.close``, bounded: a close flushes what is buffered first, and a client that
        stopped reading (uvicorn closes when the app ends a response it could not finish, e.g. at
        the write timeout) would keep the socket, its buffer and a connection slot for ever. After
        a close, every ``write_timeout`` seconds without the buffer shrinking, the transport is
        aborted instead."""
        original()
        pending = transport.get_write_buffer_size()
        if pending:
            self.loop.call_later(self.bounds.write_timeout, self._linger, transport, pending)

    def _linger(self, transport: asyncio.Transport, before: int) -> None:
        pending = transport.get_write_buffer_size()
        if pending == 0:
            return  # flushed: the connection closed normally
        if pending < before:  # the client is still reading: give it another period
            self.loop.call_later(self.bounds.write_timeout, self._linger, transport, pending)
            return
        _THROTTLE.hit(
            "client_write_timeout",
            f"aborted a closed connection whose client read none of its last {pending:,} bytes "
            f"within --client-write-timeout {self.bounds.write_timeout:g} s",
        )
        transport.abort()

    def oversized(self, data: bytes, awaiting: bool) -> int | None:
        """Before the parser sees `data`: None when the pending head stays within
        ``max_header_bytes`` (counted up to its empty line when `data` holds it), else the bytes
        of it received. `awaiting`: no head is complete yet for the next request. A head that
        starts while a request is being served (pipelined) is counted from the next read."""
        if not awaiting:
            return None
        window = self._tail + data
        end = _HEAD_END.search(window)
        size = self._head_bytes + (end.end() - len(self._tail) if end else len(data))
        if size > self.bounds.max_header_bytes:
            return size
        self._head_bytes, self._tail = (0, b"") if end else (size, window[-2:])
        return None

    def after_data(self, awaiting: bool, upgraded: bool) -> None:
        """After the parser consumed a read: keep the header deadline while a head is pending
        (armed at the first byte of a kept-alive connection's next head: until then uvicorn's
        keep-alive timer runs), drop it once the head is complete, upgraded or closed."""
        transport = self.transport
        if self.answered:
            return
        if not awaiting or upgraded or transport is None or transport.is_closing():
            self._head_bytes, self._tail = 0, b""
            self.cancel()
        elif self._timer is None:
            self._arm()

    def cancel(self) -> None:
        """Stop the header deadline (head complete, upgrade, or connection lost)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        self._timer = self.loop.call_later(self.bounds.header_timeout, self._expired)

    def _expired(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        metrics.cap_hit("header_timeout", "408")
        _THROTTLE.hit(
            "header_timeout",
            "closed a connection that sent no complete request head within --header-timeout "
            f"{self.bounds.header_timeout:g} s",
        )
        transport.abort()

    def too_large(self, received: int) -> HeadTooLarge:
        """The failure of a head over the bound, `received` bytes of it read."""
        limit = self.bounds.max_header_bytes
        return HeadTooLarge(
            f"the request head (request line and headers) is over {limit} bytes (--max-header-bytes): "
            f"{received} bytes received; send fewer or smaller headers",
            size=received,
            limit=limit,
        )

    def answer(self, failure: Failure, default_headers: list[tuple[bytes, bytes]]) -> None:
        """Answer a head that cannot be served with the outcome table's status and envelope
        (``Connection: close``), then close: the write side at once, the read side when the
        client closes or after `LINGER` seconds (`answered`: what it still sends is dropped).
        Counted in ``loopwarden_requests_total`` (model ``other``: no body was read) and logged
        like every outcome."""
        self.cancel()
        transport = self.transport
        if transport is None or transport.is_closing() or self.answered:
            return
        self.answered = True
        outcome = outcomes.resolve(failure)
        outcomes.record(outcome)
        metrics.REQUESTS.labels(status=str(outcome.status), model=metrics.OTHER_MODEL).inc()
        status, headers, body = outcomes.render_json(outcome)
        if (b"connection", b"close") not in headers:
            headers.append((b"connection", b"close"))
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
        lines += [name + b": " + value + b"\r\n" for name, value in (*default_headers, *headers)]
        transport.write(b"".join(lines) + b"\r\n" + body)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._timer = self.loop.call_later(LINGER, transport.abort)


class BoundedTransport(asyncio.Transport):
    """A transport whose class allows no bounded ``close`` / ``write`` (uvloop's C
    ``TCPTransport``), wrapped: ``close`` and ``write`` go through `ConnectionGuard.close` /
    `ConnectionGuard.write`, every other attribute (``abort``, ``is_closing``, ``pause_reading``,
    ``get_extra_info``, ``set_protocol``, ...) to the wrapped transport `inner`."""

    def __init__(self, inner: asyncio.Transport, guard: ConnectionGuard) -> None:
        super().__init__()
        self.inner = inner
        self._guard = guard

    def write(self, data: bytes | bytearray | memoryview) -> None:
        ConnectionGuard.write(self.inner.write, self.inner, data)

    def close(self) -> None:
        self._guard.close(self.inner.close, self.inner)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def is_closing(self) -> bool:
        return self.inner.is_closing()

    def abort(self) -> None:
        self.inner.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.inner.get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return self.inner.get_write_buffer_size()

    def can_write_eof(self) -> bool:
        return self.inner.can_write_eof()

    def write_eof(self) -> None:
        self.inner.write_eof()

    def pause_reading(self) -> None:
        self.inner.pause_reading()

    def resume_reading(self) -> None:
        self.inner.resume_reading()

    def is_reading(self) -> bool:
        return self.inner.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.inner.get_protocol()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.inner.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.inner.get_write_buffer_limits()


def _unparsable() -> InvalidRequest:
    return InvalidRequest(
        "the request is not valid HTTP/1.1 (the parser rejected its request line, headers or framing)",
        code="invalid_request",
    )


class _Bounded(asyncio.Protocol):
    """What both bounded protocols share: the guard made in ``__init__`` and the hooks
    ``connection_made`` (the cap at accept, the header deadline), ``data_received`` (the head size
    before the parser sees the bytes) and ``connection_lost``. A subclass puts it before uvicorn's
    protocol in its bases and says when a head is awaited (`_awaiting_head`)."""

    guard: ConnectionGuard
    server_state: ServerState
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        bounds: ConnectionBounds,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)  # type: ignore[call-arg]
        self.guard = ConnectionGuard(bounds, self.loop)

    def _awaiting_head(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        bounded = self.guard.admit(transport, len(self.server_state.connections))
        if bounded is not None:
            super().connection_made(bounded)

    def data_received(self, data: bytes) -> None:
        if self.guard.answered:
            return
        received = self.guard.oversized(data, self._awaiting_head())
        if received is not None:
            self.guard.answer(self.guard.too_large(received), self.server_state.default_headers)
            return
        super().data_received(data)
        self.guard.after_data(self._awaiting_head(), upgraded=self.transport.get_protocol() is not self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.cancel()
        if not self.guard.refused:
            super().connection_lost(exc)


class BoundedH11Protocol(_Bounded, H11Protocol):
    """uvicorn's h11 protocol with the connection bounds (module docstring).

    Overrides ``connection_made`` (the cap at accept, the header deadline), ``data_received``
    (the head size before h11 sees the bytes; the deadline kept while ``conn.their_state`` is
    ``IDLE``), ``connection_lost`` and ``send_400_response`` (h11's rejections, its own
    ``h11_max_incomplete_event_size`` bound included, as an envelope: 431 when the buffered head
    is over the bound, else 400). ``bounds``: keyword-only, bound by `protocol_factory`.
    """

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def send_400_response(self, msg: str) -> None:
        buffered = len(self.conn.trailing_data[0])
        too_large = buffered > self.guard.bounds.max_header_bytes
        failure = self.guard.too_large(buffered) if too_large else _unparsable()
        self.guard.answer(failure, self.server_state.default_headers)


class BoundedHttpToolsProtocol(_Bounded, HttpToolsProtocol):
    """uvicorn's httptools protocol with the connection bounds (module docstring).

    Overrides ``connection_made``, ``data_received``, ``connection_lost`` and
    ``send_400_response`` as `BoundedH11Protocol` does (httptools itself bounds no head), and the
    parser callbacks ``on_message_begin`` / ``on_headers_complete`` to know when a head is being
    read. Bytes the parser rejects after a complete request that is still being answered (llhttp
    parses ahead, h11 does not) are answered as h11 answers them: after that request's own
    response, with the 400 envelope and a close (``on_response_complete``; CASES B25d).
    ``bounds``: keyword-only, bound by `protocol_factory`.
    """

    _in_head = False  # between on_message_begin and on_headers_complete
    _garbage_after = False  # unparsable bytes followed a complete request still being answered

    def _awaiting_head(self) -> bool:
        idle = not self.pipeline and (self.cycle is None or self.cycle.response_complete)
        return self._in_head or idle

    def data_received(self, data: bytes) -> None:
        if self._garbage_after:
            return  # the parser already failed: drop what follows, as `answer` will
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            # llhttp parses ahead: bytes pipelined after a complete body fail here before the app
            # has answered that request. h11 parses them only once the response is done, so the
            # answer waits as it does there (CASES B25d): the request's own outcome first, then
            # this 400 envelope and the close (`on_response_complete`).
            self._garbage_after = True
            self.flow.pause_reading()
            return
        self.guard.answer(_unparsable(), self.server_state.default_headers)

    def on_response_complete(self) -> None:
        if self._garbage_after:
            self.server_state.total_requests += 1
            self.flow.resume_reading()  # the linger reads (and drops) what the client still sends
            self.guard.answer(_unparsable(), self.server_state.default_headers)
            return
        super().on_response_complete()

    def on_message_begin(self) -> None:
        self._in_head = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
