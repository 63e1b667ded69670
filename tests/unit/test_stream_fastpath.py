"""The stream fast path (issue 21 item 1): runs of regular frames forwarded as received.

The property: on every generated stream (framing, read splits and the irregular cases the issue
lists), `read_round` with the fast path (``on_run``) and without it give the client the same bytes
and end the same way (terminal type, or the same failure class and code), at any ledger limit. Plus
units for `regular_prefix` and checks that the fast path really is taken.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget import BudgetExceeded, ChargeModel, Ledger
from middleware.asgi.client_stream import ClientStream
from middleware.upstream.errors import UpstreamError
from middleware.upstream.fastpath import (
    STREAM_FIELD_TYPES,
    _frame_by_frame,
    _Head,
    _vectorised,
    may_hold_surrogate,
    regular_prefix,
    stream_field_error,
)
from middleware.upstream.reader import UpstreamEvent, read_round
from middleware.upstream.sse import SSEParser


class _Response:
    """An upstream response whose body arrives as the given reads."""

    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads

    async def _gen(self) -> AsyncIterator[bytes]:
        for read in self._reads:
            yield read

    def chunks(self) -> AsyncIterator[bytes]:
        return self._gen()

    async def aclose(self) -> None:
        return None


def _frame(kind: str, body: dict[str, Any] | bytes, name: str | None = None) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    return b"event: " + (name or kind).encode() + b"\ndata: " + data + b"\n\n"


def run_stream(
    reads: list[bytes], *, fast: bool, limit: int, model: str = "reference"
) -> tuple[bytes, str, int]:
    """(client bytes, outcome, runs taken): outcome is the terminal type or ``Class:code``."""

    async def go() -> tuple[bytes, str, int]:
        out: list[bytes] = []
        runs = 0

        async def send(message: Any) -> None:
            if message["type"] == "http.response.body":
                out.append(message["body"])

        client = ClientStream(send)
        ledger = Ledger(limit, model=ChargeModel.named(model), store=False)

        async def on_event(event: UpstreamEvent) -> None:
            await client.forward(event.type, event.data, event.obj, changed=event.changed)

        async def on_run(frames: bytes, count: int) -> None:
            nonlocal runs
            runs += 1
            await client.forward_run(frames, count)

        try:
            outcome = await read_round(
                _Response(reads), ledger, client=client, on_event=on_event, on_run=on_run if fast else None
            )
        except (UpstreamError, BudgetExceeded) as exc:
            outcome = f"{type(exc).__name__}:{getattr(exc, 'code', None)}"
        await client.flush()
        assert ledger.charged == 0  # everything the reader charged is released
        return b"".join(out), outcome, runs

    return asyncio.run(go())


def _delta(seq: int, text: str = "hi") -> bytes:
    return _frame(
        "response.output_text.delta",
        {"type": "response.output_text.delta", "sequence_number": seq, "output_index": 0, "delta": text},
    )


_IRREGULAR: list[bytes] = [
    b": a comment\n\n",
    b"id: 7\n",
    b"retry: 10\n",
    _frame("x.delta", b'{"type":"x.delta","sequence_number":1.0}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":true}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":99}'),
    _frame("x.delta", b'{"sequence_number":SEQ}'),
    _frame("x.delta", b'{"type":"y.delta","sequence_number":SEQ}', name="x.delta"),
    _frame("x.delta", b'{"type":"x.delta","type":"z","sequence_number":SEQ}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"n":NaN}'),
    # repeated keys (issue 21 defect): refused by the exact path, never forwarded as received
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"d":"a","d":"b"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"d":"a","\\u0064":"b"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"o":{"a":1,"a":2}}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"o":[{"a":":","a":2}]}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"delta":"\xff"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"delta":"\\ud800"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"delta":"\\ud83d\\ude00"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"d":"a\tb"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"d":"a\x01b"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"d":"a\rb"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ}\x0c'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"d":' + b"[" * 300 + b"]" * 300 + b"}"),
    _frame("x.delta", b"[1,2]"),
    _frame("x.delta", b"[DONE]"),
    _frame("x.delta", b"not json"),
    _frame("bad name!", b'{"type":"bad name!","sequence_number":SEQ}'),
    b'event: \xffx.delta\ndata: {"type":"x.delta","sequence_number":SEQ}\n\n',  # a name not UTF-8
    b"event: x.delta\r\ndata: {}\r\n\r\n",
    # other line shapes (the list-wise split checks lines in threes: event, data, blank)
    b'event: x.delta\ndata:{"type":"x.delta","sequence_number":SEQ}\n\n',
    b'event:x.delta\ndata: {"type":"x.delta","sequence_number":SEQ}\n\n',
    b'data: {"type":"x.delta","sequence_number":SEQ}\nevent: x.delta\n\n',
    b'event: x.delta\ndata: {"type":"x.delta",\ndata: "sequence_number":SEQ}\n\n',
    b'event: x.delta\nevent: x.delta\ndata: {"type":"x.delta","sequence_number":SEQ}\n\n',
    # the read fields' types (DESIGN.md section 5: a 502 on the exact path)
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"output_index":true}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"output_index":-1}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"content_index":"0"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"delta":5}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"item_id":["m"]}'),
    b'data: {"type":"x.delta","sequence_number":0}\n\n',
    b'event: x.delta\ndata: {"type":\n',
    b'data: "x.delta","sequence_number":0}\n\n',
    _frame("error", {"type": "error", "sequence_number": "SEQ", "code": "boom", "message": "m"}),
    _frame(
        "response.created", {"type": "response.created", "sequence_number": "SEQ", "response": {"id": "r"}}
    ),
    _frame(
        "response.in_progress", {"type": "response.in_progress", "sequence_number": "SEQ", "response": {}}
    ),
]


def _numbered(frame: bytes, seq: int) -> bytes:
    """`frame` with its ``SEQ`` placeholder set to `seq` (the client's next number there)."""
    return frame.replace(b'"SEQ"', b"SEQ").replace(b"SEQ", str(seq).encode())


def _terminal(seq: int) -> bytes:
    return _frame(
        "response.completed", {"type": "response.completed", "sequence_number": seq, "response": {}}
    )


_TERMINAL = _terminal(0)
#: Valid frames the fast path leaves to the exact path all the same (a ``:`` inside a string: its
#: key count cannot prove "no repeat"); the exact path forwards them unchanged.
_CONSERVATIVE: list[bytes] = [
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"delta":"a: b"}'),
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"o":{"type":"t","u":"http://h"}}'),
]
#: Frames of other shapes that are regular all the same (valid UTF-8, escapes, spaces).
_ALSO_REGULAR: list[bytes] = [
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"delta":"caf\xc3\xa9"}'),
    _frame("x.delta", b'{ "type" : "x.delta" , "sequence_number" : SEQ, "d": "\\n\\u0041" }'),
    # the same key in different objects is no repeat (counted per object)
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"o":{"type":"t","p":[{"type":"u"}]}}'),
    # null read fields count as absent on both paths
    _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"output_index":null,"item_id":null}'),
]


