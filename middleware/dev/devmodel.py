"""The embedded development model: a deterministic OpenAI Responses API server with no model inside.

`create_devmodel_app()` returns a Starlette app serving ``POST /v1/responses`` (buffered JSON, or SSE
with ``"stream": true``), ``POST /v1/chat/completions`` (the same answers in the Chat Completions
shape, `middleware.dev.devchat`) and ``GET /v1/models``, complete enough for the official SDKs with strict
response validation, including the ``client.responses.stream(...)`` helper. ``make run`` puts the
gateway in front of it when no upstream is configured; demos and tests use it as a model whose answers
are fixed by the request. The same request always gets the same output; only ids and timestamps vary.

Rules, in order:

* **Reading the input.** A string ``input`` is the user text. In a list of items, the last message
  with role ``user`` gives the user text (string content, or its text parts joined by spaces; leading
  and trailing whitespace stripped), and the ``function_call_output`` items after it are the *tool
  results*, each named by the ``function_call`` with the same ``call_id`` in the input (else by the
  ``call_id``). Other items are ignored.
* **Tool calls** (at most one per response). Only ``{"type": "function", "name": ...}`` tools count
  (with ``tool_choice`` ``{"type": "allowed_tools", ...}``, only the listed ones, and its ``mode`` is the
  choice). A tool *matches* when the user text contains its name as a word, case-insensitively, a space
  also matching ``_`` (``get time`` matches ``get_time``), or any word (a run of letters and digits) of
  its ``description``. ``tool_choice`` ``"none"`` never calls; ``{"type": "function", "name": N}``
  always calls N; ``"required"`` always calls: the first matching tool, else the first tool. Otherwise
  (``"auto"``), without tool results it calls the first declared tool that matches, and nothing when
  none does; with tool results it calls nothing (it answers them), unless the user text says "loop
  forever": then it calls the first tool every time (a runaway loop, to demonstrate loop caps).
* **Arguments** are a compact JSON object built from the tool's ``parameters`` schema: each required
  property (every property when ``required`` is absent) gets its first ``enum`` value, or by type:
  a string named ``expression`` the first arithmetic expression in the user text (``calculate 6*7`` ->
  ``{"expression":"6*7"}``), other strings the user text, numbers and integers 1, booleans true,
  arrays ``[]``, objects ``{}``, anything else null. No parameters -> ``{}``.
* **Text answers** otherwise: ``Tool results: NAME -> OUTPUT; NAME -> OUTPUT.`` when there are tool
  results (each output on one line, at most 200 characters), else ``You said: <user text>``, or
  ``Hello from loopwarden's development model.`` when the user text is empty.
* **``max_output_tokens``** N smaller than the text answer's word count cuts it to its first N words and
  ends the response ``incomplete`` with ``incomplete_details.reason == "max_output_tokens"`` (terminal
  SSE event ``response.incomplete``). Function calls are never cut.
* **Usage** counts whitespace-separated words as tokens: input = ``instructions`` plus every message
  text, call arguments and tool output in ``input``; output = the answer text or the call arguments.
* **Streaming** sends ``response.created``, ``response.in_progress``, then per output item
  ``response.output_item.added``, for a message ``response.content_part.added``, one
  ``response.output_text.delta`` per word, ``response.output_text.done`` and
  ``response.content_part.done``, for a function call two ``response.function_call_arguments.delta``
  and ``response.function_call_arguments.done``, then ``response.output_item.done``; finally
  ``response.completed`` or ``response.incomplete``. ``sequence_number`` runs 0..N; no ``[DONE]``.
* **Errors.** A body that is not JSON or not an object, a missing or non-string ``model``, a field of
  the wrong JSON type (``input``, ``tools``, ``stream``, ...) or ``max_output_tokens`` < 1 is a 400 with
  the OpenAI envelope ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}`` and
  ``x-should-retry: false``; unknown URLs (404 ``unknown_url``) and wrong methods (405
  ``method_not_allowed``) use the same envelope.

Nothing is stored: ``previous_response_id`` and ``store`` are echoed, not honoured.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = [
    "DEV_MODEL_ID",
    "GREETING",
    "DevModelRequestError",
    "build_response",
    "create_devmodel_app",
    "parse_request",
    "response_events",
]

JSONObject = dict[str, Any]

DEV_MODEL_ID: Final = "dev"
GREETING: Final = "Hello from loopwarden's development model."

_RESULT_CHARS: Final = 200
_WORD: Final = re.compile(r"\S+")
_TEXT_DELTA: Final = re.compile(r"\s*\S+\s*")
_DESCRIPTION_WORD: Final = re.compile(r"[^\W_]+")
_EXPRESSION: Final = re.compile(r"[-+(]*\d[\d\s+\-*/().]*")

# Request fields echoed into the response object: allowed JSON types (null always means "default")
# and the default shown when the request leaves them out.
_ECHOED: Final[dict[str, tuple[tuple[str, ...], object]]] = {
    "instructions": (("string", "array"), None),
    "max_output_tokens": (("integer",), None),
    "max_tool_calls": (("integer",), None),
    "metadata": (("object",), {}),
    "parallel_tool_calls": (("boolean",), True),
    "previous_response_id": (("string",), None),
    "reasoning": (("object",), {"effort": None, "summary": None}),
    "store": (("boolean",), True),
    "temperature": (("integer", "number"), 1.0),
    "text": (("object",), {"format": {"type": "text"}, "verbosity": "medium"}),
    "tool_choice": (("string", "object"), "auto"),
    "tools": (("array",), []),
    "top_p": (("integer", "number"), 1.0),
    "presence_penalty": (("integer", "number"), 0.0),
    "frequency_penalty": (("integer", "number"), 0.0),
    "top_logprobs": (("integer",), 0),
    "truncation": (("string",), "disabled"),
    "service_tier": (("string",), "default"),
    "safety_identifier": (("string",), None),
    "prompt_cache_key": (("string",), None),
}
# A function tool's keys the response object requires, with the defaults the spec documents.
_TOOL_DEFAULTS: Final = {"description": None, "parameters": None, "strict": True}
_TYPES: Final[dict[str, tuple[str, ...]]] = {
    "model": ("string",),
    "input": ("string", "array"),
    "stream": ("boolean",),
    **{key: kinds for key, (kinds, _) in _ECHOED.items()},
}
_ENUMS: Final = {"tool_choice": ("none", "auto", "required"), "truncation": ("auto", "disabled")}


class DevModelRequestError(ValueError):
    """A create request the development model refuses; answered 400 with the OpenAI error envelope.

    `param` names the offending field (None for the body as a whole); `code` is the OpenAI error code:
    ``invalid_json``, ``invalid_type``, ``invalid_value``, ``missing_required_parameter`` or
    ``integer_below_min_value``.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_type") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def parse_request(raw: bytes) -> JSONObject:
    """Decode and check a create body; return it as a dict.

    Raises DevModelRequestError for a body that is not a JSON object (NaN and Infinity are refused), a
    missing ``model``, a known field of the wrong JSON type (``model``, ``input``, ``stream``, ``tools``,
    ``tool_choice``, ``instructions``, ``metadata``, ``max_output_tokens``, ``temperature``, ...),
    ``max_output_tokens`` < 1, an ``input`` or ``tools`` entry that is not an object, and a function
    tool without a non-empty string ``name``.
    """
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DevModelRequestError(
            f"request body is not valid JSON ({exc}); send one JSON object", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise DevModelRequestError(f"request body must be a JSON object, got {_json_type(body)}")
    if body.get("model") is None:
        raise DevModelRequestError(
            "missing required parameter 'model'; the development model accepts any name, e.g. \"dev\"",
            param="model",
            code="missing_required_parameter",
        )
    for key, allowed in _TYPES.items():
        value = body.get(key)
        if value is not None and _json_type(value) not in allowed:
            kinds = " or ".join(allowed)
            raise DevModelRequestError(f"'{key}' must be {kinds}, got {_json_type(value)}", param=key)
        if key in _ENUMS and isinstance(value, str) and value not in _ENUMS[key]:
            raise DevModelRequestError(
                f"'{key}' must be one of {_ENUMS[key]}, got {value!r}", param=key, code="invalid_value"
            )
    limit = body.get("max_output_tokens")
    if isinstance(limit, int) and limit < 1:
        raise DevModelRequestError(
            f"'max_output_tokens' must be at least 1, got {limit}",
            param="max_output_tokens",
            code="integer_below_min_value",
        )
    for field in ("input", "tools"):
        for index, item in enumerate(body[field] if isinstance(body.get(field), list) else ()):
            if not isinstance(item, dict):
                raise DevModelRequestError(
                    f"'{field}[{index}]' must be an object, got {_json_type(item)}", param=f"{field}[{index}]"
                )
    for index, tool in enumerate(body.get("tools") or ()):
        if tool.get("type") == "function" and not (isinstance(tool.get("name"), str) and tool["name"]):
            raise DevModelRequestError(
                f"function tool {index} needs a non-empty string 'name'",
                param=f"tools[{index}].name",
                code="missing_required_parameter",
            )
    return body


def build_response(body: JSONObject) -> JSONObject:
    """Answer a create request (as returned by `parse_request`) with a finished response object.

    The result is the JSON-ready ``Response`` the buffered endpoint returns: status ``completed`` or
    ``incomplete``, output items and usage as described in the module docstring.
    """
    conversation = _read_input(body)
    calls = _choose_calls(body, conversation)
    status, incomplete = "completed", None
    if calls:
        output = [_function_call(tool, conversation.user_text) for tool in calls]
        output_words = sum(_count_words(item["arguments"]) for item in output)
    else:
        text = _answer_text(conversation)
        words = list(_WORD.finditer(text))
        limit = body.get("max_output_tokens")
        if isinstance(limit, int) and 1 <= limit < len(words):
            text = text[: words[limit - 1].end()]
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        output = [_message(text, status)]
        output_words = _count_words(text)
    now = int(time.time())
    response: JSONObject = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": now,
        "status": status,
        "background": False,
        "completed_at": now if status == "completed" else None,
        "error": None,
        "incomplete_details": incomplete,
        "model": body["model"],
        "output": output,
        "usage": {
            "input_tokens": conversation.words,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_words,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": conversation.words + output_words,
        },
    }
    for key, (_, default) in _ECHOED.items():
        value = body.get(key)
        response[key] = default if value is None else value
    if not isinstance(response["text"].get("format"), dict):
        response["text"] = {**response["text"], "format": {"type": "text"}}
    response["reasoning"] = {"effort": None, "summary": None, **response["reasoning"]}
    response["tools"] = [
        {**_TOOL_DEFAULTS, **tool} if tool.get("type") == "function" else tool for tool in response["tools"]
    ]
    return response


