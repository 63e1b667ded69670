"""Pure builders of the client-visible pieces of a response (no I/O, no state).

`sum_usage` (usage over rounds), `as_input_items`, `public_tools`
(MCP secrets echoed as null), `call_arguments`, `mcp_call_item`, `approval_request_item`,
`terminal_event` / `TERMINAL_STATUS` (the terminal event of a status and back), and
`synthesized_events` (the SSE events of a complete response object, for a server that answered
a streamed call buffered).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from middleware.loop.echo import echo_tool, normalise_response
from middleware.store.store import SECRET_TOOL_FIELDS
from middleware.tools import ToolOutcome
from middleware.upstream.reader import dumps_checked

if TYPE_CHECKING:
    from middleware.store.history import Restored

#: Terminal event type -> the response status it ends with (DESIGN.md §6: the event decides).
TERMINAL_STATUS = {
    "response.completed": "completed",
    "response.incomplete": "incomplete",
    "response.failed": "failed",
}


def terminal_event(status: object) -> str:
    """The terminal event type of a response ``status`` (``response.completed`` for anything
    that is not ``incomplete`` or ``failed``)."""
    return {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
        str(status), "response.completed"
    )


def sum_usage(total: dict[str, Any] | None, usage: Any) -> dict[str, Any] | None:
    """Add one round's ``usage`` object into `total` (integers summed, nested details too)."""
    if not isinstance(usage, dict):
        return total
    out: dict[str, Any] = dict(total or {})
    for key, value in usage.items():
        if isinstance(value, int) and not isinstance(value, bool):
            prior = out.get(key)
            out[key] = (prior if isinstance(prior, int) else 0) + value
        elif isinstance(value, dict):
            prior_dict = out.get(key)
            out[key] = sum_usage(prior_dict if isinstance(prior_dict, dict) else None, value)
        elif key not in out:
            out[key] = value
    return out


def epoch_seconds(value: Any) -> int:
    """An upstream ``created_at`` as epoch seconds (now when it is missing or not a sane number)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e11:
        return int(value)
    return int(time.time())


def as_input_items(value: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as a list of items (a string becomes one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, dict)]
    return []


def public_tools(tools: Any) -> list[Any]:
    """The request's ``tools`` as echoed in a response: MCP ``headers`` / ``authorization`` are
    secrets sent to that server only, so they are shown as null (DESIGN.md §6); function tools
    get the spec's defaults for the required keys the client omitted (`echo_tool`)."""
    if not isinstance(tools, list):
        return []
    out: list[Any] = []
    for tool in tools:
        if (
            isinstance(tool, dict)
            and tool.get("type") == "mcp"
            and any(k in tool for k in SECRET_TOOL_FIELDS)
        ):
            tool = {k: (None if k in SECRET_TOOL_FIELDS else v) for k, v in tool.items()}
        out.append(echo_tool(tool))
    return out


def call_arguments(call: dict[str, Any]) -> str:
    """A call's ``arguments`` as re-emitted to the client: valid JSON text (``"{}"`` for a
    parameterless call whose upstream sent ``""`` or null, case B07)."""
    arguments = call.get("arguments")
    return arguments if isinstance(arguments, str) and arguments.strip() else "{}"


def mcp_call_item(
    call: dict[str, Any], outcome: ToolOutcome, server_label: str, name: str, item_id: str
) -> dict[str, Any]:
    """The client-visible ``mcp_call`` item of an executed gateway call."""
    item: dict[str, Any] = {
        "type": "mcp_call",
        "id": item_id,
        "server_label": server_label,
        "name": name,
        "arguments": call_arguments(call),
        "output": outcome.output if outcome.error is None else None,
        "error": None,
        "status": "completed" if outcome.error is None else "failed",
    }
    if outcome.error is not None:
        item["error"] = {
            "type": "mcp_tool_execution_error",
            "content": [{"type": "text", "text": outcome.output}],
        }
    return item


def approval_request_item(
    call: dict[str, Any], request_id: str, server_label: str, name: str
) -> dict[str, Any]:
    """The client-visible ``mcp_approval_request`` item of a gateway call awaiting approval."""
    return {
        "type": "mcp_approval_request",
        "id": request_id,
        "server_label": server_label,
        "name": name,
        "arguments": call_arguments(call),
    }


def synthesized_events(
    response: dict[str, Any], items: list[dict[str, Any]]
) -> list[tuple[str, dict[str, Any]]]:
    """The SSE events of a complete response object: created, each item added and done, the
    terminal event its status names (``sequence_number`` is the writer's to set)."""
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": {**response, "status": "in_progress", "output": []}})
    ]
    for index, item in enumerate(items):
        events.append(("response.output_item.added", {"output_index": index, "item": item}))
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    events.append((terminal_event(response.get("status")), {"response": response}))
    return events


#: `upstream_body`'s default ``tool_choice``: the client's own, as it sent it.
CLIENT_CHOICE: Any = object()


