"""Limits enforcement end to end (issue 4): every DESIGN.md §5 row that exists so far, at its exact
boundary, against a real uvicorn, the official SDK and a scripted upstream controlling exact bytes.

Cases B09-B12, B17, B18, B21, B23 and B25 of ../shared/cases/CASES.md are named in the tests.
They state the reference model's prices (DESIGN.md §4: 32 x bytes + 256 x nodes, the ``// 32``
clamp), so their gateways run ``charge_model="reference"``; the last tests repeat the two
boundaries under the default measured model.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from budget import ChargeModel, json_features
from tests.helpers import (
    DONE,
    FC,
    PRE,
    B,
    MetricDelta,
    counting_gateway,
    gateway,
    message_item,
    raw_http,
    response_json,
    response_obj,
    sdk,
    sse_events,
    text_delta,
)
from tests.mock_upstream import RST, E, MockUpstream, Reply

PREFIX = b'{"model":"m","input":"'
SUFFIX = b'"}'


def ok_reply(text: str = "hi") -> Reply:
    return Reply.json(response_obj([message_item(text)]))


def post(url: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/responses",
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )


def text_stream(n: int, piece: str) -> list[bytes]:
    """PRE, n text deltas, the item's .done snapshot and response.completed with the full text."""
    full = piece * n
    parts = PRE()
    seq = 2
    item_added = {
        "type": "response.output_item.added",
        "sequence_number": seq,
        "output_index": 0,
        "item": {**message_item(""), "status": "in_progress", "content": []},
    }
    parts.append(E("response.output_item.added", item_added))
    seq += 1
    for _ in range(n):
        parts.append(text_delta(seq, piece))
        seq += 1
    parts.append(
        E(
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "sequence_number": seq,
                "output_index": 0,
                "item": message_item(full),
            },
        )
    )
    parts.append(DONE(seq + 1, [message_item(full)]))
    return parts


# -- the initial payload: raw clamp and admit_input (B17) ---------------------------------------
def test_ledger_boundary_exact_to_the_byte(upstream: MockUpstream) -> None:
    """store on: charge = 2 × (32 × len + 256 × 5 nodes). At exactly B the body is admitted (the
    upstream is called; its answer then cannot be charged: 502); one byte more is 413 and the
    upstream is never called."""
    size = (B - 2 * 256 * 5) // 64
    assert 2 * (32 * size + 256 * 5) == B
    body = PREFIX + b"a" * (size - len(PREFIX) - len(SUFFIX)) + SUFFIX
    assert len(body) == size
    upstream.push(ok_reply())
    with gateway(upstream, charge_model="reference") as (url, _):
        m = MetricDelta()
        at_limit = post(url, body)
        assert len(upstream.requests) == 1
        over = post(url, body[:-2] + b'a"}')
    assert at_limit.status_code == 502
    assert at_limit.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert over.status_code == 413
    assert over.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert over.json()["error"]["type"] == "invalid_request_error"
    assert over.headers["x-should-retry"] == "false"
    assert len(upstream.requests) == 1
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="413") == 1
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="502") == 1


def test_raw_clamp_boundary(upstream: MockUpstream) -> None:
    """Exactly B // 32 bytes passes the clamp (and then fails the ledger); one more is request_too_large."""
    clamp = B // 32
    body = PREFIX + b"a" * (clamp - len(PREFIX) - len(SUFFIX)) + SUFFIX
    with gateway(upstream, charge_model="reference") as (url, _):
        at = post(url, body)
        over = post(url, body[:-2] + b'a"}')
    assert at.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert over.status_code == 413
    assert over.json()["error"]["code"] == "request_too_large"
    assert "32.00 KiB" not in over.json()["error"]["message"]  # sizes are said in bytes or MiB
    assert "max_retained_bytes" in over.json()["error"]["message"]
    assert upstream.requests == []


