"""What CPython retains for a JSON text, counted lexically (the measured charge model's input).

`JsonFeatures` is what `budget.JsonNodeCounter(features=True)` counts in its one lexical pass over
the bytes, next to the nodes (DESIGN.md §4, "the measured model prices the features that decide
what CPython retains"). `FeatureTally` is the counter's per-piece helper; like the node count it
does its work with C-level `bytes` operations per 64 KiB piece, never per byte in Python.

Strings are priced exactly or bounded from above, never guessed:

* the strings of a piece without backslashes and without non-ASCII bytes cost ``49 + len`` each
  (CPython's compact ASCII `str`), computed from their lengths; the empty string and one-byte
  strings are interned singletons in CPython and cost nothing;
* the strings of any other piece are decoded once, together (UTF-8, or one ``json.loads`` of the
  piece's string literals when escapes are present) and their exact `sys.getsizeof` summed;
* a string that runs across pieces is bounded: its characters are at most its bytes minus UTF-8
  continuation bytes, its width is the widest character its raw bytes or escapes can produce (1,
  2 or 4 bytes; a high-surrogate escape means 4), and it costs ``76 + width * characters``.

Numbers: the integers ``-5..=256`` are shared singletons in CPython; `small_ints` counts the ones
that are lexically certain (``-5``..``-1``, ``0``..``256``), every other number is priced as a new
object (`numbers` - `small_ints`) plus its bytes (`number_bytes`, a bound for big integers).
"""

from __future__ import annotations

import json
import re
import sys
from operator import add, methodcaller
from typing import Final, NamedTuple

__all__ = ["FeatureTally", "JsonFeatures"]

_HIGH: Final = bytes(range(0x80, 0x100))
_CONT: Final = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes
_LEAD3: Final = bytes(range(0xE0, 0xF0))  # leads of 3-byte UTF-8 sequences
_NOT_ASTRAL: Final = bytes(c for c in range(256) if c < 0xF0)  # delete all but 4-byte leads
_NOT_WIDE: Final = bytes(c for c in range(256) if not 0xC4 <= c <= 0xEF)  # keep U+0100..U+FFFF leads
_ESC_ASTRAL: Final = re.compile(rb"\\u[dD][89abAB]")
_ESC_WIDE: Final = re.compile(rb"\\u(?!00)")
_ESC_LATIN1: Final = re.compile(rb"\\u00[89a-fA-F]")
#: Number bytes (what a number token may hold) kept, every other byte a space: ``split()`` then
#: gives the maximal runs of number bytes (`FeatureTally.outside`).
_NUM_RUNS: Final = bytes(c if c in b"-+.eE0123456789" else 0x20 for c in range(256))
_NUM_BYTES: Final = frozenset(b"-+.eE0123456789")
#: The tokens CPython parses to a shared small int (``-5..=256``), as they are written.
_SMALL_INTS: Final = frozenset(
    {str(i).encode() for i in range(257)} | {str(-i).encode() for i in range(1, 6)}
)
# '1' may start a number, '2' only continues one (the node counter's classes)
_NUM_CLASS: Final = bytes(0x31 if c in b"-0123456789" else 0x32 if c in b"+.eE" else 0x30 for c in range(256))
_DECODE: Final = methodcaller("decode", "utf-8", "replace")
_LENIENT: Final = json.JSONDecoder(strict=False)  # control characters are the strict parser's job
_ASCII_STR: Final = sys.getsizeof("")  # 49 on 64-bit CPython 3.11: header of a compact ASCII str
_EMPTY: Final = sys.getsizeof("")
_ONE: Final = sys.getsizeof("a")
_WIDE_STR: Final = 76  # header bound of any str (UCS-4: 76 + 4 per character)
_LATIN1_STR: Final = sys.getsizeof("\xe9") - 1  # 73: header of a Latin-1 str