def upstream_body(
    request: dict[str, Any],
    tools: list[Any],
    items: list[dict[str, Any]],
    rounds: int,
    *,
    keep_text: bool,
    tool_choice: Any = CLIENT_CHOICE,
    later_tool_choice: Any = "auto",
) -> bytes:
    """The JSON body of one inference call (DESIGN.md §6): the client's request with the
    gateway's `tools` (MCP tools as function tools), the items so far as ``input`` (the client's
    own string when `keep_text` and nothing was added), ``store: false`` and no
    ``previous_response_id`` / ``conversation`` / ``max_tool_calls`` (the gateway owns the
    history) nor ``background`` (the gateway runs background responses itself),
    ``reasoning.encrypted_content`` included, and ``tool_choice`` — on the first round
    `tool_choice` (default: the client's own; None leaves it out), after it `later_tool_choice`
    (``"auto"``; `middleware.loop.choice` gives both) — `rounds` is this call's number, from 1.
    Raises `UpstreamInvalid` when the items so far hold a number JSON cannot carry
    (`dumps_checked`)."""
    body = dict(request)
    if "tools" in body or tools:
        body["tools"] = tools
    raw_input = request.get("input")
    body["input"] = raw_input if isinstance(raw_input, str) and keep_text else items
    body["store"] = False
    for field in ("max_tool_calls", "previous_response_id", "conversation", "background"):
        body.pop(field, None)
    include = body.get("include")
    include = list(include) if isinstance(include, list) else []
    if "reasoning.encrypted_content" not in include:
        include.append("reasoning.encrypted_content")
    body["include"] = include
    if rounds > 1:
        body["tool_choice"] = later_tool_choice
    elif tool_choice is None:
        body.pop("tool_choice", None)
    elif tool_choice is not CLIENT_CHOICE:
        body["tool_choice"] = tool_choice
    return dumps_checked(body)


def final_response(
    terminal: dict[str, Any],
    *,
    response_id: str,
    request: dict[str, Any],
    items: list[dict[str, Any]],
    store: bool,
    restored: Restored,
    usage: dict[str, Any] | None,
    incomplete: str | None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """The client's response object: the last round's terminal response with the gateway's id,
    every round's visible `items`, the client's own ``tools`` (secrets null), ``tool_choice``,
    ``store``, ``background``, ``previous_response_id`` / ``conversation`` (from `restored`), the summed `usage`,
    and ``incomplete`` (a reason) when the loop ended incomplete (DESIGN.md §6); echo fields the
    upstream left out are filled from the request (`normalise_response`; ``created_at`` its)."""
    final = dict(terminal)
    final["id"] = response_id
    final["object"] = "response"
    final["output"] = items
    final["tools"] = public_tools(request.get("tools"))
    final["tool_choice"] = request.get("tool_choice", "auto")
    final["store"] = store
    final["background"] = request.get("background") is True  # never forwarded upstream
    final["background"] = request.get("background") is True  # never forwarded upstream
    final["previous_response_id"] = restored.previous_response_id
    if restored.conversation_id is not None:
        final["conversation"] = {"id": restored.conversation_id}
    if usage is not None:
        final["usage"] = usage
    if incomplete is not None:
        final["status"] = "incomplete"
        final["incomplete_details"] = {"reason": incomplete}
    elif final.get("status") in (None, "in_progress"):
        final["status"] = "completed"
    normalise_response(final, request, created_at=created_at)
    return final


SUMMARY_TEXT_LIMIT = 256  # characters: longer strings (instructions, ...) are left out of a summary
#: Fields a summary keeps at most, and the longest key it keeps (characters): a response object
#: has ~25 scalar fields; an upstream's thousands of extra ones are left out.
SUMMARY_FIELDS = 64
SUMMARY_KEY_LIMIT = 64


def response_summary(response: dict[str, Any]) -> dict[str, Any]:
    """The scalar fields of an upstream response object (``created_at``, ``model``,
    ``temperature``, ``truncation``, …; strings up to `SUMMARY_TEXT_LIMIT` characters, keys up to
    `SUMMARY_KEY_LIMIT`, the first `SUMMARY_FIELDS` of them), kept for the ``response.failed``
    event of a later failure: bounded by a constant (~150 KB at most: 64 keys of 64 characters
    and values of 256 characters or 4,300 digits, however the object was decoded), so keeping it
    needs no ledger charge (the object itself is forwarded and dropped)."""
    summary: dict[str, Any] = {}
    for key, value in response.items():
        if len(key) <= SUMMARY_KEY_LIMIT and (
            value is None
            or isinstance(value, bool | int | float)
            or (isinstance(value, str) and len(value) <= SUMMARY_TEXT_LIMIT)
        ):
            summary[key] = value
            if len(summary) == SUMMARY_FIELDS:
                break
    return summary
