"""Process-wide admission control, memory-pressure shedding and drain state (issue 10).

The per-request ledger protects a request from itself; `ProcessPool` protects the worker from the
sum of its requests. Every request first reserves budget bytes from the pool — ``min(its
max_retained_bytes, Content-Length x the input multiplier)`` — before its body is read, and every
later ledger charge draws from that reservation, then from the pool, in the same synchronous step
(`RequestReservation` is the ledger's `budget.ChargePool`). The pool is per worker process; one
event loop per process, so plain integers suffice (check-then-commit without awaiting).

Two numbers, two gauges: ``reserved`` (``loopwarden_admission_reserved_bytes``) is what the
requests in flight hold from the pool (their reservations, grown when a ledger charges past its
own); ``charged`` (``loopwarden_inflight_retained_bytes``) is what their ledgers have charged now,
the sum of live ledgers, never more than ``reserved``. A charge or release writes no gauge (one
integer add keeps ``charged``): in one process a scrape reads both numbers live
(`Gauge.set_function`); with ``--workers`` > 1 (prometheus-client's multiprocess mode, which reads
files, not functions) the worker answering the scrape writes its values first
(`metrics.publish_before_scrape`), and every other worker's are the ones it wrote at its last
request start or end.

One caller (DESIGN.md §4: the API key's owner hash, or the client address when the gateway is
open — `middleware.asgi.auth.Authenticator.caller`) may hold at most ``max_share_per_caller`` of
the pool: ``held_by`` maps each caller to the budget bytes its requests hold (reservations and
their growth; an entry is removed when it drops to 0), so the check is one dict lookup per charge
that draws from the pool. The caller's share in bytes, `ProcessPool.caller_cap`, is
``floor(budget_bytes x share)``, the share taken as the decimal it is written as (0.29 of 100 is
29, not 28); holding exactly the share is admitted, one byte more is refused.

Refusals (the middleware maps them, DESIGN.md §5): a request that does not fit now -> 503
``server_overloaded`` with ``Retry-After`` (body not read), with the cap-hit label ``admission``,
or ``caller_share`` when the pool has room but the caller's share has not; one whose reservation
exceeds the whole pool (or a caller's whole share) -> 413 ``process_budget_exceeded``; growth
refused mid-request -> `budget.PoolExhausted`, whose cause the reservation keeps
(`RequestReservation.refusal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Literal

from middleware.errors import CallerShareFull, CallerShareTooLarge, Overloaded, ProcessBudgetExceeded
from middleware.ops import metrics

#: Seconds between two writes of the admission gauges in multiprocess mode (`ProcessPool._publish`).
PUBLISH_INTERVAL = 0.05


def memory_limit_bytes() -> int:
    """Memory this process may use: the cgroup v2/v1 limit when one is set, else physical RAM."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_pool_bytes(workers: int) -> int:
    """A quarter of `memory_limit_bytes`, divided by the worker count (issue 10's default)."""
    return memory_limit_bytes() // 4 // max(1, workers)


def memory_pressure() -> float:
    """Used / allowed memory: cgroup ``memory.current / memory.max`` when both exist, else this
    process's RSS / physical RAM."""
    try:
        current = int(Path("/sys/fs/cgroup/memory.current").read_text())
        limit_text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit_text.isdigit():
            return current / int(limit_text)
    except (OSError, ValueError):
        pass
    try:
        rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return rss_pages * os.sysconf("SC_PAGE_SIZE") / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


#: Which limit refused a draw from the pool: the cap-hit ``limit`` label of the refusal.
RefusedBy = Literal["admission", "caller_share"]


def share_bytes(budget_bytes: int, share: float) -> int:
    """One caller's share of a pool, in budget bytes: ``floor(budget_bytes x share)``, computed
    exactly from the decimal spelling of ``share`` (``share_bytes(100, 0.29) == 29``)."""
    return int(budget_bytes * Fraction(repr(share)))


