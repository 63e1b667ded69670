"""The request-wide retained-bytes ledger (DESIGN.md §4).

One `Ledger` per client request, shared by every round. Every admission is check-then-commit
with exact integer arithmetic: a charge that makes ``charged == limit`` is admitted, one byte
more raises `BudgetExceeded`, and a refused charge leaves the ledger exactly as it was. Charges
that cannot fit fail before any counting work (their per-byte part alone is checked first).

The ledger is synchronous and lock-free: one request runs on one event loop, and no admission
awaits. An optional process-wide pool can draw the same amounts in the same synchronous step
(see `ChargePool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .errors import BudgetExceeded, ConfigError, Phase, PoolExhausted
from .features import JsonFeatures
from .model import ChargeModel
from .nodes import count_json_nodes, json_features

__all__ = ["ChargePool", "Ledger"]

_DEFAULT_MODEL = ChargeModel()

BytesLike = bytes | bytearray | memoryview


@runtime_checkable
class ChargePool(Protocol):
    """A process-wide budget that every request ledger draws from (admission control).

    The ledger calls `try_take` with exactly the amount it is about to commit, after its own
    limit check passed and before it commits; `False` makes the ledger raise `PoolExhausted`
    and stay unchanged. Every release calls `give_back` with exactly the amount released, so a
    pool's total equals the sum of its ledgers' ``charged``. Both are called synchronously
    from the request's event loop; a pool shared across threads must lock internally.
    """

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` budget bytes if available; return whether it did."""
        ...

    def give_back(self, nbytes: int) -> None:
        """Return ``nbytes`` budget bytes taken earlier."""
        ...


def _pool_admits(pool: ChargePool, nbytes: int) -> bool:
    """Whether `pool` would let `try_take` take ``nbytes`` now, changing nothing: its own
    ``can_take`` when it has one, else a take given straight back."""
    can_take = getattr(pool, "can_take", None)
    if can_take is not None:
        return bool(can_take(nbytes))
    if not pool.try_take(nbytes):
        return False
    pool.give_back(nbytes)
    return True


