"""Fault injection (issue 9): upstream resets at every event boundary of recorded streams, an MCP
server killed mid-call, slow-loris client bodies, and 50 concurrent streaming clients with random
disconnects — afterwards nothing leaked (tasks, connections, in-flight gauges), every ledger peak
stayed within its limit, and nothing was stored as ``completed`` for a failed request.

Real parts throughout: uvicorn on loopback, the scripted upstream, real MCP servers (one in a
subprocess that is SIGKILLed), the store behind ``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from starlette.types import Receive, Scope, Send

from middleware.app import create_app
from middleware.config import Settings
from middleware.dev.embedded import BackgroundServer
from middleware.upstream.sse import SSEParser
from tests.helpers import (
    DONE,
    FC,
    PRE,
    MetricDelta,
    gateway,
    message_item,
    response_json,
    response_obj,
    settled,
    sse_events,
    text_delta,
    wait_for,
)
from tests.loop.test_loop_e2e import LOG, TOOLS_DECL, build_server, fc_stream, text_stream
from tests.mock_upstream import RST, E, MockUpstream, Reply, Turn, cassettes_dir, load_cassette
from tests.servers import serve_asgi

KEY = "k"
AUTH = {"authorization": f"Bearer {KEY}"}
TERMINAL = (b"response.completed", b"response.incomplete", b"response.failed")


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def stored_status(client: httpx.Client, url: str, response_id: str) -> str | None:
    r = client.get(f"{url}/v1/responses/{response_id}", headers=AUTH)
    return r.json()["status"] if r.status_code == 200 else None


# -- 1. an upstream reset at every event boundary of a recorded stream ---------------------------------
CASSETTES = (
    "events/text-only-vllm-gemma4.yaml",
    "codex/codex-openai-https-namespace-tool-gpt-4o-streaming.yaml",
    "tool_calls/multi_turn/openai_responses_tool_calls_3turn_streaming.yaml",
)


def first_streamed_turn(name: str) -> Turn:
    root = cassettes_dir()
    if root is None:
        pytest.skip(
            "recorded cassettes not found: set $LOOPWARDEN_CASSETTES or check out ../shared/cassettes"
        )
    path = root / name
    if not path.is_file():
        pytest.skip(f"cassette {name} is not in {root}")
    return next(turn for turn in load_cassette(path) if turn.events is not None)


def terminal_index(parts: list[bytes]) -> int:
    """Index of the part that completes the stream's terminal event."""
    parser = SSEParser()
    for i, part in enumerate(parts):
        for event in parser.feed(part):
            if event.data.strip() and json.loads(event.data).get("type", "").encode() in TERMINAL:
                return i
    raise AssertionError("the recorded stream has no terminal event")


@pytest.mark.parametrize("name", CASSETTES)
def test_upstream_reset_at_every_event_boundary_is_one_error_frame_and_nothing_completed(
    upstream: MockUpstream, name: str
) -> None:
    turn = first_streamed_turn(name)
    parts = [p for p in turn.reply.parts if isinstance(p, bytes)]
    end = terminal_index(parts)
    body = {**turn.request, "stream": True}
    body.pop("store", None)  # store on: the outcome must be stored truthfully
    with gateway(upstream, max_retained_bytes=64 * 1048576) as (url, _), httpx.Client(timeout=20) as client:
        m = MetricDelta()
        failures = 0
        for cut in range(len(parts) + 1):
            upstream.push(Reply.sse([*parts[:cut], RST]))
            r = client.post(url + "/v1/responses", json=body, headers=AUTH)
            where = f"{name}: reset after {cut} of {len(parts)} parts"
            if cut > end:  # the terminal event went through before the reset
                assert r.status_code == 200, where
                names = [n for n, _ in sse_events(r.content)]
                assert names[-1] == "response.completed" and "error" not in names, where
                response_id = sse_events(r.content)[0][1]["response"]["id"]
                assert stored_status(client, url, response_id) == "completed", where
                continue
            failures += 1
            if r.headers["content-type"].startswith("application/json"):  # failed before commit
                assert r.status_code == 502, where
                assert r.json()["error"]["code"] == "upstream_incomplete", where
                continue
            assert r.status_code == 200, where
            events = sse_events(r.content)
            names = [n for n, _ in events]
            assert names.count("error") == 1 and names[-2:] == ["error", "response.failed"], (where, names)
            assert events[-2][1]["code"] == "upstream_incomplete", where
            assert not any(n in ("response.completed", "response.incomplete") for n in names), where
            assert r.content.count(b"[DONE]") == 1 and r.content.endswith(b"data: [DONE]\n\n"), where
            assert [d["sequence_number"] for _, d in events] == list(range(len(events))), where
            created = [d for n, d in events if n == "response.created"]
            assert len(created) == 1, where
            assert stored_status(client, url, created[0]["response"]["id"]) == "failed", where
        assert len(upstream.requests) == len(parts) + 1
    assert m.delta("loopwarden_upstream_errors_total", kind="eof") == failures
    assert wait_for(lambda: sample("loopwarden_inflight_requests") == 0)


