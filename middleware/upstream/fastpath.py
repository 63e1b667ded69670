"""The stream fast path: find the frames of one upstream read that need no change, with bytes
operations and a field-selective decode, so a run of them is forwarded as received (issue 21).

DESIGN.md asks for a per-frame *check* and per-frame *validation*, not per-frame Python objects.
`regular_prefix` walks the frames at the start of a read (``event: NAME\\ndata: JSON\\n\\n``, LF
line ends only) and stops at the first one that is not **regular**, i.e. that the exact per-frame
path (`middleware.upstream.reader`) might treat otherwise than "forward its bytes unchanged":

* framing: another shape (a comment, an ``id:`` / ``retry:`` line, several ``data:`` lines, no
  ``event:`` line, CR line ends, a frame that does not end in this read);
* bytes: invalid UTF-8 (msgspec does not check the strings it skips, so it is checked here), a
  CR (a line end to the SSE parser), a ``\\ud800``-style escape (a possibly lone surrogate),
  more than `MAX_BRACKETS` ``[`` / ``{`` (nesting); control characters inside strings are refused
  by msgspec as by strict ``json.loads`` (tested);
* JSON: anything msgspec refuses (not an object, ``NaN``, malformed, trailing bytes): the exact
  path gives its own verdict; a text that may repeat a key (`no_duplicate_keys`: msgspec keeps
  the last one silently, the exact path refuses a repeat, `middleware.upstream.reader`);
* fields: a ``type`` that is missing, not a string, not the event name, not a plain name
  (`EVENT_TYPE`), ``error``, or one of the lifecycle / terminal events the gateway normalises
  (`IRREGULAR_TYPES`); a ``sequence_number`` that is not an ``int`` (``true`` and ``2.0`` are
  re-encoded) or not the client's next number (renumbered).

msgspec validates the whole JSON text (0.2-0.4 µs for a text delta). The ledger is checked once per read
(`budget.Ledger.stream_read_fits`); the caller falls back to the exact path for the whole read
when that bound does not fit or the pool is short.
"""

from __future__ import annotations

import re
from itertools import compress, repeat
from operator import attrgetter, itemgetter, ne
from typing import Annotated, Any, Final

import msgspec

from budget import key_total

#: What may be written into an ``event:`` line (`middleware.upstream.reader.EVENT_TYPE`).
EVENT_TYPE: Final = re.compile(rb"[A-Za-z0-9_.:-]{1,128}")
#: Event types never forwarded as received: in-band errors, and the lifecycle and terminal
#: events whose response object the gateway normalises (`middleware.loop.echo`).
IRREGULAR_TYPES: Final = frozenset(
    {
        b"error",
        b"response.created",
        b"response.in_progress",
        b"response.queued",
        b"response.completed",
        b"response.incomplete",
        b"response.failed",
    }
)
#: With store on (the loop's rounds) the item events are never regular either: the stitcher
#: hides gateway calls at ``output_item.added`` and the accumulator keeps ``output_item.done``.
STITCHED_IRREGULAR_TYPES: Final = IRREGULAR_TYPES | {
    b"response.output_item.added",
    b"response.output_item.done",
}
#: ``[`` and ``{`` bytes a regular frame may hold (json.loads recurses per level; the exact path
#: decides for deeper text).
MAX_BRACKETS: Final = 128
#: A JSON text this long or shorter nests at most `MAX_BRACKETS` deep (each level opens and
#: closes: 2 bytes), so its brackets need no count.
_SHALLOW: Final = 2 * MAX_BRACKETS
#: Frames in a read from which the list-wise classification pays (measured: one frame costs 2.8
#: µs frame by frame, 5.7 list-wise; 1000 frames 2.4 and 1.4 µs each).
LIST_WISE_FROM: Final = 8
#: ``\\uD800``-``\\uDFFF`` escapes, which the exact path may refuse (a lone surrogate; a pair is
#: fine, but rare enough to leave to it). Searched only in data that holds a ``\\u`` at all.
_SURROGATE: Final = re.compile(rb"\\u[dD][89abcdefABCDEF]")
#: Single bytes as ints: ``10 in data`` is a memchr, ``b"\\n" in data`` costs ~4 × more (a
#: buffer look-up per call, measured 0.06 vs 0.25 µs).
_LF: Final = 10
_CR: Final = 13
_BACKSLASH: Final = 92
#: A stream index: an integer >= 0 (`STREAM_FIELD_TYPES`).
_Index = Annotated[int, msgspec.Meta(ge=0)]


