"""The charge model: every multiplier the ledger uses, as data (DESIGN.md §4).

All charges are exact integers in *budget bytes*: ``per_byte * wire_bytes + per_node * nodes``,
where nodes are counted lexically (`budget.nodes`). "× store" means the charge is multiplied by
``store_multiplier`` when the response will be stored (the request snapshot plus the persisted
projection); restored history is never multiplied.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Final

from .errors import ConfigError

__all__ = ["ChargeModel"]

_MAX_FACTOR: Final = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class ChargeModel:
    """Multipliers for every ledger owner; defaults are DESIGN.md §4 (the reference design).

    ==============================  =======  ===========================================================
    field                           default  charge
    ==============================  =======  ===========================================================
    ``input_per_byte``              32       initial create body, per raw byte (× store)
    ``input_per_node``              256      initial create body, per JSON node (× store)
    ``output_per_byte``             64       buffered upstream body while held and parsed (× store)
    ``output_per_node``             8192     buffered upstream body, per node (× store)
    ``stream_retained_per_byte``    32       SSE bytes waiting in the parser, retained until released
    ``stream_transient_per_byte``   16       SSE chunk transient peak, must fit on top (not kept)
    ``frame_per_node``              512      parsing one complete SSE ``data:`` payload (transient)
    ``frame_store_extra_per_node``  256      … plus this per node when store is on
    ``accumulated_per_byte``        32       what the stream accumulator keeps (× store)
    ``accumulated_per_node``        256      … per node (× store)
    ``terminal_per_byte``           4        encoding the final response, per serialized byte
    ``terminal_store_extra_per_byte`` 2      … plus this per byte when store is on
    ``tool_per_byte``               32       a gateway tool result fed back to the model (× store)
    ``tool_per_node``               256      … per node (× store)
    ``history_per_byte``            32       restored stored history, per serialized byte (never × store)
    ``history_per_node``            8192     … per node
    ``store_multiplier``            2        the "× store" factor
    ==============================  =======  ===========================================================

    Every field is an int in ``0..=1048576`` (``store_multiplier`` in ``1..=1048576``); anything
    else raises `ConfigError`. Two models ship: `ChargeModel.default` (these numbers, so operators
    can reason about them) and `ChargeModel.cpython` (measured on CPython by
    ``python -m budget.calibrate``, several times cheaper and still sound).
    """

    input_per_byte: int = 32
    input_per_node: int = 256
    output_per_byte: int = 64
    output_per_node: int = 8192
    stream_retained_per_byte: int = 32
    stream_transient_per_byte: int = 16
    frame_per_node: int = 512
    frame_store_extra_per_node: int = 256
    accumulated_per_byte: int = 32
    accumulated_per_node: int = 256
    terminal_per_byte: int = 4
    terminal_store_extra_per_byte: int = 2
    tool_per_byte: int = 32
    tool_per_node: int = 256
    history_per_byte: int = 32
    history_per_node: int = 8192
    store_multiplier: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 1 if f.name == "store_multiplier" else 0
            allowed = f"{low}..={_MAX_FACTOR}"
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(
                    f.name, value, allowed, f"{f.name} must be an int in {allowed}, got {value!r}"
                )
            if not low <= value <= _MAX_FACTOR:
                raise ConfigError(f.name, value, allowed)

    @classmethod
    def default(cls) -> ChargeModel:
        """The reference model of DESIGN.md §4 (equal to ``ChargeModel()``)."""
        return cls()

    @classmethod
    def cpython(cls) -> ChargeModel:
        """A model measured on CPython: what parsing really retains, plus a safety margin.

        Produced by ``python -m budget.calibrate`` (tracemalloc over pathological shapes, for
        ``json.loads`` and ``orjson.loads``) on CPython 3.11.7, x86-64 Linux, 64-bit, with a
        1.25 safety margin; re-run it when the interpreter changes and paste its output here.
        The input charge covers what either parser retains and the transient peak of
        ``json.loads`` (the gateway's parser); see `budget.calibrate.derive_model` for how each
        field is built. Soundness against both parsers is a tested property
        (tests/test_budget_soundness.py). Choose it when real memory, not the reference numbers,
        is what you size workers for.
        """
        # --- generated by `python -m budget.calibrate` (CPython 3.11.7, x86_64) ---
        return cls(
            input_per_byte=12,
            input_per_node=104,
            output_per_byte=23,
            output_per_node=168,
            stream_retained_per_byte=7,
            stream_transient_per_byte=3,
            frame_per_node=88,
            frame_store_extra_per_node=48,
            accumulated_per_byte=6,
            accumulated_per_node=104,
            terminal_per_byte=7,
            terminal_store_extra_per_byte=4,
            tool_per_byte=12,
            tool_per_node=104,
            history_per_byte=12,
            history_per_node=168,
            store_multiplier=2,
        )
        # --- end generated ---

    # Charges, in budget bytes. Pure functions of sizes; the ledger and the cost table share them.

    def _store(self, store: bool) -> int:
        return self.store_multiplier if store else 1

    def input_charge(self, nbytes: int, nodes: int, store: bool) -> int:
        """Initial create body: ``(input_per_byte*nbytes + input_per_node*nodes)`` × store."""
        return (self.input_per_byte * nbytes + self.input_per_node * nodes) * self._store(store)

    def output_charge(self, nbytes: int, nodes: int, store: bool) -> int:
        """Buffered upstream body while held and parsed, × store."""
        return (self.output_per_byte * nbytes + self.output_per_node * nodes) * self._store(store)

    def stream_retained_charge(self, nbytes: int) -> int:
        """SSE bytes waiting in the parser: ``stream_retained_per_byte * nbytes`` (retained)."""
        return self.stream_retained_per_byte * nbytes

    def stream_chunk_need(self, nbytes: int) -> int:
        """What an SSE chunk needs to fit: retained plus its transient peak."""
        return (self.stream_retained_per_byte + self.stream_transient_per_byte) * nbytes

    def frame_charge(self, nodes: int, store: bool) -> int:
        """Transient need of parsing one complete SSE ``data:`` payload."""
        return (self.frame_per_node + (self.frame_store_extra_per_node if store else 0)) * nodes

    def accumulated_charge(self, nbytes: int, nodes: int, store: bool) -> int:
        """What the stream accumulator keeps (delta text, items, terminal response), × store."""
        return (self.accumulated_per_byte * nbytes + self.accumulated_per_node * nodes) * self._store(store)

    def terminal_charge(self, nbytes: int, store: bool) -> int:
        """Encoding the final response: ``terminal_per_byte`` (+ the store extra) per byte."""
        return (self.terminal_per_byte + (self.terminal_store_extra_per_byte if store else 0)) * nbytes

    def tool_result_charge(self, nbytes: int, nodes: int, store: bool) -> int:
        """A gateway tool result fed back to the model, × store."""
        return (self.tool_per_byte * nbytes + self.tool_per_node * nodes) * self._store(store)

    def history_charge(self, nbytes: int, nodes: int) -> int:
        """Restored stored history (never × store)."""
        return self.history_per_byte * nbytes + self.history_per_node * nodes
