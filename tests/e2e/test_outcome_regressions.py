"""Regressions that come with one outcome table (the architecture issue): each failed before it.

* a failure after the response object exists is stored ``failed`` — also `PoolExhausted` and
  unexpected exceptions (500 ``internal_error``), which used to leave nothing stored;
* after commit: one ``error``, one ``response.failed`` (the response so far), ``data: [DONE]``;
  every frame carries ``event: <type>``, also when the upstream sent no ``event:`` line; the
  official SDK raises from ``create(stream=True)`` and ``responses.stream()``, and ends cleanly on
  ``[DONE]``;
* upstream answers the gateway cannot re-encode, or whose read fields have the wrong type, are
  502 ``upstream_invalid_response`` (error frames after commit), never a 500, stored as the
  client saw them;
* a conversation deleted while a request appends to it: the request answers as the client saw it;
* unknown paths are 404 with the envelope; every 405 carries ``Allow``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from middleware.app import create_app, default_upstream
from middleware.config import Settings
from tests.helpers import DONE, FC, PRE, B, gateway, message_item, response_obj, sdk, sse_events, text_delta
from tests.mock_upstream import E, MockUpstream, Reply
from tests.servers import serve_asgi


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=30)


def stored_statuses(db: Path) -> dict[str, tuple[str, str | None]]:
    """Every stored response: id -> (status, error code)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT id, status, response FROM responses").fetchall()
    out = {}
    for rid, status, body in rows:
        error = json.loads(body).get("error")
        out[rid] = (status, error.get("code") if isinstance(error, dict) else None)
    return out


def long_stream(deltas: int, size: int) -> list[bytes]:
    text = "x" * size
    return [*PRE(), *(text_delta(2 + i, text) for i in range(deltas)), DONE(2 + deltas, [message_item(text)])]


# -- stored failed: PoolExhausted and unexpected exceptions -------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
def test_pool_exhausted_after_the_response_exists_is_stored_failed(
    upstream: MockUpstream, tmp_path: Path, stream: bool
) -> None:
    db = tmp_path / "lw.db"
    upstream.push(
        Reply.sse(long_stream(2000, 200))
        if stream
        else Reply.json(response_obj([message_item("x" * 200_000)]))
    )
    with gateway(
        upstream,
        store=f"sqlite:///{db}",
        max_retained_bytes=64 * B,
        max_inflight_retained_bytes=B,  # the measured model charges a 200 KB answer about 1 MiB
        max_inflight_share_per_caller=1.0,  # the pool refuses, not one caller's share
    ) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": stream})
    if stream:
        events = sse_events(r.content)
        assert events[-2][1]["code"] == "process_budget_exceeded"
        rid = events[0][1]["response"]["id"]
        assert stored_statuses(db)[rid] == ("failed", "process_budget_exceeded")
    else:
        assert r.status_code == 502 and r.json()["error"]["code"] == "process_budget_exceeded"
        assert list(stored_statuses(db).values()) == [("failed", "process_budget_exceeded")]


class _Exploding:
    """An upstream whose response body raises a defect (not an upstream failure) after `after` chunks."""

    def __init__(self, inner: Any, after: int) -> None:
        self.inner = inner
        self.after = after

    async def post(self, path: str, body: bytes, *, stream: bool) -> Any:
        response = await self.inner.post(path, body, stream=stream)
        after = self.after

        class Response:
            status_code = response.status_code
            headers = response.headers

            async def chunks(self) -> AsyncIterator[bytes]:
                count = 0
                async for chunk in response.chunks():
                    if count >= after:
                        raise RuntimeError("a defect in the gateway")
                    count += 1
                    yield chunk

            async def aclose(self) -> None:
                await response.aclose()

        return Response()

    async def get(self, path: str) -> Any:
        return await self.inner.get(path)

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextlib.contextmanager
def exploding_gateway(upstream: MockUpstream, db: Path, after: int) -> Iterator[str]:
    settings = Settings(upstream=upstream.base_url, store=f"sqlite:///{db}", max_retained_bytes=B)
    app = create_app(settings, upstream_factory=lambda s, u: _Exploding(default_upstream(s, u), after))
    with serve_asgi(app) as url:
        yield url


