"""Chat Completions replies as Responses objects: the finite builder both paths share.

`Completion` is what one Chat reply says once accumulated (a ``chat.completion`` body, or the
stream's deltas); `build_response` turns it into the Responses object of the round, as Praxis
``chat_response_to_response_resource`` does (../shared/specs/chat-completions-translation.md
§1.3): a ``reasoning`` item (per `ChatDialect.reasoning_dialect`), the ``message`` item, one
``function_call`` per tool call; ``finish_reason`` ``length`` / ``content_filter`` make the
response ``incomplete`` with that reason; usage is mapped field by field. The streamed terminal is
built from the same `Completion`, so a streamed and a finite translation of one reply agree.
Item ids are fresh per round (``msg_``/``rs_``/``fc_`` + random hex), never derived from the
response id: every round of a loop would otherwise mint the same ids.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from middleware.ids import new_id
from middleware.upstream.chat.dialect import ChatDialect
from middleware.upstream.chat.errors import reply_failure
from middleware.upstream.reader import refuse_lone_surrogates

FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


@dataclasses.dataclass
class ToolCall:
    """One accumulated call: ``call_id``, ``name``, ``arguments`` (JSON text), ``item_id``."""

    call_id: str
    name: str
    arguments: str = ""
    item_id: str = dataclasses.field(default_factory=lambda: new_id("fc"))


@dataclasses.dataclass
class Completion:
    """One Chat reply, accumulated. ``order`` lists the output keys (``"reasoning"``,
    ``"message"``, ``("call", i)``) in the order their items are output (streamed: as announced)."""

    id: str = ""
    model: str = ""
    created: int | None = None
    text: str = ""
    refusal: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    message_id: str = dataclasses.field(default_factory=lambda: new_id("msg"))
    reasoning_id: str = dataclasses.field(default_factory=lambda: new_id("rs"))
    order: list[Any] = dataclasses.field(default_factory=list)
    parts: list[str] = dataclasses.field(default_factory=list)  # "refusal" / "text", as they came

    def default_order(self) -> list[Any]:
        """Reasoning, message, calls: the finite reply's order (§1.3)."""
        keys: list[Any] = ["reasoning"] if self.reasoning else []
        if self.text or self.refusal:
            keys.append("message")
        return keys + [("call", i) for i in range(len(self.calls))]


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(``status``, ``incomplete_details``) for a finish reason."""
    reason = INCOMPLETE.get(finish_reason or "")
    return ("incomplete", {"reason": reason}) if reason else ("completed", None)


def usage_of(usage: Any) -> dict[str, Any] | None:
    """Chat ``usage`` as Responses usage (absent counts are 0); None when the reply had none."""
    if not isinstance(usage, dict):
        return None

    def count(obj: Any, key: str) -> int:
        value = obj.get(key) if isinstance(obj, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    prompt, completion = count(usage, "prompt_tokens"), count(usage, "completion_tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": count(usage.get("prompt_tokens_details"), "cached_tokens")},
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": count(usage.get("completion_tokens_details"), "reasoning_tokens")
        },
        "total_tokens": count(usage, "total_tokens") or prompt + completion,
    }


def message_item(c: Completion, status: str) -> dict[str, Any]:
    """The assistant ``message`` item: its parts in arrival order (refusal before text when the
    refusal came first)."""
    content: list[dict[str, Any]] = []
    for part in c.parts or (["refusal"] if c.refusal else []) + (["text"] if c.text else []):
        if part == "text":
            content.append({"type": "output_text", "text": c.text, "annotations": [], "logprobs": []})
        else:
            content.append({"type": "refusal", "refusal": c.refusal})
    return {"id": c.message_id, "type": "message", "status": status, "role": "assistant", "content": content}


def reasoning_item(c: Completion, status: str) -> dict[str, Any]:
    """Raw chain of thought as ``reasoning_text`` content, never relabelled as a summary."""
    return {
        "id": c.reasoning_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": c.reasoning}],
    }


def call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": call.item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments or "{}",
    }


def output_items(c: Completion, status: str) -> list[dict[str, Any]]:
    """The round's output items in ``c.order`` (else `Completion.default_order`)."""
    items = []
    for key in c.order or c.default_order():
        if key == "reasoning":
            items.append(reasoning_item(c, status))
        elif key == "message":
            items.append(message_item(c, status))
        else:
            items.append(call_item(c.calls[key[1]], status))
    return items