def test_upstream_reset_at_every_boundary_of_a_buffered_round_is_502(upstream: MockUpstream) -> None:
    turn = first_streamed_turn(CASSETTES[0])
    parts = [p for p in turn.reply.parts if isinstance(p, bytes)]
    body = {**turn.request, "stream": False}
    with gateway(upstream) as (url, _), httpx.Client(timeout=20) as client:
        for cut in range(terminal_index(parts) + 1):
            upstream.push(Reply.sse([*parts[:cut], RST]))
            r = client.post(url + "/v1/responses", json=body, headers=AUTH)
            assert r.status_code == 502, cut
            assert r.json()["error"]["code"] == "upstream_incomplete", cut
            assert r.json()["error"]["type"] == "server_error"
            assert r.headers.get("x-should-retry") != "false", "a truncated upstream is worth a retry"


# -- 2. an MCP server killed mid-call ---------------------------------------------------------------
MCP_CHILD = r"""
import asyncio, socket, sys
import uvicorn
from mcp.server.mcpserver import MCPServer

server = MCPServer("tools")

@server.tool()
async def block() -> str:
    '''Announces itself, then waits to be killed.'''
    print("CALLED", flush=True)
    await asyncio.sleep(60)
    return "never"

@server.tool()
async def ping() -> str:
    '''Answers at once.'''
    return "pong"

sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
sock.bind(("127.0.0.1", 0))
print("PORT", sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(server.streamable_http_app(), log_level="error")).run(sockets=[sock])
"""


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError("the MCP child said nothing")
    return proc.stdout.readline().strip()


