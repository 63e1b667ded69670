"""The agentic loop end to end (issue 5): a real uvicorn, the official SDK, a real MCP server built
with the `mcp` SDK on a loopback port, and a scripted upstream.

Cases B01, B02, B06, B07, B14, B16, B19 and B26 of ../shared/cases/CASES.md are named in the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from mcp.server.mcpserver import MCPServer

from middleware.loop.echo import normalise_response
from tests.helpers import DONE, FC, PRE, MetricDelta, gateway, message_item, response_obj, sdk, sse_events
from tests.mock_upstream import RST, E, MockUpstream, Reply
from tests.servers import serve_asgi

TOOLS_DECL = {"type": "mcp", "server_label": "tools", "require_approval": "never"}
GET_TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


class ToolLog:
    """What the test MCP server saw: calls per tool with their arguments, concurrency, cancellations."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.inflight = 0
        self.peak = 0
        self.cancelled: list[str] = []
        self.big_result = "x" * 10

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)


LOG = ToolLog()


@contextlib.asynccontextmanager
async def _tracked(name: str, args: dict[str, Any]) -> Any:
    LOG.calls.append((name, args))
    LOG.inflight += 1
    LOG.peak = max(LOG.peak, LOG.inflight)
    try:
        yield
    except asyncio.CancelledError:
        LOG.cancelled.append(name)
        raise
    finally:
        LOG.inflight -= 1


def build_server() -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("tools")

    @server.tool()
    async def lookup(q: str = "", p: str = "", location: str = "") -> str:
        """Look something up."""
        async with _tracked("lookup", {"q": q, "p": p, "location": location}):
            return "ok"

    @server.tool()
    async def slow() -> str:
        """Sleeps 10 s."""
        async with _tracked("slow", {}):
            await asyncio.sleep(10)
            return "slow done"

    @server.tool()
    async def hang() -> str:
        """Never answers."""
        async with _tracked("hang", {}):
            await asyncio.Event().wait()
            return "never"

    @server.tool()
    async def fast1() -> str:
        """0.3 s."""
        async with _tracked("fast1", {}):
            await asyncio.sleep(0.3)
            return "ok1"

    @server.tool()
    async def fast2() -> str:
        """0.3 s."""
        async with _tracked("fast2", {}):
            await asyncio.sleep(0.3)
            return "ok2"

    @server.tool()
    async def query_db(sql: str = "") -> str:
        """Returns LOG.big_result."""
        async with _tracked("query_db", {"sql": sql}):
            return LOG.big_result

    @server.tool()
    async def write_file(path: str, content: str) -> str:
        """Pretends to write a file."""
        async with _tracked("write_file", {"path": path, "content": content}):
            return f"wrote {len(content)} bytes to {path}"

    return server


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    server = build_server()
    with serve_asgi(server.streamable_http_app()) as url:
        yield url + "/mcp"


@pytest.fixture(autouse=True)
def fresh_log() -> None:
    LOG.__init__()  # type: ignore[misc]


def loop_gateway(upstream: MockUpstream, mcp_url: str, **kw: Any) -> Any:
    kw.setdefault("mcp_server", (f"tools={mcp_url}",))
    # The tool lists (seven tools here) are charged for every request that keeps them, so loop
    # semantics are tested at 4 MiB; the budget cases (B19) pass the CASES.md 1 MiB themselves.
    kw.setdefault("max_retained_bytes", 4 * 1048576)
    kw.setdefault("tool_timeout", 1.0)
    kw.setdefault("tool_concurrency", 2)
    return gateway(upstream, **kw)


def post_streamed(url: str, timeout: float = 60) -> list[tuple[str, Any]]:
    """POST a streamed request that declares the MCP server ``tools``; the SSE events answered."""
    r = httpx.post(
        url + "/v1/responses",
        json={"model": "m", "input": "x", "tools": [TOOLS_DECL], "stream": True},
        timeout=timeout,
    )
    return sse_events(r.content)


def fc_reply(*calls: dict[str, Any]) -> Reply:
    return Reply.json(
        response_obj(list(calls), usage={"input_tokens": 10, "output_tokens": 2, "total_tokens": 12})
    )


