"""The Chat Completions translator as units (issue 25): request mapping, the stream converter,
byte-at-a-time feeding, streamed == finite, dialects, caps. Numbers (``#N``) are the acceptance
behaviours of ../shared/specs/chat-completions-translation.md §1.10.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from budget import BudgetExceeded, Ledger
from middleware.config import Settings, SettingsError
from middleware.errors import InvalidRequest
from middleware.upstream.chat.client import ChatResponse
from middleware.upstream.chat.dialect import ChatDialect
from middleware.upstream.chat.errors import ChatLimitExceeded, ChatReplyInvalid, ChatStreamIncomplete
from middleware.upstream.chat.request import translate_request
from middleware.upstream.chat.response import build_response, completion_from_body
from middleware.upstream.errors import UpstreamError
from tests.chat_upstream import (
    CHAT_DONE,
    FakeResponse,
    calls_stream,
    chunk,
    completion,
    function_call,
    text_stream,
    tool_fragment,
)
from tests.helpers import sse_events
from tests.spec_schema import assert_event, assert_response

STRICT = ChatDialect()
TOLERANT = ChatDialect(tool_call_profile="tolerant")
IDS = re.compile(rb"(msg|rs|fc|call|resp)_[0-9a-zA-Z_]+")


def translate(parts: list[bytes], dialect: ChatDialect = STRICT, ledger: Ledger | None = None) -> bytes:
    """The Responses SSE bytes the translator makes of Chat SSE `parts`, fed as given."""
    response = ChatResponse(FakeResponse(parts), dialect, ledger or Ledger(67_108_864), sse=True)

    async def run() -> bytes:
        return b"".join([piece async for piece in response.chunks()])

    return asyncio.run(run())


def events(parts: list[bytes], dialect: ChatDialect = STRICT) -> list[tuple[str, Any]]:
    """The translated events, each item event valid against the Open Responses schema (the
    lifecycle events' response objects get their echo fields from the loop: the e2e tests
    validate those)."""
    out = sse_events(translate(parts, dialect))
    for _, data in out:
        if "response" not in data:
            assert_event(data)
    return out


def finite(body: dict[str, Any], dialect: ChatDialect = STRICT) -> dict[str, Any]:
    response = ChatResponse(
        FakeResponse([json.dumps(body).encode()], "application/json"), dialect, Ledger(67_108_864), sse=False
    )

    async def run() -> bytes:
        return b"".join([piece async for piece in response.chunks()])

    return json.loads(asyncio.run(run()))


def _no_ids(raw: bytes) -> bytes:
    return IDS.sub(b"ID", raw)


# -- request mapping (#2, #3, #5, #6, #7) -----------------------------------------------------------
def test_request_mapping_golden() -> None:
    body = {
        "model": "m",
        "instructions": "sys",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "http://x/i.png", "detail": "low"},
                ],
            },
        ],
        "top_logprobs": 2,
        "reasoning": {"effort": "high", "summary": "auto"},
        "text": {
            "format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
        },
        "max_output_tokens": 9,
        "stream": True,
        "stream_options": {"include_obfuscation": False},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "metadata": {"k": "v"},
    }
    assert translate_request(body, ChatDialect(developer_role="system", max_tokens_field="max_tokens")) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "system", "content": "ab"},  # all-text parts joined with no separator
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "http://x/i.png", "detail": "low"}},
                ],
            },
        ],
        "top_logprobs": 2,
        "logprobs": True,
        "reasoning_effort": "high",
        "max_tokens": 9,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True},
        },
        "stream": True,
        "stream_options": {"include_obfuscation": False, "include_usage": True},
    }


def test_response_format_is_dropped_with_tools_and_tool_choice_nests() -> None:
    body = {
        "model": "m",
        "input": "x",
        "text": {"format": {"type": "json_object"}},
        "tools": [{"type": "function", "name": "f", "parameters": {}}],
        "tool_choice": {"type": "function", "name": "f"},
    }
    out = translate_request(body, STRICT)
    assert "response_format" not in out
    assert out["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert "tool_choice" not in translate_request({"model": "m", "input": "x", "tool_choice": "auto"}, STRICT)


def test_calls_batch_and_reasoning_replay_follows_the_dialect() -> None:
    """#3, #5: reasoning attaches to the next assistant message (dialect) or is dropped, never a 400."""
    items = [
        {"type": "message", "role": "user", "content": "q"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "think"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": {"a": 1}},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "r2"}]},
    ]
    replayed = translate_request(
        {"model": "m", "input": items}, ChatDialect(reasoning_replay="reasoning_content")
    )
    assert replayed["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}},
        ],
        "reasoning_content": "think",
    }
    assert replayed["messages"][2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
    ]
    dropped = translate_request({"model": "m", "input": items}, STRICT)
    assert "reasoning_content" not in dropped["messages"][1] and len(dropped["messages"]) == 4


