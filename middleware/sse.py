"""Incremental Server-Sent Events parser and frame encoder (WHATWG HTML §9.2.6).

`SSEParser.feed(chunk)` takes bytes as they come off the socket, split anywhere, and returns the
events completed by them. Line ends may be LF, CR or CRLF (a CRLF split across two chunks is one
line end); comment lines (``:``…), ``id:`` and ``retry:`` fields are ignored (the gateway emits
neither); a block without ``data`` dispatches nothing; several ``data:`` lines join with ``\\n``.
`pending` is the number of raw bytes held that belong to no completed event yet (what the ledger
charges as retained stream bytes). Data stays bytes (``json.loads`` validates its UTF-8); an event
name that is not UTF-8 raises `SSEDecodeError`.
"""

from __future__ import annotations

import dataclasses
import re

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEDecodeError(ValueError):
    """A line of the stream is not valid UTF-8."""


@dataclasses.dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event: ``event`` (its name, "message" when absent) and ``data`` (the raw
    UTF-8 bytes of its data lines joined by ``\n``; validated as UTF-8 when it is decoded)."""

    event: str
    data: bytes


class SSEParser:
    """Stateful WHATWG event-stream parser; feed bytes, get `SSEEvent`s."""

    __slots__ = ("_buf", "_data", "_data_bytes", "_event", "_skip_lf")

    def __init__(self) -> None:
        self._buf = b""  # bytes of an unfinished line
        self._skip_lf = False  # last chunk ended in CR: a leading LF is that line end's second half
        self._event = ""
        self._data: list[bytes] = []
        self._data_bytes = 0

    @property
    def pending(self) -> int:
        """Raw bytes held for events not yet complete (partial line plus the current block's data)."""
        return len(self._buf) + self._data_bytes

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume `chunk`; return the events it completes, in order. Raises SSEDecodeError."""
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        data = self._buf + chunk if self._buf else chunk
        events: list[SSEEvent] = []
        pos = 0
        for match in _LINE_END.finditer(data):
            end = match.end()
            if match.group() == b"\r" and end == len(data):
                self._skip_lf = True  # CR at the very end: an LF may follow in the next chunk
            self._line(data[pos : match.start()], events, match.end() - pos)
            pos = end
        self._buf = data[pos:]
        return events

    def _line(self, line: bytes, events: list[SSEEvent], raw_len: int) -> None:
        if not line:
            if self._data:
                events.append(SSEEvent(self._event or "message", b"\n".join(self._data)))
            self._event = ""
            self._data = []
            self._data_bytes = 0
            return
        if line[:1] == b":":
            return
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._data_bytes += raw_len
        elif name == b"event":
            try:
                self._event = value.decode("utf-8")
            except UnicodeDecodeError:
                raise SSEDecodeError(f"upstream SSE event name is not valid UTF-8: {line[:80]!r}") from None
        # id, retry and unknown fields are ignored: the gateway never re-emits them.

    def finish(self) -> None:
        """End of stream: an unterminated block is discarded, as the spec says. Returns nothing."""
        self._buf = b""
        self._event = ""
        self._data = []
        self._data_bytes = 0


def encode_event(event: str, data: bytes) -> bytes:
    """One frame, ``event: <event>\\ndata: <data>\\n\\n``; multi-line data gets one ``data:`` per line."""
    head = b"event: " + event.encode() + b"\n"
    if b"\n" in data or b"\r" in data:
        return head + b"".join(b"data: " + line + b"\n" for line in data.splitlines()) + b"\n"
    return head + b"data: " + data + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"
