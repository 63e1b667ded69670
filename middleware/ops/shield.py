"""The retry shield: a deterministic failure, answered again at once to the same caller's retry.

Clients that retry what they should not (the Codex CLI ignores ``x-should-retry: false`` and
sent one request 30 times after a 502 ``max_retained_bytes_exceeded``, each a real inference
call) multiply the cost of a failure. `RetryShield` remembers the answer to a failure the outcome
table marks as shielded (`middleware.outcomes.shielded`: 400 validation, 413 ledger overflow of
the parsed input, 508, budget 502s, and any failure after a gateway tool with side effects ran)
for ``seconds`` under a key made of the caller's identity (the API-key hash, or ``addr:<host>``
on an open gateway — `middleware.asgi.auth.Authenticator.caller`, the per-caller share's
notion), the limits the request ran under and a digest of its body. The digest is
`canonical_digest` of the parsed request — key order does not count: the Codex CLI serialises
maps in a random order on every retry — or, for a body that failed before it was parsed, the
SHA-256 of its bytes (hashed while they are read). Neither keeps a copy of the body. The same
request again within the window gets the remembered status, headers and body at once — no
upstream call, no tool run (DESIGN.md §5, last row).

Per worker: each process has its own (with ``--workers N`` a client may reach each worker once).
Memory is bounded by ``max_entries`` and ``max_bytes``: the oldest entries are evicted first, an
answer larger than ``max_bytes // 8`` is not remembered, and every entry's cost (`entry_cost`:
its bytes plus `ENTRY_OVERHEAD`) is drawn from the worker's admission pool (`ProcessPool`) as
caller `POOL_CALLER`, so what the shield holds is room new requests do not get; when the pool
has no room the answer is simply not remembered. ``seconds == 0`` turns the shield off.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

from middleware.ops.admission import ProcessPool

#: Budget bytes charged per entry on top of its bytes: the key, the entry object, its tuples and
#: the dict slot (CPython: ~450 bytes measured for a 3-header entry; rounded up).
ENTRY_OVERHEAD = 1024
#: The admission-pool caller the shield's entries are held under.
POOL_CALLER = "retry-shield"


@dataclasses.dataclass(frozen=True, slots=True)
class Remembered:
    """One remembered answer: HTTP ``status``, ``headers`` (lower-case name, value bytes) and
    ``body`` bytes exactly as they were sent (a committed stream's answer is the replay:
    ``response.created`` then the same ``error`` / ``response.failed`` frames), the outcome
    ``row`` and ``code`` it answered, the ``request_id`` of the request that failed, ``at``
    (the shield's clock, seconds) when it was remembered, and the ``caller`` it belongs to."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    row: str
    code: str
    request_id: str
    at: float
    caller: str = ""

    @property
    def cost(self) -> int:
        """Budget bytes this entry holds (`entry_cost`)."""
        return entry_cost(self.headers, self.body)


def entry_cost(headers: tuple[tuple[bytes, bytes], ...], body: bytes) -> int:
    """Budget bytes of one entry: body and header bytes plus `ENTRY_OVERHEAD`."""
    return len(body) + sum(len(k) + len(v) for k, v in headers) + ENTRY_OVERHEAD


def canonical_digest(obj: Any) -> bytes:
    """SHA-256 (32 bytes) of a parsed JSON value in a canonical form: object keys sorted, every
    value tagged with its type (``1`` and ``1.0`` and ``true`` differ), strings by their UTF-8
    bytes and length. Equal for any two serialisations of the same JSON value (key order,
    spacing, escapes). Iterative (no recursion limit); streams into the hash, building no copy."""
    h = hashlib.sha256()
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, _Mark):
            h.update(item.token)
        elif isinstance(item, str):
            data = item.encode("utf-8", "surrogatepass")
            h.update(b"s%d:" % len(data))
            h.update(data)
        elif item is None or isinstance(item, bool):
            h.update(b"n" if item is None else (b"t" if item else b"f"))
        elif isinstance(item, int):
            h.update(b"i%d;" % item)
        elif isinstance(item, float):
            h.update(b"d" + repr(item).encode() + b";")
        elif isinstance(item, dict):
            h.update(b"{%d:" % len(item))
            stack.append(_CLOSE_OBJECT)
            for key in sorted(item, reverse=True):  # popped in sorted order
                stack.append(item[key])
                stack.append(key)
        else:  # a list
            h.update(b"[%d:" % len(item))
            stack.append(_CLOSE_ARRAY)
            stack.extend(reversed(item))
    return h.digest()