def response_events(response: JSONObject) -> Iterator[JSONObject]:
    """Yield the SSE events that stream `response` (from `build_response`), ``sequence_number`` 0..N.

    The ``response.created`` / ``response.in_progress`` snapshots have no output and no usage; the
    terminal event is ``response.<status>`` carrying `response` itself.
    """
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> JSONObject:
        return {"type": kind, **fields, "sequence_number": next(numbers)}

    start = {**response, "status": "in_progress", "completed_at": None, "incomplete_details": None}
    start |= {"output": [], "usage": None}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    for index, item in enumerate(response["output"]):
        at: JSONObject = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            yield event(
                "response.output_item.added",
                item={**item, "status": "in_progress", "content": []},
                output_index=index,
            )
            for content_index, part in enumerate(item["content"]):
                at_part = {**at, "content_index": content_index}
                yield event("response.content_part.added", **at_part, part={**part, "text": ""})
                for delta in _TEXT_DELTA.findall(part["text"]):
                    yield event("response.output_text.delta", **at_part, delta=delta, logprobs=[])
                yield event("response.output_text.done", **at_part, text=part["text"], logprobs=[])
                yield event("response.content_part.done", **at_part, part=part)
        else:
            arguments = item["arguments"]
            yield event(
                "response.output_item.added",
                item={**item, "status": "in_progress", "arguments": ""},
                output_index=index,
            )
            half = len(arguments) // 2
            for delta in (arguments[:half], arguments[half:]):
                yield event("response.function_call_arguments.delta", **at, delta=delta)
            yield event("response.function_call_arguments.done", **at, arguments=arguments)
        yield event("response.output_item.done", item=item, output_index=index)
    yield event(f"response.{response['status']}", response=response)