def final_reply(text: str = "all done") -> Reply:
    return Reply.json(
        response_obj([message_item(text)], usage={"input_tokens": 20, "output_tokens": 3, "total_tokens": 23})
    )


def fc_stream(call: dict[str, Any], seq0: int = 2) -> list[bytes]:
    added = {**call, "arguments": "", "status": "in_progress"}
    return [
        *PRE(),
        E(
            "response.output_item.added",
            {"type": "response.output_item.added", "sequence_number": seq0, "output_index": 0, "item": added},
        ),
        E(
            "response.function_call_arguments.delta",
            {
                "type": "response.function_call_arguments.delta",
                "sequence_number": seq0 + 1,
                "item_id": call["id"],
                "output_index": 0,
                "delta": call["arguments"],
            },
        ),
        E(
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "sequence_number": seq0 + 2,
                "output_index": 0,
                "item": call,
            },
        ),
        DONE(seq0 + 3, [call]),
    ]


def text_stream(text: str) -> list[bytes]:
    item = message_item(text)
    return [
        *PRE(),
        E(
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "sequence_number": 2,
                "output_index": 0,
                "item": {**item, "content": [], "status": "in_progress"},
            },
        ),
        E(
            "response.content_part.added",
            {
                "type": "response.content_part.added",
                "sequence_number": 3,
                "output_index": 0,
                "item_id": "msg_1",
                "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []},
            },
        ),
        E(
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "sequence_number": 4,
                "output_index": 0,
                "item_id": "msg_1",
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            },
        ),
        E(
            "response.output_text.done",
            {
                "type": "response.output_text.done",
                "sequence_number": 5,
                "output_index": 0,
                "item_id": "msg_1",
                "content_index": 0,
                "text": text,
                "logprobs": [],
            },
        ),
        E(
            "response.content_part.done",
            {
                "type": "response.content_part.done",
                "sequence_number": 6,
                "output_index": 0,
                "item_id": "msg_1",
                "content_index": 0,
                "part": {"type": "output_text", "text": text, "annotations": []},
            },
        ),
        E(
            "response.output_item.done",
            {"type": "response.output_item.done", "sequence_number": 7, "output_index": 0, "item": item},
        ),
        DONE(8, [item]),
    ]


def outputs_sent(upstream: MockUpstream, i: int) -> dict[str, str]:
    """call_id -> output of the function_call_output items the upstream received in call i."""
    items = upstream.requests[i].json()["input"]
    return {
        it["call_id"]: it["output"]
        for it in items
        if isinstance(it, dict) and it.get("type") == "function_call_output"
    }


