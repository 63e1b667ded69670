"""WHATWG SSE parsing: line ends, comments, meta-only blocks, and chunking independence.

Cases B09 (CRLF / CR line ends), B10 (comments, retry/id-only blocks, empty data) and B11 (events
split anywhere) of ../shared/cases/CASES.md, at the parser level; the end-to-end versions are in
tests/e2e/test_limits_e2e.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.upstream.sse import SSEDecodeError, SSEEvent, SSEParser, encode_event


def parse_full(chunks: list[bytes]) -> list[SSEEvent]:
    """Every event of a stream fed in `chunks`, the end of stream included (`flush`)."""
    parser = SSEParser()
    out: list[SSEEvent] = []
    for chunk in chunks:
        out.extend(parser.feed(chunk))
    out.extend(parser.flush())
    return out


def parse(chunks: list[bytes]) -> list[SSEEvent]:
    """The events as (name, data) only: `raw_len` is checked on its own below."""
    return [SSEEvent(e.event, e.data) for e in parse_full(chunks)]


def frame(t: str, obj: object, nl: str = "\n") -> bytes:
    return f"event: {t}{nl}data: {json.dumps(obj, separators=(',', ':'))}{nl}{nl}".encode()


REFERENCE = [
    ("response.created", {"type": "response.created", "sequence_number": 0}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hel"}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "delta": 'lo "x"\\'}),
    ("response.completed", {"type": "response.completed", "sequence_number": 3}),
]
WANT = [SSEEvent(t, json.dumps(o, separators=(",", ":")).encode()) for t, o in REFERENCE]


@pytest.mark.parametrize("nl", ["\n", "\r\n", "\r"])
def test_b09_line_endings_give_identical_events(nl: str) -> None:
    stream = b"".join(frame(t, o, nl) for t, o in REFERENCE)
    got = parse([stream])
    assert got == WANT
    assert all(b"\r" not in e.data and "\r" not in e.event for e in got)


def test_b09_crlf_split_across_chunks_is_one_line_end() -> None:
    stream = b"".join(frame(t, o, "\r\n") for t, o in REFERENCE)
    cut = stream.index(b"}\r\n") + 2  # chunk ends in b'}\r', the next starts with b'\n\r\n'
    assert stream[cut - 1 : cut] == b"\r"
    parser = SSEParser()
    first = parser.feed(stream[:cut])
    assert first == []  # no premature dispatch: the event is not complete yet
    rest = parser.feed(stream[cut:])
    assert [SSEEvent(e.event, e.data) for e in first + rest] == WANT
    assert parser.pending == 0  # the buffer is emptied after each event


def test_b10_comments_and_meta_only_blocks_dispatch_nothing() -> None:
    noise = [
        b": OPENROUTER PROCESSING\n\n",
        b":\n\n",
        b": ping - 2025-01-01 00:00:00\n",
        b"retry: 3000\n\n",
        b"id: 7\n\n",
        b"event: ping\n\n",
        b"data:\n\n",
    ]
    frames = [frame(t, o) for t, o in REFERENCE]
    chunks = [
        noise[0],
        frames[0],
        noise[1],
        noise[2],
        frames[1],
        noise[3],
        noise[4],
        noise[5],
        frames[2],
        noise[6],
    ]
    chunks.append(frames[3])
    got = parse(chunks)
    # `data:` alone carries an empty string: per the spec it dispatches an event with empty data.
    non_empty = [e for e in got if e.data]
    assert non_empty == WANT
    assert all(not e.data.startswith(b":") for e in got)


def test_b11_every_split_offset_of_an_escaped_quote_event() -> None:
    delta = {
        "type": "response.function_call_arguments.delta",
        "delta": 'Info" style="margin-top: 12px;"></dl',
    }
    stream = frame("response.function_call_arguments.delta", delta)
    want = parse([stream])
    assert len(want) == 1
    for cut in range(len(stream) + 1):
        assert parse([stream[:cut], stream[cut:]]) == want, cut


def test_b11_one_byte_per_chunk() -> None:
    stream = b"".join(frame(t, o) for t, o in REFERENCE)
    assert parse([stream[i : i + 1] for i in range(len(stream))]) == WANT


def test_multiline_data_joins_with_newline() -> None:
    assert parse([b"data: a\ndata: b\n\n"]) == [SSEEvent("message", b"a\nb")]


def test_multibyte_utf8_split_across_chunks() -> None:
    stream = 'data: {"d":"😀é"}\n\n'.encode()
    cut = stream.index("😀".encode()) + 2
    assert parse([stream[:cut], stream[cut:]]) == [SSEEvent("message", '{"d":"😀é"}'.encode())]


def test_invalid_utf8_event_name_raises() -> None:
    with pytest.raises(SSEDecodeError):
        parse([b"event: \xff\ndata: {}\n\n"])


def test_unterminated_block_is_not_dispatched() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: {}\n") == []
    assert parser.pending > 0
    assert parser.flush() == []


def test_encode_event_round_trips_multiline() -> None:
    assert parse([encode_event("x", b"a\nb")]) == [SSEEvent("x", b"a\nb")]


@settings(max_examples=200, deadline=None)
@given(
    nl=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=30),
    noise=st.lists(st.sampled_from([b":\n\n", b": c\n", b"retry: 1\n\n", b"id: 2\n\n"]), max_size=4),
)
def test_any_chunking_yields_the_same_events(nl: str, cuts: list[int], noise: list[bytes]) -> None:
    stream = b"".join(noise) + b"".join(frame(t, o, nl) for t, o in REFERENCE)
    points = sorted({c % (len(stream) + 1) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    assert parse(chunks) == WANT


@settings(max_examples=200, deadline=None)
@given(
    nl=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=30),
    noise=st.lists(st.sampled_from([b":\n\n", b": c\n", b"retry: 1\n\n", b"id: 2\n\n"]), max_size=4),
)
def test_raw_lengths_cover_the_stream_whatever_the_chunking(
    nl: str, cuts: list[int], noise: list[bytes]
) -> None:
    """Each event's raw_len is the wire bytes since the previous event: they add up to the stream
    and do not depend on the chunking (the ledger charges frames by them)."""
    stream = b"".join(noise) + b"".join(frame(t, o, nl) for t, o in REFERENCE)
    points = sorted({c % (len(stream) + 1) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    whole = [e.raw_len for e in parse_full([stream])]
    assert [e.raw_len for e in parse_full(chunks)] == whole
    assert sum(whole) == len(stream)


def test_a_long_line_in_many_chunks_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear, not quadratic: each byte is searched for line ends about once however many chunks
    a 1 MiB line arrives in (a quadratic parser blocked the event loop for seconds)."""
    import re

    import middleware.upstream.sse as sse

    scanned = [0]

    class Counting:
        def finditer(self, buf: bytes, pos: int = 0, endpos: int = -1) -> object:
            scanned[0] += (len(buf) if endpos < 0 else endpos) - pos
            return re.compile(rb"\r\n|\r|\n").finditer(buf, pos, len(buf) if endpos < 0 else endpos)

    monkeypatch.setattr(sse, "_LINE_END", Counting())
    stream = b"data: " + b"y" * (1 << 20) + b"\n\n"
    parser = SSEParser()
    events = []
    for i in range(0, len(stream), 4096):
        events += parser.feed(stream[i : i + 4096])
    assert [len(e.data) for e in events] == [1 << 20]
    assert scanned[0] <= 2 * len(stream)