class JsonFeatures(NamedTuple):
    """The lexical features of one JSON text, all ints (an immutable named tuple: it is built once
    per counted payload, and a tuple costs a seventh of a frozen dataclass to build).

    * ``nbytes`` — wire bytes; ``nodes`` — JSON nodes (`budget.nodes` rules);
    * ``string_bytes`` — bytes of the `str` objects a parse builds for every string and key (an
      upper bound, exact for strings inside one piece), shared singletons excluded;
    * ``strings`` — string literals (keys included); ``longest_string`` — bytes of the largest of
      those `str` objects (a bound); ``escaped`` — 1 when any string holds a backslash escape;
    * ``objects`` / ``empty_objects`` (``{}`` with nothing between), ``members`` (``:`` outside
      strings: one per key), ``arrays`` / ``empty_arrays`` (``[]``);
    * ``numbers``, ``small_ints`` (lexically certain ``-5..=256``), ``number_bytes`` (bytes of
      number tokens, a bound);
    * ``literals`` — ``true``, ``false``, ``null``;
    * ``nonascii_bytes`` — bytes ``>= 0x80`` anywhere; ``lead3_bytes`` — leads of 3-byte UTF-8
      sequences (``0xE0..=0xEF``); ``chars`` — code points of the whole text
      (bytes minus UTF-8 continuation bytes); ``text_width`` — 1, 2 or 4, the widest character of
      the raw text (what its decoded `str` needs per character).

    Malformed input still gets features (never an error); they only bound what a parse of valid
    JSON would build.
    """

    nbytes: int
    nodes: int
    string_bytes: int
    strings: int
    objects: int
    empty_objects: int
    members: int
    arrays: int
    empty_arrays: int
    numbers: int
    small_ints: int
    number_bytes: int
    literals: int
    longest_string: int
    escaped: int
    nonascii_bytes: int
    lead3_bytes: int
    chars: int
    text_width: int

    def combine(self, other: JsonFeatures, k: int = 1) -> JsonFeatures:
        """``self + k * other`` field by field (``k`` may be negative, for differences of real
        payloads in `budget.costs`); ``text_width``, ``longest_string`` and ``escaped`` are the
        larger of the two when ``k > 0``, else ``self``'s."""
        values = (
            list(map(add, self, other)) if k == 1 else [a + k * b for a, b in zip(self, other, strict=True)]
        )
        for i in _NOT_SUMMED:  # the wider / larger one
            values[i] = max(self[i], other[i]) if k > 0 else self[i]
        return JsonFeatures._make(values)

    @property
    def text_bytes(self) -> int:
        """Bytes of the `str` that decoding the whole text builds (``bytes.decode``)."""
        if self.text_width == 1:
            header = _ASCII_STR if self.nonascii_bytes == 0 else _LATIN1_STR
            return header + self.chars
        return _WIDE_STR + self.text_width * (self.chars + 1)

    @property
    def elements(self) -> int:
        """Values directly inside arrays: every node that is neither a key, a member's value,
        nor the top-level value (``nodes - 2*members - 1``, at least 0)."""
        return max(self.nodes - 2 * self.members - 1, 0)

    @property
    def serialized_bound(self) -> int:
        """Largest compact ``json.dumps`` (``ensure_ascii``) of the parsed value, in bytes: ASCII
        stays as it is, a non-ASCII character becomes a ``\\uXXXX`` escape: 2 bytes -> 6, 3 bytes
        -> 6, an astral character's 4 bytes -> 12 (a surrogate pair)."""
        return self.nbytes + 2 * self.nonascii_bytes - 3 * self.lead3_bytes


#: Positions of the fields `JsonFeatures.combine` does not sum: text_width, longest_string, escaped.
_NOT_SUMMED: Final = tuple(JsonFeatures._fields.index(f) for f in ("text_width", "longest_string", "escaped"))


def _width(data: bytes) -> int:
    """Widest character the raw bytes ``data`` (not ASCII) hold: 4, 2, or 1 (Latin-1)."""
    if data.translate(None, _NOT_ASTRAL):
        return 4
    if data.translate(None, _NOT_WIDE):
        return 2
    return 1


