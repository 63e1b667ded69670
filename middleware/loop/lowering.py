"""The upstream form of input items the gateway emitted (DESIGN.md §6; issue 18 items 1 and 2).

A client may feed back anything a response gave it — the OpenAI Agents SDK and LangChain send
the whole history as ``input`` on every turn, ``store`` on or off — but the upstream only knows
the Open Responses input items (``../shared/specs/open-responses/openapi.json``, ``ItemParam``).
`lower_input` rewrites the gateway's own item types, in place of each:

=========================  =============================================================
item                       sent upstream as
=========================  =============================================================
``mcp_list_tools``         nothing (it carries nothing the model needs: the tools are sent)
``mcp_call``               a ``function_call`` + ``function_call_output`` pair (the output,
                           or the error's text); ``call_id`` from its ``approval_request_id``
                           (see below) or its ``id``
``mcp_approval_request``   a ``function_call`` when its call is answered: by a
                           ``function_call_output`` of the history, or — in new input, no
                           ``mcp_call`` carrying it — by an ``mcp_approval_response`` of the
                           same input (a *stateless approval*: the call is returned in
                           ``pending``, and the loop runs it or feeds the refusal); else nothing
``mcp_approval_response``  nothing (the loop reads it from the client's input)
``{"role", "content"}``    the same message with ``"type": "message"`` (ItemParam needs it)
=========================  =============================================================

The ``call_id`` of an approval request ``mcpr_X`` is ``X`` (`middleware.loop.approvals`), so a
stored and a stateless approval of the same call agree. A stateless approval runs under the rules
of a stored one: its ``server_label`` and ``name`` must name a tool this request's ``tools`` expose
(declared, on the allowlist, through ``allowed_tools``), its ``arguments`` must be a JSON object
that the tool's input schema accepts; else `InvalidRequest` (400) before anything runs. The call
is built from the item only (server, name, arguments), so a fabricated request item gains nothing
the client could not get by declaring the server with ``require_approval: "never"``.

`drop_orphans` then removes what a strict server refuses to continue from: a ``reasoning`` item
not followed by the output item it preceded (OpenAI: "provided without its required following
item"), e.g. when the call after it was omitted at the tool cap. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from budget import JsonInvalid, JsonTooDeep, loads_strict
from middleware.errors import InvalidRequest
from middleware.ids import new_id
from middleware.loop.approvals import APPROVAL_PREFIX
from middleware.tools.names import upstream_name
from middleware.tools.resolved import ResolvedTools

__all__ = [
    "GATEWAY_INPUT_TYPES",
    "Lowered",
    "carries_gateway_items",
    "drop_orphans",
    "lower_history",
    "lower_input",
]

#: Input item types only the gateway understands: a request carrying one runs in the agent loop.
GATEWAY_INPUT_TYPES = frozenset(
    {"mcp_list_tools", "mcp_call", "mcp_approval_request", "mcp_approval_response", "item_reference"}
)
#: Item types a reasoning item may precede (what a model emits after it in one response).
_FOLLOWERS = frozenset({"function_call", "custom_tool_call", "message"})


def carries_gateway_items(value: Any) -> bool:
    """Whether a request's ``input`` holds an item of `GATEWAY_INPUT_TYPES`."""
    return isinstance(value, list) and any(
        isinstance(i, dict) and isinstance(t := i.get("type"), str) and t in GATEWAY_INPUT_TYPES
        for i in value
    )