#: The decoder: every frame's JSON text validated and decoded to plain objects (msgspec: UTF-8 of
#: the strings it keeps is checked; the rest is checked by `_utf8`). A dict, not a Struct of two
#: fields: its ``len`` against the frame's ``:`` count proves the frame repeats no key
#: (`no_duplicate_keys`), and the store-on path needs ``output_index`` and ``delta`` too.
_DECODER: Final = msgspec.json.Decoder()
#: What the list-wise classification returns: ``(end, count, widest, heads)`` (`regular_prefix`).
Run = tuple[int, int, int, list[dict[str, Any]]]
_NONE: Final[Run] = (0, 0, 0, [])
#: `regular_prefix`'s answer when the first frame is not regular (nothing after it was looked at).
NOT_REGULAR: Final[Run] = _NONE


#: The stream fields the gateway reads (maps, stitches, accumulates) and the one type each must
#: have when present (Open Responses openapi.json: integer / string in every event that has it).
STREAM_FIELD_TYPES: Final = (
    ("output_index", int),
    ("content_index", int),
    ("summary_index", int),
    ("item_id", str),
    ("delta", str),
)


def stream_field_error(head: dict[str, Any]) -> str | None:
    """What is wrong with one decoded event's read fields (`STREAM_FIELD_TYPES`), or None.
    Exact types: ``true`` is not an index (``bool`` subclasses ``int``), ``"0"`` is not one either.
    DESIGN.md §5 makes such a frame 502 ``upstream_invalid_response``; the fast path leaves it to
    the exact path (`middleware.upstream.reader`), which raises."""
    for field, kind in STREAM_FIELD_TYPES:
        value = head.get(field)
        if value is not None and type(value) is not kind:
            return f"{field} is {type(value).__name__} {str(value)[:40]!r}, not {'an integer' if kind is int else 'a string'}"
        if type(value) is int and value < 0:
            return f"{field} is {value}, not an integer >= 0"
    return None


#: A surrogate written as raw bytes (``ED A0``-``ED BF``): ``json.loads`` reads bytes with
#: ``surrogatepass``, so such a text decodes to a lone surrogate instead of failing.
_RAW_SURROGATE: Final = re.compile(rb"\xed[\xa0-\xbf]")


def may_hold_surrogate(data: bytes) -> bool:
    """Whether the JSON text `data`, decoded by ``json.loads``, may hold a string with a
    surrogate (lone or paired) — False proves it holds none, so the caller need not walk every
    string of the value (`middleware.upstream.reader.refuse_lone_surrogates`). Only a
    ``\\uD800``-``\\uDFFF`` escape or raw surrogate bytes write one, read as UTF-8; a text
    with a NUL byte may be read as UTF-16 / UTF-32 (``json.detect_encoding``): True. One memchr
    per byte class, a search only where it finds one. Pure; raises nothing."""
    if 0 in data:
        return True
    if _BACKSLASH in data and _SURROGATE.search(data) is not None:
        return True
    return not data.isascii() and _RAW_SURROGATE.search(data) is not None


def no_duplicate_keys(data: bytes, obj: Any) -> bool:
    """Whether `data` (a valid JSON text, `obj` its decoded value) provably repeats no key in
    any object. Sound, not complete: each key token of the text is followed by one ``:`` outside
    strings, so ``data.count(b":")`` >= key tokens >= distinct keys (`key_total`); when the count
    equals the distinct keys, no key was repeated (``"a"`` and ``"\\u0061"`` are one key
    decoded, two tokens: caught). False means "maybe": a ``:`` inside a string, or a repeat —
    the caller decides exactly (`middleware.upstream.reader.duplicate_key`)."""
    colons = data.count(b":")
    if type(obj) is dict and len(obj) == colons:
        return True  # a flat object (a text delta): no nested key, none repeated
    return key_total(obj) == colons


