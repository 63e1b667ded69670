"""Chat Completions upstreams end to end (issue 25): a real uvicorn, the official ``openai`` SDK,
a scripted Chat server returning exact bytes (tests/chat_upstream.py), ``--upstream-api chat``.

Acceptance behaviours of ../shared/specs/chat-completions-translation.md §1.10 are named by number
(``#N``); every translated answer is validated against the Open Responses schema.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.chat_upstream import (
    CHAT_DONE,
    USAGE,
    calls_stream,
    chunk,
    completion,
    function_call,
    text_stream,
    tool_fragment,
)
from tests.helpers import MetricDelta, gateway, sdk, sse_events
from tests.mcp_servers import Probe, build_tools_server, serve_mcp
from tests.mock_upstream import MockUpstream, Reply
from tests.spec_schema import assert_response, assert_stream

WEATHER = {
    "type": "function",
    "name": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
MODELS = {"chat-model": {}, "tolerant-model": {"tool_call_profile": "tolerant"}}


@pytest.fixture(scope="module")
def upstream() -> Iterator[MockUpstream]:
    with MockUpstream() as mock:
        yield mock


@pytest.fixture(scope="module")
def url(upstream: MockUpstream) -> Iterator[str]:
    with gateway(upstream, upstream_api="chat", models=MODELS) as (base, _):
        yield base


@pytest.fixture(autouse=True)
def _fresh(upstream: MockUpstream) -> None:
    upstream.replies.clear()
    upstream.requests.clear()


def _sent(upstream: MockUpstream, i: int = -1) -> dict[str, Any]:
    request = upstream.requests[i]
    assert request.path == "/v1/chat/completions"
    body = request.json()
    assert isinstance(body, dict)
    return body


def _stream(url: str, **params: Any) -> list[tuple[str, Any]]:
    """The SSE events of one streamed create (raw HTTP, so every frame is seen)."""
    with httpx.Client(timeout=10) as client:
        raw = client.post(f"{url}/v1/responses", json={"model": "chat-model", "stream": True, **params})
    assert raw.status_code == 200, raw.text
    return sse_events(raw.content)


# -- buffered ------------------------------------------------------------------------------------
def test_buffered_text_round_trip_maps_usage_and_the_request(upstream: MockUpstream, url: str) -> None:
    """#1, #2: text and usage field by field; instructions as the first system message,
    max_output_tokens on max_completion_tokens, no compressed answer asked for."""
    upstream.push(Reply.json(completion("Hello there")))
    with sdk(url) as client:
        raw = client.responses.with_raw_response.create(
            model="chat-model", input="hi", instructions="be brief", max_output_tokens=50, temperature=0.5
        )
    body = raw.http_response.json()
    assert_response(body)
    assert body["status"] == "completed" and body["output"][0]["type"] == "message"
    assert body["output"][0]["content"][0]["text"] == "Hello there"
    assert body["usage"] == {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 3},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 18,
    }
    assert body["instructions"] == "be brief" and body["max_output_tokens"] == 50  # echoed from the request
    sent = _sent(upstream)
    assert sent["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert sent["max_completion_tokens"] == 50 and sent["temperature"] == 0.5
    assert "stream" not in sent and "store" not in sent and "include" not in sent and "input" not in sent
    assert upstream.requests[-1].headers.get("accept-encoding") == "identity"


def test_buffered_client_tool_calls_are_handed_back(upstream: MockUpstream, url: str) -> None:
    """Two parallel calls in one buffered reply become two function_call items, in order."""
    calls = [
        function_call("call_a", "weather", '{"city":"Oslo"}'),
        function_call("call_b", "weather", '{"city":"Rome"}'),
    ]
    upstream.push(Reply.json(completion(None, tool_calls=calls, finish="tool_calls")))
    with sdk(url) as client:
        raw = client.responses.with_raw_response.create(model="chat-model", input="weather?", tools=[WEATHER])  # type: ignore[list-item]
    assert_response(raw.http_response.json())
    response = raw.parse()
    assert [
        (o.type, getattr(o, "call_id", None), getattr(o, "arguments", None)) for o in response.output
    ] == [
        ("function_call", "call_a", '{"city":"Oslo"}'),
        ("function_call", "call_b", '{"city":"Rome"}'),
    ]
    sent = _sent(upstream)
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "weather", "parameters": WEATHER["parameters"]}}
    ]


def test_buffered_length_finish_is_incomplete(upstream: MockUpstream, url: str) -> None:
    """#13: finish_reason length -> incomplete, reason max_output_tokens."""
    upstream.push(Reply.json(completion("cut", finish="length")))
    with sdk(url) as client:
        response = client.responses.create(model="chat-model", input="hi", max_output_tokens=1)
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )


