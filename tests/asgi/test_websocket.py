"""WebSocket mode of ``/v1/responses`` (issue 19): real uvicorn, real WebSocket clients.

The clients are the ``websockets`` package and the official ``openai`` SDK's
``client.responses.connect()``; the gateway runs on a real uvicorn with the WebSocket options
``loopwarden serve`` uses (`uvicorn_websocket_options`), in front of the scripted upstream or a
real MCP server. A non-reading client is a raw socket with a 4 KiB receive window that did the
upgrade by hand. Lifetimes and idle timeouts are made short through the settings.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from middleware.app import create_app
from middleware.asgi.websocket import uvicorn_websocket_options, websocket_max_size
from middleware.config import Settings
from middleware.ops.connections import connection_options
from tests.helpers import DONE, FC, PRE, MetricDelta, message_item, metric, sse_events, text_delta
from tests.mcp_servers import Probe, build_tools_server, serve_mcp
from tests.mock_upstream import E, MockUpstream, Reply, cassettes_dir
from tests.servers import serve_asgi

B = 1_048_576
KEY = "ws-test-key"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
WS = "loopwarden_websocket_turns_total"
CAP = "loopwarden_cap_hits_total"


@contextlib.contextmanager
def ws_gateway(upstream: MockUpstream | None, **overrides: Any) -> Iterator[str]:
    """The gateway on a real uvicorn with `loopwarden serve`'s connection options (the bounded
    protocol of ``http``, its WebSocket options: `uvicorn_websocket_options`); yields its
    ``http://`` base URL."""
    overrides.setdefault("max_retained_bytes", 4 * B)
    overrides.setdefault("store", "memory")
    overrides.setdefault("upstream_read_timeout", 5.0)
    overrides.setdefault("upstream_connect_timeout", 2.0)
    settings = Settings(upstream=upstream.base_url if upstream else None, **overrides)
    with serve_asgi(create_app(settings), **connection_options(settings)) as url:
        yield url


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/responses"


def answer(text: str) -> Reply:
    return Reply.sse([*PRE(), text_delta(2, text), DONE(3, [message_item(text)])])


def create(**body: Any) -> str:
    return json.dumps({"type": "response.create", "model": "m", **body})


async def turn(ws: ClientConnection, message: str | None = None) -> list[dict[str, Any]]:
    """Send `message` (if any) and read one turn's messages: up to its terminal event, or an error
    before the first event (no ``sequence_number``)."""
    if message is not None:
        await ws.send(message)
    out: list[dict[str, Any]] = []
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 20))
        out.append(event)
        if event["type"] in TERMINAL or (event["type"] == "error" and "sequence_number" not in event):
            return out


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def settled(m: MetricDelta, name: str, want: float, **labels: str) -> float:
    deadline = time.monotonic() + 5
    while m.delta(name, **labels) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return m.delta(name, **labels)


# -- turns ---------------------------------------------------------------------------------------