def _size(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_arguments(limit: int, model: ChargeModel) -> None:
    """`Ledger`'s argument checks: `ConfigError` unless ``limit`` is an int >= 0, `TypeError`
    unless ``model`` is a `ChargeModel`."""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ConfigError("limit", limit, "0..", f"limit must be an int >= 0, got {limit!r}")
    if not isinstance(model, ChargeModel):
        raise TypeError(f"model must be a ChargeModel, got {type(model).__name__}")


class Ledger:
    """Charges every payload a request retains, before it is parsed or stored.

    ``Ledger(limit, model=ChargeModel(), store=False, *, pool=None)``: ``limit`` in budget bytes
    (normally ``Limits.max_retained_bytes``), ``model`` the multipliers, ``store`` whether the
    response will be stored (doubles the input, buffered-output, accumulated and tool-result
    charges under the default model), ``pool`` an optional `ChargePool`.

    Every ``admit_*`` returns the charge it added (an int, budget bytes) so the caller can
    `release` exactly that later, and raises `BudgetExceeded` (or `PoolExhausted`) without
    changing anything when it does not fit. Methods that take a payload count its JSON nodes
    lexically unless ``nodes`` is given (pass the count from a counting pass you already made, or
    the node delta of a `JsonNodeCounter` fed the same bytes).

    Read-only state, all ints in budget bytes: ``limit``, ``charged``, ``remaining``, ``peak``
    (the highest ``charged`` so far, for metrics).
    """

    __slots__ = ("_charged", "_limit", "_model", "_peak", "_pool", "_store")

    def __init__(
        self,
        limit: int,
        model: ChargeModel = _DEFAULT_MODEL,
        store: bool = False,
        *,
        pool: ChargePool | None = None,
    ) -> None:
        _check_arguments(limit, model)
        self._limit = limit
        self._model = model
        self._store = bool(store)
        self._pool = pool
        self._charged = 0
        self._peak = 0

    def __repr__(self) -> str:
        return (
            f"Ledger(limit={self._limit}, charged={self._charged}, peak={self._peak}, "
            f"store={self._store}, model={self._model!r})"
        )

    # --- state -------------------------------------------------------------------------------

    @property
    def limit(self) -> int:
        """The limit in budget bytes."""
        return self._limit

    @property
    def charged(self) -> int:
        """Budget bytes currently charged."""
        return self._charged

    @property
    def remaining(self) -> int:
        """``limit - charged`` (0 after the limit was lowered below ``charged`` — never negative)."""
        return max(self._limit - self._charged, 0)

    @property
    def peak(self) -> int:
        """The highest ``charged`` so far."""
        return self._peak

    @property
    def model(self) -> ChargeModel:
        """The charge model."""
        return self._model

    @property
    def store(self) -> bool:
        """Whether store surcharges apply."""
        return self._store

    # --- core ----------------------------------------------------------------------------------

    def _fits(self, phase: Phase, need: int) -> None:
        """Raise unless ``need`` more budget bytes fit; changes nothing."""
        if self._charged + need > self._limit:
            raise BudgetExceeded(phase, need, self._charged, self._limit)

    def _commit(self, phase: Phase, charge: int, need: int | None = None) -> int:
        """Check that ``need`` (default: ``charge``) fits, draw ``charge`` from the pool, commit."""
        self._fits(phase, charge if need is None else need)
        if self._pool is not None and charge and not self._pool.try_take(charge):
            raise PoolExhausted(phase, charge)
        self._charged += charge
        if self._charged > self._peak:
            self._peak = self._charged
        return charge

    def _nodes(self, data: BytesLike, nodes: int | None) -> int:
        return count_json_nodes(data) if nodes is None else _size("nodes", nodes)

    # --- admissions ----------------------------------------------------------------------------

    def admit_input(
        self, raw: BytesLike, nodes: int | None = None, *, features: JsonFeatures | None = None
    ) -> int:
        """Charge the initial create body before it is parsed.

        Reference model: ``(32*len(raw) + 256*nodes)``, × 2 with store. Measured model:
        `ChargeModel.measured_input` of ``features`` (counted here when not given). Phase
        ``input``.
        """
        m, store, n = self._model, self._store, len(raw)
        self._fits("input", m.input_floor(n, store))
        if m.parse is not None:
            f = features if features is not None else json_features(raw)
            return self._commit("input", m.measured_input(f, store))
        return self._commit("input", m.input_charge(n, self._nodes(raw, nodes), store))

    def admit_output_parse(self, features: JsonFeatures) -> int:
        """The rest of a buffered upstream body's charge once it is complete and before it is
        parsed (measured model: `ChargeModel.measured_output` minus what `admit_output` charged
        for its chunks; reference model: 0, its chunks carry the whole price). Phase ``output``."""
        m = self._model
        if m.parse is None:
            return 0
        return self._commit(
            "output", m.measured_output(features, self._store) - m.output_floor(features.nbytes)
        )

    def admit_output(self, raw: BytesLike, nodes: int | None = None) -> int:
        """Charge a buffered upstream body (or the next chunk of one) while it is held and parsed.

        ``(64*len(raw) + 8192*nodes)``, × 2 with store. Release it (`release`) once the round's
        kept output items are admitted with `admit_accumulated`. When charging a body chunk by
        chunk, count with one `JsonNodeCounter` and pass each chunk's node delta as ``nodes``.
        Phase ``output``.
        """
        m, store, n = self._model, self._store, len(raw)
        if m.parse is not None:  # measured: the chunk and its joined copy; the parse comes later
            return self._commit("output", m.output_floor(n, store))
        self._fits("output", m.output_charge(n, 0, store))
        return self._commit("output", m.output_charge(n, self._nodes(raw, nodes), store))

    def admit_stream_chunk(self, raw: BytesLike) -> int:
        """Charge SSE bytes that now wait in the parser: retains ``32*len(raw)``.

        The chunk also needs room for its transient peak (``16*len``), so ``48*len`` must fit.
        The retained part stays until `release_stream_bytes` is called for those bytes. Not
        multiplied by store. Phase ``stream``.

        Serves the cost table (`budget.costs`) and the benchmarks; the gateway's stream reader
        charges whole frames by size instead (`admit_stream_bytes`, then `release`).
        """
        return self.admit_stream_bytes(len(raw))

    def admit_stream_bytes(self, nbytes: int, *, transient: bool = True) -> int:
        """`admit_stream_chunk` by size: retains ``32*nbytes``; with ``transient`` the parse's
        ``16*nbytes`` peak must also fit (``48*nbytes`` in all), without it only the retained
        part. Charging whole frames this way makes the outcome independent of how the stream was
        split into reads. Phase ``stream``."""
        m, n = self._model, _size("nbytes", nbytes)
        retained = m.stream_retained_charge(n)
        return self._commit("stream", retained, m.stream_chunk_need(n) if transient else retained)

    def release_stream_bytes(self, nbytes: int) -> int:
        """A frame completed: ``nbytes`` wire bytes left the parser buffer. Releases
        ``32*nbytes`` and returns that amount. Raises `ValueError` if more than is charged.

        The counterpart of `admit_stream_chunk`, for the cost table (`budget.costs`) and the
        benchmarks; the gateway releases the amount `admit_stream_bytes` returned (`release`)."""
        return self.release(self._model.stream_retained_charge(_size("nbytes", nbytes)))

    def check_stream_frame(self, data: BytesLike, nodes: int | None = None) -> int:
        """Transient check for parsing one complete SSE ``data:`` payload; keeps nothing.

        ``512*nodes`` (+ ``256*nodes`` with store) must fit on top of what is charged. Returns
        that transient amount; raises `BudgetExceeded` (phase ``stream_frame``) otherwise.
        """
        need = self._model.frame_charge(self._nodes(data, nodes), self._store)
        self._fits("stream_frame", need)
        return need

    def check_stream_frame_bounded(self, data: BytesLike) -> None:
        """`check_stream_frame` with the same outcome at less cost: a JSON text has at most one
        node per byte, so when ``frame_charge(len(data))`` fits the nodes are not counted (they
        cannot change the outcome); else they are, and `check_stream_frame` decides. Raises
        `BudgetExceeded` (phase ``stream_frame``) exactly when it does."""
        if self._charged + self._model.frame_charge(len(data), self._store) > self._limit:
            self.check_stream_frame(data)

    def stream_read_fits(self, nbytes: int, max_frame: int) -> bool:
        """Whether one bound for a whole upstream read of ``nbytes`` wire bytes, whose largest
        ``data:`` payload is ``max_frame`` bytes, fits on top of what is charged: the read's
        ``48*nbytes`` (held at once: its frames' copies and decodes; `admit_stream_bytes` of it
        whole) plus one frame's parse at one node per byte (`check_stream_frame_bounded`'s
        bound). That is at least every per-frame and per-slice check the read would make one by
        one, so when it fits none of them can trip. Changes nothing; raises nothing."""
        m = self._model
        need = m.stream_chunk_need(nbytes) + m.frame_charge(max_frame, self._store)
        return self._charged + need <= self._limit

    def stream_read_admits(self, nbytes: int, max_frame: int) -> bool:
        """`stream_read_fits` and, when it does, whether the widest frame's own charge
        (`admit_stream_bytes` of ``max_frame``) could be drawn from the pool now — the outcome of
        admitting it and releasing it at once, without doing either: the peak notes the frame as
        that would (``charged`` + its retained charge), the pool is only asked. For the stream
        fast path (`middleware.upstream.reader`): one check per read, no pool traffic per read.
        Raises nothing."""
        if not self.stream_read_fits(nbytes, max_frame):
            return False
        charge = self._model.stream_retained_charge(max_frame)
        if self._pool is not None and charge and not _pool_admits(self._pool, charge):
            return False
        if self._charged + charge > self._peak:
            self._peak = self._charged + charge
        return True

    def admit_accumulated(
        self, data: BytesLike, nodes: int | None = None, *, features: JsonFeatures | None = None
    ) -> int:
        """Charge what the stream accumulator keeps: delta text, a finished item, the terminal
        response. ``(32*len + 256*nodes)``, × 2 with store. Pass ``nodes=0`` for plain delta text.

        When a snapshot replaces accumulated state (an item's ``.done``, the terminal response),
        admit the snapshot first, then `release` the charges it replaces, so the peak stays
        honest. Phase ``accumulated``.
        """
        m, store, n = self._model, self._store, len(data)
        if m.parse is not None:
            raw = data if isinstance(data, bytes) else bytes(data)
            f = None if nodes == 0 else features if features is not None else json_features(raw)
            return self._commit("accumulated", m.measured_accumulated(raw, f, store))
        self._fits("accumulated", m.accumulated_charge(n, 0, store))
        return self._commit("accumulated", m.accumulated_charge(n, self._nodes(data, nodes), store))

    def admit_accumulated_texts(self, texts: Sequence[bytes]) -> list[int]:
        """`admit_accumulated` ``(text, nodes=0)`` of each delta text (UTF-8) in one commit; returns
        each one's charge, in order. All or nothing (`BudgetExceeded`, `PoolExhausted`): when the
        sum fits, so does each one-by-one admission it replaces (the stream fast path, store on)."""
        m, store = self._model, self._store
        measured = m.parse is not None
        charges = [
            m.measured_accumulated(t, None, store) if measured else m.accumulated_charge(len(t), 0, store)
            for t in texts
        ]
        self._commit("accumulated", sum(charges))
        return charges

    def admit_terminal(self, serialized: BytesLike, *, features: JsonFeatures | None = None) -> int:
        """Charge encoding the final response: reference ``4*len`` (+ ``2*len`` with store);
        measured `ChargeModel.measured_terminal` of the encoding's features (counted here when not
        given). Phase ``terminal``."""
        m = self._model
        if m.parse is not None:
            raw = serialized if isinstance(serialized, bytes) else bytes(serialized)
            f = features if features is not None else json_features(raw)
            return self._commit("terminal", m.measured_terminal(f, self._store))
        return self._commit("terminal", m.terminal_charge(len(serialized), self._store))

    def admit_tool_result(self, raw: BytesLike, nodes: int | None = None) -> int:
        """Charge a gateway tool result before it is kept: ``(32*len + 256*nodes)``, × 2 with
        store. Phase ``tool_result``."""
        m, store, n = self._model, self._store, len(raw)
        if m.parse is not None:  # a tool result is text, fed back as a JSON string
            text = raw if isinstance(raw, bytes) else bytes(raw)
            return self._commit("tool_result", m.measured_tool_result(text, store))
        self._fits("tool_result", m.tool_result_charge(n, 0, store))
        return self._commit("tool_result", m.tool_result_charge(n, self._nodes(raw, nodes), store))

    def admit_history(self, serialized: BytesLike, nodes: int | None = None) -> int:
        """Charge restored stored history: ``32*len + 8192*nodes`` (never × store). Phase
        ``history``.

        The by-payload form of `admit_history_size`, which is what the gateway and the cost table
        (`budget.costs`) call (history is charged from sizes summed in SQL, before decoding); the
        ledger tests use this one to check the history price on real payloads."""
        m, n = self._model, len(serialized)
        self._fits("history", m.history_charge(n, 0))
        return self._commit("history", m.history_charge(n, self._nodes(serialized, nodes)))

    def admit_history_size(self, nbytes: int, nodes: int) -> int:
        """Charge stored history from sizes summed in SQL, before any row is decoded: the same
        ``32*nbytes + 8192*nodes``. Phase ``history``."""
        charge = self._model.history_charge(_size("nbytes", nbytes), _size("nodes", nodes))
        return self._commit("history", charge)

    def reserve(self, nbytes: int) -> int:
        """Charge ``nbytes`` budget bytes for another owner, as is. Phase ``reserve``."""
        return self._commit("reserve", _size("nbytes", nbytes))

    # --- releases and limit --------------------------------------------------------------------

    def release(self, nbytes: int) -> int:
        """Give back ``nbytes`` budget bytes (an amount an ``admit_*`` or `reserve` returned).

        Returns ``nbytes``. Raises `ValueError` when ``nbytes`` is negative or more than is
        charged — a bookkeeping bug in the caller.
        """
        _size("nbytes", nbytes)
        if nbytes > self._charged:
            raise ValueError(f"cannot release {nbytes} budget bytes: only {self._charged} are charged")
        self._charged -= nbytes
        if self._pool is not None and nbytes:
            self._pool.give_back(nbytes)
        return nbytes

    def release_all(self) -> int:
        """Release everything still charged (end of request); returns the amount."""
        return self.release(self._charged)

    def lower_limit(self, limit: int) -> None:
        """Lower the limit to ``limit`` if it is smaller (a per-model override, a client header).

        Never raises the limit. Raises `BudgetExceeded` (phase ``limit``, ``requested`` 0) when
        what is already charged no longer fits; the limit is unchanged then.
        """
        _size("limit", limit)
        if limit >= self._limit:
            return
        if self._charged > limit:
            raise BudgetExceeded("limit", 0, self._charged, limit)
        self._limit = limit