def regular_prefix(
    block: bytes, next_sequence: int, names: dict[bytes, str], irregular: frozenset[bytes] = IRREGULAR_TYPES
) -> Run:
    """The regular frames at the start of `block` (module docstring): ``(end, count, widest,
    heads)``, ``block[:end]`` being those `count` whole frames, `widest` the largest ``data:``
    payload among them (bytes) and `heads` their decoded JSON objects, in order.
    `next_sequence`: the client's next ``sequence_number``. `names`: event names already found
    regular in this stream (bytes -> type), a cache filled here (one cache per `irregular`).
    `irregular`: the event names never regular (`IRREGULAR_TYPES`; the store-on path adds the
    item events, `STITCHED_IRREGULAR_TYPES`). Pure; raises nothing.

    From `LIST_WISE_FROM` frames on, they are classified list-wise (`_vectorised`, a few C-level
    passes over all of them; fewer go frame by frame, which costs less for one or two);
    whatever that cannot settle (a refusal from the decoder, bytes that need a frame-by-frame
    look) is settled frame by frame (`_frame_by_frame`), which gives the same answer."""
    # token-paced: a frame or two. A frame has at least three line ends (event, data, blank):
    # counting one byte is a memchr-speed pass, ~3 x cheaper than counting blank lines
    if len(block) <= _SMALL or block.count(_LF, 0, _LOOK) < 3 * LIST_WISE_FROM:
        return _frame_by_frame(block, next_sequence, names, irregular)
    nl = block.find(b"\n", 0, 7 + 130)
    if nl < 0 or not block.startswith(b"event: ") or not _name_ok(block[7:nl], names, irregular):
        return _NONE  # the first frame is not regular (a lifecycle event, an error, ...)
    found = _vectorised(block, next_sequence, names, irregular)
    return found if found is not None else _frame_by_frame(block, next_sequence, names, irregular)


#: Bytes `regular_prefix` counts line ends in to choose between frame by frame and list-wise,
#: and the size of a read it walks frame by frame without counting (a few frames).
_LOOK: Final = 8192
_SMALL: Final = 1024


def frames_end(block: bytes, count: int) -> int:
    """The offset just past the first `count` frames of `block` (each ends with a blank line)."""
    end = 0
    for _ in range(count):
        end = block.index(b"\n\n", end) + 2
    return end


def _name_ok(name: bytes, names: dict[bytes, str], irregular: frozenset[bytes]) -> bool:
    if name in names:
        return True
    if EVENT_TYPE.fullmatch(name) is None or name in irregular:
        return False
    names[name] = name.decode("ascii")
    return True


def _lines(text: bytes, names: dict[bytes, str], irregular: frozenset[bytes]) -> Any:
    """`_vectorised`'s first step: ``(events, datas, kinds, frames)`` for the frames of `text`
    (whole frames, the last one's blank line cut off) up to the first one with an irregular name:
    their ``event:`` lines, ``data:`` payloads (bytes) and event types (str), and the number of
    frames in `text`; None when a frame has another shape than ``event: NAME\\ndata: JSON``.

    C-level passes, no per-frame Python: the text must split into lines in threes (event, data,
    blank), the first of each three start with ``event: `` (checked on each distinct line), the
    second with ``data: `` (the set of their first six bytes) and the third be empty."""
    lines = text.split(b"\n")
    count = (len(lines) + 1) // 3
    if len(lines) != 3 * count - 1 or any(lines[2::3]):
        return None  # a frame of more or fewer lines than event + data
    data_lines = lines[1::3]
    if set(map(_PREFIX, data_lines)) != {b"data: "}:
        return None
    events = lines[0::3]
    kind_of = {
        line: names[line[7:]]
        for line in set(events)
        if line.startswith(b"event: ") and _name_ok(line[7:], names, irregular)
    }
    kinds = list(map(kind_of.get, events))
    frames = count
    if None in kinds:
        count = kinds.index(None)
        data_lines = data_lines[:count]
    return events[:count], list(map(_PAYLOAD, data_lines)), kinds[:count], frames


_PREFIX: Final = itemgetter(slice(0, 6))
_PAYLOAD: Final = itemgetter(slice(6, None))


class _Head(msgspec.Struct, gc=False):
    """The fields a regular frame's JSON object must have, typed as `STREAM_FIELD_TYPES` says
    (an index: an ``int`` >= 0, not ``true``; an id or delta: a string; null as absent); what
    msgspec's strict `convert` checks list-wise in C."""

    type: str
    sequence_number: int
    output_index: _Index | msgspec.UnsetType | None = msgspec.UNSET
    content_index: _Index | msgspec.UnsetType | None = msgspec.UNSET
    summary_index: _Index | msgspec.UnsetType | None = msgspec.UNSET
    item_id: str | msgspec.UnsetType | None = msgspec.UNSET
    delta: str | msgspec.UnsetType | None = msgspec.UNSET


_TYPE: Final = attrgetter("type")
_SEQUENCE: Final = attrgetter("sequence_number")


