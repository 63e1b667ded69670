"""Soak: many concurrent streaming clients with random disconnects against a gateway subprocess.

Usage: ``python bench/soak.py [--clients 200] [--seconds 60] [--max-requests 200000] [--json]``

Everything runs on loopback: a scripted Responses upstream and a small MCP tool server (both in
this process, on 127.0.0.1 ephemeral ports), the gateway as a real ``loopwarden serve`` subprocess
(``--store memory``), and ``--clients`` asyncio clients that stream requests back to back until
``--seconds`` have passed or ``--max-requests`` were sent (both bounded). Each request picks a
scenario: a normal streamed answer, a long one the client may leave early (a disconnect), an
upstream reset mid-stream, an in-band upstream error, a ledger overflow (the client lowers
``loopwarden-max-retained-bytes`` and the upstream streams large deltas), a gateway tool call
(MCP), a buffered request, and a stateless one (``"store": false``).

Reported (text, or one JSON object with ``--json``): requests sent and served, outcomes by kind,
cap hits (the gateway's ``loopwarden_cap_hits_total`` increase by limit and outcome), errors
(error frames by code, HTTP error statuses, client-side transport errors), the gateway's maximum
RSS (sampled from /proc every 0.2 s, and the kernel's high-water mark VmHWM), its RSS before and
after the load, and the in-flight gauges once the load is over (both must be back at 0). A sample of
failed requests is read back from the store: none may be stored as ``completed``.

Exit status 1 when an invariant breaks (gauges not back at 0, a failed request stored as completed,
a 500, or the gateway process died), else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
KEY = "soak"
AUTH = {"authorization": f"Bearer {KEY}"}
TOOLS = {"type": "mcp", "server_label": "tools", "require_approval": "never"}
SCENARIOS = ("ok", "ok", "long", "long", "rst", "error", "overflow", "tool", "buffered", "stateless")
MAX_SECONDS = 600.0
MAX_CLIENTS = 1000


# -- the scripted upstream ------------------------------------------------------------------------------
def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def response(output: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": "resp_up", "object": "response", "status": status, "output": output}


def script(body: dict[str, Any]) -> tuple[bool, list[Any]]:
    """(streamed?, parts) for one upstream call: bytes are written, floats sleep, None resets."""
    items = body.get("input")
    first = items if isinstance(items, str) else str(items[0].get("content", "")) if items else ""
    scenario, _, n = first.partition(":")
    count = int(n) if n.isdigit() else 4
    stream = body.get("stream") is True
    if scenario == "tool" and isinstance(items, str):
        call = {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "lookup",
            "arguments": '{"q":"x"}',
            "status": "completed",
        }
        done = response([call])
    else:
        done = response([message("w" * 4 * count)])
    if not stream:
        return False, [json.dumps(done).encode()]
    created = {"id": "resp_up", "object": "response", "status": "in_progress", "output": []}
    parts: list[Any] = [
        sse("response.created", {"type": "response.created", "sequence_number": 0, "response": created}),
        sse(
            "response.in_progress",
            {"type": "response.in_progress", "sequence_number": 1, "response": created},
        ),
    ]
    if scenario != "tool":
        for i in range(count):
            delta = "w" * (1500 if scenario == "overflow" else 4)
            parts += [
                0.05 if scenario == "long" else 0.01,
                sse(
                    "response.output_text.delta",
                    {
                        "type": "response.output_text.delta",
                        "sequence_number": 2 + i,
                        "item_id": "msg_1",
                        "output_index": 0,
                        "content_index": 0,
                        "delta": delta,
                    },
                ),
            ]
            if scenario == "rst" and i == count // 2:
                return True, [*parts, None]
            if scenario == "error" and i == count // 2:
                error = {"type": "error", "sequence_number": 3 + i, "code": "server_error", "message": "boom"}
                return True, [*parts, sse("error", error)]
    parts.append(
        sse(
            "response.completed",
            {"type": "response.completed", "sequence_number": 2 + count, "response": done},
        )
    )
    return True, parts


class Upstream:
    """A Responses upstream on 127.0.0.1 in a background thread; one scripted answer per request."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0
        self.calls = 0

    def __enter__(self) -> Upstream:
        self.thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop
        ).result(10)
        self.port = server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method = lines[0].split(" ", 1)[0]
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            raw = await reader.readexactly(length)
            self.calls += 1
            if method == "GET":
                body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                return
            streamed, parts = script(json.loads(raw))
            if not streamed:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(parts[0]), parts[0]))
                await writer.drain()
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            )
            for part in parts:
                if part is None:
                    writer.transport.abort()
                    return
                if isinstance(part, float):
                    await asyncio.sleep(part)
                    continue
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


