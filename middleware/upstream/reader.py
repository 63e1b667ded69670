"""Reading one upstream round under the ledger: SSE streams and buffered JSON bodies.

`read_stream_events` feeds the upstream body to the SSE parser in slices of at most 4 KiB, charging
the parser's buffer and each complete frame (``admit_stream_bytes``, released once the frame is
handed out) and each frame's parse (``check_stream_frame``, transient) before ``json.loads`` runs,
and yields `UpstreamEvent`s; with a `FastRun` it forwards runs of regular frames as received
instead (issue 21: `middleware.upstream.fastpath`), the pass-through's and, store on, the loop's
rounds (the accumulator then admits their delta text, `StreamAccumulator.stage`).
`StreamAccumulator` keeps what a round needs once its stream is over — delta text until its item
is done, finished items, the terminal response — each charged with ``admit_accumulated`` and a
replaced snapshot released only after its replacement was admitted (DESIGN.md §4).
`read_buffered_body` reads a JSON body under ``admit_output`` with the ``max_retained_bytes // 8``
clamp (DESIGN.md §3). Upstream JSON holding ``NaN`` / ``Infinity``, numbers out of the float
range (``-1e400``) or lone surrogates (what cannot be re-encoded as JSON or UTF-8), SSE data
repeating a key, a frame whose ``event:`` line names another type than its data, read fields of
the wrong type (`middleware.upstream.fastpath.stream_field_error`) and events out of order
(`StreamOrder`) are refused. Failures raise `middleware.upstream.errors` failures or `BudgetExceeded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Final

from budget import (
    BudgetExceeded,
    JsonFeatures,
    JsonNodeCounter,
    JsonTooDeep,
    Ledger,
    PoolExhausted,
    decode_first,
    key_total,
)
from middleware.upstream.errors import (
    UpstreamBodyTooLarge,
    UpstreamIncomplete,
    UpstreamInvalid,
    stream_error_failure,
)
from middleware.upstream.fastpath import (
    IRREGULAR_TYPES,
    NOT_REGULAR,
    STITCHED_IRREGULAR_TYPES,
    frames_end,
    may_hold_surrogate,
    no_duplicate_keys,
    regular_prefix,
    stream_field_error,
)
from middleware.upstream.protocol import UpstreamResponse
from middleware.upstream.sse import SSEDecodeError, SSEEvent, SSEParser

if TYPE_CHECKING:
    from middleware.asgi.client_stream import ClientStream

EVENT_TYPE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # what may be written into an `event:` line
SLICE = 4096  # bytes fed to the SSE parser at a time, so charges do not depend on socket reads
MAX_UPSTREAM_DEPTH = 256  # JSON nesting accepted from the upstream (json.loads recurses per level)
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
#: The events that open a response before its output (Open Responses' streaming lifecycle).
LIFECYCLE_EVENTS = frozenset({"response.created", "response.in_progress", "response.queued"})


@dataclasses.dataclass(slots=True)
class UpstreamEvent:
    """One parsed upstream SSE event: ``type`` (from the JSON, else the event name), the raw
    ``data`` bytes as received, and the parsed ``obj``. ``changed``: ``obj`` was edited after the
    parse, so ``data`` no longer matches it (forward ``obj`` re-encoded, not ``data``)."""

    type: str
    data: bytes
    obj: dict[str, Any]
    changed: bool = False


def no_terminal_event() -> UpstreamIncomplete:
    """The one failure of a stream that ended without a terminal event."""
    return UpstreamIncomplete("upstream stream ended without a terminal event")


def _reject_constant(name: str) -> Any:
    raise UpstreamInvalid(f"upstream JSON holds {name}, which JSON cannot carry")


def _finite_float(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf - inf is nan; a finite value minus itself is 0.0
        raise UpstreamInvalid(
            f"upstream JSON holds the number {text[:40]}, which is out of range (it overflows to infinity)"
        )
    return value


#: Built once: ``json.loads(..., parse_constant=...)`` builds a decoder (and its scanner, a
#: reference cycle) on every call, which costs as much as decoding a text delta.
_UPSTREAM_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


#: Byte order marks (UTF-8, UTF-16, UTF-32): a body that starts with one is not UTF-8 JSON
#: (RFC 8259 §8.1: no byte order mark in JSON exchanged between systems).
_BOMS: Final = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")


def loads_upstream(data: bytes, *, depth_checked: bool = False, size_priced: bool = False) -> Any:
    """``json.loads`` for upstream bytes: ``NaN`` / ``Infinity`` and numbers out of the float range
    (``-1e400``, which ``float`` turns into ``-inf``) raise `UpstreamInvalid` (DESIGN.md §5: what
    cannot be re-encoded as JSON is 502 ``upstream_invalid_response``). The bytes must be UTF-8
    (RFC 8259 §8.1; an event stream is UTF-8 too, WHATWG HTML §9.2.5), decoded with
    ``surrogatepass`` as ``json.loads`` does, so raw surrogate bytes reach the lone-surrogate
    check: `UnicodeDecodeError` for bytes that are not UTF-8 — ``json.loads`` would read UTF-16
    or UTF-32 as well, and the pass-through forwards a frame's or a body's bytes as they came —
    `ValueError` (`json.JSONDecodeError`) for text that is not JSON (a byte order mark included).

    msgspec decodes first where it may (`budget.decode_first`: the same value as
    ``json.loads``, no more memory than priced for it, nesting provably at most 256 levels —
    `depth_checked`: the caller counted it, `read_buffered_body`), 2-3 × faster: no ``str`` copy
    of the text, no Python hooks. Anything it refuses — ``NaN``, lone surrogates, numbers out of
    range, invalid UTF-8 — goes to ``json.loads``, whose verdict and message stand. The parse
    peak priced (`budget.calibrate`) is the worse of the two. `size_priced`: the caller checked
    a size-only charge for the parse (an SSE frame's, `budget.Ledger.check_stream_frame_bounded`)
    and keeps nothing of the value that a feature price covers (`_TRANSIENT_VALUES`), so msgspec
    may decode one-character strings too (`budget.msgspec_may_decode`)."""
    done, value = decode_first(data, depth_checked=depth_checked, size_priced=size_priced)
    return value if done else _UPSTREAM_DECODER.decode(data.decode("utf-8", "surrogatepass"))


class _RepeatedKey(Exception):
    pass


def _pairs_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _RepeatedKey
    return obj


def duplicate_key(data: bytes, obj: Any) -> bool:
    """Whether the JSON text `data` (decoded: `obj`) repeats a key within one object (compared
    decoded, so ``"a"`` and ``"\\u0061"`` are one key). DESIGN.md §5 refuses such an upstream
    answer (502 ``upstream_invalid_response``): a decoder keeps one of the two silently, so what
    the client gets would depend on which. Cheap when provable from counts
    (`middleware.upstream.fastpath.no_duplicate_keys`), else one more parse that keeps pairs."""
    if no_duplicate_keys(data, obj):
        return False
    try:
        json.loads(
            data, object_pairs_hook=_pairs_once, parse_constant=_reject_constant, parse_float=_finite_float
        )
    except _RepeatedKey:
        return True
    return False


#: The encoder of `dumps_checked`, built once (``json.dumps`` with arguments builds one per call).
_COMPACT: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def repeats_a_key(data: bytes, obj: Any, features: JsonFeatures | None) -> bool:
    """Whether the valid JSON text `data` (decoded: `obj`) repeats a key within one object. With
    its `JsonFeatures` (counted as it was read), exact at the cost of one walk of `obj`'s
    containers: ``members`` counts the ``:`` outside strings, one per key written, and `key_total`
    the distinct keys of every object, so they differ exactly when an object repeats a key
    (``"a"`` and ``"\\u0061"`` are one key decoded). Without them, `duplicate_key`."""
    if features is not None:
        return features.members != key_total(obj)
    return duplicate_key(data, obj)


def dumps_checked(obj: Any) -> bytes:
    """Compact JSON of `obj` for the client or the upstream, refusing what JSON cannot carry: an
    upstream number that overflowed to infinity (``1e999``) or NaN raises `UpstreamInvalid`
    (``json.dumps`` would write ``Infinity``, which no JSON parser accepts)."""
    try:
        return _COMPACT.encode(obj).encode()
    except ValueError:
        raise UpstreamInvalid(
            "upstream JSON holds a number out of range (it overflows to infinity)"
        ) from None


def _lone_surrogate(text: str) -> bool:
    # O(1) for ASCII text (CPython knows a string's widest character); else one encode
    if text.isascii():
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def refuse_lone_surrogates(value: Any, where: str) -> None:
    """Raise `UpstreamInvalid` when any string (or key) in `value` holds a lone surrogate
    (``"\\ud800"``): no UTF-8 encoder — the client's, the store's — can write it. Walks the
    parsed value (cost per string, not per byte: a 1 MiB ASCII text is one O(1) check)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _lone_surrogate(item):
                raise UpstreamInvalid(
                    f"upstream {where} holds a lone surrogate (\\ud800-\\udfff), which UTF-8 cannot carry"
                )
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


async def read_stream_events(
    response: UpstreamResponse,
    ledger: Ledger,
    *,
    client: ClientStream | None = None,
    fast: FastRun | None = None,
) -> AsyncGenerator[UpstreamEvent, None]:
    """Parse the upstream SSE body into `UpstreamEvent`s under the ledger.

    With ``fast`` (and a ``client``): the fast path (`FastRun`). Whenever the parser holds
    nothing, what is left of the read is scanned for the regular frames at its start
    (`middleware.upstream.fastpath.regular_prefix`: frames the exact path would forward as
    received); when the consumer takes them (``fast.accept``), what the accumulator keeps of
    them is admitted (``fast.acc``), the ledger's one bound for all of the read fits
    (`budget.Ledger.stream_read_fits`) and the pool has room for the widest frame, those frames
    go to ``fast.on_run(frames, count)`` as one slice and yield no event. The next frame (an
    irregular one) goes through the exact per-frame path, then the scan resumes after it.

    With a `ClientStream` (``client``): it is flushed each time every event of the bytes received
    so far has been handed out, before waiting for more; and while the gateway waits for upstream
    bytes and nothing was sent to the client for ``client.keepalive_interval`` seconds (since
    ``client.last_sent()``), a keep-alive comment is sent. Upstream bytes that complete no event
    (comments, a long frame trickling in) do not put it off.
    Comments, ``retry:``/``id:``-only blocks, empty data and ``[DONE]`` yield nothing.
    Raises `UpstreamInvalid` for a frame that is not a JSON object (or holds ``NaN``, or repeats a
    key), `UpstreamIncomplete` for bad encoding, `BudgetExceeded` when the ledger trips.
    """
    reader = _ExactReader(ledger)
    chunks = response.chunks()
    timer = _KeepaliveTimer(client.keepalive, client.keepalive_interval, client.last_sent) if client else None
    idle = client.flush if client is not None else None
    path = _FastPath(ledger, client, fast) if fast is not None and client is not None else None
    try:
        while not reader.ended:
            if idle is not None:
                await idle()
            todo = await _next_read(chunks, timer, reader)
            at = 0  # where the rest of this read starts (offsets: the rest is never copied)
            while True:
                if path is not None and at < len(todo) and not reader.parser.pending:
                    segment, at = await path.split(todo, at)  # forwards the regular frames first
                    if len(todo) > at > len(todo) // 2:  # drop what is done (copies O(read) in all)
                        todo, at = todo[at:], 0
                elif path is not None and at < len(todo):  # a frame begun in an earlier read
                    end = _held_frame_end(todo, at, reader.parser)  # its rest completes it, then fast
                    if await path.held(todo, at, end, reader):
                        segment, at = b"", end  # taken whole: forwarded, the parser cleared
                    else:
                        segment, at = (todo[at:end] if at or end < len(todo) else todo), end
                else:
                    segment, at = (todo[at:] if at else todo), len(todo)
                for piece in [segment] if len(segment) <= SLICE else _slices(segment):
                    if piece or reader.ended:  # else: all of it forwarded (or an empty read)
                        for event in reader.feed(piece):
                            yield event
                if at >= len(todo):
                    break
    finally:
        reader.close()
        if timer is not None:
            timer.cancel()
        with contextlib.suppress(Exception):
            await chunks.aclose()  # type: ignore[attr-defined]


async def _next_read(chunks: Any, timer: _KeepaliveTimer | None, reader: _ExactReader) -> bytes:
    """The next upstream read (keep-alives armed while it is awaited); b"" and ``reader.ended``
    at the end of the stream (then the parser settles a held CR)."""
    if timer is not None:
        timer.arm()
    try:
        todo: bytes = await anext(chunks)
    except StopAsyncIteration:
        reader.ended, todo = True, b""
    if timer is not None:
        await timer.disarm()  # a failure (or cancellation) instead cancels it in the caller
    return todo


class _ExactReader:
    """The exact per-frame path of one stream: the SSE parser and its charges (DESIGN.md §4).
    ``held``: the retained charge for the bytes of the incomplete frame (32 × ``parser.pending``);
    ``frame``: the retained charge for the frame being handed out."""

    __slots__ = ("ended", "frame", "held", "ledger", "parser")

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.parser = SSEParser()
        self.held = 0
        self.frame = 0
        self.ended = False

    def feed(self, piece: bytes) -> Iterator[UpstreamEvent]:
        """The events `piece` completes (b"": the end of the stream), each decoded while its
        whole frame is charged (its partial charge released first): the same checks, in the same
        order, however the stream was split into reads. Raises as `read_stream_events`."""
        ledger = self.ledger
        try:
            events = self.parser.feed(piece) if piece else self.parser.flush()
        except SSEDecodeError as exc:
            raise UpstreamIncomplete(str(exc)) from None
        for event in events:
            if self.held:
                ledger.release(self.held)
                self.held = 0
            self.frame = ledger.admit_stream_bytes(event.raw_len)
            upstream_event = _decode(event, ledger)
            if upstream_event is not None:
                yield upstream_event
            ledger.release(self.frame)
            self.frame = 0
        if self.held:
            ledger.release(self.held)
            self.held = 0
        if self.parser.pending:
            self.held = ledger.admit_stream_bytes(self.parser.pending, transient=False)

    def drop_held(self) -> None:
        """The frame the parser held the beginning of was taken whole (`_FastPath.held`): clear
        the parser and release the charge for its bytes."""
        self.parser.clear()
        self.ledger.release(self.held)
        self.held = 0

    def close(self) -> None:
        """Release what the parser held (it is gone with the reader)."""
        self.ledger.release(self.held + self.frame)
        self.held = self.frame = 0


@dataclasses.dataclass(frozen=True, slots=True)
class FastRun:
    """How a consumer takes runs of regular frames (`read_stream_events`' fast path).

    ``on_run(frames, count)``: forwards `count` whole frames as received (one slice; e.g.
    `ClientStream.forward_run`). ``accept(heads)``: how many of the leading regular frames (their
    decoded JSON objects) the consumer would forward unchanged, from 0 to ``len(heads)``; by
    default all. ``acc``: the round's `StreamAccumulator` (store on, the loop's rounds): it keeps
    their delta text with its exact charges, and the item events are irregular there
    (`STITCHED_IRREGULAR_TYPES`)."""

    on_run: Callable[[bytes, int], Awaitable[None]]
    accept: Callable[[list[dict[str, Any]]], int] | None = None
    acc: StreamAccumulator | None = None


class _FastPath:
    """The fast path of one stream (`read_stream_events` with a `FastRun`): `split` hands the
    regular frames at the start of what is left of a read to ``on_run`` and cuts the next frame
    off for the exact path."""

    __slots__ = ("_client", "_fast", "_irregular", "_ledger", "_names", "_window")

    def __init__(self, ledger: Ledger, client: ClientStream, fast: FastRun) -> None:
        self._ledger = ledger
        self._client = client
        self._fast = fast
        self._irregular = IRREGULAR_TYPES if fast.acc is None else STITCHED_IRREGULAR_TYPES
        self._names: dict[bytes, str] = {}  # event names found regular in this stream
        self._window: int | None = None  # frames looked at per call; None: all of the read

    async def split(self, chunk: bytes, start: int) -> tuple[bytes, int]:
        """Forward the regular frames at ``chunk[start:]`` (an upstream read; `start` at a frame
        boundary, the parser holding nothing) when the consumer takes them, the one ledger bound
        for all of `chunk` fits and the pool has room; return ``(segment, next)``: `segment` for
        the exact path (the next frame, up to and with its blank line; all of what is left when no
        blank line follows), `next` the offset this method goes on from.

        The frames looked at per call are bounded (`_window`) once a look was mostly wasted (the
        consumer took few of them, say the stitcher refusing a gateway call's argument deltas), so
        a read of n such frames costs O(n × `FAST_WINDOW`), not O(n²); a run taken whole widens
        the window again (×4). When the read's bound cannot fit even with no frame at all (the
        widest frame only adds to it: a request close to its limit), nothing is classified."""
        if self._ledger.stream_read_fits(len(chunk), 0):
            wend = _frames_end_from(chunk, start, self._window)
            block = chunk if start == 0 and wend == len(chunk) else chunk[start:wend]
            found = regular_prefix(block, self._client.next_sequence, self._names, self._irregular)
        else:  # `_forward` would refuse any run: the exact path takes the next frame
            block, found = chunk, NOT_REGULAR
        end, count, widest, heads = found
        accept = self._fast.accept
        if count and accept is not None and (taken := accept(heads)) < count:
            count, heads = taken, heads[:taken]
            end = frames_end(block, count)
        if not count or not await self._forward(block, end, count, widest, heads, held=len(chunk)):
            end, count = 0, 0  # left unchanged: the exact path meets the same checks, frame by frame
        if found is not NOT_REGULAR:  # (that answer looked at the first line only)
            self._resize(block, end, count)
        at = start + end
        cut = chunk.find(b"\n\n", at)
        if cut < 0:
            return chunk[at:], len(chunk)
        return chunk[at : cut + 2], cut + 2

    async def held(self, chunk: bytes, start: int, end: int, reader: _ExactReader) -> bool:
        """Take the frame whose beginning `reader`'s parser holds whole when this read completes
        it (``chunk[start:end]``, `end` from `_held_frame_end`): the beginning as the parser took
        it (`SSEParser.held_frame_start`) joined with its rest is classified as one frame
        (`regular_prefix`) and, when regular and the consumer takes it, forwarded under the same
        one bound as a run (the read and the beginning held at once); then the parser is cleared
        and its charge released (True). Else nothing changes (False): the rest goes the exact
        way. Over a network most reads end inside a frame; without this, the rest of each went
        the exact way (~15 µs a read)."""
        if not (chunk.endswith(b"\n\n", start, end) or (end == start + 1 and chunk[start] == 10)):  # 10: LF
            return False  # not complete in this read (checked first: a long frame is copied once)
        # the bound `_forward` checks, with sizes at least as large (the beginning written back is
        # at most 2 bytes longer than as fed: ``event:x`` / ``data:x`` gain a space), checked
        # before the frame is copied and decoded: a frame too long for it goes the exact way
        # without that work done twice
        longest = reader.parser.pending + 2 + end - start
        if not self._ledger.stream_read_fits(len(chunk) + longest, longest):
            return False
        head = reader.parser.held_frame_start()
        if head is None:
            return False
        frame = head + chunk[start:end]
        if not frame.endswith(b"\n\n"):
            return False
        stop, count, widest, heads = regular_prefix(
            frame, self._client.next_sequence, self._names, self._irregular
        )
        accept = self._fast.accept
        if count != 1 or stop != len(frame) or (accept is not None and accept(heads) != 1):
            return False
        if not await self._forward(frame, stop, 1, widest, heads, held=len(chunk) + len(head)):
            return False
        reader.drop_held()
        return True

    def _resize(self, block: bytes, end: int, count: int) -> None:
        """Narrow the window to `FAST_WINDOW` frames when fewer than half of the frames looked at
        in `block` were taken (`count` of them, ending at `end`); widen it ×4 when all were."""
        if end == len(block):
            if self._window is not None:
                self._window *= 4
        elif count + 1 < block.count(b"\n\n", end) // 2:
            self._window = FAST_WINDOW

    async def _forward(
        self, chunk: bytes, end: int, count: int, widest: int, heads: list[dict[str, Any]], *, held: int
    ) -> bool:
        """Admit what the run keeps and check the read's bound; forward the run when both fit
        (True), else change nothing (False). What the accumulator keeps is admitted first, so the
        bound is checked on top of all of it: at least every check the exact path makes."""
        acc, ledger = self._fast.acc, self._ledger
        staged = acc.stage(heads) if acc is not None else None
        if acc is not None and staged is None:
            return False
        # the peak notes the largest frame once, as the per-frame path shows it, and the pool is
        # asked for room for it (its charge would be released at once: nothing is taken)
        if not ledger.stream_read_admits(held, widest):
            if acc is not None and staged is not None:
                acc.unstage(staged)
            return False
        if acc is not None and staged is not None:
            acc.keep(staged)
        await self._fast.on_run(chunk if end == len(chunk) else chunk[:end], count)
        return True


#: Frames the fast path looks at per call once a look was mostly wasted (`_FastPath.split`).
FAST_WINDOW = 16


def _frames_end_from(chunk: bytes, start: int, frames: int | None) -> int:
    """The offset just past `frames` whole frames of ``chunk[start:]`` (each ending with a blank
    line), or ``len(chunk)`` when there are fewer (or `frames` is None)."""
    if frames is None:
        return len(chunk)
    at = start
    for _ in range(frames):
        cut = chunk.find(b"\n\n", at)
        if cut < 0:
            return len(chunk)
        at = cut + 2
    return at


def _held_frame_end(chunk: bytes, start: int, parser: SSEParser) -> int:
    """Where, in ``chunk[start:]``, the frame the parser holds the beginning of ends: just past
    its blank line (the first ``\n\n``, or the very first byte when it is ``\n`` and the parser
    holds no unfinished line: the previous read ended with a line end), else ``len(chunk)``. The
    rest of the read, from there, starts a frame: the fast path looks at it again (a read that
    began mid-frame, as reads over a network do, is not all taken the exact way)."""
    if chunk[start : start + 1] == b"\n" and not parser.line_held:
        return start + 1
    cut = chunk.find(b"\n\n", start)
    return len(chunk) if cut < 0 else cut + 2


def _slices(chunk: bytes) -> list[bytes]:
    """`chunk` in slices of at most `SLICE` bytes."""
    view = memoryview(chunk)
    return [bytes(view[offset : offset + SLICE]) for offset in range(0, len(chunk), SLICE)]


class _KeepaliveTimer:
    """Awaits ``keepalive`` while armed once the client has heard nothing for ``interval`` seconds,
    from a task of its own.

    Armed before each upstream read and disarmed after it. A flag per read, not a timer handle:
    one ``call_at`` handle stays scheduled across reads and, when it fires, re-checks the quiet
    time and schedules itself again if the client heard something since (a token-paced stream
    arms it per token; a handle per read cost ~2.5 µs of each read's ~18). Quiet time counts from
    ``last_sent()`` (the last client write) or from the last keep-alive, whichever is later — not
    from the last upstream read, so upstream bytes that complete no event do not starve the
    client (without ``last_sent``: from the arming). No keep-alive goes out while disarmed.
    `disarm` waits for a keep-alive in progress (two sends never overlap) and re-raises its
    failure.
    """

    __slots__ = (
        "_armed",
        "_armed_at",
        "_beat_at",
        "_handle",
        "_interval",
        "_keepalive",
        "_last_sent",
        "_loop",
        "_task",
    )

    def __init__(
        self,
        keepalive: Callable[[], Awaitable[None]],
        interval: float,
        last_sent: Callable[[], float] | None = None,
    ) -> None:
        self._keepalive = keepalive
        self._interval = interval
        self._last_sent = last_sent
        self._loop = asyncio.get_running_loop()
        self._beat_at = self._loop.time()  # the last keep-alive (or the start of the stream)
        self._armed_at = self._beat_at
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._armed = False

    def arm(self) -> None:
        self._armed = True
        if self._last_sent is None:
            self._armed_at = self._loop.time()
        if self._handle is None and self._task is None:
            self._schedule()

    def _due(self) -> float:
        """When the client will have heard nothing for ``interval`` seconds (loop time)."""
        quiet_since = self._last_sent() if self._last_sent is not None else self._armed_at
        return max(self._beat_at, quiet_since) + self._interval

    def _schedule(self) -> None:
        self._handle = self._loop.call_at(max(self._due(), self._loop.time()), self._fire)

    def _fire(self) -> None:
        self._handle = None
        if not self._armed:
            return  # disarmed since: the next `arm` schedules again
        if self._due() > self._loop.time():
            self._schedule()  # the client heard something since this handle was scheduled
            return
        self._task = self._loop.create_task(self._beat())

    async def _beat(self) -> None:
        self._beat_at = self._loop.time()
        await self._keepalive()
        if self._armed:
            self._task = None
            self._schedule()

    def _stop(self) -> asyncio.Task[None] | None:
        """No further keep-alives; returns the one in progress (if any) for the caller to settle.
        The scheduled handle (if any) stays: it does nothing when it fires disarmed."""
        self._armed = False
        task, self._task = self._task, None
        return task

    async def disarm(self) -> None:
        task = self._stop()
        if task is not None:
            await task

    def cancel(self) -> None:
        task = self._stop()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if task is not None:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: the request is failing for another reason already


#: Event types whose decoded value is kept only as `response_summary` (bounded by a constant), or
#: not at all: with the ``.delta`` events (whose text is kept priced as a whole ``str``,
#: `StreamAccumulator.apply`) msgspec may decode them whatever their strings (`loads_upstream`'s
#: ``size_priced``: the frame's charge is size-only). An item or a terminal response is kept
#: priced by its features, where a one-character string costs nothing (``json.loads`` shares it,
#: msgspec would not): those are decoded under the same condition as a buffered body. The
#: ``event:`` line decides; a frame whose data names another type is refused anyway.
_TRANSIENT_VALUES: Final = LIFECYCLE_EVENTS


def _decode(event: SSEEvent, ledger: Ledger) -> UpstreamEvent | None:
    """One dispatched SSE event as an `UpstreamEvent` (its parse checked against the ledger), or
    None for what carries nothing (empty data, ``[DONE]``)."""
    data = event.data
    if not data.strip() or data == b"[DONE]":
        return None
    ledger.check_stream_frame_bounded(data)
    try:
        obj = loads_upstream(
            data, size_priced=event.event in _TRANSIENT_VALUES or event.event.endswith(".delta")
        )
    except UnicodeDecodeError:
        raise UpstreamIncomplete("upstream SSE data is not valid UTF-8") from None
    except (ValueError, RecursionError):
        raise UpstreamInvalid(f"upstream SSE data is not JSON: {data[:80]!r}") from None
    if not isinstance(obj, dict):
        raise UpstreamInvalid("upstream SSE data is not a JSON object")
    if duplicate_key(data, obj):
        raise UpstreamInvalid(f"upstream SSE data repeats a key within one object: {data[:80]!r}")
    raw_kind = obj.get("type")
    named = isinstance(raw_kind, str)
    if isinstance(raw_kind, str) and event.event not in ("message", raw_kind):  # "message": no `event:` line
        raise UpstreamInvalid(
            f"upstream SSE frame names event {event.event[:80]!r} but its data is of type {raw_kind[:80]!r}"
        )
    kind: str = raw_kind if isinstance(raw_kind, str) else event.event
    if not EVENT_TYPE.fullmatch(kind):
        raise UpstreamInvalid(f"upstream SSE event type is not a plain name: {kind[:80]!r}")
    wrong = stream_field_error(obj)
    if wrong is not None:
        raise UpstreamInvalid(f"upstream {kind}: {wrong}")
    delta = obj.get("delta")
    if isinstance(delta, str) and kind.endswith(".delta"):  # the hot path: one string to check
        if _lone_surrogate(delta):
            raise UpstreamInvalid(f"upstream {kind} delta holds a lone surrogate, which UTF-8 cannot carry")
    elif may_hold_surrogate(data):  # else provably none: no walk over every string
        refuse_lone_surrogates(obj, f"SSE event {kind}")
    if not named:  # the data must carry the type its `event:` line names (Open Responses)
        obj["type"] = kind
        return UpstreamEvent(kind, data, obj, changed=True)
    return UpstreamEvent(kind, data, obj)


_RESPONSE_TEXT_FIELDS = ("id", "status", "object", "model", "previous_response_id")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_item(item: Any, where: str) -> None:
    """Refuse an output item whose fields the gateway reads have the wrong type: ``type`` must
    be a string; a ``function_call``'s ``call_id`` and ``name`` strings and its ``arguments`` a
    string or null (DESIGN.md §5: 502 ``upstream_invalid_response``). Raises `UpstreamInvalid`."""
    if not isinstance(item, dict):
        raise UpstreamInvalid(f"upstream {where} is {_type_name(item)}, not an object")
    if not isinstance(item.get("type"), str):
        raise UpstreamInvalid(f"upstream {where}.type is {_type_name(item.get('type'))}, not a string")
    if item["type"] == "function_call":
        for field in ("call_id", "name"):
            if not isinstance(item.get(field), str):
                raise UpstreamInvalid(
                    f"upstream {where}.{field} is {_type_name(item.get(field))}, not a string"
                )
        if not isinstance(item.get("arguments"), str | None):
            raise UpstreamInvalid(
                f"upstream {where}.arguments is {_type_name(item['arguments'])}, not a string"
            )


def check_response(response: dict[str, Any]) -> None:
    """Refuse a response object whose fields the gateway reads or re-encodes have the wrong
    type: ``id``, ``status``, ``object``, ``model`` strings (or absent / null), ``output`` a list
    of valid items (`check_item`), ``usage`` an object whose ``*_tokens`` are integers and
    ``*_details`` objects, and
    ``incomplete_details`` an object or null. Raises `UpstreamInvalid` naming the field."""
    for field in _RESPONSE_TEXT_FIELDS:
        value = response.get(field)
        if value is not None and not isinstance(value, str):
            raise UpstreamInvalid(f"upstream response.{field} is {_type_name(value)}, not a string")
    output = response.get("output")
    if output is not None:
        if not isinstance(output, list):
            raise UpstreamInvalid(f"upstream response.output is {_type_name(output)}, not a list")
        for index, item in enumerate(output):
            check_item(item, f"response.output[{index}]")
    usage = response.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise UpstreamInvalid(f"upstream response.usage is {_type_name(usage)}, not an object")
        for key, value in usage.items():
            # token counts are summed over rounds: integers; anything else (e.g. a provider's
            # float "cost") is passed on as the first round sent it
            if key.endswith("_tokens") and (isinstance(value, bool) or not isinstance(value, int | None)):
                raise UpstreamInvalid(f"upstream response.usage.{key} is {_type_name(value)}, not an integer")
            if key.endswith("_details") and not isinstance(value, dict | None):
                raise UpstreamInvalid(f"upstream response.usage.{key} is {_type_name(value)}, not an object")
    details = response.get("incomplete_details")
    if details is not None and not isinstance(details, dict):
        raise UpstreamInvalid(f"upstream response.incomplete_details is {_type_name(details)}, not an object")


class StreamOrder:
    """The event-order check every streamed round goes through (`read_round`; Open Responses: one
    ``response.created`` opens a stream and its terminal event is for the same response; DESIGN.md
    §5 "upstream protocol violation": 502 before commit, the error frames after). Refuses a second
    ``response.created``, a terminal event whose ``response.id`` differs from the one the
    ``response.created`` opened and, with `created_first`, a first event of another type (the
    pass-through; the loop's stitcher opens the client's stream itself). Raises `UpstreamInvalid`."""

    def __init__(self, *, created_first: bool = False) -> None:
        self.created_first = created_first
        self.opened = False  # response.created was seen
        self.created_id: Any = None  # its response id

    def check(self, kind: str, response: Any) -> None:
        """Check the next event (`kind`, its ``response`` field or None); raises `UpstreamInvalid`."""
        if kind == "response.created":
            if self.opened:
                raise UpstreamInvalid("upstream sent response.created twice in one stream")
            self.opened = True
            self.created_id = response.get("id") if isinstance(response, dict) else None
        elif not self.opened and self.created_first:
            raise UpstreamInvalid(
                f"upstream stream did not start with response.created (it began with {kind})"
            )
        elif kind in TERMINAL_EVENTS and isinstance(response, dict):
            said = response.get("id")
            if said is not None and self.created_id is not None and said != self.created_id:
                raise UpstreamInvalid(
                    f"upstream {kind} is for response {str(said)[:80]!r}, not {str(self.created_id)[:80]!r} "
                    "that its response.created opened"
                )


async def read_round(
    response: UpstreamResponse,
    ledger: Ledger,
    *,
    created_first: bool = False,
    client: ClientStream | None = None,
    acc: StreamAccumulator | None = None,
    on_event: Callable[[UpstreamEvent], Awaitable[None]] | None = None,
    on_run: Callable[[bytes, int], Awaitable[None]] | None = None,
    accept: Callable[[list[dict[str, Any]]], int] | None = None,
) -> str:
    """Read one streamed round up to its terminal event (`read_stream_events`, closed as soon as
    the round ends, however it ends, so what the reader holds is released then): each event is
    kept by `acc` and handed to `on_event` (forwarding); returns the terminal event's type. With
    `on_run`: runs of regular frames that `accept` takes go to it as received instead, their
    delta text kept by `acc` (`read_stream_events`' fast path, `FastRun`).

    Raises `UpstreamStreamError` for an in-band ``error`` event, `UpstreamIncomplete` when the
    stream ends without a terminal event, `UpstreamInvalid` for events out of order
    (`StreamOrder`; `created_first`: the first event must be ``response.created``), and whatever
    the reader raises.
    """
    order = StreamOrder(created_first=created_first)
    async with contextlib.aclosing(
        read_stream_events(
            response, ledger, client=client, fast=None if on_run is None else FastRun(on_run, accept, acc)
        )
    ) as events:
        async for event in events:
            if event.type == "error":
                raise stream_error_failure(event.obj)
            order.check(event.type, event.obj.get("response"))
            if acc is not None:
                acc.apply(event)
            if on_event is not None:
                await on_event(event)
            if event.type in TERMINAL_EVENTS:
                return event.type
    raise no_terminal_event()


#: What `StreamAccumulator.stage` admitted: ``(output_index, delta text)`` pairs and their charges.
Staged = tuple[list[tuple[int, str]], list[int]]


class StreamAccumulator:
    """What one streamed round keeps, charged to the ledger (DESIGN.md §4 "streaming" rows).

    ``items``: finished output items by ``output_index``; ``terminal``: the terminal response
    object (or None). Delta text is kept per item until the item is done (a fallback when an
    upstream never sends the item); its charge is released when the finished item is admitted.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.items: dict[int, dict[str, Any]] = {}
        self.terminal: dict[str, Any] | None = None
        self.terminal_type: str | None = None
        self._item_charges: dict[int, int] = {}
        self._delta_charges: dict[int, int] = {}
        self._deltas: dict[int, list[str]] = {}
        self._terminal_charge = 0

    def apply(self, event: UpstreamEvent) -> None:
        """Account for one event; raises `BudgetExceeded` when what it keeps does not fit."""
        kind, obj = event.type, event.obj
        index = obj.get("output_index")
        if kind.endswith(".delta") and isinstance(obj.get("delta"), str) and isinstance(index, int):
            text = obj["delta"]
            charge = self.ledger.admit_accumulated(text.encode(), nodes=0)
            self._delta_charges[index] = self._delta_charges.get(index, 0) + charge
            self._deltas.setdefault(index, []).append(text)
        elif (
            kind == "response.output_item.done"
            and isinstance(obj.get("item"), dict)
            and isinstance(index, int)
        ):
            item = obj["item"]
            check_item(item, "output_item.done item")
            if item.get("type") == "function_call" and not item.get("arguments") and self._deltas.get(index):
                # arguments were streamed as deltas and the done event left them out (case B07 a)
                item = obj["item"] = {**item, "arguments": "".join(self._deltas[index])}
                event.changed = True
            item_json = json.dumps(item, separators=(",", ":")).encode()
            charge = self.ledger.admit_accumulated(item_json)
            self.ledger.release(self._delta_charges.pop(index, 0) + self._item_charges.pop(index, 0))
            self._deltas.pop(index, None)
            self._item_charges[index] = charge
            self.items[index] = obj["item"]
        elif kind in TERMINAL_EVENTS and isinstance(obj.get("response"), dict):
            check_response(obj["response"])
            self._terminal_charge = self.ledger.admit_accumulated(event.data)
            self.terminal = obj["response"]
            self.terminal_type = kind

    def stage(self, heads: list[dict[str, Any]]) -> Staged | None:
        """Admit what `apply` would keep of frames forwarded as received (their decoded JSON
        objects `heads`, none an item or terminal event): each delta text, charged as `apply`
        charges it (`budget.Ledger.admit_accumulated_texts`: one commit). All or nothing: returns
        the staged ``(output_index, text)`` pairs and their charges for `keep`, or None when they
        do not fit (`BudgetExceeded` or `PoolExhausted` caught; the ledger is as before)."""
        kept = [
            (head["output_index"], head["delta"])
            for head in heads
            if isinstance(head.get("delta"), str)
            and isinstance(head.get("output_index"), int)
            and head["type"].endswith(".delta")
        ]
        try:
            charges = self.ledger.admit_accumulated_texts([text.encode() for _, text in kept])
        except (BudgetExceeded, PoolExhausted):
            return None
        return kept, charges

    def keep(self, staged: Staged) -> None:
        """Keep what `stage` admitted, as `apply` keeps delta text."""
        kept, charges = staged
        if len({index for index, _ in kept}) == 1:  # the usual run: the deltas of one item
            index = kept[0][0]
            self._delta_charges[index] = self._delta_charges.get(index, 0) + sum(charges)
            self._deltas.setdefault(index, []).extend([text for _, text in kept])
            return
        for (index, text), charge in zip(kept, charges, strict=True):
            self._delta_charges[index] = self._delta_charges.get(index, 0) + charge
            self._deltas.setdefault(index, []).append(text)

    def unstage(self, staged: Staged) -> None:
        """Release what `stage` admitted (the frames go to the exact path instead)."""
        self.ledger.release(sum(staged[1]))

    def delta_text(self, index: int) -> str:
        """The delta text kept for the item at `index` so far ("" when none)."""
        return "".join(self._deltas.get(index, ()))

    def output(self) -> list[dict[str, Any]]:
        """The round's output items: the terminal response's ``output`` when it carries one,
        else the finished items in ``output_index`` order."""
        if self.terminal is not None and isinstance(self.terminal.get("output"), list):
            items = [item for item in self.terminal["output"] if isinstance(item, dict)]
            return [self._with_arguments(i, item) for i, item in enumerate(items)]
        return [self._with_arguments(i, self.items[i]) for i in sorted(self.items)]

    def _with_arguments(self, index: int, item: dict[str, Any]) -> dict[str, Any]:
        """A function call whose ``arguments`` the terminal left null or empty gets them from its
        finished item or its streamed deltas (case B07 a); never silently ``{}``."""
        if item.get("type") != "function_call" or item.get("arguments"):
            return item
        done = self.items.get(index)
        if done is not None and done.get("call_id") == item.get("call_id") and done.get("arguments"):
            return {**item, "arguments": done["arguments"]}
        if self._deltas.get(index):
            return {**item, "arguments": "".join(self._deltas[index])}
        return item

    def release_all(self) -> None:
        """Give back every charge this accumulator holds (the round's state is no longer kept)."""
        total = sum(self._item_charges.values()) + sum(self._delta_charges.values()) + self._terminal_charge
        self.ledger.release(total)
        self._item_charges.clear()
        self._delta_charges.clear()
        self._terminal_charge = 0


def _refuse_declared_length(response: UpstreamResponse, ledger: Ledger) -> None:
    """Raise `UpstreamBodyTooLarge` (502 ``upstream_response_too_large``) when the upstream's
    ``Content-Length`` is over the charge model's buffered clamp for ``ledger.limit``; the body
    is then never read."""
    model = ledger.model
    clamp = model.upstream_clamp(ledger.limit)
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > clamp:
        raise UpstreamBodyTooLarge(
            f"upstream response declares {int(declared)} bytes, over the {clamp}-byte clamp "
            f"(the largest body the {model.name} charge model can admit under max_retained_bytes="
            f"{ledger.limit}); raise max_retained_bytes or ask the model for less",
            size=int(declared),
            clamp=clamp,
        )


async def read_buffered_body(
    response: UpstreamResponse, ledger: Ledger
) -> tuple[bytes, int, JsonFeatures | None]:
    """Read a buffered (JSON) upstream body under the ledger; return ``(body, charge, features)``:
    ``features`` are the body's `JsonFeatures` (measured charge model; None under the reference
    model), counted once as it arrived, so whoever charges these same bytes again (the answer's
    `Ledger.admit_terminal` when the body goes out unchanged) need not count them a second time.

    A ``Content-Length`` over ``ledger.limit // 8`` is refused without reading (502
    ``upstream_response_too_large``); otherwise each chunk is charged with ``admit_output`` as it
    arrives (the ledger trips long before the clamp; `BudgetExceeded`). A body whose first
    non-whitespace byte is not ``{`` is refused at once (502 ``upstream_invalid_response``). The caller releases
    ``charge`` once the round's kept items are charged.
    """
    model = ledger.model
    _refuse_declared_length(response, ledger)
    counter = JsonNodeCounter(max_depth=MAX_UPSTREAM_DEPTH, features=model.parse is not None)
    features: JsonFeatures | None = None
    parts: list[bytes] = []
    charge = 0
    nodes = 0
    opened = False  # the first non-whitespace byte was seen (and is "{")
    try:
        async for chunk in response.chunks():
            if not opened and (head := chunk.lstrip(b" \t\r\n")):
                # a response object or nothing: an SSE or HTML body without its content type is
                # refused as what it is, not charged (its text would count as many JSON nodes)
                if head[:1] != b"{":
                    raise UpstreamInvalid(
                        "upstream answered JSON in another encoding than UTF-8 (a byte order mark)"
                        if head.startswith(_BOMS)
                        else f"upstream answered with a body that is not a JSON object: {head[:40]!r}"
                    )
                opened = True
            try:
                total = counter.feed(chunk)
            except JsonTooDeep:
                raise UpstreamInvalid(
                    f"upstream JSON nests deeper than {MAX_UPSTREAM_DEPTH} levels"
                ) from None
            charge += ledger.admit_output(chunk, nodes=total - nodes)
            nodes = total
            parts.append(chunk)
        if model.parse is not None:  # the parse and its copies, once the body is complete
            try:
                features = counter.features()
            except JsonTooDeep:
                raise UpstreamInvalid(
                    f"upstream JSON nests deeper than {MAX_UPSTREAM_DEPTH} levels"
                ) from None
            charge += ledger.admit_output_parse(features)
    except BaseException:
        ledger.release(charge)
        raise
    return b"".join(parts), charge, features


@dataclasses.dataclass(frozen=True)
class ResponseBody:
    """A buffered upstream answer: its ``body`` bytes, the ``parsed`` response object, its output
    ``items``, and ``charge`` — what keeping those items costs (the body's own charge is released);
    ``features``: the `JsonFeatures` of ``body`` (measured charge model, else None)."""

    body: bytes
    parsed: dict[str, Any]
    items: list[dict[str, Any]]
    charge: int
    features: JsonFeatures | None = None


async def read_response_object(
    response: UpstreamResponse, ledger: Ledger, *, keep_items: bool = True
) -> ResponseBody:
    """Read and parse a buffered upstream response object under the ledger (`read_buffered_body`),
    then exchange the body's charge for the kept output items' (admitted first, DESIGN.md §4).

    ``keep_items=False`` (the pass-through, which keeps nothing past its answer): no exchange —
    the body's charge, which covers the bytes and the whole parsed object (`ChargeModel.
    measured_output`: the parse's peak), stays until the request ends, and ``charge`` is it. That
    saves encoding and counting the items a second time; the charge held is never smaller than
    what is kept (the items are part of the parsed object).

    Raises `UpstreamInvalid` for a body that is not a JSON object, is not UTF-8 (RFC 8259 §8.1:
    JSON exchanged between systems is UTF-8; ``json.loads`` would read UTF-16 or UTF-32 too, and the
    pass-through answers with the upstream's own bytes) or repeats a key within an object (its
    meaning would depend on the client's parser: DESIGN.md §5, as for a streamed frame).
    """
    body, body_charge, features = await read_buffered_body(response, ledger)
    try:
        # UTF-8 only: UTF-16 / UTF-32 text (NULs, a BOM) is not JSON there; its depth was capped
        parsed = loads_upstream(body, depth_checked=True)
    except (ValueError, RecursionError):
        if json.detect_encoding(body) != "utf-8":  # only to say so: what was refused is refused
            raise UpstreamInvalid("upstream answered JSON in another encoding than UTF-8") from None
        raise UpstreamInvalid("upstream answered with a body that is not JSON") from None
    if not isinstance(parsed, dict):
        raise UpstreamInvalid("upstream answered with JSON that is not a response object")
    if repeats_a_key(body, parsed, features):
        raise UpstreamInvalid("upstream answered a JSON object that repeats a key within one object")
    if may_hold_surrogate(body):  # else provably none: no walk over every string
        refuse_lone_surrogates(parsed, "response body")
    if not isinstance(parsed.get("output"), list):  # e.g. an error envelope answered with a 2xx
        error = parsed.get("error")
        said = f": {str(error.get('message'))[:200]}" if isinstance(error, dict) else ""
        raise UpstreamInvalid(
            f"upstream answered a success status with no response object (no output list){said}"
        )
    check_response(parsed)
    output = parsed.get("output")
    items = [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []
    if not keep_items:
        return ResponseBody(body, parsed, items, body_charge, features)
    kept = ledger.admit_accumulated(json.dumps(items, separators=(",", ":")).encode())
    ledger.release(body_charge)
    return ResponseBody(body, parsed, items, kept, features)
