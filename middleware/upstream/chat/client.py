"""`ChatUpstream`: an `UpstreamClient` that speaks Responses to the loop and Chat Completions to
the model server.

It sits below the stream reader: ``post("/responses", body, stream=...)`` translates the round's
body (`translate_request`), POSTs it to ``/chat/completions`` through the wrapped client (aiohttp
or httpx, with their timeouts, headers and errors), and returns a `ChatResponse` whose `chunks()`
yield the reply translated back into Responses bytes — a JSON response object for a buffered
reply, Responses SSE for a streamed one (`StreamConverter`). So the loop, its classification,
508, the ledger's own charges on those bytes, the outcome table, the stitcher and the store are
unchanged. Error answers (status >= 400) are handed over as they came: their envelope is the
OpenAI one, which `status_failure` already normalises, and ``Retry-After`` is kept.

Under the ledger (DESIGN.md §4) of the request bound with `bind_ledger` (a fresh default-limit
ledger when none is bound, so the translator is never unbounded): the translated request body is
charged as retained bytes while it is sent; a buffered Chat body is read and charged as any
buffered upstream body (`read_buffered_body`: the clamp, ``64 × bytes``), released once
translated; a streamed reply's bytes waiting in the parser and each frame's parse are charged as
the Responses reader charges its own; and what the converter keeps (text, reasoning, ids, names,
arguments) is charged as retained stream bytes until the round ends. Chat deltas are transient.

A streamed round ends at ``[DONE]``: nothing after it is parsed or translated (what follows in
the same read is dropped, later reads never happen) and the upstream connection is closed. An
upstream that sends the finish reason but never ``[DONE]`` and keeps the connection open gets
`FINISH_GRACE_S` after the finish reason (and again after a usage chunk that follows it, when
``include_usage`` puts it there) before the round ends as if ``[DONE]`` had come.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from budget import Ledger
from middleware.upstream.chat.dialect import ChatDialect
from middleware.upstream.chat.errors import reply_failure
from middleware.upstream.chat.request import translate_request
from middleware.upstream.chat.response import build_response, completion_from_body
from middleware.upstream.chat.stream import StreamConverter
from middleware.upstream.errors import UpstreamError, UpstreamIncomplete, UpstreamInvalid
from middleware.upstream.protocol import UpstreamClient, UpstreamResponse
from middleware.upstream.sse import SSEDecodeError, SSEParser, encode_event

_LEDGER: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar(
    "loopwarden_chat_ledger", default=None
)
FALLBACK_LIMIT = 67_108_864  # bytes: the default max_retained_bytes, for a call no request bound
CHAT_PATH = "/chat/completions"
#: seconds an upstream may take, after its finish reason (and again after a usage chunk that follows
#: it), to send ``[DONE]`` or close, before the round ends without it (README "Chat Completions upstreams").
FINISH_GRACE_S = 2.0
NO_COMPACT = json.dumps(
    {
        "error": {
            "message": "a Chat Completions upstream has no /responses/compact",
            "type": "invalid_request_error",
            "param": None,
            "code": "unknown_url",
        }
    }
).encode()


@contextlib.contextmanager
def bind_ledger(ledger: Ledger) -> Iterator[None]:
    """Charge the translation of the upstream calls made inside this block to `ledger`."""
    token = _LEDGER.set(ledger)
    try:
        yield
    finally:
        _LEDGER.reset(token)


def _ledger() -> Ledger:
    return _LEDGER.get() or Ledger(FALLBACK_LIMIT)


class _Static:
    """A synthetic answer (``/responses/compact``: 404, so ``auto`` compaction falls back)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status_code = status
        self.headers: Mapping[str, str] = {"content-type": "application/json"}
        self._body = body

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self._body

    async def aclose(self) -> None:
        return None


