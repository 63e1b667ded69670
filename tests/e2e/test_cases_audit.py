"""The CASES.md audit (issue 9): every expectation of B01–B27 that no other test asserted yet.

The audit read each case against the tests that name it (test_loop_e2e, test_limits_e2e,
test_store_e2e, test_sse, test_tools, test_passthrough, test_cardinality). What was already
asserted there is not repeated here; each test below names the case and the expectation it adds.
(CASES.md has no B04, B08, B13, B15, B20, B22 or B24.)

Knobs as CASES.md: B = 1 MiB, max_infer_iters 3, tool timeout 1 s, tool concurrency 2, upstream
timeouts 2 s. Gateway-owned tools come from the real MCP server of tests/mcp_servers.py.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from tests.helpers import (
    DONE,
    FC,
    PRE,
    B,
    MetricDelta,
    gateway,
    message_item,
    response_obj,
    sdk,
    settled,
    sse_events,
    text_delta,
    wait_for,
)
from tests.mcp_servers import Probe, build_tools_server, serve_mcp
from tests.mock_upstream import RST, E, MockUpstream, Reply

KEY = "k"
AUTH = {"authorization": f"Bearer {KEY}"}
# The CASES.md tools (the test server has more; only these are exposed).
CASE_TOOLS = ["lookup", "slow", "fast1", "fast2", "query_db", "write_file"]
TOOLS = {"type": "mcp", "server_label": "tools", "require_approval": "never", "allowed_tools": CASE_TOOLS}


def tools_with(*helpers: str) -> dict[str, Any]:
    """The tools declaration exposing only the named helpers of the test server."""
    return {**TOOLS, "allowed_tools": list(helpers)}


SLEEP = tools_with("sleep")


GET_TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
PROBE = Probe()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with serve_mcp(build_tools_server(PROBE)) as (url, _):
        yield url


@pytest.fixture(autouse=True)
def fresh_probe() -> None:
    PROBE.reset()


def tools_gateway(upstream: MockUpstream, mcp_url: str, **kw: Any) -> Any:
    """The gateway with the MCP server ``tools``. The tool lists are charged for every round, so
    (as in test_loop_e2e) loop semantics run at 4 MiB; budget cases pass B themselves."""
    kw.setdefault("mcp_server", (f"tools={mcp_url}",))
    kw.setdefault("max_retained_bytes", 4 * B)
    kw.setdefault("tool_timeout", 1.0)
    kw.setdefault("tool_concurrency", 2)
    return gateway(upstream, **kw)


def fc_reply(*calls: dict[str, Any]) -> Reply:
    return Reply.json(response_obj(list(calls)))


def final_reply(text: str = "done") -> Reply:
    return Reply.json(response_obj([message_item(text)]))


def added(index: int, item: dict[str, Any], seq: int) -> bytes:
    return E(
        "response.output_item.added",
        {"type": "response.output_item.added", "sequence_number": seq, "output_index": index, "item": item},
    )


def args_delta(item_id: str, delta: str, seq: int) -> bytes:
    return E(
        "response.function_call_arguments.delta",
        {
            "type": "response.function_call_arguments.delta",
            "sequence_number": seq,
            "item_id": item_id,
            "output_index": 0,
            "delta": delta,
        },
    )


def stored(client: httpx.Client, url: str, response_id: str) -> dict[str, Any]:
    r = client.get(f"{url}/v1/responses/{response_id}", headers=AUTH)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def created_id(raw: bytes) -> str:
    first = sse_events(raw)[0]
    assert first[0] == "response.created"
    return str(first[1]["response"]["id"])


def gateway_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith(("loopwarden", "uvicorn"))
    ]


# -- B02: the stored response of a max_tool_calls stop is incomplete ---------------------------------
def test_b02_stored_response_is_incomplete(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(
        fc_reply(
            FC("call_a", "lookup", '{"p":"1"}'),
            FC("call_b", "lookup", '{"p":"2"}'),
            FC("call_c", "lookup", '{"p":"3"}'),
        )
    )
    with tools_gateway(upstream, mcp_url) as (url, _), httpx.Client(timeout=20) as client:
        r = client.post(
            url + "/v1/responses",
            json={"model": "m", "input": "find files", "tools": [TOOLS], "max_tool_calls": 2},
            headers=AUTH,
        )
        kept = stored(client, url, r.json()["id"])
    assert r.json()["status"] == "incomplete"
    assert kept["status"] == "incomplete"
    assert kept["incomplete_details"] == {"reason": "max_tool_calls"}
    assert PROBE.names() == ["lookup", "lookup"]


# -- B06: mid-arguments truncation stored as failed; invalid arguments in a complete *stream* ---------
def write_file_parts(delta: str) -> list[Any]:
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_W", "name": "write_file"}
    return [
        *PRE(),
        added(0, {**item, "arguments": "", "status": "in_progress"}, 2),
        args_delta("fc_1", delta, 3),
    ]


def test_b06a_truncated_arguments_stream_is_stored_failed(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(Reply.sse([*write_file_parts('{"path":"a.txt","content":"hel'), RST]))
    with tools_gateway(upstream, mcp_url) as (url, _), httpx.Client(timeout=20) as client:
        r = client.post(
            url + "/v1/responses",
            json={"model": "m", "input": "save a note", "tools": [TOOLS], "stream": True},
            headers=AUTH,
        )
        kept = stored(client, url, created_id(r.content))
    assert sse_events(r.content)[-2][1]["code"] == "upstream_incomplete"
    assert kept["status"] == "failed"
    assert kept["error"]["code"] == "upstream_incomplete"
    assert "write_file" not in PROBE.names()


def test_b06b_invalid_arguments_in_a_complete_stream_are_fed_back_not_run(
    upstream: MockUpstream, mcp_url: str
) -> None:
    broken = '{"path":"a.txt","content":"hel'
    call = FC("call_W", "write_file", broken)
    done_args = E(
        "response.function_call_arguments.done",
        {
            "type": "response.function_call_arguments.done",
            "sequence_number": 4,
            "item_id": "fc_1",
            "output_index": 0,
            "arguments": broken,
        },
    )
    item_done = E(
        "response.output_item.done",
        {"type": "response.output_item.done", "sequence_number": 5, "output_index": 0, "item": call},
    )
    stream = [*write_file_parts(broken), done_args, item_done, DONE(6, [call])]
    upstream.push(Reply.sse(stream), Reply.sse([*PRE(), DONE(2, [message_item("sorry")])]))
    with tools_gateway(upstream, mcp_url) as (url, _), httpx.Client(timeout=20) as client:
        m = MetricDelta()
        r = client.post(
            url + "/v1/responses",
            json={"model": "m", "input": "save a note", "tools": [TOOLS], "stream": True},
            headers=AUTH,
        )
    names = [n for n, _ in sse_events(r.content)]
    assert names[-1] == "response.completed" and "error" not in names
    assert "write_file" not in PROBE.names()
    assert len(upstream.requests) == 2  # the fed-back error costs an inference call
    fed = [i for i in upstream.requests[1].json()["input"] if i.get("type") == "function_call_output"]
    assert fed == [
        {
            "type": "function_call_output",
            "call_id": "call_W",
            "output": "<error: arguments are not valid JSON>",
        }
    ]
    assert m.delta("loopwarden_tool_calls_total", outcome="invalid_arguments") == 1
    assert settled(m, "loopwarden_inference_rounds_sum", 2) == 2  # observed after the answer


# -- B07: re-emitted items carry valid JSON arguments ("{}" for an empty string) ----------------------
@pytest.mark.parametrize("stream", [False, True])
def test_b07_reemitted_mcp_call_arguments_are_valid_json(
    upstream: MockUpstream, mcp_url: str, stream: bool
) -> None:
    empty = FC("call_F", "fast1", "")
    if stream:
        upstream.push(
            Reply.sse([*PRE(), DONE(2, [empty])]), Reply.sse([*PRE(), DONE(2, [message_item("ok")])])
        )
    else:
        upstream.push(fc_reply(empty), final_reply())
    with tools_gateway(upstream, mcp_url) as (url, _), httpx.Client(timeout=20) as client:
        r = client.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [TOOLS], "stream": stream},
            headers=AUTH,
        )
    if stream:
        items = [d["item"] for n, d in sse_events(r.content) if n == "response.output_item.done"]
        final = sse_events(r.content)[-1][1]["response"]
        items += final["output"]
    else:
        items = r.json()["output"]
    calls = [item for item in items if item["type"] == "mcp_call"]
    assert calls, items
    assert PROBE.names() == ["fast1"]
    for call in calls:
        assert call["arguments"] == "{}", call  # valid JSON text, as the tool was run with {}


# -- B10: keep-alives while a gateway tool runs do not upset the official SDK ---------------------------
def test_b10_keepalives_during_a_tool_wait_through_the_sdk(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(
        Reply.sse([*PRE(), DONE(2, [FC("call_s", "sleep", '{"tag":"s","seconds":0.6}')])]),
        Reply.sse([*PRE(), DONE(2, [message_item("rested")])]),
    )
    raw: list[bytes] = []
    with tools_gateway(upstream, mcp_url, keepalive_interval=0.1) as (url, _):
        with sdk(url) as client:
            events = list(client.responses.create(model="m", input="x", tools=[SLEEP], stream=True))  # type: ignore[list-item]
        upstream.push(
            Reply.sse([*PRE(), DONE(2, [FC("call_s", "sleep", '{"tag":"t","seconds":0.6}')])]),
            Reply.sse([*PRE(), DONE(2, [message_item("rested")])]),
        )
        with httpx.stream(
            "POST",
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [SLEEP], "stream": True},
            timeout=20,
        ) as r:
            raw.extend(r.iter_bytes())
    body = b"".join(raw)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "rested"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert body.count(b": keep-alive\n\n") >= 3  # sent while the tool ran
    assert b"\nid:" not in body and b"retry:" not in body and not body.startswith(b"id:")
    assert all(data for _, data in sse_events(body))


# -- B11: function-call argument deltas split at every offset, end to end --------------------------------
ESCAPED = 'Info" style="margin-top: 12px;"></dl'  # on the wire: Info\" style=\"margin-top: 12px;\"></dl


def b11_stream() -> tuple[list[bytes], int, str]:
    deltas = ['{"html":"<dl class=\\"', ESCAPED, '>\\n"}']
    call = FC("call_h", "get_time", "".join(deltas))
    parts = [*PRE(), added(0, {**call, "arguments": "", "status": "in_progress"}, 2)]
    parts += [args_delta(call["id"], d, 3 + i) for i, d in enumerate(deltas)]
    parts.append(DONE(6, [call]))
    return parts, 4, "".join(deltas)  # index of the escaped-quote event


def normalised(raw: bytes) -> list[tuple[str, Any]]:
    out = []
    for name, data in sse_events(raw):
        if isinstance(data.get("response"), dict):
            data["response"]["id"] = "resp_gw"
            data["response"]["created_at"] = 0  # filled with "now" when the upstream omits it
        out.append((name, data))
    return out


def test_b11_argument_deltas_split_at_every_offset_give_identical_events(upstream: MockUpstream) -> None:
    parts, at, args = b11_stream()
    event = parts[at]
    assert b'Info\\" style=\\"' in event
    body = {"model": "m", "input": "x", "tools": [GET_TIME], "stream": True}
    with gateway(upstream) as (url, _), httpx.Client(timeout=20) as client:

        def run(chunks: list[bytes]) -> list[tuple[str, Any]]:
            upstream.push(Reply.sse(chunks))
            return normalised(client.post(url + "/v1/responses", json=body, headers=AUTH).content)

        reference = run(parts)
        variants = {
            "one chunk": [b"".join(parts)],
            "one byte per chunk": [bytes([b]) for b in b"".join(parts)],
        }
        for k in range(1, len(event)):
            variants[f"split at {k} ({event[k - 1 : k + 1]!r})"] = [
                b"".join(parts[:at]),
                event[:k],
                event[k:],
                b"".join(parts[at + 1 :]),
            ]
        for label, chunks in variants.items():
            assert run(chunks) == reference, label
    names = [n for n, _ in reference]
    assert "error" not in names and names[-1] == "response.completed"
    deltas = [d["delta"] for n, d in reference if n == "response.function_call_arguments.delta"]
    assert deltas[1] == ESCAPED and "".join(deltas) == args
    assert reference[-1][1]["response"]["output"][0]["arguments"] == args
    assert len(names) == len(set((n, d["sequence_number"]) for n, d in reference))  # nothing twice


# -- B12: no tool runs after an in-band error; non-stream keeps the Anthropic-style code --------------------
def test_b12_in_band_error_after_a_tool_call_runs_no_tool(upstream: MockUpstream, mcp_url: str) -> None:
    call = FC("call_l", "lookup", "{}")
    error = b'event: error\ndata: {"type":"error","sequence_number":3,"code":"server_error","message":"boom","param":null}\n\n'
    item_done = E(
        "response.output_item.done",
        {"type": "response.output_item.done", "sequence_number": 2, "output_index": 0, "item": call},
    )
    upstream.push(Reply.sse([*PRE(), item_done, error, DONE(4, [call])]))
    upstream.push(Reply.sse([*PRE(), item_done, error, DONE(4, [call])]))
    with tools_gateway(upstream, mcp_url) as (url, _), httpx.Client(timeout=20) as client:
        streamed = client.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [TOOLS], "stream": True},
            headers=AUTH,
        )
        buffered = client.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "tools": [TOOLS]}, headers=AUTH
        )
        kept = stored(client, url, created_id(streamed.content))
    names = [n for n, _ in sse_events(streamed.content)]
    assert names.count("error") == 1 and names[-2:] == ["error", "response.failed"]
    assert buffered.status_code == 502 and buffered.json()["error"]["code"] == "server_error"
    assert PROBE.names() == []
    assert len(upstream.requests) == 2  # one per client request: no further model call
    assert kept["status"] == "failed"


def test_b12_non_stream_anthropic_style_error_keeps_its_code(upstream: MockUpstream) -> None:
    error = (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    )
    upstream.push(Reply.sse([*PRE(), text_delta(2, "Hel"), error, DONE(4, [])]))
    with gateway(upstream) as (url, _):
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x"}, timeout=10)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "overloaded_error"
    assert "Overloaded" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"


# -- B14: after a disconnect the in-flight gauges are back at baseline and nothing is stored completed ------
def inflight() -> tuple[float, float]:
    return sample("loopwarden_inflight_requests"), sample("loopwarden_inflight_retained_bytes")


def test_b14a_disconnect_mid_stream_restores_gauges_and_stores_cancelled(
    upstream: MockUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    parts: list[Any] = [*PRE()]
    for i in range(300):
        parts += [0.1, text_delta(2 + i, "z")]
    upstream.push(Reply.sse(parts), Reply.json(response_obj([message_item("next")])))
    with gateway(upstream) as (url, _), httpx.Client(timeout=10) as client:
        baseline = inflight()
        m = MetricDelta()
        raw = b""
        with client.stream(
            "POST", url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, headers=AUTH
        ) as r:
            for chunk in r.iter_raw():
                raw += chunk
                if raw.count(b"\n\n") >= 4:
                    # read while the client is still connected: leaving iter_raw may close the
                    # connection, and a quick gateway then releases the request at once
                    during = inflight()
                    break
        assert wait_for(lambda: inflight() == baseline), (inflight(), baseline)
        assert wait_for(lambda: m.delta("loopwarden_client_disconnects_total") == 1)
        kept = stored(client, url, created_id(raw))
        follow = client.post(url + "/v1/responses", json={"model": "m", "input": "y"}, headers=AUTH)
    assert during[0] == baseline[0] + 1 and during[1] > baseline[1]
    assert kept["status"] in ("cancelled", "incomplete")  # CASES.md: not completed
    assert len(upstream.requests) == 2  # no further model call for the gone client
    assert follow.status_code == 200
    assert gateway_errors(caplog) == []


def test_b14b_disconnect_during_a_tool_restores_gauges_and_stores_no_completed(
    upstream: MockUpstream, mcp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    upstream.push(
        Reply.sse([*PRE(), DONE(2, [FC("call_s", "sleep", '{"tag":"s","seconds":10}')])]),
        Reply.sse([*PRE(), DONE(2, [message_item("late")])]),
    )
    with tools_gateway(upstream, mcp_url, tool_timeout=30.0) as (url, _), httpx.Client(timeout=10) as client:
        baseline = inflight()
        raw = b""
        with client.stream(
            "POST",
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [SLEEP], "stream": True},
            headers=AUTH,
        ) as r:
            for chunk in r.iter_raw():
                raw += chunk
                if b"mcp_call.in_progress" in raw:
                    time.sleep(0.2)
                    break
        gone = time.monotonic()
        assert PROBE.wait_cancelled("s", 2.0)
        cancelled_after = time.monotonic() - gone
        assert wait_for(lambda: inflight() == baseline), (inflight(), baseline)
        kept = stored(client, url, created_id(raw))
    assert cancelled_after <= 1.0
    assert kept["status"] in ("cancelled", "incomplete")  # CASES.md: not completed
    assert len(upstream.requests) == 1
    assert gateway_errors(caplog) == []


# -- B16: the hung call's MCP request is cancelled; nothing keeps running after the response ------------------
def test_b16_hung_call_is_cancelled_at_the_server_and_the_answer_takes_about_a_second(
    upstream: MockUpstream, mcp_url: str
) -> None:
    upstream.push(
        fc_reply(FC("call_s", "slow", "{}"), FC("call_f1", "fast1", "{}"), FC("call_f2", "fast2", "{}")),
        final_reply(),
    )
    with tools_gateway(upstream, mcp_url) as (url, _):
        started = time.monotonic()
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "tools": [TOOLS]}, timeout=20)
        wall = time.monotonic() - started
        assert PROBE.wait_cancelled("slow", 2.0), "the MCP request for slow was cancelled"
        assert wait_for(lambda: PROBE.active == 0), "no tool execution left running"
    assert r.status_code == 200 and r.json()["status"] == "completed"
    assert 1.0 <= wall < 2.0
    assert PROBE.peak <= 2


# -- B17c: the refusal from the header is counted --------------------------------------------------------------
def test_b17c_refusal_from_a_huge_content_length_is_counted(upstream: MockUpstream) -> None:
    from tests.helpers import raw_http, response_json

    with gateway(upstream) as (url, _):
        m = MetricDelta()
        head = b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000000\r\n\r\n"
        status, _, body = response_json(raw_http(url, head, b'{"model":"m","inpu', read_timeout=5))
    assert status == 413
    assert body["error"]["type"] == "invalid_request_error"
    assert settled(m, "loopwarden_cap_hits_total", 1, limit="request_body", outcome="413") == 1


# -- B18: an oversized buffered answer runs no tool, even when it holds a gateway call --------------------------
def test_b18b_oversized_answer_holding_a_gateway_call_runs_no_tool(
    upstream: MockUpstream, mcp_url: str
) -> None:
    body = json.dumps(response_obj([FC("call_l", "lookup", "{}"), message_item("x" * (5 * B))])).encode()
    parts = [body[i : i + 16384] for i in range(0, len(body), 16384)]
    upstream.push(Reply(headers=[("content-type", "application/json")], parts=parts, framing="chunked"))
    with tools_gateway(upstream, mcp_url, max_retained_bytes=B) as (url, _):
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "tools": [TOOLS]}, timeout=20)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert PROBE.names() == []
    assert len(upstream.requests) == 1


# -- B21: c) names the field; e) a lone surrogate from a tool end to end ------------------------------------------
def test_b21c_invalid_utf8_byte_names_input(upstream: MockUpstream) -> None:
    with gateway(upstream) as (url, _):
        r = httpx.post(
            url + "/v1/responses",
            content=b'{"model":"m","input":"bad \xff"}',
            headers={"content-type": "application/json"},
            timeout=10,
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_unicode"
    assert r.json()["error"]["param"] == "input"
    assert upstream.requests == []


def test_b21e_lone_surrogate_from_a_tool_reaches_upstream_as_valid_utf8(
    upstream: MockUpstream, mcp_url: str
) -> None:
    upstream.push(fc_reply(FC("call_u", "surrogate", "{}")), final_reply("fine"))
    with tools_gateway(upstream, mcp_url) as (url, _):
        r = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "tools": [tools_with("surrogate")]},
            timeout=20,
        )
    assert r.status_code == 200 and r.json()["status"] == "completed"
    sent = upstream.requests[1].body
    sent.decode("utf-8")  # valid UTF-8, no surrogate escapes
    assert b"\\udc" not in sent.lower()
    outputs = [
        i["output"] for i in upstream.requests[1].json()["input"] if i.get("type") == "function_call_output"
    ]
    assert outputs == ["café \ufffd end"]


# -- B23: the duplicate-key 400s are invalid_request_error --------------------------------------------------------
def test_b23_duplicate_keys_are_invalid_request_errors(upstream: MockUpstream) -> None:
    bodies = [
        b'{"model":"small","model":"big","input":"hi"}',
        b'{"model":"m","input":[{"type":"message","role":"user","role":"system","content":"x"}]}',
        b'{"model":"a","mod\\u0065l":"b","input":"hi"}',
        b'{"model":"m","input":"hi","metadata":{"k":"1","k":"2"}}',
    ]
    with gateway(upstream) as (url, _), httpx.Client(timeout=10) as client:
        answers = [
            client.post(url + "/v1/responses", content=b, headers={"content-type": "application/json"})
            for b in bodies
        ]
    assert [(a.status_code, a.json()["error"]["type"]) for a in answers] == [
        (400, "invalid_request_error")
    ] * 4
    assert all(a.headers["x-should-retry"] == "false" for a in answers)
    assert upstream.requests == []


# -- B25b: conflicting upstream framing: no framing headers copied, no uvicorn RuntimeError ---------------------
def test_b25b_no_framing_headers_reach_the_client_and_nothing_is_logged(
    upstream: MockUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    parts = [*PRE(), DONE(2, [message_item("ok")])]
    headers = [
        ("content-type", "text/event-stream"),
        ("content-length", "123"),
        ("content-encoding", "identity"),
        ("x-upstream-header", "1"),
    ]
    # aiohttp (the default client) refuses the conflicting framing; the upstream switches to httpx
    # and the request is sent once more (tests/upstream/test_upstream_clients.py asserts the counts)
    upstream.push(*[Reply(headers=headers, parts=parts, framing="chunked")] * 2)
    with gateway(upstream) as (url, _):
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10)
    assert r.status_code == 200
    assert "content-length" not in r.headers
    assert "content-encoding" not in r.headers
    assert r.headers.get("transfer-encoding") == "chunked"
    assert [n for n, _ in sse_events(r.content)][-1] == "response.completed"
    assert not [m for m in caplog.messages if "Content-Length" in m or "RuntimeError" in m]
    assert gateway_errors(caplog) == []


# -- B26: the exact a) body (reasoning + empty message); b) streamed incomplete is stored incomplete ----------------
def test_b26a_reasoning_only_incomplete_is_passed_through_and_stored(
    upstream: MockUpstream, mcp_url: str
) -> None:
    upstream.push(
        Reply.json(
            {
                "id": "resp_up",
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
                "output": [
                    {"type": "reasoning", "id": "rs_1", "summary": []},
                    {"type": "message", "id": "msg_1", "role": "assistant", "content": []},
                ],
            }
        )
    )
    with tools_gateway(upstream, mcp_url) as (url, _), httpx.Client(timeout=20) as client:
        r = client.post(
            url + "/v1/responses",
            json={"model": "m", "input": "write two paragraphs", "max_output_tokens": 16, "tools": [TOOLS]},
            headers=AUTH,
        )
        kept = stored(client, url, r.json()["id"])
    assert r.status_code == 200
    assert r.json()["status"] == "incomplete"
    assert r.json()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in r.json()["output"] if i["type"] != "mcp_list_tools"] == [
        "reasoning",
        "message",
    ]
    assert kept["status"] == "incomplete"
    assert len(upstream.requests) == 1


def test_b26b_streamed_incomplete_is_stored_incomplete(upstream: MockUpstream) -> None:
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
    with gateway(upstream) as (url, _), httpx.Client(timeout=10) as client:
        r = client.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "stream": True, "max_output_tokens": 16},
            headers=AUTH,
        )
        kept = stored(client, url, created_id(r.content))
    assert [n for n, _ in sse_events(r.content)][-1] == "response.incomplete"
    assert kept["status"] == "incomplete"
    assert kept["incomplete_details"] == {"reason": "max_output_tokens"}


# -- B27: scrape time is unaffected by many distinct request strings ------------------------------------------------
def test_b27_scrape_time_is_unaffected(upstream: MockUpstream) -> None:
    def scrape_time(client: httpx.Client, url: str) -> float:
        times = []
        for _ in range(7):
            started = time.perf_counter()
            assert client.get(url + "/metrics").status_code == 200
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    with gateway(upstream) as (url, _), httpx.Client(timeout=10) as client:
        before = scrape_time(client, url)
        for _ in range(200):
            marker = uuid.uuid4().hex
            upstream.push(Reply.json({"error": {"message": f"engine {marker} died"}}, status=500))
            client.post(
                url + "/v1/responses",
                json={
                    "model": f"m-{marker}",
                    "input": "hi",
                    "user": marker,
                    "metadata": {"session": marker},
                    "tools": [{"type": "function", "name": f"t_{marker}", "parameters": {"type": "object"}}],
                },
            )
        after = scrape_time(client, url)
    assert after < max(3 * before, before + 0.02), (before, after)  # series growth would show


# -- always true: a worker that refused or failed a request serves the next one ------------------------------------
def test_the_worker_serves_the_next_request_after_each_failure_class(upstream: MockUpstream) -> None:
    failures: list[tuple[bytes, Reply | None]] = [
        (b'{"model":"m","input":"x","metadata":{"k":"1","k":"2"}}', None),  # 400
        (b'{"model":"m","input":"' + b"a" * (B // 32) + b'"}', None),  # 413
        (b'{"model":"m","input":"x","stream":true}', Reply.sse([*PRE(), RST])),  # error frame
        (b'{"model":"m","input":"x"}', Reply.json({"error": {"message": "down"}}, status=503)),  # 502
    ]
    with gateway(upstream) as (url, _), httpx.Client(timeout=10) as client:
        for body, reply in failures:
            if reply is not None:
                upstream.push(reply)
            client.post(url + "/v1/responses", content=body, headers={"content-type": "application/json"})
            upstream.push(final_reply("next"))
            follow = client.post(url + "/v1/responses", json={"model": "m", "input": "y"})
            assert follow.status_code == 200, body[:60]
            assert follow.json()["output"][0]["content"][0]["text"] == "next"
        assert wait_for(lambda: sample("loopwarden_inflight_requests") == 0)