def create_devmodel_app() -> Starlette:
    """Build the development model app: ``POST /v1/responses`` and ``GET /v1/models``.

    Stateless: every request is answered from its own body, as the module docstring describes.
    """
    return Starlette(
        routes=[
            Route("/v1/responses", _create_response, methods=["POST"]),
            Route("/v1/chat/completions", _create_chat_completion, methods=["POST"]),
            Route("/v1/models", _list_models, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error},
    )


# --- HTTP side ---------------------------------------------------------------------------------------


async def _create_response(request: Request) -> Response:
    try:
        body = parse_request(await request.body())
    except DevModelRequestError as exc:
        return _error(400, exc.message, param=exc.param, code=exc.code)
    response = build_response(body)
    headers = {"x-request-id": f"req_{uuid.uuid4().hex}"}
    if body.get("stream"):
        headers["cache-control"] = "no-cache"
        return StreamingResponse(
            _sse_frames(response, request), media_type="text/event-stream", headers=headers
        )
    return JSONResponse(response, headers=headers)


async def _create_chat_completion(request: Request) -> Response:
    """``POST /v1/chat/completions``: the same answer in the Chat shape (`middleware.dev.devchat`)."""
    from middleware.dev import devchat

    try:
        chat = json.loads(await request.body())
        if not isinstance(chat, dict):
            raise DevModelRequestError("the request body must be a JSON object", code="invalid_json")
        body = parse_request(json.dumps(devchat.responses_body(chat)).encode())
    except ValueError as exc:
        if isinstance(exc, DevModelRequestError):
            return _error(400, exc.message, param=exc.param, code=exc.code)
        return _error(400, "the request body is not valid JSON", code="invalid_json")
    response = build_response(body)
    if body.get("stream"):
        options = chat.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        frames = devchat.chunks(response, include_usage=usage)
        return StreamingResponse(
            iter(frames), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )
    return JSONResponse(devchat.completion(response))


async def _sse_frames(response: JSONObject, request: Request) -> AsyncIterator[bytes]:
    """The answer's SSE frames; stops once the gateway has hung up (checked every 64 frames), so a
    long answer is not written into a closed socket frame by frame."""
    for count, event in enumerate(response_events(response)):
        if count % 64 == 63 and await request.is_disconnected():
            return
        data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
        yield f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _list_models(request: Request) -> Response:
    model = {"id": DEV_MODEL_ID, "object": "model", "created": 0, "owned_by": "loopwarden"}
    return JSONResponse({"object": "list", "data": [model]})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}. The development model serves"
        return _error(
            404,
            f"{message} POST /v1/responses, POST /v1/chat/completions and GET /v1/models.",
            code="unknown_url",
        )
    return _error(exc.status_code, str(exc.detail), code="method_not_allowed", headers=exc.headers)


