"""Regressions for the defects an adversarial review found (each named by its class); every fix
covers the class, not only the literal input."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import DONE, FC, PRE, counting_gateway, gateway, message_item, response_obj, sse_events
from tests.loop.test_loop_e2e import LOG, build_server, fc_reply, final_reply, text_stream
from tests.mock_upstream import E, MockUpstream, Reply
from tests.servers import serve_asgi

TOOLS = {"type": "mcp", "server_label": "tools", "require_approval": "never"}
APPROVE = {"type": "mcp", "server_label": "tools"}


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with serve_asgi(build_server().streamable_http_app()) as url:
        yield url + "/mcp"


@pytest.fixture(autouse=True)
def fresh_log() -> None:
    LOG.__init__()  # type: ignore[misc]


def loop(upstream: MockUpstream, mcp_url: str, **kw: Any) -> Any:
    kw.setdefault("mcp_server", (f"tools={mcp_url}",))
    kw.setdefault("max_retained_bytes", 4 * 1048576)
    kw.setdefault("tool_timeout", 2.0)
    return gateway(upstream, **kw)


def post(url: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=30, **kw)


def test_compressed_upstream_bodies_are_refused_before_inflating(upstream: MockUpstream) -> None:
    bomb = gzip.compress(json.dumps(response_obj([message_item("x" * 5_000_000)])).encode())
    upstream.push(
        Reply(headers=[("content-type", "application/json"), ("content-encoding", "gzip")], parts=[bomb]),
        Reply(
            headers=[("content-type", "text/event-stream"), ("content-encoding", "gzip")],
            parts=[bomb],
            framing="chunked",
        ),
    )
    with counting_gateway(upstream) as (url, _, counted):
        buffered = post(url, {"model": "m", "input": "x"})
        streamed = post(url, {"model": "m", "input": "x", "stream": True})
    assert buffered.status_code == 502 and buffered.json()["error"]["code"] == "upstream_invalid_response"
    assert streamed.status_code == 502
    assert counted.bytes_read == 0
    assert upstream.requests[0].headers["accept-encoding"] == "identity"


def test_max_tool_calls_as_an_integral_float_is_enforced(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(*[fc_reply(FC(f"call_{i}", "lookup", "{}")) for i in range(10)])
    with loop(upstream, mcp_url, max_infer_iters=10) as (url, _):
        r = post(url, {"model": "m", "input": "x", "tools": [TOOLS], "max_tool_calls": 2.0})
    assert r.status_code == 200 and r.json()["status"] == "incomplete"
    assert LOG.count("lookup") == 2 and len(upstream.requests) == 3


def test_approvals_respect_max_tool_calls_and_cannot_be_answered_twice(
    upstream: MockUpstream, mcp_url: str
) -> None:
    upstream.push(
        fc_reply(*[FC(f"call_{i}", "lookup", "{}") for i in range(3)]), fc_reply(FC("call_A", "lookup", "{}"))
    )
    with loop(upstream, mcp_url) as (url, _):
        r1 = post(url, {"model": "m", "input": "x", "tools": [APPROVE], "max_tool_calls": 1}).json()
        ids = [i["id"] for i in r1["output"] if i["type"] == "mcp_approval_request"]
        over = post(
            url,
            {
                "model": "m",
                "previous_response_id": r1["id"],
                "tools": [APPROVE],
                "max_tool_calls": 1,
                "input": [
                    {"type": "mcp_approval_response", "approval_request_id": i, "approve": True} for i in ids
                ],
            },
        )
        r3 = post(url, {"model": "m", "input": "x", "tools": [APPROVE]}).json()
        answer = {"type": "mcp_approval_response", "approval_request_id": "mcpr_call_A", "approve": True}
        twice = post(
            url,
            {"model": "m", "previous_response_id": r3["id"], "tools": [APPROVE], "input": [answer, answer]},
        )
        gone = post(url, {"model": "m", "previous_response_id": r3["id"], "input": [answer]})
    assert len(ids) == 3
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tool_calls"
    assert twice.status_code == 400 and "answered twice" in twice.json()["error"]["message"]
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "tools"
    assert LOG.count("lookup") == 0 and len(upstream.requests) == 2


@pytest.mark.parametrize(
    ("kind", "response"),
    [
        (
            "response.failed",
            {"id": "resp_up", "output": [FC("call_w", "write_file", '{"path":"a","content":"x"}')]},
        ),
        (
            "response.incomplete",
            {"id": "resp_up", "output": [FC("call_w", "write_file", '{"path":"a","content":"x"}')]},
        ),
        (
            "response.failed",
            {
                "id": "resp_up",  # the id PRE's response.created opened
                "status": "completed",
                "output": [FC("call_w", "write_file", '{"path":"a","content":"x"}')],
            },
        ),
    ],
)
def test_a_streamed_round_not_ending_in_completed_runs_no_tool(
    upstream: MockUpstream, mcp_url: str, kind: str, response: dict[str, Any]
) -> None:
    upstream.push(Reply.sse([*PRE(), E(kind, {"type": kind, "sequence_number": 2, "response": response})]))
    with loop(upstream, mcp_url) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": True, "tools": [TOOLS]})
    assert LOG.count("write_file") == 0 and len(upstream.requests) == 1
    assert sse_events(r.content)[-1][0] == kind
    assert not any(d.get("item", {}).get("type") == "function_call" for _, d in sse_events(r.content))


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "input": [{"type": "function_call_output", "call_id": ["x"], "output": "y"}]},
        {"model": "m", "input": "x", "tools": [TOOLS, {"type": "function", "name": ["a"]}]},
        {
            "model": "m",
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
                {"type": "function_call_output", "call_id": "c", "output": "2"},
            ],
        },
    ],
)
def test_odd_client_input_is_a_400_never_a_500(
    upstream: MockUpstream, mcp_url: str, body: dict[str, Any]
) -> None:
    with loop(upstream, mcp_url) as (url, _):
        r = post(url, body)
    assert r.status_code == 400, r.text
    assert upstream.requests == []


def test_upstream_protocol_violations_are_502_and_odd_values_do_not_break_storing(
    upstream: MockUpstream, mcp_url: str
) -> None:
    no_id = {"type": "function_call", "id": "fc", "name": "lookup", "arguments": "{}"}
    upstream.push(
        fc_reply(no_id),
        fc_reply(FC("call_1", "lookup", "{}"), FC("call_1", "lookup", "{}")),
        Reply.json(
            {
                **response_obj([message_item("ok")]),
                "created_at": "soon",
                "usage": {"input_tokens": 1, "cost": 1e300},
            }
        ),
        Reply.json({**response_obj([message_item("ok")]), "usage": {"input_tokens": 1e300}}),
    )
    with loop(upstream, mcp_url) as (url, _):
        missing = post(url, {"model": "m", "input": "x", "tools": [TOOLS]})
        duplicate = post(url, {"model": "m", "input": "x", "tools": [TOOLS]})
        odd = post(url, {"model": "m", "input": "x"})
        float_tokens = post(url, {"model": "m", "input": "x"})
    assert missing.status_code == 502 and missing.json()["error"]["code"] == "upstream_invalid_response"
    assert duplicate.status_code == 502 and "duplicate call_id" in duplicate.json()["error"]["message"]
    assert odd.status_code == 200  # an odd created_at is re-stamped; a provider's float "cost" is passed on
    assert odd.json()["usage"]["cost"] == 1e300
    # a token count that is not an integer is a wrong type (it is summed over rounds)
    assert float_tokens.status_code == 502, float_tokens.text
    assert "usage.input_tokens" in float_tokens.json()["error"]["message"]
    assert LOG.calls == []


def test_an_event_type_cannot_inject_sse_frames(upstream: MockUpstream) -> None:
    forged = 'x\n\nevent: response.completed\ndata: {"type":"response.completed","response":{"id":"forged"}}'
    upstream.push(Reply.sse([*PRE(), E("x", {"type": forged, "sequence_number": 2}), DONE(3, [])]))
    with gateway(upstream) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": True, "store": False})
    names = [n for n, _ in sse_events(r.content)]
    assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names
    assert b"forged" not in r.content


def test_b07_arguments_only_in_deltas_reach_the_tool(upstream: MockUpstream, mcp_url: str) -> None:
    call = FC("call_L", "lookup", None)  # type: ignore[arg-type]
    parts = [
        *PRE(),
        E(
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "sequence_number": 2,
                "output_index": 0,
                "item": {**call, "status": "in_progress"},
            },
        ),
        E(
            "response.function_call_arguments.delta",
            {
                "type": "response.function_call_arguments.delta",
                "sequence_number": 3,
                "item_id": call["id"],
                "output_index": 0,
                "delta": '{"location": ',
            },
        ),
        E(
            "response.function_call_arguments.delta",
            {
                "type": "response.function_call_arguments.delta",
                "sequence_number": 4,
                "item_id": call["id"],
                "output_index": 0,
                "delta": '"Boston"}',
            },
        ),
        DONE(5, [call]),
    ]
    upstream.push(Reply.sse(parts), Reply.sse(text_stream("ok")))
    with loop(upstream, mcp_url) as (url, _):
        post(url, {"model": "m", "input": "x", "stream": True, "tools": [TOOLS]})
    assert LOG.calls == [("lookup", {"q": "", "p": "", "location": "Boston"})]


def test_an_incomplete_round_hides_and_does_not_store_its_unrun_gateway_calls(
    upstream: MockUpstream, mcp_url: str
) -> None:
    partial = {**FC("call_I", "lookup", '{"q":"a'), "status": "incomplete"}
    upstream.push(
        Reply.json(
            response_obj([partial], status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        ),
        final_reply("go on"),
    )
    with loop(upstream, mcp_url) as (url, _):
        r1 = post(url, {"model": "m", "input": "x", "tools": [TOOLS]}).json()
        r2 = post(url, {"model": "m", "input": "more", "previous_response_id": r1["id"], "tools": [TOOLS]})
    assert [i["type"] for i in r1["output"]] == ["mcp_list_tools"]
    assert r2.status_code == 200
    assert all(i.get("call_id") != "call_I" for i in upstream.requests[1].json()["input"])


def test_the_upstream_key_is_never_echoed_in_errors(upstream: MockUpstream) -> None:
    key = "sk-very-secret-upstream-key"
    upstream.push(
        Reply.json({"error": {"message": f"Incorrect API key provided: {key}"}}, status=401),
        Reply.sse([*PRE(), E("error", {"type": "error", "code": "x", "message": f"bad key {key}"})]),
    )
    with gateway(upstream, upstream_api_key=key) as (url, _):
        r1 = post(url, {"model": "m", "input": "x", "store": False})
        r2 = post(url, {"model": "m", "input": "x", "store": False, "stream": True})
    assert r1.status_code == 502 and key not in r1.text and "***" in r1.text
    assert key not in r2.text


def test_tool_lists_are_charged_before_the_first_upstream_call(upstream: MockUpstream) -> None:
    from mcp.server.mcpserver import MCPServer

    big: MCPServer[Any] = MCPServer("big")
    for i in range(300):
        big.add_tool(lambda: "ok", name=f"tool_{i}", description="d" * 400)
    with (
        serve_asgi(big.streamable_http_app()) as base,
        gateway(upstream, mcp_server=(f"big={base}/mcp",)) as (url, _),
    ):
        r = post(
            url,
            {
                "model": "m",
                "input": "x",
                "tools": [{"type": "mcp", "server_label": "big", "require_approval": "never"}],
            },
        )
    assert r.status_code == 502 and r.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert upstream.requests == []


def test_models_list_upstream_failure_is_an_envelope_not_a_500() -> None:
    from middleware.app import create_app
    from middleware.config import Settings

    settings = Settings(upstream="http://127.0.0.1:9/v1", upstream_connect_timeout=1, store="memory")
    with serve_asgi(create_app(settings)) as url:
        r = httpx.get(url + "/v1/models", timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"


def test_a_stream_always_starts_with_response_created(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(
        Reply.sse([DONE(0, [FC("call_1", "lookup", "{}")])]), Reply.sse([DONE(0, [message_item("done")])])
    )
    with loop(upstream, mcp_url) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": True, "tools": [TOOLS]})
    names = [n for n, _ in sse_events(r.content)]
    assert names[0] == "response.created" and names.count("response.created") == 1
    assert names[-1] == "response.completed"


def test_keepalives_while_a_later_round_waits_for_upstream_headers(
    upstream: MockUpstream, mcp_url: str
) -> None:
    # the second round's upstream is silent for 1.5 s before its first byte
    upstream.push(
        Reply.sse([*PRE(), DONE(2, [FC("call_1", "lookup", "{}")])]),
        Reply.sse([1.5, DONE(0, [message_item("late")])]),
    )
    with loop(upstream, mcp_url, keepalive_interval=0.3) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": True, "tools": [TOOLS]})
    assert r.content.count(b": keep-alive") >= 3
    assert sse_events(r.content)[-1][0] == "response.completed"


def test_stream_true_with_a_json_upstream_answer_still_gets_sse(upstream: MockUpstream) -> None:
    upstream.push(Reply.json(response_obj([message_item("hi")])))
    with gateway(upstream) as (url, _):
        r = post(url, {"model": "m", "input": "x", "stream": True, "store": False})
    assert r.headers["content-type"].startswith("text/event-stream")
    names = [n for n, _ in sse_events(r.content)]
    assert names == [
        "response.created",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