def test_continuation_replays_calls_and_outputs_as_chat_messages(upstream: MockUpstream, url: str) -> None:
    """#3, #4, #21: a stored response's calls come back on the next turn (previous_response_id)
    as one assistant message with both tool_calls, each output a tool message, order kept."""
    calls = [
        function_call("call_a", "weather", '{"city":"Oslo"}'),
        function_call("call_b", "weather", '{"city":"Rome"}'),
    ]
    upstream.push(
        Reply.json(completion(None, tool_calls=calls, finish="tool_calls")), Reply.json(completion("done"))
    )
    with sdk(url) as client:
        first = client.responses.create(model="chat-model", input="weather?", tools=[WEATHER])  # type: ignore[list-item]
        outputs = [
            {"type": "function_call_output", "call_id": c, "output": f"sunny {c}"}
            for c in ("call_a", "call_b")
        ]
        second = client.responses.create(
            model="chat-model",
            previous_response_id=first.id,
            input=outputs,
            tools=[WEATHER],  # type: ignore[arg-type,list-item]
        )
    assert second.output_text == "done"
    messages = _sent(upstream)["messages"]
    assert messages == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**c, "function": c["function"]} for c in calls],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny call_a"},
        {"role": "tool", "tool_call_id": "call_b", "content": "sunny call_b"},
    ]


# -- streamed -------------------------------------------------------------------------------------
def test_streamed_text_has_the_canonical_sequence(upstream: MockUpstream, url: str) -> None:
    """#8: the exact event list, sequence numbers 0..n, one item id throughout; usage forced."""
    upstream.push(Reply.sse(text_stream("Hel", "lo")))
    events = _stream(url, input="hi")
    assert_stream(events)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    item_ids = {data["item_id"] for _, data in events if "item_id" in data}
    assert len(item_ids) == 1 and item_ids == {events[-1][1]["response"]["output"][0]["id"]}
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["total_tokens"] == 18
    sent = _sent(upstream)
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_streamed_tool_calls_split_and_interleaved_through_the_sdk(upstream: MockUpstream, url: str) -> None:
    """#9, #10: two calls (indexes 0 and 1) with interleaved argument fragments -> two items with
    their own output_index, arguments not mixed, `name` on .done; the SDK's stream agrees."""
    fragments = [
        tool_fragment(0, id="call_a", name="weather", args=""),
        tool_fragment(0, args='{"city":'),
        tool_fragment(1, id="call_b", name="weather", args='{"ci'),
        tool_fragment(0, args='"Oslo"}'),
        tool_fragment(1, args='ty":"Rome"}'),
    ]
    upstream.push(Reply.sse(calls_stream(fragments)))
    with (
        sdk(url) as client,
        client.responses.stream(model="chat-model", input="w", tools=[WEATHER]) as stream,
    ):  # type: ignore[list-item]
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [(o.call_id, o.arguments) for o in final.output if o.type == "function_call"] == [
        ("call_a", '{"city":"Oslo"}'),
        ("call_b", '{"city":"Rome"}'),
    ]
    assert (
        kinds.count("response.output_item.added") == 2
        and kinds.count("response.function_call_arguments.done") == 2
    )
    upstream.push(Reply.sse(calls_stream(fragments)))
    events = _stream(url, input="w", tools=[WEATHER])
    assert_stream(events)
    added = [d["output_index"] for n, d in events if n == "response.output_item.added"]
    assert added == [0, 1]
    done = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert [(d["output_index"], d["name"], d["arguments"]) for d in done] == [
        (0, "weather", '{"city":"Oslo"}'),
        (1, "weather", '{"city":"Rome"}'),
    ]


