"""The embedded development model, end to end: a real uvicorn and the official SDK with strict validation.

`_strict_response_validation=True` makes the SDK validate every response object and SSE event against
its pydantic types, so a missing required field fails these tests instead of surfacing later.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from middleware.dev.devmodel import (
    GREETING,
    build_response,
    create_devmodel_app,
    parse_request,
    response_events,
)
from tests.servers import serve_asgi

GET_TIME: Any = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {}},
}
CALCULATE: Any = {
    "type": "function",
    "name": "calculate",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
}
TOOLS: Any = [GET_TIME, CALCULATE]

TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
CALL_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serve_asgi(create_devmodel_app()) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[OpenAI]:
    with OpenAI(
        base_url=base_url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


def calls(response: Any) -> list[tuple[str, Any]]:
    """(name, decoded arguments) of each function_call in `response.output`."""
    return [
        (item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"
    ]


# --- buffered --------------------------------------------------------------------------------------


def test_text_answer_echoes_the_user_text(client: OpenAI) -> None:
    response = client.responses.create(model="dev", input="hello")
    assert response.status == "completed"
    assert response.output_text == "You said: hello"
    assert response.model == "dev"
    assert response.id.startswith("resp_")
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert (message.role, message.status) == ("assistant", "completed")
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        1,
        3,
        4,
    )
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.incomplete_details is None and response.error is None


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_user_text_gets_the_greeting(client: OpenAI, text: str) -> None:
    assert client.responses.create(model="dev", input=text).output_text == GREETING


def test_last_user_message_is_answered(client: OpenAI) -> None:
    response = client.responses.create(
        model="dev",
        input=[
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "You said: first"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "  second one "}]},
        ],
    )
    assert response.output_text == "You said: second one"
    assert response.usage is not None and response.usage.input_tokens == 6


def test_request_fields_are_echoed(client: OpenAI) -> None:
    response = client.responses.create(
        model="any-name",
        input="hi",
        instructions="be brief",
        metadata={"k": "v"},
        temperature=0.5,
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
    )
    assert (response.model, response.instructions, response.metadata) == ("any-name", "be brief", {"k": "v"})
    assert (response.temperature, response.tool_choice, response.parallel_tool_calls) == (0.5, "auto", False)
    assert [tool.name for tool in response.tools if tool.type == "function"] == ["get_time", "calculate"]
    assert response.usage is not None and response.usage.input_tokens == 3  # "hi" + "be brief"


# --- tools -----------------------------------------------------------------------------------------


def test_no_call_unless_a_tool_is_named(client: OpenAI) -> None:
    response = client.responses.create(model="dev", input="what is the time?", tools=TOOLS)
    assert calls(response) == [] and response.output_text == "You said: what is the time?"


@pytest.mark.parametrize("text", ["call get_time", "please call GET TIME now"])
def test_named_tool_without_parameters_is_called_with_empty_object(client: OpenAI, text: str) -> None:
    response = client.responses.create(model="dev", input=text, tools=TOOLS)
    [call] = response.output
    assert call.type == "function_call"
    assert (call.name, call.arguments, call.status) == ("get_time", "{}", "completed")
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    assert response.output_text == ""


def test_expression_argument_is_the_arithmetic_in_the_text(client: OpenAI) -> None:
    response = client.responses.create(model="dev", input="calculate 6*7.", tools=TOOLS)
    assert calls(response) == [("calculate", {"expression": "6*7"})]
    assert (
        response.output[0].type == "function_call" and response.output[0].arguments == '{"expression":"6*7"}'
    )


def test_one_call_to_the_first_declared_matching_tool(client: OpenAI) -> None:
    text = "calculate (2 + 3) * 4 and call get_time"
    response = client.responses.create(model="dev", input=text, tools=TOOLS)
    assert calls(response) == [("get_time", {})]  # first in `tools` order, not in the text
    reversed_tools: Any = [CALCULATE, GET_TIME]
    response = client.responses.create(model="dev", input=text, tools=reversed_tools)
    assert calls(response) == [("calculate", {"expression": "(2 + 3) * 4"})]


WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("What's the WEATHER like in Paris?", ["get_weather"]),  # a description word, any case
        ("which city is largest?", ["get_weather"]),
        ("weatherman", []),  # whole words only
        ("hello there", []),
    ],
)
def test_a_word_of_the_description_calls_the_tool(client: OpenAI, text: str, expected: list[str]) -> None:
    response = client.responses.create(model="dev", input=text, tools=[WEATHER])
    assert [name for name, _ in calls(response)] == expected


def test_required_calls_the_first_matching_tool_else_the_first_tool(client: OpenAI) -> None:
    tools: Any = [GET_TIME, WEATHER]
    matched = client.responses.create(model="dev", input="weather?", tools=tools, tool_choice="required")
    unmatched = client.responses.create(model="dev", input="hello", tools=tools, tool_choice="required")
    assert [name for name, _ in calls(matched)] == ["get_weather"]
    assert [name for name, _ in calls(unmatched)] == ["get_time"]


def test_allowed_tools_restrict_the_choice(client: OpenAI) -> None:
    choice: Any = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "calculate"}],
    }
    response = client.responses.create(
        model="dev", input="call get_time 1+1", tools=TOOLS, tool_choice=choice
    )
    assert calls(response) == [("calculate", {"expression": "1+1"})]


def test_response_object_is_spec_complete(client: OpenAI) -> None:
    raw = client.responses.with_raw_response.create(model="dev", input="hi", tools=TOOLS, top_logprobs=3)
    body = json.loads(raw.text)
    assert {
        key: body[key]
        for key in (
            "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
            "safety_identifier", "prompt_cache_key", "service_tier", "truncation",
        )
    } == {
        "temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "top_logprobs": 3, "safety_identifier": None, "prompt_cache_key": None,
        "service_tier": "default", "truncation": "disabled",
    }  # fmt: skip
    assert [(t["description"], t["strict"]) for t in body["tools"]] == [(None, True), (None, True)]


def test_schema_types_get_fixed_values(client: OpenAI) -> None:
    tool: Any = {
        "type": "function",
        "name": "restart_job",
        "parameters": {
            "type": "object",
            "properties": {
                "job_id": {"type": "string"},
                "priority": {"type": "string", "enum": ["low", "high"]},
                "memory_gb": {"type": "integer"},
                "ratio": {"type": ["number", "null"]},
                "force": {"type": "boolean"},
                "note": {"type": "string"},
            },
            "required": ["job_id", "priority", "memory_gb", "ratio", "force"],
        },
    }
    response = client.responses.create(model="dev", input="restart job 7", tools=[tool])
    args = {"job_id": "restart job 7", "priority": "low", "memory_gb": 1, "ratio": 1, "force": True}
    assert calls(response) == [("restart_job", args)]


def test_tool_results_are_summarised(client: OpenAI) -> None:
    first = client.responses.create(model="dev", input="call get_time", tools=TOOLS)
    second = client.responses.create(model="dev", input="calculate 6*7", tools=TOOLS)
    [time_call] = (item for item in first.output if item.type == "function_call")
    [calc_call] = (item for item in second.output if item.type == "function_call")
    items: Any = [
        {"role": "user", "content": "call get_time and calculate 6*7"},
        time_call.to_dict(),
        calc_call.to_dict(),
        {"type": "function_call_output", "call_id": time_call.call_id, "output": "2026-11-30T01:00:00Z"},
        {
            "type": "function_call_output",
            "call_id": calc_call.call_id,
            "output": [{"type": "input_text", "text": "42"}],
        },
    ]
    follow_up = client.responses.create(model="dev", tools=TOOLS, input=items)
    assert calls(follow_up) == []
    assert follow_up.output_text == "Tool results: get_time -> 2026-11-30T01:00:00Z; calculate -> 42."


def test_tool_result_without_its_call_is_named_by_call_id_and_kept_short(client: OpenAI) -> None:
    output = "line one\n\n" + "x" * 500
    response = client.responses.create(
        model="dev",
        input=[{"type": "function_call_output", "call_id": "call_abc", "output": output}],
    )
    assert response.output_text == "Tool results: call_abc -> line one " + "x" * 188 + "...."


def test_loop_forever_keeps_calling_the_first_tool(client: OpenAI) -> None:
    items: list[Any] = [{"role": "user", "content": "loop forever"}]
    call_ids = set()
    for _ in range(3):
        response = client.responses.create(model="dev", input=items, tools=TOOLS)
        [call] = response.output
        assert call.type == "function_call" and (call.name, call.arguments) == ("get_time", "{}")
        call_ids.add(call.call_id)
        items += [call.to_dict(), {"type": "function_call_output", "call_id": call.call_id, "output": "tick"}]
    assert len(call_ids) == 3


@pytest.mark.parametrize(
    ("tool_choice", "text", "expected"),
    [
        ("none", "call get_time", []),
        ("required", "hello", [("get_time", {})]),
        ({"type": "function", "name": "calculate"}, "hello 1+1", [("calculate", {"expression": "1+1"})]),
    ],
)
def test_tool_choice(client: OpenAI, tool_choice: Any, text: str, expected: list[Any]) -> None:
    response = client.responses.create(model="dev", input=text, tools=TOOLS, tool_choice=tool_choice)
    assert calls(response) == expected


# --- streaming -------------------------------------------------------------------------------------


def test_stream_helper_accepts_the_text_stream(client: OpenAI) -> None:
    buffered = client.responses.create(model="dev", input="hello")
    with client.responses.stream(model="dev", input="hello") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.type for event in events] == TEXT_EVENTS
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert final.output_text == buffered.output_text == "You said: hello"
    assert final.status == "completed" and final.usage == buffered.usage


def test_raw_text_stream_events(client: OpenAI) -> None:
    with client.responses.create(model="dev", input="hello", stream=True) as stream:
        events = list(stream)
    assert [event.type for event in events] == TEXT_EVENTS
    created, in_progress, added = events[0], events[1], events[2]
    assert created.type == "response.created" and in_progress.type == "response.in_progress"
    assert created.response.status == "in_progress" and created.response.output == []
    assert added.type == "response.output_item.added" and added.item.type == "message"
    assert [event.delta for event in events if event.type == "response.output_text.delta"] == [
        "You ",
        "said: ",
        "hello",
    ]
    for event in events[3:-2]:
        assert (event.item_id, event.output_index, event.content_index) == (added.item.id, 0, 0)  # type: ignore[union-attr]
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.id == created.response.id
    assert completed.response.output_text == "You said: hello"


def test_raw_function_call_stream_events(client: OpenAI) -> None:
    with client.responses.create(model="dev", input="calculate 6*7", tools=TOOLS, stream=True) as stream:
        events = list(stream)
    assert [event.type for event in events] == CALL_EVENTS
    added, done = events[2], events[-2]
    assert added.type == "response.output_item.added" and added.item.type == "function_call"
    assert (added.item.arguments, added.item.status) == ("", "in_progress")
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"expression":"6*7"}' and all(deltas)
    assert done.type == "response.output_item.done" and done.item.type == "function_call"
    assert done.item.arguments == '{"expression":"6*7"}' and done.item.call_id == added.item.call_id


def test_stream_helper_accepts_a_function_call(client: OpenAI) -> None:
    with client.responses.stream(model="dev", input="calculate 6*7", tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0]
    assert calls(final) == [("calculate", {"expression": "6*7"})]


# --- max_output_tokens -----------------------------------------------------------------------------


def test_max_output_tokens_cuts_the_text_buffered(client: OpenAI) -> None:
    response = client.responses.create(model="dev", input="one two three four", max_output_tokens=2)
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.output_text == "You said:"
    assert response.output[0].type == "message" and response.output[0].status == "incomplete"
    assert response.usage is not None and response.usage.output_tokens == 2
    assert response.max_output_tokens == 2


def test_max_output_tokens_cuts_the_text_streamed(client: OpenAI) -> None:
    with client.responses.create(
        model="dev", input="one two three four", max_output_tokens=2, stream=True
    ) as raw:
        raw_events = list(raw)
    with client.responses.stream(model="dev", input="one two three four", max_output_tokens=2) as stream:
        helper_events = list(stream)
    for events in (raw_events, helper_events):
        assert [event.type for event in events][-1] == "response.incomplete"
        assert [event.delta for event in events if event.type == "response.output_text.delta"] == [
            "You ",
            "said:",
        ]
        terminal = events[-1]
        assert terminal.type == "response.incomplete" and terminal.response.status == "incomplete"
        assert terminal.response.incomplete_details is not None
        assert terminal.response.incomplete_details.reason == "max_output_tokens"
        assert terminal.response.output_text == "You said:"


def test_max_output_tokens_above_the_answer_length_completes(client: OpenAI) -> None:
    response = client.responses.create(model="dev", input="one two", max_output_tokens=4)
    assert (response.status, response.output_text) == ("completed", "You said: one two")


# --- errors and other routes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"not json", None, "invalid_json"),
        (b'{"model": "dev", "temperature": NaN}', None, "invalid_json"),
        (b"[1, 2]", None, "invalid_type"),
        (b'{"input": "hi"}', "model", "missing_required_parameter"),
        (b'{"model": 5, "input": "hi"}', "model", "invalid_type"),
        (b'{"model": "dev", "input": 5}', "input", "invalid_type"),
        (b'{"model": "dev", "input": ["hi"]}', "input[0]", "invalid_type"),
        (b'{"model": "dev", "input": "hi", "stream": "yes"}', "stream", "invalid_type"),
        (
            b'{"model": "dev", "input": "hi", "max_output_tokens": 0}',
            "max_output_tokens",
            "integer_below_min_value",
        ),
        (
            b'{"model": "dev", "input": "hi", "tools": [{"type": "function"}]}',
            "tools[0].name",
            "missing_required_parameter",
        ),
        (b'{"model": "dev", "input": "hi", "tool_choice": "always"}', "tool_choice", "invalid_value"),
    ],
)
def test_bad_body_gets_the_error_envelope(base_url: str, body: bytes, param: str | None, code: str) -> None:
    with httpx.Client(base_url=base_url) as http:
        reply = http.post("/v1/responses", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["x-should-retry"] == "false"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert isinstance(error["message"], str) and error["message"]


def test_sdk_raises_bad_request_error(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="dev", input=cast(Any, 5))
    assert (caught.value.status_code, caught.value.code, caught.value.param) == (400, "invalid_type", "input")


def test_models_list(base_url: str, client: OpenAI) -> None:
    with httpx.Client(base_url=base_url) as http:
        assert http.get("/v1/models").json() == {
            "object": "list",
            "data": [{"id": "dev", "object": "model", "created": 0, "owned_by": "loopwarden"}],
        }
    assert [model.id for model in client.models.list()] == ["dev"]


def test_unknown_url_gets_the_error_envelope(base_url: str) -> None:
    with httpx.Client(base_url=base_url) as http:
        reply = http.get("/v1/nothing")
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "unknown_url"


def test_sse_wire_format(base_url: str) -> None:
    with httpx.Client(base_url=base_url) as http:
        reply = http.post("/v1/responses", json={"model": "dev", "input": "hi", "stream": True})
    assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
    frames = reply.text.split("\n\n")
    assert frames[-1] == "" and "[DONE]" not in reply.text
    for frame in frames[:-1]:
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}" and data_line == "data: " + json.dumps(
            data, separators=(",", ":")
        )


# --- in-process properties -------------------------------------------------------------------------

EVENT = TypeAdapter[Any](ResponseStreamEvent)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), limit=st.none() | st.integers(min_value=1, max_value=8))
def test_stream_reassembles_to_the_buffered_response(text: str, limit: int | None) -> None:
    body = parse_request(json.dumps({"model": "dev", "input": text, "max_output_tokens": limit}).encode())
    response = build_response(body)
    Response.model_validate(response)
    events = [EVENT.validate_python(event) for event in response_events(response)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == f"response.{response['status']}"
    text_out = response["output"][0]["content"][0]["text"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text_out
    if response["status"] == "incomplete":
        assert response["usage"]["output_tokens"] == limit
    assert build_response(body)["output"][0]["content"] == response["output"][0]["content"]  # deterministic
