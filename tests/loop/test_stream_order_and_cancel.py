"""Issue 21 item 1 through the real gateway: a store-on stream whose client goes away leaves a
``cancelled`` response with the output the client saw, and the pass-through refuses an upstream
stream out of order or repeating a key (DESIGN.md §5: 502 before commit, ``error`` +
``response.failed`` after), on the exact and the fast path alike."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import DONE, PRE, gateway, message_item, response_obj, sse_events, text_delta
from tests.mock_upstream import E, MockUpstream, Reply

STORE_OFF = {"model": "m", "input": "x", "stream": True, "store": False}
IN_PROGRESS = {**message_item(""), "status": "in_progress", "content": []}


@pytest.fixture
def upstream() -> Iterator[MockUpstream]:
    with MockUpstream() as mock:
        yield mock


def _added(seq: int) -> bytes:
    event = {"type": "response.output_item.added", "sequence_number": seq, "output_index": 0}
    return E("response.output_item.added", {**event, "item": IN_PROGRESS})


def _stored_once_settled(client: httpx.Client, url: str, response_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        r = client.get(f"{url}/v1/responses/{response_id}")
        if r.status_code == 200 and r.json()["status"] != "in_progress":
            body: dict[str, Any] = r.json()
            return body
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)


def test_a_client_gone_mid_stream_leaves_a_cancelled_response_with_the_text_it_saw(
    upstream: MockUpstream,
) -> None:
    head = [*PRE(), _added(2), *(text_delta(3 + i, "Hel" if i == 0 else "lo") for i in range(2))]
    parts: list[Any] = [b"".join(head)]  # one upstream read: the fast path takes the two deltas
    for i in range(200):
        parts += [0.05, text_delta(5 + i, "z")]
    upstream.push(Reply.sse(parts))
    with gateway(upstream) as (url, _), httpx.Client(timeout=10) as client:
        raw = b""
        with client.stream(
            "POST", url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}
        ) as r:
            for chunk in r.iter_raw():
                raw += chunk
                if b'"delta":"lo"' in raw:
                    break
        response_id = sse_events(raw)[0][1]["response"]["id"]
        kept = _stored_once_settled(client, url, response_id)
    assert kept["status"] == "cancelled"
    [message] = kept["output"]
    assert (message["type"], message["id"], message["status"]) == ("message", "msg_1", "incomplete")
    text = message["content"][0]["text"]
    assert text.startswith("Hello")  # what the client saw, and at most the few deltas in flight
    assert set(text[5:]) <= {"z"} and len(text) < 5 + 200


def _failure(raw: bytes) -> tuple[list[str], dict[str, Any]]:
    events = sse_events(raw)
    kinds = [kind for kind, _ in events]
    error = next(obj for kind, obj in events if kind == "error")
    return kinds, error


def test_a_stream_that_does_not_start_with_response_created_is_a_502(upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([b"".join(text_delta(i, "w") for i in range(20)), DONE(20, [message_item("w")])]))
    with gateway(upstream) as (url, _):
        r = httpx.post(url + "/v1/responses", json=STORE_OFF, timeout=10)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_invalid_response"
    assert "did not start with response.created" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("late", "said"),
    [
        (PRE()[0], "response.created twice"),
        (
            E(
                "response.completed",
                {
                    "type": "response.completed",
                    "sequence_number": 12,
                    "response": response_obj([], id="resp_other"),
                },
            ),
            "is for response 'resp_other'",
        ),
        (
            E(
                "response.output_text.delta",
                '{"type":"response.output_text.delta","sequence_number":12,"output_index":0,"delta":"a","delta":"b"}',
            ),
            "repeats a key",
        ),
    ],
)
def test_an_out_of_order_or_repeated_key_frame_after_commit_is_an_error_then_response_failed(
    upstream: MockUpstream, late: bytes, said: str
) -> None:
    deltas = b"".join(text_delta(2 + i, "w") for i in range(10))
    upstream.push(Reply.sse([b"".join([*PRE(), deltas, late]), DONE(13, [message_item("w")])]))
    with gateway(upstream) as (url, _):
        r = httpx.post(url + "/v1/responses", json=STORE_OFF, timeout=10)
    assert r.status_code == 200  # committed: the deltas went out first
    kinds, error = _failure(r.content)
    assert kinds[-2:] == ["error", "response.failed"]
    assert kinds.count("response.output_text.delta") == 10
    assert "response.completed" not in kinds
    assert error["code"] == "upstream_invalid_response"
    assert said in error["message"]
    assert r.content.endswith(b"data: [DONE]\n\n")
