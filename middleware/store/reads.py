"""Admission of the store's read routes (DESIGN.md §4, issue 15): `StoreReads`, `StoreRead`.

A read of stored data — ``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``,
``GET /v1/conversations/{id}/items`` — holds what it reads (the fetched text, the decoded items,
the encoded answer) until its answer is sent, so it is admitted like a create request: a
reservation from the worker's `ProcessPool` and a per-request `Ledger` drawing from it, charged
from the sizes the store measured when it wrote the rows, before a row is fetched or decoded.
While a read is in flight its charge shows in ``loopwarden_inflight_retained_bytes`` and
``loopwarden_admission_reserved_bytes`` (the pool's gauges).

One read, in order (`middleware.store.routes` drives it):

1. the size query — `Store.response_size`, or `Store.input_item_sizes` /
   `Store.conversation_item_sizes` (ids and stored sizes of at most ``limit + 1`` rows; the item
   column is never selected);
2. `StoreRead.admit_response` / `StoreRead.admit_page` — the reservation and the ledger charge;
3. the fetch of what was admitted, and only that: `Store.response_json` (the stored JSON text,
   served as it is, never decoded) or `Store.load_page` (the admitted prefix of the page);
4. `StoreRead.respond` — the answer, whose sending ends with `StoreRead.close` (everything
   released, the reservation closed), however it ends.

Prices: the ledger's history price, ``Ledger.admit_history_size(nbytes, nodes)``, on the stored
sizes (`item_read_size`): per item its ``size_bytes`` + `ITEM_EXTRA_BYTES` + twice its id's UTF-8
length (the id as ``first_id`` / ``last_id``), and ``node_count`` + `ITEM_EXTRA_NODES` (what
`present_item` may add: a minted ``id``, ``type``, ``status``, a content list); per page
`PAGE_EXTRA_BYTES` / `PAGE_EXTRA_NODES` once (the list envelope). A stored response, never
decoded, is charged for its bytes only (``admit_history_size(size_bytes, 0)``).

Two bounds, both in budget bytes:

* the **page bound** is the request's ``max_retained_bytes`` (``--max-retained-bytes``, lowered by
  a ``loopwarden-max-retained-bytes`` header): after the first item, items join the page while the
  page's charge stays within it (and while the pool can supply them); a page cut short by it says
  ``has_more: true`` and continues from its ``last_id`` like any page;
* the **read ledger's limit**, `read_ledger_limit`: the page's first item, or the response, is
  admitted whatever the page bound as long as it fits this limit, which is large enough for
  anything a create request could have stored under the same ``max_retained_bytes`` (so a page
  always holds at least one item). What does not fit is a 413 `StoredReadTooLarge` naming the
  setting to raise.

Conversation POST bodies (create, add items, update) are admitted like a create request's body
(`middleware.store.bodies`): `StoreRead.open_body` reserves from the pool before a byte is read
(``min(max_retained_bytes, Content-Length × ChargeModel.reserve_per_byte())``, the whole
``max_retained_bytes`` without a ``Content-Length``) and opens a ledger of ``max_retained_bytes``
with the store's surcharges (the body is stored); `StoreRead.admit_body` charges the read body
(``Ledger.admit_input``: 413 ``max_retained_bytes_exceeded`` when it does not fit) before it is
parsed. The charge is held until the answer is sent.

Refusals, raised for `middleware.outcomes` to answer (the create path's rows, `middleware.asgi.intake`):
`ShuttingDown` (draining), `Overloaded` (503 ``server_overloaded`` with ``Retry-After``: the pool
cannot supply the first item now, or the request cap or memory pressure is hit),
`ProcessBudgetExceeded` (413: the first item alone is more than the whole pool),
`StoredReadTooLarge` (413 ``max_retained_bytes_exceeded``), `InvalidHeader` (400, a bad
``loopwarden-max-*`` header).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from fractions import Fraction

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from budget import BudgetExceeded, ChargeModel, JsonFeatures, Ledger, Limits, PoolExhausted
from middleware.asgi.intake import effective_limits
from middleware.errors import (
    Overloaded,
    ProcessBudgetExceeded,
    ShuttingDown,
    StoredReadTooLarge,
)
from middleware.ops.admission import DRAIN, DrainState, ProcessPool, RequestReservation
from middleware.store.store import ItemSize, PageSizes

__all__ = [
    "ITEM_EXTRA_BYTES",
    "ITEM_EXTRA_NODES",
    "PAGE_EXTRA_BYTES",
    "PAGE_EXTRA_NODES",
    "StoreRead",
    "StoreReads",
    "item_read_size",
    "read_ledger_limit",
    "stored_byte_floor",
]

#: Bytes and JSON nodes `present_item` may add to a stored item: a minted ``"id"`` (its key and a
#: 32-hex-digit id with a short prefix), ``"type":"message"``, ``"status":"completed"`` and a
#: string content wrapped as ``[{"type":"output_text","text":…,"annotations":[]}]``, plus the
#: separators of the list (a test checks the worst case stays within both).
ITEM_EXTRA_BYTES, ITEM_EXTRA_NODES = 160, 16
#: Bytes and nodes of a page's list envelope (``object``, ``data``, ``first_id``, ``last_id``,
#: ``has_more``), the two ids aside: each item pays for its own id twice (`item_read_size`).
PAGE_EXTRA_BYTES, PAGE_EXTRA_NODES = 96, 16

#: The model a `Ledger` charges with when given none: the create path's (`middleware.asgi.intake`).
_LEDGER_MODEL = Ledger(0).model


def item_read_size(row: ItemSize) -> tuple[int, int]:
    """What reading the stored item ``row`` on a page is charged for, as ``(bytes, nodes)`` at the
    history price: its stored ``size_bytes`` + `ITEM_EXTRA_BYTES` + 2 × its id's UTF-8 length
    (the id may be the page's ``first_id`` and ``last_id``), its ``node_count`` +
    `ITEM_EXTRA_NODES`."""
    return (
        row.size_bytes + ITEM_EXTRA_BYTES + 2 * len(row.item_id.encode("utf-8")),
        row.node_count + ITEM_EXTRA_NODES,
    )


def read_ledger_limit(
    max_retained_bytes: int, model: ChargeModel, *, extra_bytes: int = 0, extra_nodes: int = 0
) -> int:
    """The limit (budget bytes) of a read's ledger: enough to read back, alone, any item or
    response a create request could have stored under ``max_retained_bytes``, plus what reading
    it adds (``extra_bytes`` / ``extra_nodes`` of presentation, at the history price).

    A create request charged what it stored at least the cheapest create-path price, per byte
    and per node, with the store on: the input, buffered-output, accumulated-output and
    tool-result charges and (bytes only) the terminal encode. A read charges the history price.
    So an item of ``b`` bytes and ``k`` nodes that fitted ``max_retained_bytes`` at create costs
    a read at most ``ceil(max_retained_bytes × max(h_b / c_b, h_k / c_k, 1))``, where ``h_*``
    are the history prices and ``c_*`` the cheapest create prices. The sizes compared are the
    stored ones (compact JSON, as measured at write time).

    The measured model (``model.parse`` set) charges most owners by features, not by the
    size-only prices: accumulated delta text costs its `str` plus the persisted projection (two
    copies of its serialized bytes), × the margin. The projection is the floor every stored byte
    paid at write (`stored_byte_floor`), so its price also bounds the cheapest create price per
    byte: a ``failed`` response kept from many deltas (attack report D2) costs about 3.4 budget
    bytes per stored byte at write, not the size-only 11.

    A model whose cheapest create price is 0 where the history price is not can store anything:
    the limit is then unbounded (``sys.maxsize``) and the pool bounds the read.
    """
    per_byte = (
        model.input_charge(1, 0, True),
        model.output_charge(1, 0, True),
        model.accumulated_charge(1, 0, True),
        model.tool_result_charge(1, 0, True),
        model.terminal_charge(1, True),
    )
    per_node = (
        model.input_charge(0, 1, True),
        model.output_charge(0, 1, True),
        model.accumulated_charge(0, 1, True),
        model.tool_result_charge(0, 1, True),
    )
    byte_floor = min(Fraction(min(per_byte)), stored_byte_floor(model))
    scaled = max_retained_bytes
    for read, create in (
        (model.history_charge(1, 0), byte_floor),
        (model.history_charge(0, 1), Fraction(min(per_node))),
    ):
        if create == 0:
            if read:
                return sys.maxsize
            continue
        scaled = max(scaled, math.ceil(max_retained_bytes * read / create))
    return scaled + model.history_charge(extra_bytes, extra_nodes)


def stored_byte_floor(model: ChargeModel) -> Fraction:
    """The least a create request under ``model`` charges, with the store on, per byte of what it
    stores (budget bytes per stored byte, exact). Size-only models (the reference one): unbounded
    here (their size-only prices, in `read_ledger_limit`, decide). The measured model: the
    persisted projection its feature prices charge for every stored byte, ``2 × margin`` (the
    stored text and its encoding, both at least the stored length; `ChargeModel.measured_accumulated`,
    ``measured_input``, ``measured_tool_result``), everything else it charges on top."""
    if model.parse is None:
        return Fraction(sys.maxsize)
    return Fraction(2 * model.parse.margin_eighths, 8)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StoreReads:
    """What every store read of one gateway shares: the server-wide ``limits`` (their
    ``max_retained_bytes`` is the page bound), the admission ``pool``, the ``drain`` state,
    ``retry_after`` (seconds in a 503), the charge ``model`` (default: the one a `Ledger`
    uses when given none, as the create path does), ``caller_of`` (whose pool share a request
    counts against) and ``client_body_timeout`` (seconds to receive a whole POST body,
    ``--client-body-timeout``)."""

    limits: Limits
    pool: ProcessPool
    drain: DrainState = DRAIN
    retry_after: float = 1.0
    model: ChargeModel = _LEDGER_MODEL
    caller_of: Callable[[Scope, str], str] | None = None
    client_body_timeout: float = 30.0

    def start(self, scope: Scope, owner: str = "") -> StoreRead:
        """A `StoreRead` for the request ``scope`` of ``owner``; `InvalidHeader` for a bad
        ``loopwarden-max-*`` header. Its reservation counts against the caller's share of the
        pool (``caller_of(scope, owner)``, the create path's `Authenticator.caller`)."""
        limits, _ = effective_limits(self.limits, scope.get("headers", []))
        caller = self.caller_of(scope, owner) if self.caller_of is not None else owner
        return StoreRead(self, limits.max_retained_bytes, caller)


class StoreRead:
    """The admission of one store read (see the module docstring); per request, never shared.

    ``max_retained_bytes``: the page bound (budget bytes). After an ``admit_*``: ``ledger`` (the
    read's `Ledger`, its limit `read_ledger_limit` of the page bound and of what reading the
    response or the page's first item adds) and ``reservation`` (its share of the pool), both
    released by `close`.
    """

    def __init__(self, reads: StoreReads, max_retained_bytes: int, caller: str = "") -> None:
        self.reads = reads
        self.max_retained_bytes = max_retained_bytes
        self.caller = caller
        self.ledger: Ledger | None = None
        self.reservation: RequestReservation | None = None

    def admit_response(self, response_id: str, size_bytes: int) -> None:
        """Admit serving the stored response ``response_id`` of ``size_bytes`` bytes (from
        `Store.response_size`), before its text is fetched. Raises the refusals of the module
        docstring."""
        self._open(f"the stored response {response_id[:64]!r} ({size_bytes:,} bytes)", size_bytes, 0, 0, 0)

    def admit_page(self, sizes: PageSizes) -> int:
        """Admit the longest prefix of ``sizes`` (from a ``*_item_sizes`` query) that this read
        may load, before anything is fetched; returns its length, for `Store.load_page`.

        The first row is admitted against the read ledger's limit alone (a page holds at least
        one item); each next row only while the page's charge stays within the page bound and
        the pool can supply it. Raises the refusals of the module docstring (for the first row).
        """
        rows = sizes.rows[: sizes.limit]
        if not rows:
            self._open(
                "an empty page", PAGE_EXTRA_BYTES, PAGE_EXTRA_NODES, PAGE_EXTRA_BYTES, PAGE_EXTRA_NODES
            )
            return 0
        first = rows[0]
        nbytes, nodes = item_read_size(first)
        extra_bytes = PAGE_EXTRA_BYTES + nbytes - first.size_bytes
        extra_nodes = PAGE_EXTRA_NODES + nodes - first.node_count
        ledger = self._open(
            f"the stored item {first.item_id[:64]!r} ({first.size_bytes:,} bytes, {first.node_count:,} JSON nodes)",
            first.size_bytes + extra_bytes,
            first.node_count + extra_nodes,
            extra_bytes,
            extra_nodes,
        )
        count = 1
        for row in rows[1:]:
            nbytes, nodes = item_read_size(row)
            if ledger.charged + ledger.model.history_charge(nbytes, nodes) > self.max_retained_bytes:
                break  # the page bound: the next page starts here
            try:
                ledger.admit_history_size(nbytes, nodes)
            except PoolExhausted:
                break  # the pool is short now: a shorter page, not a refusal
            count += 1
        return count

    def open_body(self, declared: int | None) -> Ledger:
        """Admit reading a POST body of ``declared`` bytes (its ``Content-Length``; None when
        absent) before a byte of it is read: a reservation of ``min(max_retained_bytes,
        declared × reserve_per_byte)`` (``max_retained_bytes`` when None) and a ledger of
        ``max_retained_bytes`` with the store's surcharges, returned. Raises `ShuttingDown`,
        `ProcessBudgetExceeded` / `CallerShareTooLarge` (the reservation is more than the pool /
        one caller's share of it), `Overloaded` / `CallerShareFull` (no room now)."""
        pool, model = self.reads.pool, self.reads.model
        if self.reads.drain.draining:
            raise ShuttingDown("the gateway is shutting down; retry on another instance", refused=True)
        limit = self.max_retained_bytes
        initial = limit if declared is None else min(limit, declared * model.reserve_per_byte())
        self.reservation = pool.reserve_request(
            initial, caller=self.caller, retry_after=self.reads.retry_after, declared=declared is not None
        )
        self.ledger = ledger = Ledger(limit, model, store=True, pool=self.reservation)
        return ledger

    def admit_body(self, raw: bytes, nodes: int, features: JsonFeatures | None) -> None:
        """Charge the read body ``raw`` (``nodes`` JSON nodes; ``features`` for the measured
        model) before it is parsed: ``Ledger.admit_input`` with the store's surcharges (raises
        `budget.BudgetExceeded` / `PoolExhausted` of phase ``input``: 413). Call `open_body`
        first."""
        assert self.ledger is not None, "open_body comes first"
        self.ledger.admit_input(raw, nodes=nodes, features=features)

    def respond(self, body: bytes) -> Response:
        """The ``application/json`` answer ``body``; this read stays admitted until it is sent."""
        return _AdmittedResponse(body, self)

    def close(self) -> None:
        """Release what the ledger charged and return the reservation to the pool (idempotent)."""
        ledger, reservation = self.ledger, self.reservation
        self.ledger = self.reservation = None
        if ledger is not None:
            ledger.release_all()
        if reservation is not None:
            reservation.close()

    def _open(self, what: str, nbytes: int, nodes: int, extra_bytes: int, extra_nodes: int) -> Ledger:
        """Reserve from the pool and charge ``nbytes`` / ``nodes`` at the history price on a new
        ledger whose limit is `read_ledger_limit` of the page bound and of ``extra_bytes`` /
        ``extra_nodes`` (what the read adds to the stored sizes); the refusals of the module
        docstring."""
        pool = self.reads.pool
        if self.reads.drain.draining:
            raise ShuttingDown("the gateway is shutting down; retry on another instance", refused=True)
        reason = pool.refusal(0)
        if reason is not None:
            raise self._overloaded(reason, 0)
        self.reservation = pool.admit(0, caller=self.caller)
        limit = read_ledger_limit(
            self.max_retained_bytes, self.reads.model, extra_bytes=extra_bytes, extra_nodes=extra_nodes
        )
        self.ledger = ledger = Ledger(limit, self.reads.model, pool=self.reservation)
        try:
            ledger.admit_history_size(nbytes, nodes)
        except BudgetExceeded as exc:
            raise StoredReadTooLarge(
                f"{what} needs {exc.requested:,} budget bytes to be read, over the {exc.limit:,} of this read's "
                f"ledger (the most a read of anything stored under max_retained_bytes={self.max_retained_bytes:,} "
                "can need); raise --max-retained-bytes (loopwarden-max-retained-bytes only lowers it)",
                requested=exc.requested,
                charged=exc.charged,
                limit=exc.limit,
            ) from None
        except PoolExhausted as exc:
            if exc.requested > pool.budget:
                raise ProcessBudgetExceeded(
                    f"{what} needs {exc.requested:,} budget bytes to be read, more than this worker's whole pool of "
                    f"{pool.budget:,} (--max-inflight-retained-bytes); raise --max-inflight-retained-bytes",
                    requested=exc.requested,
                    limit=pool.budget,
                ) from None
            raise self._overloaded(pool.refusal(exc.requested) or "the pool is full", exc.requested) from None
        return ledger

    def _overloaded(self, reason: str, requested: int) -> Overloaded:
        return Overloaded(
            f"the gateway is overloaded: {reason}; retry after {self.reads.retry_after:g} s",
            requested=requested,
        )


class _AdmittedResponse(Response):
    """A JSON answer that closes its `StoreRead` once sending ends, however it ends."""

    media_type = "application/json"

    def __init__(self, body: bytes, read: StoreRead) -> None:
        super().__init__(body)
        self._read = read

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._read.close()