# -- a three-round loop, buffered and streamed ---------------------------------------------------
def test_three_round_loop_buffered(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(
        fc_reply(FC("call_1", "lookup", '{"q":"a"}')),
        fc_reply(FC("call_2", "lookup", '{"q":"b"}')),
        final_reply(),
    )
    with loop_gateway(upstream, mcp_url) as (url, _), sdk(url) as client:
        m = MetricDelta()
        response = client.responses.create(
            model="m", input="list the documents", tools=[TOOLS_DECL], tool_choice="required"
        )
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["mcp_list_tools", "mcp_call", "mcp_call", "message"]
    assert response.output_text == "all done"
    listed = response.output[0]
    assert {t.name for t in listed.tools} >= {"lookup", "slow", "fast1", "write_file"}
    call = response.output[1]
    assert (call.name, call.server_label, call.arguments, call.output) == (
        "lookup",
        "tools",
        '{"q":"a"}',
        "ok",
    )
    assert response.usage is not None and response.usage.total_tokens == 12 + 12 + 23
    assert response.tool_choice == "required"  # the client's own value is echoed
    assert response.id.startswith("resp_") and response.id != "resp_up"
    assert LOG.calls == [
        ("lookup", {"q": "a", "p": "", "location": ""}),
        ("lookup", {"q": "b", "p": "", "location": ""}),
    ]
    assert len(upstream.requests) == 3
    first, second = upstream.requests[0].json(), upstream.requests[1].json()
    assert [t["type"] for t in first["tools"]] == ["function"] * len(first["tools"])
    assert "reasoning.encrypted_content" in first["include"]
    assert first["tool_choice"] == "required" and second["tool_choice"] == "auto"
    assert "max_tool_calls" not in first
    assert [it.get("type", "message") for it in second["input"]] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    assert outputs_sent(upstream, 1) == {"call_1": "ok"}
    assert outputs_sent(upstream, 2) == {"call_1": "ok", "call_2": "ok"}
    assert m.delta("loopwarden_tool_calls_total", outcome="ok") == 2
    assert m.delta("loopwarden_inference_rounds_count") == 1
    assert m.delta("loopwarden_inference_rounds_sum") == 3


def test_three_round_loop_streamed_passes_the_sdk_stream_helper(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(
        Reply.sse(fc_stream(FC("call_1", "lookup", '{"q":"a"}'))),
        Reply.sse(fc_stream(FC("call_2", "lookup", '{"q":"b"}'))),
        Reply.sse(text_stream("all done")),
    )
    with (
        loop_gateway(upstream, mcp_url) as (url, _),
        sdk(url) as client,
        client.responses.stream(model="m", input="go", tools=[TOOLS_DECL]) as stream,
    ):
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types.count("response.created") == 1 and types.count("response.in_progress") == 1
    assert types[-1] == "response.completed" and types.count("response.completed") == 1
    assert "response.function_call_arguments.delta" not in types
    assert types.count("response.mcp_call.completed") == 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    ids = {
        e.response.id
        for e in events
        if e.type in ("response.created", "response.in_progress", "response.completed")
    }
    assert len(ids) == 1 and ids != {"resp_up"}
    assert [item.type for item in final.output] == ["mcp_list_tools", "mcp_call", "mcp_call", "message"]
    assert final.output_text == "all done"
    indexes = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert indexes == list(range(4))
    assert LOG.count("lookup") == 2
    assert len(upstream.requests) == 3


# -- max_infer_iters (B01) ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 10])
def test_b01_model_that_always_calls_a_tool_gets_508_after_exactly_n_calls(
    upstream: MockUpstream, mcp_url: str, n: int
) -> None:
    upstream.push(*[fc_reply(FC(f"call_{i}", "lookup", "{}")) for i in range(n + 2)])
    with loop_gateway(upstream, mcp_url, max_infer_iters=n) as (url, _), sdk(url, max_retries=2) as client:
        m = MetricDelta()
        with pytest.raises(openai.APIStatusError) as info:
            client.responses.create(model="m", input="list the documents", tools=[TOOLS_DECL])
    assert info.value.status_code == 508
    assert info.value.response.headers["x-should-retry"] == "false"
    body = info.value.response.json()
    assert body["error"]["code"] == "max_infer_iters_exceeded"
    assert body["error"]["type"] == "server_error"
    assert len(upstream.requests) == n, "exactly max_infer_iters upstream calls, and no SDK retry"
    assert LOG.count("lookup") == n - 1
    assert m.delta("loopwarden_cap_hits_total", limit="max_infer_iters", outcome="508") == 1


def test_b01_streaming_variant_is_one_error_frame(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(*[Reply.sse(fc_stream(FC(f"call_{i}", "lookup", "{}"))) for i in range(4)])
    with loop_gateway(upstream, mcp_url) as (url, _):
        m = MetricDelta()
        events = post_streamed(url, timeout=30)
    names = [name for name, _ in events]
    assert names[0] == "response.created"
    assert names.count("error") == 1 and names[-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "max_infer_iters_exceeded"
    assert "response.completed" not in names
    assert len(upstream.requests) == 3 and LOG.count("lookup") == 2
    assert m.delta("loopwarden_cap_hits_total", limit="max_infer_iters", outcome="sse_error") == 1


# -- mixed rounds, max_tool_calls (B02), timeouts (B16) ------------------------------------------------
def test_mixed_round_runs_gateway_calls_and_hands_client_calls_back(
    upstream: MockUpstream, mcp_url: str
) -> None:
    upstream.push(fc_reply(FC("call_g", "lookup", "{}"), FC("call_T", "get_time", "{}")))
    with loop_gateway(upstream, mcp_url) as (url, _), sdk(url) as client:
        response = client.responses.create(model="m", input="plan my day", tools=[TOOLS_DECL, GET_TIME])
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["mcp_list_tools", "function_call", "mcp_call"]
    assert response.output[1].call_id == "call_T"
    assert response.output[2].output == "ok"
    assert len(upstream.requests) == 1
    assert LOG.count("lookup") == 1


def test_b02a_parallel_calls_over_max_tool_calls(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(
        fc_reply(
            FC("call_a", "lookup", '{"p":"1"}'),
            FC("call_b", "lookup", '{"p":"2"}'),
            FC("call_c", "lookup", '{"p":"3"}'),
        )
    )
    with loop_gateway(upstream, mcp_url) as (url, _), sdk(url) as client:
        m = MetricDelta()
        response = client.responses.create(
            model="m", input="find files", tools=[TOOLS_DECL], max_tool_calls=2
        )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_tool_calls"
    assert [c.arguments for c in response.output if c.type == "mcp_call"] == ['{"p":"1"}', '{"p":"2"}']
    assert [args["p"] for _, args in LOG.calls] == ["1", "2"]
    assert m.delta("loopwarden_tool_calls_total", outcome="ok") == 2
    assert m.delta("loopwarden_cap_hits_total", limit="max_tool_calls", outcome="incomplete") == 1


def test_b02b_sequential_calls_stop_at_max_tool_calls_before_the_iteration_cap(
    upstream: MockUpstream, mcp_url: str
) -> None:
    upstream.push(*[fc_reply(FC(f"call_{i}", "lookup", "{}")) for i in range(6)])
    with loop_gateway(upstream, mcp_url, max_infer_iters=10) as (url, _), sdk(url) as client:
        response = client.responses.create(
            model="m", input="find files", tools=[TOOLS_DECL], max_tool_calls=2
        )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_tool_calls"
    assert LOG.count("lookup") == 2
    assert len(upstream.requests) == 3
    assert [c.type for c in response.output] == ["mcp_list_tools", "mcp_call", "mcp_call"]


def test_b16_hung_tool_times_out_while_the_others_finish(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(
        fc_reply(FC("call_s", "hang", "{}"), FC("call_f1", "fast1", "{}"), FC("call_f2", "fast2", "{}")),
        final_reply(),
    )
    with loop_gateway(upstream, mcp_url) as (url, _), sdk(url) as client:
        m = MetricDelta()
        started = time.monotonic()
        response = client.responses.create(model="m", input="go", tools=[TOOLS_DECL])
        elapsed = time.monotonic() - started
    assert response.status == "completed"
    assert 1.0 <= elapsed < 4.0
    sent = outputs_sent(upstream, 1)
    assert set(sent) == {"call_s", "call_f1", "call_f2"}
    assert "timed out after 1" in sent["call_s"]
    assert (sent["call_f1"], sent["call_f2"]) == ("ok1", "ok2")
    assert LOG.peak <= 2
    failed = [c for c in response.output if c.type == "mcp_call" and c.status == "failed"]
    assert [c.name for c in failed] == ["hang"]
    assert m.delta("loopwarden_tool_calls_total", outcome="timeout") == 1
    assert m.delta("loopwarden_cap_hits_total", limit="tool_timeout", outcome="tool_error") == 1


# -- tool results and the ledger (B19) -----------------------------------------------------------
def test_b19_huge_tool_result_is_502_buffered_and_never_reaches_upstream(
    upstream: MockUpstream, mcp_url: str
) -> None:
    LOG.big_result = "r" * (5 * 1024 * 1024)
    upstream.push(fc_reply(FC("call_q", "query_db", '{"sql":"select *"}')), final_reply())
    with loop_gateway(
        upstream, mcp_url, tool_max_result_bytes=16 * 1024 * 1024, tool_timeout=20, max_retained_bytes=1048576
    ) as (url, _):
        m = MetricDelta()
        r = httpx.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "tools": [TOOLS_DECL]}, timeout=60
        )
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert len(upstream.requests) == 1
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="502") == 1


def test_b19_streamed_overflow_is_one_error_frame_after_the_mcp_call_events(
    upstream: MockUpstream, mcp_url: str
) -> None:
    LOG.big_result = "r" * (5 * 1024 * 1024)
    upstream.push(
        Reply.sse(fc_stream(FC("call_q", "query_db", '{"sql":"select *"}'))), Reply.sse(text_stream("x"))
    )
    with loop_gateway(
        upstream, mcp_url, tool_max_result_bytes=16 * 1024 * 1024, tool_timeout=20, max_retained_bytes=1048576
    ) as (url, _):
        m = MetricDelta()
        r = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [TOOLS_DECL], "stream": True},
            timeout=60,
        )
    events = sse_events(r.content)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert "response.mcp_call.in_progress" in names
    assert not any(n.startswith("response.function_call") for n in names)
    assert not any(d.get("item", {}).get("type") == "function_call" for _, d in events)
    assert names.count("error") == 1 and names[-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "max_retained_bytes_exceeded"
    assert len(upstream.requests) == 1
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="sse_error") == 1


def test_items_kept_as_added_are_charged_in_a_streamed_loop(upstream: MockUpstream, mcp_url: str) -> None:
    """The stitcher keeps each visible item as the upstream added it for the round (the response
    stored when the client goes away mid-round shows it), charged to the ledger: six ~250 KB
    ``output_item.added`` frames each fit alone (the frame's own charge is released after it),
    but the items kept together are over a 4 MiB request's limit — one error frame and
    ``response.failed``, where they were kept uncharged and the stream completed."""
    items = [
        {
            **message_item("x", f"msg_{i}"),
            "content": [],
            "status": "in_progress",
            "metadata": {"n": "n" * 250_000},
        }
        for i in range(6)
    ]
    stream = [
        *PRE(),
        *(
            E(
                "response.output_item.added",
                {
                    "type": "response.output_item.added",
                    "sequence_number": 2 + i,
                    "output_index": i,
                    "item": item,
                },
            )
            for i, item in enumerate(items)
        ),
        DONE(8, [message_item("x", f"msg_{i}") for i in range(6)]),
    ]
    upstream.push(Reply.sse(stream))
    with loop_gateway(upstream, mcp_url) as (url, _):
        m = MetricDelta()
        events = post_streamed(url)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    added = [
        d["item"]["id"]
        for n, d in events
        if n == "response.output_item.added" and d["item"]["type"] == "message"
    ]
    assert 1 <= len(added) < 6  # refused at the item that did not fit, not at the first
    assert names.count("error") == 1 and names[-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "max_retained_bytes_exceeded"
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="sse_error") == 1


def test_default_result_cap_turns_a_huge_result_into_an_error_output(
    upstream: MockUpstream, mcp_url: str
) -> None:
    LOG.big_result = "r" * (5 * 1024 * 1024)
    upstream.push(fc_reply(FC("call_q", "query_db", "{}")), final_reply())
    with (
        loop_gateway(upstream, mcp_url, tool_max_result_bytes=262_144, tool_timeout=20) as (url, _),
        sdk(url) as client,
    ):
        m = MetricDelta()
        response = client.responses.create(model="m", input="x", tools=[TOOLS_DECL])
    assert response.status == "completed"
    sent = outputs_sent(upstream, 1)["call_q"]
    assert "per-call cap of 262,144 bytes" in sent and "--tool-max-result-bytes" in sent and len(sent) < 1000
    assert m.delta("loopwarden_tool_calls_total", outcome="too_large") == 1


# -- allowlist ----------------------------------------------------------------------------------------
def test_client_declared_server_outside_the_allowlist_is_400(upstream: MockUpstream, mcp_url: str) -> None:
    declared = {
        "type": "mcp",
        "server_label": "evil",
        "server_url": "http://127.0.0.1:1/mcp",
        "require_approval": "never",
    }
    with loop_gateway(upstream, mcp_url, mcp_allow=("http://allowed.example/",)) as (url, _):
        r = httpx.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "tools": [declared]}, timeout=10
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "mcp_server_not_allowed"
    assert r.json()["error"]["param"] == "tools"
    assert upstream.requests == []