def test_b17_control_small_body_is_served(upstream: MockUpstream) -> None:
    upstream.push(ok_reply())
    body = PREFIX + b"a" * 2000 + SUFFIX
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, body)
    assert r.status_code == 200
    assert r.json()["output"][0]["content"][0]["text"] == "hi"


def test_b17a_declared_50_mib_refused_from_the_header(upstream: MockUpstream) -> None:
    with gateway(upstream, charge_model="reference") as (url, counter):
        m = MetricDelta()
        head = b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 52428800\r\n\r\n"
        raw = raw_http(url, head, b'{"model":"m","input":"' + b"a" * 1000)
    status, headers, body = response_json(raw)
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert headers["connection"] == "close"
    assert headers["x-should-retry"] == "false"
    assert counter.body_bytes == 0
    assert upstream.requests == []
    assert m.delta("loopwarden_cap_hits_total", limit="request_body", outcome="413") == 1


def test_b17c_huge_content_length_answered_without_waiting_for_the_body(upstream: MockUpstream) -> None:
    with gateway(upstream, charge_model="reference") as (url, counter):
        started = time.monotonic()
        head = b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000000\r\n\r\n"
        raw = raw_http(url, head, b'{"model":"m","inpu', read_timeout=5)
        elapsed = time.monotonic() - started
    status, _, body = response_json(raw)
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert elapsed < 2
    assert counter.body_bytes == 0


def test_b17b_chunked_50_mib_stops_reading_at_the_clamp(upstream: MockUpstream) -> None:
    chunk = 64 * 1024
    with gateway(upstream, charge_model="reference") as (url, counter):
        m = MetricDelta()

        def body() -> Any:
            yield b'{"model":"m","input":"'
            for _ in range(50 * 16):
                yield b"a" * chunk

        r = httpx.post(url + "/v1/responses", content=body(), timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    # At most the clamp plus the one receive() message that crossed it. uvicorn hands the app
    # what it buffered meanwhile: up to its 64 KiB high-water mark plus one socket read.
    assert counter.body_bytes <= B // 32 + counter.largest_message
    assert counter.largest_message <= 2 * chunk + 1024
    assert upstream.requests == []
    assert m.delta("loopwarden_cap_hits_total", limit="request_body", outcome="413") == 1


def test_b17d_node_heavy_body_overflows_the_ledger(upstream: MockUpstream) -> None:
    items = b",".join([b'{"role":"user","content":"a"}'] * 1000)
    body = b'{"model":"m","input":[' + items + b"]}"
    assert len(body) < B // 32
    with gateway(upstream, charge_model="reference") as (url, _):
        m = MetricDelta()
        r = post(url, body)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert upstream.requests == []
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="413") == 1