# -- the MCP tool server --------------------------------------------------------------------------------
@contextlib.contextmanager
def mcp_server() -> Iterator[str]:
    from mcp.server.mcpserver import MCPServer

    server: MCPServer[Any] = MCPServer("tools", log_level="WARNING")

    @server.tool()
    async def lookup(q: str = "") -> str:
        """Look something up."""
        await asyncio.sleep(0.02)
        return f"found {q}"

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(server.streamable_http_app(), log_level="error", log_config=None, lifespan="on")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the MCP server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


# -- the gateway subprocess -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from /proc (0, 0 when unavailable)."""
    values = {"VmRSS": 0, "VmHWM": 0}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0])
    return values["VmRSS"], values["VmHWM"]


@contextlib.contextmanager
def gateway(
    upstream_port: int, mcp_url: str, max_retained_bytes: int
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "middleware.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--upstream",
        f"http://127.0.0.1:{upstream_port}/v1",
        "--store",
        "memory",
        "--max-retained-bytes",
        str(max_retained_bytes),
        "--mcp-server",
        f"tools={mcp_url}",
        "--upstream-read-timeout",
        "10",
        "--tool-timeout",
        "5",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited at start-up with status {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start within 30 s")
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


# -- the clients -------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    scenario: str
    status: int = 0
    response_id: str | None = None
    terminal: str | None = None  # response.completed / response.incomplete / error
    error: str | None = None
    left_early: bool = False
    transport_error: str | None = None


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    sent: int = 0


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random) -> Outcome:
    scenario = rng.choice(SCENARIOS)
    count = {"long": 40, "overflow": 30}.get(scenario, rng.randint(2, 8))
    body: dict[str, Any] = {"model": "m", "input": f"{scenario}:{count}", "stream": scenario != "buffered"}
    headers = dict(AUTH)
    if scenario == "overflow":
        headers["loopwarden-max-retained-bytes"] = "262144"
    if scenario == "tool":
        body["tools"] = [TOOLS]
    if scenario == "stateless":
        body.update(store=False, input=f"ok:{count}")
    leave_after = rng.randint(3, 8) if scenario == "long" and rng.random() < 0.5 else None
    outcome = Outcome(scenario)
    try:
        async with client.stream("POST", url + "/v1/responses", json=body, headers=headers) as r:
            outcome.status = r.status_code
            if not body["stream"] or r.status_code != 200:
                data = json.loads(await r.aread())
                if r.status_code == 200:
                    outcome.terminal, outcome.response_id = f"response.{data['status']}", data["id"]
                else:
                    outcome.error = data["error"]["code"]
                return outcome
            name, seen = "", 0
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    seen += 1
                    data = json.loads(line[5:])
                    if name == "response.created":
                        outcome.response_id = data["response"]["id"]
                    elif name in ("response.completed", "response.incomplete", "response.failed"):
                        outcome.terminal = name
                    elif name == "error":
                        outcome.terminal, outcome.error = "error", data["code"]
                    if leave_after is not None and seen >= leave_after:
                        outcome.left_early = True
                        return outcome
    except httpx.HTTPError as exc:
        outcome.transport_error = type(exc).__name__
    return outcome


async def load(url: str, clients: int, seconds: float, max_requests: int, seed: int) -> Run:
    run = Run()
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 100_003 + i)
            while time.monotonic() < stop and run.sent < max_requests:
                run.sent += 1
                run.outcomes.append(await one_request(client, url, rng))

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return run