@dataclasses.dataclass(frozen=True, slots=True)
class _Mark:
    token: bytes


_CLOSE_OBJECT = _Mark(b"}")
_CLOSE_ARRAY = _Mark(b"]")


def request_key(caller: str, limits: tuple[int, ...], body_digest: bytes) -> bytes:
    """The shield key of a request: SHA-256 over the caller's identity, the effective limits
    (``max_retained_bytes``, ``max_infer_iters``: a request that lowered them differently may end
    differently) and the ``body_digest`` (32 bytes: `canonical_digest` of the parsed body, or the SHA-256 of its
    bytes when it was not parsed)."""
    h = hashlib.sha256(caller.encode("utf-8", "surrogateescape"))
    h.update(b"\0" + ",".join(map(str, limits)).encode() + b"\0")
    h.update(body_digest)
    return h.digest()


class RetryShield:
    """The per-worker memory of shielded failures (see the module docstring).

    ``seconds``: how long an answer is remembered (0: off). ``max_entries``, ``max_bytes``: the
    bounds (entries; budget bytes, `entry_cost`). ``pool``: the admission pool the entries are
    drawn from (None: not counted, for unit tests). ``clock``: seconds, monotonic.
    Raises ValueError for a negative ``seconds``, ``max_entries`` or ``max_bytes``.
    """

    def __init__(
        self,
        *,
        seconds: float,
        max_entries: int = 4096,
        max_bytes: int = 16 * 1024 * 1024,
        pool: ProcessPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if seconds < 0 or max_entries < 0 or max_bytes < 0:
            raise ValueError(
                f"retry shield bounds must be >= 0, got seconds={seconds}, max_entries={max_entries}, "
                f"max_bytes={max_bytes}"
            )
        self.seconds = seconds
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.pool = pool
        self.clock = clock
        self.held = 0  # budget bytes of the entries now
        self._entries: collections.OrderedDict[bytes, Remembered] = collections.OrderedDict()
        self._callers: collections.Counter[str] = collections.Counter()  # entries per caller

    def __repr__(self) -> str:
        return (
            f"RetryShield(seconds={self.seconds:g}, max_entries={self.max_entries}, max_bytes={self.max_bytes}, "
            f"entries={len(self._entries)}, held={self.held})"
        )

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        """Whether anything can be remembered (``seconds`` and both bounds above 0)."""
        return self.seconds > 0 and self.max_entries > 0 and self.max_bytes > ENTRY_OVERHEAD

    @property
    def max_entry_bytes(self) -> int:
        """The largest entry remembered (budget bytes): an eighth of ``max_bytes``."""
        return self.max_bytes // 8

    def knows(self, caller: str) -> bool:
        """Whether the shield holds a failure of `caller` within the window (cheap: a request
        from any other caller need not compute its digest of the parsed body)."""
        self._expire()
        return self._callers[caller] > 0

    def lookup(self, key: bytes) -> Remembered | None:
        """The answer remembered under `key` within the window, or None (expired ones are dropped)."""
        self._expire()
        return self._entries.get(key)

    def remember(self, key: bytes, answer: Remembered) -> bool:
        """Remember `answer` under `key` (replacing an older one); False when it is not kept: the
        shield is off, the answer is over `max_entry_bytes`, or the pool has no room for it."""
        if not self.enabled:
            return False
        cost = answer.cost
        if cost > self.max_entry_bytes:
            return False
        self._expire()
        self._drop(key)
        while self._entries and (len(self._entries) >= self.max_entries or self.held + cost > self.max_bytes):
            self._drop(next(iter(self._entries)))
        if self.pool is not None and self.pool.draw(cost, caller=POOL_CALLER) is not None:
            return False
        self._entries[key] = answer
        self._callers[answer.caller] += 1
        self.held += cost
        return True

    def clear(self) -> None:
        """Forget everything and give the pool back what the entries held."""
        for key in list(self._entries):
            self._drop(key)

    def _expire(self) -> None:
        cutoff = self.clock() - self.seconds
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if oldest.at > cutoff:
                return
            self._drop(key)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.held -= entry.cost
        self._callers[entry.caller] -= 1
        if self._callers[entry.caller] <= 0:
            del self._callers[entry.caller]
        if self.pool is not None:
            self.pool.give(entry.cost, caller=POOL_CALLER)