def test_stop_finish_with_streamed_calls_still_hands_them_back(upstream: MockUpstream, url: str) -> None:
    """#14: Ollama's finish_reason stop after streamed calls: the calls are still the round's."""
    upstream.push(
        Reply.sse(calls_stream([tool_fragment(0, id="call_a", name="weather", args="{}")], finish="stop"))
    )
    events = _stream(url, input="w", tools=[WEATHER])
    assert [o["type"] for o in events[-1][1]["response"]["output"]] == ["function_call"]


def test_streamed_length_is_response_incomplete(upstream: MockUpstream, url: str) -> None:
    """#13 streamed: response.incomplete, items incomplete."""
    upstream.push(Reply.sse(text_stream("cut", finish="length")))
    events = _stream(url, input="hi")
    assert_stream(events)
    name, data = events[-1]
    assert name == "response.incomplete" and data["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert data["response"]["output"][0]["status"] == "incomplete"


def test_every_call_on_index_zero_strict_fails_tolerant_splits(upstream: MockUpstream, url: str) -> None:
    """#15: strict -> one error event (+ response.failed), counted; tolerant -> two calls."""
    fragments = [
        tool_fragment(0, id="call_a", name="weather", args='{"city":"Oslo"}'),
        tool_fragment(0, id="call_b", name="weather", args='{"city":"Rome"}'),
    ]
    upstream.push(Reply.sse(calls_stream(fragments)))
    delta = MetricDelta()
    events = _stream(url, input="w", tools=[WEATHER])
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "upstream_invalid_response"
    assert "tool_call_profile: tolerant" in events[-2][1]["message"]
    assert delta.delta("loopwarden_translation_failures_total", reason="invalid_tool_stream") == 1
    upstream.push(Reply.sse(calls_stream(fragments)))
    events = _stream(url, input="w", tools=[WEATHER], model="tolerant-model")
    assert_stream(events)
    calls = [(o["call_id"], o["arguments"]) for o in events[-1][1]["response"]["output"]]
    assert calls == [("call_a", '{"city":"Oslo"}'), ("call_b", '{"city":"Rome"}')]


def test_stream_without_a_finish_reason_is_one_error_frame(upstream: MockUpstream, url: str) -> None:
    """#16: [DONE] before any finish reason -> upstream_incomplete error frame, nothing completed."""
    upstream.push(Reply.sse([chunk({"content": "partial"}), CHAT_DONE]))
    events = _stream(url, input="hi")
    names = [n for n, _ in events]
    assert "response.completed" not in names and names[-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "upstream_incomplete"


def test_buffered_failures_are_502_with_a_static_message(upstream: MockUpstream, url: str) -> None:
    """A body that is not a chat.completion -> 502, the upstream's bytes not reflected."""
    upstream.push(Reply.json({"choices": [], "secret": "do-not-echo"}))
    with sdk(url) as client, pytest.raises(openai.InternalServerError) as info:
        client.responses.create(model="chat-model", input="hi")
    assert info.value.status_code == 502 and "do-not-echo" not in info.value.message
    assert "not a valid chat.completion" in info.value.message


# -- errors -------------------------------------------------------------------------------------------
def test_upstream_429_keeps_retry_after_and_the_code(upstream: MockUpstream, url: str) -> None:
    """#19: 429 with Retry-After -> 429, the same Retry-After, the envelope with the code."""
    envelope = {
        "error": {"message": "slow down", "type": "requests", "code": "rate_limit_exceeded", "extra": "x"}
    }
    reply = Reply.json(envelope, status=429)
    reply.headers.append(("retry-after", "7"))
    upstream.push(reply)
    with sdk(url) as client, pytest.raises(openai.RateLimitError) as info:
        client.responses.create(model="chat-model", input="hi")
    assert info.value.response.headers["retry-after"] == "7"
    body = info.value.response.json()
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["message"].startswith("slow down")
    assert "extra" not in body["error"]


def test_upstream_500_is_502(upstream: MockUpstream, url: str) -> None:
    upstream.push(Reply.json({"error": {"message": "boom", "type": "server_error"}}, status=500))
    with sdk(url) as client, pytest.raises(openai.InternalServerError) as info:
        client.responses.create(model="chat-model", input="hi")
    assert info.value.status_code == 502


def test_unsupported_tool_is_400_before_any_upstream_call(upstream: MockUpstream, url: str) -> None:
    """#7: a tool type Chat cannot express -> 400 naming it, the upstream not called."""
    delta = MetricDelta()
    with sdk(url) as client, pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="chat-model", input="hi", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert (
        "unsupported Responses tool type for Chat Completions translation: web_search" in info.value.message
    )
    assert upstream.requests == []
    assert delta.delta("loopwarden_translation_failures_total", reason="unsupported_request") == 1


# -- the loop -----------------------------------------------------------------------------------------
def test_multi_round_mcp_loop_over_a_chat_upstream(upstream: MockUpstream) -> None:
    """#20: round 1 calls a gateway MCP tool, round 2 answers: one logical stream, one
    response.created, an mcp_call, usage summed; round 2 got the call and its output as messages."""
    probe = Probe()
    with (
        serve_mcp(build_tools_server(probe)) as (mcp_url, _),
        gateway(upstream, upstream_api="chat", mcp_server=(f"tools={mcp_url}",)) as (base, _),
    ):
        upstream.push(
            Reply.sse(calls_stream([tool_fragment(0, id="call_1", name="lookup", args='{"q":"x"}')])),
            Reply.sse(text_stream("found ", "it")),
        )
        tools = [{"type": "mcp", "server_label": "tools", "require_approval": "never"}]
        with httpx.Client(timeout=20) as client:
            raw = client.post(
                f"{base}/v1/responses", json={"model": "m", "input": "look", "stream": True, "tools": tools}
            )
        events = sse_events(raw.content)
    assert_stream(events)
    names = [n for n, _ in events]
    assert names.count("response.created") == 1 and names[-1] == "response.completed"
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]][-2:] == ["mcp_call", "message"]
    assert final["output"][-1]["content"][0]["text"] == "found it"
    assert final["usage"]["total_tokens"] == 2 * USAGE["total_tokens"]
    ids = [o["id"] for o in final["output"]]
    assert len(set(ids)) == len(ids)
    second = json.loads(upstream.requests[1].body)["messages"]
    assert (
        second[-2]["tool_calls"][0]["id"] == "call_1"
        and second[-2]["tool_calls"][0]["function"]["name"] == "lookup"
    )
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_1"
    assert "lookup q=x" in second[-1]["content"]