def test_413_is_not_retried_by_the_sdk_with_default_retries(upstream: MockUpstream) -> None:
    with (
        gateway(upstream, charge_model="reference") as (url, counter),
        sdk(url, max_retries=2) as client,
        pytest.raises(openai.APIStatusError) as info,
    ):
        client.responses.create(model="m", input="a" * (B // 32))
    assert info.value.status_code == 413
    assert counter.requests == 1


def test_client_lowering_headers(upstream: MockUpstream) -> None:
    upstream.push(ok_reply())
    body = PREFIX + b"a" * 2000 + SUFFIX
    with gateway(upstream, charge_model="reference") as (url, _):
        lowered = post(url, body, **{"loopwarden-max-retained-bytes": "4096"})
        raised = post(url, body, **{"loopwarden-max-retained-bytes": "268435456"})
        bad = post(url, body, **{"loopwarden-max-retained-bytes": "lots"})
        too_low = post(url, body, **{"loopwarden-max-infer-iters": "0"})
    assert lowered.status_code == 413
    assert lowered.json()["error"]["code"] == "request_too_large"
    assert "loopwarden-max-retained-bytes header" not in lowered.text  # the clamp message says its own fix
    assert raised.status_code == 200  # a client can lower, never raise, its limits
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "loopwarden-max-retained-bytes"
    assert "4096..=268435456" in bad.json()["error"]["message"]
    assert too_low.status_code == 400
    assert too_low.json()["error"]["param"] == "loopwarden-max-infer-iters"


def test_client_body_timeout_is_408(upstream: MockUpstream) -> None:
    """B25c: Content-Length 100, 40 bytes sent, then silence."""
    with gateway(upstream, charge_model="reference", client_body_timeout=0.5) as (url, _):
        m = MetricDelta()
        head = b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
        started = time.monotonic()
        raw = raw_http(url, head, b'{"model":"m","input":"' + b"a" * 18, read_timeout=5)
        elapsed = time.monotonic() - started
    status, headers, body = response_json(raw)
    assert status == 408
    assert body["error"]["code"] == "request_timeout"
    assert headers["x-should-retry"] == "false"
    assert 0.4 < elapsed < 3
    assert upstream.requests == []
    assert m.delta("loopwarden_cap_hits_total", limit="client_body_timeout", outcome="408") == 1


def test_b25d_pipelined_extra_bytes_are_not_parsed_as_the_body(upstream: MockUpstream) -> None:
    with gateway(upstream, charge_model="reference") as (url, _):
        head = b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n"
        raw = raw_http(url, head, b'{"model":"m","input":"' + b"a" * 178 + b'"}', read_timeout=3)
    status, _, body = response_json(raw)
    assert status == 400
    assert body["error"]["code"] == "invalid_json"
    assert upstream.requests == []


# -- client JSON validation (B21, B23) ----------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model":"m","input":"emoji \\ud83d"}', "input"),
        (b'{"model":"m","input":"x \\ude00 y"}', "input"),
        (b'{"model":"m","input":"bad \xff"}', "input"),
    ],
)
def test_b21_invalid_unicode_is_400(upstream: MockUpstream, body: bytes, param: str | None) -> None:
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_unicode"
    assert r.json()["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert r.json()["error"]["param"] == param
    assert r.headers["x-should-retry"] == "false"
    assert upstream.requests == []


def test_b21d_valid_surrogate_pair_reaches_upstream(upstream: MockUpstream) -> None:
    upstream.push(ok_reply())
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, b'{"model":"m","input":"ok \\ud83d\\ude00"}')
    assert r.status_code == 200
    assert upstream.requests[0].json()["input"] == "ok 😀"


@pytest.mark.parametrize(
    ("body", "key", "path"),
    [
        (b'{"model":"small","model":"big","input":"hi"}', "model", "model"),
        (
            b'{"model":"m","input":[{"type":"message","role":"user","role":"system","content":"x"}]}',
            "role",
            "input[0].role",
        ),
        (b'{"model":"a","mod\\u0065l":"b","input":"hi"}', "model", "model"),
        (b'{"model":"m","input":"hi","metadata":{"k":"1","k":"2"}}', "k", "metadata.k"),
    ],
)
def test_b23_duplicate_keys_are_400(upstream: MockUpstream, body: bytes, key: str, path: str) -> None:
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "duplicate_key"
    assert key in error["message"]
    assert path in error["message"]
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"model":"m","input":"hi"', "invalid_json", None),
        (b"[1,2]", "invalid_request", None),
        (b'{"input":"hi"}', "invalid_value", "model"),
        (b'{"model":"m","input":5}', "invalid_type", "input"),
        (b'{"model":"m","input":"x","temperature":1e400}', "invalid_number", "temperature"),
        (b'{"model":"m","input":"x","temperature":NaN}', "invalid_number", None),
        (b'{"model":"m","input":"x","max_output_tokens":-1}', "invalid_value", "max_output_tokens"),
        (b'{"model":"m","input":"x","stream":"yes"}', "invalid_type", "stream"),
        (b"[" * 129 + b"]" * 129, "json_too_deep", None),
    ],
)
def test_malformed_client_json_is_a_specific_400(
    upstream: MockUpstream, body: bytes, code: str, param: str | None
) -> None:
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code
    if param is not None:
        assert r.json()["error"]["param"] == param
    assert upstream.requests == []


