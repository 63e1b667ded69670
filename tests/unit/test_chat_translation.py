"""The Chat Completions translator as units (issue 25): request mapping, the stream converter,
byte-at-a-time feeding, streamed == finite, dialects, caps. Numbers (``#N``) are the acceptance
behaviours of ../shared/specs/chat-completions-translation.md §1.10.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
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
            _no_ids(
                json.dumps(
                    {k: v for k, v in response.items() if k not in ("created_at", "completed_at")}
                ).encode()
            )
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


# -- the attacker's defects (D1-D6) ------------------------------------------------------------------
LONE = (
    "\ud800"  # json.dumps writes it as the escape "\ud800", which json.loads turns back into a lone surrogate
)


@pytest.mark.parametrize(
    "parts",
    [
        text_stream("ok", LONE),
        [chunk({"reasoning_content": "a" + LONE}), chunk({}, "stop"), CHAT_DONE],
        calls_stream([tool_fragment(0, id="c" + LONE, name="f", args="{}")]),
        calls_stream([tool_fragment(0, id="c", name="f", args='{"a":"' + LONE + '"}')]),
        calls_stream([tool_fragment(0, id="c", name="f" + LONE, args="{}")]),
    ],
    ids=["content", "reasoning", "call_id", "arguments", "name"],
)
def test_a_lone_surrogate_in_a_stream_is_upstream_invalid(parts: list[bytes]) -> None:
    """D1: never a UnicodeEncodeError (a 500): the reader's UpstreamInvalid (502 / error frame)."""
    with pytest.raises(UpstreamError, match="lone surrogate") as info:
        translate(parts)
    assert info.value.row == "upstream_invalid"


@pytest.mark.parametrize(
    "body",
    [
        completion("x" + LONE),
        completion(None, tool_calls=[function_call("c", "f", '{"a":"' + LONE + '"}')], finish="tool_calls"),
        completion(None, tool_calls=[function_call("c" + LONE, "f", "{}")], finish="tool_calls"),
    ],
    ids=["content", "arguments", "call_id"],
)
def test_a_lone_surrogate_in_a_body_is_upstream_invalid(body: dict[str, Any]) -> None:
    with pytest.raises(UpstreamError, match="lone surrogate") as info:
        finite(body)
    assert info.value.row == "upstream_invalid"


def _azure(choices: list[Any], **more: Any) -> bytes:
    obj = {"choices": choices, "id": "", "model": "", "object": "", "created": 0, **more}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


AZURE_PROMPT = _azure([], prompt_filter_results=[{"prompt_index": 0, "content_filter_results": {}}])
AZURE_FILTER = _azure(
    [{"index": 0, "finish_reason": None, "content_filter_results": {"hate": {"filtered": False}}}]
)


def test_azure_metadata_chunks_are_skipped() -> None:
    """D2: Azure OpenAI's prompt-filter first chunk and asynchronous filter chunks (empty id, model,
    object; mid-stream and after the finish) are skipped; the first real id names the response."""
    parts = [
        AZURE_PROMPT,
        *text_stream("he", "llo")[:-3],
        AZURE_FILTER,
        chunk({}, "stop"),
        AZURE_FILTER,
        CHAT_DONE,
    ]
    out = events(parts)
    final = out[-1][1]["response"]
    assert out[0][0] == "response.created" and out[0][1]["response"]["id"] == "resp_chatcmpl_1"
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "hello"


