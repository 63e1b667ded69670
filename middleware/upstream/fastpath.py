"""The stream fast path: find the frames of one upstream read that need no change, with bytes
operations and a field-selective decode, so a run of them is forwarded as received (issue 21).

DESIGN.md asks for a per-frame *check* and per-frame *validation*, not per-frame Python objects.
`regular_prefix` walks the frames at the start of a read (``event: NAME\\ndata: JSON\\n\\n``, LF
line ends only) and stops at the first one that is not **regular**, i.e. that the exact per-frame
path (`middleware.upstream.reader`) might treat otherwise than "forward its bytes unchanged":

* framing: another shape (a comment, an ``id:`` / ``retry:`` line, several ``data:`` lines, no
  ``event:`` line, CR line ends, a frame that does not end in this read);
* bytes: invalid UTF-8 (msgspec does not check the strings it skips, so it is checked here),
  control characters (what strict ``json.loads`` refuses inside strings), a ``\\ud800``-style
  escape (a possibly lone surrogate), more than `MAX_BRACKETS` ``[`` / ``{`` (nesting);
* JSON: anything msgspec refuses (not an object, ``NaN``, malformed, trailing bytes): the exact
  path gives its own verdict;
* fields: a ``type`` that is missing, not a string, not the event name, not a plain name
  (`EVENT_TYPE`), ``error``, or one of the lifecycle / terminal events the gateway normalises
  (`IRREGULAR_TYPES`); a ``sequence_number`` that is not an ``int`` (``true`` and ``2.0`` are
  re-encoded) or not the client's next number (renumbered).

msgspec validates the whole JSON text and builds only the two fields asked for (duplicate keys:
the last wins, as in ``json.loads``). The ledger is checked once per read
(`budget.Ledger.stream_read_fits`); the caller falls back to the exact path for the whole read
when that bound does not fit or the pool is short.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

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
#: ``[`` and ``{`` bytes a regular frame may hold (json.loads recurses per level; the exact path
#: decides for deeper text).
MAX_BRACKETS: Final = 128
#: Bytes the exact path may judge otherwise: control characters, and ``\\uD8..``-``\\uDF..``
#: escapes (lone surrogates are refused there; a pair is fine, but rare enough to leave to it).
_SUSPECT: Final = re.compile(rb"[\x00-\x1f]|\\u[dD][89abcdefABCDEF]")


class _Head(msgspec.Struct):
    """The two fields the pass-through needs of a frame; everything else is validated, not built."""

    type: Any = None
    sequence_number: Any = None


_DECODER: Final = msgspec.json.Decoder(_Head)


def regular_prefix(block: bytes, next_sequence: int, names: dict[bytes, str]) -> tuple[int, int, int]:
    """The regular frames at the start of `block` (module docstring): ``(end, count, widest)``,
    ``block[:end]`` being those `count` whole frames and `widest` the largest ``data:`` payload
    among them (bytes). `next_sequence`: the client's next ``sequence_number``. `names`: event
    names already found regular in this stream (bytes -> type), a cache filled here. Pure; raises
    nothing."""
    pos = count = widest = 0
    find, startswith, suspect, decode = block.find, block.startswith, _SUSPECT.search, _DECODER.decode
    while True:
        end = find(b"\n\n", pos)
        if end < 0 or not startswith(b"event: ", pos):
            break
        nl = find(b"\n", pos + 7, end)
        if nl < 0 or not startswith(b"data: ", nl + 1):
            break
        data = block[nl + 7 : end]
        if b"\n" in data or suspect(data) is not None:
            break
        if not data.isascii():
            try:
                data.decode()
            except UnicodeDecodeError:
                break
        if data.count(b"[") + data.count(b"{") > MAX_BRACKETS:
            break
        try:
            head = decode(data)
        except (msgspec.DecodeError, RecursionError):
            break
        name = block[pos + 7 : nl]
        kind = names.get(name)
        if kind is None:
            if EVENT_TYPE.fullmatch(name) is None or name in IRREGULAR_TYPES:
                break
            kind = names[name] = name.decode("ascii")
        sequence = head.sequence_number
        if head.type != kind or type(sequence) is not int or sequence != next_sequence + count:
            break
        count += 1
        widest = max(widest, len(data))
        pos = end + 2
    return pos, count, widest
