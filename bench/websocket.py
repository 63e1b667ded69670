"""Per-turn latency of a 3-turn tool loop: WebSocket mode against HTTP+SSE, same gateway, same upstream.

Usage: ``python bench/websocket.py [--loops 40] [--warmup 5] [--json PATH]`` (a script, not a test).

Two real processes on loopback: the embedded development model (``loopwarden devmodel``) as the
upstream, and ``loopwarden serve --store memory`` in front of it (its own uvicorn options,
WebSocket mode included). The client loop is what an agent does with a client-owned tool: turn 1
sends the user message and gets a ``function_call`` back, turn 2 sends the tool output and gets
another call ("loop forever" makes the model call again), turn 3 sends the last tool output with a
new user message and gets the answer. Three ways to carry it, run interleaved loop by loop so the
machine's load hits them alike:

* ``http_full``  — ``POST /v1/responses`` with ``stream: true``, ``store: false`` and the whole
  history resent every turn (what stateless agent clients do over HTTP);
* ``http_prev``  — ``POST`` with ``stream: true``, ``store: true`` and ``previous_response_id``
  (the gateway restores the chain from its store);
* ``ws``         — one WebSocket per loop, ``store: false`` and ``previous_response_id`` (the
  gateway continues from connection memory).

A turn's latency is the wall time from sending it to receiving its terminal event (seconds); the
HTTP client keeps its connection alive across turns (httpx), so neither side pays a TCP handshake
per turn; the WebSocket's upgrade is outside every turn (it is paid once per connection).
Printed: the median and p90 per turn and over all turns, and the ratios to ``ws``.
``--context-bytes N`` puts N bytes of context (a developer message) in turn 1: every later HTTP
turn of ``http_full`` resends it, ``http_prev`` restores it from the store, ``ws`` from memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import websockets

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [
    {
        "type": "function",
        "name": "get_time",
        "description": "The time.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    }
]
MODES = ("http_full", "http_prev", "ws")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, timeout: float = 30.0) -> None:
    """Poll ``url`` until it answers 200; RuntimeError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


