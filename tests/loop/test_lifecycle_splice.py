"""A streamed lifecycle or terminal event whose response object only lacked members (vLLM and
other upstreams leave echo fields out) goes to the client as the upstream's bytes with those
members inserted (`middleware.loop.passthrough.splice_event_response`, issue 21), not re-encoded:
the client gets the same event as a re-encode would give. Real uvicorn, scripted upstream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import gateway, message_item, response_obj, sse_events, text_delta
from tests.mock_upstream import MockUpstream, Reply


@pytest.fixture
def upstream() -> Iterator[MockUpstream]:
    with MockUpstream() as mock:
        yield mock


def spaced(kind: str, seq: int, response: dict[str, Any]) -> bytes:
    """An event written as OpenAI orders it (``response`` before ``sequence_number``), with
    ``json.dumps``' default spaces: bytes a re-encode would not give."""
    data = json.dumps({"type": kind, "response": response, "sequence_number": seq})
    return f"event: {kind}\ndata: {data}\n\n".encode()


def frames_of(body: bytes) -> dict[str, bytes]:
    out = {}
    for frame in body.split(b"\n\n"):
        if frame.startswith(b"event: "):
            name, _, data = frame.partition(b"\ndata: ")
            out[name[7:].decode()] = data
    return out


def test_lifecycle_events_keep_the_upstreams_bytes_with_the_missing_members_inserted(
    upstream: MockUpstream,
) -> None:
    created = response_obj([], status="in_progress")
    done = response_obj([message_item("hi")])
    upstream.push(
        Reply.sse(
            [
                spaced("response.created", 0, created),
                spaced("response.in_progress", 1, created),
                text_delta(2, "hi"),
                spaced("response.completed", 3, done),
            ]
        )
    )
    request = {"model": "m", "input": "x", "stream": True, "store": False, "temperature": 0.25}
    with gateway(upstream) as (url, _):
        r = httpx.post(url + "/v1/responses", json=request, timeout=10)
    assert r.status_code == 200
    events = dict(sse_events(r.content))
    sent = frames_of(r.content)
    for kind, obj in (("response.created", created), ("response.completed", done)):
        upstream_data = json.dumps({"type": kind, "response": obj, "sequence_number": 0})
        kept = upstream_data[: upstream_data.rindex("}, ")].encode()  # all but the response's brace
        assert sent[kind].startswith(kept), sent[kind][:200]
        response = events[kind]["response"]
        assert response["temperature"] == 0.25 and response["tools"] == []  # filled: the request's
        assert list(response)[: len(obj)] == list(obj)  # the upstream's members first, as sent
    assert events["response.completed"]["response"]["output"][0]["content"][0]["text"] == "hi"
    assert [e["sequence_number"] for e in events.values()] == [0, 1, 2, 3]


def test_a_lifecycle_event_the_client_numbers_otherwise_is_re_encoded(upstream: MockUpstream) -> None:
    created = response_obj([], status="in_progress")
    upstream.push(
        Reply.sse([spaced("response.created", 7, created), spaced("response.completed", 8, response_obj([]))])
    )
    with gateway(upstream) as (url, _):
        r = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "x", "stream": True, "store": False},
            timeout=10,
        )
    sent = frames_of(r.content)
    assert b", " not in sent["response.created"][:40]  # compact: re-encoded with the client's number
    assert json.loads(sent["response.created"])["sequence_number"] == 0