def split_reads(draw: st.DrawFn, body: bytes) -> list[bytes]:
    """`body` cut at up to six drawn offsets into the upstream reads a stream arrives in."""
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    reads, last = [], 0
    for cut in [*cuts, len(body)]:
        if cut > last:
            reads.append(body[last:cut])
            last = cut
    return reads


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    """A stream of regular deltas (numbered from 0, as the client will number them) with
    irregular frames mixed in, maybe a terminal event (perhaps mid-read), split into reads."""
    parts: list[bytes] = []
    seq = 0
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.integers(0, 3)) == 0:
            parts.append(_numbered(draw(st.sampled_from(_IRREGULAR + _ALSO_REGULAR + _CONSERVATIVE)), seq))
            if draw(st.integers(0, 7)) == 0:
                parts.append(b"\n")  # a stray blank line after a frame: dispatches nothing
        else:
            parts.append(_delta(seq, draw(st.sampled_from(["hi", "x" * 300, "é", ""]))))
        seq += 1
    if draw(st.booleans()):
        parts.append(_TERMINAL)
        if draw(st.booleans()):
            parts.append(_delta(seq + 1))  # after the terminal event, in the same read or not
    return split_reads(draw, b"".join(parts))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    streams(),
    st.sampled_from([4096 * 16, 200_000, 1_000_000, 64 << 20]),
    st.sampled_from(["reference", "measured"]),
)
def test_fast_and_exact_paths_give_the_same_bytes_and_outcome(
    reads: list[bytes], limit: int, model: str
) -> None:
    fast = run_stream(reads, fast=True, limit=limit, model=model)
    exact = run_stream(reads, fast=False, limit=limit, model=model)
    assert fast[:2] == exact[:2]
    assert exact[2] == 0