@contextmanager
def servers() -> Iterator[str]:
    """The development model and the gateway in front of it, as processes; yields the gateway's URL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    model_port, gateway_port = free_port(), free_port()
    cli = [sys.executable, "-m", "middleware.cli"]
    model = subprocess.Popen(
        [*cli, "devmodel", "--port", str(model_port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gateway = subprocess.Popen(
        [
            *cli,
            "serve",
            "--port",
            str(gateway_port),
            "--upstream",
            f"http://127.0.0.1:{model_port}/v1",
            "--store",
            "memory",
            "--log-level",
            "warning",
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(f"http://127.0.0.1:{model_port}/v1/models")
        wait_ready(f"http://127.0.0.1:{gateway_port}/readyz")
        yield f"http://127.0.0.1:{gateway_port}"
    finally:
        for proc in (gateway, model):
            proc.terminate()
            proc.wait(10)


#: Bytes of context (a developer message before the first user message: files, a repository
#: map) that turn 1 carries; ``--context-bytes``.
CONTEXT = {"bytes": 0}


def turn_inputs(call_id: str | None, turn: int) -> list[dict[str, Any]]:
    """The new input items of turn 1..3 (``call_id``: the call the previous turn handed back)."""
    if turn == 1:
        context = [{"type": "message", "role": "developer", "content": "c" * CONTEXT["bytes"]}]
        return [
            *(context if CONTEXT["bytes"] else []),
            {"type": "message", "role": "user", "content": "loop forever: get time"},
        ]
    output = {"type": "function_call_output", "call_id": call_id, "output": f"12:0{turn}"}
    if turn == 2:
        return [output]
    return [output, {"type": "message", "role": "user", "content": "thanks, that is all"}]


def sse_terminal(lines: list[str]) -> dict[str, Any] | None:
    for line in lines:
        if line.startswith("data: ") and '"response.completed"' in line[:60]:
            return json.loads(line[6:])["response"]
    return None


async def http_loop(client: httpx.AsyncClient, url: str, mode: str) -> list[float]:
    """One 3-turn loop over HTTP+SSE; the seconds of each turn."""
    times: list[float] = []
    history: list[dict[str, Any]] = []
    previous: str | None = None
    call_id: str | None = None
    for n in (1, 2, 3):
        new = turn_inputs(call_id, n)
        body: dict[str, Any] = {"model": "dev", "tools": TOOLS, "stream": True}
        if mode == "http_full":
            history += new
            body.update(input=history, store=False)
        else:
            body.update(input=new, store=True, previous_response_id=previous)
        started = time.perf_counter()
        async with client.stream("POST", url + "/v1/responses", json=body) as r:
            lines = [line async for line in r.aiter_lines()]
        times.append(time.perf_counter() - started)
        final = sse_terminal(lines)
        assert final is not None, lines[-3:]
        previous, call_id = final["id"], _call_id(final)
        history += final["output"]
    return times


async def ws_loop(url: str) -> list[float]:
    """One 3-turn loop over one WebSocket; the seconds of each turn."""
    times: list[float] = []
    previous: str | None = None
    call_id: str | None = None
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/responses") as ws:
        for n in (1, 2, 3):
            message = {"type": "response.create", "model": "dev", "tools": TOOLS, "store": False}
            message.update(input=turn_inputs(call_id, n), previous_response_id=previous)
            started = time.perf_counter()
            await ws.send(json.dumps(message))
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.completed":
                    break
                assert event["type"] != "error", event
            times.append(time.perf_counter() - started)
            previous, call_id = event["response"]["id"], _call_id(event["response"])
    return times


def _call_id(response: dict[str, Any]) -> str | None:
    return next((i["call_id"] for i in response["output"] if i.get("type") == "function_call"), None)


def summary(samples: list[float]) -> dict[str, float]:
    """Median and p90 (milliseconds) of ``samples`` (seconds)."""
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))] * 1000,
    }


async def measure(url: str, loops: int, warmup: int) -> dict[str, list[list[float]]]:
    """``loops`` loops of every mode, interleaved (after ``warmup`` unrecorded ones)."""
    results: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(warmup + loops):
            for mode in MODES:
                times = await (ws_loop(url) if mode == "ws" else http_loop(client, url, mode))
                if i >= warmup:
                    results[mode].append(times)
    return results


def report(results: dict[str, list[list[float]]]) -> dict[str, Any]:
    """The figures: per mode, per turn and overall median/p90, and ratios to ``ws``."""
    out: dict[str, Any] = {}
    for mode, loops in results.items():
        per_turn = [summary([loop[t] for loop in loops]) for t in range(3)]
        out[mode] = {"turns": per_turn, "all": summary([x for loop in loops for x in loop])}
    ws = out["ws"]["all"]["median_ms"]
    for mode in MODES:
        out[mode]["ratio_to_ws"] = out[mode]["all"]["median_ms"] / ws
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--context-bytes", type=int, default=0, help="bytes of context turn 1 carries (default 0)"
    )
    args = parser.parse_args()
    CONTEXT["bytes"] = args.context_bytes
    with servers() as url:
        figures = report(asyncio.run(measure(url, args.loops, args.warmup)))
    print(f"{'mode':<10} {'turn 1':>15} {'turn 2':>15} {'turn 3':>15} {'all turns':>15}  median / ws")
    for mode in MODES:
        cells = [f"{t['median_ms']:6.2f} ({t['p90_ms']:6.2f})" for t in figures[mode]["turns"]]
        overall = figures[mode]["all"]
        cells.append(f"{overall['median_ms']:6.2f} ({overall['p90_ms']:6.2f})")
        print(
            f"{mode:<10} " + " ".join(f"{c:>15}" for c in cells) + f"  {figures[mode]['ratio_to_ws']:.2f} x"
        )
    print("milliseconds: median (p90) per turn, send to terminal event")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