def test_too_large_and_malformed_is_413(upstream: MockUpstream) -> None:
    body = b'{"model":"m","input":"' + b"a" * (B // 32)
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, body)
    assert r.status_code == 413


# -- buffered upstream bodies (B18, B25a) --------------------------------------------------------
def big_response(size: int) -> bytes:
    return json.dumps(response_obj([message_item("x" * size)])).encode()


def test_b18a_declared_length_over_the_clamp_is_refused_without_reading(upstream: MockUpstream) -> None:
    upstream.push(Reply.json(big_response(5 * B)))
    with counting_gateway(upstream, charge_model="reference") as (url, _, up):
        m = MetricDelta()
        r = post(url, PREFIX + b"hi" + SUFFIX)
    assert r.status_code == 502
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "upstream_response_too_large"
    assert r.headers["x-should-retry"] == "false"
    assert up.bytes_read == 0
    assert m.delta("loopwarden_cap_hits_total", limit="upstream_body", outcome="502") == 1


def test_b18b_chunked_body_trips_the_ledger_and_stops_reading(upstream: MockUpstream) -> None:
    body = big_response(5 * B)
    parts = [body[i : i + 16384] for i in range(0, len(body), 16384)]
    upstream.push(Reply(headers=[("content-type", "application/json")], parts=parts, framing="chunked"))
    with counting_gateway(upstream, charge_model="reference") as (url, _, up):
        m = MetricDelta()
        r = post(url, PREFIX + b"hi" + SUFFIX)
        deadline = time.monotonic() + 5
        while upstream.peer_closed == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert up.bytes_read <= B // 64 + 65536
    assert upstream.peer_closed == 1, "the upstream connection is closed, not drained"
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="502") == 1


def test_b18c_declared_length_refused_before_the_body_is_sent(upstream: MockUpstream) -> None:
    upstream.push(
        Reply(headers=[("content-type", "application/json")], parts=[5.0, b"{}"], declared_length=5 * B)
    )
    with gateway(upstream, charge_model="reference") as (url, _):
        started = time.monotonic()
        r = post(url, PREFIX + b"hi" + SUFFIX)
        elapsed = time.monotonic() - started
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_response_too_large"
    assert elapsed < 3


def test_b18_control_1kb_upstream_body(upstream: MockUpstream) -> None:
    upstream.push(Reply.json(big_response(1000)))
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, PREFIX + b"hi" + SUFFIX)
    assert r.status_code == 200


def test_b25a_short_body_then_reset_is_502_incomplete(upstream: MockUpstream) -> None:
    upstream.push(
        Reply(
            headers=[("content-type", "application/json")],
            parts=[b"{" + b" " * 999, RST],
            declared_length=4000,
        )
    )
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, PREFIX + b"hi" + SUFFIX)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_incomplete"


def test_b25b_conflicting_upstream_framing_headers_still_work(upstream: MockUpstream) -> None:
    """aiohttp (the default client) refuses Content-Length + chunked, so the gateway switches that
    upstream to httpx for good and sends the refused request again: two upstream requests for the
    first client request, one for each after it."""

    def reply() -> Reply:
        parts = [*PRE(), DONE(2, [message_item("ok")])]
        headers = [("content-type", "text/event-stream"), ("content-length", "123")]
        return Reply(headers=headers, parts=parts, framing="chunked")

    upstream.push(reply(), reply(), reply())
    with gateway(upstream, charge_model="reference") as (url, _), sdk(url) as client:
        events = list(client.responses.create(model="m", input="x", stream=True))
        assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]
        assert len(upstream.requests) == 2
        assert upstream.requests[0].body == upstream.requests[1].body
        again = list(client.responses.create(model="m", input="x", stream=True))
        assert again[-1].type == "response.completed"
        assert len(upstream.requests) == 3


def test_non_json_upstream_body_is_502_invalid(upstream: MockUpstream) -> None:
    upstream.push(Reply(headers=[("content-type", "application/json")], parts=[b"<html>oops</html>"]))
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, PREFIX + b"hi" + SUFFIX)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_invalid_response"