def build_response(c: Completion, *, created_at: int | None = None) -> dict[str, Any]:
    """The Responses object of the round (the loop fills the echo fields from the request).
    ``completed_at`` (Unix seconds) is now for a ``completed`` response, null otherwise, as a
    Responses upstream answers."""
    status, details = status_of(c.finish_reason)
    response: dict[str, Any] = {
        "id": "resp_" + (c.id or new_id("chat")).replace("-", "_")[-48:],
        "object": "response",
        "created_at": c.created if c.created is not None else created_at,
        "model": c.model,
        "status": status,
        "incomplete_details": details,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "output": output_items(c, status),
        "usage": usage_of(c.usage),
    }
    if response["created_at"] is None:
        del response["created_at"]
    return response


def _reasoning_field(obj: dict[str, Any], dialect: ChatDialect) -> str:
    """The reasoning text a message or delta carries in the dialect's field ("" when none)."""
    if dialect.reasoning_dialect == "none":
        return ""
    value = obj.get(dialect.reasoning_dialect)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise reply_failure("invalid_reasoning")
    return value


def _string(value: Any) -> str:
    """A text field of the message: a string, null (""), else refused."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise reply_failure("invalid_completion")
    return value


def _content(value: Any) -> str:
    """``message.content``: a string, null, or a list of ``{"type": "text", "text": ...}`` parts
    (joined); any other part is refused (nothing is dropped silently)."""
    if not isinstance(value, list):
        return _string(value)
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise reply_failure("invalid_completion")
        texts.append(part["text"])
    return "".join(texts)


def completion_from_body(body: Any, dialect: ChatDialect) -> Completion:
    """A ``chat.completion`` body as a `Completion` (only ``choices[0]`` is used). Raises
    `ChatReplyInvalid` for a body that is not one (a role other than ``assistant``, a content
    part that is not text, non-string ``arguments``), a tool call without a function name, two
    different calls with one id (an identical repeat is dropped), legacy ``function_call`` or an
    unknown finish reason; `UpstreamInvalid` for a string holding a lone surrogate."""
    refuse_lone_surrogates(body, "Chat completion body")
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise reply_failure("invalid_completion")
    message = choices[0].get("message")
    if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
        raise reply_failure("invalid_completion")
    finish = choices[0].get("finish_reason")
    if finish == "function_call" or message.get("function_call") is not None:
        raise reply_failure("legacy_function_call")
    if finish not in FINISH_REASONS:
        raise reply_failure("unknown_finish_reason" if finish is not None else "missing_finish_reason")
    c = Completion(
        id=str(body.get("id") or ""),
        model=str(body.get("model") or ""),
        created=body.get("created") if isinstance(body.get("created"), int) else None,
        text=_content(message.get("content")),
        refusal=_string(message.get("refusal")),
        reasoning=_reasoning_field(message, dialect),
        finish_reason=finish,
        usage=body.get("usage") if isinstance(body.get("usage"), dict) else None,
    )
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or len(calls) > dialect.max_tool_calls:
        raise reply_failure("invalid_tool_stream" if not isinstance(calls, list) else "limit_tool_calls")
    by_id: dict[str, ToolCall] = {}
    for call in calls:
        made = _body_call(call, dialect)
        seen = by_id.get(made.call_id)
        if seen is not None:
            if (seen.name, seen.arguments) != (made.name, made.arguments):
                raise reply_failure("invalid_tool_stream")  # two different calls, one id
            continue  # the same call twice: kept once
        by_id[made.call_id] = made
        c.calls.append(made)
    return c


def _body_call(call: Any, dialect: ChatDialect) -> ToolCall:
    """One ``message.tool_calls[]`` entry: a function name, ``arguments`` JSON text (absent: ``{}``;
    any other type refused), the id (made when absent)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise reply_failure("invalid_tool_stream")
    arguments = function.get("arguments", "{}")
    call_id = call.get("id")
    if not isinstance(arguments, str) or not isinstance(call_id, (str, type(None))):
        raise reply_failure("invalid_tool_stream")
    if len(arguments.encode()) > dialect.max_tool_call_argument_bytes:
        raise reply_failure("limit_tool_arguments")
    return ToolCall(call_id=call_id or new_id("call"), name=function["name"], arguments=arguments)
