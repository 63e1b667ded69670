"""The store's HTTP routes (issue 6) on a real uvicorn, driven by the official `openai` SDK where
it has methods (it must parse every answer) and by raw HTTP for the error paths.

The caller's identity is its API key here (``owner_of`` reads the bearer token), so two SDK
clients with different keys are two owners. The routes sit behind `RequestIdMiddleware`, as in the
gateway, so every error message must name the request id (the outcome table adds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar, cast

import httpx
import openai
import pytest
from openai import OpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from budget import ChargeModel, Limits
from middleware.errors import Unauthenticated
from middleware.ops.admission import ProcessPool
from middleware.ops.request_id import RequestIdMiddleware
from middleware.store.reads import StoreReads
from middleware.store.routes import MAX_BODY_BYTES, store_routes
from middleware.store.store import Store, StoredResponse, open_store
from tests.servers import raw_http, response_json, serve_asgi

T = TypeVar("T")


def reads() -> StoreReads:
    """Store reads (and conversation bodies) admitted at the default limits and the gateway's
    default charge model (measured) from a pool too large to refuse them (the admission itself
    is tests/store/test_store_reads.py's and tests/store/test_conversation_routes.py's)."""
    return StoreReads(limits=Limits(), pool=ProcessPool(1 << 40), model=ChargeModel.measured())


def owner_of(request: Request) -> str:
    return request.headers.get("authorization", "").removeprefix("Bearer ")


class Harness:
    """The routes in a Starlette app whose lifespan opens the store at ``url`` (in memory by
    default), its reads admitted by ``store_reads`` (default `reads`); `call` runs a store
    coroutine on the server's event loop (to seed data); `body_bytes` counts request bytes read."""

    def __init__(self, url: str = "memory", *, store_reads: StoreReads | None = None) -> None:
        self.store: Store = open_store(url)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.body_bytes = 0
        routes = store_routes(lambda: self.store, owner_of, reads=store_reads or reads())
        self.app = RequestIdMiddleware(Starlette(routes=routes, lifespan=self.lifespan))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.loop = asyncio.get_running_loop()
        await self.store.open()
        try:
            yield
        finally:
            await self.store.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                self.body_bytes += len(message.get("body", b""))
            return message

        await self.app(scope, counting_receive, send)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Harness]]:
    harness = Harness()
    with serve_asgi(harness) as url:
        yield url, harness


@pytest.fixture
def alice(server: tuple[str, Harness]) -> Iterator[OpenAI]:
    with OpenAI(base_url=server[0] + "/v1", api_key="alice-key", max_retries=0) as client:
        yield client


@pytest.fixture
def mallory(server: tuple[str, Harness]) -> Iterator[OpenAI]:
    with OpenAI(base_url=server[0] + "/v1", api_key="mallory-key", max_retries=0) as client:
        yield client


def http(url: str, method: str, path: str, *, key: str = "alice-key", **kw: Any) -> httpx.Response:
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}) as client:
        return client.request(method, path, **kw)