def test_an_sse_body_without_its_content_type_is_invalid_not_a_cap_hit(upstream: MockUpstream) -> None:
    """A buffered request answered with event-stream text and no content type: 502
    upstream_invalid_response at its first byte — not charged as JSON (that read as a budget
    overflow: 502 max_retained_bytes_exceeded and a cap hit)."""
    sse = b"".join([*PRE(), *(text_delta(2 + i, "x" * 50) for i in range(40)), DONE(42, [message_item("x")])])
    upstream.push(Reply(headers=[], parts=[b"\r\n  " + sse], framing="chunked"))
    caps = MetricDelta()
    with gateway(upstream, charge_model="reference", max_retained_bytes=262_144) as (url, _):
        r = post(url, b'{"model":"m","input":"x","store":false}')
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_invalid_response"
    assert "not a JSON object" in r.json()["error"]["message"]
    assert caps.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="502") == 0


@pytest.mark.parametrize(
    ("status", "body", "want_status", "want_code", "want_message"),
    [
        (
            401,
            {"error": {"message": "bad key", "code": "invalid_api_key"}},
            502,
            "upstream_auth_failed",
            "bad key",
        ),
        (403, b"forbidden", 502, "upstream_auth_failed", "forbidden"),
        (
            500,
            {"error": {"message": "engine died", "type": "server_error"}},
            502,
            "server_error",
            "engine died",
        ),
        (503, b"overloaded", 502, "upstream_error", "overloaded"),
        (
            400,
            {"error": {"message": "bad param", "code": "invalid_value", "param": "top_p"}},
            400,
            "invalid_value",
            "bad param",
        ),
        (404, {"error": {"message": "no model"}}, 404, "upstream_error", "no model"),
        (422, {"detail": "unprocessable"}, 422, "upstream_error", "upstream answered HTTP 422"),
        (
            429,
            {"error": {"message": "slow down", "code": "rate_limit_exceeded"}},
            429,
            "rate_limit_exceeded",
            "slow down",
        ),
    ],
)
def test_upstream_status_is_normalised(
    upstream: MockUpstream, status: int, body: Any, want_status: int, want_code: str, want_message: str
) -> None:
    upstream.push(
        Reply.json(body, status=status) if isinstance(body, dict) else Reply(status=status, parts=[body])
    )
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, PREFIX + b"hi" + SUFFIX)
    assert r.status_code == want_status
    error = r.json()["error"]
    assert error["code"] == want_code
    assert want_message in error["message"]
    assert error["type"] == ("server_error" if want_status >= 500 else "invalid_request_error")


def test_upstream_idle_read_timeout_is_504(upstream: MockUpstream) -> None:
    upstream.push(Reply(headers=[("content-type", "application/json")], parts=[2.0, b"{}"]))
    with gateway(upstream, charge_model="reference", upstream_read_timeout=0.5) as (url, _):
        m = MetricDelta()
        r = post(url, PREFIX + b"hi" + SUFFIX)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert m.delta("loopwarden_upstream_errors_total", kind="timeout") == 1


# -- streams: framing (B09-B11), in-band errors (B12), mid-stream overflow, keep-alive -------------
def reference_stream(nl: bytes = b"\n") -> list[bytes]:
    deltas = ["Hel", 'lo "x"', "!"]
    parts = [
        *PRE(),
        *[text_delta(2 + i, d) for i, d in enumerate(deltas)],
        DONE(5, [message_item("".join(deltas))]),
    ]
    return [p.replace(b"\n", nl) for p in parts]


def stream_via_gateway(upstream: MockUpstream, parts: list[Any]) -> list[dict[str, Any]]:
    """The client-visible events, with the gateway-minted response id replaced by a constant."""
    upstream.push(Reply.sse(parts))
    with gateway(upstream, charge_model="reference") as (url, _), sdk(url) as client:
        events = [e.to_dict() for e in client.responses.create(model="m", input="x", stream=True)]
    for event in events:
        if isinstance(event.get("response"), dict):
            assert event["response"]["id"].startswith("resp_")
            event["response"]["id"] = "resp_gateway"
            event["response"]["created_at"] = 0  # filled with "now" when the upstream omits it
    return events