def test_an_unexpected_exception_is_500_stored_failed_and_logged(
    upstream: MockUpstream, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "lw.db"
    spaced = [p for part in long_stream(3, 5) for p in (part, 0.05)]  # one upstream read per part
    upstream.push(Reply.sse(spaced), Reply.json(response_obj([message_item("ok")])))
    with (
        caplog.at_level(logging.WARNING, logger="loopwarden.outcome"),
        exploding_gateway(upstream, db, 2) as url,
    ):
        streamed = post(url, {"model": "m", "input": "x", "stream": True})
    events = sse_events(streamed.content)
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "internal_error" and events[-2][1]["error"]["type"] == "server_error"
    rid = events[0][1]["response"]["id"]
    assert stored_statuses(db)[rid] == ("failed", "internal_error")
    assert any("row=internal" in r.getMessage() and "status=500" in r.getMessage() for r in caplog.records)

    db2 = tmp_path / "lw2.db"
    upstream.push(Reply.json(response_obj([message_item("ok")])))
    with exploding_gateway(upstream, db2, 0) as url:
        buffered = post(url, {"model": "m", "input": "x"})
    assert buffered.status_code == 500 and buffered.json()["error"]["code"] == "internal_error"
    assert buffered.headers["x-should-retry"] == "false"
    assert list(stored_statuses(db2).values()) == [("failed", "internal_error")]


# -- after commit: error, response.failed, [DONE]; event lines ----------------------------------------
def _frames(body: bytes) -> list[tuple[str | None, bytes]]:
    out = []
    for block in body.split(b"\n\n"):
        lines = [line for line in block.split(b"\n") if line and not line.startswith(b":")]
        if not lines:
            continue
        event = next((line[7:].decode() for line in lines if line.startswith(b"event: ")), None)
        data = b"\n".join(line[6:] for line in lines if line.startswith(b"data: "))
        out.append((event, data))
    return out


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("fails", [False, True])
def test_every_frame_names_its_event_and_the_stream_ends_with_done(
    upstream: MockUpstream, store: bool, fails: bool
) -> None:
    """The upstream sends data-only frames (no ``event:`` line): the gateway still names each."""

    def bare(frame: bytes) -> bytes:
        return b"\n".join(line for line in frame.split(b"\n") if not line.startswith(b"event:"))

    tail = (
        [E("error", {"type": "error", "code": "engine_died", "message": "x"})]
        if fails
        else [DONE(4, [message_item("ab")])]
    )
    upstream.push(Reply.sse([bare(f) for f in [*PRE(), text_delta(2, "a"), text_delta(3, "b"), *tail]]))
    with gateway(upstream) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": True, "store": store})
    frames = _frames(r.content)
    assert frames[-1] == (None, b"[DONE]") and r.content.endswith(b"\n\ndata: [DONE]\n\n")
    for event, data in frames[:-1]:
        assert event == json.loads(data)["type"], (event, data)
    names = [event for event, _ in frames[:-1]]
    assert names[-1] == ("response.failed" if fails else "response.completed")
    assert names.count("response.created") == 1


def test_the_sdk_raises_on_a_failed_stream_and_ends_cleanly_on_done(upstream: MockUpstream) -> None:
    error = E("error", {"type": "error", "code": "engine_died", "message": "the engine died"})
    empty = {**message_item(""), "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    item_added = {
        "type": "response.output_item.added",
        "sequence_number": 2,
        "output_index": 0,
        "item": empty,
    }
    part_added = {
        "type": "response.content_part.added",
        "sequence_number": 3,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "part": part,
    }
    item_done = {
        "type": "response.output_item.done",
        "sequence_number": 5,
        "output_index": 0,
        "item": message_item("Hi"),
    }
    head = [*PRE(), E(item_added["type"], item_added), E(part_added["type"], part_added), text_delta(4, "Hi")]
    done = [E(item_done["type"], item_done), DONE(6, [message_item("Hi")])]
    upstream.push(
        Reply.sse([*head, error]),
        Reply.sse([*head, error]),
        Reply.sse([*head, *done]),
        Reply.sse([*head, *done]),
    )
    with gateway(upstream) as (url, _):
        client = sdk(url)
        with pytest.raises(openai.APIError, match="the engine died"):
            for _ in client.responses.create(model="m", input="x", stream=True):
                pass
        with (
            pytest.raises(openai.APIError, match="the engine died"),
            client.responses.stream(model="m", input="x") as s,
        ):
            for _ in s:
                pass
        kinds = [event.type for event in client.responses.create(model="m", input="x", stream=True)]
        with client.responses.stream(model="m", input="x") as s:
            streamed = [event.type for event in s]
            final = s.get_final_response()
    assert kinds[-1] == "response.completed" and streamed[-1] == "response.completed"
    assert final.output_text == "Hi"


# -- upstream answers the gateway cannot re-encode, wrong types -------------------------------------
WRONG = st.sampled_from([5, 1.5, True, ["x"], {"a": 1}])
FIELDS = st.sampled_from(
    ["id", "status", "output", "output.type", "call_id", "name", "arguments", "usage", "usage.input_tokens"]
)


def _broken(field: str, value: Any) -> dict[str, Any]:
    item: dict[str, Any] = message_item("ok")
    response = response_obj([item], usage={"input_tokens": 1, "output_tokens": 1, "total_tokens": 2})
    if field in ("call_id", "name", "arguments"):
        item = FC("call_1", "client_tool", "{}")
        response["output"] = [item]
    if field == "output":
        response["output"] = value if not isinstance(value, list) else [value]
    elif field == "output.type" or field in ("call_id", "name", "arguments"):
        item[field.split(".")[-1]] = value
    elif field == "usage.input_tokens":
        response["usage"]["input_tokens"] = value
    else:
        response[field] = value
    return response


@pytest.fixture(scope="module")
def shared_upstream() -> Iterator[MockUpstream]:
    with MockUpstream() as mock:
        yield mock


@pytest.fixture(scope="module")
def shared_gateway(
    shared_upstream: MockUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    db = tmp_path_factory.mktemp("wrong") / "lw.db"
    with gateway(shared_upstream, store=f"sqlite:///{db}") as (url, _):
        yield url, db


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=FIELDS, value=WRONG, stream=st.booleans(), store=st.booleans())
def test_wrong_types_in_read_fields_are_never_a_500(
    shared_upstream: MockUpstream,
    shared_gateway: tuple[str, Path],
    field: str,
    value: Any,
    stream: bool,
    store: bool,
) -> None:
    url, db = shared_gateway
    response = _broken(field, value)
    if stream:
        shared_upstream.push(
            Reply.sse(
                [
                    *PRE(),
                    E(
                        "response.completed",
                        {"type": "response.completed", "sequence_number": 2, "response": response},
                    ),
                ]
            )
        )
    else:
        shared_upstream.push(Reply.json(response))
    before = stored_statuses(db)
    tools = [{"type": "function", "name": "client_tool", "parameters": {"type": "object"}}]
    r = post(url, {"model": "m", "input": "x", "stream": stream, "store": store, "tools": tools})
    shared_upstream.requests.clear()
    assert r.status_code != 500, r.text
    new = {k: v for k, v in stored_statuses(db).items() if k not in before}
    if not stream:
        if r.status_code == 200:
            assert new == ({r.json()["id"]: (r.json()["status"], None)} if store else {})
        else:
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_invalid_response", r.text
            assert set(new.values()) <= {("failed", "upstream_invalid_response")}
        return
    events = sse_events(r.content)
    rid = events[0][1]["response"]["id"]
    if events[-1][0] == "response.failed" and events[-2][0] == "error":
        assert events[-2][1]["code"] == "upstream_invalid_response"
        assert new == ({rid: ("failed", "upstream_invalid_response")} if store else {})
    else:
        assert events[-1][0] == "response.completed"
        assert new == ({rid: ("completed", None)} if store else {})


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "payload",
    [
        b'{"type":"response.output_text.delta","sequence_number":2,"output_index":0,"content_index":0,"delta":"\\ud800"}',
        b'{"type":"response.output_text.delta","sequence_number":2,"output_index":0,"content_index":0,"delta":"a","logprob":NaN}',
    ],
    ids=["lone-surrogate", "nan"],
)
def test_values_json_cannot_carry_are_502_upstream_invalid_response(
    upstream: MockUpstream, tmp_path: Path, stream: bool, payload: bytes
) -> None:
    db = tmp_path / "lw.db"
    if stream:
        upstream.push(
            Reply.sse([*PRE(), b"event: response.output_text.delta\ndata: " + payload + b"\n\n", DONE(3, [])])
        )
    else:
        text = payload.split(b'"delta":')[1].rstrip(b"}")
        upstream.push(
            Reply.json(b'{"id":"r","object":"response","status":"completed","output":[],"x":' + text + b"}")
        )
    with gateway(upstream, store=f"sqlite:///{db}") as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": stream})
    if stream:
        events = sse_events(r.content)
        assert events[-2][1]["code"] == "upstream_invalid_response"
        assert stored_statuses(db)[events[0][1]["response"]["id"]] == ("failed", "upstream_invalid_response")
    else:
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_invalid_response"
        assert list(stored_statuses(db).values()) == [("failed", "upstream_invalid_response")]


