"""One Responses round (the body the loop sends) as one Chat Completions request.

Follows the request mapping of ../shared/specs/chat-completions-translation.md §1.2 (Praxis
``map_request_parameters``, OGX, vLLM ``construct_input_messages``): instructions become the first
system message, input items become messages (adjacent ``function_call`` items batch into one
assistant message, each ``function_call_output`` a ``tool`` message), function tools nest under
``function``, ``tool_choice`` and ``text.format`` are rewritten, ``max_output_tokens`` goes to the
dialect's field, and a streamed round forces ``stream_options.include_usage``. Anything the Chat
API cannot express is a 400 (`middleware.upstream.chat.errors.unsupported`) before any upstream
call; nothing is dropped silently except what the notes say has no Chat equivalent (``store``,
``include``, ``truncation``, ``metadata``, reasoning summaries).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from middleware.upstream.chat.dialect import ChatDialect
from middleware.upstream.chat.errors import unsupported

#: Top-level fields copied verbatim (§1.2).
COPIED = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "parallel_tool_calls",
    "prompt_cache_key",
    "service_tier",
    "user",
    "seed",
    "stop",
)
TEXT_PARTS = ("input_text", "output_text", "text")
#: Items the gateway emits that carry nothing the model needs to see again.
SKIPPED_ITEMS = ("mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "item_reference_resolved")


def translate_request(body: dict[str, Any], dialect: ChatDialect) -> dict[str, Any]:
    """The Chat Completions request for Responses request `body` (a parsed JSON object).

    Raises `InvalidRequest` (400, ``unsupported_parameter``, ``param`` names the field) for an item,
    content part, tool or ``tool_choice`` the Chat API cannot express."""
    out: dict[str, Any] = {"model": body.get("model")}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    elif isinstance(raw_input, list):
        messages.extend(_messages(raw_input, dialect))
    out["messages"] = messages
    _parameters(body, out, dialect)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        out["tools"] = [_tool(tool, i) for i, tool in enumerate(tools)]
    _tool_choice(body, out)
    if body.get("stream") is True:
        out["stream"] = True
        options = body.get("stream_options")
        out["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return out


def _parameters(body: dict[str, Any], out: dict[str, Any], dialect: ChatDialect) -> None:
    """The scalar parameters: copied, ``top_logprobs`` (+ ``logprobs``), ``reasoning.effort``,
    ``max_output_tokens`` and ``text.format`` (dropped when tools are present)."""
    for field in COPIED:
        if body.get(field) is not None:
            out[field] = body[field]
    if isinstance(body.get("top_logprobs"), int) and body["top_logprobs"] > 0:
        out["top_logprobs"] = body["top_logprobs"]
        out["logprobs"] = True
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    if body.get("max_output_tokens") is not None:
        out[dialect.max_tokens_field] = body["max_output_tokens"]
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and not body.get("tools"):
        kind = fmt.get("type")
        if kind == "json_object":
            out["response_format"] = {"type": "json_object"}
        elif kind == "json_schema":
            nested = fmt.get("json_schema")
            schema = (
                nested
                if isinstance(nested, dict)
                else {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
            )
            out["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif kind not in (None, "text"):
            raise unsupported(
                f"unsupported text.format type for Chat Completions translation: {kind}", "text.format"
            )


def _tool(tool: Any, index: int) -> dict[str, Any]:
    """A Responses function tool as a Chat tool (a nested ``function`` passes through)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise unsupported(
            f"unsupported Responses tool type for Chat Completions translation: {kind}; the upstream "
            "speaks only function tools (declare MCP servers, which the gateway runs, or function tools)",
            f"tools[{index}]",
        )
    if isinstance(tool.get("function"), dict):
        return {"type": "function", "function": tool["function"]}
    function = {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
    }
    return {"type": "function", "function": function}