def _without_created_at(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`events` with every ``response.created_at`` set to 0 (each request's own second)."""
    out = json.loads(json.dumps(events))
    for event in out:
        if isinstance(event.get("response"), dict) and "created_at" in event["response"]:
            event["response"]["created_at"] = 0
    return out


def test_turns_are_the_sse_events_in_order_and_continue_from_connection_memory(
    upstream: MockUpstream,
) -> None:
    upstream.push(answer("hello"), answer("hello"), answer("again"))
    with ws_gateway(upstream) as url:
        sse = sse_events(
            httpx.post(
                url + "/v1/responses", json={"model": "m", "input": "hi", "stream": True}, timeout=20
            ).content
        )
        m = MetricDelta()

        async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            async with websockets.connect(ws_url(url)) as ws:
                first = await turn(ws, create(input="hi"))
                rid = first[-1]["response"]["id"]
                second = await turn(ws, create(input="more", store=False, previous_response_id=rid))
                return first, second

        first, second = run(main())
    # the same events, in the same order with the same sequence numbers, as the SSE stream
    # (the response id is each response's own, and so is ``created_at``: the second each request
    # arrived in, which differs when the two straddle a second boundary)
    http_id = sse[-1][1]["response"]["id"]
    same = [json.loads(json.dumps(obj).replace(http_id, first[-1]["response"]["id"])) for _, obj in sse]
    assert _without_created_at(first) == _without_created_at(same)
    assert [e["type"] for e in first] == [
        "response.created",
        "response.in_progress",
        "response.output_text.delta",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in second] == [0, 1, 2, 3]
    assert second[-1]["response"]["previous_response_id"] == first[-1]["response"]["id"]
    # the continuation replayed the first turn's input and output before the new input
    sent = upstream.requests[2].json()["input"]
    assert [i.get("role") for i in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"][0]["text"] == "hello" and sent[2]["content"] == "more"
    assert settled(m, WS, 2, outcome="completed") == 2
    assert metric("loopwarden_websocket_connections") == 0


def test_connection_memory_is_charged_to_the_process_pool_while_the_connection_lives(
    upstream: MockUpstream,
) -> None:
    upstream.push(answer("remember me " * 200))
    with ws_gateway(upstream) as url:

        async def main() -> tuple[float, float]:
            async with websockets.connect(ws_url(url)) as ws:
                await turn(ws, create(input="hi", store=False))
                deadline = time.monotonic() + 5
                while metric("loopwarden_inflight_requests") and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                # no request in flight: what is charged now is the connection's memory
                return metric("loopwarden_inflight_retained_bytes"), metric(
                    "loopwarden_admission_reserved_bytes"
                )

        charged, reserved = run(main())
        deadline = time.monotonic() + 5
        while metric("loopwarden_inflight_retained_bytes") and time.monotonic() < deadline:
            time.sleep(0.01)
        after = metric("loopwarden_inflight_retained_bytes")
    assert charged >= len("remember me " * 200) and reserved >= charged
    assert after == 0


def test_messages_sent_back_to_back_are_served_one_at_a_time_in_order(upstream: MockUpstream) -> None:
    upstream.push(answer("one"), answer("two"), answer("three"))
    with ws_gateway(upstream) as url:

        async def main() -> list[list[dict[str, Any]]]:
            async with websockets.connect(ws_url(url)) as ws:
                for text in ("a", "b", "c"):
                    await ws.send(create(input=text, store=False))
                return [await turn(ws) for _ in range(3)]

        turns = run(main())
    texts = [t[-1]["response"]["output"][0]["content"][0]["text"] for t in turns]
    assert texts == ["one", "two", "three"]
    for events in turns:  # never interleaved: each turn numbered from 0, one terminal event
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert sum(e["type"] in TERMINAL for e in events) == 1
    assert [r.json()["input"] for r in upstream.requests] == ["a", "b", "c"]


def test_the_sdk_connect_continues_store_false_and_a_new_connection_cannot(upstream: MockUpstream) -> None:
    upstream.push(answer("first"), answer("second"))
    with ws_gateway(upstream, api_key=(KEY,)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)

        async def main() -> tuple[str, list[str], dict[str, Any]]:
            async with client.responses.connect() as conn:
                await conn.response.create(model="m", input="hi", store=False)
                first = [e async for e in _until_terminal(conn)]
                rid = first[-1].response.id
                await conn.response.create(model="m", input="next", store=False, previous_response_id=rid)
                second = [e.type async for e in _until_terminal(conn)]
            async with client.responses.connect() as conn:  # a reconnect: the old id is gone
                await conn.response.create(model="m", input="again", store=False, previous_response_id=rid)
                error = json.loads(await conn.recv_bytes())
            return rid, second, error

        rid, second, error = run(main())
    assert second[-1] == "response.completed"
    assert error["type"] == "error" and error["status"] == 400
    assert error["error"]["code"] == "previous_response_not_found"
    assert error["error"]["param"] == "previous_response_id" and rid in error["error"]["message"]
    assert len(upstream.requests) == 2, "the refused turn never went upstream"


async def _until_terminal(conn: Any) -> Any:
    async for event in conn:
        yield event
        if event.type in TERMINAL or event.type == "error":
            return


def test_store_true_continues_on_a_new_connection_from_the_store(upstream: MockUpstream) -> None:
    upstream.push(answer("stored"), answer("continued"))
    with ws_gateway(upstream) as url:

        async def main() -> list[dict[str, Any]]:
            async with websockets.connect(ws_url(url)) as ws:
                rid = (await turn(ws, create(input="hi")))[-1]["response"]["id"]
            async with websockets.connect(ws_url(url)) as ws:
                return await turn(ws, create(input="more", previous_response_id=rid))

        events = run(main())
    assert events[-1]["type"] == "response.completed"
    assert [i.get("role") for i in upstream.requests[1].json()["input"]] == ["user", "assistant", "user"]


def test_a_failed_continuation_evicts_its_previous_response(upstream: MockUpstream) -> None:
    upstream.push(answer("kept"), Reply.json({"error": {"message": "boom", "code": "server_error"}}, 500))
    with ws_gateway(upstream) as url:

        async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            async with websockets.connect(ws_url(url)) as ws:
                rid = (await turn(ws, create(input="hi", store=False)))[-1]["response"]["id"]
                failed = await turn(ws, create(input="x", store=False, previous_response_id=rid))
                again = await turn(ws, create(input="y", store=False, previous_response_id=rid))
                return failed, again

        failed, again = run(main())
    assert failed[-1]["type"] == "error" and failed[-1]["status"] == 502
    assert again == [again[0]] and again[0]["error"]["code"] == "previous_response_not_found"
    assert len(upstream.requests) == 2


def test_http_only_fields_and_openai_extras_are_refused_and_the_connection_stays_usable(
    upstream: MockUpstream,
) -> None:
    upstream.push(answer("fine"))
    with ws_gateway(upstream) as url:
        m = MetricDelta()

        async def main() -> list[list[dict[str, Any]]]:
            async with websockets.connect(ws_url(url)) as ws:
                return [
                    await turn(ws, create(input="x", stream=True)),
                    await turn(ws, create(input="x", background=True)),
                    await turn(ws, json.dumps({"type": "response.steer", "input": "faster"})),
                    await turn(ws, create(input="x", stream_id="lane-2")),
                    await turn(ws, "not json"),
                    await turn(ws, create(input="ok", store=False)),
                ]

        *refused, ok = run(main())
    params = [t[0]["error"]["param"] for t in refused]
    assert params == ["stream", "background", "type", "stream_id", None]
    assert [t[0]["status"] for t in refused] == [400] * 5
    assert "OpenAI-only" in refused[2][0]["error"]["message"]
    assert refused[4][0]["error"]["code"] == "invalid_json"
    assert ok[-1]["type"] == "response.completed"
    assert len(upstream.requests) == 1
    assert settled(m, WS, 5, outcome="failed") == 5


# -- limits mid-turn -----------------------------------------------------------------------------


def fc_stream(call: dict[str, Any]) -> Reply:
    added = {**call, "arguments": "", "status": "in_progress"}
    return Reply.sse(
        [
            *PRE(),
            E(
                "response.output_item.added",
                {
                    "type": "response.output_item.added",
                    "sequence_number": 2,
                    "output_index": 0,
                    "item": added,
                },
            ),
            E(
                "response.output_item.done",
                {"type": "response.output_item.done", "sequence_number": 3, "output_index": 0, "item": call},
            ),
            DONE(4, [call]),
        ]
    )


def test_a_508_mid_turn_is_an_error_then_response_failed_and_the_next_turn_runs(
    upstream: MockUpstream,
) -> None:
    probe = Probe()
    upstream.push(*[fc_stream(FC(f"call_{i}", "lookup", "{}")) for i in range(2)], answer("after"))
    tools = {"type": "mcp", "server_label": "tools", "require_approval": "never"}
    with (
        serve_mcp(build_tools_server(probe)) as (mcp, _),
        ws_gateway(upstream, mcp_server=(f"tools={mcp}",), max_infer_iters=2) as url,
    ):
        m = MetricDelta()

        async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            async with websockets.connect(ws_url(url)) as ws:
                looped = await turn(ws, create(input="loop", tools=[tools], store=False))
                return looped, await turn(ws, create(input="next", store=False))

        looped, after = run(main())
    names = [e["type"] for e in looped]
    assert names[0] == "response.created" and names[-2:] == ["error", "response.failed"]
    error, failed = looped[-2:]
    assert error["status"] == 508 and error["error"]["code"] == "max_infer_iters_exceeded"
    assert failed["sequence_number"] == error["sequence_number"] + 1
    assert failed["response"]["error"]["code"] == "max_infer_iters_exceeded"
    assert "response.mcp_call.completed" in names and probe.names() == ["lookup"]
    assert after[-1]["type"] == "response.completed"
    assert settled(m, CAP, 1, limit="max_infer_iters", outcome="sse_error", transport="websocket") == 1
    assert m.delta(CAP, limit="max_infer_iters", outcome="sse_error") == 0  # not counted as http


def test_a_repeated_failing_turn_runs_again_and_is_not_a_retry_shield_replay(upstream: MockUpstream) -> None:
    """The retry shield replays HTTP answers; on a WebSocket each turn's failure is an envelope
    of its connection, so two identical failing turns both run (both reach the upstream) and both
    say their own status (a replay once said ``"status": 200``)."""
    probe = Probe()
    upstream.push(*[fc_stream(FC(f"call_{i}", "lookup", "{}")) for i in range(4)])
    tools = {"type": "mcp", "server_label": "tools", "require_approval": "never"}
    with (
        serve_mcp(build_tools_server(probe)) as (mcp, _),
        ws_gateway(
            upstream, mcp_server=(f"tools={mcp}",), max_infer_iters=2, retry_shield_seconds=30.0
        ) as url,
    ):

        async def main() -> list[list[dict[str, Any]]]:
            async with websockets.connect(ws_url(url)) as ws:
                message = create(input="loop", tools=[tools], store=False)
                return [await turn(ws, message), await turn(ws, message)]

        turns = run(main())
    for events in turns:
        error = events[-2]
        assert (error["type"], error["status"], error["error"]["code"]) == (
            "error",
            508,
            "max_infer_iters_exceeded",
        )
    assert len(upstream.requests) == 4


def test_a_ledger_overflow_mid_turn_is_a_502_error_then_response_failed(upstream: MockUpstream) -> None:
    big = [text_delta(2 + i, "y" * 16_384) for i in range(100)]
    upstream.push(Reply.sse([*PRE(), *big, DONE(102, [message_item("never")])]), answer("small"))
    with ws_gateway(upstream, max_retained_bytes=B) as url:
        m = MetricDelta()

        async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            async with websockets.connect(ws_url(url)) as ws:
                return await turn(ws, create(input="x", store=False)), await turn(
                    ws, create(input="y", store=False)
                )

        over, after = run(main())
    assert over[-2]["type"] == "error" and over[-2]["status"] == 502
    assert over[-2]["error"]["code"] == "max_retained_bytes_exceeded"
    assert over[-1]["type"] == "response.failed"
    assert after[-1]["type"] == "response.completed"
    assert settled(m, CAP, 1, limit="max_retained_bytes", outcome="sse_error", transport="websocket") == 1


# -- connection bounds ---------------------------------------------------------------------------


def test_the_lifetime_limit_sends_websocket_connection_limit_reached_and_closes_1001(
    upstream: MockUpstream,
) -> None:
    upstream.push(answer("in time"))
    with ws_gateway(upstream, websocket_max_lifetime=1.5) as url:
        m = MetricDelta()

        async def main() -> tuple[list[dict[str, Any]], dict[str, Any], int | None, float]:
            async with websockets.connect(ws_url(url)) as ws:
                opened = time.monotonic()
                served = await turn(ws, create(input="x", store=False))
                error = json.loads(await asyncio.wait_for(ws.recv(), 10))
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 10)
                return served, error, ws.close_code, time.monotonic() - opened

        served, error, code, age = run(main())
    assert served[-1]["type"] == "response.completed"
    assert error["status"] == 400 and error["error"]["code"] == "websocket_connection_limit_reached"
    assert code == 1001 and 1.4 < age < 8
    assert settled(m, CAP, 1, limit="websocket_lifetime", outcome="400", transport="websocket") == 1


def test_an_idle_connection_is_closed_1001(upstream: MockUpstream) -> None:
    with ws_gateway(upstream, websocket_idle_timeout=0.5) as url:
        m = MetricDelta()

        async def main() -> tuple[dict[str, Any], int | None]:
            async with websockets.connect(ws_url(url)) as ws:
                error = json.loads(await asyncio.wait_for(ws.recv(), 10))
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 10)
                return error, ws.close_code

        error, code = run(main())
    assert error["status"] == 408 and error["error"]["code"] == "websocket_idle_timeout" and code == 1001
    assert settled(m, CAP, 1, limit="websocket_idle", outcome="408", transport="websocket") == 1


def test_oversize_messages_close_1009(upstream: MockUpstream) -> None:
    settings = Settings(max_retained_bytes=B, store="memory")
    limit = websocket_max_size(settings)
    with ws_gateway(upstream, max_retained_bytes=B) as url:
        m = MetricDelta()

        async def main() -> tuple[int | None, dict[str, Any], int | None]:
            # over the server's clamp: uvicorn refuses the frame (ws_max_size) and closes 1009
            async with websockets.connect(ws_url(url), max_size=None) as ws:
                await ws.send(create(input="x" * (limit + 1)))
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 10)
                over_server = ws.close_code
            # over the clamp this connection lowered with its header: an envelope, then 1009
            lowered = {"loopwarden-max-retained-bytes": str(B // 4)}
            async with websockets.connect(ws_url(url), additional_headers=lowered) as ws:
                await ws.send(create(input="x" * (limit // 2)))
                error = json.loads(await asyncio.wait_for(ws.recv(), 10))
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 10)
                return over_server, error, ws.close_code

        over_server, error, code = run(main())
    assert over_server == 1009
    assert error["status"] == 413 and error["error"]["code"] == "request_too_large" and code == 1009
    assert settled(m, CAP, 2, limit="websocket_message_size", outcome="413", transport="websocket") == 2
    assert len(upstream.requests) == 0


@pytest.mark.parametrize("room", [True, False], ids=["pool-holds-it", "share-refuses-it"])
def test_a_message_sent_during_a_turn_is_held_in_the_pool_or_refused_with_1013(
    upstream: MockUpstream, room: bool
) -> None:
    """A ``response.create`` sent while a turn runs waits for its turn in memory: it is drawn from
    the pool (with room for one more message uvicorn may read meanwhile, ``ws_max_size``). With
    room it is served next; when the caller's share cannot hold it, the turn in flight finishes,
    then the connection gets 503 ``server_overloaded`` and closes 1013, and the message never runs."""
    import threading

    hold = threading.Event()
    upstream.push(Reply.sse([*PRE(), hold, DONE(2, [message_item("first")])]), answer("second"))
    share = {"max_inflight_share_per_caller": 1.0} if room else {}  # else 0.5 of 4 MiB < ws_max_size
    with ws_gateway(upstream, max_inflight_retained_bytes=(8 if room else 4) * B, **share) as url:

        async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int | None]:
            async with websockets.connect(ws_url(url)) as ws:
                await ws.send(create(input="first", store=False))
                assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "response.created"
                await ws.send(create(input="second", store=False))  # arrives while the first runs
                await asyncio.sleep(0.5)
                hold.set()
                first = await turn(ws)
                try:
                    second = await turn(ws)
                except websockets.ConnectionClosed:
                    second = []
                if not room:
                    with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
                        await asyncio.wait_for(ws.recv(), 10)
                return first, second, ws.close_code

        first, second, code = run(main())
    assert first[-1]["type"] == "response.completed"
    if room:
        assert second[-1]["type"] == "response.completed" and len(upstream.requests) == 2
    else:
        assert len(upstream.requests) == 1
        assert second and second[0]["type"] == "error" and second[0]["status"] == 503, second
        assert second[0]["error"]["code"] == "server_overloaded" and code == 1013


def test_a_wrong_api_key_is_401_then_1008_and_a_saturated_pool_1013(upstream: MockUpstream) -> None:
    import threading

    hold = threading.Event()
    upstream.push(Reply.sse([*PRE(), hold, DONE(2, [message_item("late")])]))
    with ws_gateway(upstream, api_key=(KEY,), max_concurrent_requests=1) as url:
        m = MetricDelta()

        async def main() -> tuple[dict[str, Any], int | None, dict[str, Any], int | None]:
            async with websockets.connect(
                ws_url(url), additional_headers={"authorization": "Bearer nope"}
            ) as ws:
                denied = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert ws.response is not None
                rid = ws.response.headers["x-request-id"]
                assert re.fullmatch(r"req_[0-9a-f]{32}", rid), rid
                assert denied["message"].endswith(f"[request id {rid}]"), denied
                assert denied["error"]["message"] == denied["message"]
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 10)
                denied_code = ws.close_code
            auth = {"authorization": f"Bearer {KEY}"}
            async with websockets.connect(ws_url(url), additional_headers=auth) as busy:
                await busy.send(create(input="hold the only slot", store=False))
                assert json.loads(await asyncio.wait_for(busy.recv(), 10))["type"] == "response.created"
                async with websockets.connect(
                    ws_url(url), additional_headers={**auth, "x-request-id": "mine-1"}
                ) as ws:
                    full = json.loads(await asyncio.wait_for(ws.recv(), 10))
                    assert full["message"].endswith("[request id mine-1]"), full
                    with pytest.raises(websockets.ConnectionClosed):
                        await asyncio.wait_for(ws.recv(), 10)
                hold.set()
                return denied, denied_code, full, ws.close_code

        denied, denied_code, full, full_code = run(main())
    assert denied["status"] == 401 and denied["error"]["code"] == "invalid_api_key" and denied_code == 1008
    assert full["status"] == 503 and full["error"]["code"] == "server_overloaded" and full_code == 1013
    assert settled(m, CAP, 1, limit="admission", outcome="503", transport="websocket") == 1


def _raw_upgrade(url: str, headers: str = "") -> socket.socket:
    """A WebSocket upgrade over a raw socket with a 4 KiB receive window; returns the socket."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: sets the window
    sock.connect((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET /v1/responses HTTP/1.1\r\nhost: {host}:{port}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            f"sec-websocket-key: {key}\r\nsec-websocket-version: 13\r\n{headers}\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _text_frame(text: str) -> bytes:
    payload = text.encode()
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    n = len(payload)
    length = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n)
    return b"\x81" + length + mask + masked


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_a_client_that_stops_reading_is_bounded_by_the_write_timeout(
    upstream: MockUpstream, http: str
) -> None:
    deltas = [text_delta(2 + i, "z" * 16_384) for i in range(400)]
    upstream.push(Reply.sse([*PRE(), *deltas, DONE(402, [message_item("never read")])]))
    with ws_gateway(upstream, max_retained_bytes=256 * B, client_write_timeout=1.0, http=http) as url:
        m = MetricDelta()
        sock = _raw_upgrade(url)
        try:
            sock.sendall(_text_frame(create(input="talk a lot", store=False)))
            started = time.monotonic()
            assert (
                settled(m, CAP, 1, limit="client_write_timeout", outcome="closed", transport="websocket") == 1
            )
            assert time.monotonic() - started < 15
            assert settled(m, WS, 1, outcome="cancelled") == 1
            deadline = time.monotonic() + 15  # then the bounded close aborts the socket
            while metric("loopwarden_websocket_connections") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric("loopwarden_websocket_connections") == 0
            assert metric("loopwarden_inflight_requests") == 0
        finally:
            sock.close()


def test_a_drain_closes_an_idle_connection_1001_after_server_shutting_down(upstream: MockUpstream) -> None:
    from middleware.ops.admission import DRAIN

    upstream.push(answer("before the drain"))
    with ws_gateway(upstream) as url:

        async def main() -> tuple[list[dict[str, Any]], dict[str, Any], int | None]:
            async with websockets.connect(ws_url(url)) as ws:
                served = await turn(ws, create(input="x", store=False))
                DRAIN.start(30, time.monotonic())
                try:
                    error = json.loads(await asyncio.wait_for(ws.recv(), 10))
                    with pytest.raises(websockets.ConnectionClosed):
                        await asyncio.wait_for(ws.recv(), 10)
                finally:  # the process-wide drain state, as it was
                    DRAIN.draining, DRAIN.deadline = False, None
                return served, error, ws.close_code

        served, error, code = run(main())
    assert served[-1]["type"] == "response.completed"
    assert error["status"] == 503 and error["error"]["code"] == "server_shutting_down" and code == 1001


def test_websocket_connections_count_toward_max_connections(upstream: MockUpstream) -> None:
    assert uvicorn_websocket_options(Settings())["ws"].endswith(":DrainingWebSocketProtocol")
    with ws_gateway(upstream, max_connections=2) as url:
        m = MetricDelta()

        async def main() -> bool:
            async with websockets.connect(ws_url(url)), websockets.connect(ws_url(url)):
                assert metric("loopwarden_websocket_connections") == 2
                with pytest.raises((OSError, websockets.InvalidHandshake, websockets.ConnectionClosed)):
                    async with websockets.connect(ws_url(url), open_timeout=5):
                        pass
            return True

        assert run(main())
    assert settled(m, CAP, 1, limit="max_connections", outcome="503") == 1


# -- the Codex cassettes -------------------------------------------------------------------------

CASSETTES = sorted((cassettes_dir() or Path("/nonexistent")).glob("codex/*-websocket-*.yaml"))


@pytest.mark.skipif(
    not CASSETTES, reason="no Codex WebSocket cassettes (../shared/cassettes or $LOOPWARDEN_CASSETTES)"
)
@pytest.mark.parametrize("path", CASSETTES, ids=lambda p: p.stem)
def test_codex_websocket_cassettes_replay(upstream: MockUpstream, path: Path) -> None:
    """The recorded Codex turns, sent by a WebSocket client: each turn's upstream events are the
    recorded ones, and the client gets the recorded WebSocket messages' types, in order."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    for t in doc["turns"]:
        upstream.push(Reply.sse([(line.rstrip("\n") + "\n\n").encode() for line in t["response"]["sse"]]))
    with ws_gateway(upstream, max_retained_bytes=16 * B) as url:

        async def main() -> list[list[dict[str, Any]]]:
            out: list[list[dict[str, Any]]] = []
            ours: str | None = None
            async with websockets.connect(ws_url(url)) as ws:
                for t in doc["turns"]:
                    body = dict(t["request"]["body"])
                    if body.get("previous_response_id") is not None:
                        body["previous_response_id"] = ours  # the gateway's id of the recorded one
                    events = await turn(ws, json.dumps(body))
                    assert events[-1]["type"] == "response.completed", events[-1]
                    ours = events[-1]["response"]["id"]
                    out.append(events)
            return out

        got = run(main())
    for t, events in zip(doc["turns"], got, strict=True):
        recorded = [json.loads(message)["type"] for message in t["response"]["websocket"]]
        assert [e["type"] for e in events] == recorded, events[-1]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # the continuation was replayed from connection memory: the first turn's function call and the
    # tool output the client sent, before the new message
    second = upstream.requests[1].json()["input"]
    assert [i["type"] for i in second[-3:]] == ["function_call", "function_call_output", "message"]