def test_client_declared_server_inside_the_allowlist_runs(upstream: MockUpstream, mcp_url: str) -> None:
    declared = {
        "type": "mcp",
        "server_label": "mine",
        "server_url": mcp_url,
        "require_approval": "never",
        "headers": {"x-token": "s3cret"},
    }
    upstream.push(fc_reply(FC("call_1", "lookup", "{}")), final_reply())
    with (
        loop_gateway(upstream, mcp_url, mcp_allow=(mcp_url.rsplit("/", 1)[0] + "/",), mcp_server=()) as (
            url,
            _,
        ),
        sdk(url) as client,
    ):
        response = client.responses.create(model="m", input="x", tools=[declared])  # type: ignore[list-item]
    assert response.status == "completed"
    assert LOG.count("lookup") == 1
    assert "s3cret" not in response.to_json()


# -- arguments (B06, B07) -----------------------------------------------------------------------------
def test_b06a_stream_dies_mid_arguments_and_nothing_runs(upstream: MockUpstream, mcp_url: str) -> None:
    added = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_W",
        "name": "write_file",
        "arguments": "",
        "status": "in_progress",
    }
    parts = [
        *PRE(),
        E(
            "response.output_item.added",
            {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": added},
        ),
        E(
            "response.function_call_arguments.delta",
            {
                "type": "response.function_call_arguments.delta",
                "sequence_number": 3,
                "item_id": "fc_1",
                "output_index": 0,
                "delta": '{"path":"a.txt","content":"hel',
            },
        ),
        RST,
    ]
    upstream.push(Reply.sse(parts))
    with loop_gateway(upstream, mcp_url) as (url, _):
        r = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "save a note", "tools": [TOOLS_DECL], "stream": True},
            timeout=10,
        )
        upstream.push(Reply(headers=[("content-type", "text/event-stream")], parts=parts, framing="chunked"))
        buffered = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "save a note", "tools": [TOOLS_DECL]},
            timeout=10,
        )
    names = [n for n, _ in sse_events(r.content)]
    assert names[-2:] == ["error", "response.failed"] and names.count("error") == 1
    assert sse_events(r.content)[-2][1]["code"] == "upstream_incomplete"
    assert buffered.status_code == 502
    assert LOG.count("write_file") == 0


