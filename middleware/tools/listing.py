"""What a ``tools/list`` answer costs: its charge to the request that fetches it, and its place in
the process's listing cache, which is bounded in bytes (DESIGN.md §4: memory outside any
request's ledger is bounded and counted too).

* `LISTING_MODEL` — the prices: the size-only bounds of `budget.ChargeModel.measured` (calibrated on CPython with
  ``tracemalloc``), not the reference multipliers, which would price an ordinary 8-tool server
  out of a 1 MiB request.
* `ListingMeter` — an `middleware.tools.session.AnswerMeter` that charges one request's ledger for
  one server's ``tools/list`` answers *while they are read*, before the SDK buffers or parses a
  byte of them, and refuses the rest of an answer the request cannot afford.
* `ListingCache` — the listings kept across requests: at most ``max_bytes`` in all (the sizes
  `listing_size` gives), least recently used evicted first, for ``ttl`` seconds, dropped per
  server on ``notifications/tools/list_changed`` (`server_identity`).

Measured with ``tracemalloc`` on a real streamable-HTTP listing (the MCP server in another
process), for shapes from 2,000 typical tools to node-heavy and UCS-4 ones: the peak while one
answer is read and parsed is at most 1/2.5 of its `ListingMeter` charge, and what the cache
keeps is at most 1/1.5 of its `listing_size` (tests/tools/test_listing_cache.py checks the latter).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Final, Generic, TypeVar

from budget import BudgetExceeded, ChargeModel, JsonNodeCounter, Ledger, PoolExhausted, count_json_nodes
from middleware.tools.endpoints import Endpoint

__all__ = [
    "ENTRY_OVERHEAD",
    "LISTING_MODEL",
    "ListingCache",
    "ListingMeter",
    "listing_size",
    "server_identity",
]

V = TypeVar("V")

#: The prices of what ``tools/list`` brings into a request (see the module docstring).
LISTING_MODEL: Final = ChargeModel.measured()  # its size-only bounds: a listing is charged as it streams in

#: Bytes one cache entry costs besides its listing: the entry, its key tuple and the LRU's slot
#: (the key's strings are added by `listing_size`).
ENTRY_OVERHEAD: Final = 1024


def listing_size(serialized: bytes, key: tuple[str, ...]) -> int:
    """The bytes one cache entry keeps alive: the parsed listing, priced from its compact JSON
    serialization `serialized` (UTF-8) as `LISTING_MODEL` prices parsed objects a request keeps
    (``accumulated_charge``: per byte and per JSON node), plus `ENTRY_OVERHEAD` and the key's
    characters. Sound, not exact: tests/tools/test_listing_cache.py holds it to ``tracemalloc``."""
    parsed = LISTING_MODEL.accumulated_charge(len(serialized), count_json_nodes(serialized), False)
    return parsed + ENTRY_OVERHEAD + sum(len(part) for part in key)


def server_identity(endpoint: Endpoint) -> tuple[object, ...]:
    """What names one MCP server for invalidation: its URL exactly as connected to (the query
    included), its stdio argv, or its in-process app. Every cache key of one server — any headers,
    any caller — shares this identity."""
    if endpoint.app is not None:
        return ("app", id(endpoint.app))
    if endpoint.command is not None:
        return ("stdio", tuple(endpoint.command))
    return ("url", endpoint.url)


class ListingMeter:
    """Charges one request's `budget.Ledger` for one server's ``tools/list`` answers as they are read.

    An `middleware.tools.session.AnswerMeter`: `feed` gets each chunk of each answer (all pages)
    before the SDK buffers or parses it, and reserves (``ledger.reserve``) what holding and parsing
    it costs — ``LISTING_MODEL.output_charge(bytes, nodes)``, the buffered-body price, with JSON
    nodes counted lexically over the answer stream. The first refused charge (`BudgetExceeded`
    or `PoolExhausted`) is kept in `refused` and raised again by every later `feed`, so a refused
    answer is never read further. `charge_parsed` charges the same price for an answer that had
    no bytes to show (in-process and stdio servers), after it was parsed. `release` gives back
    everything charged, `restart` also forgets what was fed. Budget bytes throughout; not
    thread-safe (one fetch, one task).
    """

    __slots__ = ("_counter", "_ledger", "charged", "refused", "wire_bytes")

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._counter = JsonNodeCounter(max_depth=None)
        self.charged = 0
        """Budget bytes this meter holds on the ledger."""
        self.wire_bytes = 0
        """Answer bytes fed so far."""
        self.refused: BudgetExceeded | PoolExhausted | None = None
        """The ledger's refusal, once a charge did not fit."""

    def __repr__(self) -> str:
        return f"ListingMeter(wire_bytes={self.wire_bytes}, charged={self.charged}, refused={self.refused!r})"

    def _nodes(self, chunk: bytes) -> int:
        """JSON nodes in `chunk`, continuing the count. A raw newline never occurs inside a JSON
        string, so a line that ends inside one is malformed (an SSE frame the SDK will not parse):
        the count restarts after it, so that one bad frame cannot hide the nodes of the next."""
        saved = copy.copy(self._counter)
        before = self._counter.nodes
        self._counter.feed(chunk)
        if not (self._counter.in_string and b"\n" in chunk):
            return self._counter.nodes - before
        counter, total = saved, 0
        lines = chunk.split(b"\n")
        for i, line in enumerate(lines):
            start = counter.nodes
            counter.feed(line)
            if i < len(lines) - 1:
                counter.feed(b"\n")
            total += counter.nodes - start
            if i < len(lines) - 1 and counter.in_string:
                counter = JsonNodeCounter(max_depth=None)
        self._counter = counter
        return total

    def _reserve(self, charge: int) -> None:
        try:
            self.charged += self._ledger.reserve(charge)
        except (BudgetExceeded, PoolExhausted) as exc:
            self.refused = exc
            raise

    def feed(self, chunk: bytes) -> None:
        """Charge `chunk` (answer bytes as received). Raises `BudgetExceeded` / `PoolExhausted`
        (also kept in `refused`) when the ledger cannot take it, and again for every later chunk."""
        if self.refused is not None:
            raise self.refused
        # The per-byte part first: a chunk that cannot fit is refused before any counting work.
        self._reserve(LISTING_MODEL.output_charge(len(chunk), 0, False))
        self._reserve(LISTING_MODEL.output_charge(0, self._nodes(chunk), False))
        self.wire_bytes += len(chunk)

    def charge_parsed(self, serialized: bytes) -> None:
        """Charge an answer that was parsed without passing through `feed`, from its compact JSON
        `serialized`. Raises like `feed`."""
        if self.refused is not None:
            raise self.refused
        self._reserve(LISTING_MODEL.output_charge(len(serialized), count_json_nodes(serialized), False))

    def release(self) -> None:
        """Give back everything this meter charged (the answer's bytes and parse are gone)."""
        if self.charged:
            self._ledger.release(self.charged)
            self.charged = 0

    def restart(self) -> None:
        """`release`, and meter the next answers as if nothing had been fed (a failed listing is
        tried again)."""
        self.release()
        self._counter = JsonNodeCounter(max_depth=None)
        self.wire_bytes = 0