# -- a conversation deleted while a request appends to it --------------------------------------------
def test_a_conversation_deleted_mid_request_answers_as_the_client_saw_it(upstream: MockUpstream) -> None:
    go = threading.Event()
    upstream.push(Reply.sse([*PRE(), text_delta(2, "hi"), go, DONE(3, [message_item("hi")])]))
    with gateway(upstream) as (url, _):
        conversation = httpx.post(url + "/v1/conversations", json={}).json()["id"]
        with httpx.stream(
            "POST",
            url + "/v1/responses",
            json={"model": "m", "input": "x", "stream": True, "conversation": conversation},
            timeout=30,
        ) as r:
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if b"response.output_text.delta" in body and not go.is_set():
                    assert httpx.delete(url + f"/v1/conversations/{conversation}").status_code == 200
                    go.set()
        rid = sse_events(body)[0][1]["response"]["id"]
        stored = httpx.get(url + f"/v1/responses/{rid}")
    assert r.status_code == 200 and sse_events(body)[-1][0] == "response.completed"
    assert stored.status_code == 404  # not stored: the conversation's items are not brought back


# -- routing: 404 envelope, Allow on every 405 ------------------------------------------------------
def test_unknown_paths_are_404_and_every_405_carries_allow(upstream: MockUpstream) -> None:
    with gateway(upstream) as (url, _):
        unknown = httpx.get(url + "/v2/nothing")
        wrong = [
            httpx.request(method, url + path)
            for method, path in [
                ("GET", "/v1/responses"),
                ("PUT", "/v1/responses/resp_1"),
                ("POST", "/v1/responses/resp_1/input_items"),
                ("PATCH", "/v1/conversations"),
                ("PUT", "/v1/conversations/conv_1/items"),
                ("POST", "/healthz"),
                ("DELETE", "/metrics"),
                ("POST", "/v1/models"),
            ]
        ]
    for r in (unknown,):
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    for r in wrong:
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", (
            r.request.url,
            r.text,
        )
        assert r.headers.get("allow"), r.request.url
        assert r.request.method not in r.headers["allow"]


