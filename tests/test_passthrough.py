"""Walking skeleton: the gateway forwards recorded real Responses traffic end to end.

Real parts: a real uvicorn serving the gateway, the official `openai` SDK as the client, a
scripted upstream on a loopback socket replaying cassettes from ../shared/cassettes.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from middleware.app import create_app
from middleware.config import Settings
from tests.mock_upstream import E, MockUpstream, Reply, cassettes_dir, load_cassette
from tests.servers import serve_asgi

CASSETTES = cassettes_dir()
SKIP_REASON = "recorded cassettes not found: put ../shared beside the repo or set $LOOPWARDEN_CASSETTES"
REPLAYED = ["tool_calls/multi_turn/*.yaml", "events/*.yaml", "reasoning/**/*.yaml", "tool_loop/*.yaml"]


def _cassette_ids() -> list[str]:
    if CASSETTES is None:
        return ["<absent>"]
    return sorted(str(p.relative_to(CASSETTES)) for pattern in REPLAYED for p in CASSETTES.glob(pattern))


@pytest.fixture
def upstream() -> Iterator[MockUpstream]:
    with MockUpstream() as mock:
        yield mock


def gateway(upstream: MockUpstream, **overrides: Any) -> Any:
    settings = Settings(upstream=upstream.base_url, upstream_api_key="operator-secret", **overrides)
    return serve_asgi(create_app(settings))


def sdk(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="client-key", max_retries=0)


_KNOWN = set(inspect.signature(OpenAI(api_key="x").responses.create).parameters)


def _split(params: dict[str, Any]) -> dict[str, Any]:
    known = {k: v for k, v in params.items() if k in _KNOWN}
    extra = {k: v for k, v in params.items() if k not in _KNOWN}
    return {**known, "extra_body": extra} if extra else known


@pytest.mark.skipif(CASSETTES is None, reason=SKIP_REASON)
@pytest.mark.parametrize("name", _cassette_ids())
def test_cassette_replays_unchanged(upstream: MockUpstream, name: str) -> None:
    assert CASSETTES is not None
    turns = list(load_cassette(CASSETTES / name))
    assert turns, f"{name} has no turns"
    upstream.push(*(t.reply for t in turns))
    ids: dict[str, str] = {}
    with gateway(upstream) as url, sdk(url) as client:
        for i, turn in enumerate(turns):
            params = dict(turn.request)
            if params.get("previous_response_id") in ids:
                params["previous_response_id"] = ids[params["previous_response_id"]]
            if turn.events is not None:
                params["stream"] = True
                got = [e.to_dict() for e in client.responses.create(**_split(params))]
                want = turn.events
                assert [e["type"] for e in got] == [e.get("type") for e in want]
                assert got == want
                terminal = want[-1].get("response", {})
                ids[terminal.get("id", f"turn{i}")] = got[-1].get("response", {}).get("id", f"turn{i}")
            else:
                assert turn.body is not None
                raw = client.responses.with_raw_response.create(**_split(params))
                assert raw.status_code == 200
                assert raw.http_response.json() == turn.body
                parsed = raw.parse()
                assert [item.to_dict() for item in parsed.output] == turn.body["output"]
                ids[turn.body["id"]] = parsed.id
            sent = upstream.requests[i]
            assert sent.path == "/v1/responses"
            assert sent.json() == params, "the upstream must receive what the client sent"
            assert sent.headers["authorization"] == "Bearer operator-secret"
    assert len(upstream.requests) == len(turns)


@pytest.mark.skipif(CASSETTES is None, reason=SKIP_REASON)
def test_sse_answer_to_a_buffered_call_is_aggregated(upstream: MockUpstream) -> None:
    assert CASSETTES is not None
    turn = next(
        load_cassette(CASSETTES / "tool_calls/multi_turn/openai_responses_tool_calls_3turn_streaming.yaml")
    )
    assert turn.events is not None
    upstream.push(turn.reply)
    with gateway(upstream) as url, sdk(url) as client:
        params = {**turn.request, "stream": False}
        raw = client.responses.with_raw_response.create(**_split(params))
    assert raw.status_code == 200
    assert raw.http_response.json() == turn.events[-1]["response"]
    assert raw.parse().output[0].type == "function_call"


def _pre() -> list[bytes]:
    created = {"id": "resp_up", "object": "response", "status": "in_progress", "output": []}
    return [
        E("response.created", {"type": "response.created", "sequence_number": 0, "response": created}),
        E(
            "response.in_progress",
            {"type": "response.in_progress", "sequence_number": 1, "response": created},
        ),
    ]


def _done(seq: int, text: str) -> bytes:
    item = {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    response = {"id": "resp_up", "object": "response", "status": "completed", "output": [item]}
    return E(
        "response.completed", {"type": "response.completed", "sequence_number": seq, "response": response}
    )


def test_first_event_reaches_the_client_before_the_upstream_finishes(upstream: MockUpstream) -> None:
    """The mock holds the rest of its stream until the client has seen the first event: a gateway
    that buffered the stream would deadlock here and fail on the read timeout."""
    client_saw_first = threading.Event()
    delta = E(
        "response.output_text.delta",
        {
            "type": "response.output_text.delta",
            "sequence_number": 2,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": "hi",
        },
    )
    upstream.push(Reply.sse([*_pre(), client_saw_first, delta, _done(3, "hi")]))
    with gateway(upstream) as url, sdk(url) as client:
        types = []
        for event in client.responses.create(model="m", input="x", stream=True, timeout=15):
            types.append(event.type)
            client_saw_first.set()
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_text.delta",
        "response.completed",
    ]
    assert upstream.bytes_written > 0


def test_upstream_read_timeout_is_a_504_not_a_hang(upstream: MockUpstream) -> None:
    upstream.push(Reply(status=200, headers=[("content-type", "application/json")], parts=[3.0, b"{}"]))
    with gateway(upstream, upstream_read_timeout=0.5) as url:
        started = time.monotonic()
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x"}, timeout=10)
        elapsed = time.monotonic() - started
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert r.json()["error"]["type"] == "server_error"
    assert elapsed < 2.5


def test_upstream_unreachable_is_a_502_envelope() -> None:
    settings = Settings(upstream="http://127.0.0.1:9/v1", upstream_connect_timeout=2)
    with serve_asgi(create_app(settings)) as url:
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x"}, timeout=10)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"


def test_framing_headers_are_not_copied_from_upstream(upstream: MockUpstream) -> None:
    upstream.push(
        Reply(
            status=200,
            headers=[
                ("content-type", "application/json"),
                ("content-encoding", "identity"),
                ("x-upstream", "1"),
            ],
            parts=[
                json.dumps(
                    {"id": "resp_up", "object": "response", "status": "completed", "output": []}
                ).encode()
            ],
        )
    )
    with gateway(upstream) as url:
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x"}, timeout=10)
    assert r.status_code == 200
    assert "content-encoding" not in r.headers
    assert r.headers["content-length"] == str(len(r.content))
    assert r.json()["id"] == "resp_up"


def test_embedded_dev_model_serves_without_upstream() -> None:
    with serve_asgi(create_app(Settings())) as url, sdk(url) as client:
        response = client.responses.create(model="dev", input="hello")
        assert response.status == "completed"
        assert response.output_text == "You said: hello"
        with client.responses.stream(model="dev", input="hello") as stream:
            types = [event.type for event in stream]
            final = stream.get_final_response()
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    assert final.output_text == "You said: hello"


def test_healthz_and_metrics(upstream: MockUpstream) -> None:
    with gateway(upstream) as url:
        assert httpx.get(url + "/healthz").json() == {"status": "ok"}
        metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200
    assert "loopwarden_requests_total" in metrics.text