@dataclass
class Lowered:
    """`lower_input`'s answer: ``items`` to send upstream, in order; ``pending``: the
    ``function_call`` items (also in ``items``) of stateless approvals; ``answers``: the
    ``mcp_approval_response`` items still to settle (not those of a call already carried by an
    ``mcp_call`` or answered by an output), for the loop (`middleware.loop.approvals`)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)


def _call_id(request_id: str) -> str:
    return request_id[len(APPROVAL_PREFIX) :] if request_id.startswith(APPROVAL_PREFIX) else request_id


def _text(value: Any, limit: int = 100) -> str:
    return str(value)[:limit]


def _function_name(item: dict[str, Any], resolved: ResolvedTools | None) -> str:
    name, label = item.get("name"), item.get("server_label")
    found = (
        resolved.function_name(label, name)
        if resolved is not None and isinstance(label, str) and isinstance(name, str)
        else None
    )
    return found or upstream_name(name if isinstance(name, str) and name else "mcp_tool", ())


def _arguments(item: dict[str, Any]) -> str:
    arguments = item.get("arguments")
    return arguments if isinstance(arguments, str) and arguments.strip() else "{}"


def mcp_call_output(item: dict[str, Any]) -> str:
    """What the model was fed for an ``mcp_call``: its ``output``, else its error's text."""
    output = item.get("output")
    if isinstance(output, str):
        return output
    error = item.get("error")
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        content = error.get("content")
        texts = [c.get("text") for c in content if isinstance(c, dict)] if isinstance(content, list) else []
        joined = "\n".join(t for t in texts if isinstance(t, str))
        return joined or _text(error.get("message") or "the tool call failed", 4000)
    return ""


