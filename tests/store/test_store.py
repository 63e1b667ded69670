"""The store (issue 6, DESIGN.md §7): one suite, run against SQLite in memory, a SQLite file and a
real PostgreSQL server (one throwaway server per test session, a fresh schema per test).

PostgreSQL missing is a FAILURE, not a skip: run `bash scripts/ensure-postgres.sh`.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import re
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import middleware.store.store as store_module
from budget import count_json_nodes
from middleware.store.backends import single
from middleware.store.store import (
    ChainInfo,
    ConversationNotFound,
    DuplicateId,
    SchemaTooNew,
    Store,
    StoredResponse,
    UnknownCursor,
    encode_json,
    open_store,
)
from tests.pg import PgServer, PostgresMissing, running_postgres

BACKENDS = ["memory", "sqlite", "postgresql"]


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL for an empty database of each backend."""
    if request.param == "memory":
        return "memory"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/nested/dir/store.db"
    server: PgServer = request.getfixturevalue("pg_server")
    return server.create_schema(f"t_{uuid.uuid4().hex[:16]}")


def run_with_store(url: str, body: Callable[[Store], Awaitable[None]]) -> None:
    async def main() -> None:
        async with open_store(url) as store:
            await body(store)

    asyncio.run(main())


async def raw_rows(store: Store, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    return await store.backend.run(single(sql, params), write=False)


def response(
    rid: str,
    *,
    owner: str = "alice",
    previous: str | None = None,
    conversation: str | None = None,
    status: str = "completed",
    request: dict[str, Any] | None = None,
) -> StoredResponse:
    return StoredResponse(
        id=rid,
        owner=owner,
        created_at=1_700_000_000,
        status=status,
        model="gpt-test",
        previous_response_id=previous,
        conversation_id=conversation,
        response={
            "id": rid,
            "object": "response",
            "status": status,
            "model": "gpt-test",
            "output": [],
            "usage": {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8},
            "error": None,
        },
        request=request if request is not None else {"instructions": "be brief", "tool_choice": "auto"},
    )


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def turn(n: int, inputs: int = 2) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Input, output (client view) and replay (upstream view) items of round ``n``: a gateway MCP
    call shown as ``mcp_call``, replayed as its function call / output pair."""
    inp = [user(f"q{n}.{k}") for k in range(inputs)]
    out: list[dict[str, Any]] = [
        {
            "type": "mcp_call",
            "id": f"mcp_{n}",
            "server_label": "tools",
            "name": "now",
            "arguments": "{}",
            "output": "12:00",
        },
        {
            "type": "message",
            "id": f"msg_{n}",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"a{n}"}],
        },
    ]
    rep: list[dict[str, Any]] = [
        {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": f"call_{n}", "output": "12:00"},
        out[1],
    ]
    return inp, out, rep


def sizes(items: list[dict[str, Any]]) -> tuple[int, int]:
    data = [encode_json(item).encode("utf-8") for item in items]
    return sum(len(d) for d in data), sum(count_json_nodes(d) for d in data)


# --- responses ---------------------------------------------------------------------------------


def test_save_get_delete(store_url: str) -> None:
    async def body(store: Store) -> None:
        inp, out, rep = turn(1)
        saved = response("resp_1")
        await store.save_response(saved, input_items=inp, output_items=out, replay_items=rep)
        got = await store.get_response("resp_1", "alice")
        assert got == saved
        assert got.response == saved.response and got.request == saved.request
        assert await store.get_response("resp_nope", "alice") is None
        usage = await raw_rows(store, "SELECT usage, error, status FROM responses WHERE id = ?", ("resp_1",))
        assert usage == [('{"input_tokens":3,"output_tokens":5,"total_tokens":8}', None, "completed")]

        assert await store.delete_response("resp_1", "alice") is True
        assert await store.get_response("resp_1", "alice") is None
        assert await store.delete_response("resp_1", "alice") is False
        assert await raw_rows(store, "SELECT COUNT(*) FROM items WHERE response_id = ?", ("resp_1",)) == [
            (0,)
        ]

    run_with_store(store_url, body)


def test_failed_status_keeps_its_error_and_bad_status_is_refused(store_url: str) -> None:
    async def body(store: Store) -> None:
        failed = response("resp_f", status="failed")
        failed.response["error"] = {"code": "server_error", "message": "boom"}
        await store.save_response(failed, input_items=[user("x")], output_items=[], replay_items=[])
        rows = await raw_rows(store, "SELECT status, error FROM responses WHERE id = ?", ("resp_f",))
        assert rows == [("failed", '{"code":"server_error","message":"boom"}')]
        info = await store.chain_size("resp_f", "alice")
        assert info is not None and info.head_status == "failed"
        with pytest.raises(ValueError, match="status must be one of"):
            await store.save_response(
                response("resp_x", status="done"), input_items=[], output_items=[], replay_items=[]
            )

    run_with_store(store_url, body)


def test_duplicate_id_and_failed_save_store_nothing(store_url: str) -> None:
    async def body(store: Store) -> None:
        inp, out, rep = turn(1)
        await store.save_response(response("resp_1"), input_items=inp, output_items=out, replay_items=rep)
        with pytest.raises(DuplicateId):
            await store.save_response(
                response("resp_1"), input_items=[user("again")], output_items=[], replay_items=[]
            )
        assert await store.load_chain("resp_1", "alice") == inp + rep  # the first one, intact

        # The conversation is gone: the whole transaction rolls back, the response is not stored.
        with pytest.raises(ConversationNotFound):
            await store.save_response(
                response("resp_2", conversation="conv_gone"),
                input_items=inp,
                output_items=out,
                replay_items=rep,
            )
        assert await store.get_response("resp_2", "alice") is None
        assert await raw_rows(store, "SELECT COUNT(*) FROM items WHERE response_id = ?", ("resp_2",)) == [
            (0,)
        ]
        # The store is still usable after both failures.
        await store.save_response(
            response("resp_3"), input_items=[user("ok")], output_items=[], replay_items=[]
        )

    run_with_store(store_url, body)


def test_owner_isolation(store_url: str) -> None:
    async def body(store: Store) -> None:
        inp, out, rep = turn(1)
        await store.save_response(response("resp_1"), input_items=inp, output_items=out, replay_items=rep)
        conv = await store.create_conversation("alice", items=[user("hi")], metadata={"k": "v"})
        cid = conv["id"]
        # A chain link of another owner is not followed either.
        await store.save_response(
            response("resp_m", owner="mallory", previous="resp_1"),
            input_items=[user("x")],
            output_items=[],
            replay_items=[],
        )

        assert await store.get_response("resp_1", "mallory") is None
        assert await store.chain_size("resp_1", "mallory") is None
        assert await store.load_chain("resp_1", "mallory") == []
        assert await store.list_input_items("resp_1", "mallory") is None
        assert await store.delete_response("resp_1", "mallory") is False
        info = await store.chain_size("resp_m", "mallory")
        assert info is not None and info.length == 1 and info.missing_id == "resp_1"
        assert await store.load_chain("resp_m", "mallory") == [user("x")]

        assert await store.get_conversation(cid, "mallory") is None
        assert await store.list_conversation_items(cid, "mallory") is None
        assert await store.add_conversation_items(cid, "mallory", [user("sneak")]) is None
        assert await store.conversation_size(cid, "mallory") is None
        assert await store.load_conversation(cid, "mallory") == []
        assert await store.delete_conversation(cid, "mallory") is False
        with pytest.raises(ConversationNotFound):
            await store.save_response(
                response("resp_m2", owner="mallory", conversation=cid),
                input_items=[],
                output_items=[],
                replay_items=[],
            )

        # Alice still has everything, untouched.
        assert await store.get_response("resp_1", "alice") is not None
        assert await store.load_conversation(cid, "alice") == [user("hi")]

    run_with_store(store_url, body)


# --- chains ------------------------------------------------------------------------------------


def test_chain_restore_order_over_three_responses(store_url: str) -> None:
    async def body(store: Store) -> None:
        turns = [turn(1, inputs=12), turn(2), turn(3, inputs=1)]  # 12 inputs: seq 10 sorts after 9
        previous = None
        for n, (inp, out, rep) in enumerate(turns, start=1):
            await store.save_response(
                response(f"resp_{n}", previous=previous), input_items=inp, output_items=out, replay_items=rep
            )
            previous = f"resp_{n}"
        # A sibling branch from resp_1 must not leak into resp_3's chain.
        await store.save_response(
            response("resp_2b", previous="resp_1"),
            input_items=[user("branch")],
            output_items=[],
            replay_items=[],
        )

        expected = [item for inp, _, rep in turns for item in inp + rep]
        assert await store.load_chain("resp_3", "alice") == expected
        first_two = [item for inp, _, rep in turns[:2] for item in inp + rep]
        assert await store.load_chain("resp_2", "alice") == first_two
        assert await store.load_chain("resp_2b", "alice") == turns[0][0] + turns[0][2] + [user("branch")]
        assert await store.load_chain("resp_nope", "alice") == []

    run_with_store(store_url, body)


def test_chain_size_sums_stored_sizes_and_decodes_nothing(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(store: Store) -> None:
        turns = [turn(1), turn(2, inputs=5), turn(3)]
        turns[1][0].append({"role": "user", "content": "ünïcödé ✓ — 字"})  # sizes are UTF-8 bytes
        previous = None
        for n, (inp, out, rep) in enumerate(turns, start=1):
            await store.save_response(
                response(f"resp_{n}", previous=previous, status="incomplete" if n == 3 else "completed"),
                input_items=inp,
                output_items=out,
                replay_items=rep,
            )
            previous = f"resp_{n}"
        restored = [item for inp, _, rep in turns for item in inp + rep]
        nbytes, nodes = sizes(restored)
        stored = await raw_rows(
            store,
            "SELECT SUM(size_bytes), SUM(node_count) FROM items WHERE role IN ('input', 'replay')",
        )
        assert (int(stored[0][0]), int(stored[0][1])) == (nbytes, nodes)

        statements: list[str] = []
        store.backend.on_statement = statements.append

        def no_decoding(*args: object, **kwargs: object) -> object:
            raise AssertionError("chain_size decoded a stored JSON value")

        with monkeypatch.context() as patch:
            patch.setattr(store_module, "_loads", no_decoding)
            info = await store.chain_size("resp_3", "alice")
        store.backend.on_statement = None
        assert info == ChainInfo(
            size_bytes=nbytes, node_count=nodes, item_count=len(restored), length=3, head_status="incomplete"
        )
        assert statements, "no statement was recorded"
        assert not [sql for sql in statements if re.search(r"\bitem\b", sql)], (
            "a statement read the item column"
        )

        # What load_chain then decodes is exactly what was measured.
        assert sizes(await store.load_chain("resp_3", "alice")) == (nbytes, nodes)

        # A deleted link: the chain is reported broken where it breaks.
        assert await store.delete_response("resp_2", "alice")
        broken = await store.chain_size("resp_3", "alice")
        assert broken is not None and broken.length == 1 and broken.missing_id == "resp_2"
        assert await store.chain_size("resp_nope", "alice") is None

    run_with_store(store_url, body)


def test_list_input_items_pages_like_openai(store_url: str) -> None:
    async def body(store: Store) -> None:
        items: list[dict[str, Any]] = [user(f"m{k}") for k in range(24)]
        items.append(
            {
                "type": "message",
                "id": "msg_own",
                "role": "developer",
                "content": [{"type": "input_text", "text": "d"}],
            }
        )
        await store.save_response(response("resp_1"), input_items=items, output_items=[], replay_items=[])

        page = await store.list_input_items("resp_1", "alice")
        assert page is not None and len(page.data) == 20 and page.has_more
        assert page.data[0]["id"] == "msg_own"  # newest first by default
        assert page.data[1] == {
            "id": page.data[1]["id"],
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "m23"}],
            "status": "completed",
        }
        assert page.data[1]["id"].startswith("msg_")
        assert (page.first_id, page.last_id) == (page.data[0]["id"], page.data[-1]["id"])
        rest = await store.list_input_items("resp_1", "alice", after=page.last_id)
        assert rest is not None and not rest.has_more
        assert [d["content"][0]["text"] for d in rest.data] == ["m4", "m3", "m2", "m1", "m0"]

        ids_desc = [d["id"] for d in page.data + rest.data]
        asc: list[str] = []
        after = None
        while True:
            chunk = await store.list_input_items("resp_1", "alice", after=after, limit=7, order="asc")
            assert chunk is not None
            asc += [d["id"] for d in chunk.data]
            if not chunk.has_more:
                break
            after = chunk.last_id
        assert asc == ids_desc[::-1]
        # ids are stable across reads
        again = await store.list_input_items("resp_1", "alice", limit=100, order="asc")
        assert again is not None and [d["id"] for d in again.data] == asc

        with pytest.raises(UnknownCursor):
            await store.list_input_items("resp_1", "alice", after="msg_unknown")
        with pytest.raises(ValueError, match="limit"):
            await store.list_input_items("resp_1", "alice", limit=101)
        with pytest.raises(ValueError, match="order"):
            await store.list_input_items("resp_1", "alice", order="up")  # type: ignore[arg-type]
        empty = await store.list_input_items("resp_1", "alice", after=asc[-1], order="asc")
        assert empty is not None and (empty.data, empty.first_id, empty.last_id, empty.has_more) == (
            [],
            None,
            None,
            False,
        )

    run_with_store(store_url, body)


def test_page_sizes_select_no_item_and_load_page_decodes_only_the_admitted_rows(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads are admitted from the sizes measured at write time (issue 15): the size query reads
    ids and sizes of at most limit + 1 rows, never the item column, and decodes nothing; then
    `load_page` decodes the first ``count`` rows only, the page continuing at its last id."""

    async def body(store: Store) -> None:
        items = [user(f"m{k}" + "é" * k) for k in range(6)]  # sizes are UTF-8 bytes
        await store.save_response(response("resp_1"), input_items=items, output_items=[], replay_items=[])
        conv = await store.create_conversation("alice", items=items[:3], metadata=None)
        statements: list[str] = []
        decoded: list[object] = []
        real = store_module._loads
        monkeypatch.setattr(store_module, "_loads", lambda text: decoded.append(text) or real(text))
        store.backend.on_statement = statements.append
        sizes_page = await store.input_item_sizes("resp_1", "alice", limit=4, order="asc")
        conv_sizes = await store.conversation_item_sizes(conv["id"], "alice", limit=100)
        store.backend.on_statement = None
        assert decoded == [] and statements
        assert not [sql for sql in statements if re.search(r"\bitem\b", sql)], "the item column was read"
        assert sizes_page is not None and conv_sizes is not None
        expected = [sizes([item]) for item in items]
        assert [(r.size_bytes, r.node_count) for r in sizes_page.rows] == expected[:5]  # limit + 1 rows
        assert [(r.seq, r.size_bytes) for r in conv_sizes.rows] == [
            (2, expected[2][0]),
            (1, expected[1][0]),
            (0, expected[0][0]),
        ]

        page = await store.load_page(sizes_page, 2)
        assert [d["content"][0]["text"] for d in page.data] == ["m0", "m1é"]
        assert len(decoded) == 2, "only the two admitted rows were decoded"
        assert (page.first_id, page.last_id, page.has_more) == (
            sizes_page.rows[0].item_id,
            sizes_page.rows[1].item_id,
            True,
        )
        assert page == await store.list_input_items("resp_1", "alice", limit=2, order="asc")
        rest = await store.input_item_sizes("resp_1", "alice", after=page.last_id, limit=100, order="asc")
        assert rest is not None and len(rest.rows) == 4
        assert [r.item_id for r in rest.rows[:3]] == [r.item_id for r in sizes_page.rows[2:]]
        whole = await store.load_page(rest, len(rest.rows))
        assert [d["content"][0]["text"] for d in whole.data] == [f"m{k}" + "é" * k for k in range(2, 6)]
        assert not whole.has_more
        with pytest.raises(ValueError, match="count"):
            await store.load_page(rest, len(rest.rows) + 1)
        empty = await store.load_page(rest, 0)
        assert (empty.data, empty.first_id, empty.has_more) == ([], None, True)

        # Gone in between (its response deleted): the page leaves its rows out.
        assert await store.delete_response("resp_1", "alice")
        gone = await store.load_page(sizes_page, 4)
        assert (gone.data, gone.first_id, gone.last_id, gone.has_more) == ([], None, None, True)
        assert await store.input_item_sizes("resp_1", "alice") is None
        assert await store.input_item_sizes("resp_x", "alice") is None
        assert await store.conversation_item_sizes(conv["id"], "mallory") is None
        with pytest.raises(UnknownCursor):
            await store.conversation_item_sizes(conv["id"], "alice", after="msg_unknown")

    run_with_store(store_url, body)


def test_response_size_is_measured_at_write_and_its_text_is_served_undecoded(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(store: Store) -> None:
        saved = response("resp_1")
        saved.response["output"] = [{"type": "message", "role": "assistant", "content": "ünï ✓ 字 😀"}]
        await store.save_response(saved, input_items=[], output_items=[], replay_items=[])
        text = encode_json(saved.response).encode("utf-8")
        decoded: list[object] = []
        monkeypatch.setattr(store_module, "_loads", lambda value: decoded.append(value))
        assert await store.response_size("resp_1", "alice") == len(text)
        assert await store.response_json("resp_1", "alice") == text
        assert decoded == []
        assert await store.response_size("resp_1", "mallory") is None
        assert await store.response_json("resp_1", "mallory") is None
        assert await store.response_size("resp_nope", "alice") is None
        # A row written before schema version 2 has no size: 4 bytes per character bound it.
        await store.backend.run(single("UPDATE responses SET size_bytes = NULL"), write=True)
        assert await store.response_size("resp_1", "alice") == 4 * len(text.decode("utf-8"))

    run_with_store(store_url, body)


# --- conversations -----------------------------------------------------------------------------


def test_minted_ids_are_the_gateway_format() -> None:
    """Conversation ids and the ids of items stored without one are `middleware.ids.new_id`'s:
    ``prefix_`` + 32 hex digits; an item's own id is kept."""

    async def body(store: Store) -> None:
        conv = await store.create_conversation("alice", items=[], metadata=None)
        assert re.fullmatch(r"conv_[0-9a-f]{32}", conv["id"])
        added = await store.add_conversation_items(
            conv["id"], "alice", [user("x"), {"type": "function_call_output", "call_id": "c", "output": ""}]
        )
        assert added is not None
        assert [re.fullmatch(r"(msg|fco)_[0-9a-f]{32}", item["id"]) is not None for item in added] == [
            True,
            True,
        ]
        mine = await store.add_conversation_items(conv["id"], "alice", [{**user("y"), "id": "msg_mine"}])
        assert mine is not None and mine[0]["id"] == "msg_mine"

    run_with_store("memory", body)


def test_conversation_lifecycle_with_responses(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(store: Store) -> None:
        conv = await store.create_conversation("alice", items=[user("hello")], metadata={"topic": "demo"})
        cid = conv["id"]
        assert (
            cid.startswith("conv_")
            and conv["object"] == "conversation"
            and conv["metadata"] == {"topic": "demo"}
        )
        assert await store.get_conversation(cid, "alice") == conv

        inp, out, rep = turn(1)
        await store.save_response(
            response("resp_1", conversation=cid), input_items=inp, output_items=out, replay_items=rep
        )
        added = await store.add_conversation_items(cid, "alice", [user("later")])
        assert added is not None and added[0]["type"] == "message" and added[0]["id"].startswith("msg_")

        page = await store.list_conversation_items(cid, "alice", order="asc")
        assert page is not None
        shown = [{k: v for k, v in d.items() if k not in ("id", "status")} for d in page.data]
        assert [d.get("type") for d in shown] == ["message"] * 3 + ["mcp_call", "message", "message"]
        assert page.data[3] == out[0] and page.data[4]["id"] == "msg_1"

        upstream = [user("hello"), *inp, *rep, user("later")]
        assert await store.load_conversation(cid, "alice") == upstream

        with monkeypatch.context() as patch:
            patch.setattr(
                store_module, "_loads", lambda *a, **k: pytest.fail("conversation_size decoded a row")
            )
            info = await store.conversation_size(cid, "alice")
        nbytes, nodes = sizes(upstream)
        assert info is not None
        assert (info.size_bytes, info.node_count, info.item_count, info.length) == (
            nbytes,
            nodes,
            len(upstream),
            0,
        )
        # Items appended after the size was taken are not loaded with its through_seq.
        await store.add_conversation_items(cid, "alice", [user("racing")])
        assert await store.load_conversation(cid, "alice", through_seq=info.through_seq) == upstream
        assert (await store.load_conversation(cid, "alice"))[-1] == user("racing")

        assert await store.delete_conversation(cid, "alice") is True
        assert await store.get_conversation(cid, "alice") is None
        assert await store.delete_conversation(cid, "alice") is False
        assert await raw_rows(
            store, "SELECT COUNT(*) FROM conversation_items WHERE conversation_id = ?", (cid,)
        ) == [(0,)]
        assert await store.get_response("resp_1", "alice") is not None  # responses outlive it

        empty = await store.create_conversation("alice", items=[], metadata=None)
        assert empty["metadata"] == {}
        size = await store.conversation_size(empty["id"], "alice")
        assert size is not None and (size.size_bytes, size.item_count, size.through_seq) == (0, 0, -1)

    run_with_store(store_url, body)


def test_fifty_concurrent_appends_lose_nothing(store_url: str) -> None:
    async def body(store: Store) -> None:
        conv = await store.create_conversation("alice", items=[], metadata=None)
        cid = conv["id"]

        async def append(n: int) -> None:
            await store.add_conversation_items(cid, "alice", [user(f"append-{n}")])

        await asyncio.gather(*(append(n) for n in range(50)))
        rows = await raw_rows(
            store, "SELECT seq, item FROM conversation_items WHERE conversation_id = ? ORDER BY seq", (cid,)
        )
        seqs = [int(seq) for seq, _ in rows]
        assert len(rows) == 50
        assert seqs == sorted(set(seqs)) and len(set(seqs)) == 50
        assert sorted(item for _, item in rows) == sorted(encode_json(user(f"append-{n}")) for n in range(50))
        # The paged API agrees with the rows' order.
        listed: list[str] = []
        after = None
        while True:
            page = await store.list_conversation_items(cid, "alice", after=after, limit=20, order="asc")
            assert page is not None
            listed += [d["content"][0]["text"] for d in page.data]
            if not page.has_more:
                break
            after = page.last_id
        assert listed == [store_module._loads(item)["content"] for _, item in rows]

    run_with_store(store_url, body)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_two_stores_on_one_database_share_a_conversation(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two gateway processes (two stores, two connections or pools) opening and appending at once."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/shared.db"
    else:
        server: PgServer = request.getfixturevalue("pg_server")
        url = server.create_schema(f"t_{uuid.uuid4().hex[:16]}")

    async def main() -> None:
        first, second = open_store(url), open_store(url)
        await asyncio.gather(first.open(), second.open())  # concurrent migrations
        try:
            assert await first.schema_version() == await second.schema_version() == 3
            assert await raw_rows(first, "SELECT COUNT(*) FROM schema_migrations") == [(3,)]
            cid = (await first.create_conversation("alice", items=[], metadata=None))["id"]
            await asyncio.gather(
                *(
                    (first if n % 2 else second).add_conversation_items(cid, "alice", [user(f"p{n}")])
                    for n in range(50)
                )
            )
            rows = await raw_rows(
                second, "SELECT seq FROM conversation_items WHERE conversation_id = ?", (cid,)
            )
            assert sorted(int(r[0]) for r in rows) == list(range(50))
        finally:
            await first.close()
            await second.close()

    asyncio.run(main())


# --- schema, secrets, robustness ---------------------------------------------------------------


def test_migrations_are_idempotent(store_url: str) -> None:
    async def main() -> None:
        async with open_store(store_url) as store:
            assert await store.schema_version() == 3
            assert await store._migrate() == []  # nothing left to apply
            assert await raw_rows(store, "SELECT version FROM schema_migrations ORDER BY version") == [
                (1,),
                (2,),
                (3,),
            ]
            await store.save_response(
                response("resp_1"), input_items=[user("x")], output_items=[], replay_items=[]
            )
            if store_url == "memory":
                return
        async with open_store(store_url) as store:  # a restart keeps the data, applies nothing
            assert await raw_rows(store, "SELECT COUNT(*) FROM schema_migrations") == [(3,)]
            assert await store.load_chain("resp_1", "alice") == [user("x")]
            await store.backend.run(
                single("INSERT INTO schema_migrations (version, name, applied_at) VALUES (99, 'future', 0)"),
                write=True,
            )
        store = open_store(store_url)
        with pytest.raises(SchemaTooNew, match="version 99"):
            await store.open()
        await store.close()

    asyncio.run(main())


def test_secrets_are_never_stored(store_url: str, tmp_path: Path) -> None:
    mcp_tool = {
        "type": "mcp",
        "server_label": "crm",
        "server_url": "https://mcp.example/sse",
        "headers": {"Authorization": "Bearer SECRET-HEADER-TOKEN"},
        "authorization": "SECRET-OAUTH-TOKEN",
    }
    function_tool = {
        "type": "function",
        "name": "fetch",
        "parameters": {"type": "object", "properties": {"headers": {"type": "object"}}},
    }
    request: dict[str, Any] = {"instructions": "x", "tools": [mcp_tool, function_tool]}

    async def body(store: Store) -> None:
        saved = response("resp_1", request=request)
        saved.response["tools"] = [mcp_tool, function_tool]  # echoed by the response object too
        await store.save_response(saved, input_items=[user("hi")], output_items=[], replay_items=[])
        got = await store.get_response("resp_1", "alice")
        assert got is not None
        kept = {"type": "mcp", "server_label": "crm", "server_url": "https://mcp.example/sse"}
        assert got.request["tools"] == [kept, function_tool]  # a schema property named headers is kept
        assert got.response["tools"] == [kept, function_tool]
        dump = []
        for table in ("responses", "items", "conversations", "conversation_items"):
            dump += [repr(row) for row in await raw_rows(store, f"SELECT * FROM {table}")]
        assert dump and "SECRET" not in "\n".join(dump)
        assert request["tools"][0]["headers"]  # the caller's dict was not modified

    run_with_store(store_url, body)
    for path in glob.glob(str(tmp_path / "**" / "*.db*"), recursive=True):  # the SQLite file and its WAL
        assert b"SECRET" not in Path(path).read_bytes()


def test_strip_secrets_drops_each_secret_tool_field() -> None:
    """`SECRET_TOOL_FIELDS` is the one list of credential fields (the loop echoes them as null)."""
    assert sorted(store_module.SECRET_TOOL_FIELDS) == ["authorization", "headers"]
    for name in store_module.SECRET_TOOL_FIELDS:
        tool = {"type": "mcp", "server_label": "crm", name: "SECRET"}
        assert store_module.strip_secrets({"tools": [tool]}) == {
            "tools": [{"type": "mcp", "server_label": "crm"}]
        }


def test_cancelled_save_leaves_the_store_usable(store_url: str) -> None:
    async def body(store: Store) -> None:
        for delay in range(6):
            inp, out, rep = turn(delay)
            task = asyncio.create_task(
                store.save_response(
                    response(f"resp_{delay}"), input_items=inp, output_items=out, replay_items=rep
                )
            )
            for _ in range(delay):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            got = await store.get_response(f"resp_{delay}", "alice")
            chain = await store.load_chain(f"resp_{delay}", "alice")
            assert chain == (inp + rep if got is not None else [])  # all or nothing
        await store.save_response(
            response("resp_after"), input_items=[user("ok")], output_items=[], replay_items=[]
        )
        assert await store.load_chain("resp_after", "alice") == [user("ok")]

    run_with_store(store_url, body)


def test_sqlite_file_creates_parents_and_uses_wal(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "loopwarden.db"

    async def body(store: Store) -> None:
        rows = await raw_rows(store, "PRAGMA journal_mode")
        assert rows == [("wal",)]

    run_with_store(f"sqlite:///{path}", body)
    assert path.exists()


def test_open_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = open_store("sqlite:///.loopwarden/loopwarden.db")
    assert repr(relative) == "Store(SqliteBackend(path='.loopwarden/loopwarden.db'))"
    assert "path='/abs/x.db'" in repr(open_store("sqlite:////abs/x.db"))
    assert "path=None" in repr(open_store("memory"))
    pg = open_store("postgresql://u:hunter2@db:5432/lw")
    assert "hunter2" not in repr(pg) and "u:***@db:5432/lw" in repr(pg)
    assert "hunter2" not in repr(open_store("postgresql://u@db/lw?sslmode=require&password=hunter2"))
    with pytest.raises(ValueError, match="unsupported store URL") as err:
        open_store("mysql://u:hunter2@db/lw")
    assert "hunter2" not in str(err.value)
    with pytest.raises(ValueError, match="names no file"):
        open_store("sqlite:///")

    async def body(store: Store) -> None:
        await store.save_response(response("resp_1"), input_items=[], output_items=[], replay_items=[])

    run_with_store("sqlite:///.loopwarden/loopwarden.db", body)
    assert (tmp_path / ".loopwarden" / "loopwarden.db").exists()


def test_missing_postgres_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the server binaries the PostgreSQL tests fail (never skip) and say what to run."""
    import tests.pg as pg

    monkeypatch.setattr(pg.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(pg.shutil, "which", lambda name: None)
    with pytest.raises(PostgresMissing, match=r"scripts/ensure-postgres\.sh"), running_postgres():
        pass


def test_find_item_for_item_references(store_url: str) -> None:
    """Issue 18 item 2 (case B37): an item is found by id among its owner's responses (the
    client-visible output form first, never the replay form) and conversations, sizes before text."""

    async def body(store: Store) -> None:
        inp, out, rep = turn(1)
        await store.save_response(response("resp_1"), input_items=inp, output_items=out, replay_items=rep)
        found = await store.find_item("mcp_1", "alice")
        assert found is not None and (found.table, found.key, found.role) == ("items", "resp_1", "output")
        assert (found.size_bytes, found.node_count) == sizes([out[0]])
        assert await store.load_item(found) == out[0]
        msg = await store.find_item("msg_1", "alice")  # in output and replay: the output row
        assert msg is not None and msg.role == "output"
        assert await store.find_item("fc_1", "alice") is None  # replay only: never shown
        assert await store.find_item("mcp_1", "bob") is None  # another owner's
        conv = await store.create_conversation("alice", items=[{**user("in a conversation"), "id": "msg_c"}])
        in_conv = await store.find_item("msg_c", "alice")
        assert in_conv is not None and (in_conv.table, in_conv.key) == ("conversation_items", conv["id"])
        assert (await store.load_item(in_conv) or {}).get("content") == "in a conversation"
        assert await store.find_item("msg_c", "bob") is None
        await store.delete_response("resp_1", "alice")
        assert await store.load_item(found) is None

    run_with_store(store_url, body)
