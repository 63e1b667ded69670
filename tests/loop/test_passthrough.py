"""Walking skeleton: the gateway forwards recorded real Responses traffic end to end.

Real parts: a real uvicorn serving the gateway, the official `openai` SDK as the client, a
scripted upstream on a loopback socket replaying cassettes from ../shared/cassettes.
"""

from __future__ import annotations

import copy
import inspect
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from middleware.app import create_app
from middleware.config import Settings
from middleware.loop.echo import normalise_response
from middleware.loop.passthrough import NORMALISED_EVENTS
from tests.mock_upstream import E, MockUpstream, Reply, cassettes_dir, load_cassette
from tests.servers import serve_asgi

CASSETTES = cassettes_dir()
SKIP_REASON = "recorded cassettes not found: put ../shared beside the repo or set $LOOPWARDEN_CASSETTES"
REPLAYED = ["tool_calls/multi_turn/*.yaml", "events/*.yaml", "reasoning/**/*.yaml", "tool_loop/*.yaml"]


def _cassette_ids() -> list[str]:
    if CASSETTES is None:
        return ["<absent>"]
    return sorted(str(p.relative_to(CASSETTES)) for pattern in REPLAYED for p in CASSETTES.glob(pattern))


def gateway(upstream: MockUpstream, **overrides: Any) -> Any:
    overrides.setdefault("store", "memory")
    settings = Settings(upstream=upstream.base_url, upstream_api_key="operator-secret", **overrides)
    return serve_asgi(create_app(settings))


def sdk(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="client-key", max_retries=0)


_KNOWN = set(inspect.signature(OpenAI(api_key="x").responses.create).parameters)


def _split(params: dict[str, Any]) -> dict[str, Any]:
    known = {k: v for k, v in params.items() if k in _KNOWN}
    extra = {k: v for k, v in params.items() if k not in _KNOWN}
    return {**known, "extra_body": extra} if extra else known


def _items(value: Any) -> list[Any]:
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


def _recorded_output(turn: Any) -> list[Any]:
    """The output items a recorded turn produced (terminal response, else the .done events)."""
    if turn.body is not None:
        return list(turn.body["output"])
    terminal = turn.events[-1].get("response", {})
    if isinstance(terminal.get("output"), list):
        return list(terminal["output"])
    done = [e for e in turn.events if e.get("type") == "response.output_item.done"]
    return [e["item"] for e in sorted(done, key=lambda e: e["output_index"])]


# What the gateway owns in a response object (its id, the echo of what the client asked for).
GATEWAY_OWNED = {
    "id",
    "object",
    "store",
    "previous_response_id",
    "tools",
    "tool_choice",
    "conversation",
    "usage",
}


def _unanswered(items: list[Any]) -> list[str]:
    answered = {i.get("call_id") for i in items if i.get("type") == "function_call_output"}
    return [i["call_id"] for i in items if i.get("type") == "function_call" and i["call_id"] not in answered]


def _client_view(event: dict[str, Any], request: dict[str, Any] | None = None) -> dict[str, Any]:
    """An event as compared: no sequence number, no gateway-owned response fields; with
    `request`, a recorded response object as the gateway normalises it (echo fields the
    upstream left out filled from the request)."""
    out = {k: v for k, v in event.items() if k != "sequence_number"}
    if isinstance(out.get("response"), dict):
        response = copy.deepcopy(out["response"])
        if request is not None and out.get("type") in NORMALISED_EVENTS:
            normalise_response(response, request)
        out["response"] = {k: v for k, v in response.items() if k not in GATEWAY_OWNED | {"output"}}
    return out


