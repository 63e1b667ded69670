"""`middleware.loop.lowering` (issue 18 item 2): what the gateway emitted, fed back as input in any
of the ways clients do, never reaches the upstream in a form a strict Responses server rejects
(`tests.strict_upstream.input_problems`: the Open Responses ``ItemParam`` schema plus call
pairing, unique call ids, reasoning followed by its item). Pure functions, hypothesis."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from middleware.errors import InvalidRequest
from middleware.loop.approvals import approval_id, check_call_pairs, pending_approvals
from middleware.loop.lowering import carries_gateway_items, drop_orphans, lower_history, lower_input
from middleware.tools.resolved import GatewayTool, ResolvedTools
from tests.strict_upstream import input_problems

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": False}


def resolved() -> ResolvedTools:
    tools = {
        "lookup": GatewayTool("tools", "lookup", "lookup", True),
        "calendar_get_time": GatewayTool("tools", "calendar.get_time", "calendar_get_time", True),
    }
    upstream = [
        {"type": "function", "name": name, "description": "", "parameters": SCHEMA, "strict": False}
        for name in tools
    ]
    return ResolvedTools(
        upstream_tools=upstream, list_items=[], gateway_tools=tools, endpoints={}, connect_timeout=1.0
    )


# --- what the gateway emits -------------------------------------------------------------------------

names = st.sampled_from([("tools", "lookup"), ("tools", "calendar.get_time")])


def _message(i: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{i}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "t", "annotations": []}],
    }


def _reasoning(i: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{i}", "summary": [], "encrypted_content": "e"}


def _mcp_call(i: str, tool: tuple[str, str], failed: bool, approval: bool) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "mcp_call",
        "id": f"mcp_{i}",
        "server_label": tool[0],
        "name": tool[1],
        "arguments": '{"q":"x"}',
        "output": None if failed else "out",
        "error": {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": "boom"}]}
        if failed
        else None,
        "status": "failed" if failed else "completed",
    }
    if approval:
        item["approval_request_id"] = approval_id(f"call_{i}")
    return item


def _approval(i: str, tool: tuple[str, str]) -> dict[str, Any]:
    return {
        "type": "mcp_approval_request",
        "id": approval_id(f"call_{i}"),
        "server_label": tool[0],
        "name": tool[1],
        "arguments": '{"q":"x"}',
    }


@st.composite
def gateway_output(draw: st.DrawFn, turn: int) -> list[dict[str, Any]]:
    """One response's ``output`` as the gateway builds it: an ``mcp_list_tools`` item, then rounds
    of visible items (reasoning, messages, client function calls) each followed by that round's
    ``mcp_call`` items, possibly ending in approval requests. Ids are unique, as the gateway's."""
    out: list[dict[str, Any]] = [
        {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "tools", "tools": []}
    ]
    for k in range(draw(st.integers(0, 4))):
        visible = draw(st.sampled_from(["reasoning", "message", "reasoning+message", "client_call", "none"]))
        i = f"{turn}_{k}"
        if visible.startswith("reasoning"):
            out.append(_reasoning(i))
        if visible.endswith("message"):
            out.append(_message(i))
        if visible == "client_call":
            out.append(
                {
                    "type": "function_call",
                    "id": f"fc_{i}",
                    "call_id": f"cc_{i}",
                    "name": "mine",
                    "arguments": "{}",
                }
            )
        for j in range(draw(st.integers(0, 2))):
            out.append(_mcp_call(f"{i}_{j}", draw(names), draw(st.booleans()), draw(st.booleans())))
    if draw(st.booleans()):
        i = f"{turn}_last"
        if draw(st.booleans()):
            out.append(_reasoning(i))
        out.append(_approval(i, draw(names)))
    return out


@st.composite
def fed_back(draw: st.DrawFn, first_turn: int = 0) -> list[dict[str, Any]]:
    """A client's next input: the history so far (easy or typed user messages, earlier outputs),
    outputs for its own calls, answers to some approval requests, and a new user message."""
    items: list[dict[str, Any]] = []
    for turn in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            items.append({"role": "user", "content": "hi"})
        else:
            items.append(
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
            )
        output = draw(gateway_output(first_turn + turn))
        items.extend(output)
        for item in output:
            if item["type"] == "function_call":
                items.append({"type": "function_call_output", "call_id": item["call_id"], "output": "mine"})
            if item["type"] == "mcp_approval_request" and draw(st.booleans()):
                answer = {
                    "type": "mcp_approval_response",
                    "approval_request_id": item["id"],
                    "approve": draw(st.booleans()),
                }
                items.append(answer)
    items.append({"role": "user", "content": "next"})
    return items


