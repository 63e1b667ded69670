"""Lexical JSON node counting, incremental and chunking-independent, at C speed.

A *node* (DESIGN.md §4) is, outside strings: each string start (object keys count), ``{``,
``[``, ``true``, ``false``, ``null`` and each number. Nothing inside a string counts. Counting is
lexical: it never validates, never raises on malformed input (only the depth cap raises
`JsonTooDeep`), and gives the same count however the bytes are split into chunks.

Exact lexical rules, which also define the count of malformed input:

* Backslashes pair up left to right everywhere: in a run of backslashes, each pair is inert and
  an unpaired last backslash *escapes* the next byte. An escaped ``"`` never opens or closes a
  string; an escaped ``\\`` is part of the pair. (Inside strings this is JSON's own rule; outside
  strings backslashes are invalid JSON anyway.)
* Outside strings, an unescaped ``"`` opens a string, which ends at the next unescaped ``"``.
* Outside strings, ``{``, ``[``, and each of the bytes ``t``, ``f``, ``n`` count one node (the
  first letters of ``true``/``false``/``null``; no other valid token contains them); a number
  starts at a byte in ``-0123456789`` whose preceding byte is not one of ``-+.0123456789eE``.
* Depth: ``{``/``[`` add one, ``}``/``]`` remove one but never below zero. Going past
  ``max_depth`` raises `JsonTooDeep` with ``depth = max_depth + 1``.

How it is fast without C code of our own: input is processed in pieces of at most 64 KiB. A
piece without backslashes is split on quotes (they simply alternate) and its outside-string parts
joined; any other piece goes through one `re.subn` that replaces every string literal by a space
(the pattern scans string bodies with a single-byte negated class, which `re` runs as a tight C
loop, and decides escaped quotes with fixed-width look-behinds). What remains is the small
"outside strings" text, on which `bytes.count` finds ``{``, ``[``, ``t``, ``f``, ``n``, one
`bytes.translate` plus a `bytes.count` finds number starts, and `bytes.translate` +
`itertools.accumulate` over the brackets alone (as signed bytes) gives the depth.

Python code runs per piece, never per byte or per node, and nothing is retained. The C helpers
build their results from per-string slices internally, so counting has a transient peak bounded by
the piece size: about 3 MiB at worst (measured on a body of one-character strings), freed before
the next piece. Backslash runs of 8 or more before a quote (real encoders produce them only in
deeply nested JSON-in-JSON) fall back, for that piece only, to pairing backslashes with
`bytes.replace` first; the result is identical.

State carried between chunks is four flags and three ints: inside a string, an unpaired trailing
backslash, whether the last byte outside strings was a number byte, and nodes / depth /
deepest depth seen.
"""

from __future__ import annotations

import itertools
import re
from array import array
from operator import sub
from typing import Final

from .errors import JsonTooDeep
from .features import _ASCII_STR, FeatureTally, JsonFeatures, _small_ints

__all__ = ["DEFAULT_MAX_DEPTH", "JsonFeatures", "JsonNodeCounter", "count_json_nodes", "json_features"]

DEFAULT_MAX_DEPTH: Final = 128
"""The gateway's nesting cap for client JSON (DESIGN.md §3 order of checks)."""

_PIECE: Final = 65536
"""Bytes processed per step: bounds transient memory, keeps per-step overhead negligible."""

_BACKSLASH: Final = 0x5C
_QUOTE: Final = 0x22
_BS_RE: Final = rb"\\"  # one literal backslash, in regex syntax
_LONG_RUN: Final = 8  # backslash runs this long before a quote take the slow path
_LONG: Final = b"\\" * _LONG_RUN


def _run_is(odd: bool, suffix: bytes) -> bytes:
    """Regex assertions: the backslash run right before ``suffix`` (which ends at the current
    position) is odd (``odd=True``) or even, and shorter than `_LONG_RUN`; longer runs fail."""

    def level(n: int) -> bytes:  # n backslashes are known to be there
        if n == _LONG_RUN:
            return b"(?!)"
        exact = b"(?<!" + _BS_RE * (n + 1) + suffix + b")"
        longer = b"(?<=" + _BS_RE * (n + 1) + suffix + b")" + level(n + 1)
        if (n % 2 == 1) == odd:
            return b"(?:" + exact + b"|" + longer + b")"
        return longer

    return level(0)