def _vectorised(
    block: bytes, next_sequence: int, names: dict[bytes, str], irregular: frozenset[bytes] = IRREGULAR_TYPES
) -> Run | None:
    """`regular_prefix` with list operations; None when it must be settled frame by frame."""
    last = block.rfind(b"\n\n")
    # (a backslash first: `in` finds one byte with memchr, two bytes ~50 × slower)
    if last < 0 or _CR in block or (_BACKSLASH in block and _SURROGATE.search(block) is not None):
        return None
    found = _lines(block[:last], names, irregular)
    if found is None:
        return None
    events, datas, kinds, frames = found
    if not datas or (not block.isascii() and not _utf8(block, last)):
        return None
    long = [data for data in datas if len(data) > _SHALLOW]
    if (
        long
        and max(map(bytes.count, long, repeat(b"["))) + max(map(bytes.count, long, repeat(b"{")))
        > MAX_BRACKETS
    ):
        return None
    try:
        decoded = list(map(_DECODER.decode, datas))
        heads = msgspec.convert(decoded, list[_Head])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # not an object, a field of the wrong type, ...: settled frame by frame
    count = len(decoded)
    types = list(map(_TYPE, heads))
    sequences = list(map(_SEQUENCE, heads))
    if types != kinds or sequences != list(range(next_sequence, next_sequence + count)):
        count = _settle(types, sequences, kinds, next_sequence)
    count = _unrepeated(datas[:count], decoded[:count])
    if not count:
        return (0, 0, 0, [])  # not `NOT_REGULAR`: this answer looked at every frame
    if count == frames:  # every frame up to the last blank line
        return last + 2, count, max(map(len, datas)), decoded
    end = sum(map(len, events[:count])) + sum(map(len, datas[:count])) + 9 * count
    return end, count, max(map(len, datas[:count])), decoded[:count]


def _settle(types: list[str], sequences: list[int], kinds: list[str], next_sequence: int) -> int:
    """The number of leading frames whose type and ``sequence_number`` pass one by one."""
    for i, (kind, sequence) in enumerate(zip(types, sequences, strict=True)):
        if kind != kinds[i] or sequence != next_sequence + i:
            return i
    return len(types)


def _unrepeated(datas: list[bytes], decoded: list[dict[str, Any]]) -> int:
    """The number of leading frames that provably repeat no key (`no_duplicate_keys`): flat
    frames are settled by one list compare of key and ``:`` counts, only the others are walked."""
    keys = list(map(len, decoded))
    colons = list(map(bytes.count, datas, repeat(b":")))
    if keys == colons:
        return len(datas)
    for at in compress(range(len(keys)), map(ne, keys, colons)):  # the nested ones, in order
        if key_total(decoded[at]) != colons[at]:
            return at
    return len(datas)


def _utf8(block: bytes, end: int) -> bool:
    try:
        block[:end].decode()
    except UnicodeDecodeError:
        return False
    return True


def _frame_head(data: bytes, kind: str, sequence: int) -> dict[str, Any] | None:
    """One frame's ``data:`` payload decoded, or None when the exact path must look at it (bytes
    or JSON it might refuse, a repeated key, not an object, a read field of the wrong type, not
    type `kind` or not numbered `sequence`)."""
    if _LF in data or _CR in data or (_BACKSLASH in data and _SURROGATE.search(data) is not None):
        return None
    if not data.isascii():
        try:
            data.decode()
        except UnicodeDecodeError:
            return None
    if len(data) > _SHALLOW and data.count(b"[") + data.count(b"{") > MAX_BRACKETS:
        return None
    try:
        head = _DECODER.decode(data)
        typed = msgspec.convert(head, _Head)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if typed.type != kind or typed.sequence_number != sequence:
        return None
    return head if no_duplicate_keys(data, head) else None


def _frame_by_frame(
    block: bytes, next_sequence: int, names: dict[bytes, str], irregular: frozenset[bytes] = IRREGULAR_TYPES
) -> Run:
    """`regular_prefix` one frame at a time (`NOT_REGULAR` when the first frame is not)."""
    pos = widest = 0
    heads: list[dict[str, Any]] = []
    find, startswith = block.find, block.startswith
    while True:
        end = find(b"\n\n", pos)
        if end < 0 or not startswith(b"event: ", pos):
            break
        nl = find(b"\n", pos + 7, end)
        if nl < 0 or not startswith(b"data: ", nl + 1):
            break
        name = block[pos + 7 : nl]
        kind = names.get(name)
        if kind is None:
            if not _name_ok(name, names, irregular):
                break
            kind = names[name]
        head = _frame_head(block[nl + 7 : end], kind, next_sequence + len(heads))
        if head is None:
            break
        heads.append(head)
        widest = max(widest, end - nl - 7)
        pos = end + 2
    return (pos, len(heads), widest, heads) if heads else _NONE
