"""A streamed frame whose data is not UTF-8 JSON (UTF-16, UTF-32, a byte order mark) is refused
like any other frame that is not JSON: after commit, one ``error`` event, then
``response.failed`` (DESIGN.md §5). ``json.loads`` reads UTF-16 and UTF-32 as well, and the
pass-through forwards an unchanged frame's bytes as they came, so such a frame used to reach the
client inside a UTF-8 event stream (NUL bytes and all) with a 200 and ``response.completed``.
RFC 8259 §8.1 and the SSE format (WHATWG HTML §9.2.5) both say UTF-8. Real uvicorn, scripted
upstream, on the fast path (the frame inside a read of regular frames), the exact path (a read of
its own) and the store-on path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import DONE, PRE, gateway, message_item, sse_events, text_delta
from tests.mock_upstream import MockUpstream, Reply


@pytest.fixture
def upstream() -> Iterator[MockUpstream]:
    with MockUpstream() as mock:
        yield mock


def _delta_in(encoding: str, seq: int) -> bytes:
    frame = text_delta(seq, "w")
    head, data = frame[:-2].split(b"\ndata: ", 1)
    return head + b"\ndata: " + data.decode().encode(encoding) + b"\n\n"


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-8-sig"])
@pytest.mark.parametrize("framing", ["amid a read of regular frames", "a read of its own"])
@pytest.mark.parametrize("store", [False, True])
def test_a_frame_not_in_utf8_is_an_error_then_response_failed(
    upstream: MockUpstream, encoding: str, framing: str, store: bool
) -> None:
    deltas = [text_delta(2 + i, "w") for i in range(10)]
    bad = _delta_in(encoding, 12)
    parts: list[Any] = (
        [b"".join([*PRE(), *deltas, bad])]
        if framing.startswith("amid")
        else [b"".join([*PRE(), *deltas]), bad]
    )
    parts.append(DONE(13, [message_item("w" * 11)]))
    upstream.push(Reply.sse(parts))
    with gateway(upstream) as (url, _):
        r = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "stream": True, "store": store},
            timeout=10,
        )
    assert r.status_code == 200  # committed: the deltas before it went out
    assert b"\x00" not in r.content and b"\xef\xbb\xbf" not in r.content
    events = sse_events(r.content)  # checks: one error, then response.failed, then [DONE]
    kinds = [kind for kind, _ in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert kinds.count("response.output_text.delta") == 10
    assert "response.completed" not in kinds
    error = events[-2][1]
    assert error["code"] == "upstream_invalid_response", error
    assert "not JSON" in error["message"]
    json.dumps(events)  # every frame the client got was JSON


def test_the_same_frame_in_utf8_goes_through(upstream: MockUpstream) -> None:
    """The control: the same stream with the frame in UTF-8 completes."""
    deltas = [text_delta(2 + i, "w") for i in range(11)]
    upstream.push(Reply.sse([b"".join([*PRE(), *deltas]), DONE(13, [message_item("w" * 11)])]))
    with gateway(upstream) as (url, _):
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10)
    kinds = [kind for kind, _ in sse_events(r.content)]
    assert kinds[-1] == "response.completed" and kinds.count("response.output_text.delta") == 11
