"""A buffered upstream answer that repeats a key, or is not UTF-8, is 502 `upstream_invalid_response`
on every path (issue 21 attack report D1/D2): the pass-through answers with the upstream's own
bytes (as they came, or with the members it lacked inserted), so such a body would reach the client
as it is, its meaning up to the client's parser. Real uvicorn, scripted upstream, raw HTTP client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from middleware.loop.echo import ECHO_DEFAULTS
from tests.helpers import gateway, message_item, response_obj
from tests.mock_upstream import MockUpstream, Reply

COMPLETE = {  # every echo field an upstream may send: the body goes out as it came
    "created_at": 1,
    "model": "m",
    "instructions": None,
    "previous_response_id": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "safety_identifier": None,
    "prompt_cache_key": None,
    "reasoning": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_logprobs": 0,
    "truncation": "disabled",
    "store": False,
    "background": False,
    "service_tier": "default",
    "tool_choice": "auto",
    "text": {"format": {"type": "text"}},
    "tools": [],
    "completed_at": 1,
    "incomplete_details": None,
    "error": None,
    "usage": None,
}


def test_complete_holds_every_echo_field() -> None:
    """`COMPLETE` is written out (an upstream's literal body), so it is held to the echo fields the
    gateway fills: a new one would otherwise turn the "as it came" cases into insert cases."""
    assert COMPLETE.keys() >= ECHO_DEFAULTS.keys()


def body(complete: bool, text: str = "ok") -> bytes:
    extra: dict[str, Any] = COMPLETE if complete else {}
    return json.dumps(response_obj([message_item(text)], **extra), separators=(",", ":")).encode()


def ask(upstream: MockUpstream, raw: bytes, model: str = "measured", **overrides: Any) -> httpx.Response:
    upstream.push(Reply(parts=[raw], headers=[("content-type", "application/json")]))
    with gateway(upstream, charge_model=model, **overrides) as (url, _):
        return httpx.post(
            f"{url}/v1/responses", json={"model": "m", "input": "hi", "store": False}, timeout=30
        )


@pytest.mark.parametrize("model", ["measured", "reference"])
@pytest.mark.parametrize("complete", [False, True])  # answered by an insert / as it came
@pytest.mark.parametrize(
    "repeat",
    [
        b',"status":"failed"}',  # a top-level member, the second value different
        b',"st\\u0061tus":"completed"}',  # the same key, spelled with an escape
        b',"usage":{"input_tokens":1,"input_tokens":2,"output_tokens":1,"total_tokens":2}}',  # nested
    ],
)
def test_a_repeated_key_is_502_whatever_the_path(
    upstream: MockUpstream, model: str, complete: bool, repeat: bytes
) -> None:
    raw = body(complete)
    if b'"usage"' in repeat:
        raw = raw.replace(b',"usage":null', b"")
    r = ask(upstream, raw[:-1] + repeat, model, max_retained_bytes=1 << 26)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "upstream_invalid_response"
    assert "repeats a key" in r.json()["error"]["message"]


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-32-le", "utf-16", "utf-32", "utf-8-sig"])  # BOMs too
def test_a_body_in_another_encoding_than_utf8_is_502(upstream: MockUpstream, encoding: str) -> None:
    r = ask(upstream, body(True).decode().encode(encoding), max_retained_bytes=1 << 26)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_invalid_response"
    assert "UTF-8" in r.json()["error"]["message"]


@pytest.mark.parametrize("complete", [False, True])
def test_colons_and_key_like_text_inside_strings_are_not_repeated_keys(
    upstream: MockUpstream, complete: bool
) -> None:
    text = 'Note: "status":"failed", at 10:30 — see https://example.com/a:b'
    r = ask(upstream, body(complete, text), max_retained_bytes=1 << 26)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == text
    assert r.content.count(b'"status"') == 2  # the response's and its message's, once each