def test_streamed_reasoning_is_its_own_item_through_the_sdk(upstream: MockUpstream, url: str) -> None:
    """#11 through the gateway: reasoning (reasoning_content dialect) then text; the whole stream
    valid against the spec, and the SDK's stream ends with both items."""
    frames = [
        chunk({"role": "assistant", "reasoning_content": "think"}),
        chunk({"content": "answer"}),
        chunk({}, "stop"),
        CHAT_DONE,
    ]
    upstream.push(Reply.sse(frames))
    events = _stream(url, input="q")
    assert_stream(events)
    output = events[-1][1]["response"]["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    upstream.push(Reply.sse(frames))
    with sdk(url) as client, client.responses.stream(model="chat-model", input="q") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "answer"


def test_ledger_overflow_in_translation_is_502_buffered_and_an_error_frame_streamed(
    upstream: MockUpstream, url: str
) -> None:
    """#18 ledger: a Chat reply too big for the request's ledger (1 MiB here) -> 502
    max_retained_bytes_exceeded buffered; one error frame once the stream is committed."""
    upstream.push(Reply.json(completion("y" * 200_000)))
    with sdk(url) as client, pytest.raises(openai.InternalServerError) as info:
        client.responses.create(model="chat-model", input="hi")
    assert info.value.status_code == 502 and info.value.code == "max_retained_bytes_exceeded"
    upstream.push(Reply.sse(text_stream(*["y" * 4000] * 100)))
    events = _stream(url, input="hi")
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "max_retained_bytes_exceeded"
    assert events[0][0] == "response.created"


# -- the attacker's defects (D1, D2, D4, D5, D6) through the gateway --------------------------------
def test_a_lone_surrogate_is_502_buffered_and_an_error_frame_streamed(
    upstream: MockUpstream, url: str
) -> None:
    """D1: a lone surrogate in a buffered call's arguments -> 502 upstream_invalid_response (was
    500 internal_error); in a streamed delta after the stream committed -> error + response.failed."""
    calls = [function_call("c1", "weather", '{"city":"\ud800"}')]
    upstream.push(Reply.json(completion(None, tool_calls=calls, finish="tool_calls")))
    with sdk(url) as client, pytest.raises(openai.InternalServerError) as info:
        client.responses.create(model="chat-model", input="hi", tools=[WEATHER])  # type: ignore[list-item]
    assert info.value.status_code == 502 and info.value.code == "upstream_invalid_response"
    upstream.push(Reply.sse(text_stream("fine", "then \ud800")))
    events = _stream(url, input="hi")
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "upstream_invalid_response" and events[0][0] == "response.created"


def test_an_azure_stream_with_filter_metadata_chunks_completes(upstream: MockUpstream, url: str) -> None:
    """D2: Azure OpenAI's first chunk (choices [], empty id/model/object, prompt_filter_results)
    and a mid-stream content_filter_results chunk are skipped; the SDK gets the whole answer."""
    meta = {"id": "", "model": "", "object": "", "created": 0}
    first = {
        **meta,
        "choices": [],
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}],
    }
    late = {**meta, "choices": [{"index": 0, "finish_reason": None, "content_filter_results": {}}]}
    frames = text_stream("Hel", "lo")
    sse = [
        b"data: " + json.dumps(first).encode() + b"\n\n",
        *frames[:2],
        b"data: " + json.dumps(late).encode() + b"\n\n",
    ]
    upstream.push(Reply.sse([*sse, *frames[2:]]))
    with sdk(url) as client, client.responses.stream(model="chat-model", input="hi") as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "Hello"