def test_a_regular_stream_goes_in_one_run_per_read_byte_for_byte() -> None:
    body = b"".join(_delta(i) for i in range(100)) + _terminal(100)
    out, outcome, runs = run_stream([body], fast=True, limit=64 << 20)
    assert outcome == "response.completed"
    assert runs == 1
    assert out == body  # already numbered 0..100: every frame as received


def test_the_fast_path_stops_at_the_first_irregular_frame_and_resumes_after_it() -> None:
    head = b"".join(_delta(i) for i in range(3))
    renumbered = _delta(40)  # the client's next number is 3: re-encoded with 3
    reads = [head + renumbered + _delta(4), b"".join(_delta(i) for i in range(5, 8)) + _terminal(8)]
    out, outcome, runs = run_stream(reads, fast=True, limit=64 << 20)
    assert outcome == "response.completed"
    assert runs == 3  # 0-2; 4 after the renumbered frame; the second read
    assert out == head + _delta(3) + b"".join(_delta(i) for i in range(4, 8)) + _terminal(8)


def test_frames_take_the_exact_path_until_the_bound_for_the_rest_of_the_read_fits() -> None:
    frame = len(_delta(0, "x" * 2000))
    body = b"".join(_delta(i, "x" * 2000) for i in range(20)) + _terminal(20)
    limit = 48 * 5 * frame + 512 * 2100  # one frame fits; the rest of the read once 5 are left
    out, outcome, runs = run_stream([body], fast=True, limit=limit)
    assert runs == 1
    assert (out, outcome) == run_stream([body], fast=False, limit=limit)[:2]
    assert outcome == "response.completed"
    assert out == body


@settings(max_examples=300, deadline=None)
@given(streams(), st.integers(0, 3))
def test_list_wise_and_frame_by_frame_classification_agree(reads: list[bytes], start: int) -> None:
    block = b"".join(reads)
    exact = _frame_by_frame(block, start, {})
    assert _vectorised(block, start, {}) in (None, exact)  # None: left to the frame-by-frame walk
    assert regular_prefix(block, start, {}) == exact


@pytest.mark.parametrize(
    "frame",
    [
        *_ALSO_REGULAR,
        *_CONSERVATIVE,
        _frame("error", {"type": "error", "sequence_number": "SEQ", "code": "boom", "message": "m"}),
        _frame("x.delta", b'{"type":"x.delta","sequence_number":99}'),
        _frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"d":"a","d":"b"}'),
    ],
)
def test_the_list_wise_classification_settles_a_long_read_itself(frame: bytes) -> None:
    """With `LIST_WISE_FROM` frames or more, a read of regular frames, a frame of another kind
    among them, is settled list-wise (not left to the walk) and the same as the walk settles it."""
    block = b"".join(_delta(i) for i in range(10)) + _numbered(frame, 10) + _delta(11) + _delta(12)
    found = _vectorised(block, 0, {})
    assert found is not None
    assert found == _frame_by_frame(block, 0, {})
    assert found[1] == (13 if frame in _ALSO_REGULAR else 10)  # all, or the deltas before it


@pytest.mark.parametrize("frame", _IRREGULAR)
def test_regular_prefix_stops_at_each_irregular_shape(frame: bytes) -> None:
    block = _delta(0) + _numbered(frame, 1) + _delta(2)
    end, count, widest, heads = regular_prefix(block, 0, {})
    assert (end, count) == (len(_delta(0)), 1)
    assert widest == len(_delta(0)) - 42  # the data payload: the frame less its event and data lines
    assert heads == [json.loads(_delta(0).partition(b"\ndata: ")[2])]


