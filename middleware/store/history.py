"""Restoring a request's stored history (DESIGN.md §7): `restore_history`.

`restore_history` admits the size of a ``previous_response_id`` chain or a ``conversation``
(summed in SQL, `Ledger.admit_history_size`) before any row is decoded, then loads the items the
upstream must see, lowered to upstream form (`middleware.loop.lowering.lower_history`: the
`NOT_REPLAYED` types are the client's view; an ``mcp_call`` a client sent as input becomes its
call/output pair). Checking the new input against that history (approvals, call pairing) is
`middleware.loop.approvals`. `resolve_references` replaces a request's ``item_reference`` input
items by the caller's stored items (case B37: the upstream, sent ``store: false``, holds none).

Raises failures (`middleware.errors`), answered by `middleware.outcomes`: `InvalidRequest` (both
fields given, a malformed id, a head that cannot be continued, a deleted link), `NotFound`
(unknown or another owner's), `HistoryTooLarge` (the history does not fit the ledger).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from budget import BudgetExceeded, Ledger
from middleware.errors import HistoryTooLarge, InvalidRequest, NotFound
from middleware.loop.lowering import lower_history
from middleware.store.store import CONTINUABLE_STATUSES, ChainInfo, Store

__all__ = ["NOT_REPLAYED", "Restored", "conversation_id_of", "resolve_references", "restore_history"]

#: Client-visible item types that the upstream never sees (their upstream form is in the replay).
NOT_REPLAYED = frozenset({"mcp_approval_request", "mcp_approval_response", "mcp_list_tools", "mcp_call"})


@dataclasses.dataclass(frozen=True)
class Restored:
    """The history to send upstream before the new input, and where it came from."""

    items: list[dict[str, Any]]
    previous_response_id: str | None = None
    conversation_id: str | None = None


def conversation_id_of(value: Any) -> str | None:
    """The id of a request's ``conversation`` field (a string or ``{"id": ...}``); `InvalidRequest`
    otherwise."""
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

    Raises `InvalidRequest` (both given; not continuable; a deleted link), `NotFound` (unknown or
    another owner's), `HistoryTooLarge` (the history does not fit; nothing was decoded).
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
            raise NotFound(
                f"previous response {previous!r} not found (it may belong to another API key, or have been deleted)",
                param="previous_response_id",
            )
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
        _admit(ledger, info, "previous_response_id")
        items = await store.load_chain(previous, owner)
        return Restored(lower_history(items), previous_response_id=previous)
    if conversation is not None:
        cinfo = await store.conversation_size(conversation, owner)
        if cinfo is None:
            raise NotFound(
                f"conversation {conversation!r} not found (it may belong to another API key, or have been deleted)",
                param="conversation",
            )
        _admit(ledger, cinfo, "conversation")
        items = await store.load_conversation(conversation, owner, through_seq=cinfo.through_seq)
        return Restored(lower_history(items), conversation_id=conversation)
    return Restored([])


def _admit(ledger: Ledger, info: ChainInfo, param: str) -> None:
    """Charge the history's size summed in SQL (`Ledger.admit_history_size`) before any row is
    decoded; `HistoryTooLarge` naming ``param`` when it does not fit."""
    try:
        ledger.admit_history_size(info.size_bytes, info.node_count)
    except BudgetExceeded as exc:
        raise HistoryTooLarge(
            f"the stored {'item referenced in' if param == 'input' else 'history named by'} {param} is too "
            f"large for this request's budget: {exc}",
            param=param,
            requested=exc.requested,
            charged=exc.charged,
            limit=exc.limit,
        ) from None


async def resolve_references(
    items: list[dict[str, Any]], store: Store | None, owner: str, ledger: Ledger
) -> list[dict[str, Any]]:
    """`items` with each ``{"type": "item_reference", "id"}`` replaced by the item `owner`
    stored under that id (`Store.find_item`: a client-visible form first), its stored size
    admitted (``Ledger.admit_history_size``) before it is decoded; other items unchanged.

    Raises `InvalidRequest` (``param: "input"``) naming an id that is not a string, unknown, or
    another caller's, or when the gateway has no store; `HistoryTooLarge` (``param: "input"``)
    when a referenced item does not fit the ledger.
    """
    if not any(i.get("type") == "item_reference" for i in items):
        return items
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if item.get("type") != "item_reference":
            out.append(item)
            continue
        ref = item.get("id")
        if not isinstance(ref, str) or not ref:
            raise InvalidRequest(
                f"input[{index}] is an item_reference without a string id",
                code="invalid_value",
                param="input",
            )
        if store is None:
            raise InvalidRequest(
                f"input[{index}] references item {ref[:100]!r}, but this gateway runs without a store; "
                "send the item itself instead of an item_reference",
                code="invalid_value",
                param="input",
            )
        found = await store.find_item(ref, owner)
        stored = None
        if found is not None:
            _admit(ledger, ChainInfo(found.size_bytes, found.node_count, 1, 0, None), "input")
            stored = await store.load_item(found)
        if stored is None:
            raise InvalidRequest(
                f"input[{index}] references item {ref[:100]!r}, which is not stored for this API key "
                "(unknown, deleted, or another caller's); send the item itself, or reference an item "
                "of a stored response",
                code="invalid_value",
                param="input",
            )
        out.append(stored)
    return out