def response_object(rid: str, text: str = "Hi there") -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": 1_700_000_000,
        "status": "completed",
        "model": "gpt-test",
        "output": [
            {
                "type": "message",
                "id": f"msg_{rid}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "previous_response_id": None,
        "store": True,
        "usage": {
            "input_tokens": 3,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 5,
        },
    }


_counter = iter(range(10**9))


def seed(harness: Harness, *, inputs: int = 1, owner: str = "alice-key") -> str:
    rid = f"resp_{next(_counter):06d}"
    obj = response_object(rid)
    stored = StoredResponse(rid, owner, 1_700_000_000, "completed", "gpt-test", None, None, obj, {})
    items = [{"role": "user", "content": f"question {k}"} for k in range(inputs)]
    harness.call(
        harness.store.save_response(
            stored, input_items=items, output_items=obj["output"], replay_items=obj["output"]
        )
    )
    return rid


def text(item: Any) -> str:
    """The text of a message item's first content part, as the SDK parsed it."""
    return str(item.content[0].text)


def assert_envelope(resp: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    """The OpenAI envelope with this status, code and param; 4xx and a defect (500) say
    ``x-should-retry: false`` and other 5xx do not; the message ends with the request id."""
    assert resp.status_code == status, resp.text
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = resp.json()
    assert body == {
        "error": {"message": body["error"]["message"], "type": kind, "param": param, "code": code}
    }
    assert body["error"]["message"]
    assert resp.headers["content-type"] == "application/json"
    assert resp.headers.get("x-should-retry") == ("false" if status < 500 or status == 500 else None)
    assert body["error"]["message"].endswith(f" [request id {resp.headers['x-request-id']}]")


# --- responses ---------------------------------------------------------------------------------


def test_retrieve_a_stored_response(server: tuple[str, Harness], alice: OpenAI) -> None:
    rid = seed(server[1])
    got = alice.responses.retrieve(rid)
    assert got.id == rid and got.status == "completed" and got.output_text == "Hi there"
    assert got.usage is not None and got.usage.total_tokens == 5
    assert http(server[0], "GET", f"/v1/responses/{rid}").json() == response_object(rid)


def test_unknown_or_foreign_response_is_404(
    server: tuple[str, Harness], alice: OpenAI, mallory: OpenAI
) -> None:
    rid = seed(server[1])
    for client, response_id in ((alice, "resp_unknown"), (mallory, rid)):
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(response_id)
        assert err.value.code == "not_found"
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(response_id)
    assert_envelope(http(server[0], "GET", f"/v1/responses/{rid}", key="mallory-key"), 404, "not_found")
    assert_envelope(http(server[0], "DELETE", f"/v1/responses/{rid}", key="mallory-key"), 404, "not_found")
    assert alice.responses.retrieve(rid).id == rid  # untouched


def test_delete_a_response(server: tuple[str, Harness], alice: OpenAI) -> None:
    rid = seed(server[1])
    alice.responses.delete(rid)  # the SDK returns nothing on success
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(rid)
    other = seed(server[1])
    resp = http(server[0], "DELETE", f"/v1/responses/{other}")
    assert resp.status_code == 200 and resp.json() == {"id": other, "object": "response", "deleted": True}


def test_input_items_page_through_the_sdk(server: tuple[str, Harness], alice: OpenAI) -> None:
    rid = seed(server[1], inputs=25)
    page = alice.responses.input_items.list(rid, limit=10)
    assert len(page.data) == 10 and page.has_more
    first = page.data[0]
    assert first.type == "message" and first.role == "user" and first.id.startswith("msg_")
    assert first.type == "message" and first.content[0].type == "input_text" and text(first) == "question 24"
    every = list(alice.responses.input_items.list(rid, limit=10))  # the SDK follows the cursor
    assert [text(item) for item in every] == [f"question {k}" for k in reversed(range(25))]
    ascending = list(alice.responses.input_items.list(rid, limit=7, order="asc"))
    assert [item.id for item in ascending] == [item.id for item in reversed(every)]

    raw = http(
        server[0], "GET", f"/v1/responses/{rid}/input_items", params={"limit": 2, "order": "asc"}
    ).json()
    assert set(raw) == {"object", "data", "first_id", "last_id", "has_more"} and raw["object"] == "list"
    assert (raw["first_id"], raw["last_id"], raw["has_more"]) == (
        raw["data"][0]["id"],
        raw["data"][1]["id"],
        True,
    )
    end = http(server[0], "GET", f"/v1/responses/{rid}/input_items", params={"after": every[-1].id}).json()
    assert end == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


@pytest.mark.parametrize(
    ("params", "param", "code"),
    [
        ({"limit": "0"}, "limit", "integer_below_min_value"),
        ({"limit": "101"}, "limit", "integer_above_max_value"),
        ({"limit": "ten"}, "limit", "invalid_type"),
        ({"order": "sideways"}, "order", "invalid_value"),
        ({"after": "msg_nope"}, "after", "invalid_value"),
    ],
)
def test_list_parameters_are_validated(
    server: tuple[str, Harness], params: dict[str, str], param: str, code: str
) -> None:
    rid = seed(server[1])
    cid = server[1].call(server[1].store.create_conversation("alice-key", items=[], metadata=None))["id"]
    for path in (f"/v1/responses/{rid}/input_items", f"/v1/conversations/{cid}/items"):
        resp = http(server[0], "GET", path, params=params)
        assert_envelope(resp, 400, code, param)
        assert resp.headers["x-should-retry"] == "false"


# --- conversations -----------------------------------------------------------------------------


def test_conversation_lifecycle_through_the_sdk(server: tuple[str, Harness], alice: OpenAI) -> None:
    conv = alice.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hello!"}], metadata={"topic": "demo"}
    )
    assert (
        conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "demo"}
    )
    assert abs(conv.created_at - time.time()) < 60
    got = alice.conversations.retrieve(conv.id)
    assert (got.id, got.created_at, got.metadata) == (conv.id, conv.created_at, conv.metadata)

    added = alice.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More"}]},
            {"type": "message", "role": "assistant", "content": "Sure."},
        ],
    )
    assert added.object == "list" and len(added.data) == 2 and not added.has_more
    assert (added.first_id, added.last_id) == (added.data[0].id, added.data[1].id)
    assert added.data[1].type == "message" and added.data[1].content[0].type == "output_text"

    items = list(alice.conversations.items.list(conv.id, limit=1, order="asc"))  # cursor via last_id
    assert [text(item) for item in items] == ["Hello!", "More", "Sure."]
    newest = alice.conversations.items.list(conv.id)
    assert [item.id for item in newest.data] == [item.id for item in reversed(items)]

    deleted = alice.conversations.delete(conv.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (conv.id, True, "conversation.deleted")
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        alice.conversations.delete(conv.id)


def test_create_without_a_body_and_empty_conversation(server: tuple[str, Harness], alice: OpenAI) -> None:
    conv = alice.conversations.create()
    assert conv.metadata == {}
    page = alice.conversations.items.list(conv.id)
    assert page.data == [] and not page.has_more
    resp = http(server[0], "POST", "/v1/conversations")  # no body at all
    assert resp.status_code == 200 and resp.json()["object"] == "conversation"


def test_foreign_conversation_is_404(server: tuple[str, Harness], alice: OpenAI, mallory: OpenAI) -> None:
    conv = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "mine"}])
    with pytest.raises(openai.NotFoundError):
        mallory.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        mallory.conversations.items.list(conv.id)
    with pytest.raises(openai.NotFoundError):
        mallory.conversations.items.create(
            conv.id, items=[{"type": "message", "role": "user", "content": "x"}]
        )
    with pytest.raises(openai.NotFoundError):
        mallory.conversations.delete(conv.id)
    assert_envelope(
        http(server[0], "GET", f"/v1/conversations/{conv.id}", key="mallory-key"), 404, "not_found"
    )
    assert len(alice.conversations.items.list(conv.id).data) == 1


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [
        ("/v1/conversations", b"{not json", "invalid_json", None),
        ("/v1/conversations", b'{"items": [], "items": []}', "duplicate_key", "items"),
        ("/v1/conversations", b"[]", "invalid_type", None),
        ("/v1/conversations", b'{"itemz": []}', "unknown_parameter", "itemz"),
        ("/v1/conversations", b'{"items": {}}', "invalid_type", "items"),
        ("/v1/conversations", b'{"items": [1]}', "invalid_type", "items[0]"),
        ("/v1/conversations", b'{"items": [{"content": "x"}]}', "invalid_value", "items[0]"),
        (
            "/v1/conversations",
            b'{"items": [{"type": "message", "content": "x"}]}',
            "invalid_value",
            "items[0].role",
        ),
        ("/v1/conversations", b'{"metadata": {"k": 1}}', "invalid_type", "metadata.k"),
        ("/v1/conversations", b'{"metadata": {"k": "' + b"v" * 513 + b'"}}', "invalid_value", "metadata.k"),
        (
            "/v1/conversations",
            json.dumps({"items": [{"role": "user", "content": "x"}] * 21}).encode(),
            "array_above_max_length",
            "items",
        ),
        ("ITEMS", b"{}", "invalid_type", "items"),
        ("ITEMS", b'{"items": []}', "empty_array", "items"),
    ],
)
def test_invalid_conversation_bodies_are_400(
    server: tuple[str, Harness], path: str, body: bytes, code: str, param: str | None
) -> None:
    if path == "ITEMS":
        cid = server[1].call(server[1].store.create_conversation("alice-key", items=[], metadata=None))["id"]
        path = f"/v1/conversations/{cid}/items"
    resp = http(server[0], "POST", path, content=body, headers={"content-type": "application/json"})
    assert_envelope(resp, 400, code, param)
    assert resp.headers["x-should-retry"] == "false"