class ChatResponse:
    """One translated Chat reply (`UpstreamResponse`): ``status_code`` 200, ``content-type`` the
    Responses one (``text/event-stream`` for a streamed reply, JSON otherwise)."""

    def __init__(self, inner: UpstreamResponse, dialect: ChatDialect, ledger: Ledger, *, sse: bool) -> None:
        self._inner = inner
        self._dialect = dialect
        self._ledger = ledger
        self._sse = sse
        self.status_code = 200
        self.headers: Mapping[str, str] = {
            "content-type": "text/event-stream" if sse else "application/json",
            **{k: v for k, v in inner.headers.items() if k.startswith("x-ratelimit-") or k == "x-request-id"},
        }

    def chunks(self) -> AsyncIterator[bytes]:
        return self._stream() if self._sse else self._buffered()

    async def _buffered(self) -> AsyncIterator[bytes]:
        from middleware.upstream.reader import loads_upstream, read_buffered_body

        body, charge, _features = await read_buffered_body(self._inner, self._ledger)
        try:
            try:
                parsed = loads_upstream(body, depth_checked=True)  # read_buffered_body capped its depth
            except (ValueError, RecursionError):
                raise reply_failure("invalid_completion") from None
            completion = completion_from_body(parsed, self._dialect)
            del parsed, body
            out = json.dumps(
                build_response(completion, created_at=int(time.time())), separators=(",", ":")
            ).encode()
        finally:
            self._ledger.release(charge)
        yield out

    async def _stream(self) -> AsyncIterator[bytes]:
        ledger, parser = self._ledger, SSEParser()
        converter = StreamConverter(self._dialect, created_at=int(time.time()))
        source = self._inner.chunks().__aiter__()
        held = kept = 0  # charges: bytes waiting in the parser, what the converter keeps
        kept_bytes = 0  # the converter's retained bytes that `kept` covers
        deadline: float | None = None  # the grace after the finish reason (loop time)
        marks = (False, False)  # (finish reason seen, usage seen) when `deadline` was set
        eof = False
        try:
            while not converter.ended:
                try:
                    chunk = await _next(source, deadline)
                except TimeoutError:
                    break  # the grace after the finish reason passed: the round ends here
                if chunk is None:
                    eof = True
                    break
                frames, failure = self._feed(converter, parser, chunk)
                if failure is not None:
                    if frames:  # what came before the failure goes first (it may commit the stream)
                        yield frames
                    raise failure
                ledger.release(held)
                held = 0
                held = ledger.admit_stream_bytes(parser.pending, transient=False)
                if converter.retained > kept_bytes:
                    kept += ledger.admit_stream_bytes(converter.retained - kept_bytes, transient=False)
                    kept_bytes = converter.retained
                if frames:
                    yield frames
                now = (converter.finished, converter.c.usage is not None)
                if converter.finished and now != marks:
                    deadline, marks = asyncio.get_running_loop().time() + FINISH_GRACE_S, now
            if not converter.ended:
                if parser.pending and eof:
                    raise UpstreamIncomplete("the Chat Completions upstream stream ended inside a frame")
                yield b"".join(_encode(converter.done()))
        finally:
            ledger.release(held + kept)
            if converter.ended:
                await self._inner.aclose()  # bytes after [DONE] or the grace are never read

    def _feed(
        self, converter: StreamConverter, parser: SSEParser, chunk: bytes
    ) -> tuple[bytes, UpstreamError | None]:
        """The Responses frames for one read of upstream bytes, up to the terminal (what follows
        ``[DONE]`` in the same read is dropped), and the translation's failure (None when none):
        the frames before a failure still go to the client first. Raises `UpstreamInvalid` for
        a line that is not UTF-8."""
        step = self._ledger.admit_stream_bytes(len(chunk))
        try:
            events = parser.feed(chunk)
        except SSEDecodeError:
            raise UpstreamInvalid(
                "the Chat Completions upstream sent a stream line that is not UTF-8"
            ) from None
        finally:
            self._ledger.release(step)
        out: list[bytes] = []
        for event in events:
            if converter.ended:
                break
            try:
                out.extend(self._translate(converter, event.data))
            except UpstreamError as failure:
                return b"".join(out), failure
        return b"".join(out), None

    def _translate(self, converter: StreamConverter, data: bytes) -> list[bytes]:
        """The Responses frames for one Chat ``data:`` payload (its parse checked first: strict,
        ``NaN`` / ``Infinity`` refused as in a buffered body)."""
        from middleware.upstream.reader import loads_upstream

        if data.strip() == b"[DONE]":
            return _encode(converter.done())
        self._ledger.check_stream_frame_bounded(data)
        try:
            obj: Any = loads_upstream(data)
        except (ValueError, RecursionError):
            raise reply_failure("invalid_chunk") from None
        if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
            from middleware.upstream.errors import stream_error_failure
            from middleware.upstream.reader import refuse_lone_surrogates

            refuse_lone_surrogates(obj, "Chat stream error")  # its message is handed on (chunks: chunk())
            raise stream_error_failure(obj)  # an in-band error object: the upstream's code kept
        return _encode(converter.chunk(obj))

    async def aclose(self) -> None:
        await self._inner.aclose()


async def _next(source: AsyncIterator[bytes], deadline: float | None) -> bytes | None:
    """The next read of `source`, None at its end. Raises TimeoutError once `deadline` (loop
    time) has passed (no deadline: the transport's own read timeout applies)."""
    try:
        if deadline is None:
            return await anext(source)
        async with asyncio.timeout(max(0.0, deadline - asyncio.get_running_loop().time())):
            return await anext(source)
    except StopAsyncIteration:
        return None


def _encode(events: list[tuple[str, dict[str, Any]]]) -> list[bytes]:
    return [
        encode_event(kind, json.dumps(payload, separators=(",", ":")).encode()) for kind, payload in events
    ]


class ChatUpstream:
    """`UpstreamClient` for a Chat Completions server: wraps `inner` (the aiohttp or httpx client
    for the same base URL) and translates with `dialect`. Raises what `inner` raises, plus
    `InvalidRequest` (400) for an untranslatable request before any upstream call and
    `ChatReplyInvalid` / `ChatStreamIncomplete` (502 / error frame) from the reply's `chunks()`."""

    def __init__(self, inner: UpstreamClient, dialect: ChatDialect) -> None:
        self.inner = inner
        self.dialect = dialect

    async def post(self, path: str, body: bytes, *, stream: bool) -> UpstreamResponse:
        if path == "/responses/compact":
            return _Static(404, NO_COMPACT)
        ledger = _ledger()
        request = json.loads(body)
        translated = json.dumps(translate_request(request, self.dialect), separators=(",", ":")).encode()
        del request
        charge = ledger.admit_stream_bytes(len(translated), transient=False)
        try:
            response = await self.inner.post(CHAT_PATH, translated, stream=stream)
        finally:
            ledger.release(charge)
        if response.status_code >= 400:
            return response
        if response.status_code != 200:
            await response.aclose()
            raise reply_failure("invalid_completion")
        sse = response.headers.get("content-type", "").lower().startswith("text/event-stream")
        return ChatResponse(response, self.dialect, ledger, sse=sse)

    async def get(self, path: str) -> UpstreamResponse:
        return await self.inner.get(path)

    async def aclose(self) -> None:
        await self.inner.aclose()