def test_b06b_invalid_json_arguments_are_fed_back_not_run(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(fc_reply(FC("call_W", "write_file", '{"path":"a.txt","content":"hel')), final_reply())
    with loop_gateway(upstream, mcp_url) as (url, _), sdk(url) as client:
        m = MetricDelta()
        response = client.responses.create(model="m", input="save a note", tools=[TOOLS_DECL])
    assert response.status == "completed"
    assert LOG.count("write_file") == 0
    assert "not valid JSON" in outputs_sent(upstream, 1)["call_W"]
    assert len(upstream.requests) == 2  # the error output costs an inference call
    assert m.delta("loopwarden_tool_calls_total", outcome="invalid_arguments") == 1


def test_b07_null_and_empty_arguments(upstream: MockUpstream, mcp_url: str) -> None:
    call = FC("call_L", "lookup", '{"location": "Boston"}')
    added = {**call, "arguments": None, "status": "in_progress"}
    parts = [
        *PRE(),
        E(
            "response.output_item.added",
            {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": added},
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
        E(
            "response.function_call_arguments.done",
            {
                "type": "response.function_call_arguments.done",
                "sequence_number": 5,
                "item_id": call["id"],
                "output_index": 0,
            },
        ),
        DONE(6, [call]),
    ]
    upstream.push(
        Reply.sse(parts), Reply.sse(fc_stream(FC("call_F", "fast1", ""))), Reply.sse(text_stream("fine"))
    )
    with loop_gateway(upstream, mcp_url) as (url, _):
        r = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [TOOLS_DECL], "stream": True},
            timeout=20,
        )
    names = [n for n, _ in sse_events(r.content)]
    assert "error" not in names and names[-1] == "response.completed"
    assert LOG.calls[0] == ("lookup", {"q": "", "p": "", "location": "Boston"})
    assert LOG.calls[1] == ("fast1", {})
    assert outputs_sent(upstream, 2) == {"call_L": "ok", "call_F": "ok1"}


# -- incomplete (B26), disconnect (B14b) --------------------------------------------------------------
def test_b26_upstream_incomplete_runs_no_tool(upstream: MockUpstream, mcp_url: str) -> None:
    partial = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "lookup",
        "arguments": '{"q":"ab',
        "status": "incomplete",
    }
    upstream.push(
        Reply.json(
            response_obj([partial], status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        )
    )
    with loop_gateway(upstream, mcp_url) as (url, _), sdk(url) as client:
        response = client.responses.create(
            model="m", input="write two paragraphs", tools=[TOOLS_DECL], max_output_tokens=16
        )
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    assert LOG.calls == []
    assert len(upstream.requests) == 1


def test_b26_streamed_incomplete_ends_with_response_incomplete(upstream: MockUpstream, mcp_url: str) -> None:
    incomplete = E(
        "response.incomplete",
        {
            "type": "response.incomplete",
            "sequence_number": 2,
            "response": response_obj(
                [], status="incomplete", incomplete_details={"reason": "max_output_tokens"}
            ),
        },
    )
    upstream.push(Reply.sse([*PRE(), incomplete]))
    with loop_gateway(upstream, mcp_url) as (url, _):
        r = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [TOOLS_DECL], "stream": True},
            timeout=10,
        )
    events = sse_events(r.content)
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert len(upstream.requests) == 1