# An opening quote: not escaped (checked after the quote, so `re` can search for the literal).
_OPEN: Final = b'"' + _run_is(odd=False, suffix=b'"')
# A string body after its opening quote, through the closing quote. `[^"]*+` is the fast part;
# a quote it stops at closes the string at once when no backslash precedes it (the common case);
# otherwise each quote is escaped (odd run: continue) or closing (even run: stop).
_BODY: Final = (
    rb'[^"]*+(?:(?<!\\)"|(?:'
    + _run_is(odd=True, suffix=b"")
    + rb'"[^"]*+)*+"(?<!'
    + _BS_RE * _LONG_RUN
    + rb'"))'
)
_STRING_RE: Final = re.compile(_OPEN + _BODY)
_CONTINUE_RE: Final = re.compile(_BODY)
_OPEN_RE: Final = re.compile(_OPEN)

_NUM_START: Final = b"-0123456789"
_NUM_BYTES: Final = frozenset(b"-0123456789+.eE")
# Outside-string byte classes for number starts: '1' may start a number, '2' only continues one.
_NUM_CLASS: Final = bytes(0x31 if c in _NUM_START else 0x32 if c in b"+.eE" else 0x30 for c in range(256))
_NOT_BRACKETS: Final = bytes(c for c in range(256) if c not in b"{[}]")
# Brackets as signed bytes: +1 opens, -1 (0xFF) closes; read back through array("b").
_SIGNED: Final = bytes(0x01 if c in b"{[" else 0xFF if c in b"}]" else 0 for c in range(256))


