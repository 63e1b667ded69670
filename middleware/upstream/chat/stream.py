"""`StreamConverter`: Chat Completions SSE chunks in, Responses SSE events out, for one round.

A pure, round-scoped state machine after Praxis ``StreamConverter``
(../shared/specs/chat-completions-translation.md §1.4): it never buffers the reply, only the
accumulated text, reasoning and call arguments that the terminal response needs. Events follow the
canonical sequences: ``response.created`` + ``response.in_progress`` on the first chunk; an item's
``output_item.added`` when its first content arrives (``output_index`` dense, in that order; a
call is announced at its first argument fragment once its ``id`` and ``name`` are known); deltas;
then, at the terminal, every item's ``.done`` events and ``output_item.done`` followed by
``response.completed`` or ``response.incomplete``, whose response is `build_response` of the
accumulated `Completion` (the finite translation's builder). ``sequence_number`` counts from 0.
Reasoning streams as its own ``reasoning`` item with the Open Responses spec's
``response.reasoning.delta`` / ``response.reasoning.done`` events (openai-python names them
``response.reasoning_text.*``; the spec is the contract here, and the SDK ignores event types it
does not know, taking the item from ``output_item.done`` and the terminal).

Tool calls are decided from the accumulated calls, never from ``finish_reason`` (Ollama sends
``stop`` after streamed calls). In the ``tolerant`` profile a new id on an index whose call has
arguments starts a new call (servers that put every call on ``index: 0``), a fragment without
``index`` continues the last call or, with a new id, starts one, and a call without an id gets
one. Every failure raises through `middleware.upstream.chat.errors.reply_failure`.

Upstream strings are checked once per chunk for lone surrogates (`refuse_lone_surrogates`: 502
``upstream_invalid_response`` / an error frame, as the reader refuses them), so every later
UTF-8 count is safe. Azure OpenAI's metadata-only chunks (an empty ``id``, no choices or choices
carrying only ``content_filter_results`` / ``prompt_filter_results``) are skipped; a non-empty
``id`` that changes is refused. Text, reasoning and arguments are kept as lists of pieces with a
running byte count and joined once at the terminal: linear in the reply, never a copy per delta.
A call re-sent whole (its id and name again with an argument piece that is itself a JSON object,
once it has arguments) is dropped when identical to what was accumulated and refused otherwise
(never ``{}{}``).
"""

from __future__ import annotations

import json
from typing import Any

from middleware.ids import new_id
from middleware.upstream.chat.dialect import ChatDialect
from middleware.upstream.chat.errors import reply_failure
from middleware.upstream.chat.response import (
    FINISH_REASONS,
    Completion,
    ToolCall,
    _reasoning_field,
    build_response,
    call_item,
    message_item,
    reasoning_item,
)
from middleware.upstream.reader import refuse_lone_surrogates

Event = tuple[str, dict[str, Any]]


class _Slot:
    """A call being streamed: its identity so far, its arguments, whether it was announced."""

    __slots__ = ("announced", "args", "call", "call_id", "name", "nbytes", "output_index")

    def __init__(self) -> None:
        self.call_id = ""
        self.name = ""
        self.args: list[str] = []  # the argument pieces, joined once at the terminal
        self.nbytes = 0  # UTF-8 bytes of `args`
        self.announced = False
        self.output_index = -1
        self.call: ToolCall | None = None