def test_b14b_client_disconnect_cancels_the_running_tool(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(Reply.sse(fc_stream(FC("call_s", "slow", "{}"))), Reply.sse(text_stream("late")))
    with loop_gateway(upstream, mcp_url, tool_timeout=30) as (url, _):
        m = MetricDelta()

        def client() -> None:
            with httpx.stream(
                "POST",
                url + "/v1/responses",
                json={"model": "m", "input": "x", "tools": [TOOLS_DECL], "stream": True},
                timeout=10,
            ) as r:
                for line in r.iter_lines():
                    if "mcp_call.in_progress" in line:
                        time.sleep(0.2)
                        return

        thread = threading.Thread(target=client)
        thread.start()
        thread.join(10)
        deadline = time.monotonic() + 3
        while "slow" not in LOG.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
    assert LOG.cancelled == ["slow"]
    assert len(upstream.requests) == 1
    assert m.delta("loopwarden_client_disconnects_total") == 1


def test_requests_without_gateway_tools_are_untouched_by_the_loop(
    upstream: MockUpstream, mcp_url: str
) -> None:
    body = response_obj([FC("call_T", "get_time", "{}")])
    upstream.push(Reply.json(body), Reply.json(body))
    with loop_gateway(upstream, mcp_url) as (url, _):
        stateless = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [GET_TIME], "store": False},
            timeout=10,
        )
        stored = httpx.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "tools": [GET_TIME]}, timeout=10
        )
    request = {"model": "m", "input": "x", "tools": [GET_TIME], "store": False}
    complete = copy.deepcopy(body)
    normalise_response(complete, request)  # only the echo fields the upstream left out are filled
    answer = stateless.json()
    # the upstream sent no created_at: both fills say "now", which may fall in different seconds
    assert abs(answer.pop("created_at") - complete.pop("created_at")) <= 5
    assert answer == complete and answer["output"] == body["output"]
    assert json.loads(upstream.requests[0].body) == {
        "model": "m",
        "input": "x",
        "tools": [GET_TIME],
        "store": False,
    }
    # with the store on, the gateway owns the history: the upstream stores nothing
    sent = json.loads(upstream.requests[1].body)
    assert sent["store"] is False and sent["input"] == "x" and sent["tools"] == [GET_TIME]
    assert stored.json()["id"] != "resp_up" and stored.json()["output"] == body["output"]
