"""Settling a request's new input against its restored history, before any upstream call.

`pending_approvals` resolves each ``mcp_approval_response`` of the new input against the
history's pending gateway calls (an ``mcp_approval_request`` id is `APPROVAL_PREFIX` + the pending
call's ``call_id``, `approval_id`, so no extra state is stored). `check_call_pairs` then refuses a
request whose history plus new input would leave a function call without exactly one answer (an
output, or an approval) or an output without its call (case B03). Both raise
`middleware.errors.InvalidRequest` with ``param: "input"`` (`middleware.outcomes` answers it).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from middleware.errors import InvalidRequest
from middleware.tools.resolved import ResolvedTools

__all__ = ["APPROVAL_PREFIX", "approval_id", "check_call_pairs", "pending_approvals"]

#: Prefix of the ``mcp_approval_request`` id derived from a pending call's ``call_id``.
APPROVAL_PREFIX = "mcpr_"


def approval_id(call_id: str) -> str:
    """The ``mcp_approval_request`` id of a pending gateway call (derived, so no extra state)."""
    return APPROVAL_PREFIX + call_id


def pending_approvals(
    history: Sequence[dict[str, Any]], new_input: Sequence[dict[str, Any]]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(stored pending function_call, its ``mcp_approval_response``) for each approval answered.

    Raises `InvalidRequest` naming an ``approval_request_id`` answered twice or matching no
    pending call of the history, or an ``approve`` that is not a boolean.
    """
    calls = {
        item.get("call_id"): item
        for item in history
        if item.get("type") == "function_call" and isinstance(item.get("call_id"), str)
    }
    answered = {
        item.get("call_id")
        for item in history
        if item.get("type") == "function_call_output" and isinstance(item.get("call_id"), str)
    }
    out = []
    seen: set[str] = set()
    for item in new_input:
        if item.get("type") != "mcp_approval_response":
            continue
        rid = item.get("approval_request_id")
        if isinstance(rid, str) and rid in seen:
            raise InvalidRequest(
                f"approval request {rid!r} is answered twice; send one mcp_approval_response per request",
                code="invalid_value",
                param="input",
            )
        if isinstance(rid, str):
            seen.add(rid)
        call_id = (
            rid[len(APPROVAL_PREFIX) :] if isinstance(rid, str) and rid.startswith(APPROVAL_PREFIX) else None
        )
        if call_id is None or call_id not in calls or call_id in answered:
            raise InvalidRequest(
                f"no pending approval request {rid!r} in the history; answer an mcp_approval_request of the "
                "previous response",
                code="invalid_value",
                param="input",
            )
        if not isinstance(item.get("approve"), bool):
            raise InvalidRequest(
                "mcp_approval_response.approve must be true or false", code="invalid_type", param="input"
            )
        out.append((calls[call_id], item))
    return out


def check_call_pairs(
    history: Sequence[dict[str, Any]], new_input: Sequence[dict[str, Any]], approved_call_ids: set[str]
) -> None:
    """Every function call has exactly one output and every output a call (case B03).

    Raises `InvalidRequest` (``param: "input"``) naming the first ``call_id`` at fault.
    """
    items = [*history, *new_input]
    for item in new_input:
        if item.get("type") in ("function_call", "function_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(
                    f"every {item.get('type')} needs a string call_id, got {str(call_id)[:100]!r}",
                    code="invalid_type",
                    param="input",
                )
    calls = [
        item.get("call_id")
        for item in items
        if item.get("type") == "function_call" and isinstance(item.get("call_id"), str)
    ]
    outputs = [
        item.get("call_id")
        for item in items
        if item.get("type") == "function_call_output" and isinstance(item.get("call_id"), str)
    ]
    known = set(calls)
    for call_id, count in collections.Counter(outputs).items():
        if count == 1:
            continue
        raise InvalidRequest(
            f"the function call {call_id!r} has more than one function_call_output; send exactly one",
            code="invalid_value",
            param="input",
        )
    for call_id in outputs:
        if call_id not in known:
            raise InvalidRequest(
                f"no function call found for the function_call_output with call_id {call_id!r}; "
                "send outputs only for calls of the previous response or of this input",
                code="invalid_value",
                param="input",
            )
    answered = set(outputs) | approved_call_ids
    for call_id in calls:
        if call_id not in answered:
            raise InvalidRequest(
                f"no tool output found for function call {call_id!r}; send a function_call_output with "
                f"call_id {call_id!r} in the input",
                code="invalid_value",
                param="input",
            )


def check_approvals(
    approvals: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    resolved: ResolvedTools,
    max_tool_calls: int | None,
) -> list[dict[str, Any]]:
    """The approved calls of `approvals` (from `pending_approvals`), after checking that each is
    for a gateway tool this request declares and that they fit ``max_tool_calls``.

    Raises `InvalidRequest` (``param`` ``tools`` / ``max_tool_calls``) before anything runs.
    """
    for call, _ in approvals:
        if resolved.gateway_tool(str(call.get("name"))) is None:
            raise InvalidRequest(
                f"the approved call {call.get('call_id')!r} is for tool {str(call.get('name'))[:100]!r}, which this "
                "request's tools do not declare; resend the mcp tool with the approval",
                code="invalid_value",
                param="tools",
            )
    approved = [call for call, answer in approvals if answer.get("approve") is True]
    if max_tool_calls is not None and len(approved) > max_tool_calls:
        raise InvalidRequest(
            f"{len(approved)} approved tool calls exceed this request's max_tool_calls={max_tool_calls}; "
            "approve fewer calls or raise max_tool_calls",
            code="invalid_value",
            param="max_tool_calls",
        )
    return approved