def test_compaction_item_becomes_an_assistant_summary() -> None:
    """#6."""
    import base64

    item = {"type": "compaction", "encrypted_content": base64.b64encode(b"we did X").decode()}
    out = translate_request({"model": "m", "input": [item]}, STRICT)
    assert out["messages"] == [
        {"role": "assistant", "content": "[Previous conversation summary]\n\nwe did X"}
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0]"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ],
)
def test_untranslatable_requests_are_400(body: dict[str, Any], param: str) -> None:
    """#7: item, part, tool, tool_choice the Chat API cannot express."""
    with pytest.raises(InvalidRequest) as info:
        translate_request({"model": "m", **body}, STRICT)
    assert info.value.param == param and "Chat Completions translation" in info.value.message


# -- the stream converter -----------------------------------------------------------------------------
def test_byte_at_a_time_is_byte_identical_to_whole_chunks() -> None:
    """#12: the same bytes, whatever the split (ids normalised: they are fresh per translation)."""
    parts = [
        chunk({"role": "assistant", "reasoning_content": "hmm"}),
        chunk({"content": "héllo 😀"}),
        chunk({"tool_calls": [tool_fragment(0, id="c1", name="f", args='{"a"')]}),
        chunk({"tool_calls": [tool_fragment(0, args=":1}")]}),
        chunk({}, "tool_calls"),
        chunk(choices=[], usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
        CHAT_DONE,
    ]
    whole = translate(parts)
    joined = b"".join(parts)
    single = translate([joined[i : i + 1] for i in range(len(joined))])
    assert _no_ids(single) == _no_ids(whole)
    assert _no_ids(translate([joined])) == _no_ids(whole)


def test_streamed_and_finite_translations_agree() -> None:
    """The terminal of the stream equals the finite translation of the same reply."""
    calls = [function_call("c1", "f", '{"a":1}'), function_call("c2", "g", "{}")]
    body = completion("text", tool_calls=calls, finish="tool_calls", reasoning_content="why")
    stream = [
        chunk({"role": "assistant", "reasoning_content": "wh"}),
        chunk({"reasoning_content": "y"}),
        chunk({"content": "te"}),
        chunk({"content": "xt"}),
        chunk({"tool_calls": [tool_fragment(0, id="c1", name="f", args='{"a":1}')]}),
        chunk({"tool_calls": [tool_fragment(1, id="c2", name="g", args="{}")]}),
        chunk({}, "tool_calls"),
        chunk(choices=[], usage=body["usage"]),
        CHAT_DONE,
    ]
    terminal = events(stream)[-1][1]["response"]
    buffered = finite(body)

    def strip(response: dict[str, Any]) -> Any:
        return json.loads(
            _no_ids(json.dumps({k: v for k, v in response.items() if k != "created_at"}).encode())
        )

    assert strip(terminal) == strip(buffered)
    assert [o["type"] for o in buffered["output"]] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]


def test_reasoning_text_and_call_get_three_output_indexes() -> None:
    """#11 (9router#2611, kitty-bridge#122): three items, three distinct output_index values."""
    out = events(
        [
            chunk({"reasoning": "r"}),
            chunk({"content": "t"}),
            chunk({"tool_calls": [tool_fragment(0, id="c1", name="f", args="{}")]}),
            chunk({}, "tool_calls"),
            CHAT_DONE,
        ],
        ChatDialect(reasoning_dialect="reasoning"),
    )
    added = [(d["output_index"], d["item"]["type"]) for n, d in out if n == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "function_call")]
    assert [n for n, _ in out].count("response.reasoning.delta") == 1
    done = [n for n, _ in out].index("response.output_item.done")
    assert all(n in ("response.output_item.done", "response.completed") for n, _ in out[done:])  # deferred


def test_reasoning_dialect_none_ignores_the_field() -> None:
    out = events(text_stream("x"), ChatDialect(reasoning_dialect="none"))
    assert [o["type"] for o in out[-1][1]["response"]["output"]] == ["message"]
    body = completion("x", reasoning_content="secret")
    assert [o["type"] for o in finite(body, ChatDialect(reasoning_dialect="none"))["output"]] == ["message"]


def test_refusal_streams_as_its_own_part_in_arrival_order() -> None:
    out = events([chunk({"refusal": "no"}), chunk({"content": "sorry"}), chunk({}, "stop"), CHAT_DONE])
    content = out[-1][1]["response"]["output"][0]["content"]
    assert [p["type"] for p in content] == ["refusal", "output_text"]
    assert "response.refusal.done" in [n for n, _ in out]