class LinesOnly(SSEParser):
    """The reference: every byte through the line-by-line path (`_feed_lines`)."""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        self._feed_lines(chunk, events)
        return events


LINES = [
    b"event: response.output_text.delta",
    b'data: {"a":1}',
    b"data:nospace",
    b"data:  two spaces",
    b"data: ",
    b"data",
    b"event: ",
    b"event:x",
    b": comment",
    b"id: 7",
    b"retry: 10",
    b"",
    b"",
    b"",
]


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.sampled_from(LINES), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=20),
)
def test_the_lf_fast_path_matches_the_line_by_line_parser(lines: list[bytes], cuts: list[int]) -> None:
    """Canonical frames are cut out whole on LF-only input; every other shape (comments, meta
    fields, multi-line data, frames split across chunks) must give the same events and raw_len."""
    stream = b"\n".join(lines) + b"\n"
    points = sorted({c % (len(stream) + 1) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    fast, slow = SSEParser(), LinesOnly()
    got = [e for c in chunks for e in fast.feed(c)] + fast.flush()
    want = [e for c in chunks for e in slow.feed(c)] + slow.flush()
    assert got == want
    assert fast.pending == slow.pending


def test_a_long_lf_line_in_many_chunks_is_copied_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LF fast path copies the buffer only when a line end arrived: a 1 MiB line fed in 4 KiB
    chunks is copied about once, not once per chunk."""
    import middleware.upstream.sse as sse

    copied = [0]

    def counting_bytes(value: bytes | bytearray) -> bytes:
        copied[0] += len(value)
        return bytes(value)

    monkeypatch.setattr(sse, "bytes", counting_bytes, raising=False)
    stream = b"event: x\ndata: " + b"y" * (1 << 20) + b"\n\nevent: z\ndata: 1\n\n"
    parser = SSEParser()
    events = []
    for i in range(0, len(stream), 4096):
        events += parser.feed(stream[i : i + 4096])
    assert [(e.event, len(e.data)) for e in events] == [("x", 1 << 20), ("z", 1)]
    assert copied[0] <= 2 * len(stream)


_LINES = st.sampled_from(
    [
        b"event: x.delta\n",
        b"event:x.delta\n",
        b"event: y\n",
        b'data: {"a":1}\n',
        b'data:{"a": 2}\n',
        b"data:  spaced\n",
        b": comment\n",
        b"id: 7\n",
        b"retry: 5\n",
        b"event: x\r\n",
        b"data: cr\r",
        b"\n",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_LINES, min_size=1, max_size=7), st.data())
def test_a_held_frame_start_followed_by_the_rest_parses_as_what_was_fed(
    lines: list[bytes], data: st.DataObject
) -> None:
    """`SSEParser.held_frame_start`: wherever a stream is cut, the frame begun so far written back
    (when the parser says it can be) followed by the rest parses to the same events as the rest
    fed to the parser that holds it (the stream fast path takes a held frame whole on this)."""
    stream = b"".join(lines) + b"\n"
    cut = data.draw(st.integers(0, len(stream)))
    holder = SSEParser()
    holder.feed(stream[:cut])
    head = holder.held_frame_start()
    if head is None:
        assert len(holder._data) > 1 or b"\r" in bytes(holder._buf)
        return
    fresh = SSEParser()
    rest = stream[cut:]
    got = [(e.event, e.data) for e in fresh.feed(head + rest) + fresh.flush()]
    want = [(e.event, e.data) for e in holder.feed(rest) + holder.flush()]
    assert got == want


def test_clear_drops_the_held_frame() -> None:
    parser = SSEParser()
    parser.feed(b"event: x\ndata: {")
    assert parser.held_frame_start() == b"event: x\ndata: {" and parser.pending == len(b"event: x\ndata: {")
    parser.clear()
    assert parser.pending == 0 and parser.held_frame_start() == b""
    assert [(e.event, e.data) for e in parser.feed(b"data: 1\n\n")] == [("message", b"1")]


@pytest.mark.parametrize("split", [0, 1, 20])
def test_events_before_a_broken_line_are_handed_out_however_the_stream_was_split(split: int) -> None:
    """An event name that is not UTF-8 fails the stream, but the events completed before it in
    the same chunk are handed out first and the error comes with the next call: what a client
    gets before the failure does not depend on where the upstream's reads ended (issue 21 attack:
    the exact path sent nothing where the fast path, cutting the read at a frame, sent frame A)."""
    good = b'event: x.d\ndata: {"a":1}\n\n'
    bad = b'event: \xffx.d\ndata: {"a":2}\n\n'
    stream = good + bad
    parser = SSEParser()
    got = parser.feed(stream[:split]) if split else []
    got += parser.feed(stream[split:])
    assert [(e.event, e.data) for e in got] == [("x.d", b'{"a":1}')]
    assert parser.held_frame_start() is None  # nothing of a failed parser goes the fast way
    assert parser.pending == 0  # nor is anything held (charged) for it
    with pytest.raises(SSEDecodeError, match="not valid UTF-8"):
        parser.feed(b"data: 3\n\n")
    with pytest.raises(SSEDecodeError):
        parser.flush()


@pytest.mark.parametrize("cr", [b"\n", b"\r\n"])
def test_a_broken_line_first_in_a_chunk_still_raises_at_once(cr: bytes) -> None:
    with pytest.raises(SSEDecodeError):
        SSEParser().feed(b"event: \xff" + cr + b"data: 1" + cr + cr)