def test_a_finish_without_done_on_an_open_connection_ends_after_the_grace(upstream: MockUpstream) -> None:
    """D5: finish reason and usage, then no [DONE] and the connection held open: the round ends
    about FINISH_GRACE_S (2 s) after the usage chunk, completed, with the usage (not at the read
    timeout, 30 s here); D4: a frame after [DONE] on a held connection is never read."""
    from middleware.upstream.chat.client import FINISH_GRACE_S as grace

    hold = threading.Event()
    with gateway(upstream, upstream_api="chat", models=MODELS, upstream_read_timeout=30.0) as (url, _):
        try:
            upstream.push(Reply.sse([*text_stream("done")[:-1], hold]))
            started = time.monotonic()
            events = _stream(url, input="hi")
            took = time.monotonic() - started
            assert events[-1][0] == "response.completed"
            assert events[-1][1]["response"]["usage"]["total_tokens"] == 18
            assert grace * 0.9 < took < grace * 2 + 6
            upstream.push(Reply.sse([*text_stream("done"), chunk({"content": "INJECTED"}), hold]))
            started = time.monotonic()
            events = _stream(url, input="hi")
            assert events[-1][0] == "response.completed" and time.monotonic() - started < grace
            assert "INJECTED" not in json.dumps(events)
        finally:
            hold.set()


def test_a_tool_role_reply_and_object_arguments_are_502(upstream: MockUpstream, url: str) -> None:
    """D6: role "tool" in a reply and arguments that are not JSON text -> 502, never a guess."""
    bad_args = {
        "id": "c1",
        "type": "function",
        "function": {"name": "weather", "arguments": {"city": "Oslo"}},
    }
    for body in (completion("x", role="tool"), completion(None, tool_calls=[bad_args], finish="tool_calls")):
        upstream.push(Reply.json(body))
        with sdk(url) as client, pytest.raises(openai.InternalServerError) as info:
            client.responses.create(model="chat-model", input="hi", tools=[WEATHER])  # type: ignore[list-item]
        assert info.value.status_code == 502 and info.value.code == "upstream_invalid_response"


def test_completed_at_is_set_on_a_completed_chat_response(upstream: MockUpstream, url: str) -> None:
    """D6: completed_at as the Responses path sets it (Unix seconds, at or after created_at)."""
    upstream.push(Reply.json(completion("hi")))
    with sdk(url) as client:
        response = client.responses.create(model="chat-model", input="hi")
    assert response.completed_at is not None and response.completed_at >= response.created_at
    assert abs(response.completed_at - time.time()) < 30
