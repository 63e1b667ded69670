"""`ConnectionMemory`: the most recent response of one WebSocket connection (Open Responses,
"WebSocket Continuation"), and `restore_turn_history`, the history of one WebSocket turn.

The spec's connection-local state: a follow-up ``response.create`` on the same socket continues
from the previous response without a store read, and ``store: false`` (zero data retention) can
continue at all. The memory holds exactly one response — the connection's most recent one that
can be continued (``completed`` or ``incomplete``) — as the upstream items a continuation replays
(its history, its input, its replay: what `middleware.store.Store.load_chain` would return).

Charged, like everything kept alive: the items are charged to the connection's own ledger at the
price of restored history (``admit_history``: 32 x serialized bytes + 8192 x nodes with the
reference model), whose pool is the connection's share of the process pool, so a connection's
memory counts in the worker's admission budget and gauges; a turn that continues from it charges
the same size to its own ledger (``admit_history_size``), exactly as a store restore would. A
response whose items do not fit the connection's ledger is not kept (a later continuation from
it fails with ``previous_response_not_found``, or reads the store).

Eviction (a spec MUST): when a continuation turn fails with a 4xx or 5xx, the response it
continued from is evicted (`evict`); the WebSocket endpoint calls it with the turn's
``referenced`` id.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from budget import BudgetExceeded, Ledger, PoolExhausted, count_json_nodes
from middleware.errors import HistoryTooLarge, NotFound, PreviousResponseNotFound
from middleware.store.history import NOT_REPLAYED, Restored, restore_history
from middleware.store.store import Store

log = logging.getLogger("loopwarden")


class ConnectionMemory:
    """One WebSocket connection's most recent response (see the module docstring).

    ``ledger``: the connection's ledger (its pool: the connection's share of the process pool).
    ``referenced``: the ``previous_response_id`` of the turn in progress (None: none), set when
    the turn is parsed, for `evict` on failure.
    """

    __slots__ = ("_charge", "_items", "_nodes", "_size", "ledger", "referenced", "response_id")

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.response_id: str | None = None
        self.referenced: str | None = None
        self._items: list[dict[str, Any]] = []
        self._size = 0  # bytes of the items serialized
        self._nodes = 0
        self._charge = 0  # budget bytes charged to the connection's ledger

    def recall(self, response_id: str, ledger: Ledger) -> list[dict[str, Any]] | None:
        """The upstream items of ``response_id`` if it is the one kept, its size charged to the
        turn's ``ledger`` first (`HistoryTooLarge` when it does not fit); None otherwise."""
        if response_id != self.response_id:
            return None
        try:
            ledger.admit_history_size(self._size, self._nodes)
        except BudgetExceeded as exc:
            raise HistoryTooLarge(
                f"the previous response kept by this WebSocket connection is too large for this turn's budget: {exc}",
                param="previous_response_id",
                requested=exc.requested,
                charged=exc.charged,
                limit=exc.limit,
            ) from None
        return list(self._items)

    def remember(self, response_id: str, items: list[dict[str, Any]]) -> bool:
        """Keep ``items`` (the upstream items a continuation of ``response_id`` replays) in place
        of the response kept so far. False (and nothing kept) when they do not fit the
        connection's ledger or the pool."""
        self.forget()
        raw = json.dumps(items, separators=(",", ":"), default=str).encode()
        nodes = count_json_nodes(raw)
        try:
            self._charge = self.ledger.admit_history(raw, nodes)
        except (BudgetExceeded, PoolExhausted) as exc:
            log.warning("response %s is not kept in WebSocket connection memory: %s", response_id, exc)
            return False
        self.response_id = response_id
        self._items = items
        self._size, self._nodes = len(raw), nodes
        return True

    def evict(self, response_id: str | None) -> None:
        """Drop ``response_id`` if it is the one kept (None: drop whatever is kept)."""
        if response_id is None or response_id == self.response_id:
            self.forget()

    def forget(self) -> None:
        """Drop what is kept and release its charge."""
        if self._charge:
            self.ledger.release(self._charge)
        self._charge = self._size = self._nodes = 0
        self._items = []
        self.response_id = None


def continuation_items(
    restored: Restored, input_items: list[dict[str, Any]], replay: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """What a continuation of a response replays upstream: its restored history, its input items
    (minus the client-only ones, `NOT_REPLAYED`), its replay items — in `Store.load_chain`'s
    order."""
    return [*restored.items, *(i for i in input_items if i.get("type") not in NOT_REPLAYED), *replay]


async def restore_turn_history(
    request: dict[str, Any], store: Store | None, owner: str, ledger: Ledger, memory: ConnectionMemory
) -> Restored:
    """The history of one WebSocket turn: ``previous_response_id`` from connection memory first,
    then — with ``store`` on — from the store (`restore_history`, which also serves
    ``conversation``). Raises `PreviousResponseNotFound` when the id is in neither, and what
    `restore_history` raises otherwise."""
    previous = request.get("previous_response_id")
    memory.referenced = previous if isinstance(previous, str) else None
    if isinstance(previous, str) and request.get("conversation") is None:
        items = memory.recall(previous, ledger)
        if items is not None:
            return Restored(items, previous_response_id=previous)
        if request.get("store") is False or store is None:
            raise _not_found(previous, "it is not this connection's most recent response, and store is false")
    if store is None:
        return Restored([])
    try:
        return await restore_history(request, store, owner, ledger)
    except NotFound:
        if isinstance(previous, str):
            raise _not_found(
                previous, "it is not this connection's most recent response, nor stored"
            ) from None
        raise


def _not_found(previous: str, why: str) -> PreviousResponseNotFound:
    return PreviousResponseNotFound(
        f"Previous response with id {previous[:100]!r} not found: {why}. Start a new response without "
        "previous_response_id and send the full input (a store: false response lives only on the "
        "WebSocket connection that made it)",
        param="previous_response_id",
    )
