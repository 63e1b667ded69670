"""The routes issue 16 adds (item 4) and their outcomes (item 5): ``POST /v1/responses/{id}/cancel``,
``POST /v1/conversations/{id}`` (update), ``GET`` / ``DELETE /v1/conversations/{id}/items/{item_id}``
and the refusal of ``background: true`` with ``store: false``; plus the bounds of every conversation POST body (body
clamp, admission, node count and depth, the ledger) and of the one-item read.

The SDK tests run the whole gateway (`create_app`) on a real uvicorn with the official `openai`
SDK as client, a scripted upstream (`tests.mock_upstream`) where a response is needed, on every
store backend (memory, SQLite file, a real PostgreSQL from tests/pg.py: missing is a failure).
The admission tests run the store routes alone (`tests.store.test_store_reads.serve`) so that the pool
they draw from can be sized to the byte.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.conversations import Conversation

from budget import ChargeModel, Ledger
from tests.helpers import gateway, message_item, response_obj, sdk
from tests.mock_upstream import MockUpstream, Reply
from tests.pg import PgServer
from tests.servers import raw_http, response_json
from tests.store.test_store_reads import PAGE, item_charge, msg, serve, settled
from tests.store.test_store_routes import assert_envelope, http

MiB = 1 << 20
MODEL = ChargeModel.measured()  # the gateway's default charge model


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.db"
    server: PgServer = request.getfixturevalue("pg_server")
    return server.create_schema(f"t_{uuid.uuid4().hex[:16]}")


@pytest.fixture
def served(upstream: MockUpstream, store_url: str) -> Iterator[str]:
    with gateway(upstream, store=store_url, max_retained_bytes=8 * MiB) as (url, _):
        yield url


def other(url: str) -> OpenAI:
    """A second caller: another API key, so another owner."""
    return OpenAI(base_url=url + "/v1", api_key="mallory-key", max_retries=0)


def key_of(client: OpenAI) -> str:
    return str(client.api_key)


def reply(text: str, item_id: str) -> Reply:
    return Reply.json(response_obj([message_item(text, item_id)]))


# --- POST /v1/conversations/{id}: update -----------------------------------------------------------


def test_update_replaces_the_metadata_and_null_clears_it(served: str) -> None:
    with sdk(served) as alice, other(served) as mallory:
        created = alice.conversations.create(metadata={"topic": "a", "lang": "en"})
        updated = alice.conversations.update(created.id, metadata={"topic": "b"})
        assert isinstance(updated, Conversation)
        assert (updated.id, updated.created_at, updated.metadata) == (
            created.id,
            created.created_at,
            {"topic": "b"},
        )
        assert alice.conversations.retrieve(created.id).metadata == {"topic": "b"}  # replaced, not merged
        assert alice.conversations.update(created.id, metadata=None).metadata == {}
        assert alice.conversations.retrieve(created.id).metadata == {}
        for client, cid in ((mallory, created.id), (alice, "conv_nope")):
            with pytest.raises(openai.NotFoundError) as info:
                client.conversations.update(cid, metadata={"x": "y"})
            assert info.value.code == "not_found" and f"'{cid}'" in info.value.message
        assert alice.conversations.retrieve(created.id).metadata == {}  # mallory changed nothing


FULL = {f"k{n:02d}": "v" for n in range(16)}


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"metadata": {**FULL, "k16": "v"}}, "invalid_value", "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "invalid_value", "metadata"),
        ({"metadata": {"k": "v" * 513}}, "invalid_value", "metadata.k"),
        ({"metadata": {"k": 1}}, "invalid_type", "metadata.k"),
        ({"metadata": ["k"]}, "invalid_type", "metadata"),
        ({}, "missing_required_parameter", "metadata"),
        ({"metadata": {}, "items": []}, "unknown_parameter", "items"),
    ],
)
def test_update_enforces_openais_metadata_limits(
    upstream: MockUpstream, body: dict[str, Any], code: str, param: str
) -> None:
    with gateway(upstream) as (url, _), sdk(url) as alice:
        cid = alice.conversations.create(metadata={"keep": "me"}).id
        at_limits = {**FULL, "k15": "v" * 512, "k" * 64: "v"}
        del at_limits["k00"]  # 16 pairs: one key of 64 characters, one value of 512
        assert alice.conversations.update(cid, metadata=at_limits).metadata == at_limits
        resp = httpx.post(
            f"{url}/v1/conversations/{cid}", json=body, headers={"authorization": "Bearer client-key"}
        )
        assert_envelope(resp, 400, code, param)
        assert alice.conversations.retrieve(cid).metadata == at_limits  # a refused update changes nothing


# --- GET / DELETE /v1/conversations/{id}/items/{item_id} -------------------------------------------


def test_retrieve_and_delete_one_item(served: str) -> None:
    with sdk(served) as alice, other(served) as mallory:
        conv = alice.conversations.create(
            items=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
            metadata={"m": "1"},
        )
        first, second = [item.id for item in alice.conversations.items.list(conv.id, order="asc")]
        got = alice.conversations.items.retrieve(first, conversation_id=conv.id)
        assert got.type == "message" and got.id == first
        assert got.role == "user" and got.content[0].text == "one"  # type: ignore[union-attr]
        for call in (
            lambda: mallory.conversations.items.retrieve(first, conversation_id=conv.id),
            lambda: mallory.conversations.items.delete(first, conversation_id=conv.id),
            lambda: alice.conversations.items.retrieve("msg_nope", conversation_id=conv.id),
            lambda: alice.conversations.items.retrieve(first, conversation_id="conv_nope"),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                call()
            assert info.value.code == "not_found"
        deleted = alice.conversations.items.delete(first, conversation_id=conv.id)
        assert isinstance(deleted, Conversation)  # OpenAI answers the conversation, not a deletion stub
        assert (deleted.id, deleted.metadata, deleted.created_at) == (conv.id, {"m": "1"}, conv.created_at)
        assert [item.id for item in alice.conversations.items.list(conv.id)] == [second]
        with pytest.raises(openai.NotFoundError) as info:
            alice.conversations.items.retrieve(first, conversation_id=conv.id)
        assert f"'{first}'" in info.value.message
        with pytest.raises(openai.NotFoundError):
            alice.conversations.items.delete(first, conversation_id=conv.id)  # already gone
        assert alice.conversations.items.retrieve(second, conversation_id=conv.id).id == second


def test_a_deleted_item_is_no_longer_sent_upstream(served: str, upstream: MockUpstream) -> None:
    """Deleting an input item or a response's output message removes it from the history later
    requests send, not only from the list (the output is stored once to show, once to replay)."""
    upstream.push(reply("first answer", "msg_out_1"), reply("second answer", "msg_out_2"))
    with sdk(served) as alice:
        conv = alice.conversations.create(
            items=[{"role": "user", "content": "keep"}, {"role": "user", "content": "forget"}]
        )
        alice.responses.create(model="m", conversation=conv.id, input="q1")
        shown = {item.id: item for item in alice.conversations.items.list(conv.id, order="asc")}
        assert "msg_out_1" in shown
        forget = next(i for i, item in shown.items() if getattr(item, "content", [None])[0].text == "forget")  # type: ignore[union-attr]
        alice.conversations.items.delete(forget, conversation_id=conv.id)
        alice.conversations.items.delete("msg_out_1", conversation_id=conv.id)
        alice.responses.create(model="m", conversation=conv.id, input="q2")
    sent = [(i.get("role"), i.get("content")) for i in upstream.requests[1].json()["input"]]
    assert sent == [("user", "keep"), ("user", "q1"), ("user", "q2")]


# --- POST /v1/responses/{id}/cancel ------------------------------------------------------------------


def test_cancel_of_a_foreground_response_is_400_and_unknown_is_404(
    served: str, upstream: MockUpstream
) -> None:
    upstream.push(reply("done", "msg_c1"))
    with sdk(served) as alice, other(served) as mallory:
        done = alice.responses.create(model="m", input="hi")
        with pytest.raises(openai.BadRequestError) as info:
            alice.responses.cancel(done.id)
        err = info.value
        assert (err.status_code, err.code, err.type, err.param) == (
            400,
            "invalid_request",
            "invalid_request_error",
            None,
        )
        assert "Only responses created with background=true can be cancelled" in err.message
        assert err.response.headers["x-should-retry"] == "false"
        for client, rid in ((mallory, done.id), (alice, "resp_nope")):
            with pytest.raises(openai.NotFoundError) as missing:
                client.responses.cancel(rid)
            assert missing.value.code == "not_found" and f"'{rid}'" in missing.value.message
        assert alice.responses.retrieve(done.id).status == "completed"  # nothing changed
    assert len(upstream.requests) == 1


# --- background: true ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_background_true_without_store_is_refused_never_run_in_the_foreground(
    upstream: MockUpstream, stream: bool
) -> None:
    body = {"model": "m", "input": "hi", "background": True, "stream": stream, "store": False}
    with gateway(upstream) as (url, _), sdk(url) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**body)  # type: ignore[call-overload]
        raw = httpx.post(url + "/v1/responses", json=body)
    err = info.value
    assert (err.code, err.param, err.type) == ("invalid_value", "store", "invalid_request_error")
    assert "background: true requires store: true" in err.message
    assert_envelope(raw, 400, "invalid_value", "store")
    assert upstream.requests == []  # nothing ran (background mode itself: tests/loop/test_background.py)


def test_background_false_runs_as_usual(upstream: MockUpstream) -> None:
    upstream.push(reply("ok", "msg_bg"))
    with gateway(upstream) as (url, _), sdk(url) as client:
        assert client.responses.create(model="m", input="hi", background=False).output_text == "ok"


# --- 404 / 405 envelopes -----------------------------------------------------------------------------


def test_wrong_methods_are_405_naming_every_method_of_the_path(upstream: MockUpstream) -> None:
    with gateway(upstream) as (url, _):
        cid = httpx.post(url + "/v1/conversations", json={}).json()["id"]
        cases = {
            ("GET", "/v1/responses/resp_1/cancel"): {"POST"},
            ("DELETE", "/v1/responses/resp_1/cancel"): {"POST"},
            ("PUT", "/v1/responses/resp_1"): {"GET", "HEAD", "DELETE"},
            ("PATCH", f"/v1/conversations/{cid}"): {"GET", "HEAD", "POST", "DELETE"},
            ("POST", f"/v1/conversations/{cid}/items/msg_1"): {"GET", "HEAD", "DELETE"},
            ("PUT", f"/v1/conversations/{cid}/items"): {"GET", "HEAD", "POST"},
        }
        answers = {case: httpx.request(case[0], url + case[1]) for case in cases}
        unknown_item = httpx.delete(f"{url}/v1/conversations/{cid}/items/msg_nope")
        unknown_conv = httpx.get(url + "/v1/conversations/conv_nope/items/msg_1")
    for case, allowed in cases.items():
        assert_envelope(answers[case], 405, "method_not_allowed")
        assert set(answers[case].headers["allow"].split(", ")) == allowed, case
    assert_envelope(unknown_item, 404, "not_found")
    assert unknown_item.json()["error"]["message"].startswith("Item with id 'msg_nope' not found.")
    assert_envelope(unknown_conv, 404, "not_found")
    assert unknown_conv.json()["error"]["message"].startswith("Conversation with id 'conv_nope' not found.")


# --- conversation POST bodies are bounded like create bodies -------------------------------------------


def bomb(token: bytes, size: int) -> bytes:
    """A create-conversation body of about ``size`` bytes: one message whose content is an array
    of ``token`` repeated — many tiny JSON nodes (a JSON bomb for the ledger)."""
    head, tail = b'{"items":[{"role":"user","content":[', b"]}]}"
    count = (size - len(head) - len(tail)) // (len(token) + 1)
    return head + b",".join([token] * count) + tail


POSTS = ["/v1/conversations", "/v1/conversations/{cid}", "/v1/conversations/{cid}/items"]


@pytest.mark.parametrize("path", POSTS)
def test_a_json_bomb_is_413_charged_before_parsing_and_nothing_is_stored(path: str) -> None:
    limit = 16 * MiB  # a lowered limit: its clamp (2/3 of it) is over the routes' own 1 MiB
    body = bomb(b"{}", MiB - 64)
    charge = Ledger(1 << 40, MODEL, store=True).admit_input(body)
    assert charge > limit  # ~35 budget bytes per byte: about 33 MiB for this 1 MiB body
    with serve("memory", max_retained_bytes=64 * MiB) as (url, harness, pool):
        cid = harness.call(harness.store.create_conversation("alice-key", items=[], metadata={"a": "b"}))[
            "id"
        ]
        resp = http(
            url,
            "POST",
            path.format(cid=cid),
            content=body,
            headers={"loopwarden-max-retained-bytes": str(limit)},
        )
        assert_envelope(resp, 413, "max_retained_bytes_exceeded")
        assert f"it needs {charge:,} bytes" in resp.json()["error"]["message"]
        assert settled(lambda: pool.requests == 0)
        page = http(url, "GET", f"/v1/conversations/{cid}/items").json()
        assert page["data"] == [] and http(url, "GET", f"/v1/conversations/{cid}").json()["metadata"] == {
            "a": "b"
        }
        # the same body under the default 64 MiB limit is admitted (its charge fits)
        assert charge < 64 * MiB
        if path == "/v1/conversations/{cid}":
            return  # an update takes metadata, not items
        ok = http(url, "POST", path.format(cid=cid), content=body)
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", POSTS)
def test_nesting_over_the_depth_cap_is_400_json_too_deep(path: str) -> None:
    deep = b'{"metadata":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with serve("memory", max_retained_bytes=64 * MiB) as (url, harness, pool):
        cid = harness.call(harness.store.create_conversation("alice-key", items=[], metadata=None))["id"]
        resp = http(url, "POST", path.format(cid=cid), content=deep)
        assert_envelope(resp, 400, "json_too_deep")
        assert settled(lambda: pool.requests == 0)


@pytest.mark.parametrize("path", POSTS)
def test_an_oversize_body_is_413_from_content_length_at_the_lowered_clamp(path: str) -> None:
    limit = 65536
    clamp = MODEL.body_clamp(limit)  # 43,690 bytes: under the routes' own 1 MiB
    with serve("memory", max_retained_bytes=64 * MiB) as (url, harness, pool):
        cid = harness.call(harness.store.create_conversation("alice-key", items=[], metadata=None))["id"]
        head = (
            b"POST %s HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer alice-key\r\nContent-Type: application/json\r\n"
            b"loopwarden-max-retained-bytes: %d\r\nContent-Length: %d\r\n\r\n"
            % (path.format(cid=cid).encode(), limit, clamp + 1)
        )
        before = harness.body_bytes
        status, headers, body = response_json(raw_http(url, head, b"", read_timeout=5.0))  # body never sent
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert "max_retained_bytes=65,536" in body["error"]["message"]
        assert headers["connection"] == "close" and harness.body_bytes == before
        assert pool.requests == 0  # refused before anything was reserved
        # a body that fits the lowered limit's ledger (store on: about 8 budget bytes a byte) passes
        fits = json.dumps({"items": [{"role": "user", "content": "x" * 2000}]}).encode()
        if "items" not in path and path != "/v1/conversations":
            fits = json.dumps({"metadata": {"k": "v"}}).encode()
        ok = http(
            url,
            "POST",
            path.format(cid=cid),
            content=fits,
            headers={"loopwarden-max-retained-bytes": str(limit)},
        )
        assert ok.status_code == 200, ok.text


def test_a_body_is_reserved_from_the_pool_before_it_is_read() -> None:
    """A body whose reservation (Content-Length × 8 budget bytes, measured) is over the whole pool
    is 413 ``process_budget_exceeded`` without a byte read; while the pool is held full, 503."""
    body = json.dumps({"items": [{"role": "user", "content": "x" * 5000}]}).encode()
    need = len(body) * MODEL.reserve_per_byte()
    with serve("memory", max_retained_bytes=64 * MiB, pool_bytes=need - 1) as (url, harness, pool):
        before = harness.body_bytes
        resp = http(url, "POST", "/v1/conversations", content=body)
        assert_envelope(resp, 413, "process_budget_exceeded")
        assert harness.body_bytes == before
    with serve("memory", max_retained_bytes=64 * MiB, pool_bytes=4 * need) as (url, harness, pool):
        held = pool.admit(4 * need - need + 1, caller="someone-else")
        try:
            busy = http(url, "POST", "/v1/conversations", content=body)
            assert_envelope(busy, 503, "server_overloaded")
            assert busy.headers["retry-after"] == "1"
        finally:
            held.close()
        assert http(url, "POST", "/v1/conversations", content=body).status_code == 200


# --- GET of one item is an admitted read --------------------------------------------------------------


def test_one_item_is_read_under_the_pool_charged_as_a_page_of_one() -> None:
    item = msg(7, "y" * 20000)
    charge = PAGE + item_charge(item, item["id"])  # what the read draws from the pool
    for pool_bytes, status in ((charge, 200), (charge - 1, 413)):
        with serve("memory", max_retained_bytes=64 * MiB, pool_bytes=pool_bytes) as (url, harness, _):
            cid = harness.call(harness.store.create_conversation("alice-key", items=[item], metadata=None))[
                "id"
            ]
            resp = http(url, "GET", f"/v1/conversations/{cid}/items/{item['id']}")
            if status == 200:
                assert resp.status_code == 200, resp.text
                assert resp.json()["content"] == [{"type": "input_text", "text": item["content"]}]
            else:
                assert_envelope(resp, 413, "process_budget_exceeded")


def test_a_body_not_received_within_the_timeout_is_408() -> None:
    from budget import Limits
    from middleware.ops.admission import ProcessPool
    from middleware.store.reads import StoreReads
    from tests.servers import serve_asgi
    from tests.store.test_store_routes import Harness

    pool = ProcessPool(1 << 40)
    harness = Harness(
        "memory", store_reads=StoreReads(limits=Limits(), pool=pool, model=MODEL, client_body_timeout=0.5)
    )
    with serve_asgi(harness) as url:
        head = (
            b"POST /v1/conversations HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer alice-key\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        started = time.monotonic()
        status, _, body = response_json(raw_http(url, head, b'{"items":', read_timeout=10.0))
        assert status == 408 and body["error"]["code"] == "request_timeout", body
        assert time.monotonic() - started < 8.0
        assert settled(lambda: pool.requests == 0)


@pytest.mark.parametrize("token", [b"{}", b"[[]]", b'"x"', b"0.5", b'{"type":"input_text","text":"abc"}'])
def test_the_body_charge_covers_what_an_add_items_call_retains(token: bytes) -> None:
    """Soundness of the body's one charge (measured model, store on) for the copies an add-items
    call holds at once: the raw body, the parsed items, the store's encoded projection and the
    answer's items and encoding (measured with tracemalloc; the charge is also at most 2 × it)."""
    import tracemalloc

    from budget import loads_strict
    from middleware.store.store import _prepare, encode_json, present_item

    raw = bomb(token, MiB - 64)
    charge = Ledger(1 << 40, MODEL, store=True).admit_input(raw)
    tracemalloc.start()
    try:
        body = bytes(bytearray(raw))
        items = loads_strict(body)["items"]
        prepared = [_prepare(item) for item in items]
        shown = [present_item(item, p.item_id) for item, p in zip(items, prepared, strict=True)]
        answer = encode_json({"object": "list", "data": shown}).encode("utf-8")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answer and peak <= charge <= 2 * peak, (peak, charge)