def settle(items: list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the loop sends on its first round: the history, the lowered input, an output for each
    settled approval (run or refused), orphans dropped; InvalidRequest raised as the loop would."""
    tools = resolved()
    lowered = lower_input(
        items,
        tools,
        known_calls=frozenset(i["call_id"] for i in history if i.get("type") == "function_call"),
        answered=frozenset(i["call_id"] for i in history if i.get("type") == "function_call_output"),
    )
    approvals = pending_approvals([*history, *lowered.pending], lowered.answers)
    check_call_pairs(history, lowered.items, {str(c["call_id"]) for c, _ in approvals})
    replay = [
        {"type": "function_call_output", "call_id": c["call_id"], "output": "settled"} for c, _ in approvals
    ]
    return drop_orphans([*history, *lowered.items, *replay])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fed_back())
def test_fed_back_output_reaches_the_upstream_in_strict_form(items: list[dict[str, Any]]) -> None:
    sent = settle(items, [])
    assert input_problems({"input": sent}) == [], json.dumps(sent)[:3000]
    assert not carries_gateway_items(sent)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fed_back(), fed_back(first_turn=10))
def test_stored_history_with_fed_back_items_is_strict_too(
    first: list[dict[str, Any]], second: list[dict[str, Any]]
) -> None:
    """A chain whose earlier request carried gateway items as its input (stored as sent) is
    restored in upstream form (`lower_history`), and the next input on top of it is too."""
    try:
        earlier = settle(first, [])
    except InvalidRequest:
        return
    # the stored rows: the input as the client sent it, then the replay (outputs of its approvals)
    lowered = lower_input(first, resolved())
    approvals = pending_approvals(lowered.pending, lowered.answers)
    stored = [
        *first,
        *(
            {"type": "function_call_output", "call_id": c["call_id"], "output": "settled"}
            for c, _ in approvals
        ),
    ]
    history = lower_history(stored)
    assert input_problems({"input": drop_orphans(history)}) == []
    assert [i for i in drop_orphans(history) if i.get("type") == "function_call_output"] == [
        i for i in earlier if i.get("type") == "function_call_output"
    ]
    try:
        sent = settle(second, history)
    except InvalidRequest:
        return
    assert input_problems({"input": sent}) == []


# --- the rules one by one ---------------------------------------------------------------------------


def test_an_unanswered_approval_request_and_the_list_carry_nothing() -> None:
    items = [
        {"type": "mcp_list_tools", "id": "l", "server_label": "tools", "tools": []},
        _reasoning("1"),
        _approval("1", ("tools", "lookup")),
    ]
    lowered = lower_input(items, resolved())
    assert lowered.items == [_reasoning("1")] and lowered.pending == []
    assert drop_orphans(lowered.items) == []


def test_a_stateless_approval_becomes_a_pending_call_under_the_requests_name() -> None:
    request = _approval("7", ("tools", "calendar.get_time"))
    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
    lowered = lower_input([request, answer], resolved())
    assert lowered.pending == [
        {"type": "function_call", "call_id": "call_7", "name": "calendar_get_time", "arguments": '{"q":"x"}'}
    ]
    assert lowered.items == lowered.pending and lowered.answers == [answer]


def test_history_never_runs_an_approval() -> None:
    request = _approval("8", ("tools", "lookup"))
    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
    assert lower_history([request, answer]) == []


@pytest.mark.parametrize(
    ("arguments", "match", "code"),
    [
        ('{"q":1}', "not of type", "invalid_value"),
        ('{"z":"x"}', "Additional properties", "invalid_value"),
        ("nope", "JSON object", "invalid_value"),
        ('{"q":"x","q":"y"}', 'duplicate key "q"', "duplicate_key"),
        ('{"q":"x","\\u0071":"y"}', 'duplicate key "q"', "duplicate_key"),  # equal once unescaped
        ('{"q":"\\ud800"}', "surrogate", "invalid_unicode"),
    ],
)
def test_stateless_approval_arguments_are_checked_against_the_schema(
    arguments: str, match: str, code: str
) -> None:
    message = {"type": "message", "role": "user", "content": "first"}
    request = {**_approval("9", ("tools", "lookup")), "arguments": arguments}
    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
    with pytest.raises(InvalidRequest, match=match) as info:
        lower_input([message, request, answer], resolved())
    assert (info.value.param, info.value.code) == ("input[1].arguments", code)


def test_hostile_field_types_do_not_crash() -> None:
    odd: list[dict[str, Any]] = [
        {"type": ["mcp_call"]},
        {"type": "mcp_call", "id": ["x"], "approval_request_id": {"a": 1}, "output": 5, "error": [1]},
        {"type": "mcp_approval_response", "approval_request_id": ["x"]},
        {"type": "function_call_output", "call_id": ["x"]},
        {"type": "reasoning"},
    ]
    lowered = lower_input(odd, resolved())
    assert [i.get("type") for i in lowered.items][:1] == [["mcp_call"]]
    assert not carries_gateway_items([{"type": ["mcp_call"]}])