def delta_by(before: dict[Any, float], after: dict[Any, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample == name:
            change = value - before.get((sample, labels), 0.0)
            if change:
                key = ",".join(f"{k}={v}" for k, v in labels) if label == "*" else dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + change
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-requests", type=int, default=200_000)
    parser.add_argument("--max-retained-bytes", type=int, default=4 * 1048576)
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--check-stored", type=int, default=300, help="failed requests read back (at most)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.seconds <= MAX_SECONDS or args.max_requests < 1:
        parser.error(f"--clients 1..={MAX_CLIENTS}, --seconds (0, {MAX_SECONDS:g}], --max-requests >= 1")

    with (
        Upstream() as upstream,
        mcp_server() as mcp_url,
        gateway(upstream.port, mcp_url, args.max_retained_bytes) as (url, proc),
    ):
        with httpx.Client(timeout=10) as warm:  # caches the tool list, opens the pools
            for text in ("ok:2", "tool:1"):
                extra = {"tools": [TOOLS]} if text.startswith("tool") else {}
                warm.post(url + "/v1/responses", json={"model": "m", "input": text, **extra}, headers=AUTH)
        rss_before, _ = rss_kib(proc.pid)
        before = scrape(url)
        samples: list[int] = []
        done = threading.Event()

        def sampler() -> None:
            while not done.wait(0.2):
                samples.append(rss_kib(proc.pid)[0])

        watcher = threading.Thread(target=sampler, daemon=True)
        watcher.start()
        started = time.monotonic()
        run = asyncio.run(load(url, args.clients, args.seconds, args.max_requests, args.seed))
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 15
        after = scrape(url)
        while time.monotonic() < deadline and after.get(("loopwarden_inflight_requests", ()), 0) > 0:
            time.sleep(0.2)
            after = scrape(url)
        done.set()
        watcher.join(2)
        rss_after, hwm = rss_kib(proc.pid)
        failed = [o for o in run.outcomes if o.response_id and o.error and o.scenario != "stateless"]
        stored: Counter[str] = Counter()
        with httpx.Client(timeout=10) as client:
            for o in failed[: args.check_stored]:
                r = client.get(f"{url}/v1/responses/{o.response_id}", headers=AUTH)
                stored[r.json()["status"] if r.status_code == 200 else f"http_{r.status_code}"] += 1
        alive = proc.poll() is None

    outcomes = run.outcomes
    served = sum(1 for o in outcomes if o.status == 200)
    report = {
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "requests_sent": run.sent,
        "requests_served": served,
        "requests_per_second": round(len(outcomes) / elapsed, 1),
        "upstream_calls": upstream.calls,
        "by_scenario": dict(Counter(o.scenario for o in outcomes)),
        "terminal": dict(Counter(o.terminal or ("left early" if o.left_early else "none") for o in outcomes)),
        "client_disconnects": sum(o.left_early for o in outcomes),
        "cap_hits": delta_by(before, after, "loopwarden_cap_hits_total", "*"),
        "error_frames": dict(Counter(o.error for o in outcomes if o.status == 200 and o.error)),
        "http_errors": dict(Counter(f"{o.status} {o.error}" for o in outcomes if o.status not in (0, 200))),
        "transport_errors": dict(Counter(o.transport_error for o in outcomes if o.transport_error)),
        "gateway_status_counts": delta_by(before, after, "loopwarden_requests_total", "status"),
        "gateway_disconnects": after.get(("loopwarden_client_disconnects_total", ()), 0)
        - before.get(("loopwarden_client_disconnects_total", ()), 0),
        "rss_mib": {
            "before": round(rss_before / 1024, 1),
            "max_sampled": round(max(samples, default=0) / 1024, 1),
            "high_water_mark": round(hwm / 1024, 1),
            "after": round(rss_after / 1024, 1),
        },
        "after_load": {
            "inflight_requests": after.get(("loopwarden_inflight_requests", ()), -1),
            "inflight_retained_bytes": after.get(("loopwarden_inflight_retained_bytes", ()), -1),
        },
        "failed_requests_read_back": dict(stored),
        "gateway_alive": alive,
    }
    problems = []
    if report["after_load"]["inflight_requests"] != 0 or report["after_load"]["inflight_retained_bytes"] != 0:
        problems.append("in-flight gauges not back at 0")
    if stored.get("completed"):
        problems.append("a failed request was stored as completed")
    if report["gateway_status_counts"].get("500"):
        problems.append("the gateway answered 500")
    if not alive:
        problems.append("the gateway process died")
    report["problems"] = problems
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:28} {value}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    sys.exit(main())