class StreamConverter:
    """Feed each Chat ``data:`` payload (parsed JSON) to `chunk`, then `done` at ``[DONE]``/EOF;
    each returns the Responses events it produces, as (type, payload) with ``type`` and
    ``sequence_number`` set. ``retained``: UTF-8 bytes of text, reasoning, ids, names and
    arguments kept so far (what the ledger charges). Raises `ChatReplyInvalid`,
    `ChatLimitExceeded` or `ChatStreamIncomplete` (all `UpstreamError`s)."""

    def __init__(self, dialect: ChatDialect, *, created_at: int | None = None) -> None:
        self.dialect = dialect
        self.created_at = created_at
        self.c = Completion()
        self.seq = 0
        self.retained = 0
        self.finished = False  # a finish reason was seen
        self.ended = False  # the terminal was emitted
        self._slots: list[_Slot] = []
        self._by_index: dict[int, int] = {}  # chunk index -> slot number
        self._next_output = 0
        self._message_index = -1
        self._reasoning_index = -1
        self._text_part = -1
        self._refusal_part = -1
        self._pieces: dict[str, list[str]] = {"text": [], "refusal": [], "reasoning": []}

    # -- emission --------------------------------------------------------------------------
    def _event(self, out: list[Event], kind: str, payload: dict[str, Any]) -> None:
        terminal = kind in ("response.completed", "response.incomplete")
        if self.seq >= self.dialect.max_stream_events - 1 and not terminal:  # the terminal's slot is kept
            raise reply_failure("limit_events")
        out.append((kind, {"type": kind, "sequence_number": self.seq, **payload}))
        self.seq += 1

    def _keep(self, text: str) -> int:
        """Count `text` as retained; its UTF-8 bytes (lone surrogates were refused in `chunk`)."""
        size = _utf8_len(text)
        self.retained += size
        return size

    def _snapshot(self, status: str) -> dict[str, Any]:
        response = build_response(
            Completion(id=self.c.id, model=self.c.model, created=self.c.created), created_at=self.created_at
        )
        response.update(status=status, output=[], usage=None, incomplete_details=None, completed_at=None)
        return response

    # -- input -----------------------------------------------------------------------------
    def chunk(self, obj: Any) -> list[Event]:
        """The events for one ``chat.completion.chunk``."""
        out: list[Event] = []
        if self.ended:
            raise reply_failure("invalid_chunk")  # the caller stops reading at the terminal
        refuse_lone_surrogates(obj, "Chat stream chunk")
        if _metadata_only(obj):
            return out
        if not isinstance(obj, dict) or obj.get("object", "chat.completion.chunk") != "chat.completion.chunk":
            raise reply_failure("invalid_chunk")
        self._identity(obj, out)
        if isinstance(obj.get("usage"), dict):
            self.c.usage = obj["usage"]
        choices = obj.get("choices")
        if choices is None or choices == []:
            return out
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise reply_failure("invalid_chunk")
        choice = choices[0]
        if choice.get("index", 0) != 0 or self.finished:
            raise reply_failure("invalid_chunk")
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict) or delta.get("role") not in (None, "assistant"):
            raise reply_failure("invalid_chunk")
        if delta.get("function_call") is not None or choice.get("finish_reason") == "function_call":
            raise reply_failure("legacy_function_call")
        self._delta(delta, out)
        finish = choice.get("finish_reason")
        if finish is not None:
            if finish not in FINISH_REASONS:
                raise reply_failure("unknown_finish_reason")
            self.finished = True
            self.c.finish_reason = finish
        return out

    def _identity(self, obj: dict[str, Any], out: list[Event]) -> None:
        """The first chunk names the reply (``id``, ``model``) and starts the response; later
        chunks must not change them."""
        rid, model = obj.get("id"), obj.get("model")
        if self.seq == 0:
            if not isinstance(rid, str) or not rid or not isinstance(model, str) or not model:
                raise reply_failure("invalid_chunk")
            self.c.id, self.c.model = rid, model
            self.c.created = obj.get("created") if isinstance(obj.get("created"), int) else None
            self._event(out, "response.created", {"response": self._snapshot("in_progress")})
            self._event(out, "response.in_progress", {"response": self._snapshot("in_progress")})
        elif (rid not in (None, "") and rid != self.c.id) or (
            model not in (None, "") and model != self.c.model
        ):
            raise reply_failure("invalid_chunk")  # an empty id/model is absent; a changed one is refused

    def _delta(self, delta: dict[str, Any], out: list[Event]) -> None:
        reasoning = _reasoning_field(delta, self.dialect)
        if reasoning:
            self._reasoning(reasoning, out)
        refusal, content = delta.get("refusal"), delta.get("content")
        if not isinstance(refusal, (str, type(None))) or not isinstance(content, (str, type(None))):
            raise reply_failure("invalid_chunk")
        if refusal:
            self._text(refusal, out, refusal=True)
        if content:
            self._text(content, out, refusal=False)
        calls = delta.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise reply_failure("invalid_tool_stream")
            for fragment in calls:
                self._fragment(fragment, out)

    def _reasoning(self, text: str, out: list[Event]) -> None:
        if self._reasoning_index < 0:
            self._reasoning_index = self._allocate("reasoning")
            item = {**reasoning_item(self.c, "in_progress"), "content": []}
            self._event(
                out, "response.output_item.added", {"output_index": self._reasoning_index, "item": item}
            )
            part = {"type": "reasoning_text", "text": ""}
            self._event(
                out,
                "response.content_part.added",
                self._where(self.c.reasoning_id, self._reasoning_index, 0, part=part),
            )
        self._pieces["reasoning"].append(text)
        self._keep(text)
        self._event(
            out,
            "response.reasoning.delta",
            self._where(self.c.reasoning_id, self._reasoning_index, 0, delta=text),
        )

    def _text(self, text: str, out: list[Event], *, refusal: bool) -> None:
        if self._message_index < 0:
            self._message_index = self._allocate("message")
            item = {**message_item(self.c, "in_progress"), "content": []}
            self._event(
                out, "response.output_item.added", {"output_index": self._message_index, "item": item}
            )
        part_index = self._refusal_part if refusal else self._text_part
        if part_index < 0:
            part_index = len(self.c.parts)
            self.c.parts.append("refusal" if refusal else "text")
            if refusal:
                self._refusal_part = part_index
                part: dict[str, Any] = {"type": "refusal", "refusal": ""}
            else:
                self._text_part = part_index
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._event(
                out,
                "response.content_part.added",
                self._where(self.c.message_id, self._message_index, part_index, part=part),
            )
        self._keep(text)
        where = self._where(self.c.message_id, self._message_index, part_index, delta=text)
        self._pieces["refusal" if refusal else "text"].append(text)
        if refusal:
            self._event(out, "response.refusal.delta", where)
        else:
            self._event(out, "response.output_text.delta", {**where, "logprobs": []})

    def _where(self, item_id: str, output_index: int, content_index: int, **more: Any) -> dict[str, Any]:
        return {"item_id": item_id, "output_index": output_index, "content_index": content_index, **more}

    def _allocate(self, key: Any) -> int:
        self.c.order.append(key)
        index = self._next_output
        self._next_output += 1
        return index

    # -- tool calls ------------------------------------------------------------------------
    def _slot_for(self, fragment: dict[str, Any]) -> _Slot:
        """The call a fragment belongs to (see the module docstring for the tolerant rules)."""
        index, fid = fragment.get("index"), fragment.get("id")
        new_id_given = isinstance(fid, str) and fid != ""
        if not isinstance(index, int) or isinstance(index, bool):
            if not self.dialect.tolerant or index is not None:
                raise reply_failure("invalid_tool_stream")
            if self._slots and not (new_id_given and self._slots[-1].call_id not in ("", fid)):
                return self._slots[-1]
            return self._new_slot(None)
        number = self._by_index.get(index)
        if number is None:
            return self._new_slot(index)
        slot = self._slots[number]
        if new_id_given and slot.args and fid != slot.call_id:
            if not self.dialect.tolerant:
                raise reply_failure("invalid_tool_stream")  # IdAfterArguments (Praxis)
            return self._new_slot(index)  # the next call on a reused index (vercel/ai#14277)
        return slot

    def _new_slot(self, index: int | None) -> _Slot:
        if len(self._slots) >= self.dialect.max_tool_calls:
            raise reply_failure("limit_tool_calls")
        slot = _Slot()
        self._slots.append(slot)
        if index is not None:
            self._by_index[index] = len(self._slots) - 1
        return slot

    def _fragment(self, fragment: Any, out: list[Event]) -> None:
        if not isinstance(fragment, dict):
            raise reply_failure("invalid_tool_stream")
        slot = self._slot_for(fragment)
        fid = fragment.get("id")
        function = fragment.get("function") or {}
        if not isinstance(function, dict):
            raise reply_failure("invalid_tool_stream")
        name, args = function.get("name"), function.get("arguments")
        if any(not isinstance(v, (str, type(None))) for v in (fid, name, args)):
            raise reply_failure("invalid_tool_stream")  # e.g. arguments as an object, not JSON text
        if fid and fid == slot.call_id and name and slot.args and args and _is_object(args):
            self._repeated(slot, args)  # the whole call again: dropped when identical
            return
        if isinstance(fid, str) and fid and fid != slot.call_id:
            if slot.args or slot.announced:
                raise reply_failure("invalid_tool_stream")
            slot.call_id += fid
            self._keep(fid)
        if isinstance(name, str) and name and name != slot.name:  # "" (LM Studio) is ignored
            if slot.args or slot.announced:
                if not self.dialect.tolerant:
                    raise reply_failure("invalid_tool_stream")  # NameAfterArguments (Praxis)
            else:
                slot.name += name
                self._keep(name)
        if isinstance(args, str) and args:
            self._arguments(slot, args, out)

    def _arguments(self, slot: _Slot, args: str, out: list[Event]) -> None:
        if not slot.announced:
            self._announce(slot, out)
        assert slot.call is not None
        slot.args.append(args)
        slot.nbytes += self._keep(args)
        if slot.nbytes > self.dialect.max_tool_call_argument_bytes:
            raise reply_failure("limit_tool_arguments")
        self._event(
            out,
            "response.function_call_arguments.delta",
            {"item_id": slot.call.item_id, "output_index": slot.output_index, "delta": args},
        )

    def _repeated(self, slot: _Slot, args: str) -> None:
        """A call sent again whole: identical (same bytes) is dropped, anything else refused."""
        if _utf8_len(args) != slot.nbytes or "".join(slot.args) != args:
            raise reply_failure("invalid_tool_stream")

    def _announce(self, slot: _Slot, out: list[Event]) -> None:
        """``output_item.added`` for a call whose identity is known (a made id when tolerant)."""
        if not slot.call_id and self.dialect.tolerant:
            slot.call_id = new_id("call")
        if not slot.call_id or not slot.name:
            raise reply_failure("invalid_tool_stream")  # arguments before identity
        slot.call = ToolCall(call_id=slot.call_id, name=slot.name)
        self.c.calls.append(slot.call)
        slot.output_index = self._allocate(("call", len(self.c.calls) - 1))
        slot.announced = True
        item = {**call_item(slot.call, "in_progress"), "arguments": ""}
        self._event(out, "response.output_item.added", {"output_index": slot.output_index, "item": item})

    # -- the end ---------------------------------------------------------------------------
    def done(self) -> list[Event]:
        """``[DONE]`` or EOF: every item's closing events and the terminal. Raises
        `ChatStreamIncomplete` when no finish reason came."""
        if self.ended:
            return []
        if not self.finished:
            raise reply_failure("missing_finish_reason")
        out: list[Event] = []
        for slot in self._slots:  # a call identified but never given arguments is added late
            if not slot.announced:
                self._announce(slot, out)
            assert slot.call is not None
            slot.call.arguments = "".join(slot.args)
        self.c.text, self.c.refusal, self.c.reasoning = (
            "".join(self._pieces[key]) for key in ("text", "refusal", "reasoning")
        )
        final = build_response(self.c, created_at=self.created_at)
        by_index = dict(enumerate(final["output"]))
        for output_index, item in by_index.items():
            self._close(output_index, item, out)
        for output_index, item in by_index.items():
            self._event(out, "response.output_item.done", {"output_index": output_index, "item": item})
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        self._event(out, kind, {"response": final})
        self.ended = True
        return out

    def _close(self, output_index: int, item: dict[str, Any], out: list[Event]) -> None:
        """An item's ``.done`` events before its ``output_item.done``."""
        if item["type"] == "function_call":
            payload = {
                "item_id": item["id"],
                "output_index": output_index,
                "name": item["name"],
                "arguments": item["arguments"],
            }
            self._event(out, "response.function_call_arguments.done", payload)
            return
        for content_index, part in enumerate(item["content"]):
            where = self._where(item["id"], output_index, content_index)
            if part["type"] == "reasoning_text":
                self._event(out, "response.reasoning.done", {**where, "text": part["text"]})
            elif part["type"] == "refusal":
                self._event(out, "response.refusal.done", {**where, "refusal": part["refusal"]})
            else:
                self._event(out, "response.output_text.done", {**where, "text": part["text"], "logprobs": []})
            self._event(out, "response.content_part.done", {**where, "part": part})


