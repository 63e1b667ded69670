"""The development model's ``POST /v1/chat/completions``: the same deterministic answers as its
``/v1/responses`` (`middleware.dev.devmodel`), in the Chat Completions shape.

A Chat request is read as the equivalent Responses body (system messages -> ``instructions``,
messages -> message items, assistant ``tool_calls`` -> ``function_call`` items, ``tool`` messages ->
``function_call_output`` items, nested function tools and ``tool_choice`` flattened,
``max_completion_tokens`` / ``max_tokens`` -> ``max_output_tokens``), answered by
`devmodel.build_response`, and the answer is written back as a ``chat.completion`` (or, with
``"stream": true``, ``chat.completion.chunk`` frames: a role chunk, one content chunk per word or
each call's id+name then its arguments in two pieces, the finish chunk, a usage-only chunk when
``stream_options.include_usage`` is set, and ``data: [DONE]``). ``finish_reason`` is ``length`` for
an incomplete answer, ``tool_calls`` when it calls, else ``stop``. So ``loopwarden serve
--upstream-api chat`` can be tried against ``loopwarden devmodel`` with no model server.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

JSONObject = dict[str, Any]


def responses_body(chat: JSONObject) -> JSONObject:
    """The Responses request equivalent to Chat request `chat` (see the module docstring)."""
    body: JSONObject = {"model": chat.get("model"), "stream": bool(chat.get("stream"))}
    system, items = [], []
    for message in chat.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role, content = message.get("role"), message.get("content")
        text = content if isinstance(content, str) else _parts_text(content)
        if role in ("system", "developer"):
            system.append(text)
        elif role == "tool":
            items.append(
                {"type": "function_call_output", "call_id": message.get("tool_call_id"), "output": text}
            )
        else:
            if text:
                items.append({"type": "message", "role": role or "user", "content": text})
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": function.get("name"),
                        "arguments": function.get("arguments") or "{}",
                    }
                )
    if system:
        body["instructions"] = "\n".join(system)
    body["input"] = items
    tools = [
        {"type": "function", **(t.get("function") or {})}
        for t in chat.get("tools") or []
        if isinstance(t, dict)
    ]
    if tools:
        body["tools"] = tools
    choice = chat.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        choice = {"type": "function", "name": choice["function"].get("name")}
    if choice is not None:
        body["tool_choice"] = choice
    limit = chat.get("max_completion_tokens", chat.get("max_tokens"))
    if limit is not None:
        body["max_output_tokens"] = limit
    return body


def _parts_text(content: Any) -> str:
    if not isinstance(content, list):
        return ""
    return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _pieces(response: JSONObject) -> tuple[str, list[JSONObject], str, JSONObject]:
    """(text, tool calls, finish_reason, usage) of a devmodel Responses answer."""
    text, calls = "", []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            text += "".join(p.get("text", "") for p in item.get("content") or [])
        elif item.get("type") == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            calls.append({"id": item["call_id"], "type": "function", "function": function})
    finish = "length" if response.get("status") == "incomplete" else "tool_calls" if calls else "stop"
    usage = response.get("usage") or {}
    chat_usage = {
        "prompt_tokens": usage.get("input_tokens", 0),
        "completion_tokens": usage.get("output_tokens", 0),
        "total_tokens": usage.get("total_tokens", 0),
    }
    return text, calls, finish, chat_usage


def completion(response: JSONObject) -> JSONObject:
    """The ``chat.completion`` body of a devmodel answer."""
    text, calls, finish, usage = _pieces(response)
    message: JSONObject = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": response.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }


def chunks(response: JSONObject, *, include_usage: bool) -> Iterator[bytes]:
    """The ``chat.completion.chunk`` frames of a devmodel answer, then ``data: [DONE]``."""
    text, calls, finish, usage = _pieces(response)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
    }
    head["model"] = response.get("model")

    def frame(delta: JSONObject | None, finish_reason: str | None = None, **extra: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
        data = json.dumps({**head, "choices": choices, **extra}, separators=(",", ":"), ensure_ascii=False)
        return f"data: {data}\n\n".encode()

    yield frame({"role": "assistant", "content": ""})
    words = text.split(" ") if text else []
    for i, word in enumerate(words):
        yield frame({"content": word if i == 0 else " " + word})
    for index, call in enumerate(calls):
        identity = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"]},
        }
        yield frame({"tool_calls": [identity]})
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        for piece in (arguments[:half], arguments[half:]):
            yield frame({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    yield frame({}, finish)
    if include_usage:
        yield frame(None, usage=usage)
    yield b"data: [DONE]\n\n"
