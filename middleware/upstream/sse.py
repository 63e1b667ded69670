"""Incremental Server-Sent Events parser and frame encoder (WHATWG HTML §9.2.6).

`SSEParser.feed(chunk)` takes bytes as they come off the socket, split anywhere, and returns the
events completed by them. Line ends may be LF, CR or CRLF (a CRLF split across two chunks is one
line end); comment lines (``:``…), ``id:`` and ``retry:`` fields are ignored (the gateway emits
neither); a block without ``data`` dispatches nothing; several ``data:`` lines join with ``\\n``.
`pending` is the number of raw bytes held that belong to no completed event yet (what the ledger
charges as retained stream bytes), and each event carries ``raw_len``: the wire bytes it took since
the previous event (comments and meta-only blocks before it included) — the same whatever the
chunking, so charges made per event do not depend on how the stream was read. A CR at the very end
of a chunk is held until the next byte shows whether it starts a CRLF (`flush` at end of stream
settles it). Data stays bytes (``json.loads`` validates its UTF-8); an event name that is not UTF-8
raises `SSEDecodeError`.
"""

from __future__ import annotations

import dataclasses
import re

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEDecodeError(ValueError):
    """A line of the stream is not valid UTF-8."""


@dataclasses.dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event: ``event`` (its name, "message" when absent), ``data`` (the raw UTF-8
    bytes of its data lines joined by ``\n``; validated as UTF-8 when it is decoded) and
    ``raw_len`` (the wire bytes it took, see the module docstring)."""

    event: str
    data: bytes
    raw_len: int = 0


class SSEParser:
    """Stateful WHATWG event-stream parser; feed bytes, get `SSEEvent`s."""

    __slots__ = ("_buf", "_consumed", "_data", "_event", "_failed")

    def __init__(self) -> None:
        # The unfinished line (no line end inside it, but perhaps a trailing CR that may start a
        # CRLF). A bytearray appended in place and scanned only from its new bytes, so a long
        # line fed in many chunks costs O(n), not O(n^2).
        self._buf = bytearray()
        self._consumed = 0  # raw bytes of the lines taken since the last dispatched event
        self._event = ""
        self._data: list[bytes] = []
        self._failed: SSEDecodeError | None = None  # raised by the next call (`feed`)

    @property
    def line_held(self) -> bool:
        """Whether an unfinished line is held (bytes after the last line end fed, or a CR that may
        start a CRLF): then the next byte does not start a line."""
        return bool(self._buf)

    def held_frame_start(self) -> bytes | None:
        """The frame begun so far, written as `encode_event` writes a frame, when that is exact:
        ``event: NAME\n`` for the event line taken (none when there is none), ``data: DATA\n`` for
        the one data line taken (if any), then the unfinished line's bytes as fed. Followed by
        the rest of the frame as it comes, these bytes parse to the same event as what was fed
        (the lines taken are written back as their parse; comments, ``id:`` lines and other fields
        taken are dropped, as `encode_event` drops them), so the frame may be classified as a
        whole (the stream fast path: `middleware.upstream.fastpath.regular_prefix`). None when
        it is not exact: more than one data line taken, a CR held (CR line ends), or a failure
        held back (`feed`)."""
        if len(self._data) > 1 or b"\r" in self._buf or self._failed is not None:
            return None
        head = b"event: " + self._event.encode() + b"\n" if self._event else b""
        if self._data:
            head += b"data: " + self._data[0] + b"\n"
        return head + self._buf if self._buf else head

    def clear(self) -> None:
        """Drop the frame begun so far (`held_frame_start`'s caller took it whole)."""
        self._buf.clear()
        self._consumed = 0
        self._event = ""
        self._data = []

    @property
    def pending(self) -> int:
        """Raw bytes held for no completed event yet (the partial line and the lines taken since
        the last dispatched event)."""
        return len(self._buf) + self._consumed

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume `chunk`; return the events it completes, in order. Raises SSEDecodeError —
        after the events completed before the line at fault, when there are any: those are
        returned, and the error is raised by the next `feed` or `flush`. So what is handed out
        before a broken line does not depend on how the stream was split into chunks."""
        if self._failed is not None:
            raise self._failed
        events: list[SSEEvent] = []
        try:
            self._feed(chunk, events)
        except SSEDecodeError as exc:
            if not events:
                raise
            self._failed = exc
            self.clear()  # nothing is held for the next call, which raises: `pending` is 0
        return events

    def _feed(self, chunk: bytes, events: list[SSEEvent]) -> None:
        buf = self._buf
        if b"\r" in chunk or buf.endswith(b"\r"):
            self._feed_lines(chunk, events)
            return
        scan_from = len(buf)
        buf += chunk
        if buf.find(b"\n", scan_from) < 0:  # no line completed: nothing copied, nothing scanned twice
            return
        # LF-only bytes: whole `event: ...` / `data: ...` frames are cut out at C speed; anything
        # else (comments, meta fields, multi-line data, a frame begun in an earlier chunk) goes
        # line by line through `_line`, exactly as `_feed_lines` would.
        data = bytes(buf)
        pos = 0
        blank = data.find(b"\n\n")
        while True:
            if pos <= blank and not self._data and not self._event:
                frame = data[pos:blank]
                nl = frame.find(b"\n")
                matched = True
                if nl < 0 and frame.startswith(b"data: "):
                    events.append(SSEEvent("message", frame[6:], self._consumed + blank + 2 - pos))
                elif (
                    nl > 0
                    and frame.startswith(b"event: ")
                    and frame.startswith(b"data: ", nl + 1)
                    and frame.find(b"\n", nl + 1) < 0
                ):
                    try:
                        name = frame[7:nl].decode("utf-8") or "message"
                    except UnicodeDecodeError:
                        raise SSEDecodeError(
                            f"upstream SSE event name is not valid UTF-8: {frame[:80]!r}"
                        ) from None
                    events.append(SSEEvent(name, frame[nl + 7 :], self._consumed + blank + 2 - pos))
                else:
                    matched = False
                if matched:
                    self._consumed = 0
                    pos = blank + 2
                    blank = data.find(b"\n\n", pos)
                    continue
            end = data.find(b"\n", pos)
            if end < 0:
                break
            self._line(data[pos:end], events, end + 1 - pos)
            pos = end + 1
            if 0 <= blank < pos:
                blank = data.find(b"\n\n", pos)
        del buf[:pos]

    def _feed_lines(self, chunk: bytes, events: list[SSEEvent]) -> None:
        """`feed` for bytes with CR line ends: every line end (LF, CR, CRLF) found by one regex."""
        buf = self._buf
        scan_from = max(len(buf) - 1, 0)  # a held CR may pair with the first new byte
        buf += chunk
        # A trailing CR may be the first half of a CRLF whose LF is in the next chunk: keep it.
        end = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
        pos = 0
        for match in _LINE_END.finditer(buf, scan_from, end):
            self._line(bytes(buf[pos : match.start()]), events, match.end() - pos)
            pos = match.end()
        if pos:
            del buf[:pos]

    def flush(self) -> list[SSEEvent]:
        """End of stream: a held trailing CR ends its line (which may complete an event). An
        event left without its blank line is discarded, as the spec says. Raises the
        SSEDecodeError `feed` held back, if any."""
        if self._failed is not None:
            raise self._failed
        events: list[SSEEvent] = []
        if self._buf.endswith(b"\r"):
            line = bytes(self._buf[:-1])
            self._line(line, events, len(line) + 1)
        self._buf.clear()
        return events

    def _line(self, line: bytes, events: list[SSEEvent], raw_len: int) -> None:
        self._consumed += raw_len
        if not line:
            if self._data:
                events.append(SSEEvent(self._event or "message", b"\n".join(self._data), self._consumed))
                self._consumed = 0
            self._event = ""
            self._data = []
            return
        if line[:1] == b":":
            return
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            try:
                self._event = value.decode("utf-8")
            except UnicodeDecodeError:
                raise SSEDecodeError(f"upstream SSE event name is not valid UTF-8: {line[:80]!r}") from None
        # id, retry and unknown fields are ignored: the gateway never re-emits them.


def encode_event(event: str, data: bytes) -> bytes:
    """One frame, ``event: <event>\\ndata: <data>\\n\\n``; multi-line data gets one ``data:`` per line."""
    head = b"event: " + event.encode() + b"\n"
    if b"\n" in data or b"\r" in data:
        return head + b"".join(b"data: " + line + b"\n" for line in data.splitlines()) + b"\n"
    return head + b"data: " + data + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"