def test_b09_b10_b11_framing_variants_give_identical_client_events(upstream: MockUpstream) -> None:
    want = stream_via_gateway(upstream, reference_stream())
    assert [e["type"] for e in want][-1] == "response.completed"
    crlf = b"".join(reference_stream(b"\r\n"))
    cut = crlf.index(b"}\r\n") + 2
    variants = {
        "crlf": reference_stream(b"\r\n"),
        "cr": reference_stream(b"\r"),
        "split-crlf": [crlf[:cut], crlf[cut:]],
        "one-byte-chunks": [bytes([b]) for b in b"".join(reference_stream())],
        "one-chunk": [b"".join(reference_stream())],
        "noise": [
            b": OPENROUTER PROCESSING\n\n",
            *reference_stream()[:3],
            b":\n\n",
            b": ping - 2025-01-01 00:00:00\n",
            b"retry: 3000\n\n",
            b"id: 7\n\n",
            b"event: ping\n\n",
            b"data:\n\n",
            *reference_stream()[3:],
        ],
    }
    for name, parts in variants.items():
        assert stream_via_gateway(upstream, parts) == want, name


def test_b10_gateway_frames_have_no_comment_data_or_ids(upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([b": OPENROUTER PROCESSING\n\n", *reference_stream()]))
    with gateway(upstream, charge_model="reference") as (url, _):
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10)
    assert b"data: :" not in r.content
    assert b"\nid:" not in r.content and b"retry:" not in r.content
    assert all(data for _, data in sse_events(r.content))


def test_b12_in_band_error_is_one_frame_and_the_sdk_raises(upstream: MockUpstream) -> None:
    error = b'event: error\ndata: {"type":"error","sequence_number":3,"code":"server_error","message":"boom","param":null}\n\n'
    parts = [*PRE(), text_delta(2, "Hel"), error, text_delta(4, "lo"), DONE(5, [message_item("Hello")])]
    upstream.push(Reply.sse(parts))
    with gateway(upstream, charge_model="reference") as (url, _), sdk(url) as client:
        m = MetricDelta()
        seen = []
        with pytest.raises(openai.APIError) as info:
            for event in client.responses.create(model="m", input="x", stream=True):
                seen.append(event.type)
    assert "boom" in str(info.value.message)
    assert seen == ["response.created", "response.in_progress", "response.output_text.delta"]
    assert m.delta("loopwarden_upstream_errors_total", kind="stream_error") == 1
    assert m.delta("loopwarden_stream_errors_total", code="upstream_error") == 1  # upstream codes are folded


def test_b12_raw_frames_after_the_error_are_dropped(upstream: MockUpstream) -> None:
    error = (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    )
    upstream.push(Reply.sse([*PRE(), text_delta(2, "Hel"), error, text_delta(4, "lo"), DONE(5, [])]))
    with gateway(upstream, charge_model="reference") as (url, _):
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10)
    events = sse_events(r.content)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    data = events[-2][1]
    assert data["code"] == "overloaded_error" and data["message"].startswith("Overloaded [request id req_")
    assert data["error"] == {
        "type": "server_error",
        "code": "overloaded_error",
        "message": data["message"],
        "param": None,
    }
    assert data["sequence_number"] == 3 and data["param"] is None and data["type"] == "error"
    # the upstream's frames after its error (and its own [DONE]) are dropped; the gateway's ends the stream
    assert b"response.completed" not in r.content and b'"lo"' not in r.content
    assert r.content.count(b"[DONE]") == 1 and r.content.endswith(b"data: [DONE]\n\n")