def _normalised(recorded: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """A recorded buffered body as the gateway answers it (`normalise_response`)."""
    body = copy.deepcopy(recorded)
    normalise_response(body, request)
    return {k: v for k, v in body.items() if k not in GATEWAY_OWNED}


@pytest.mark.skipif(CASSETTES is None, reason=SKIP_REASON)
@pytest.mark.parametrize("name", _cassette_ids())
def test_cassette_replays_with_the_whole_item_chain_upstream(upstream: MockUpstream, name: str) -> None:
    """Each recorded turn is replayed through the gateway with its store on: the client sees the
    recorded events and output items (under the gateway's own response id), and the upstream
    receives ``store: false`` and, for a turn continuing ``previous_response_id``, the whole item
    chain — every earlier turn's input and output items, oldest first — then the new input."""
    assert CASSETTES is not None
    turns = list(load_cassette(CASSETTES / name))
    assert turns, f"{name} has no turns"
    upstream.push(*(t.reply for t in turns))
    ids: dict[str, str] = {}  # recorded response id -> the gateway's
    chains: dict[str, list[Any]] = {}  # recorded response id -> the items its chain holds
    with gateway(upstream) as url, sdk(url) as client:
        for i, turn in enumerate(turns):
            params = dict(turn.request)
            previous = params.get("previous_response_id")
            if previous is not None:
                params["previous_response_id"] = ids[previous]
            history = chains.get(previous, []) if previous is not None else []
            dangling = _unanswered([*history, *_items(turn.request["input"])]) if history else []
            if dangling:
                # Recorded against a lenient server; the gateway follows OpenAI (case B03): a stored
                # call left without its output is a 400 naming it, before any upstream call.
                with pytest.raises(openai.BadRequestError) as info:
                    client.responses.create(**_split(params))
                assert dangling[0] in info.value.message
                assert len(upstream.requests) == i
                return
            if turn.events is not None:
                params["stream"] = True
                got = [e.to_dict() for e in client.responses.create(**_split(params))]
                want = turn.events
                assert [e["type"] for e in got] == [e.get("type") for e in want]
                assert [e["sequence_number"] for e in got] == list(range(len(got)))
                views = [(_client_view(g), _client_view(w, params)) for g, w in zip(got, want, strict=True)]
                for (seen, recorded), w in zip(views, want, strict=True):
                    if isinstance(w.get("response"), dict) and "created_at" not in w["response"]:
                        # filled by the gateway with the request's own second (checked elsewhere)
                        seen["response"].pop("created_at", None)
                        recorded["response"].pop("created_at", None)
                assert [seen for seen, _ in views] == [recorded for _, recorded in views]
                recorded_id = want[-1].get("response", {}).get("id", f"turn{i}")
                gateway_id = got[-1]["response"]["id"]
                output = got[-1]["response"]["output"]
            else:
                assert turn.body is not None
                raw = client.responses.with_raw_response.create(**_split(params))
                assert raw.status_code == 200
                parsed = raw.parse()
                body = raw.http_response.json()
                assert {k: v for k, v in body.items() if k not in GATEWAY_OWNED} == _normalised(
                    turn.body, params
                )
                recorded_id, gateway_id, output = turn.body["id"], parsed.id, body["output"]
            assert gateway_id.startswith("resp_") and gateway_id != recorded_id
            assert output == _recorded_output(turn)
            ids[recorded_id] = gateway_id
            chains[recorded_id] = [*history, *_items(turn.request["input"]), *_recorded_output(turn)]
            sent = upstream.requests[i].json()
            assert upstream.requests[i].path == "/v1/responses"
            assert upstream.requests[i].headers["authorization"] == "Bearer operator-secret"
            assert sent["store"] is False and "previous_response_id" not in sent
            want_input = [*history, *_items(turn.request["input"])] if history else turn.request["input"]
            assert sent["input"] == want_input, "the upstream receives the whole item chain, in order"
            for key in ("model", "tools", "tool_choice", "instructions"):
                assert sent.get(key) == turn.request.get(key)
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
    body = raw.http_response.json()
    recorded = turn.events[-1]["response"]
    assert {k: v for k, v in body.items() if k not in GATEWAY_OWNED} == _normalised(recorded, params)
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
    settings = Settings(upstream="http://127.0.0.1:9/v1", upstream_connect_timeout=2, store="memory")
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
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "store": False}, timeout=10)
    assert r.status_code == 200
    assert "content-encoding" not in r.headers
    assert r.headers["content-length"] == str(len(r.content))
    assert r.json()["id"] == "resp_up"


def test_embedded_dev_model_serves_without_upstream() -> None:
    with serve_asgi(create_app(Settings(store="memory"))) as url, sdk(url) as client:
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


def test_unknown_routes_and_methods_use_the_error_envelope(upstream: MockUpstream) -> None:
    with gateway(upstream) as url:
        missing = httpx.get(url + "/v1/models-nope", timeout=10)
        wrong = httpx.get(url + "/v1/responses", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.headers["content-type"] == "application/json"
