"""Restoring a request's stored history and checking its tool-call pairing (DESIGN.md §7, case B03).

`restore_history` admits the size of a ``previous_response_id`` chain or a ``conversation``
(summed in SQL, `Ledger.admit_history_size`) before any row is decoded, then loads the items the
upstream must see. `check_call_pairs` refuses, before any upstream call, a request whose history
plus new input would leave a function call without its output or an output without its call.
`pending_approvals` resolves ``mcp_approval_response`` items against the stored
``mcp_approval_request``s (whose ids are ``mcpr_`` + the pending call's ``call_id``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from budget import BudgetExceeded, Ledger
from middleware.errors import GatewayError, InvalidRequest
from middleware.store.store import CONTINUABLE_STATUSES, Store

# Client-visible item types that the upstream never sees (their upstream form is in the replay).
NOT_REPLAYED = frozenset({"mcp_approval_request", "mcp_approval_response", "mcp_list_tools", "mcp_call"})
APPROVAL_PREFIX = "mcpr_"


def approval_id(call_id: str) -> str:
    """The ``mcp_approval_request`` id of a pending gateway call (derived, so no extra state)."""
    return APPROVAL_PREFIX + call_id


def _not_found(what: str, value: str, param: str) -> GatewayError:
    return GatewayError(
        f"{what} {value!r} not found (it may belong to another API key, or have been deleted)",
        status=404,
        code="not_found",
        param=param,
        retryable=False,
    )


def _history_too_large(exc: BudgetExceeded, param: str) -> GatewayError:
    return GatewayError(
        f"the stored history named by {param} is too large for this request's budget: {exc}",
        status=413,
        code="max_retained_bytes_exceeded",
        param=param,
        retryable=False,
        limit="max_retained_bytes",
    )


@dataclasses.dataclass(frozen=True)
class Restored:
    """The history to send upstream before the new input, and where it came from."""

    items: list[dict[str, Any]]
    previous_response_id: str | None = None
    conversation_id: str | None = None


def conversation_id_of(value: Any) -> str | None:
    """The id of a request's ``conversation`` field (a string or ``{"id": ...}``); 400 otherwise."""
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and isinstance(value.get("id"), str) and value["id"]:
        return str(value["id"])
    raise InvalidRequest(
        'conversation must be a conversation id or {"id": ...}', code="invalid_value", param="conversation"
    )


async def restore_history(request: dict[str, Any], store: Store, owner: str, ledger: Ledger) -> Restored:
    """Admit and load the history of ``previous_response_id`` or ``conversation``.

    Raises 400 (both given; not continuable; a deleted link), 404 (unknown or another owner's),
    413 ``max_retained_bytes_exceeded`` (the history does not fit; nothing was decoded).
    """
    previous = request.get("previous_response_id")
    conversation = conversation_id_of(request.get("conversation"))
    if previous is not None and conversation is not None:
        raise InvalidRequest(
            "previous_response_id and conversation cannot both be set; continue one or the other",
            code="invalid_request",
            param="previous_response_id",
        )
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise InvalidRequest(
                "previous_response_id must be a response id",
                code="invalid_value",
                param="previous_response_id",
            )
        info = await store.chain_size(previous, owner)
        if info is None:
            raise _not_found("previous response", previous, "previous_response_id")
        if info.head_status not in CONTINUABLE_STATUSES:
            raise InvalidRequest(
                f"response {previous!r} is {info.head_status}; only completed or incomplete responses can be continued",
                code="invalid_request",
                param="previous_response_id",
            )
        if info.missing_id is not None:
            raise InvalidRequest(
                f"response {info.missing_id!r}, earlier in the chain of {previous!r}, was deleted; "
                "the history cannot be restored",
                code="invalid_request",
                param="previous_response_id",
            )
        try:
            ledger.admit_history_size(info.size_bytes, info.node_count)
        except BudgetExceeded as exc:
            raise _history_too_large(exc, "previous_response_id") from None
        items = await store.load_chain(previous, owner)
        return Restored(
            [i for i in items if i.get("type") not in NOT_REPLAYED], previous_response_id=previous
        )
    if conversation is not None:
        cinfo = await store.conversation_size(conversation, owner)
        if cinfo is None:
            raise _not_found("conversation", conversation, "conversation")
        try:
            ledger.admit_history_size(cinfo.size_bytes, cinfo.node_count)
        except BudgetExceeded as exc:
            raise _history_too_large(exc, "conversation") from None
        items = await store.load_conversation(conversation, owner, through_seq=cinfo.through_seq)
        return Restored([i for i in items if i.get("type") not in NOT_REPLAYED], conversation_id=conversation)
    return Restored([])


def pending_approvals(
    history: Sequence[dict[str, Any]], new_input: Sequence[dict[str, Any]]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(stored pending function_call, its ``mcp_approval_response``) for each approval answered.

    Raises 400 naming an ``approval_request_id`` that matches no pending call of the history.
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

    Raises 400 ``param: "input"`` naming the first ``call_id`` at fault.
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