class ProcessPool:
    """The worker's budget: ``budget_bytes`` of ledger charges and ``max_requests`` requests in
    flight (0: no request cap), of which one caller may hold at most ``max_share_per_caller``
    (a fraction in (0, 1]; 1: no per-caller limit). ``pressure`` (a callable returning
    used/allowed memory, polled at most every ``pressure_interval`` seconds) sheds new requests
    above ``pressure_threshold``. Raises ValueError for a budget under 1 or a share outside (0, 1].
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        max_requests: int = 0,
        max_share_per_caller: float = 1.0,
        pressure: Callable[[], float] | None = None,
        pressure_threshold: float = 0.9,
        pressure_interval: float = 1.0,
    ) -> None:
        if budget_bytes < 1:
            raise ValueError(f"max_inflight_retained_bytes must be >= 1, got {budget_bytes}")
        if not 0 < max_share_per_caller <= 1:
            raise ValueError(f"max_inflight_share_per_caller must be in (0, 1], got {max_share_per_caller}")
        self.budget = budget_bytes
        self.max_requests = max_requests
        self.share = max_share_per_caller
        self.caller_cap = share_bytes(budget_bytes, max_share_per_caller)  # one caller's share, bytes
        self.held_by: dict[str, int] = {}  # caller -> budget bytes its live requests hold (never 0)
        self.reserved = 0  # budget bytes held by live requests (their reservations)
        self.charged = 0  # budget bytes their ledgers have charged now (the sum of live ledgers)
        self.requests = 0
        self.pressure = pressure
        self.pressure_threshold = pressure_threshold
        self.pressure_interval = pressure_interval
        self._pressure_at = -1e9
        self._pressure_value = 0.0
        metrics.ADMISSION_BUDGET.set(budget_bytes)
        metrics.ADMISSION_RESERVED.set_function(lambda: self.reserved)
        metrics.INFLIGHT_RETAINED.set_function(lambda: self.charged)
        self._published_at = -1e9  # monotonic seconds of the last gauge write
        self._trailing: asyncio.TimerHandle | None = None
        metrics.publish_before_scrape(self._write_gauges)
        self._write_gauges()

    def _publish(self) -> None:
        """At request start and end: nothing in one process (a scrape reads both gauges live,
        `Gauge.set_function`); in multiprocess mode (`metrics.MULTIPROCESS`, read once at import
        as prometheus-client does) both gauges are written at most every `PUBLISH_INTERVAL`
        seconds, a change inside the interval by one trailing write at its end."""
        if not metrics.MULTIPROCESS:
            return
        wait = self._published_at + PUBLISH_INTERVAL - time.monotonic()
        if wait <= 0:
            self._write_gauges()
        elif self._trailing is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a synchronous caller: no loop to write later from
                self._write_gauges()
                return
            self._trailing = loop.call_later(wait, self._write_gauges)

    def _write_gauges(self) -> None:
        """Write both gauges now (before a scrape, and what `_publish` throttles)."""
        if self._trailing is not None:
            self._trailing.cancel()
            self._trailing = None
        self._published_at = time.monotonic()
        metrics.ADMISSION_RESERVED.set(self.reserved)
        metrics.INFLIGHT_RETAINED.set(self.charged)

    def pressure_ratio(self) -> float:
        """The last polled memory-pressure ratio (polled again when stale)."""
        if self.pressure is None:
            return 0.0
        now = time.monotonic()
        if now - self._pressure_at >= self.pressure_interval:
            self._pressure_at = now
            self._pressure_value = float(self.pressure())
            metrics.MEMORY_PRESSURE.set(self._pressure_value)
        return self._pressure_value

    @property
    def saturated(self) -> bool:
        """True when a new request would be refused now (for ``/readyz``)."""
        return (
            self.reserved >= self.budget
            or (self.max_requests > 0 and self.requests >= self.max_requests)
            or self.pressure_ratio() > self.pressure_threshold
        )

    def held(self, caller: str) -> int:
        """Budget bytes the live requests of ``caller`` hold from the pool now."""
        return self.held_by.get(caller, 0)

    def share_refusal(self, nbytes: int, *, caller: str) -> str | None:
        """Why ``caller`` cannot hold ``nbytes`` more now because its share is full (None: it can).

        Holding exactly `caller_cap` is admitted; one byte more is refused."""
        held = self.held_by.get(caller, 0)
        if held + nbytes <= self.caller_cap:
            return None
        return (
            f"this caller's share of the pool is full: its requests in flight hold {held} of the "
            f"{self.caller_cap} budget bytes one caller may hold (--max-inflight-share-per-caller="
            f"{self.share:g} of --max-inflight-retained-bytes={self.budget}); this request needs {nbytes}"
        )

    def refusal(self, nbytes: int) -> str | None:
        """Why a request reserving ``nbytes`` cannot be admitted now, whoever sends it (None: it
        can). The caller's own share is `share_refusal`, checked after this one: a ``caller_share``
        refusal is one the pool alone would have admitted."""
        if self.max_requests > 0 and self.requests >= self.max_requests:
            return f"{self.requests} requests are in flight (--max-concurrent-requests={self.max_requests})"
        ratio = self.pressure_ratio()
        if ratio > self.pressure_threshold:
            return f"memory pressure is {ratio:.0%}, over the {self.pressure_threshold:.0%} threshold"
        if self.reserved + nbytes > self.budget:
            return (
                f"{self.reserved} of {self.budget} budget bytes are reserved by requests in flight "
                f"(--max-inflight-retained-bytes); this request needs {nbytes}"
            )
        return None

    def admit(self, nbytes: int, *, caller: str) -> RequestReservation:
        """Reserve ``nbytes`` for a new request of ``caller`` (the intake checked `share_refusal`
        and `refusal` first)."""
        self.reserved += nbytes
        self._hold(caller, nbytes)
        self.requests += 1
        self._publish()
        return RequestReservation(self, nbytes, caller)

    def reserve_request(
        self, initial: int, *, caller: str, retry_after: float, declared: bool = True
    ) -> RequestReservation:
        """Admission control of a new request of ``caller`` that reserves ``initial`` budget bytes
        (before its body is read; DESIGN.md §3): the reservation, else the refusal — raises
        `ProcessBudgetExceeded` (413: more than the whole pool) or `CallerShareTooLarge` (413:
        more than one caller's whole share), which no retry can help, then `Overloaded` (503: no
        room in the pool now, or the request cap or memory pressure) or `CallerShareFull` (503:
        the caller's share is full now), whose messages name ``retry_after`` (seconds).
        ``declared``: the body has a ``Content-Length`` (else the messages say to send one: a body
        without one reserves ``max_retained_bytes``). The create intake and the store routes'
        reads both admit through here."""
        hint = "" if declared else "send a Content-Length (a body without one reserves max_retained_bytes), "
        if initial > self.budget:
            raise ProcessBudgetExceeded(
                f"this request would reserve {initial:,} budget bytes, more than this worker's whole pool of "
                f"{self.budget:,} (--max-inflight-retained-bytes); {hint}lower loopwarden-max-retained-bytes "
                "or send less",
                requested=initial,
                limit=self.budget,
            )
        if initial > self.caller_cap:
            raise CallerShareTooLarge(
                f"this request would reserve {initial:,} budget bytes, more than one caller's whole share of "
                f"this worker's pool: {self.caller_cap:,} (--max-inflight-share-per-caller={self.share:g} of "
                f"--max-inflight-retained-bytes={self.budget}); {hint}lower loopwarden-max-retained-bytes or "
                "send less, or ask the operator to raise the share",
                requested=initial,
                limit=self.caller_cap,
            )
        reason = self.refusal(initial)
        if reason is not None:
            raise Overloaded(
                f"the gateway is overloaded: {reason}; retry after {retry_after:g} s", requested=initial
            )
        reason = self.share_refusal(initial, caller=caller)
        if reason is not None:
            raise CallerShareFull(
                f"the gateway refuses this caller for now: {reason}; retry after {retry_after:g} s, once "
                "fewer of its requests are in flight",
                requested=initial,
                held=self.held(caller),
                share=self.caller_cap,
            )
        return self.admit(initial, caller=caller)

    def connection_share(self, *, caller: str) -> RequestReservation:
        """A reservation of nothing for a WebSocket connection's own ledger (its connection-local
        memory, `middleware.loop.memory`): its charges draw from the pool and count against
        ``caller``'s share like a request's, but the connection is not a request in flight (it
        takes no ``max_requests`` slot; its turns do, each as a request)."""
        return RequestReservation(self, 0, caller, counted=False)

    def draw(self, nbytes: int, *, caller: str) -> RefusedBy | None:
        """Draw ``nbytes`` more for a request of ``caller`` in flight; None when drawn, else the
        limit that refused it — ``admission`` when the pool has no room, ``caller_share`` when
        the pool has but the caller's share has not — and nothing changed."""
        if self.reserved + nbytes > self.budget:
            return "admission"
        if self.held_by.get(caller, 0) + nbytes > self.caller_cap:
            return "caller_share"
        self.reserved += nbytes
        self._hold(caller, nbytes)
        return None

    def can_draw(self, nbytes: int, *, caller: str) -> bool:
        """Whether `draw` of ``nbytes`` for ``caller`` would succeed now (changes nothing)."""
        return (
            self.reserved + nbytes <= self.budget and self.held_by.get(caller, 0) + nbytes <= self.caller_cap
        )

    def _hold(self, caller: str, nbytes: int) -> None:
        if nbytes > 0:
            self.held_by[caller] = self.held_by.get(caller, 0) + nbytes

    def give(self, nbytes: int, *, caller: str) -> None:
        """Return ``nbytes`` budget bytes that ``caller`` held to the pool."""
        self.reserved -= nbytes
        left = self.held_by.get(caller, 0) - nbytes
        if left > 0:
            self.held_by[caller] = left
        else:
            self.held_by.pop(caller, None)


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a reservation's last draw from the pool was refused: ``limit`` (the cap-hit label),
    ``held`` (budget bytes the caller held then) and ``needed`` (budget bytes the draw asked)."""

    limit: RefusedBy
    held: int
    needed: int


@dataclasses.dataclass(eq=False)
class RequestReservation:
    """One request's share of the `ProcessPool`, and its ledger's `budget.ChargePool`.

    Charges are drawn from the initial reservation first, then from the pool; released charges
    return to the pool beyond the initial reservation, which is held until `close`. ``charged``
    is the ledger's charged total (``held`` is at least that); the pool's ``charged`` is the sum
    over live reservations. The ledger releases before `close` (the guard's ``release_all``);
    whatever it still has charged then leaves the pool's sum at `close`. ``caller``: whose share
    the bytes count against. ``refusal``: why the last refused `try_take` was refused (the ledger
    raises `budget.PoolExhausted` right after, so it explains that exception).
    """

    pool: ProcessPool
    initial: int
    caller: str
    charged: int = 0
    held: int = dataclasses.field(init=False)
    closed: bool = False
    refusal: Refusal | None = None
    counted: bool = True  # a request in flight (``pool.requests``); a connection's share is not

    def __post_init__(self) -> None:
        self.held = self.initial

    def try_take(self, nbytes: int) -> bool:
        """Charge ``nbytes``; False when neither the reservation nor the pool (or the caller's
        share of it) has room; then `refusal` says which."""
        need = self.charged + nbytes - self.held
        if need > 0:
            refused = self.pool.draw(need, caller=self.caller)
            if refused is not None:
                self.refusal = Refusal(refused, self.pool.held(self.caller), need)
                return False
            self.held += need
        self.charged += nbytes
        self.pool.charged += nbytes
        return True

    def can_take(self, nbytes: int) -> bool:
        """Whether `try_take` of ``nbytes`` would succeed now (changes nothing, records no
        refusal): the ledger's check for a charge it would release at once."""
        need = self.charged + nbytes - self.held
        return need <= 0 or self.pool.can_draw(need, caller=self.caller)

    def give_back(self, nbytes: int) -> None:
        """Release ``nbytes``; what exceeds the initial reservation goes back to the pool."""
        self.charged -= nbytes
        self.pool.charged -= nbytes
        excess = self.held - max(self.initial, self.charged)
        if excess > 0:
            self.held -= excess
            self.pool.give(excess, caller=self.caller)

    def close(self) -> None:
        """End of request: everything held returns to the pool (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.pool.give(self.held, caller=self.caller)
        self.pool.charged -= self.charged
        if self.counted:
            self.pool.requests -= 1
        self.held = 0
        self.charged = 0
        self.pool._publish()


@dataclasses.dataclass(eq=False, slots=True)
class DrainBound:
    """One body read that the drain deadline also bounds (`DrainState.bounding`): ``timeout`` its
    entered `asyncio.timeout`, ``loop`` the loop it runs on, ``cut`` set once the drain moved the
    timeout's deadline earlier (so its expiry is the drain's, not the read's own)."""

    timeout: asyncio.Timeout
    loop: asyncio.AbstractEventLoop
    cut: bool = False


class DrainState:
    """Graceful drain: set on SIGTERM; in-flight requests get ``drain_timeout`` seconds.

    The guard ends requests in flight at the deadline; a request still receiving its body then is
    ended by its body read's own timeout, which `bounding` moves to the deadline (the read may be
    waiting for bytes that never come, with nothing else to wake it).
    """

    def __init__(self) -> None:
        self.draining = False
        self.deadline: float | None = None  # time.monotonic() after which in-flight requests are ended
        self._reads: dict[asyncio.Timeout, DrainBound] = {}

    def start(self, drain_timeout: float, now: float) -> None:
        """Stop admitting; in-flight requests may run until ``now + drain_timeout``
        (``time.monotonic()`` seconds). Safe from a signal handler and from another thread: body
        reads in progress are cut on their own loops (``call_soon_threadsafe``)."""
        if not self.draining:
            self.draining = True
            self.deadline = now + drain_timeout
            for read in tuple(self._reads.values()):
                with contextlib.suppress(RuntimeError):  # that loop is closed: nothing to cut
                    read.loop.call_soon_threadsafe(self._cut, read)

    @contextlib.contextmanager
    def bounding(self, timeout: asyncio.Timeout) -> Iterator[DrainBound]:
        """Within the block, ``timeout`` (entered, of a body read) expires at the drain deadline
        too: at once if a drain is under way, else when one starts. The `DrainBound` yielded says
        whether the drain cut it."""
        read = DrainBound(timeout, asyncio.get_running_loop())
        self._reads[timeout] = read
        try:
            if self.deadline is not None:
                self._cut(read)
            yield read
        finally:
            del self._reads[timeout]

    def _cut(self, read: DrainBound) -> None:
        """Move ``read``'s timeout to the drain deadline if that is earlier (on its loop)."""
        if self.deadline is None or self._reads.get(read.timeout) is not read:
            return  # the read is over
        when = read.loop.time() + (self.deadline - time.monotonic())
        current = read.timeout.when()
        if current is None or when < current:
            read.cut = True
            read.timeout.reschedule(when)


DRAIN = DrainState()


def install_drain_hook(drain_timeout: float, drain: DrainState = DRAIN) -> None:
    """Make uvicorn's exit handler (SIGTERM / SIGINT) start the gateway's drain first.

    Called by the CLI before serving, and by each worker process (`create_app_from_env`): uvicorn
    creates its own server object in a worker, so the hook patches the class, idempotently.
    """
    import uvicorn

    current = uvicorn.Server.handle_exit
    original = getattr(current, "_loopwarden_original", current)

    def handle_exit(self: uvicorn.Server, sig: int, frame: object) -> None:
        drain.start(drain_timeout, time.monotonic())
        original(self, sig, frame)  # type: ignore[arg-type]

    handle_exit._loopwarden_original = original  # type: ignore[attr-defined]
    uvicorn.Server.handle_exit = handle_exit  # type: ignore[method-assign]
