"""Everything the gateway emits, validated against the Open Responses spec's own schemas.

Real gateway on uvicorn (`tests.helpers.gateway` / `make run`'s defaults: the embedded dev model and
the demo MCP server), a real MCP server (`tests.mcp_servers`), scripted upstreams and recorded
cassettes (OpenAI and vLLM shapes). `tests.spec_schema` does the checking; OpenAI's MCP tool, items
and events are checked against the installed ``openai`` SDK's types (a documented deviation).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from middleware.app import create_app
from middleware.config import Settings
from middleware.dev.devmodel import build_response
from tests import spec_schema
from tests.helpers import DONE, FC, PRE, gateway, message_item, response_obj, sse_events, text_delta
from tests.mcp_servers import Probe, build_tools_server, serve_mcp
from tests.mock_upstream import RST, E, MockUpstream, Reply, cassettes_dir, load_cassette
from tests.servers import serve_asgi

DEMO = {"type": "mcp", "server_label": "demo", "require_approval": "never"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


@pytest.fixture(autouse=True)
def _spec() -> None:
    spec_schema.require_spec()


@pytest.fixture(scope="module")
def dev_url() -> Iterator[str]:
    """The gateway as ``make run`` starts it: embedded dev model, demo MCP server, memory store."""
    with serve_asgi(create_app(Settings(store="memory"))) as url:
        yield url


def post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/responses", json=body, headers=headers, timeout=30)


def buffered(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A buffered answer, validated; returns it."""
    answer = post(url, {**body, "stream": False})
    assert answer.status_code == 200, answer.text
    payload: dict[str, Any] = answer.json()
    spec_schema.assert_response(payload)
    return payload


def streamed(url: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """A streamed answer: every event validated, sequence numbers 0..N; returns the events."""
    answer = post(url, {**body, "stream": True})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = sse_events(answer.content)
    spec_schema.assert_stream(events)
    return events


CASES: dict[str, dict[str, Any]] = {
    "basic": {"model": "dev", "input": "Say hello in exactly 3 words."},
    "basic item": {
        "model": "dev",
        "input": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}],
    },
    "system prompt": {
        "model": "dev",
        "input": [
            {"type": "message", "role": "system", "content": "You are a pirate."},
            {"type": "message", "role": "user", "content": "Say hello."},
        ],
    },
    "instructions": {"model": "dev", "instructions": "Be brief.", "input": "hi", "temperature": 0.2},
    "tool call": {"model": "dev", "input": "What's the weather in San Francisco?", "tools": [WEATHER]},
    "tool choice required": {"model": "dev", "input": "hi", "tools": [WEATHER], "tool_choice": "required"},
    "image input": {
        "model": "dev",
        "input": [
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What do you see?"},
                    {"type": "input_image", "image_url": PIXEL},
                    {"type": "input_image", "image_url": "https://example.com/logo.png", "detail": "low"},
                ],
            }
        ],
    },
    "multi-turn": {
        "model": "dev",
        "input": [
            {"type": "message", "role": "user", "content": "My name is Alice."},
            {"type": "message", "role": "assistant", "content": "Hello Alice!"},
            {"type": "message", "role": "user", "content": "What is my name?"},
        ],
    },
    "incomplete": {"model": "dev", "input": "one two three four five six", "max_output_tokens": 16 // 8},
    "mcp loop": {"model": "dev", "input": "calculate 6*7", "tools": [DEMO]},
}


@pytest.mark.parametrize("store", [True, False], ids=["store", "no-store"])
@pytest.mark.parametrize("case", list(CASES))
def test_dev_model_answers_conform_buffered_and_streamed(dev_url: str, case: str, store: bool) -> None:
    body = {**CASES[case], "store": store}
    response = buffered(dev_url, body)
    events = streamed(dev_url, body)
    final = events[-1][1]["response"]
    for answer in (response, final):
        types = [item["type"] for item in answer["output"]]
        if case.startswith("tool"):
            assert types == ["function_call"] and answer["output"][0]["name"] == "get_weather"
            assert answer["tools"][0]["strict"] is True  # the spec's default, echoed
        elif case == "mcp loop":
            assert types == ["mcp_list_tools", "mcp_call", "message"]
        else:
            assert types == ["message"]
        assert answer["status"] == ("incomplete" if case == "incomplete" else "completed")
        assert answer["store"] is store
        assert answer["temperature"] == body.get("temperature", 1.0)
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]