@pytest.mark.parametrize(
    "parts",
    [
        [
            _azure([{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]),
            chunk({}, "stop"),
            CHAT_DONE,
        ],
        [chunk({"content": "a"}), chunk({"content": "b"}, id="chatcmpl-2"), chunk({}, "stop"), CHAT_DONE],
    ],
    ids=["content_without_an_id", "id_changes"],
)
def test_an_empty_id_with_content_or_a_changed_id_is_refused(parts: list[bytes]) -> None:
    with pytest.raises(ChatReplyInvalid) as info:
        translate(parts)
    assert info.value.reason == "invalid_chunk"


def _feed_cpu(n: int, kind: str) -> float:
    """Process CPU seconds for one converter fed `n` two-character deltas of `kind`."""
    from middleware.upstream.chat.stream import StreamConverter

    converter = StreamConverter(ChatDialect(max_stream_events=10**7, max_tool_call_argument_bytes=10**8))
    head = {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": {}}]}
    converter.chunk(head)
    if kind == "args":
        first = {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}
        converter.chunk({**head, "choices": [{"index": 0, "delta": {"tool_calls": [first]}}]})
    started = time.process_time()
    for _ in range(n):
        if kind == "args":
            delta: dict[str, Any] = {"tool_calls": [{"index": 0, "function": {"arguments": "ab"}}]}
        else:
            delta = {"content": "ab"}
        converter.chunk({**head, "choices": [{"index": 0, "delta": delta}]})
    converter.chunk({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    final = converter.done()[-1][1]["response"]["output"][0]
    spent = time.process_time() - started
    assert len(final["arguments"] if kind == "args" else final["content"][0]["text"]) == 2 * n + (
        kind == "args"
    )
    return spent


def test_accumulation_is_linear_in_the_number_of_deltas() -> None:
    """D3: 200k argument fragments of one call cost about 4x 50k (measured before the fix: 9.7x,
    a copy of the arguments per fragment); generous bound 8x."""
    small = min(_feed_cpu(50_000, "args") for _ in range(2))
    large = _feed_cpu(200_000, "args")
    assert large < 8 * small, (small, large)


@pytest.mark.parametrize("field", ["arguments", "content", "reasoning_content"])
def test_a_delta_does_not_copy_what_was_accumulated(field: str) -> None:
    """D3 structurally: after an 8 MB delta, 100 more small deltas allocate far less than one
    copy of the 8 MB (a ``+=`` or an ``.encode()`` of the whole would allocate 8 MB each)."""
    import tracemalloc

    from middleware.upstream.chat.stream import StreamConverter

    converter = StreamConverter(ChatDialect(max_tool_call_argument_bytes=10**8))
    head = {"id": "chatcmpl-1", "model": "m"}

    def delta(text: str, first: bool = False) -> dict[str, Any]:
        if field != "arguments":
            return {field: text}
        fragment: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        return (
            {"tool_calls": [{**fragment, "id": "c", "function": {"name": "f", "arguments": text}}]}
            if first
            else {"tool_calls": [fragment]}
        )

    big = "x" * 8_000_000
    converter.chunk({**head, "choices": [{"index": 0, "delta": delta(big, first=True)}]})
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            converter.chunk({**head, "choices": [{"index": 0, "delta": delta("ab")}]})
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
    converter.chunk({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    item = converter.done()[-1][1]["response"]["output"][0]
    kept = item["arguments"] if field == "arguments" else item["content"][0]["text"]
    assert len(kept) == 8_000_000 + 200


class _Counted(FakeResponse):
    """A FakeResponse that counts the reads taken from it, can stall (`None` part: sleep 60 s)
    and records its `aclose`."""

    def __init__(self, parts: list[bytes | None]) -> None:
        super().__init__([])
        self._script = parts
        self.reads = 0
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self._script:
            if part is None:
                await asyncio.sleep(60)
                continue
            self.reads += 1
            yield part

    async def aclose(self) -> None:
        self.closed = True


def _run(inner: _Counted) -> tuple[list[tuple[str, Any]], float]:
    response = ChatResponse(inner, STRICT, Ledger(67_108_864), sse=True)

    async def run() -> bytes:
        return b"".join([piece async for piece in response.chunks()])

    started = time.monotonic()
    raw = asyncio.run(asyncio.wait_for(run(), 30))
    return sse_events(raw), time.monotonic() - started


@pytest.mark.parametrize("same_read", [True, False])
def test_nothing_after_done_is_read_and_the_upstream_is_closed(same_read: bool) -> None:
    """D4: the round ends at [DONE]: a frame after it (same read or later) is never translated,
    the later read never happens, nothing is counted as a translation failure."""
    late = chunk({"content": "INJECTED"})
    head = text_stream("hi")
    parts: list[bytes | None] = [*head[:-1], CHAT_DONE + late] if same_read else [*head, late, late]
    inner = _Counted(parts)
    with _failures() as counted:
        out, _ = _run(inner)
    assert out[-1][0] == "response.completed" and b"INJECTED" not in json.dumps(out).encode()
    assert inner.reads == len(head) and inner.closed and counted() == 0


@contextlib.contextmanager
def _failures() -> Iterator[Callable[[], float]]:
    from middleware.ops import metrics

    def total() -> float:
        return sum(
            metrics.TRANSLATION_FAILURES.labels(reason=r)._value.get() for r in metrics.TRANSLATION_REASONS
        )

    before = total()
    yield lambda: total() - before


def test_a_finish_without_done_ends_after_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """D5: finish reason and usage, then the upstream stalls with the connection open: the round
    ends FINISH_GRACE_S after the usage chunk (not at the read timeout), with the usage, and the
    upstream is closed."""
    from middleware.upstream.chat import client

    monkeypatch.setattr(client, "FINISH_GRACE_S", 0.5)
    inner = _Counted([*text_stream("hi")[:-2], None, None])  # finish, then nothing
    out, took = _run(inner)
    assert out[-1][0] == "response.completed" and out[-1][1]["response"]["usage"] is None
    assert 0.4 < took < 10 and inner.closed
    inner = _Counted([*text_stream("hi")[:-1], None])  # finish, usage, then nothing
    out, took = _run(inner)
    assert out[-1][1]["response"]["usage"]["total_tokens"] == 18 and 0.4 < took < 10


def test_completed_at_is_set_when_completed_only() -> None:
    """D6: completed_at (Unix seconds) on a completed response, streamed and buffered; null when
    incomplete."""
    now = int(time.time())
    assert now - 5 <= finite(completion("hi"))["completed_at"] <= now + 5
    assert now - 5 <= events(text_stream("hi"))[-1][1]["response"]["completed_at"] <= now + 5
    assert finite(completion("hi", finish="length"))["completed_at"] is None
    streamed = events(text_stream("hi", finish="length"))
    assert streamed[-1][1]["response"]["completed_at"] is None
    assert streamed[0][1]["response"]["completed_at"] is None


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_streamed_non_json_constant_is_refused_as_in_a_body(constant: bytes) -> None:
    frame = (
        b'data: {"id":"chatcmpl-1","model":"chat-model","choices":[],"usage":{"total_tokens":'
        + constant
        + b"}}\n\n"
    )
    with pytest.raises(UpstreamError) as info:
        translate([chunk({"content": "a"}), frame, chunk({}, "stop"), CHAT_DONE])
    assert info.value.row == "upstream_invalid"
    with pytest.raises(UpstreamError):
        finite(json.loads(json.dumps(completion("a")).replace('"total_tokens": 18', '"total_tokens": NaN')))


def test_buffered_content_parts_are_translated_or_refused() -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    assert finite(completion(parts))["output"][0]["content"][0]["text"] == "hello"  # type: ignore[arg-type]
    with pytest.raises(ChatReplyInvalid) as info:
        finite(completion([{"type": "image_url", "image_url": {"url": "x"}}]))  # type: ignore[arg-type]
    assert info.value.reason == "invalid_completion"


@pytest.mark.parametrize(
    ("run", "reason"),
    [
        (
            lambda: finite(completion(None, tool_calls=[function_call("c", "f", {"a": 1})])),
            "invalid_tool_stream",
        ),  # type: ignore[arg-type]
        (
            lambda: translate(calls_stream([tool_fragment(0, id="c", name="f", args={"a": 1})])),
            "invalid_tool_stream",
        ),  # type: ignore[arg-type]
        (lambda: finite(completion("x", role="tool")), "invalid_completion"),
        (lambda: translate([chunk({"content": 5}), chunk({}, "stop"), CHAT_DONE]), "invalid_chunk"),
        (
            lambda: finite(
                completion(
                    None, tool_calls=[function_call("c", "f", "{}"), function_call("c", "f", '{"a":1}')]
                )
            ),
            "invalid_tool_stream",
        ),
    ],
    ids=[
        "body_arguments_object",
        "stream_arguments_object",
        "tool_role",
        "content_number",
        "one_id_two_calls",
    ],
)
def test_wrong_types_and_roles_are_refused(run: Callable[[], Any], reason: str) -> None:
    with pytest.raises(ChatReplyInvalid) as info:
        run()
    assert info.value.reason == reason and info.value.row == "upstream_invalid"


@pytest.mark.parametrize("dialect", [STRICT, TOLERANT], ids=["strict", "tolerant"])
def test_a_call_sent_twice_whole_is_kept_once_or_refused(dialect: ChatDialect) -> None:
    """D6: the same complete call (id, name, arguments) again is dropped, never ``{}{}``; the
    same id and name with other whole arguments is refused. Buffered: the same."""
    whole = tool_fragment(0, id="c", name="f", args='{"a":1}')
    out = events(calls_stream([whole, whole]), dialect)
    assert [(o["call_id"], o["arguments"]) for o in out[-1][1]["response"]["output"]] == [("c", '{"a":1}')]
    other = tool_fragment(0, id="c", name="f", args='{"a":2}')
    with pytest.raises(ChatReplyInvalid, match="tool-call stream"):
        translate(calls_stream([whole, other]), dialect)
    twice = completion(None, tool_calls=[function_call("c", "f", "{}")] * 2, finish="tool_calls")
    assert [o["arguments"] for o in finite(twice, dialect)["output"]] == ["{}"]


def test_an_in_band_error_with_a_lone_surrogate_is_upstream_invalid() -> None:
    """D1: the in-band error's message is handed on, so it is checked too (not a 500 later)."""
    frame = b'data: {"error":{"message":"bad \\ud800","code":"server_error"}}\n\n'
    with pytest.raises(UpstreamError, match="lone surrogate") as info:
        translate([chunk({"content": "a"}), frame])
    assert info.value.row == "upstream_invalid"