@pytest.mark.parametrize(
    "frame", [_frame("x.delta", b'{"type":"x.delta","sequence_number":SEQ,"d":"a"}'), *_ALSO_REGULAR]
)
def test_the_same_frames_regular_are_taken(frame: bytes) -> None:
    """The control for the test above: frames of the same kind, numbered right, are taken."""
    block = _delta(0) + _numbered(frame, 1) + _delta(2)
    assert regular_prefix(block, 0, {})[:2] == (len(block), 3)


def test_regular_prefix_counts_frames_and_caches_names() -> None:
    names: dict[bytes, str] = {}
    block = _delta(5) + _delta(6) + b"event: x"
    assert regular_prefix(block, 5, names)[:3] == (2 * len(_delta(5)), 2, len(_delta(5)) - 42)
    assert names == {b"response.output_text.delta": "response.output_text.delta"}
    assert regular_prefix(block, 4, names)[1] == 0  # not the client's next number


@pytest.mark.parametrize("frame", _IRREGULAR[10:14])
def test_a_frame_that_repeats_a_key_is_refused_on_both_paths(frame: bytes) -> None:
    """DESIGN.md §5: an upstream answer that cannot be re-encoded faithfully is 502
    ``upstream_invalid_response`` (a repeated key: a decoder keeps one of them silently)."""
    assert b'"a"' in frame or b'"d"' in frame  # the four repeated-key frames of `_IRREGULAR`
    body = _delta(0) + _numbered(frame, 1) + _terminal(2)
    for fast in (True, False):
        out, outcome, _ = run_stream([body], fast=fast, limit=64 << 20)
        assert outcome == "UpstreamInvalid:upstream_invalid_response"
        assert out == _delta(0)  # the frame before it went out; the repeated one did not


@pytest.mark.parametrize("frame", _CONSERVATIVE)
def test_frames_the_fast_path_cannot_prove_go_out_unchanged_by_the_exact_path(frame: bytes) -> None:
    block = _delta(0) + _numbered(frame, 1) + _terminal(2)
    assert regular_prefix(block, 0, {})[1] == 1  # left to the exact path
    out, outcome, runs = run_stream([block], fast=True, limit=64 << 20)
    assert (out, outcome, runs) == (block, "response.completed", 1)


