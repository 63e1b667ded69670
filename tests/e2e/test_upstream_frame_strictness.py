"""Upstream frames the gateway cannot re-encode or that break the stream's rules (attack round 3:
D1 numbers out of the float range, the note on an ``event:`` line that disagrees with its data).

DESIGN.md §5: such an answer is 502 ``upstream_invalid_response`` before commit and one ``error``
+ one schema-complete ``response.failed`` after, stored ``failed`` with the output the client saw.
Real uvicorn gateway, scripted upstream (`tests.mock_upstream`), store on and off.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.helpers import PRE, gateway, message_item, response_obj, sse_events, text_delta
from tests.mock_upstream import E, MockUpstream, Reply
from tests.spec_schema import assert_stream


def _added(seq: int) -> bytes:
    item = {**message_item(""), "status": "in_progress", "content": []}
    return E(
        "response.output_item.added",
        {"type": "response.output_item.added", "sequence_number": seq, "output_index": 0, "item": item},
    )


def _with_logprob(seq: int, kind: str) -> bytes:
    """A frame whose item holds ``"logprob": -1e400`` (JSON that ``float`` turns into ``-inf``)."""
    item = message_item("y")
    item["content"][0]["logprobs"] = [{"token": "y", "logprob": "INFX", "bytes": [], "top_logprobs": []}]
    if kind == "response.output_item.done":
        data: dict[str, Any] = {"type": kind, "sequence_number": seq, "output_index": 0, "item": item}
    else:
        data = {"type": kind, "sequence_number": seq, "response": response_obj([item])}
    return E(kind, data).replace(b'"INFX"', b"-1e400")


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=30)


@pytest.mark.parametrize("store", [True, False])
def test_an_item_with_a_number_out_of_range_ends_the_stream_failed_and_stored(
    upstream: MockUpstream, store: bool
) -> None:
    frames = [*PRE(), _added(2), text_delta(3, "y")]
    frames += [_with_logprob(4, "response.output_item.done"), _with_logprob(5, "response.completed")]
    upstream.push(Reply.sse(frames))
    with gateway(upstream) as (url, _):
        r = _post(url, {"model": "m", "input": "x", "stream": True, "store": store})
        events = sse_events(r.content)
        assert_stream(events)
        names = [name for name, _ in events]
        assert names[-2:] == ["error", "response.failed"], names
        assert events[-2][1]["code"] == "upstream_invalid_response"
        assert "out of range" in events[-2][1]["message"]
        assert b"Infinity" not in r.content
        assert not [name for name, data in events[:-2] if "1e400" in json.dumps(data)], names
        assert "response.output_text.delta" in names
        if store:
            rid = events[0][1]["response"]["id"]
            got = httpx.get(f"{url}/v1/responses/{rid}", timeout=30)
            assert got.status_code == 200, got.text
            assert got.json()["status"] == "failed"
            assert got.json()["error"]["code"] == "upstream_invalid_response"


@pytest.mark.parametrize("number", [b"-1e400", b"1e999", b"1E400"])
def test_a_buffered_body_with_a_number_out_of_range_is_502(upstream: MockUpstream, number: bytes) -> None:
    body = json.dumps(response_obj([message_item("ok")])).encode()[:-1] + b',"top_p":' + number + b"}"
    upstream.push(Reply.json(body))
    with gateway(upstream) as (url, _):
        r = _post(url, {"model": "m", "input": "x", "store": False})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_invalid_response"
    assert "out of range" in r.json()["error"]["message"]


@pytest.mark.parametrize("store", [True, False])
def test_a_frame_whose_event_line_and_data_type_disagree_is_refused(
    upstream: MockUpstream, store: bool
) -> None:
    done = {"type": "response.completed", "sequence_number": 3, "response": response_obj([message_item("y")])}
    liar = b"event: response.output_text.delta\ndata: " + json.dumps(done).encode() + b"\n\n"
    upstream.push(Reply.sse([*PRE(), text_delta(2, "y"), liar]))
    with gateway(upstream) as (url, _):
        r = _post(url, {"model": "m", "input": "x", "stream": True, "store": store})
    events = sse_events(r.content)
    assert_stream(events)
    names = [name for name, _ in events]
    assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names, names
    assert events[-2][1]["code"] == "upstream_invalid_response"
    assert "response.output_text.delta" in events[-2][1]["message"]


def _delta_with(field: str, value: Any, seq: int) -> bytes:
    data = {
        "type": "response.output_text.delta",
        "sequence_number": seq,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "y",
    }
    return E("response.output_text.delta", {**data, field: value})


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("output_index", True),
        ("output_index", "0"),
        ("output_index", -1),
        ("content_index", 0.0),
        ("item_id", 1),
        ("delta", ["y"]),
        ("delta", {"text": "y"}),
    ],
)
@pytest.mark.parametrize("run", [1, 12])  # one frame (frame by frame) or a long run (list-wise)
def test_a_delta_whose_read_fields_have_the_wrong_type_is_refused(
    upstream: MockUpstream, store: bool, field: str, value: Any, run: int
) -> None:
    frames = [*PRE(), _added(2), *[text_delta(3 + i, "x") for i in range(run)]]
    frames += [_delta_with(field, value, 3 + run), text_delta(4 + run, "z")]
    frames.append(
        E(
            "response.completed",
            {
                "type": "response.completed",
                "sequence_number": 5 + run,
                "response": response_obj([message_item("x" * run + "yz")]),
            },
        )
    )
    upstream.push(Reply.sse([b"".join(frames)]))
    with gateway(upstream) as (url, _):
        r = _post(url, {"model": "m", "input": "x", "stream": True, "store": store})
    events = sse_events(r.content)
    assert_stream(events)
    names = [name for name, _ in events]
    assert names[-2:] == ["error", "response.failed"], names
    assert events[-2][1]["code"] == "upstream_invalid_response"
    assert field in events[-2][1]["message"]
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    assert deltas == ["x"] * run, deltas


def _created(seq: int, response_id: str) -> bytes:
    created = {"id": response_id, "object": "response", "status": "in_progress", "output": []}
    return E("response.created", {"type": "response.created", "sequence_number": seq, "response": created})


def _order_case(case: str) -> list[bytes]:
    """Streams out of order (attack round 3 D6): the frames after ``PRE`` and one delta."""
    if case == "created_twice":
        return [_created(3, "resp_up"), text_delta(4, "z"), _done_for("resp_up", 5)]
    if case == "created_twice_other":
        return [_created(3, "resp_up_2"), text_delta(4, "z"), _done_for("resp_up", 5)]
    return [text_delta(3, "z"), _done_for("resp_OTHER", 4)]  # terminal_other


def _done_for(response_id: str, seq: int) -> bytes:
    response = {**response_obj([message_item("yz")]), "id": response_id}
    return E(
        "response.completed", {"type": "response.completed", "sequence_number": seq, "response": response}
    )


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("case", ["created_twice", "created_twice_other", "terminal_other"])
def test_a_stream_out_of_order_is_refused_with_store_on_and_off(
    upstream: MockUpstream, store: bool, case: str
) -> None:
    upstream.push(Reply.sse([b"".join([*PRE(), text_delta(2, "y"), *_order_case(case)])]))
    with gateway(upstream) as (url, _):
        r = _post(url, {"model": "m", "input": "x", "stream": True, "store": store})
    events = sse_events(r.content)
    assert_stream(events)
    names = [name for name, _ in events]
    assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names, names
    assert events[-2][1]["code"] == "upstream_invalid_response"
    wanted = "twice" if case.startswith("created_twice") else "resp_OTHER"
    assert wanted in events[-2][1]["message"], events[-2][1]["message"]