def lower_history(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored history (input rows as clients sent them, replay rows) in upstream form: no
    approval runs from history; an approval request counts only once its output is stored."""
    return lower_input(items, None, fresh=False).items


def lower_input(
    items: Sequence[dict[str, Any]],
    resolved: ResolvedTools | None,
    *,
    fresh: bool = True,
    known_calls: frozenset[str] = frozenset(),
    answered: frozenset[str] = frozenset(),
) -> Lowered:
    """`items` in upstream form (see the module docstring).

    ``fresh``: `items` is a request's new input (stateless approvals may run) rather than stored
    history. ``known_calls``: ``call_id``s the history already holds a function call for (never
    duplicated); ``answered``: ``call_id``s the history already holds an output for. Raises
    `InvalidRequest` for a stateless approval of a tool the request does not expose, or with
    arguments its schema refuses.
    """
    state = _State(
        resolved=resolved,
        fresh=fresh,
        answers=_strings(items, "mcp_approval_response", "approval_request_id"),
        carried=_strings(items, "mcp_call", "approval_request_id"),
        outputs=set(answered) | _strings(items, "function_call_output", "call_id"),
        seen=set(known_calls),
    )
    for index, item in enumerate(items):
        kind = item.get("type")
        if kind == "mcp_approval_response":
            rid = item.get("approval_request_id")
            if not (isinstance(rid, str) and (rid in state.carried or _call_id(rid) in state.outputs)):
                state.out.answers.append(item)
        elif kind == "mcp_call":
            state.mcp_call(item)
        elif kind == "mcp_approval_request":
            state.approval_request(item, f"input[{index}]")
        elif kind != "mcp_list_tools":
            if kind == "function_call" and isinstance(item.get("call_id"), str):
                state.seen.add(item["call_id"])
            # an easy message ({"role", "content"}) is typed: the Open Responses ItemParam needs it
            state.out.items.append(
                {"type": "message", **item} if "type" not in item and "role" in item else item
            )
    return state.out


@dataclass
class _State:
    """One `lower_input` pass: what the items answer, and the ``call_id``s already sent."""

    resolved: ResolvedTools | None
    fresh: bool
    answers: set[str]  # approval request ids an mcp_approval_response of the items answers
    carried: set[str]  # approval request ids an mcp_call of the items carries (already ran)
    outputs: set[str]  # call_ids with a function_call_output (history or items)
    seen: set[str]  # call_ids with a function call already sent
    out: Lowered = field(default_factory=Lowered)

    def mcp_call(self, item: dict[str, Any]) -> None:
        rid, raw_id = item.get("approval_request_id"), item.get("id")
        call_id = (
            _call_id(rid) if isinstance(rid, str) and rid else raw_id if isinstance(raw_id, str) else None
        )
        call_id = call_id or new_id("call")
        if call_id in self.seen:
            return
        self.seen.add(call_id)
        self.out.items.append(_call(call_id, item, self.resolved))
        self.out.items.append(
            {"type": "function_call_output", "call_id": call_id, "output": mcp_call_output(item)}
        )

    def approval_request(self, item: dict[str, Any], param: str) -> None:
        rid = item.get("id")
        if not isinstance(rid, str) or not rid:
            if self.fresh:
                raise InvalidRequest(
                    "an mcp_approval_request input item needs its string id",
                    code="invalid_value",
                    param="input",
                )
            return
        call_id = _call_id(rid)
        if rid in self.carried or call_id in self.seen:
            return
        if call_id in self.outputs:  # answered earlier: the call, for its output to follow
            self.seen.add(call_id)
            self.out.items.append(_call(call_id, item, self.resolved))
        elif self.fresh and rid in self.answers:  # a stateless approval, to settle now
            self.seen.add(call_id)
            call = _approved_call(call_id, item, self.resolved, param)
            self.out.items.append(call)
            self.out.pending.append(call)


def _strings(items: Sequence[dict[str, Any]], kind: str, key: str) -> set[str]:
    """The string values of `key` in the items of type `kind` (anything else is ignored here:
    the checks that read it refuse it)."""
    return {v for i in items if i.get("type") == kind and isinstance(v := i.get(key), str)}


def _call(call_id: str, item: dict[str, Any], resolved: ResolvedTools | None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": _function_name(item, resolved),
        "arguments": _arguments(item),
    }


def _approved_call(
    call_id: str, item: dict[str, Any], resolved: ResolvedTools | None, param: str
) -> dict[str, Any]:
    """The function call of a stateless approval (the input item at ``param``), checked against
    the request's tools; its ``arguments`` parsed as strictly as a request body (`loads_strict`:
    a repeated key, a lone surrogate or ``NaN`` is refused with that code)."""
    label, name = item.get("server_label"), item.get("name")
    function = (
        resolved.function_name(label, name)
        if resolved is not None and isinstance(label, str) and isinstance(name, str)
        else None
    )
    if function is None:
        raise InvalidRequest(
            f"the mcp_approval_request {_text(item.get('id'))!r} is for tool {_text(name)!r} of server "
            f"{_text(label)!r}, which this request's tools do not expose; declare that MCP server (its "
            "allowed_tools must include the tool) in tools with the approval",
            code="invalid_value",
            param="tools",
        )
    arguments = _arguments(item)
    parsed = _strict_arguments(arguments, item, f"{param}.arguments")
    if not isinstance(parsed, dict):
        raise InvalidRequest(
            f"the mcp_approval_request {_text(item.get('id'))!r} has arguments that are not a JSON object; "
            "send the arguments the model gave",
            code="invalid_value",
            param=f"{param}.arguments",
        )
    assert resolved is not None
    problem = resolved.argument_problem(function, parsed)
    if problem is not None:
        raise InvalidRequest(
            f"the mcp_approval_request {_text(item.get('id'))!r} has arguments that tool {_text(name)!r} "
            f"does not accept: {problem}",
            code="invalid_value",
            param=f"{param}.arguments",
        )
    return {"type": "function_call", "call_id": call_id, "name": function, "arguments": arguments}


def _strict_arguments(arguments: str, item: dict[str, Any], param: str) -> object:
    """``arguments`` parsed by `loads_strict` (None: not JSON at all); raises `InvalidRequest`
    with the `JsonInvalid` code (``duplicate_key``, ``invalid_unicode``, ``invalid_number``) at
    ``param``: the string that runs the tool must mean one thing to every parser."""
    try:
        return loads_strict(arguments.encode("utf-8", "surrogatepass"))
    except JsonTooDeep:
        return None
    except JsonInvalid as exc:
        if exc.code == "invalid_json":
            return None
        raise InvalidRequest(
            f"the mcp_approval_request {_text(item.get('id'))!r} has arguments that are not strict JSON: "
            f"{exc.message}",
            code=exc.code,
            param=param,
        ) from None


def drop_orphans(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items` without the ``reasoning`` items that no output item follows (see the module
    docstring); everything else in order."""
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if item.get("type") == "reasoning":
            following = items[index + 1] if index + 1 < len(items) else None
            if following is None or not _follows(following):
                continue
        out.append(item)
    return out


def _follows(item: dict[str, Any]) -> bool:
    kind = item.get("type")
    if kind == "message" or (kind is None and "role" in item):
        return item.get("role") == "assistant"
    return isinstance(kind, str) and (kind in _FOLLOWERS or kind.endswith("_call"))
