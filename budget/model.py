"""The charge model: every multiplier the ledger uses, as data (DESIGN.md §4).

All charges are exact integers in *budget bytes*: ``per_byte * wire_bytes + per_node * nodes``,
where nodes are counted lexically (`budget.nodes`). "× store" means the charge is multiplied by
``store_multiplier`` when the response will be stored (the request snapshot plus the persisted
projection); restored history is never multiplied.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Final

from .errors import ConfigError
from .limits import upstream_body_clamp

if TYPE_CHECKING:
    from .features import JsonFeatures

__all__ = ["ChargeModel", "ParsePrices", "text_serialized_bound"]

_MAX_FACTOR: Final = 1 << 20
ACCUMULATED_FRAGMENTS: Final = 100_000
"""Fragments CPython 3.11's C JSON encoder holds before it joins them (``_PyAccu``)."""
_CTRL: Final = bytes(range(0x20)) + b'"\\'
_CTRL_ESCAPE: Final = bytes(range(0x20))
_HIGH: Final = bytes(range(0x80, 0x100))
_CONT: Final = bytes(range(0x80, 0xC0))


def text_serialized_bound(raw: bytes) -> int:
    """Largest ``json.dumps`` (``ensure_ascii``) of the text whose UTF-8 bytes are ``raw``, as a
    JSON string, in bytes: 2 quotes, 6 per control byte (``\\u0001``), 2 per ``"`` or
    backslash, 3 per non-ASCII byte (``é`` -> ``\\u00e9``), 1 per other byte."""
    n = len(raw)
    if raw.isascii():
        special = n - len(raw.translate(None, _CTRL))
        controls = n - len(raw.translate(None, _CTRL_ESCAPE))
        return 2 + n + special + 4 * controls
    high = n - len(raw.translate(None, _HIGH))
    special = n - len(raw.translate(None, _CTRL))
    controls = n - len(raw.translate(None, _CTRL_ESCAPE))
    return 2 + n + 2 * high + special + 4 * controls