def test_continuation_and_stored_objects_conform(dev_url: str) -> None:
    first = buffered(dev_url, {"model": "dev", "input": "My name is Alice."})
    second = buffered(
        dev_url, {"model": "dev", "input": "What is my name?", "previous_response_id": first["id"]}
    )
    assert second["previous_response_id"] == first["id"]
    events = streamed(dev_url, {"model": "dev", "input": "calculate 2+2", "tools": [DEMO]})
    stream_id = events[-1][1]["response"]["id"]
    for response_id in (first["id"], second["id"], stream_id):
        got = httpx.get(f"{dev_url}/v1/responses/{response_id}", timeout=10)
        assert got.status_code == 200, got.text
        spec_schema.assert_response(got.json())
        assert got.json()["id"] == response_id
        items = httpx.get(f"{dev_url}/v1/responses/{response_id}/input_items", timeout=10)
        assert items.status_code == 200, items.text
        assert items.json()["data"], items.text
        for item in items.json()["data"]:
            spec_schema.assert_valid("ItemField", item)
    stored = httpx.get(f"{dev_url}/v1/responses/{stream_id}", timeout=10).json()
    assert [item["type"] for item in stored["output"]] == ["mcp_list_tools", "mcp_call", "message"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("POST", "/v1/responses", b"{not json", 400, None),
        ("POST", "/v1/responses", b'{"model": "dev", "input": 7}', 400, None),
        ("GET", "/v1/responses/resp_unknown", b"", 404, "not_found"),
        ("GET", "/v1/nowhere", b"", 404, "unknown_url"),
        ("DELETE", "/v1/models", b"", 405, "method_not_allowed"),
        (
            "POST",
            "/v1/responses",
            b'{"model": "dev", "input": "hi", "background": true, "store": false}',
            400,
            "invalid_value",
        ),
        ("POST", "/v1/responses/resp_unknown/cancel", b"", 404, "not_found"),
        ("GET", "/v1/responses/resp_unknown/cancel", b"", 405, "method_not_allowed"),
        ("POST", "/v1/conversations/conv_unknown", b'{"metadata": {}}', 404, "not_found"),
        ("GET", "/v1/conversations/conv_unknown/items/msg_1", b"", 404, "not_found"),
        ("DELETE", "/v1/conversations/conv_unknown/items/msg_1", b"", 404, "not_found"),
    ],
)
def test_error_envelopes_conform(
    dev_url: str, method: str, path: str, body: bytes, status: int, code: str | None
) -> None:
    answer = httpx.request(
        method, dev_url + path, content=body, headers={"content-type": "application/json"}, timeout=10
    )
    assert answer.status_code == status, answer.text
    payload = answer.json()
    spec_schema.assert_error_envelope(payload)
    if code is not None:
        assert payload["error"]["code"] == code
    expected_type = "invalid_request_error" if status < 500 else "server_error"
    assert payload["error"]["type"] == expected_type


def test_cancel_of_a_stored_foreground_response_is_a_conforming_400(dev_url: str) -> None:
    created = buffered(dev_url, {"model": "dev", "input": "hi", "store": True})
    answer = httpx.post(f"{dev_url}/v1/responses/{created['id']}/cancel", timeout=10)
    assert answer.status_code == 400, answer.text
    payload = answer.json()
    spec_schema.assert_error_envelope(payload)
    assert payload["error"]["type"] == "invalid_request_error"
    assert "background" in payload["error"]["message"]