def test_tolerant_profile_quirks() -> None:
    """#15 tolerant: calls on index 0 with distinct ids split; a fragment without index and a
    first fragment without id are accepted (a call id is made); LM Studio's empty names ignored."""
    out = events(
        calls_stream(
            [
                tool_fragment(0, name="f", args='{"x":1}'),  # no id: one is made
                tool_fragment(0, id="c2", name="g", args="{}"),  # a new id on an occupied index
                tool_fragment(None, name="", args=""),  # no index: continues the last call
            ]
        ),
        TOLERANT,
    )
    output = out[-1][1]["response"]["output"]
    assert [(o["name"], o["arguments"]) for o in output] == [("f", '{"x":1}'), ("g", "{}")]
    assert output[0]["call_id"].startswith("call_") and output[1]["call_id"] == "c2"


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ([chunk({"tool_calls": [tool_fragment(None, id="c", name="f", args="{}")]})], "invalid_tool_stream"),
        (
            [chunk({"tool_calls": [tool_fragment(0, args="{}")]})],
            "invalid_tool_stream",
        ),  # args before identity
        ([chunk({"role": "user", "content": "x"})], "invalid_chunk"),
        ([chunk({"function_call": {"name": "f"}})], "legacy_function_call"),
        ([chunk({}, "weird")], "unknown_finish_reason"),
        ([chunk({}, "stop"), chunk({"content": "late"})], "invalid_chunk"),
        ([chunk({"content": "a"}), chunk({"content": "b"}, id="chatcmpl-2")], "invalid_chunk"),
        ([chunk(choices=[{"index": 1, "delta": {}}])], "invalid_chunk"),
        ([chunk({}, "stop"), CHAT_DONE, chunk({"content": "x"})], "frame_after_terminal"),
    ],
)
def test_strict_violations_fail_closed(parts: list[bytes], reason: str) -> None:
    with pytest.raises(ChatReplyInvalid) as info:
        translate(parts)
    assert info.value.reason == reason


@pytest.mark.parametrize("parts", [[chunk({"content": "a"}), CHAT_DONE], [chunk({"content": "a"})]])
def test_no_finish_reason_is_incomplete(parts: list[bytes]) -> None:
    """#16: [DONE] or EOF before a finish reason."""
    with pytest.raises(ChatStreamIncomplete):
        translate(parts)


def test_eof_inside_a_frame_is_incomplete() -> None:
    with pytest.raises(UpstreamError, match="inside a frame"):
        translate([chunk({}, "stop")[:-3]])


@pytest.mark.parametrize(
    ("dialect", "parts", "reason"),
    [
        (
            ChatDialect(max_tool_calls=2),
            calls_stream([tool_fragment(i, id=f"c{i}", name="f", args="{}") for i in range(3)]),
            "limit_tool_calls",
        ),
        (
            ChatDialect(max_tool_call_argument_bytes=8),
            calls_stream([tool_fragment(0, id="c", name="f", args='{"a":"123456"}')]),
            "limit_tool_arguments",
        ),
        (ChatDialect(max_stream_events=6), text_stream(*["x"] * 10), "limit_events"),
    ],
)
def test_caps_fail_closed(dialect: ChatDialect, parts: list[bytes], reason: str) -> None:
    """#18: each cap is a deterministic 502 / error frame (row translation_limit)."""
    with pytest.raises(ChatLimitExceeded) as info:
        translate(parts, dialect)
    assert info.value.reason == reason and info.value.row == "translation_limit"


def test_finite_caps_and_violations() -> None:
    many = [function_call(f"c{i}", "f", "{}") for i in range(3)]
    with pytest.raises(ChatLimitExceeded):
        completion_from_body(
            completion(None, tool_calls=many, finish="tool_calls"), ChatDialect(max_tool_calls=2)
        )
    with pytest.raises(ChatReplyInvalid, match="legacy"):
        completion_from_body(completion(None, finish="function_call"), STRICT)


def test_what_the_translator_keeps_is_charged_and_released() -> None:
    """#18 ledger: a long reply's accumulated text is charged (an overflow is a BudgetExceeded,
    which the outcome table makes a 502 / error frame), and everything is released at the end."""
    ledger = Ledger(67_108_864)
    translate(text_stream(*["y" * 1000] * 20), ledger=ledger)
    assert ledger.charged == 0 and ledger.peak >= 20_000 * 32
    with pytest.raises(BudgetExceeded):
        translate(text_stream(*["y" * 1000] * 20), ledger=Ledger(200_000))


def test_finite_builder_output_validates_against_the_schema() -> None:
    """#1: usage field by field, a message item, valid against the Open Responses schema once the
    loop's echo fields are filled."""
    from middleware.loop.echo import normalise_response

    response = build_response(completion_from_body(completion("hi"), STRICT), created_at=1)
    normalise_response(response, {"model": "m", "input": "x"})
    assert_response(response)
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 3}


def test_settings_validate_the_dialect() -> None:
    with pytest.raises(SettingsError, match="tool_call_profile must be strict or tolerant"):
        Settings(tool_call_profile="loose")
    with pytest.raises(SettingsError, match=r"models\.m\.upstream_api must be responses or chat"):
        Settings(models={"m": {"upstream_api": "grpc"}})
    assert (
        Settings(upstream_api="chat", reasoning_replay="reasoning").upstream.reasoning_replay == "reasoning"
    )