def _tool_choice(body: dict[str, Any], out: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    if choice is None or (choice == "auto" and "tools" not in out):
        return  # many servers reject tool_choice without tools
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        out["tool_choice"] = choice
    elif (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
    ):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        kind = choice.get("type") if isinstance(choice, dict) else choice
        raise unsupported(
            f"unsupported Responses tool_choice type for Chat Completions translation: {kind}", "tool_choice"
        )


def _messages(items: list[Any], dialect: ChatDialect) -> list[dict[str, Any]]:
    """The input items as messages (see the module docstring); reasoning is held for the next
    assistant message (`ChatDialect.reasoning_replay`)."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise unsupported("every input item must be an object", f"input[{index}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, index, dialect)
            if message["role"] == "assistant":
                _attach(message, reasoning, dialect)
            messages.append(message)
        elif kind in ("function_call", "mcp_call"):
            _call(messages, item, reasoning, dialect)
            if kind == "mcp_call":
                output = item.get("output") if item.get("error") is None else item.get("error")
                messages.append({"role": "tool", "tool_call_id": _call_id(item), "content": _text(output)})
        elif kind == "function_call_output":
            if isinstance(item.get("call_id"), str):
                messages.append(
                    {"role": "tool", "tool_call_id": item["call_id"], "content": _output(item.get("output"))}
                )
        elif kind == "reasoning":
            reasoning.extend(_reasoning_text(item))
        elif kind == "compaction":
            summary = _compaction_summary(item)
            if summary:
                messages.append(
                    {"role": "assistant", "content": "[Previous conversation summary]\n\n" + summary}
                )
        elif kind not in SKIPPED_ITEMS:
            raise unsupported(
                f"unsupported Responses input item type for Chat Completions translation: {kind}",
                f"input[{index}]",
            )
    return messages


def _message(item: dict[str, Any], index: int, dialect: ChatDialect) -> dict[str, Any]:
    role = item.get("role") or "user"
    if role == "developer":
        role = dialect.developer_role
    content = item.get("content")
    if isinstance(content, str) or content is None:
        return {"role": role, "content": content or ""}
    if not isinstance(content, list):
        raise unsupported("message content must be a string or a list of parts", f"input[{index}].content")
    parts = [_part(part, f"input[{index}].content[{j}]") for j, part in enumerate(content)]
    if all(part["type"] == "text" for part in parts):
        return {"role": role, "content": "".join(part["text"] for part in parts)}  # no separator (Praxis)
    return {"role": role, "content": parts}


def _part(part: Any, param: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        if not isinstance(part.get("image_url"), str):
            raise unsupported(
                "an input_image needs an image_url for Chat Completions translation (file_id is not supported)",
                param,
            )
        image = {"url": part["image_url"], **({"detail": part["detail"]} if part.get("detail") else {})}
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        fields = ("file_id", "filename", "file_data", "file_url")
        return {"type": "file", "file": {k: part[k] for k in fields if part.get(k) is not None}}
    raise unsupported(f"unsupported content part type for Chat Completions translation: {kind}", param)


def _call_id(item: dict[str, Any]) -> str:
    return str(item.get("call_id") or item.get("id") or "")


def _call(
    messages: list[dict[str, Any]], item: dict[str, Any], reasoning: list[str], dialect: ChatDialect
) -> None:
    """Append a call to the previous assistant message (adjacent calls batch; a message with text
    and calls is one assistant turn), else start one."""
    if not _call_id(item) or not isinstance(item.get("name"), str):
        return  # Praxis: a call without call_id or name is dropped (it can have no output)
    arguments = item.get("arguments")
    call = {
        "id": _call_id(item),
        "type": "function",
        "function": {
            "name": item["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments or {}),
        },
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not reasoning:
        if last.get("content") == "":
            last["content"] = None
        last.setdefault("tool_calls", []).append(call)
        return
    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    _attach(message, reasoning, dialect)
    messages.append(message)


def _attach(message: dict[str, Any], reasoning: list[str], dialect: ChatDialect) -> None:
    """Put held reasoning on `message` (the dialect's replay field), or drop it (``omit``)."""
    if reasoning and dialect.reasoning_replay != "omit":
        message[dialect.reasoning_replay] = "".join(reasoning)
    reasoning.clear()


def _reasoning_text(item: dict[str, Any]) -> list[str]:
    """The text of a reasoning item: its ``reasoning_text`` content, else its summary (an
    ``encrypted_content`` from another provider cannot be decoded here and is dropped)."""
    texts = [
        p["text"] for p in item.get("content") or [] if isinstance(p, dict) and isinstance(p.get("text"), str)
    ]
    if not texts:
        texts = [
            p["text"]
            for p in item.get("summary") or []
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
    return texts


def _compaction_summary(item: dict[str, Any]) -> str:
    """A compaction item's readable summary (``summary`` text, else base64 ``encrypted_content``
    that decodes to UTF-8); "" when there is none (the item adds nothing)."""
    if isinstance(item.get("summary"), str):
        return str(item["summary"])
    try:
        return base64.b64decode(str(item.get("encrypted_content") or ""), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return ""


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _output(output: Any) -> str:
    """A ``function_call_output``'s output as tool message text (text parts joined; else JSON)."""
    if isinstance(output, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in output
    ):
        return "".join(p["text"] for p in output)
    return _text(output)
