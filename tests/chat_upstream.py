"""A scripted Chat Completions upstream: exact ``chat.completion`` bodies and
``chat.completion.chunk`` SSE bytes, served by `tests.mock_upstream.MockUpstream` (a real socket).

`chunk(...)` is one ``data:`` frame; `CHAT_DONE` the ``data: [DONE]`` terminator; `completion(...)`
a finite body; `text_stream` / `calls_stream` the usual replies; `ChatReplies` the matching
`Reply` objects; `FakeResponse` an in-memory `UpstreamResponse` for feeding bytes to the
translator directly (byte-at-a-time tests).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from tests.mock_upstream import Reply

CHAT_DONE = b"data: [DONE]\n\n"
USAGE = {
    "prompt_tokens": 11,
    "completion_tokens": 7,
    "total_tokens": 18,
    "prompt_tokens_details": {"cached_tokens": 3},
    "completion_tokens_details": {"reasoning_tokens": 2},
}


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    *,
    id: str = "chatcmpl-1",
    model: str = "chat-model",
    usage: dict[str, Any] | None = None,
    choices: list[Any] | None = None,
) -> bytes:
    """One ``chat.completion.chunk`` frame (``choices=[]`` for a usage-only chunk)."""
    obj: dict[str, Any] = {"id": id, "object": "chat.completion.chunk", "created": 1700000000, "model": model}
    obj["choices"] = (
        choices if choices is not None else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    )
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def tool_fragment(
    index: int | None, *, id: str | None = None, name: str | None = None, args: str | None = None
) -> dict[str, Any]:
    """One ``delta.tool_calls[]`` entry (fields left out when None)."""
    fragment: dict[str, Any] = {} if index is None else {"index": index}
    if id is not None:
        fragment["id"] = id
        fragment["type"] = "function"
    function = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    if function:
        fragment["function"] = function
    return fragment


def completion(
    content: str | None = "hi",
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    finish: str = "stop",
    usage: dict[str, Any] | None = None,
    **message: Any,
) -> dict[str, Any]:
    """A ``chat.completion`` body."""
    msg: dict[str, Any] = {"role": "assistant", "content": content, **message}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "chat-model",
        "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
        "usage": usage if usage is not None else USAGE,
    }


def function_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def text_stream(*pieces: str, finish: str = "stop") -> list[bytes]:
    """A streamed text reply: role chunk, one chunk per piece, the finish, usage, [DONE]."""
    frames = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"content": piece}) for piece in pieces]
    return [*frames, chunk({}, finish), chunk(choices=[], usage=USAGE), CHAT_DONE]


def calls_stream(fragments: Iterable[dict[str, Any]], finish: str = "tool_calls") -> list[bytes]:
    """A streamed reply of tool-call fragments (one chunk each)."""
    frames = [chunk({"role": "assistant"})]
    frames += [chunk({"tool_calls": [fragment]}) for fragment in fragments]
    return [*frames, chunk({}, finish), chunk(choices=[], usage=USAGE), CHAT_DONE]


def sse_reply(frames: Iterable[Any]) -> Reply:
    return Reply.sse(frames)


class FakeResponse:
    """An in-memory `UpstreamResponse` yielding `parts` as the body's chunks."""

    def __init__(self, parts: list[bytes], content_type: str = "text/event-stream") -> None:
        self.status_code = 200
        self.headers = {"content-type": content_type}
        self._parts = parts

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self._parts:
            yield part

    async def aclose(self) -> None:
        return None