class ListingCache(Generic[V]):
    """``tools/list`` results kept across requests, bounded in bytes.

    * ``max_bytes`` — the cap on the sum of the entries' sizes (bytes, >= 0; 0: nothing is kept);
    * ``ttl`` — seconds an entry is served after it was stored (>= 0; 0: nothing is kept);
    * ``clock`` — the monotonic clock, in seconds (tests pass their own).

    `get` serves an entry by key and makes it the most recently used; `put` stores one with the
    size its caller measured (`listing_size`), evicting least recently used entries until the sum
    fits; an entry larger than ``max_bytes`` is not stored. Every entry names its server
    (`server_identity`): `invalidate` drops all of that server's entries, and a listing fetched
    before an invalidation of its server is not stored (`put` compares the `epoch` taken when the
    fetch began). Raises ValueError naming the setting for an invalid ``max_bytes`` or ``ttl``.
    Thread-safe: one lock, never held across I/O.
    """

    # Invalidated servers remembered, so that a fetch racing an invalidation is not stored; past it,
    # the oldest are forgotten and a fetch begun before them is not stored whatever its server.
    _REMEMBERED: Final = 1024

    def __init__(self, max_bytes: int, ttl: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"mcp_list_cache_bytes must be an int >= 0 (0: never cache), got {max_bytes!r}")
        if not ttl >= 0:
            raise ValueError(f"mcp_list_ttl must be >= 0 seconds (0: never cache), got {ttl!r}")
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (expires, server, size, value), least recently used first
        self._entries: OrderedDict[Hashable, tuple[float, tuple[object, ...], int, V]] = OrderedDict()
        self._bytes = 0
        self._epoch = 0
        self._changed: OrderedDict[tuple[object, ...], int] = OrderedDict()
        self._forgotten = -1

    def __repr__(self) -> str:
        return (
            f"ListingCache(max_bytes={self.max_bytes}, ttl={self.ttl!r}, entries={len(self._entries)}, "
            f"bytes={self._bytes})"
        )

    @property
    def enabled(self) -> bool:
        """Whether anything can be stored (``max_bytes`` and ``ttl`` both above 0)."""
        return self.max_bytes > 0 and self.ttl > 0

    @property
    def bytes(self) -> int:
        """The sum of the stored entries' sizes (bytes); never above ``max_bytes``."""
        return self._bytes

    @property
    def entries(self) -> int:
        """How many entries are stored (expired ones included until they are evicted or read)."""
        return len(self._entries)

    def epoch(self) -> int:
        """The invalidation counter now: take it before fetching a listing, pass it to `put`."""
        return self._epoch

    def _drop(self, key: Hashable) -> None:
        _, _, size, _ = self._entries.pop(key)
        self._bytes -= size

    def get(self, key: Hashable) -> V | None:
        """The value stored under `key` if it has not expired (it becomes the most recently
        used), else None (an expired entry is dropped)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry[0] <= self._clock():
                self._drop(key)
                return None
            self._entries.move_to_end(key)
            return entry[3]

    def put(self, key: Hashable, server: tuple[object, ...], value: V, size: int, *, since: int) -> bool:
        """Store `value` under `key` for ``ttl`` seconds, as `size` bytes of server `server`;
        return whether it was stored. Not stored when the cache is disabled, when `size` is over
        ``max_bytes``, or when `server` was invalidated after `since` (an `epoch`): the listing
        may predate the change. Least recently used entries are evicted until it fits."""
        with self._lock:
            if key in self._entries:
                self._drop(key)
            if not self.enabled or size > self.max_bytes:
                return False
            if self._changed.get(server, -1) > since or self._forgotten > since:
                return False
            while self._bytes + size > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[key] = (self._clock() + self.ttl, server, size, value)
            self._bytes += size
            return True

    def invalidate(self, server: tuple[object, ...]) -> int:
        """Drop every entry of `server` (any key); return how many were dropped. Listings of it
        whose fetch began before this call will not be stored."""
        with self._lock:
            self._epoch += 1
            self._changed[server] = self._epoch
            self._changed.move_to_end(server)
            while len(self._changed) > self._REMEMBERED:
                _, epoch = self._changed.popitem(last=False)
                self._forgotten = max(self._forgotten, epoch)
            stale = [key for key, entry in self._entries.items() if entry[1] == server]
            for key in stale:
                self._drop(key)
            return len(stale)
