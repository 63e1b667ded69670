"""The store in the request path (issue 6): previous_response_id chains, B03, B05, approvals,
the history budget, ownership and the true stored status — a real uvicorn, the official SDK, a
scripted upstream, SQLite (and the same suite against PostgreSQL in tests/store/test_store.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import (
    FC,
    PRE,
    MetricDelta,
    gateway,
    response_obj,
    sdk,
    sse_events,
    text_delta,
)
from tests.loop.test_loop_e2e import (
    LOG,
    TOOLS_DECL,
    build_server,
    fc_reply,
    fc_stream,
    final_reply,
    text_stream,
)
from tests.mock_upstream import RST, MockUpstream, Reply
from tests.servers import serve_asgi

GET_TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
APPROVE = {"type": "mcp", "server_label": "tools"}  # require_approval defaults to "always"
AUTH = {"authorization": "Bearer client-key"}  # the key tests.helpers.sdk presents: the same owner


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with serve_asgi(build_server().streamable_http_app()) as url:
        yield url + "/mcp"


@pytest.fixture(autouse=True)
def fresh_log() -> None:
    LOG.__init__()  # type: ignore[misc]


def store_gateway(upstream: MockUpstream, mcp_url: str, tmp_path: Any, **kw: Any) -> Any:
    kw.setdefault("store", f"sqlite:///{tmp_path}/lw.db")
    kw.setdefault("mcp_server", (f"tools={mcp_url}",))
    kw.setdefault("tool_timeout", 2.0)
    # Store on doubles the charges and restored history costs 8192 per node: at the CASES.md
    # knob of 1 MiB a three-step chain with tools does not fit the default charge model.
    kw.setdefault("max_retained_bytes", 8 * 1048576)
    return gateway(upstream, **kw)


def sent_input(upstream: MockUpstream, i: int) -> list[dict[str, Any]]:
    return upstream.requests[i].json()["input"]


def test_b05_three_request_chain_sends_every_earlier_item_in_order(
    upstream: MockUpstream, mcp_url: str, tmp_path: Any
) -> None:
    upstream.push(
        fc_reply(FC("call_g", "lookup", '{"q":"x"}')),
        fc_reply(FC("call_T", "get_time", "{}")),
        final_reply("your day is planned"),
        final_reply("noted"),
    )
    with store_gateway(upstream, mcp_url, tmp_path) as (url, _), sdk(url) as client:
        r1 = client.responses.create(
            model="m",
            input="plan my day",
            tools=[TOOLS_DECL | {"require_approval": "never"}, GET_TIME],
            instructions="be brief",
        )
        assert [i.type for i in r1.output] == ["mcp_list_tools", "mcp_call", "function_call"]
        r2 = client.responses.create(
            model="m",
            previous_response_id=r1.id,
            input=[{"type": "function_call_output", "call_id": "call_T", "output": "12:00"}],
        )
        r3 = client.responses.create(model="m", previous_response_id=r2.id, input="thanks")
    assert r2.output_text == "your day is planned" and r3.output_text == "noted"
    step2 = sent_input(upstream, 2)
    assert [(i.get("type", "message"), i.get("call_id")) for i in step2] == [
        ("message", None),
        ("function_call", "call_g"),
        ("function_call_output", "call_g"),
        ("function_call", "call_T"),
        ("function_call_output", "call_T"),
    ]
    assert step2[0]["content"] == "plan my day"
    assert step2[1]["arguments"] == '{"q":"x"}' and step2[1]["name"] == "lookup"
    assert step2[4]["output"] == "12:00"
    assert "instructions" not in upstream.requests[2].json()  # not carried over unless resent
    step3 = sent_input(upstream, 3)
    assert step3[:5] == step2 and step3[5]["type"] == "message" and step3[-1]["content"] == "thanks"
    assert all(
        r.json()["store"] is False and "previous_response_id" not in r.json() for r in upstream.requests
    )


def test_b05_streamed_chain(upstream: MockUpstream, mcp_url: str, tmp_path: Any) -> None:
    upstream.push(Reply.sse(fc_stream(FC("call_T", "get_time", "{}"))), Reply.sse(text_stream("12 it is")))
    with store_gateway(upstream, mcp_url, tmp_path) as (url, _), sdk(url) as client:
        with client.responses.stream(model="m", input="time?", tools=[GET_TIME]) as s:
            list(s)
            first = s.get_final_response()
        with client.responses.stream(
            model="m",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": "call_T", "output": "12:00"}],
        ) as s:
            list(s)
            second = s.get_final_response()
    assert second.output_text == "12 it is"
    assert [(i.get("type", "message"), i.get("call_id")) for i in sent_input(upstream, 1)] == [
        ("message", None),
        ("function_call", "call_T"),
        ("function_call_output", "call_T"),
    ]


@pytest.mark.parametrize(
    ("new_input", "named"),
    [
        ([{"type": "message", "role": "user", "content": "hi again"}], "call_X"),
        ([{"type": "function_call_output", "call_id": "call_UNKNOWN", "output": "x"}], "call_UNKNOWN"),
    ],
)
def test_b03_dangling_and_unknown_call_ids_are_400_before_any_upstream_call(
    upstream: MockUpstream, mcp_url: str, tmp_path: Any, new_input: list[Any], named: str
) -> None:
    upstream.push(fc_reply(FC("call_X", "get_time", "{}")))
    with store_gateway(upstream, mcp_url, tmp_path) as (url, _), sdk(url) as client:
        r1 = client.responses.create(model="m", input="what time is it", tools=[GET_TIME])
        m = MetricDelta()
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", previous_response_id=r1.id, input=new_input)
    body = info.value.response.json()["error"]
    assert body["param"] == "input" and body["type"] == "invalid_request_error"
    assert named in body["message"]
    assert len(upstream.requests) == 1
    assert m.delta("loopwarden_requests_total", status="400", model="other") == 1


def test_continuing_errors(upstream: MockUpstream, mcp_url: str, tmp_path: Any) -> None:
    upstream.push(final_reply("a"))
    with store_gateway(upstream, mcp_url, tmp_path) as (url, _), sdk(url) as client:
        r1 = client.responses.create(model="m", input="x")
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="m", previous_response_id="resp_nope", input="y")
        with pytest.raises(openai.BadRequestError) as both:
            client.responses.create(model="m", previous_response_id=r1.id, conversation="conv_x", input="y")  # type: ignore[arg-type]
    assert both.value.response.json()["error"]["param"] == "previous_response_id"
    assert len(upstream.requests) == 1


def test_another_key_gets_404_and_get_delete_input_items_work(
    upstream: MockUpstream, mcp_url: str, tmp_path: Any
) -> None:
    upstream.push(final_reply("stored"))
    with store_gateway(upstream, mcp_url, tmp_path, api_key=("alice-key", "bob-key")) as (url, _):
        alice = openai.OpenAI(base_url=url + "/v1", api_key="alice-key", max_retries=0)
        bob = openai.OpenAI(base_url=url + "/v1", api_key="bob-key", max_retries=0)
        with alice, bob:
            r1 = alice.responses.create(
                model="m", input=[{"type": "message", "role": "user", "content": "secret plan"}]
            )
            got = alice.responses.retrieve(r1.id)
            items = alice.responses.input_items.list(r1.id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.retrieve(r1.id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.create(model="m", previous_response_id=r1.id, input="and?")
            with pytest.raises(openai.NotFoundError):
                bob.responses.delete(r1.id)
            alice.responses.delete(r1.id)
            with pytest.raises(openai.NotFoundError):
                alice.responses.retrieve(r1.id)
        unauthenticated = httpx.get(url + f"/v1/responses/{r1.id}", timeout=10)
    assert got.id == r1.id and got.output_text == "stored" and got.status == "completed"
    assert [i.type for i in items.data] == ["message"]
    assert unauthenticated.status_code == 401 and unauthenticated.json()["error"]["code"] == "invalid_api_key"
    assert len(upstream.requests) == 1


def test_history_too_large_is_413_without_decoding_any_row(
    upstream: MockUpstream, mcp_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream.push(final_reply("x" * 5000), final_reply("x" * 5000), final_reply("never"))
    with (
        store_gateway(upstream, mcp_url, tmp_path, max_retained_bytes=4 * 1048576) as (url, _),
        sdk(url) as client,
    ):
        r1 = client.responses.create(model="m", input="a" * 20_000)
        r2 = client.responses.create(model="m", input="b" * 20_000, previous_response_id=r1.id)
        from middleware.store import store as store_module

        decoded: list[object] = []
        real = store_module._loads
        monkeypatch.setattr(store_module, "_loads", lambda text: decoded.append(text) or real(text))
        m = MetricDelta()
        with pytest.raises(openai.APIStatusError) as info:
            client.responses.create(
                model="m",
                input="c",
                previous_response_id=r2.id,
                extra_headers={"loopwarden-max-retained-bytes": "262144"},
            )
    assert info.value.status_code == 413
    assert info.value.response.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert info.value.response.json()["error"]["param"] == "previous_response_id"
    assert decoded == [], "no stored row was decoded"
    assert len(upstream.requests) == 2
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="413") == 1


def test_approval_request_resumed_approve_runs_deny_refuses(
    upstream: MockUpstream, mcp_url: str, tmp_path: Any
) -> None:
    upstream.push(
        fc_reply(FC("call_A", "lookup", '{"q":"a"}')),
        final_reply("approved and done"),
        fc_reply(FC("call_B", "write_file", '{"path":"p","content":"c"}')),
        final_reply("ok, not writing"),
    )
    with store_gateway(upstream, mcp_url, tmp_path) as (url, _), sdk(url) as client:
        r1 = client.responses.create(model="m", input="look it up", tools=[APPROVE])  # type: ignore[list-item]
        request = [i for i in r1.output if i.type == "mcp_approval_request"]
        assert len(request) == 1 and request[0].name == "lookup" and LOG.calls == []
        r2 = client.responses.create(
            model="m",
            previous_response_id=r1.id,
            tools=[APPROVE],  # type: ignore[list-item]
            input=[{"type": "mcp_approval_response", "approval_request_id": request[0].id, "approve": True}],
        )
        r3 = client.responses.create(model="m", input="write it", tools=[APPROVE])  # type: ignore[list-item]
        deny_id = next(i.id for i in r3.output if i.type == "mcp_approval_request")
        r4 = client.responses.create(
            model="m",
            previous_response_id=r3.id,
            tools=[APPROVE],  # type: ignore[list-item]
            input=[
                {
                    "type": "mcp_approval_response",
                    "approval_request_id": deny_id,
                    "approve": False,
                    "reason": "no writes",
                }
            ],
        )
    assert LOG.calls == [("lookup", {"q": "a", "p": "", "location": ""})]
    assert [i.type for i in r2.output][-2:] == [
        "mcp_call",
        "message",
    ] and r2.output_text == "approved and done"
    sent = {
        i["call_id"]: i["output"] for i in sent_input(upstream, 1) if i.get("type") == "function_call_output"
    }
    assert sent == {"call_A": "ok"}
    refused = {
        i["call_id"]: i["output"] for i in sent_input(upstream, 3) if i.get("type") == "function_call_output"
    }
    assert "denied" in refused["call_B"] and "no writes" in refused["call_B"]
    assert r4.output_text == "ok, not writing"


def test_stored_status_is_the_true_one(upstream: MockUpstream, mcp_url: str, tmp_path: Any) -> None:
    """B12/B06a: a failed stream is stored as failed and cannot be continued; B26: incomplete can."""
    error = b'event: error\ndata: {"type":"error","sequence_number":3,"code":"server_error","message":"boom","param":null}\n\n'
    upstream.push(
        Reply.sse([*PRE(), text_delta(2, "Hel"), error]),
        Reply.json(response_obj([], status="incomplete", incomplete_details={"reason": "max_output_tokens"})),
        final_reply("continued"),
        Reply.sse([*PRE(), text_delta(2, "Hel"), RST]),
    )
    with store_gateway(upstream, mcp_url, tmp_path) as (url, _), sdk(url) as client:
        r = httpx.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, headers=AUTH, timeout=10
        )
        failed_id = sse_events(r.content)[0][1]["response"]["id"]
        failed = client.responses.retrieve(failed_id)
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="m", previous_response_id=failed_id, input="again")
        incomplete = client.responses.create(model="m", input="write two paragraphs", max_output_tokens=16)
        stored_incomplete = client.responses.retrieve(incomplete.id)
        cont = client.responses.create(model="m", previous_response_id=incomplete.id, input="go on")
        r = httpx.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, headers=AUTH, timeout=10
        )
        truncated = client.responses.retrieve(sse_events(r.content)[0][1]["response"]["id"])
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
    assert stored_incomplete.status == "incomplete"
    assert cont.output_text == "continued"
    assert truncated.status == "failed"
    assert len(upstream.requests) == 4


def test_secrets_are_not_stored(upstream: MockUpstream, mcp_url: str, tmp_path: Any) -> None:
    declared = {
        "type": "mcp",
        "server_label": "mine",
        "server_url": mcp_url,
        "require_approval": "never",
        "headers": {"x-token": "s3cret-token"},
    }
    upstream.push(fc_reply(FC("call_1", "lookup", "{}")), final_reply())
    with (
        store_gateway(
            upstream, mcp_url, tmp_path, mcp_allow=(mcp_url.rsplit("/", 1)[0] + "/",), mcp_server=()
        ) as (url, _),
        sdk(url) as client,
    ):
        r = client.responses.create(model="m", input="x", tools=[declared])  # type: ignore[list-item]
        got = client.responses.retrieve(r.id)
    raw = (tmp_path / "lw.db").read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("lw.db-*"))
    assert b"s3cret-token" not in raw
    assert "s3cret-token" not in got.to_json() and "s3cret-token" not in r.to_json()
    assert all("s3cret-token" not in req.body.decode() for req in upstream.requests)