def text_str_bound(raw: bytes) -> int:
    """Bytes of the `str` that ``raw.decode()`` builds (CPython 3.11, 64-bit): ``49 + len`` for
    ASCII, else at most ``76 + 4 * characters``."""
    if raw.isascii():
        return 49 + len(raw)
    return 76 + 4 * (len(raw) - len(raw.translate(None, _CONT)) + 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsePrices:
    """What CPython 3.11 (64-bit) builds per lexical feature when it parses JSON, in bytes: the
    measured model's prices (`ChargeModel.measured`), measured with `tracemalloc` for
    ``json.loads`` and `budget.loads_strict` by ``python -m budget.calibrate``.

    * ``object`` / ``empty_object`` — a `dict` with members (its base; ``member`` per key on top,
      a linear bound of CPython's dict sizes for every member count) / ``{}``;
    * ``array`` / ``empty_array`` / ``element`` — a `list` (base, ``[]``, per element, a linear
      bound of the scanner's append growth);
    * ``number`` — an `int` or `float` object (the ints ``-5..=256`` are shared and cost nothing),
      plus ``number_byte`` per byte of the token (big integers);
    * ``parse_member`` — transient per key while parsing: the scanner's key memo and the
      ``object_pairs_hook`` pairs list of `loads_strict`; ``memo_member`` — the key memo alone
      (plain ``json.loads``, the upstream parser);
    * ``dump_token`` — transient per string or number token while ``json.dumps`` encodes (each
      becomes a new `str` fragment before the join);
    * ``base`` — per payload: the parser's and encoder's own objects;
    * ``margin_eighths`` — every measured charge is multiplied by this over 8 (9: +12.5 %), head
      room for allocator rounding across interpreter builds.

    Strings are priced by `budget.JsonFeatures.string_bytes` itself (exact sizes or bounds).
    """

    object: int = 144
    empty_object: int = 64
    member: int = 40
    array: int = 94
    empty_array: int = 56
    element: int = 10
    number: int = 32
    number_byte: int = 1
    parse_member: int = 112
    memo_member: int = 48
    dump_token: int = 56
    base: int = 1536
    margin_eighths: int = 9

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 8 if f.name == "margin_eighths" else 0
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= _MAX_FACTOR:
                allowed = f"{low}..={_MAX_FACTOR}"
                raise ConfigError(
                    f.name, value, allowed, f"{f.name} must be an int in {allowed}, got {value!r}"
                )

    def parsed(self, f: JsonFeatures) -> int:
        """Bytes the parsed value of a text with features ``f`` retains (strings included)."""
        nonempty_objects = max(f.objects - f.empty_objects, 0)
        nonempty_arrays = max(f.arrays - f.empty_arrays, 0)
        return (
            f.string_bytes
            + self.empty_object * f.empty_objects
            + self.object * nonempty_objects
            + self.member * f.members
            + self.empty_array * f.empty_arrays
            + self.array * nonempty_arrays
            + self.element * f.elements
            + self.number * max(f.numbers - f.small_ints, 0)
            + self.number_byte * f.number_bytes
        )

    def parse_peak(self, f: JsonFeatures, *, strict: bool = True) -> int:
        """What a parse of ``f``'s text needs at its peak: the worse of decoding the bytes
        (`decode_peak`) and the decoded text with the parsed value, the transient key memo /
        pairs (``strict``: `budget.loads_strict`; else plain ``json.loads``, the key memo only)
        and, for text with escapes or wide characters, the scanner's buffer for the string
        it is building (the longest at worst)."""
        # the scanner builds a string with escapes or wide characters in a buffer, then copies it
        builder = f.longest_string if f.nonascii_bytes or f.escaped else 0
        per_member = self.parse_member if strict else self.memo_member
        return max(self.decode_peak(f), f.text_bytes + self.parsed(f) + per_member * f.members + builder)

    @staticmethod
    def decode_peak(f: JsonFeatures) -> int:
        """Peak of ``bytes.decode()`` of the text: exact for ASCII; else CPython's UTF-8 decoder
        writes into a buffer of one character per byte and widens it as wider characters come,
        holding the old and the new buffer at once: 2, 3 or 6 bytes per wire byte for a widest
        character of 1 (Latin-1), 2 or 4 bytes."""
        if f.nonascii_bytes == 0:
            return f.text_bytes
        return 76 + f.nbytes * {1: 2, 2: 3}.get(f.text_width, 6)

    def dump_peak(self, f: JsonFeatures) -> int:
        """What one compact ``json.dumps(...).encode()`` of the parsed value needs at its peak:
        the encoder's fragments, the joined `str` and its `bytes` (3 × `serialized_bound`), plus
        the fragments list: CPython 3.11's encoder keeps at most `ACCUMULATED_FRAGMENTS` of them
        before joining, a list slot each (a token and a separator per node) and a new `str` per
        string or number token (``dump_token``)."""
        fragments = min(2 * f.nodes + 2, ACCUMULATED_FRAGMENTS)
        # a token fragment is followed by a separator (``,`` or ``:``) or a closing bracket, so at
        # most half the held fragments (plus one per container) are tokens
        tokens = min(f.strings + f.numbers, ACCUMULATED_FRAGMENTS // 2 + f.objects + f.arrays)
        return 3 * f.serialized_bound + 8 * fragments + self.dump_token * tokens

    def request_peak(self, f: JsonFeatures) -> int:
        """The parsed value's worst moment: parsing it, or encoding it with the value alive."""
        parsed = self.parsed(f)
        return max(self.parse_peak(f), parsed + self.dump_peak(f))

    def margin(self, charge: int) -> int:
        """``charge`` with the margin: ``ceil(charge * margin_eighths / 8)``."""
        return -(-charge * self.margin_eighths // 8)


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
    else raises `ConfigError`. Two models ship (DESIGN.md §4):

    * `ChargeModel.reference` — these numbers (``ChargeModel()``), so operators can reason about
      them; ``parse`` is None and every charge is ``per_byte * bytes + per_node * nodes``;
    * `ChargeModel.measured` — the gateway's default: ``parse`` holds `ParsePrices`, and the
      owners that have their payload (input, buffered output, tool results, accumulated output)
      are priced from its `budget.JsonFeatures`, counting every copy alive at once (raw bytes,
      decoded text, parsed objects, the re-serialised upstream body, with store the persisted
      projection). The per-byte / per-node fields then serve only what is known by size alone
      (stream bytes, frames, the terminal encode, history summed in SQL): sound bounds measured
      by ``python -m budget.calibrate``.
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
    parse: ParsePrices | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "parse":
                if self.parse is not None and not isinstance(self.parse, ParsePrices):
                    raise ConfigError("parse", self.parse, "ParsePrices or None")
                continue
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
    def reference(cls) -> ChargeModel:
        """The reference model of DESIGN.md §4 (equal to ``ChargeModel()``)."""
        return cls()

    @classmethod
    def named(cls, name: str) -> ChargeModel:
        """``"measured"`` or ``"reference"`` (the ``--charge-model`` values); else `ConfigError`."""
        if name == "measured":
            return cls.measured()
        if name == "reference":
            return cls.reference()
        raise ConfigError("charge_model", name, "measured or reference")

    @property
    def name(self) -> str:
        """``"measured"`` when ``parse`` is set, else ``"reference"``."""
        return "reference" if self.parse is None else "measured"

    @classmethod
    def measured(cls) -> ChargeModel:
        """The measured model (the gateway's default): feature prices (`ParsePrices`) for the
        owners that hold their payload, and size-only bounds for the rest.

        The size-only fields were produced by ``python -m budget.calibrate`` (tracemalloc over
        pathological shapes, for ``json.loads`` and ``orjson.loads``) on CPython 3.11.7, x86-64
        Linux, with a 1.25 safety margin (``history_per_byte`` raised to 16: restored history is
        decoded, parsed and re-serialised, up to 4 bytes per character each); re-run it when the
        interpreter changes. Soundness and tightness are tested properties
        (tests/budget/test_budget_measured.py).
        """
        # --- size-only bounds generated by `python -m budget.calibrate` (CPython 3.11.7, x86_64) ---
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
            history_per_byte=16,
            history_per_node=168,
            store_multiplier=2,
            parse=ParsePrices(),
        )
        # --- end generated ---

    # Measured charges: from a payload's features (only when ``parse`` is set).

    def _parse(self) -> ParsePrices:
        if self.parse is None:
            raise ValueError("the reference model has no feature prices")
        return self.parse

    def measured_input(self, f: JsonFeatures, store: bool) -> int:
        """Initial create body (measured): raw bytes + the worst of parsing it (decoded text,
        parsed value, key memo) and re-serialising it for the upstream (`ParsePrices.dump_peak`
        with the parsed value alive), with store + the persisted projection (`str` and `bytes`);
        × the margin."""
        p = self._parse()
        projection = 2 * f.serialized_bound if store else 0
        return p.margin(p.base + f.nbytes + p.request_peak(f) + projection)

    def measured_output(self, f: JsonFeatures, store: bool) -> int:
        """Buffered upstream body (measured), while it is held and parsed: its chunks and the
        joined body (2 × bytes) + the parse's peak; × the margin. What the round keeps of it is
        the accumulated charge (with store's projection), its encoding for the client the
        terminal charge. ``store`` changes nothing here."""
        p = self._parse()
        return p.margin(p.base + 2 * f.nbytes + p.parse_peak(f, strict=False))

    def measured_terminal(self, f: JsonFeatures, store: bool) -> int:
        """Encoding the final response (measured), from the features of its encoding: the
        encoder's peak (`ParsePrices.dump_peak`), × the margin. ``store`` adds nothing: the
        persisted projection of the output is already in the accumulated charges (× store)."""
        p = self._parse()
        return p.margin(p.dump_peak(f))

    def measured_tool_result(self, raw: bytes, store: bool) -> int:
        """A gateway tool result's text (measured): its bytes, its `str`, its encoding as a JSON
        string in the next upstream body (`str` and `bytes`), with store the projection too."""
        p = self._parse()
        copies = 4 if store else 2
        return p.margin(p.base + len(raw) + text_str_bound(raw) + copies * text_serialized_bound(raw))

    def measured_accumulated(self, data: bytes, f: JsonFeatures | None, store: bool) -> int:
        """What the stream accumulator keeps (measured): the parsed value of ``data`` (features
        ``f``), or with ``f`` None the delta text ``data`` as a `str`; with store + the projection."""
        p = self._parse()
        if f is None:
            kept = text_str_bound(data) + (2 * text_serialized_bound(data) if store else 0)
        else:
            kept = p.parsed(f) + (2 * f.serialized_bound if store else 0)
        return p.margin(kept)

    def input_floor(self, nbytes: int, store: bool = False) -> int:
        """A lower bound of the input charge of any ``nbytes`` body: checked before any counting.
        Measured: the raw bytes plus their decoded text (at least half a byte per byte)."""
        if self.parse is None:
            return self.input_charge(nbytes, 0, store)
        return nbytes + nbytes // 2

    def output_floor(self, nbytes: int, store: bool = False) -> int:
        """What each buffered upstream chunk is charged while it is read (measured: it and its
        copy in the joined body; the parse is charged once the body is complete)."""
        if self.parse is None:
            return self.output_charge(nbytes, 0, store)
        return 2 * nbytes

    def body_clamp(self, limit: int) -> int:
        """Largest raw create body any request under ``limit`` could be admitted with, in bytes:
        the limit over this model's smallest per-byte input price (reference: ``limit // 32``;
        measured: ``limit * 2 // 3``)."""
        if self.parse is None:
            return limit // self.input_per_byte if self.input_per_byte else limit
        return limit * 2 // 3

    def upstream_clamp(self, limit: int) -> int:
        """Largest buffered upstream body read under ``limit``, in bytes (reference:
        ``limit // 8``, DESIGN.md §3; measured: ``limit * 2 // 5``, its smallest output price)."""
        if self.parse is None:
            return upstream_body_clamp(limit)
        return limit * 2 // 5

    def reserve_per_byte(self) -> int:
        """Budget bytes per declared body byte that admission reserves up front (store on): the
        reference input price × store; measured: 8 (raw, text, parsed text, two encodings)."""
        if self.parse is None:
            return self.input_per_byte * self.store_multiplier
        return 8

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