class JsonNodeCounter:
    """Count JSON nodes incrementally over chunks of bytes; track and cap nesting depth.

    ``JsonNodeCounter(max_depth=128)``; ``max_depth=None`` disables the cap and depth tracking
    (then ``depth`` and ``max_depth_seen`` stay 0). Feed chunks with `feed`, which returns the
    nodes counted so far. Rules and cost: see the module docstring. The count for a byte string
    is the same for every way of splitting it into chunks, empty chunks included.

    Raises `JsonTooDeep` from `feed` when nesting goes past ``max_depth``; after that the counter
    is spent and every further `feed` raises the same error. Not thread-safe (one per payload).
    """

    __slots__ = (
        "_bs",
        "_error",
        "_feat",
        "_in_string",
        "_num",
        "_pending",
        "_plain",
        "_tally",
        "depth",
        "max_depth",
        "max_depth_seen",
        "nbytes",
        "nodes",
    )

    def __init__(self, max_depth: int | None = DEFAULT_MAX_DEPTH, *, features: bool = False) -> None:
        if max_depth is not None and (
            not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 1
        ):
            raise ValueError(f"max_depth must be a positive int or None, got {max_depth!r}")
        self.max_depth: int | None = max_depth
        self.nodes = 0
        """Nodes counted so far."""
        self.depth = 0
        """Current nesting depth (0 outside any container)."""
        self.max_depth_seen = 0
        """Deepest nesting reached so far."""
        self._in_string = False
        self._bs = False  # an unpaired backslash ended the previous chunk
        self._num = False  # the last byte outside strings was a number byte
        self._error: JsonTooDeep | None = None
        self.nbytes = 0
        """Bytes fed so far."""
        self._feat = features
        self._tally: FeatureTally | None = None  # with features: made by the first piece counted
        self._plain: tuple[int, ...] | None = None  # the features of a whole text counted at once
        self._pending = b""  # with features: the bytes of the current 64 KiB piece so far

    def features(self) -> JsonFeatures:
        """What the measured charge model prices, for the bytes fed so far (`JsonFeatures`).

        Only for a counter made with ``features=True`` (else `ValueError`). Such a counter cuts
        the text into 64 KiB pieces at fixed offsets of the whole text, holding back the current
        piece, so its features (and its nodes and depth, which lag by less than one piece until
        this is called) are the same for every chunking. Raises `JsonTooDeep` like `feed`."""
        if not self._feat:
            raise ValueError("this JsonNodeCounter was made without features=True")
        self._flush()
        if self._plain is not None:
            return JsonFeatures._make(self._plain)
        return self._ensure_tally().result(self.nbytes, self.nodes)

    def _ensure_tally(self) -> FeatureTally:
        """The tally, made on first use (it goes on from a whole text counted at once)."""
        tally = self._tally
        if tally is None:
            tally = self._tally = FeatureTally()
            if self._plain is not None:
                tally.set_plain(self._plain)
                self._plain = None
        return tally

    @property
    def in_string(self) -> bool:
        """True when the bytes fed so far end inside a string literal."""
        return self._in_string

    def feed(self, chunk: bytes | bytearray | memoryview) -> int:
        """Count the nodes in ``chunk``, continuing from the previous chunks; return the total.

        ``chunk`` is any bytes-like object (copied only if it is not `bytes`). Raises
        `JsonTooDeep` when nesting goes past ``max_depth``.
        """
        if self._error is not None:
            raise self._error
        data = chunk if isinstance(chunk, bytes) else bytes(chunk)
        n = len(data)
        self.nbytes += n
        if self._feat:  # features: pieces aligned on the whole text, whatever the chunks
            self._aligned(data)
            return self.nodes
        if n <= _PIECE:
            if n:
                self._piece(data)
        else:
            for start in range(0, n, _PIECE):
                self._piece(data[start : start + _PIECE])
        return self.nodes

    def _aligned(self, data: bytes) -> None:
        """With features, the text is cut into pieces at fixed offsets of the whole text (at most
        one piece is held back), so that features, like nodes, do not depend on the chunking."""
        pending = self._pending + data if self._pending else data
        whole = len(pending) - len(pending) % _PIECE
        for start in range(0, whole, _PIECE):
            self._piece(pending[start : start + _PIECE])
        self._pending = pending[whole:]

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, b""
            if self.nbytes == len(pending) and self._whole(pending):
                return  # a whole text in one plain piece: counted at once (`_plain_whole`)
            self._piece(pending)

    def _whole(self, x: bytes) -> bool:
        """Count ``x``, the whole text fed (one piece, nothing counted before it), in one go when
        it is plain (`_plain_whole`): the same nodes, depth and features as `_piece` (a later
        `feed` goes on from there: `_ensure_tally`); False, changing nothing, when it is not."""
        found = _plain_whole(x, self.max_depth)
        if found is None:
            return False
        values, out_last, depth, deepest = found
        self.nodes = values[1]
        self._num = out_last in _NUM_BYTES
        if self.max_depth is not None:
            self.depth = depth
            self.max_depth_seen = deepest
        self._plain = values
        return True

    def _piece(self, x: bytes) -> None:
        """Count one piece (1..64 KiB, non-empty), continuing the lexical state of the previous
        one: the carried escape and open string first, then the strings, then what lies outside
        them (structure, literals, numbers, depth). The common path (no state carried from the
        previous piece) calls no helper: this runs once per fed chunk."""
        tally = self._ensure_tally() if self._feat else None
        if tally is not None:
            tally.raw(x)
        if self._bs or x[-1] == _BACKSLASH:
            x = self._edge_backslashes(x)
            if not x:
                return
        if self._in_string:
            x = self._close_string(x, tally)
            if not x:
                return
        if b"\\" not in x:  # no escapes: quotes simply alternate, and splitting is cheaper
            parts = x.split(b'"')
            quotes = len(parts) - 1
            nodes = (quotes + 1) >> 1
            out = b" ".join(parts[0::2])
            if tally is not None:
                self._tally_plain(tally, parts[1::2], quotes & 1, x.isascii())
            if quotes & 1:  # the last string runs to the end of the piece
                self._in_string = True
        else:
            subject = x
            out, nodes = _STRING_RE.subn(b" ", x)
            if _LONG in out:  # a long backslash run may hide a quote's meaning: pair them first
                subject = x.replace(b"\\\\", b"__")
                out, nodes = _STRING_RE.subn(b" ", subject)
            if tally is not None:
                tally.escaped_strings(_STRING_RE.findall(subject))
            if _QUOTE in out and (m := _OPEN_RE.search(out)) is not None:
                nodes += 1  # an unterminated string runs to the end of the piece
                if tally is not None:
                    tally.open_segment(out[m.end() :], new=True)
                out = out[: m.start()]
                self._in_string = True
        if out:  # outside strings: containers, literals, numbers (one carried over is not new)
            if tally is not None:  # it counts the same containers, literals and numbers
                nodes += tally.outside(out, self._num)
            else:
                nodes += (
                    out.count(b"{") + out.count(b"[") + out.count(b"t") + out.count(b"f") + out.count(b"n")
                )
                classes = out.translate(_NUM_CLASS)
                nodes += classes.count(b"01")
                if classes[0] == 0x31 and not self._num:
                    nodes += 1
            self._num = out[-1] in _NUM_BYTES
            if self.max_depth is not None:
                brackets = out.translate(_SIGNED, _NOT_BRACKETS)
                if brackets:
                    self._track_depth(brackets, nodes)
        self.nodes += nodes
        if self._bs:
            self._num = False

    def _edge_backslashes(self, x: bytes) -> bytes:
        """Apply the backslash the previous piece ended with (it escapes ``x[0]``, which becomes
        ``_``), and hold back an unpaired backslash at the end of ``x`` for the next piece; returns
        what is left to count (possibly empty)."""
        if self._bs:
            self._bs = False
            self._num = False
            if x[0] == _BACKSLASH or x[0] == _QUOTE:
                x = b"_" + x[1:]
        if x[-1] == _BACKSLASH:
            run = len(x) - len(x.rstrip(b"\\"))
            if run & 1:  # an unpaired backslash at the end escapes the next chunk's first byte
                self._bs = True
                x = x[:-1]
        return x

    def _close_string(self, x: bytes, tally: FeatureTally | None) -> bytes:
        """Inside a string carried from the previous piece: returns what follows its closing quote
        (empty when the whole piece is inside the string, or the quote ends the piece)."""
        m = _CONTINUE_RE.match(x)
        if m is None and _LONG in x:
            x = x.replace(b"\\\\", b"__")
            m = _CONTINUE_RE.match(x)
        if m is None:
            if tally is not None:
                tally.open_segment(x)
            return b""  # the whole piece is inside the string
        self._in_string = False
        self._num = False
        end = m.end()
        if tally is not None:
            tally.open_segment(x[: end - 1])
            tally.close_open()
        return x[end:]

    @staticmethod
    def _tally_plain(tally: FeatureTally, strings: list[bytes], open_last: int, ascii: bool) -> None:
        """Features of the strings of a piece without backslashes; with ``open_last`` the last
        one runs past the end of the piece (an open segment)."""
        if open_last:
            tally.plain_strings(strings[:-1], ascii)
            tally.open_segment(strings[-1], new=True)
        else:
            tally.plain_strings(strings, ascii)

    def _track_depth(self, brackets: bytes, nodes: int) -> None:
        levels = list(itertools.accumulate(array("b", brackets), initial=self.depth))
        if min(levels) >= 0:
            deepest = max(levels)
            depth = levels[-1]
        else:  # clamp at zero: depth_k = level_k - min(0, min(level_0..level_k))
            floors = itertools.accumulate(levels, min, initial=0)
            next(floors)  # floors now yields min(0, level_0..level_k) alongside level_k
            reflected = list(map(sub, levels, floors))
            deepest = max(reflected)
            depth = reflected[-1]
        max_depth = self.max_depth
        assert max_depth is not None
        if deepest > max_depth:
            self.max_depth_seen = max(self.max_depth_seen, max_depth + 1)
            self.depth = max_depth + 1
            self.nodes += nodes
            self._error = JsonTooDeep(depth=max_depth + 1, max_depth=max_depth)
            raise self._error
        if deepest > self.max_depth_seen:
            self.max_depth_seen = deepest
        self.depth = depth