def test_oversized_body_is_413_from_content_length_without_reading(server: tuple[str, Harness]) -> None:
    url, harness = server
    before = harness.body_bytes
    head = (
        b"POST /v1/conversations HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer alice-key\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1)
    )
    started = time.monotonic()
    raw = raw_http(
        url, head, b"", read_timeout=5.0
    )  # the body is never sent: the answer must not wait for it
    status, headers, body = response_json(raw)
    assert time.monotonic() - started < 3.0
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert headers["connection"] == "close" and headers["x-should-retry"] == "false"
    assert harness.body_bytes == before


def test_oversized_chunked_body_is_413_and_the_rest_is_not_read(server: tuple[str, Harness]) -> None:
    """A chunked body (no Content-Length) of 4 MiB: the answer comes once the limit is passed;
    the app has read at most the limit plus what uvicorn had already buffered (one read of
    up to 256 KiB on top of its 64 KiB high-water mark)."""
    url, harness = server
    before = harness.body_bytes
    chunk = b" " * 65536
    head = (
        b"POST /v1/conversations HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer alice-key\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(64))
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:

        def send() -> None:
            with contextlib.suppress(OSError):  # the server closes the connection mid-body
                sock.sendall(head + body)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            raw += data
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # unblocks the sender if the server still reads
        sender.join(timeout=10)
    status, headers, parsed = response_json(raw)
    assert status == 413 and parsed["error"]["code"] == "request_too_large"
    assert headers["connection"] == "close"
    assert harness.body_bytes - before <= MAX_BODY_BYTES + 320 * 1024 < len(body)


def test_a_body_at_the_limit_is_accepted(server: tuple[str, Harness]) -> None:
    text = "x" * 1000
    items = [{"role": "user", "content": text}] * 20
    body = json.dumps({"items": items}).encode()
    body += b" " * (MAX_BODY_BYTES - len(body))
    resp = http(server[0], "POST", "/v1/conversations", content=body)
    assert resp.status_code == 200, resp.text


def test_database_failure_is_503_not_500() -> None:
    never_opened = open_store("memory")
    app = RequestIdMiddleware(Starlette(routes=store_routes(lambda: never_opened, owner_of, reads=reads())))
    with serve_asgi(app) as url:
        resp = http(url, "GET", "/v1/responses/resp_1")
    assert_envelope(resp, 503, "store_unavailable")
    assert "x-should-retry" not in resp.headers
    assert resp.json()["error"]["message"].startswith("the response store is unavailable: ")


# --- every error goes through the outcome table ---------------------------------------------------

ROUTES = [
    ("GET", "/v1/responses/{rid}", None),
    ("DELETE", "/v1/responses/{rid}", None),
    ("GET", "/v1/responses/{rid}/input_items", None),
    ("GET", "/v1/conversations/{cid}", None),
    ("DELETE", "/v1/conversations/{cid}", None),
    ("GET", "/v1/conversations/{cid}/items", None),
    ("POST", "/v1/conversations/{cid}/items", {"items": [{"role": "user", "content": "x"}]}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_route_answers_404_not_found_for_another_owners_id(
    server: tuple[str, Harness], method: str, path: str, body: dict[str, Any] | None
) -> None:
    url, harness = server
    rid = seed(harness)
    cid = harness.call(harness.store.create_conversation("alice-key", items=[], metadata=None))["id"]
    resp = http(url, method, path.format(rid=rid, cid=cid), key="mallory-key", json=body)
    assert_envelope(resp, 404, "not_found")


def test_streaming_a_stored_response_is_400(server: tuple[str, Harness]) -> None:
    rid = seed(server[1])
    assert_envelope(
        http(server[0], "GET", f"/v1/responses/{rid}", params={"stream": "true"}),
        400,
        "invalid_value",
        "stream",
    )


def test_the_request_id_the_client_sent_is_named_once(server: tuple[str, Harness]) -> None:
    resp = http(server[0], "GET", "/v1/responses/resp_nope", headers={"x-request-id": "req-store-7"})
    assert_envelope(resp, 404, "not_found")
    message = resp.json()["error"]["message"]
    assert message == "Response with id 'resp_nope' not found. [request id req-store-7]"


def test_413_names_the_request_id_and_closes(server: tuple[str, Harness]) -> None:
    head = (
        b"POST /v1/conversations HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer alice-key\r\n"
        b"X-Request-Id: req-big-1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1)
    )
    status, headers, body = response_json(raw_http(server[0], head, b"", read_timeout=5.0))
    assert status == 413 and body["error"]["code"] == "request_too_large" and body["error"]["param"] is None
    assert body["error"]["message"].endswith(" [request id req-big-1]")
    assert headers["connection"] == "close" and headers["x-should-retry"] == "false"


class _BrokenStore:
    async def response_size(self, response_id: str, owner: str) -> None:
        raise RuntimeError("a bug with a secret detail")


def test_an_unexpected_exception_is_500_internal_error_without_details() -> None:
    app = RequestIdMiddleware(
        Starlette(routes=store_routes(lambda: cast(Store, _BrokenStore()), owner_of, reads=reads()))
    )
    with serve_asgi(app) as url:
        resp = http(url, "GET", "/v1/responses/resp_1")
    assert_envelope(resp, 500, "internal_error")
    assert "secret" not in resp.text


def test_what_owner_of_raises_is_answered_by_the_table() -> None:
    def refuse(request: Request) -> str:
        raise Unauthenticated("no API key was presented; send Authorization: Bearer <key>")

    store = open_store("memory")
    app = RequestIdMiddleware(Starlette(routes=store_routes(lambda: store, refuse, reads=reads())))
    with serve_asgi(app) as url:
        resp = http(url, "GET", "/v1/conversations/conv_1")
    assert_envelope(resp, 401, "invalid_api_key")