@contextlib.contextmanager
def mcp_child() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MCP_CHILD],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        line = read_line(proc, 30)
        assert line.startswith("PORT "), line
        port = int(line.split()[1])
        assert wait_for(lambda: _accepts(port), 20), "the MCP child did not start"
        yield proc, f"http://127.0.0.1:{port}/mcp"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_mcp_server_killed_mid_call_becomes_an_error_output_and_the_loop_goes_on(
    upstream: MockUpstream,
) -> None:
    final = Reply.json(response_obj([message_item("carried on")]))
    upstream.push(
        Reply.json(response_obj([FC("call_b", "block", "{}")])),
        final,
        Reply.json(response_obj([FC("call_p", "ping", "{}")])),
        Reply.json(response_obj([message_item("still fine")])),
    )
    with (
        mcp_child() as (proc, mcp_url),
        gateway(upstream, mcp_server=(f"tools={mcp_url}",), tool_timeout=20.0) as (url, _),
        httpx.Client(timeout=30) as client,
    ):
        m = MetricDelta()
        answer: list[httpx.Response] = []
        request = {"model": "m", "input": "go", "tools": [{**TOOLS_DECL}]}
        worker = threading.Thread(
            target=lambda: answer.append(client.post(url + "/v1/responses", json=request, headers=AUTH))
        )
        worker.start()
        assert read_line(proc, 20) == "CALLED"
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        worker.join(25)
        took = time.monotonic() - killed_at
        # the tool list is cached: a later request reaches the dead server at call time
        later = client.post(url + "/v1/responses", json=request, headers=AUTH)
    assert answer and answer[0].status_code == 200, answer[0].text if answer else "no answer"
    assert took < 5, "the dead server is noticed at once, not at the tool timeout"
    response = answer[0].json()
    assert response["status"] == "completed"
    calls = [item for item in response["output"] if item["type"] == "mcp_call"]
    assert len(calls) == 1 and calls[0]["status"] == "failed" and calls[0]["error"] is not None
    assert response["output"][-1]["content"][0]["text"] == "carried on"
    fed_back = [i for i in upstream.requests[1].json()["input"] if i.get("type") == "function_call_output"]
    assert [i["call_id"] for i in fed_back] == ["call_b"]
    assert fed_back[0]["output"].startswith("<error")
    assert m.delta("loopwarden_tool_calls_total", outcome="error") == 2
    assert later.status_code == 200, later.text
    later_calls = [item for item in later.json()["output"] if item["type"] == "mcp_call"]
    assert [c["status"] for c in later_calls] == ["failed"]
    assert len(upstream.requests) == 4


# -- 3. slow-loris client bodies ----------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [False, True])
def test_slow_loris_body_is_408_within_the_client_body_timeout(upstream: MockUpstream, chunked: bool) -> None:
    """One byte every 50 ms keeps the connection busy but never finishes the body: the timeout is
    for the whole body, so trickling does not extend it, and other clients are served meanwhile."""
    upstream.push(Reply.json(response_obj([message_item("meanwhile")])))
    with gateway(upstream, client_body_timeout=1.0) as (url, _):
        m = MetricDelta()
        host, port = url.removeprefix("http://").split(":")
        framing = b"transfer-encoding: chunked\r\n" if chunked else b"content-length: 10000\r\n"
        head = (
            b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + framing
            + b"\r\n"
        )
        body = b'{"model":"m","input":"' + b"a" * 1000
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            started = time.monotonic()
            sock.sendall(head)
            raw = b""
            meanwhile = None
            for i, byte in enumerate(body):
                ready, _, _ = select.select([sock], [], [], 0.05)
                if ready:
                    break
                piece = bytes([byte])
                with contextlib.suppress(OSError):
                    sock.sendall(b"1\r\n" + piece + b"\r\n" if chunked else piece)
                if i == 5:
                    meanwhile = httpx.post(
                        url + "/v1/responses", json={"model": "m", "input": "hi"}, timeout=5
                    )
                if time.monotonic() - started > 5:
                    break
            while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
            elapsed = time.monotonic() - started
    status, headers, error = response_json(raw)
    assert status == 408
    assert error["error"]["code"] == "request_timeout"
    assert headers["x-should-retry"] == "false"
    assert 0.9 <= elapsed < 2.0
    assert meanwhile is not None and meanwhile.status_code == 200
    assert len(upstream.requests) == 1  # only the other client's
    assert settled(m, "loopwarden_cap_hits_total", 1, limit="client_body_timeout", outcome="408") == 1