def _small_ints(subject: bytes) -> int:
    """The number tokens of `subject` (text outside strings) that are lexically certain to be a
    shared small int: maximal runs of number bytes spelling ``-5``..``-1`` or ``0``..``256``,
    followed by a byte that is not a number byte (a run that ends `subject` may go on in the
    next piece, so it does not count)."""
    runs = subject.translate(_NUM_RUNS).split()
    small = sum(map(_SMALL_INTS.__contains__, runs))
    if small and subject[-1] in _NUM_BYTES and runs[-1] in _SMALL_INTS:
        small -= 1
    return small


class FeatureTally:
    """Accumulates `JsonFeatures` piece by piece for `budget.JsonNodeCounter`; not public API.

    The counter calls, per piece: `raw` (every byte fed), `open_segment` / `close_open` for the
    string that runs across pieces, `plain_strings` / `escaped_strings` for the strings closed
    inside the piece, and `outside` for the text outside strings."""

    __slots__ = (
        "_open_chars",
        "_open_latin1",
        "_open_tail",
        "_open_width",
        "arrays",
        "cont",
        "empty_arrays",
        "empty_objects",
        "escaped",
        "lead3",
        "literals",
        "longest",
        "members",
        "nonascii",
        "number_bytes",
        "numbers",
        "objects",
        "small_ints",
        "string_bytes",
        "strings",
        "width",
    )

    def __init__(self) -> None:
        self.string_bytes = self.strings = 0
        self.objects = self.empty_objects = self.members = 0
        self.arrays = self.empty_arrays = 0
        self.numbers = self.small_ints = self.number_bytes = self.literals = 0
        self.nonascii = self.cont = self.lead3 = 0
        self.longest = self.escaped = 0
        self.width = 1
        self._open_chars = 0
        self._open_width = 0  # 0: ASCII so far
        self._open_latin1 = False
        self._open_tail = b""

    def raw(self, piece: bytes) -> None:
        """Every byte of the text, once (before the counter trims escapes)."""
        if piece.isascii():
            return
        self.nonascii += len(piece) - len(piece.translate(None, _HIGH))
        self.cont += len(piece) - len(piece.translate(None, _CONT))
        self.lead3 += len(piece) - len(piece.translate(None, _LEAD3))
        self.width = max(self.width, _width(piece))

    def open_segment(self, seg: bytes, *, new: bool = False) -> None:
        """Bytes inside a string that is not closed in this piece (``new``: it opens here)."""
        if new:
            self.strings += 1
            self._open_chars = 0
            self._open_width = 0
            self._open_latin1 = False
            self._open_tail = b""
        if seg.isascii():
            self._open_chars += len(seg)
        else:
            self._open_chars += len(seg.translate(None, _CONT))  # continuation bytes are not characters
            w = _width(seg)
            if w == 1:
                self._open_latin1 = True
            else:
                self._open_width = max(self._open_width, w)
        if b"\\" in seg or b"\\" in self._open_tail:
            self.escaped = 1
            probe = self._open_tail + seg
            if _ESC_ASTRAL.search(probe):
                self._open_width = 4
            elif _ESC_WIDE.search(probe):
                self._open_width = max(self._open_width, 2)
            elif _ESC_LATIN1.search(probe):
                self._open_latin1 = True
        self._open_tail = (self._open_tail + seg)[-11:]

    def close_open(self) -> None:
        """The string that ran across pieces ended: add its bound."""
        n, w = self._open_chars, self._open_width
        if w:
            cost = _WIDE_STR + w * (n + 1)
        elif self._open_latin1:
            cost = _LATIN1_STR + n
        else:
            cost = _ASCII_STR + n
        self.string_bytes += cost
        self.longest = max(self.longest, cost)
        self._open_chars = 0

    def plain_strings(self, contents: list[bytes], ascii_piece: bool) -> None:
        """Strings closed in a piece without backslashes (their contents, quotes stripped)."""
        if not contents:
            return
        self.strings += len(contents)
        if ascii_piece:
            lens = list(map(len, contents))
            n0, n1 = lens.count(0), lens.count(1)
            self.string_bytes += _ASCII_STR * (len(lens) - n0 - n1) + sum(lens) - n1
            self.longest = max(self.longest, _ASCII_STR + max(lens))
            return
        self._sized(list(map(sys.getsizeof, map(_DECODE, contents))))

    def escaped_strings(self, literals: list[bytes]) -> None:
        """Strings closed in a piece with backslashes (whole literals, quotes included)."""
        if not literals:
            return
        self.strings += len(literals)
        self.escaped = 1
        try:
            decoded = _LENIENT.decode("[" + ",".join(map(_DECODE, literals)) + "]")
        except ValueError:  # not valid JSON strings: bound each (its parse will fail anyway)
            bounds = [_WIDE_STR + 4 * len(lit) for lit in literals]
            self.string_bytes += sum(bounds)
            self.longest = max(self.longest, *bounds)
            return
        self._sized(list(map(sys.getsizeof, decoded)))

    def _sized(self, sizes: list[int]) -> None:
        # 49 and 50 are the sizes of "" and of a one-character ASCII str only: singletons
        self.string_bytes += sum(sizes) - _EMPTY * sizes.count(_EMPTY) - _ONE * sizes.count(_ONE)
        self.longest = max(self.longest, *sizes)

    def outside(self, out: bytes, after_number: bool) -> int:
        """The text outside strings of one piece (strings replaced by spaces); ``after_number``:
        the previous piece ended on a number byte. Returns the nodes it holds (containers,
        literals, number starts: `budget.nodes` rules), which the counter adds to the strings'."""
        objects = out.count(b"{")
        arrays = out.count(b"[")
        literals = out.count(b"t") + out.count(b"f") + out.count(b"n")
        self.objects += objects
        self.arrays += arrays
        self.literals += literals
        self.members += out.count(b":")
        if objects:  # "{}" holds a "{"
            self.empty_objects += out.count(b"{}")
        if arrays:
            self.empty_arrays += out.count(b"[]")
        classes = out.translate(_NUM_CLASS)
        starts = classes.count(b"01") + (1 if classes[:1] == b"1" and not after_number else 0)
        self.numbers += starts
        self.number_bytes += len(classes) - classes.count(b"0")
        if starts or after_number:
            self.small_ints += _small_ints((b"0" if after_number else b" ") + out)
        return objects + arrays + literals + starts

    def set_plain(self, values: tuple[int, ...]) -> None:
        """Take the features of a fresh tally's one plain piece, counted at once by
        `budget.nodes._plain_whole` (``values``: the `JsonFeatures` fields in order)."""
        (
            _,
            _,
            self.string_bytes,
            self.strings,
            self.objects,
            self.empty_objects,
            self.members,
            self.arrays,
            self.empty_arrays,
            self.numbers,
            self.small_ints,
            self.number_bytes,
            self.literals,
            self.longest,
            self.escaped,
            self.nonascii,
            self.lead3,
            _,
            self.width,
        ) = values

    def result(self, nbytes: int, nodes: int) -> JsonFeatures:
        """The features so far (a string still open is not included)."""
        return JsonFeatures(
            nbytes=nbytes,
            nodes=nodes,
            string_bytes=self.string_bytes,
            strings=self.strings,
            objects=self.objects,
            empty_objects=self.empty_objects,
            members=self.members,
            arrays=self.arrays,
            empty_arrays=self.empty_arrays,
            numbers=self.numbers,
            small_ints=self.small_ints,
            number_bytes=self.number_bytes,
            literals=self.literals,
            longest_string=self.longest,
            escaped=self.escaped,
            nonascii_bytes=self.nonascii,
            lead3_bytes=self.lead3,
            chars=nbytes - self.cont,
            text_width=self.width,
        )