def test_loop_cap_envelope_stream_error_and_stored_failure_conform() -> None:
    body = {"model": "dev", "input": "loop forever", "tools": [DEMO]}
    with serve_asgi(create_app(Settings(store="memory", max_infer_iters=2))) as url:
        answer = post(url, body)
        assert answer.status_code == 508
        spec_schema.assert_error_envelope(answer.json())
        assert answer.json()["error"]["code"] == "max_infer_iters_exceeded"
        events = streamed(url, body)
        failed = events[-1][1]["response"]
        got = httpx.get(f"{url}/v1/responses/{failed['id']}", timeout=10)
    error_name, error = events[-2]
    assert (error_name, error["error"]["code"]) == ("error", "max_infer_iters_exceeded")
    assert failed["status"] == "failed" and failed["error"]["code"] == "max_infer_iters_exceeded"
    assert failed["tools"][0]["server_label"] == "demo" and failed["model"] == "dev"
    assert got.status_code == 200, got.text
    spec_schema.assert_response(got.json())
    assert got.json()["status"] == "failed"


# -- scripted upstreams: minimal objects the gateway must complete -------------------------------


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with serve_mcp(build_tools_server(Probe())) as (url, _):
        yield url


LOOKUP = FC("call_1", "lookup", '{"q":"x"}')


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_real_mcp_loop_on_a_minimal_upstream_conforms(
    upstream: MockUpstream, mcp_url: str, stream: bool
) -> None:
    """The upstream's objects carry only id/object/status/output (and vLLM's null top_logprobs):
    the client still gets spec-complete objects, with the request's echo fields."""
    final = response_obj([message_item("all done")], top_logprobs=None, usage={"input_tokens": 3})
    if stream:
        upstream.push(
            Reply.sse([*PRE(), DONE(2, [LOOKUP])]),
            Reply.sse([*PRE(), DONE(2, [message_item("all done")])]),
        )
    else:
        upstream.push(Reply.json(response_obj([LOOKUP])), Reply.json(final))
    tools = [{"type": "mcp", "server_label": "tools", "require_approval": "never"}]
    body = {"model": "m", "input": "look it up", "tools": tools, "top_p": 0.5, "safety_identifier": "u1"}
    with gateway(upstream, mcp_server=(f"tools={mcp_url}",), max_retained_bytes=4 << 20) as (url, _):
        answer = streamed(url, body)[-1][1]["response"] if stream else buffered(url, body)
    assert [item["type"] for item in answer["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    assert (answer["top_p"], answer["safety_identifier"], answer["top_logprobs"]) == (0.5, "u1", 0)
    assert (answer["temperature"], answer["truncation"], answer["prompt_cache_key"]) == (
        1.0,
        "disabled",
        None,
    )


def test_approval_request_items_conform(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(Reply.json(response_obj([LOOKUP])))
    body = {"model": "m", "input": "look it up", "tools": [{"type": "mcp", "server_label": "tools"}]}
    with gateway(upstream, mcp_server=(f"tools={mcp_url}",), max_retained_bytes=4 << 20) as (url, _):
        answer = buffered(url, body)
    assert [item["type"] for item in answer["output"]] == ["mcp_list_tools", "mcp_approval_request"]


def test_passthrough_minimal_upstream_is_completed_from_the_request(upstream: MockUpstream) -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    sent = {"model": "m", "input": "hi", "store": False, "tools": [tool], "presence_penalty": 0.5}
    upstream.push(Reply.json(response_obj([message_item("hi")], tools=[tool], temperature=None)))
    upstream.push(Reply.sse([*PRE(), DONE(2, [message_item("hi")])]))
    with gateway(upstream) as (url, _):
        answer = buffered(url, sent)
        events = streamed(url, sent)
    for response in (answer, events[0][1]["response"], events[-1][1]["response"]):
        assert (response["presence_penalty"], response["temperature"]) == (0.5, 1.0)
        assert response["tools"] == [{**tool, "description": None, "strict": True}]


@pytest.mark.parametrize("store", [False, True], ids=["passthrough", "loop"])
def test_one_created_at_for_every_object_of_a_response_the_upstream_left_it_out_of(
    upstream: MockUpstream, monkeypatch: pytest.MonkeyPatch, store: bool
) -> None:
    """The upstream sends no ``created_at``: the created, in-progress and terminal events (and the
    stored object) all say the request's own second, not each the second it was filled in (a
    clock that ticks at every read makes any second fill differ)."""
    import itertools
    import types

    from middleware.loop import echo

    ticks = itertools.count(1_900_000_000)
    monkeypatch.setattr(echo, "time", types.SimpleNamespace(time=lambda: next(ticks)))
    upstream.push(Reply.sse([*PRE(), DONE(2, [message_item("hi")])]))
    with gateway(upstream) as (url, _):
        events = streamed(url, {"model": "m", "input": "hi", "store": store})
        stamps = {data["response"]["created_at"] for _, data in events if "response" in data}
        assert len(stamps) == 1, stamps
        if store:
            stored = httpx.get(f"{url}/v1/responses/{events[-1][1]['response']['id']}", timeout=10).json()
            assert stored["created_at"] in stamps


def test_a_complete_upstream_body_is_forwarded_byte_for_byte(upstream: MockUpstream) -> None:
    request = {"model": "m", "input": "hi", "store": False, "tools": [WEATHER]}
    complete = build_response(request)
    spec_schema.assert_response(complete)
    wire = json.dumps(complete, separators=(",", ":")).encode()
    upstream.push(Reply.json(wire))
    with gateway(upstream) as (url, _):
        answer = post(url, request)
    assert answer.status_code == 200 and answer.content == wire


def test_upstream_failures_conform_before_and_after_commit(upstream: MockUpstream) -> None:
    upstream.push(Reply.json({"error": {"message": "boom", "type": "server_error"}}, status=500))
    upstream.push(Reply.sse([*PRE(), RST]))
    body = {"model": "m", "input": "hi", "store": False}
    with gateway(upstream) as (url, _):
        answer = post(url, body)
        events = streamed(url, body)
    assert answer.status_code == 502
    spec_schema.assert_error_envelope(answer.json())
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert events[-1][1]["response"]["error"]["code"] == "upstream_incomplete"


UPSTREAM_ERROR = E(
    "error", {"type": "error", "sequence_number": 2, "code": "server_is_overloaded", "message": "busy"}
)
BIG_DELTA = text_delta(2, "x" * 300_000)


@pytest.mark.parametrize(
    ("parts", "code"),
    [
        ([*PRE(), UPSTREAM_ERROR], "server_is_overloaded"),
        ([*PRE(), BIG_DELTA], "max_retained_bytes_exceeded"),
    ],
    ids=["upstream-error-event", "ledger-overflow"],
)
@pytest.mark.parametrize("store", [False, True], ids=["passthrough", "store"])
def test_failures_after_commit_are_an_error_event_and_a_complete_failed_response(
    upstream: MockUpstream, parts: list[bytes], code: str, store: bool
) -> None:
    upstream.push(Reply.sse(parts))
    body = {"model": "m", "input": "hi", "store": store, "temperature": 0.3}
    with gateway(upstream) as (url, _):
        events = streamed(url, body)
    (_, error), (_, failed) = events[-2:]
    assert error["type"] == "error" and error["error"]["code"] == code and error["code"] == code
    response = failed["response"]
    assert (response["status"], response["error"]["code"], response["temperature"]) == ("failed", code, 0.3)


@pytest.mark.parametrize("status", [400, 429, 503])
def test_upstream_error_answers_become_conforming_envelopes(upstream: MockUpstream, status: int) -> None:
    envelope = {"error": {"message": "nope", "type": "invalid_request_error", "code": None, "param": None}}
    upstream.push(Reply.json(envelope, status=status))
    with gateway(upstream) as (url, _):
        answer = post(url, {"model": "m", "input": "hi", "store": False})
    assert answer.status_code == (status if status < 500 else 502)
    spec_schema.assert_error_envelope(answer.json())
    assert answer.json()["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")


# -- recorded traffic ---------------------------------------------------------------------------

CASSETTES = cassettes_dir()
# The Responses-over-HTTP recordings (the codex/ ones are WebSocket and client transcripts).
REPLAYED = ["tool_calls/multi_turn/*.yaml", "events/*.yaml", "reasoning/**/*.yaml", "tool_loop/*.yaml"]
ITEM_EVENTS = {"response.output_item.added", "response.output_item.done"}


def _cassettes() -> list[str]:
    if CASSETTES is None:
        return ["<absent>"]
    return sorted(str(p.relative_to(CASSETTES)) for pattern in REPLAYED for p in CASSETTES.glob(pattern))


def _upstream_item_deviations(item: dict[str, Any]) -> list[str]:
    """What an output item breaks of the spec (``ItemField``), for items forwarded as the
    upstream sent them: vLLM's items carry ``status: null``, reasoning ``content`` /
    ``encrypted_content`` null, messages and calls without ``type`` / ``id``."""
    return [f"{item.get('type')}: {problem}" for problem in spec_schema.errors("ItemField", item)]


@pytest.mark.skipif(
    CASSETTES is None, reason="no cassettes: set $LOOPWARDEN_CASSETTES or check out ../shared/cassettes"
)
@pytest.mark.parametrize("store", [False, True], ids=["passthrough", "store"])
@pytest.mark.parametrize("name", _cassettes())
def test_replayed_cassettes_conform(upstream: MockUpstream, name: str, store: bool) -> None:
    """The first turn of each recording (OpenAI and vLLM shapes), through the gateway: every
    response object (buffered, or in the created / in_progress / terminal events) is complete
    — vLLM's ``top_logprobs: null``, ``text.verbosity: null`` and missing ``store`` /
    ``safety_identifier`` / ``prompt_cache_key`` filled — and every event conforms, except the
    upstream's own output items and event types, forwarded as received: their deviations are
    only vLLM's known ones."""
    assert CASSETTES is not None
    turn = next(load_cassette(Path(CASSETTES) / name))
    request = {**copy.deepcopy(turn.request), "store": store}
    request.pop("previous_response_id", None)
    upstream.push(turn.reply)
    with gateway(upstream, max_retained_bytes=4 << 20) as (url, _):
        stream = turn.events is not None
        answer = post(url, {**request, "stream": stream})
    assert answer.status_code == 200, answer.text
    events = sse_events(answer.content) if stream else [("response", {"response": answer.json()})]
    deviations: set[str] = set()
    for index, (kind, event) in enumerate(events):
        if stream:
            assert event["sequence_number"] == index and kind == event["type"]
        view = copy.deepcopy(event)
        items = [view.pop("item")] if kind in ITEM_EVENTS else []
        if isinstance(view.get("response"), dict):
            items += view["response"]["output"]
            view["response"]["output"] = []
            spec_schema.assert_response(view["response"])
        if stream and not spec_schema.known_event(kind):  # vLLM's response.reasoning_part.*
            deviations.add(f"event {kind}")
        elif stream and isinstance(view.get("response"), dict):
            spec_schema.assert_event(view)  # a response object's event: the gateway's to complete
        elif stream:  # forwarded as received: the upstream's content (vLLM's parts, ...)
            schema = spec_schema.event_schemas().get(kind)
            instance = {**view, "item": None} if kind in ITEM_EVENTS else view
            problems = spec_schema.errors(schema, instance) if schema else []
            deviations.update(f"{kind}: {problem}" for problem in problems)
        for item in items:
            deviations.update(_upstream_item_deviations(item))
    final = events[-1][1]["response"]
    recorded = turn.body if turn.body is not None else (turn.events or [{}])[-1].get("response", {})
    if recorded.get("output"):  # vLLM's streamed terminal events carry an empty output
        assert final["output"] == recorded["output"]
    vllm = "vllm" in name or "gpt-oss" in name or name.startswith("tool_calls/multi_turn/responses_")
    assert not deviations or vllm, (name, deviations)