def _utf8_len(text: str) -> int:
    """UTF-8 bytes of `text` (no copy for ASCII). Raises UnicodeEncodeError on a lone surrogate,
    which `chunk` refuses first."""
    return len(text) if text.isascii() else len(text.encode())


def _is_object(text: str) -> bool:
    """Whether one argument piece is by itself a whole JSON object (a re-sent complete call)."""
    if not text.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


_CONTENT_KEYS = ("content", "refusal", "tool_calls", "function_call", "reasoning_content", "reasoning")


def _metadata_only(obj: Any) -> bool:
    """An Azure OpenAI filter-metadata chunk: an empty or absent ``id``, ``object`` empty or the
    chunk one, no ``usage``, and no choice with delta content or a finish reason (the first
    chunk's ``prompt_filter_results``, the asynchronous filter's ``content_filter_results``)."""
    if not isinstance(obj, dict) or obj.get("id") not in (None, "") or obj.get("usage") is not None:
        return False
    if obj.get("object") not in (None, "", "chat.completion.chunk"):
        return False
    choices = obj.get("choices")
    if choices is None:
        return True
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return False
        delta = choice.get("delta")
        if delta is None:
            continue
        if not isinstance(delta, dict) or any(delta.get(key) not in (None, "", []) for key in _CONTENT_KEYS):
            return False
    return True