def _error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    envelope = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return JSONResponse(envelope, status_code=status, headers={**(headers or {}), "x-should-retry": "false"})


# --- the deterministic "model" -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Conversation:
    user_text: str
    results: tuple[tuple[str, str], ...]  # (tool name, output on one line) after the last user message
    words: int  # input words, for usage


def _read_input(body: JSONObject) -> _Conversation:
    instructions = body.get("instructions")
    words = _count_words(instructions) if isinstance(instructions, str) else 0
    raw = body.get("input") or ""
    if isinstance(raw, str):
        return _Conversation(raw.strip(), (), words + _count_words(raw))
    items: list[JSONObject] = raw
    words += sum(
        _count_words(_text_of(item.get(key))) for item in items for key in ("content", "arguments", "output")
    )
    names = {
        item["call_id"]: item["name"]
        for item in items
        if item.get("type") == "function_call"
        and isinstance(item.get("call_id"), str)
        and isinstance(item.get("name"), str)
    }
    users = [
        i
        for i, item in enumerate(items)
        if item.get("type", "message") == "message" and item.get("role") == "user"
    ]
    last = users[-1] if users else -1
    user_text = _text_of(items[last].get("content")).strip() if users else ""
    results = []
    for item in items[last + 1 :]:
        if item.get("type") == "function_call_output":
            call_id = item.get("call_id") if isinstance(item.get("call_id"), str) else ""
            results.append((names.get(call_id) or call_id or "tool", _one_line(_text_of(item.get("output")))))
    return _Conversation(user_text, tuple(results), words)


