"""`restore_history` (DESIGN.md §7) raises failures, and the outcome table answers them (§5):
404 ``not_found`` / 400 / 413 ``max_retained_bytes_exceeded`` with ``param`` naming the field,
``x-should-retry: false``, and the request id in the message. Runs on the in-memory store.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import middleware.store.store as store_module
from budget import Ledger
from middleware import outcomes
from middleware.errors import HistoryTooLarge, InvalidRequest, NotFound
from middleware.ops.request_id import REQUEST_ID
from middleware.store.history import NOT_REPLAYED, restore_history
from middleware.store.store import Store, StoredResponse, open_store

LARGE = 1 << 30


def stored(rid: str, *, status: str = "completed", previous: str | None = None) -> StoredResponse:
    obj = {"id": rid, "object": "response", "status": status, "output": []}
    return StoredResponse(rid, "alice", 1_700_000_000, status, "m", previous, None, obj, {})


ITEMS: list[dict[str, Any]] = [
    {"role": "user", "content": "x" * 2000},
    {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "s", "tools": []},
]


def with_store(body: Callable[[Store], Awaitable[None]]) -> None:
    async def main() -> None:
        async with open_store("memory") as store:
            await body(store)

    asyncio.run(main())


def answer(exc: BaseException) -> tuple[int, dict[str, str], dict[str, Any]]:
    """The JSON answer of the outcome table: status, headers, the envelope's ``error``."""
    status, headers, body = outcomes.render_json(outcomes.resolve(exc))
    return status, {k.decode(): v.decode() for k, v in headers}, json.loads(body)["error"]


def test_a_fitting_chain_is_restored_without_client_only_items() -> None:
    async def body(store: Store) -> None:
        await store.save_response(stored("resp_1"), input_items=ITEMS, output_items=[], replay_items=[])
        restored = await restore_history({"previous_response_id": "resp_1"}, store, "alice", Ledger(LARGE))
        assert restored.previous_response_id == "resp_1"
        # the easy message typed (Open Responses ItemParam), the list dropped (issue 18 item 2)
        assert restored.items == [{"type": "message", **ITEMS[0]}] and ITEMS[1]["type"] in NOT_REPLAYED

    with_store(body)


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"conversation": "conv_nope"}, "conversation"),
    ],
)
def test_unknown_or_foreign_history_is_not_found(request_fields: dict[str, Any], param: str) -> None:
    async def body(store: Store) -> None:
        with pytest.raises(NotFound) as info:
            await restore_history(request_fields, store, "alice", Ledger(LARGE))
        assert info.value.param == param
        status, headers, error = answer(info.value)
        assert (status, error["code"], error["param"], error["type"]) == (
            404,
            "not_found",
            param,
            "invalid_request_error",
        )
        assert "not found" in error["message"] and headers["x-should-retry"] == "false"

    with_store(body)


@pytest.mark.parametrize("via", ["previous_response_id", "conversation"])
def test_history_over_the_ledger_is_413_and_nothing_is_decoded(
    via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(store: Store) -> None:
        if via == "conversation":
            key = (await store.create_conversation("alice", items=ITEMS))["id"]
        else:
            key = "resp_1"
            await store.save_response(stored(key), input_items=ITEMS, output_items=[], replay_items=[])
        decoded: list[str] = []
        monkeypatch.setattr(store_module, "_loads", lambda text: decoded.append(text))
        ledger = Ledger(10_000)
        with pytest.raises(HistoryTooLarge) as info:
            await restore_history({via: key}, store, "alice", ledger)
        assert decoded == [] and ledger.charged == 0
        failure = info.value
        assert failure.param == via and failure.message.startswith(
            f"the stored history named by {via} is too large"
        )
        assert failure.facts["limit"] == 10_000 and failure.facts["charged"] == 0
        assert isinstance(failure.facts["requested"], int) and failure.facts["requested"] > 10_000
        outcome = outcomes.resolve(failure)
        assert outcome.cap == "max_retained_bytes"
        status, headers, error = answer(failure)
        assert (status, error["code"], error["param"]) == (413, "max_retained_bytes_exceeded", via)
        assert headers["x-should-retry"] == "false"

    with_store(body)


@pytest.mark.parametrize(
    ("request_fields", "code", "param"),
    [
        (
            {"previous_response_id": "resp_1", "conversation": "conv_1"},
            "invalid_request",
            "previous_response_id",
        ),
        ({"previous_response_id": 7}, "invalid_value", "previous_response_id"),
        ({"conversation": {"id": ""}}, "invalid_value", "conversation"),
        ({"previous_response_id": "resp_failed"}, "invalid_request", "previous_response_id"),
        ({"previous_response_id": "resp_orphan"}, "invalid_request", "previous_response_id"),
    ],
)
def test_invalid_continuations_are_400(request_fields: dict[str, Any], code: str, param: str) -> None:
    async def body(store: Store) -> None:
        for row in (stored("resp_failed", status="failed"), stored("resp_orphan", previous="resp_deleted")):
            await store.save_response(row, input_items=[], output_items=[], replay_items=[])
        with pytest.raises(InvalidRequest) as info:
            await restore_history(request_fields, store, "alice", Ledger(LARGE))
        status, headers, error = answer(info.value)
        assert (status, error["code"], error["param"]) == (400, code, param)
        assert headers["x-should-retry"] == "false"

    with_store(body)


def test_the_outcome_names_the_request_id() -> None:
    token = REQUEST_ID.set("req_history_test")
    try:
        _, _, error = answer(NotFound("conversation 'c' not found", param="conversation"))
    finally:
        REQUEST_ID.reset(token)
    assert error["message"] == "conversation 'c' not found [request id req_history_test]"