def _plain_whole(x: bytes, max_depth: int | None) -> tuple[tuple[int, ...], int, int, int] | None:
    """`JsonNodeCounter`'s count of a whole text ``x`` (at most one piece, nothing before it) that
    is plain — ASCII, no backslash, its strings all closed, its brackets never closing below
    depth 0 and nesting at most ``max_depth`` (None: no cap) — with the C-level steps of
    `JsonNodeCounter._piece` and `FeatureTally` for such a piece, and none of their per-piece
    bookkeeping: ``(values, last, depth, deepest)``, ``values`` the `JsonFeatures` fields in
    order, ``last`` the last byte outside strings. None when ``x`` is not plain (the general
    path counts it, and raises `JsonTooDeep`). Pure; the results equal `_piece`'s (a property
    test, tests/unit/test_budget_features.py)."""
    if _BACKSLASH in x or not x.isascii():
        return None
    parts = x.split(b'"')
    quotes = len(parts) - 1
    if quotes & 1:
        return None  # the last string runs on past the end
    out = b" ".join(parts[0::2])
    brackets = out.translate(_SIGNED, _NOT_BRACKETS)
    depth = deepest = 0
    if brackets:
        levels = list(itertools.accumulate(array("b", brackets), initial=0))
        if min(levels) < 0:
            return None
        deepest, depth = max(levels), levels[-1]
        if max_depth is not None and deepest > max_depth:
            return None
    strings = parts[1::2]
    count = quotes >> 1
    string_bytes = longest = 0
    if count:
        lens = list(map(len, strings))
        ones = lens.count(1)
        total = len(x) - quotes - len(out) + count  # the strings' bytes: all but the quotes and out
        string_bytes = _ASCII_STR * (count - lens.count(0) - ones) + total - ones
        longest = _ASCII_STR + max(lens)
    objects = out.count(b"{")
    arrays = out.count(b"[")
    literals = out.count(b"t") + out.count(b"f") + out.count(b"n")
    classes = out.translate(_NUM_CLASS)
    numbers = classes.count(b"01") + (classes[0] == 0x31)
    values = (
        len(x),
        count + objects + arrays + literals + numbers,  # nodes
        string_bytes,
        count,
        objects,
        out.count(b"{}") if objects else 0,
        out.count(b":"),
        arrays,
        out.count(b"[]") if arrays else 0,
        numbers,
        _small_ints(b" " + out) if numbers else 0,
        len(classes) - classes.count(b"0"),
        literals,
        longest,
        0,  # escaped
        0,  # non-ASCII bytes
        0,  # leads of 3-byte sequences
        len(x),  # characters
        1,  # width
    )
    return values, out[-1], depth, deepest


def json_features(data: bytes | bytearray | memoryview, *, max_depth: int | None = None) -> JsonFeatures:
    """The `JsonFeatures` of ``data`` (one-shot `JsonNodeCounter` with ``features=True``), in the
    same single lexical pass that counts nodes. Never raises on malformed JSON (only
    `JsonTooDeep` when ``max_depth`` is given and exceeded)."""
    if 0 < len(data) < _PIECE:  # one piece: a plain text is counted at once, with no counter
        found = _plain_whole(data if isinstance(data, bytes) else bytes(data), max_depth)
        if found is not None:
            return JsonFeatures._make(found[0])
    counter = JsonNodeCounter(max_depth=max_depth, features=True)
    counter.feed(data)
    return counter.features()


def count_json_nodes(data: bytes | bytearray | memoryview, *, max_depth: int | None = None) -> int:
    """Return the number of JSON nodes in ``data`` (one-shot `JsonNodeCounter`).

    ``max_depth=None`` (the default) skips depth tracking, which the ledger does not need; pass
    an int to also enforce a cap, raising `JsonTooDeep`. Never raises on malformed JSON.
    """
    counter = JsonNodeCounter(max_depth=max_depth)
    return counter.feed(data)