# -- found by an attack on the refactored table (each class, not the literal input) -------------------
@pytest.mark.parametrize("value", ["日本", "€5", "ok\u0085"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_header_that_is_not_plain_ascii_is_dropped_not_a_500(
    upstream: MockUpstream, value: str, stream: bool
) -> None:
    envelope = json.dumps({"error": {"message": "slow down", "code": "rate_limit_exceeded"}}).encode()
    headers = [
        ("content-type", "application/json"),
        ("x-ratelimit-remaining-requests", value),
        ("retry-after", "3"),
    ]
    upstream.push(Reply(status=429, headers=headers, parts=[envelope]))
    with gateway(upstream) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": stream})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert "x-ratelimit-remaining-requests" not in r.headers and r.headers["retry-after"] == "3"


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_number_that_overflows_to_infinity_is_502_never_re_sent_as_infinity(
    upstream: MockUpstream, tmp_path: Path, stream: bool
) -> None:
    db = tmp_path / "lw.db"
    body = json.dumps(response_obj([message_item("ok")])).encode()[:-1] + b',"temperature":1e999}'
    if stream:
        upstream.push(
            Reply.sse(
                [
                    *PRE(),
                    b"event: response.completed\ndata: "
                    + b'{"type":"response.completed","sequence_number":2,"response":'
                    + body
                    + b"}\n\n",
                ]
            )
        )
    else:
        upstream.push(Reply.json(body))
    with gateway(upstream, store=f"sqlite:///{db}") as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": stream})
    assert b"Infinity" not in r.content
    if stream:
        events = sse_events(r.content)
        assert events[-2][1]["code"] == "upstream_invalid_response"
        assert stored_statuses(db)[events[0][1]["response"]["id"]][0] == "failed"
    else:
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_invalid_response"


def test_a_frame_whose_data_has_no_type_is_sent_with_the_type_its_event_line_names(
    upstream: MockUpstream,
) -> None:
    untyped = b'event: response.output_text.delta\ndata: {"sequence_number":2,"output_index":0,"content_index":0,"item_id":"msg_1","delta":"a"}\n\n'
    upstream.push(Reply.sse([*PRE(), untyped, DONE(3, [message_item("a")])]))
    with gateway(upstream) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": True, "store": False})
    for event, data in _frames(r.content)[:-1]:
        assert event == json.loads(data)["type"], (event, data)


@pytest.mark.parametrize("reply", ["503", "reset"])
def test_a_failure_after_a_gateway_tool_ran_is_not_retried(upstream: MockUpstream, reply: str) -> None:
    """A retry would run the tool (and its side effects) again: x-should-retry: false, and the
    official SDK with its default retries makes exactly one request."""
    from tests.loop.test_loop_e2e import LOG, build_server, fc_reply
    from tests.mock_upstream import RST

    failing = Reply.json({"error": {"message": "busy"}}, status=503) if reply == "503" else Reply(parts=[RST])
    LOG.__init__()  # type: ignore[misc]
    with serve_asgi(build_server().streamable_http_app()) as mcp:
        upstream.push(fc_reply(FC("call_1", "lookup", "{}")), failing)
        tools = [{"type": "mcp", "server_label": "tools", "require_approval": "never"}]
        with gateway(upstream, mcp_server=(f"tools={mcp}/mcp",), max_retained_bytes=4 * B) as (url, _):
            r = post(url, {"model": "m", "input": "x", "tools": tools})
            upstream.push(fc_reply(FC("call_2", "lookup", "{}")), failing, failing, failing)
            with pytest.raises(openai.APIStatusError):
                sdk(url, max_retries=2).responses.create(model="m", input="x", tools=tools)  # type: ignore[arg-type]
    assert r.status_code == 502 and r.headers["x-should-retry"] == "false"
    assert LOG.count("lookup") == 2  # once per client request: the SDK did not retry the second
    assert len(upstream.requests) == 4


@pytest.mark.parametrize(
    "body",
    [{"error": {"message": "model overloaded", "code": "overloaded"}}, {"id": "r", "object": "response"}],
    ids=["error-envelope", "no-output"],
)
@pytest.mark.parametrize("store", [False, True])
def test_a_success_status_without_a_response_object_is_502(
    upstream: MockUpstream, body: dict[str, Any], store: bool
) -> None:
    upstream.push(Reply.json(body))
    with gateway(upstream) as (url, _):
        r = post(url, {"model": "m", "input": "x", "store": store})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_invalid_response", r.text


@pytest.mark.parametrize("store", [None, True, False])
def test_every_response_snapshot_of_a_stream_shows_the_clients_store(
    upstream: MockUpstream, store: bool | None
) -> None:
    """The upstream is always called with store: false (the gateway owns the history); the
    client's own setting is what every response object of its stream shows."""
    upstream.push(Reply.sse([*PRE(), text_delta(2, "a"), DONE(3, [message_item("a")])]))
    body: dict[str, Any] = {
        "model": "m",
        "input": "x",
        "stream": True,
        "tools": [{"type": "function", "name": "f"}],
    }
    if store is not None:
        body["store"] = store
    with gateway(upstream) as (url, _):
        r = post(url, body)
    # store: false takes the pass-through: the upstream's own objects, which saw the client's store
    shown = [data["response"].get("store", False) for _, data in sse_events(r.content) if "response" in data]
    assert shown and set(shown) == {store is not False}, shown