def test_a_read_the_consumer_keeps_refusing_is_looked_at_in_linear_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read of n regular-named frames the consumer takes none of (the stitcher hiding a
    gateway call's argument deltas) costs O(n) bytes of fast-path scanning, not O(n²): after a
    wasted look the window narrows to `FAST_WINDOW` frames. Counted in bytes handed to
    `regular_prefix`; the client bytes are the exact path's."""
    import middleware.upstream.reader as reader_module

    scanned = 0
    real = reader_module.regular_prefix

    def counting(block: bytes, *args: Any) -> Any:
        nonlocal scanned
        scanned += len(block)
        return real(block, *args)

    monkeypatch.setattr(reader_module, "regular_prefix", counting)
    n = 3000
    body = b"".join(_delta(i) for i in range(n)) + _terminal(n)

    async def go() -> bytes:
        out: list[bytes] = []

        async def send(message: Any) -> None:
            if message["type"] == "http.response.body":
                out.append(message["body"])

        client = ClientStream(send)
        ledger = Ledger(64 << 20, model=ChargeModel.named("reference"), store=False)

        async def on_event(event: UpstreamEvent) -> None:
            await client.forward(event.type, event.data, event.obj, changed=event.changed)

        await read_round(
            _Response([body]),
            ledger,
            client=client,
            on_event=on_event,
            on_run=client.forward_run,
            accept=lambda heads: 0,
        )
        await client.flush()
        return b"".join(out)

    out = asyncio.run(go())
    assert out == body  # every frame went the exact path, unchanged
    # each refused frame costs a look at FAST_WINDOW frames at most: O(n); before, every look saw
    # all of the rest of the read, about n / 2 = 1500 reads' worth
    assert scanned <= (reader_module.FAST_WINDOW + 2) * len(body)
    assert scanned >= len(body)  # the first look saw the whole read


@pytest.mark.parametrize("field", [field for field, _ in STREAM_FIELD_TYPES])
@pytest.mark.parametrize("value", [0, 7, -1, True, False, 1.0, "0", "m", "", None, [], {}])
def test_the_fast_paths_field_types_are_the_exact_paths(field: str, value: Any) -> None:
    """`_Head` (msgspec, list-wise) refuses a read field exactly when `stream_field_error` (the
    exact path's check) does."""
    head = {"type": "x.delta", "sequence_number": 1, field: value}
    try:
        msgspec.convert(head, _Head)
        refused = False
    except msgspec.ValidationError:
        refused = True
    assert refused == (stream_field_error(head) is not None)


_SURROGATE_TEXT = st.lists(
    st.sampled_from(["a", "é", "\n", '"', "\\", "\ud800", "\udfff", "\ud83d\ude00", "😀", "\x00"]),
    max_size=8,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(_SURROGATE_TEXT, st.sampled_from(["ascii", "utf-8", "utf-16", "utf-32"]))
def test_a_text_said_to_hold_no_surrogate_decodes_to_none(text: str, encoding: str) -> None:
    """`may_hold_surrogate` False proves the decoded value has no surrogate in any string (key
    or value): escaped, raw bytes (``json.loads`` reads bytes with ``surrogatepass``), UTF-16/32."""
    obj = {text: [text, {"k": text}]}
    if encoding == "ascii":
        data = json.dumps(obj).encode()
    else:
        data = json.dumps(obj, ensure_ascii=False).encode(encoding, "surrogatepass")
    decoded = json.loads(data)
    holds = any(0xD800 <= ord(ch) <= 0xDFFF for ch in json.dumps(decoded, ensure_ascii=False))
    if holds:
        assert may_hold_surrogate(data)
    if encoding == "utf-8" and "\x00" not in text and not any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        assert not may_hold_surrogate(data)  # raw UTF-8 with no surrogate passes (ASCII escapes may not)


_PLAIN = _delta(1, "x" * 40)


@pytest.mark.parametrize("inside", [1, 20, -1])  # in the event line, the data, before its blank line
def test_a_read_that_begins_mid_frame_goes_fast_after_that_frame(inside: int) -> None:
    """A read that begins inside a frame (over a network reads end anywhere): that frame, its
    beginning as the parser holds it joined with its rest, is taken whole on the fast path, then
    the rest of the read goes fast again — not all of it the exact way."""
    frames = [_delta(i) for i in range(40)]
    body = b"".join(frames) + _terminal(40)
    cut = sum(map(len, frames[:20])) + (inside if inside > 0 else len(frames[20]) + inside)
    out, outcome, runs = run_stream([body[:cut], body[cut:]], fast=True, limit=64 << 20)
    assert (out, outcome) == (body, "response.completed")
    assert runs == 3  # frames 0-19 in the first read; frame 20 whole; 21-39 after it


@pytest.mark.parametrize("frame", _IRREGULAR + _ALSO_REGULAR + _CONSERVATIVE + [_PLAIN])
def test_a_frame_split_anywhere_across_reads_gives_the_exact_paths_bytes_and_outcome(frame: bytes) -> None:
    """Every cut inside every kind of frame (and in the blank line after it): the frame held by
    the parser and completed by the next read gives the same client bytes and outcome as the exact
    path, whether it is taken whole on the fast path (`_FastPath.held`) or left to the exact one."""
    head, tail = _delta(0), _delta(2) + _terminal(3)
    body = head + _numbered(frame, 1) + tail
    taken = 0
    for cut in range(len(head) + 1, len(body) - len(tail) + 1):
        reads = [body[:cut], body[cut:]]
        fast = run_stream(reads, fast=True, limit=64 << 20)
        assert fast[:2] == run_stream(reads, fast=False, limit=64 << 20)[:2], cut
        taken += fast[2] == 3  # the delta before it, the frame whole, the rest of the read
    if frame in _ALSO_REGULAR or frame == _PLAIN:
        assert taken > 0  # regular: taken whole at some cut


def test_a_long_frame_over_many_reads_is_joined_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame spanning many reads (a 1 MiB ``output_text.done`` in 4 KiB reads) is written back
    from the parser and joined with its rest once, when a read completes it — not at every read
    (which copied the growing beginning each time: quadratic in the frame's size)."""
    starts: list[int] = []
    real = SSEParser.held_frame_start

    def counted(self: SSEParser) -> bytes | None:
        head = real(self)
        starts.append(len(head or b""))
        return head

    monkeypatch.setattr(SSEParser, "held_frame_start", counted)
    body = _delta(0) + _delta(1, "x" * (1 << 20)) + _delta(2) + _terminal(3)
    reads = [body[at : at + 4096] for at in range(0, len(body), 4096)]
    out, outcome, _ = run_stream(reads, fast=True, limit=256 << 20)
    assert (out, outcome) == (body, "response.completed")
    assert len(starts) <= 3  # at most one per frame a read ends inside
    assert sum(starts) < 2 * len(body)
    # under the reference model the 1 MiB frame's bound does not fit 256 MiB (its parse at 512
    # bytes a byte): it goes the exact way without being copied and decoded first
    assert not Ledger(256 << 20, model=ChargeModel.named("reference")).stream_read_fits(1 << 20, 1 << 20)
    assert max(starts, default=0) < 1 << 19


@pytest.mark.parametrize("first", [0, 1, 7])
def test_a_frame_before_a_broken_event_name_reaches_the_client_on_both_paths(first: int) -> None:
    """The attack on issue 21's round 6: with the frames before a broken event name in the same
    read, the exact path sent none of them while the fast path sent them; both now send them,
    then fail the same way."""
    good = _delta(0)
    bad = b'event: \xffx.delta\ndata: {"type":"x.delta","sequence_number":1}\n\n'
    body = good + bad
    reads = [body[:first], body[first:]] if first else [body]
    fast = run_stream(reads, fast=True, limit=64 << 20)
    exact = run_stream(reads, fast=False, limit=64 << 20)
    assert fast[:2] == exact[:2]
    assert exact[0].startswith(good) and exact[1] == "UpstreamIncomplete:upstream_incomplete"


def test_a_read_whose_bound_cannot_fit_is_not_classified(monkeypatch: pytest.MonkeyPatch) -> None:
    """Close to the limit, where the read's one bound cannot fit even with no frame in it, the
    fast path does not classify the read (work `_forward` would then refuse, done before the exact
    path does it again): the stream goes the exact way, with its bytes and outcome."""
    import middleware.upstream.reader as reader

    looked: list[int] = []
    real = reader.regular_prefix

    def counted(block: bytes, *args: Any, **kwargs: Any) -> Any:
        looked.append(len(block))
        return real(block, *args, **kwargs)

    monkeypatch.setattr(reader, "regular_prefix", counted)
    body = b"".join(_delta(i, "x" * 2000) for i in range(20)) + _terminal(20)
    limit = 102_144  # the least the exact path completes this stream with (reference model)
    assert not Ledger(limit, model=ChargeModel.named("reference")).stream_read_fits(len(body), 0)
    fast = run_stream([body], fast=True, limit=limit)
    assert fast == (*run_stream([body], fast=False, limit=limit)[:2], 0)
    assert fast[1] == "response.completed"
    # only the read's last bytes, once what is left of it fits (every frame's rest before this)
    assert sum(looked) < len(body) // 10, looked


def test_a_broken_event_name_after_frames_fails_alike_under_a_tight_limit() -> None:
    """Found by the property test above: the parser held back its failure but kept the whole read
    as pending, which the exact path then charged (32 bytes a byte): a cap hit there, the decode
    failure on the fast path. A failed parser holds nothing now."""
    bad = b'event: \xffx.delta\ndata: {"type":"x.delta","sequence_number":3}\n\n'
    body = (
        _delta(0)
        + _delta(1)
        + b": a comment\n\n\n"
        + bad
        + b"\n"
        + b"".join(_delta(4 + i, "x" * 300) for i in range(4))
    )
    fast = run_stream([body], fast=True, limit=65536, model="reference")
    exact = run_stream([body], fast=False, limit=65536, model="reference")
    assert fast[:2] == exact[:2]
    assert exact[1] == "UpstreamIncomplete:upstream_incomplete"
    assert exact[0] == _delta(0) + _delta(1)
