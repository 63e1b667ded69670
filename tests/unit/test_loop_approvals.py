"""`middleware.loop.approvals`: answering pending approvals and checking call pairs (case B03, B05)
against a restored history, before any upstream call. Pure functions: no server."""

from __future__ import annotations

from typing import Any

import pytest

from middleware.errors import InvalidRequest
from middleware.loop.approvals import APPROVAL_PREFIX, approval_id, check_call_pairs, pending_approvals

CALL = {"type": "function_call", "call_id": "call_1", "name": "crm__lookup", "arguments": "{}"}
HISTORY: list[dict[str, Any]] = [{"role": "user", "content": "look it up"}, CALL]


def approval(request_id: str, approve: object = True) -> dict[str, Any]:
    return {"type": "mcp_approval_response", "approval_request_id": request_id, "approve": approve}


def test_an_approval_settles_its_pending_call() -> None:
    assert approval_id("call_1") == APPROVAL_PREFIX + "call_1" == "mcpr_call_1"
    answer = approval(approval_id("call_1"))
    assert pending_approvals(HISTORY, [answer]) == [(CALL, answer)]
    check_call_pairs(HISTORY, [], {"call_1"})  # the approved call counts as answered


@pytest.mark.parametrize(
    ("new_input", "code"),
    [
        ([approval("mcpr_call_9")], "invalid_value"),  # no such pending call
        ([approval("call_1")], "invalid_value"),  # not an approval request id
        ([approval("mcpr_call_1"), approval("mcpr_call_1")], "invalid_value"),  # answered twice
        ([approval("mcpr_call_1", approve="yes")], "invalid_type"),
    ],
)
def test_bad_approvals_are_refused(new_input: list[dict[str, Any]], code: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        pending_approvals(HISTORY, new_input)
    assert (info.value.code, info.value.param) == (code, "input")


def test_an_answered_call_is_no_longer_pending() -> None:
    output = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
    with pytest.raises(InvalidRequest, match="no pending approval request"):
        pending_approvals([*HISTORY, output], [approval("mcpr_call_1")])


@pytest.mark.parametrize(
    ("new_input", "code", "match"),
    [
        ([], "invalid_value", "no tool output found for function call 'call_1'"),
        (
            [{"type": "function_call_output", "call_id": "call_2", "output": ""}],
            "invalid_value",
            "no function call",
        ),
        ([{"type": "function_call_output", "call_id": 5, "output": ""}], "invalid_type", "string call_id"),
        (
            [{"type": "function_call_output", "call_id": "call_1", "output": ""}] * 2,
            "invalid_value",
            "more than one function_call_output",
        ),
    ],
)
def test_call_pairs_are_checked(new_input: list[dict[str, Any]], code: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        check_call_pairs(HISTORY, new_input, set())
    assert (info.value.code, info.value.param) == (code, "input")


def test_complete_pairs_pass() -> None:
    check_call_pairs(HISTORY, [{"type": "function_call_output", "call_id": "call_1", "output": "ok"}], set())