def test_b12_non_stream_in_band_error_is_502_with_the_code(upstream: MockUpstream) -> None:
    error = b'event: error\ndata: {"type":"error","sequence_number":3,"code":"server_error","message":"boom","param":null}\n\n'
    upstream.push(Reply.sse([*PRE(), error]))
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, PREFIX + b"hi" + SUFFIX)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "server_error"
    assert r.json()["error"]["message"].startswith("boom [request id req_")


def test_stream_without_terminal_event_is_one_error_frame(upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([*PRE(), text_delta(2, "Hel"), RST]))
    with (
        gateway(upstream, charge_model="reference") as (url, _),
        sdk(url) as client,
        pytest.raises(openai.APIError) as info,
    ):
        list(client.responses.create(model="m", input="x", stream=True))
    assert "upstream" in info.value.message


def test_mid_stream_ledger_overflow_is_exactly_one_error_frame(upstream: MockUpstream) -> None:
    """store on: delta text is kept at 64 × its bytes, so ~16 KiB of text overflows 1 MiB."""
    upstream.push(Reply.sse(text_stream(400, "x" * 100)))
    with gateway(upstream, charge_model="reference") as (url, _):
        m = MetricDelta()
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10)
    events = sse_events(r.content)
    names = [name for name, _ in events]
    assert names.count("error") == 1 and names[-2:] == ["error", "response.failed"]
    assert "response.completed" not in names
    assert events[-2][1]["code"] == "max_retained_bytes_exceeded"
    assert events[-2][1]["sequence_number"] == len(events) - 2
    assert m.delta("loopwarden_cap_hits_total", limit="max_retained_bytes", outcome="sse_error") == 1
    assert m.delta("loopwarden_stream_errors_total", code="max_retained_bytes_exceeded") == 1


def test_200kb_answer_as_10000_deltas_passes_at_the_default_limit(upstream: MockUpstream) -> None:
    """The budget counts what is kept, not every envelope (agentic-api #288)."""
    upstream.push(Reply.sse([b"".join(text_stream(10_000, "y" * 20))]))
    with (
        gateway(upstream, charge_model="reference", max_retained_bytes=67_108_864) as (url, _),
        sdk(url) as client,
    ):
        events = list(client.responses.create(model="m", input="x", stream=True, store=True))
    assert events[-1].type == "response.completed"
    assert len(events) == 10_005
    assert events[-1].response.output[0].content[0].text == "y" * 200_000


def test_keepalive_comments_while_waiting_after_commit(upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([*PRE(), 1.2, DONE(2, [message_item("late")])]))
    with gateway(upstream, charge_model="reference", keepalive_interval=0.3) as (url, _):
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10)
    assert r.content.count(b": keep-alive\n\n") >= 2
    assert [n for n, _ in sse_events(r.content)] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]


