"""Where loopwarden spends its CPU beyond a bare proxy: py-spy under load (a script, not a test).

Usage: ``python bench/profile_gateway.py [--seconds S] [--rate HZ] [--concurrency C]
[--scenarios ...] [--targets ...] [--max-retained-bytes N] [--out DIR]``

Starts the scripted upstream and the MCP server (core 0), then each target in turn (core 1):
loopwarden with the request's ``store: false`` (the pass-through path), loopwarden with store on
(``store=memory``: the agent loop and persistence), the bare Starlette + httpx and + aiohttp
proxies. Drives each with ``--concurrency`` workers (default 16) from this process (core 0) and
samples the server with ``py-spy record --nonblocking --gil`` (CPU only: idle stacks are not
sampled).

Scenarios: ``buffered``, ``stream100``, ``stream1mb`` (needs ``--max-retained-bytes 268435456``),
``loop`` / ``loop-stream`` (loopwarden only: 3 rounds, 2 MCP calls to `bench/mcp_server.py`).

For each run it prints requests completed and CPU samples per request (runs compare per request,
not per second); CPU per request by component (the innermost frame's module decides: json, node
counting, ledger, SSE parser, stream reader, the middlewares, httpx/httpcore, h11, uvicorn,
starlette, asyncio, ...), in microseconds; the top functions by self time and the loopwarden
functions by inclusive time. Raw collapsed stacks go to ``--out`` (default: a temp dir) for
flame graphs (``flamegraph.pl``, speedscope).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run

PYSPY = str(Path(sys.executable).parent / "py-spy")

# Innermost matching frame decides the component (checked leaf first).
COMPONENTS: list[tuple[str, str]] = [
    ("(budget/nodes.py", "budget: JSON node counting"),
    ("(budget/jsonstrict.py", "budget: strict JSON parse"),
    ("(budget/ledger.py", "budget: ledger"),
    ("(budget/model.py", "budget: ledger"),
    ("(budget/", "budget: other"),
    ("(json/", "json (stdlib loads/dumps)"),
    ("(middleware/upstream/sse.py", "loopwarden: SSE parser/encoder"),
    ("(middleware/upstream/reader.py", "loopwarden: stream reader/accumulator"),
    ("(middleware/upstream/", "loopwarden: upstream client wrapper"),
    ("(middleware/asgi/client_stream.py", "loopwarden: client stream (the one writer)"),
    ("(middleware/asgi/guard.py", "loopwarden: budget middleware"),
    ("(middleware/asgi/intake.py", "loopwarden: budget middleware"),
    ("(middleware/outcomes.py", "loopwarden: outcome table"),
    ("(middleware/ops/request_id.py", "loopwarden: request-id middleware"),
    ("(middleware/loop/app.py", "loopwarden: responses app"),
    ("(middleware/loop/passthrough.py", "loopwarden: responses app"),
    ("(middleware/loop/", "loopwarden: agent loop"),
    ("(middleware/tools/", "loopwarden: MCP tools"),
    ("(middleware/store/history.py", "loopwarden: history"),
    ("(middleware/store/", "loopwarden: store"),
    ("(middleware/ops/metrics.py", "loopwarden: metrics"),
    ("(middleware/ops/admission.py", "loopwarden: admission"),
    ("(middleware/", "loopwarden: other"),
    ("(proxy_bare.py", "bare proxy endpoint"),
    ("(prometheus_client/", "prometheus_client"),
    ("(mcp/", "mcp SDK"),
    ("(mcp_types/", "mcp SDK"),
    ("(pydantic", "pydantic"),
    ("(httpcore2/", "httpx2 client (MCP)"),
    ("(httpx2/", "httpx2 client (MCP)"),
    ("(httpcore/", "httpx client (httpcore)"),
    ("(httpx/", "httpx client (httpx)"),
    ("(aiohttp/", "aiohttp client"),
    ("(h11/", "h11 (HTTP/1.1 parser, server and httpcore)"),
    ("(uvicorn/", "uvicorn"),
    ("(starlette/", "starlette"),
    ("(anyio/", "anyio"),
    ("(sqlite3/", "sqlite3"),
    ("(concurrent/", "thread pool (to_thread)"),
    ("(threading.py", "thread pool (to_thread)"),
    ("(asyncio/", "asyncio event loop"),
    ("(selectors.py", "asyncio event loop"),
    ("(re/", "re"),
    ("(logging/", "logging"),
    ("(contextlib.py", "contextlib"),
]


def component(frames: list[str]) -> str:
    for frame in reversed(frames):
        for pattern, label in COMPONENTS:
            if pattern in frame:
                return label
    return "other"


def parse_raw(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def summarise(label: str, path: Path, requests: int, rate: int, top: int) -> None:
    stacks = parse_raw(path)
    total = sum(count for _, count in stacks)
    per_req = 1e6 / rate / max(requests, 1)  # microseconds of CPU per sample, per request
    print(
        f"\n### {label}: {requests} requests, {total} CPU samples at {rate} Hz "
        f"= {total * per_req:.0f} us CPU per request (sampled)"
    )
    by_component: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        by_component[component(frames)] += count
        self_time[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    print("  by component (innermost frame), us/request, share:")
    for name, count in by_component.most_common():
        print(f"    {count * per_req:9.1f}  {100 * count / total:5.1f}%  {name}")
    print(f"  top {top} self time, us/request:")
    for name, count in self_time.most_common(top):
        print(f"    {count * per_req:9.1f}  {100 * count / total:5.1f}%  {name}")
    print(f"  top {top} inclusive (loopwarden and budget frames), us/request:")
    shown = 0
    for name, count in inclusive.most_common():
        if "(middleware/" in name or "(budget/" in name:
            print(f"    {count * per_req:9.1f}  {100 * count / total:5.1f}%  {name}")
            shown += 1
            if shown >= top:
                break


LOOP = run.Scenario("loop", "tools3", False)
LOOP_STREAM = run.Scenario("loop-stream", "tools3", True)


async def drive(
    target: run.Target, scenario: run.Scenario, seconds: float, pid: int, rate: int, out: Path, conc: int
) -> tuple[int, Path]:
    client = run.Client(target.url, conc)
    tools = {"tools": run.MCP_TOOLS} if scenario.model == "tools3" else {}
    body = run.request_body(scenario.model, scenario.stream, target.store, **tools)

    def make(c: run.Client) -> Awaitable[run.Sample]:
        return run.one_request(c, body, target.headers, scenario.stream)

    await run.burst(make, client, conc, 0.5, 10_000, [], 5.0)  # warm
    raw = out / f"{target.name.replace(' ', '_').replace('=', '-')}_{scenario.name}.txt"
    spy = subprocess.Popen(
        [
            PYSPY,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--duration",
            str(int(seconds)),
            "--format",
            "raw",
            "--nolineno",
            "--nonblocking",
            "--gil",
            "--output",
            str(raw),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    await asyncio.sleep(0.3)  # py-spy attaches
    result = await run.burst(make, client, conc, seconds - 0.5, 10**9, [pid], hard_cap=seconds + 5)
    await asyncio.to_thread(spy.wait, 30)
    await client.close()
    if spy.returncode != 0:
        print(f"py-spy failed: {spy.stderr.read().decode()[-500:] if spy.stderr else ''}")
    errors = sum(1 for s in result.samples if not s.ok)
    if errors:
        print(f"  {errors} errors, e.g. {next(s.error for s in result.samples if not s.ok)[:200]}")
    # requests completed while py-spy sampled: scale the burst's count to the sampled window
    completed = sum(1 for s in result.samples if s.ok)
    sampled = completed * min(1.0, int(seconds) / max(result.elapsed, 1e-9))
    return int(sampled), raw


async def main_async(args: argparse.Namespace) -> None:
    pin = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    if pin:
        os.sched_setaffinity(0, {0})
    workdir = Path(tempfile.mkdtemp(prefix="loopwarden-profile-"))
    out = Path(args.out) if args.out else workdir
    out.mkdir(parents=True, exist_ok=True)
    procs = run.Processes(workdir, pin)
    print(run.machine_description())
    try:
        up = run.free_port()
        upstream = procs.start(
            "upstream",
            [run.PY, str(run.BENCH / "upstream.py"), "--port", str(up)],
            0,
            f"http://127.0.0.1:{up}/v1",
        )
        await run.wait_ready(upstream, "/healthz")
        scenarios = [s for s in [*run.SCENARIOS, LOOP, LOOP_STREAM] if s.name in args.scenarios]
        mcp_port = run.free_port()
        mcp_srv = procs.start(
            "mcp",
            [run.PY, str(run.BENCH / "mcp_server.py"), "--port", str(mcp_port)],
            0,
            f"http://127.0.0.1:{mcp_port}",
        )
        await run.wait_ready(mcp_srv, "/mcp")
        for name in args.targets:
            port = run.free_port()
            if name.startswith("bare"):
                argv = [
                    run.PY,
                    str(run.BENCH / "proxy_bare.py"),
                    "--client",
                    name.removeprefix("bare-"),
                    "--upstream",
                    upstream.url,
                    "--port",
                    str(port),
                ]
            else:
                argv = [
                    run.PY,
                    str(run.BENCH / "gateway.py"),
                    "--upstream",
                    upstream.url,
                    "--port",
                    str(port),
                    "--mcp-server",
                    f"tools=http://127.0.0.1:{mcp_port}/mcp",
                ]
                if args.max_retained_bytes:
                    argv += ["--max-retained-bytes", str(args.max_retained_bytes)]
            server = procs.start(name, argv, 1, f"http://127.0.0.1:{port}/v1")
            await run.wait_ready(server, "/healthz")
            store = None if name == "loopwarden-store" else False
            target = run.Target(name, server, store=store)
            for scenario in scenarios:
                if scenario.model == "tools3" and name.startswith("bare"):
                    continue
                requests, raw = await drive(
                    target, scenario, args.seconds, server.pid, args.rate, out, args.concurrency
                )
                summarise(f"{name} {scenario.name} c={args.concurrency}", raw, requests, args.rate, args.top)
            procs.stop(server)
    finally:
        procs.stop_all()
    print(f"\nraw collapsed stacks in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out")
    parser.add_argument(
        "--targets",
        nargs="+",
        default=["loopwarden", "loopwarden-store", "bare-httpx", "bare-aiohttp"],
        help="loopwarden (request store:false), loopwarden-store (store on, memory), bare-httpx, bare-aiohttp",
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["buffered", "stream100"],
        help="buffered, stream100, stream1mb, loop (3 rounds, 2 MCP calls), loop-stream",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--max-retained-bytes",
        type=int,
        default=None,
        help="loopwarden's limit (default: the default 64 MiB; stream1mb needs 268435456)",
    )
    args = parser.parse_args()
    t0 = time.monotonic()
    asyncio.run(main_async(args))
    print(f"profile run {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