def _choose_calls(body: JSONObject, conversation: _Conversation) -> list[JSONObject]:
    tools = [tool for tool in body.get("tools") or () if tool.get("type") == "function"]
    choice = body.get("tool_choice") or "auto"
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        listed = {t.get("name") for t in choice.get("tools") or () if isinstance(t, dict)}
        tools = [tool for tool in tools if tool["name"] in listed]
        choice = choice.get("mode") if choice.get("mode") in ("none", "required") else "auto"
    if not tools or choice == "none":
        return []
    if isinstance(choice, dict):
        named = [tool for tool in tools if choice.get("name") == tool["name"]]
        if choice.get("type") == "function" and named:
            return named[:1]
    text = conversation.user_text
    matching = [tool for tool in tools if _matches(text, tool)]
    if choice == "required":
        return (matching or tools)[:1]
    if conversation.results:
        return tools[:1] if "loop forever" in text.lower() else []
    return matching[:1] or (tools[:1] if "loop forever" in text.lower() else [])


def _matches(text: str, tool: JSONObject) -> bool:
    """`tool`'s name, or a word of its description, is a word of `text` (case-insensitive)."""
    if _mentions(text, tool["name"]):
        return True
    description = tool.get("description")
    words = _DESCRIPTION_WORD.findall(description) if isinstance(description, str) else []
    typed = {word.lower() for word in _DESCRIPTION_WORD.findall(text)}
    return any(word.lower() in typed for word in words)


def _mentions(text: str, name: str) -> bool:
    pattern = "[_ ]".join(re.escape(piece) for piece in name.split("_"))
    return re.search(rf"(?<!\w){pattern}(?!\w)", text, re.IGNORECASE) is not None


def _function_call(tool: JSONObject, text: str) -> JSONObject:
    parameters = tool.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    arguments: JSONObject = {}
    if isinstance(parameters, dict) and isinstance(properties, dict):
        required = parameters.get("required")
        for name, schema in properties.items():
            if not isinstance(required, list) or name in required:
                arguments[name] = _example_value(name, schema, text)
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "status": "completed",
        "arguments": json.dumps(arguments, separators=(",", ":"), ensure_ascii=False),
        "call_id": f"call_{uuid.uuid4().hex}",
        "name": tool["name"],
    }


def _example_value(name: str, schema: object, text: str) -> object:
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string" and name == "expression":
        match = _EXPRESSION.search(text)
        return match.group().strip().rstrip(".").strip() if match else text
    if kind == "string":
        return text
    return (
        {"integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}.get(kind)
        if isinstance(kind, str)
        else None
    )


def _answer_text(conversation: _Conversation) -> str:
    if conversation.results:
        return (
            "Tool results: " + "; ".join(f"{name} -> {output}" for name, output in conversation.results) + "."
        )
    return f"You said: {conversation.user_text}" if conversation.user_text else GREETING


def _message(text: str, status: str) -> JSONObject:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _text_of(value: object) -> str:
    """A message's content, call arguments or tool output as plain text (text parts joined by spaces)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _one_line(text: str) -> str:
    line = " ".join(text.split()) or "(empty)"
    return line if len(line) <= _RESULT_CHARS else line[: _RESULT_CHARS - 3] + "..."


def _count_words(text: str) -> int:
    return len(text.split())


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for kind, name in ((int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "object"


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")