def test_keepalive_does_not_upset_the_sdk(upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([*PRE(), 0.8, DONE(2, [message_item("late")])]))
    with gateway(upstream, charge_model="reference", keepalive_interval=0.2) as (url, _), sdk(url) as client:
        events = list(client.responses.create(model="m", input="x", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]


def test_client_disconnect_closes_the_upstream_within_a_second(upstream: MockUpstream) -> None:
    parts: list[Any] = [*PRE()]
    for i in range(300):
        parts += [0.1, text_delta(2 + i, "z")]
    upstream.push(Reply.sse(parts))
    with gateway(upstream, charge_model="reference") as (url, _):
        m = MetricDelta()
        with httpx.stream(
            "POST", url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10
        ) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen += 1
                if seen == 3:
                    break
        closed_at = time.monotonic()
        while upstream.peer_closed == 0 and time.monotonic() - closed_at < 3:
            time.sleep(0.02)
        noticed = time.monotonic() - closed_at
        written = upstream.bytes_written
        time.sleep(0.5)
        stopped = upstream.bytes_written == written
        # the next request is served: the slot and the pool connection were released
        upstream.push(ok_reply())
        follow = post(url, PREFIX + b"hi" + SUFFIX)
    assert upstream.peer_closed == 1
    assert noticed <= 1.0
    assert stopped, "the mock stopped writing"
    assert m.delta("loopwarden_client_disconnects_total") == 1
    assert follow.status_code == 200


def test_concurrent_requests_keep_separate_ledgers(upstream: MockUpstream) -> None:
    n = 8
    upstream.push(*[ok_reply(f"r{i}") for i in range(n)])
    results: list[int] = []
    with gateway(upstream, charge_model="reference") as (url, _):
        threads = [
            threading.Thread(
                target=lambda: results.append(post(url, PREFIX + b"x" * 5000 + SUFFIX).status_code)
            )
            for _ in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [200] * n


def test_function_call_output_of_a_stream_reaches_the_client_unchanged(upstream: MockUpstream) -> None:
    call = FC("call_1", "get_time", "{}")
    upstream.push(Reply.sse([*PRE(), DONE(2, [call])]))
    with gateway(upstream, charge_model="reference") as (url, _), sdk(url) as client:
        events = list(client.responses.create(model="m", input="x", stream=True))
    assert events[-1].response.output[0].to_dict() == call


def test_api_keys_gate_every_create_request(upstream: MockUpstream) -> None:
    upstream.push(ok_reply())
    with gateway(upstream, charge_model="reference", api_key=("k-one", "k-two")) as (url, counter):
        missing = post(url, PREFIX + b"hi" + SUFFIX)
        wrong = post(url, PREFIX + b"hi" + SUFFIX, authorization="Bearer nope")
        right = post(url, PREFIX + b"hi" + SUFFIX, authorization="Bearer k-two")
    assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert "no API key" in missing.json()["error"]["message"]
    assert "k-one" not in wrong.text and "nope" not in wrong.text
    assert counter.body_bytes == len(PREFIX + b"hi" + SUFFIX), "refused requests' bodies are not read"
    assert len(upstream.requests) == 1


def test_errors_caused_by_a_lowering_header_say_so(upstream: MockUpstream) -> None:
    with gateway(upstream, charge_model="reference") as (url, _):
        r = post(url, PREFIX + b"a" * 200 + SUFFIX, **{"loopwarden-max-retained-bytes": "16384"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert (
        "lowered max_retained_bytes with its loopwarden-max-retained-bytes header"
        in r.json()["error"]["message"]
    )


# -- the same boundaries under the default (measured) charge model --------------------------------
def _text_body(n: int) -> bytes:
    return PREFIX + b"a" * n + SUFFIX


def test_measured_ledger_boundary_exact_to_the_byte(upstream: MockUpstream) -> None:
    """The default model: the largest body whose measured input charge (store on) fits B is
    admitted and reaches the upstream; one more byte of text is 413 and never does."""
    model = ChargeModel.measured()

    def fits(n: int) -> bool:
        return model.measured_input(json_features(_text_body(n)), store=True) <= B

    lo, hi = 0, B
    while lo < hi:  # the charge grows with the text: the largest n that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    assert fits(lo) and not fits(lo + 1)
    upstream.push(ok_reply())
    with gateway(upstream) as (url, _):
        at_limit = post(url, _text_body(lo))
        assert len(upstream.requests) == 1
        over = post(url, _text_body(lo + 1))
    assert at_limit.status_code in (200, 502), at_limit.text
    assert over.status_code == 413 and over.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert len(upstream.requests) == 1


def test_measured_raw_clamp_boundary(upstream: MockUpstream) -> None:
    """The default model's clamp is B x 2/3: exactly that many bytes are read (and then overflow
    the ledger); one more is request_too_large before the upstream is ever called."""
    clamp = ChargeModel.measured().body_clamp(B)
    assert clamp == B * 2 // 3
    body = _text_body(clamp - len(PREFIX) - len(SUFFIX))
    with gateway(upstream) as (url, _):
        at = post(url, body)
        over = post(url, body[:-2] + b'a"}')
    assert at.json()["error"]["code"] == "max_retained_bytes_exceeded"
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
    assert "measured charge model" in over.json()["error"]["message"]
    assert upstream.requests == []