# -- 4. 50 concurrent streaming clients with random disconnects ----------------------------------------
class LoopProbe:
    """ASGI wrapper remembering the server's event loop (to count its tasks from the test)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.loop = asyncio.get_running_loop()
        await self.app(scope, receive, send)


def tasks_in(loop: asyncio.AbstractEventLoop) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks()) - 1

    return asyncio.run_coroutine_threadsafe(count(), loop).result(5)


class ScenarioReplies:
    """Stands in for `MockUpstream.replies`: builds each reply from the request just recorded
    (its input names the scenario), so concurrent requests each get their own script."""

    def __init__(self, mock: MockUpstream) -> None:
        self.mock = mock

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return 1

    def clear(self) -> None:
        pass

    def popleft(self) -> Reply:
        body = self.mock.requests[-1].json()
        items = body["input"]
        first = items if isinstance(items, str) else items[0]["content"]
        scenario, _, n = first.partition(":")
        count = int(n or 5)
        if scenario == "tool":
            done = isinstance(items, list) and any(i.get("type") == "function_call_output" for i in items)
            if not done:
                return Reply.sse(fc_stream(FC("call_l", "lookup", '{"q":"x"}')))
            return Reply.sse(text_stream("looked up"))
        parts: list[Any] = [*PRE()]
        for i in range(count):
            parts += [0.02, text_delta(2 + i, "w" * (1500 if scenario == "overflow" else 4))]
            if scenario == "rst" and i == count // 2:
                return Reply.sse([*parts, RST])
            if scenario == "error" and i == count // 2:
                error = {"type": "error", "sequence_number": 3 + i, "code": "server_error", "message": "boom"}
                return Reply.sse([*parts, E("error", error)])
        parts.append(DONE(2 + count, [message_item("w" * 4 * count)]))
        return Reply.sse(parts)


@dataclass
class Outcome:
    scenario: str
    status: int = 0
    response_id: str | None = None
    names: list[str] = field(default_factory=list)
    error: str | None = None
    disconnected: bool = False  # the client left while the upstream still had >= 0.3 s to stream
    done: bool = False  # the stream ended with data: [DONE]


SCENARIOS = ("ok", "ok", "long", "long", "rst", "error", "overflow", "tool", "stateless")


async def one_client(client: httpx.AsyncClient, url: str, rng: random.Random) -> Outcome:
    scenario = rng.choice(SCENARIOS)
    count = {"long": 40, "overflow": 30}.get(scenario, rng.randint(2, 8))
    body: dict[str, Any] = {"model": "m", "input": f"{scenario}:{count}", "stream": True}
    headers = dict(AUTH)
    if scenario == "overflow":
        headers["loopwarden-max-retained-bytes"] = (
            "65536"  # 30 deltas of 1500 bytes kept (~5 KiB each) cannot fit
        )
    if scenario == "tool":
        body["tools"] = [TOOLS_DECL]
    if scenario == "stateless":
        body.update(store=False, input="ok:4")
    leave_after = rng.randint(3, 6) if scenario == "long" and rng.random() < 0.6 else None
    if scenario in ("ok", "tool") and rng.random() < 0.3:
        leave_after = rng.randint(1, 4)  # may race the end of the stream: not checked in the store
    outcome = Outcome(scenario)
    async with client.stream("POST", url + "/v1/responses", json=body, headers=headers) as r:
        outcome.status = r.status_code
        if r.status_code != 200:
            outcome.error = json.loads(await r.aread())["error"]["code"]
            return outcome
        name = ""
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                if line[5:].strip() == "[DONE]":
                    outcome.done = True
                    continue
                data = json.loads(line[5:])
                outcome.names.append(name)
                if name == "response.created":
                    outcome.response_id = data["response"]["id"]
                if name == "error":
                    outcome.error = data["code"]
                if leave_after is not None and len(outcome.names) >= leave_after:
                    outcome.disconnected = scenario == "long"
                    return outcome
    return outcome


async def storm(url: str, clients: int, seconds: float, seed: int) -> list[Outcome]:
    outcomes: list[Outcome] = []
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < stop:
                outcomes.append(await one_client(client, url, rng))

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return outcomes


def test_50_streaming_clients_with_random_disconnects_leak_nothing(upstream: MockUpstream) -> None:
    upstream.replies = ScenarioReplies(upstream)  # type: ignore[assignment]
    LOG.__init__()  # type: ignore[misc]
    with serve_asgi(build_server().streamable_http_app()) as mcp_base:
        settings = Settings(
            upstream=upstream.base_url,
            store="memory",
            max_retained_bytes=4 * 1048576,
            mcp_server=(f"tools={mcp_base}/mcp",),
            tool_timeout=5.0,
            upstream_read_timeout=5.0,
        )
        probe = LoopProbe(create_app(settings))
        server = BackgroundServer(probe)
        url = server.start()
        try:
            with httpx.Client(timeout=10) as client:  # warm up: tool list cached, pools open
                for text in ("ok:2", "tool:1"):
                    extra = {"tools": [TOOLS_DECL]} if text.startswith("tool") else {}
                    client.post(
                        url + "/v1/responses", json={"model": "m", "input": text, **extra}, headers=AUTH
                    )
            assert probe.loop is not None
            assert wait_for(lambda: sample("loopwarden_inflight_requests") == 0)
            tasks_before = tasks_in(probe.loop)
            retained_before = sample("loopwarden_inflight_retained_bytes")
            m = MetricDelta()

            outcomes = asyncio.run(storm(url, clients=50, seconds=10.0, seed=9))

            settled = wait_for(lambda: sample("loopwarden_inflight_requests") == 0, 10)
            assert settled, f"in-flight gauge stuck at {sample('loopwarden_inflight_requests')}"
            assert sample("loopwarden_inflight_retained_bytes") == retained_before == 0
            assert wait_for(lambda: tasks_in(probe.loop) <= tasks_before, 5), (
                f"{tasks_in(probe.loop)} tasks in the gateway loop, {tasks_before} before"
            )
            assert wait_for(lambda: not server._server.server_state.connections, 5), (
                "client connections left open"
            )
            assert wait_for(lambda: tasks_in(upstream._loop) == 0, 5), "upstream connections left open"
            answered = m.delta("loopwarden_retained_utilization_ratio_count")
            assert answered >= len(outcomes) > 200
            # every request's ledger peak within its limit: no observation above 1.0
            assert m.delta("loopwarden_retained_utilization_ratio_bucket", le="1.0") == answered
            assert m.delta("loopwarden_requests_total", status="500", model="other") == 0
            with httpx.Client(timeout=10) as client:
                follow = client.post(
                    url + "/v1/responses", json={"model": "m", "input": "ok:2"}, headers=AUTH
                )
                assert follow.status_code == 200
                statuses = {
                    o.response_id: stored_status(client, url, o.response_id)
                    for o in outcomes
                    if o.response_id and (o.error or o.disconnected or o.names[-1:] == ["response.completed"])
                }
        finally:
            server.stop()
    by_kind: dict[str, int] = {}
    for o in outcomes:
        by_kind[o.scenario] = by_kind.get(o.scenario, 0) + 1
        assert o.status == 200, (o.scenario, o.status, o.error)
        assert o.names.count("error") <= 1
        if o.scenario == "stateless":
            assert o.response_id is None or statuses.get(o.response_id) is None
            continue
        if o.error is not None:
            assert o.names[-2:] == ["error", "response.failed"] and "response.completed" not in o.names
            assert o.done
            want = {"rst": "upstream_incomplete", "overflow": "max_retained_bytes_exceeded"}
            assert o.error == want.get(o.scenario, "server_error"), (o.scenario, o.error)
            assert statuses[o.response_id] == "failed", (o.scenario, o.error)
        elif o.disconnected:
            assert statuses[o.response_id] in ("cancelled", "failed"), statuses[o.response_id]
        elif o.names[-1:] == ["response.completed"]:
            assert statuses[o.response_id] == "completed"
    assert all(by_kind.get(kind, 0) > 5 for kind in set(SCENARIOS)), by_kind
    assert sum(o.disconnected for o in outcomes) > 10
    assert sum(o.scenario == "overflow" and o.error is not None for o in outcomes) > 5
    assert m.delta("loopwarden_client_disconnects_total") >= sum(o.disconnected for o in outcomes)
    assert LOG.inflight == 0
