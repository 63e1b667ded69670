"""loopwarden against direct upstream, bare pass-through proxies and LiteLLM (a script, not a test).

Usage: ``python bench/run.py [--quick] [--litellm PATH] [--no-litellm] [--json FILE]
[--base-tree PATH] [--reps N] [--only CELL ...]``

Starts, each in its own process on loopback (`bench/upstream.py`, `bench/proxy_bare.py`,
`bench/gateway.py`, `bench/mcp_server.py`, LiteLLM's proxy if found):

* the scripted upstream and the MCP server, pinned with the load generator (this process) to core 0;
* a bare Starlette + httpx proxy, a bare Starlette + aiohttp proxy, loopwarden
  (``Settings(upstream=..., store="memory")``, default limits, the MCP server configured), loopwarden
  with ``store="sqlite:///<tmp>"``, loopwarden with ``max_retained_bytes`` = 256 MiB (only for the
  1 MiB stream, which the default 64 MiB refuses by design) and LiteLLM, each pinned to core 1.

Then drives each with a bounded aiohttp client (``c`` workers on ``c`` keep-alive connections;
every burst is bounded in seconds and in requests), interleaving the targets rep by rep so that
the ratios are measured side by side, and prints:

* throughput (completed requests/s), p50 / p99 latency, the server process's CPU per request, and
  ratios against direct upstream and against the bare aiohttp proxy — buffered single round,
  streamed 100 events, streamed 1 MiB of text; concurrency 1 and 16;
* time to first event (p50) for the streams;
* a three-round loop with an MCP tool (two tool calls) through loopwarden, next to the same loop
  run by the client itself against direct upstream and the bare aiohttp proxy (a persistent MCP
  session per worker), and the cost of one MCP call on a persistent and on a fresh session;
* memory: peak RSS growth per in-flight maximum-size request against its ledger charge;
* (full mode) the whole app's CPU per streamed event in process, (streamed - buffered request CPU)
  / 100 events, in both framings, and per buffered request: ``bench/stream_cpu.py --app`` once, in
  its own process on core 1 with this tree's ``middleware``, at the end, when no load runs;
* the issue-8 targets, met or not.

``--quick`` is a smoke run (under a minute); the default full run takes 6-8 minutes. Only ratios
from one run mean anything: the machine is shared.

``--base-tree PATH`` compares two trees of loopwarden in one run: it adds ``loopwarden@base`` (and
``loopwarden@base store=memory``, the 256 MiB pair for the 1 MiB stream, ``loopwarden@base (MCP)``
for the loop), served by this tree's `bench/gateway.py` with ``PYTHONPATH=PATH`` so that PATH's
``middleware`` and ``budget`` are imported (checked from the gateway's start line; the base
tree's bytecode goes to the run's temp dir, not into PATH). Each sits next to its counterpart in
the targets of every rep, so both see the same machine. For each cell it then prints the
per-rep ratios new/base (throughput, CPU per request, TTFE p50) with their median, and the median
per-rep loopwarden x bare aiohttp ratios of both trees. ``--reps N`` sets the reps per cell (3 by
default); ``--only buffered stream100:16 loop-stream:1 memory app-cpu ...`` runs only those cells.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import peers
import targets21

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
MIB = 1024 * 1024
MASTER_KEY = "sk-bench-7f3a9c1e5b2d4f6a8c0e1b3d5f7a9c2e"
MCP_TOOLS = [{"type": "mcp", "server_label": "tools", "require_approval": "never"}]
LOOKUP_FN = {
    "type": "function",
    "name": "lookup",
    "description": "Look something up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
}
COMPLETED = b"response.completed"
ERROR_MARKERS = (b"event: error", b'"type":"error"', b'"type": "error"')
REQUEST_TIMEOUT = 60.0
#: The environment of a server on the default production stack, httptools + uvloop
#: (`proxy_bare.STACKS`); every other ASGI server runs h11 + asyncio.
FAST_ENV = {"LOOPWARDEN_BENCH_STACK": "fast"}


# -- machine ------------------------------------------------------------------------------------
def machine_description() -> str:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / MIB:.0f} GiB RAM"
    versions = []
    for name in ("starlette", "uvicorn", "httpx", "aiohttp", "h11"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions.append(f"{name} {version(name)}")
    with contextlib.suppress(Exception):
        import importlib.util

        for opt in ("httptools", "uvloop"):
            versions.append(f"{opt} {'installed' if importlib.util.find_spec(opt) else 'absent'}")
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "middleware", "budget"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        commit = head + (" + uncommitted changes in middleware/ or budget/" if dirty else "")
    return (
        f"loopwarden at {commit}\n"
        f"machine: {os.cpu_count()} cores ({model}){mem}; {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()} ({platform.python_implementation()})\n"
        f"         {', '.join(versions)}"
    )


# -- processes ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads), seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_delay_seconds(pid: int) -> float:
    """Seconds the threads of a process spent runnable but waiting for a CPU (the second field of
    ``/proc/PID/task/*/schedstat``, ns): time lost to other processes on its core, which its CPU
    seconds do not show. 0.0 where the kernel has no schedstat."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclasses.dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str  # base URL including /v1 for HTTP targets
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


class Processes:
    """Every process this run starts; all stopped (by pid) on exit."""

    def __init__(self, workdir: Path, pin: bool) -> None:
        self.workdir = workdir
        self.pin = pin
        self.servers: list[Server] = []

    def start(
        self, name: str, argv: list[str], core: int, url: str, env: dict[str, str] | None = None
    ) -> Server:
        log = self.workdir / f"{name.replace(' ', '_').replace('/', '_')}.log"
        prefix = ["taskset", "-c", str(core)] if self.pin else []
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                prefix + argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        server = Server(name, proc, url, log)
        self.servers.append(server)
        return server

    def stop(self, server: Server) -> None:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGINT)
            try:
                server.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait(timeout=5)
        if server in self.servers:
            self.servers.remove(server)

    def stop_all(self) -> None:
        for server in list(reversed(self.servers)):
            self.stop(server)


async def wait_ready(server: Server, path: str, timeout: float = 60.0) -> None:
    """Poll ``GET base+path`` until it answers (any status below 500)."""
    base = server.url.removesuffix("/v1")
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            if server.proc.poll() is not None:
                tail = server.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{tail}")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with session.get(base + path, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status < 500:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} not ready after {timeout} s (log: {server.log})")
            await asyncio.sleep(0.1)


def find_litellm(explicit: str | None) -> str | None:
    return peers.find_litellm(explicit, PY)


def start_portkey(
    args: argparse.Namespace, procs: Processes, upstream: str, workdir: Path
) -> tuple[Server | None, str]:
    """Start the Portkey gateway on core 1 if it is installed (`peers.find_portkey`): ``(server or
    None, a note for the report)``."""
    if args.no_portkey:
        return None, "not run (--no-portkey)"
    script = peers.find_portkey(args.portkey)
    if script is None:
        return None, "not installed (see bench/peers.py)"
    port = free_port()
    argv, env = peers.portkey_command(script, port, workdir, upstream)
    server = procs.start("portkey", argv, 1, f"http://127.0.0.1:{port}/v1", env=env)
    return server, f"ran ({peers.portkey_version(script)}, unpatched)"


async def probe_portkey(
    procs: Processes, server: Server, note: str, upstream: str
) -> tuple[Server | None, bool, str]:
    """Wait for Portkey, then send one buffered and one streamed request through it: ``(server or
    None, whether its streamed /v1/responses runs unpatched, the note)``. Streams are measured
    only when they run; a failed buffered probe drops Portkey."""
    try:
        await wait_ready(server, "/", timeout=60)
    except RuntimeError as exc:
        procs.stop(server)
        return None, False, f"did not start: {str(exc)[-300:]}"
    client = Client(server.url + "/responses", 1)
    headers = peers.portkey_headers(upstream)
    try:
        buffered = await one_request(client, request_body("small", False, False), headers, False)
        streamed = await one_request(client, request_body("small", True, False), headers, True)
    finally:
        await client.close()
    if not buffered.ok:
        procs.stop(server)
        return None, False, f"{note}; buffered /v1/responses failed: {buffered.error[:200]}"
    if not streamed.ok:
        return server, False, f"{note}; streamed /v1/responses does not run unpatched: {streamed.error[:160]}"
    return server, True, note + "; streamed /v1/responses runs unpatched"


def litellm_config(upstream: str, path: Path) -> None:
    lines = ["model_list:"]
    for model in ("small", "text1mb", "tools3", "paced:0.001", "paced:0.00005"):
        lines += [
            f'  - model_name: "{model}"',
            "    litellm_params:",
            f'      model: "openai/{model}"',
            f"      api_base: {upstream}",
            "      api_key: sk-upstream",
        ]
    lines += ["general_settings:", f"  master_key: {MASTER_KEY}", "litellm_settings:", "  drop_params: true"]
    path.write_text("\n".join(lines) + "\n")


# -- targets and scenarios ----------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    name: str
    server: Server
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    store: bool | None = False  # the request's "store" field (None: omitted, i.e. on)

    @property
    def url(self) -> str:
        return self.server.url + "/responses"


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    stream: bool


SCENARIOS = [
    Scenario("buffered", "small", False),
    Scenario("stream100", "small", True),
    Scenario("stream1mb", "text1mb", True),
    # token-paced: the same 100 events, one upstream write (read) each, 1 ms / 0.05 ms apart
    Scenario("paced1ms", "paced:0.001", True),
    Scenario("paced50us", "paced:0.00005", True),
]


def request_body(model: str, stream: bool, store: bool | None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"model": model, "input": "Say hello.", "stream": stream}
    if store is not None:
        body["store"] = store
    body.update(extra)
    return json.dumps(body).encode()


# -- the load generator -------------------------------------------------------------------------
@dataclasses.dataclass
class Sample:
    latency: float
    ttfe: float | None
    ok: bool
    error: str = ""


class RawConnection:
    """One keep-alive HTTP/1.1 connection of the load generator (asyncio streams, no framework):
    far cheaper per request than an HTTP client library, so the load generator's own core is not
    what limits the fastest targets. Decodes Content-Length and chunked bodies."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], on_data: Callable[[bytes], None]
    ) -> int:
        """POST and feed the decoded body to `on_data` as it arrives; return the status."""
        if self.writer is None:
            await self.connect()
        assert self.reader is not None and self.writer is not None
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head += f"content-length: {len(body)}\r\n\r\n"
        self.writer.write(head.encode() + body)
        reader = self.reader
        raw_head = await reader.readuntil(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length: int | None = None
        chunked = close = False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
            elif name == "connection" and "close" in value.lower():
                close = True
        if chunked:
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                data = await reader.readexactly(size + 2)
                on_data(data[:-2])
        elif length is not None:
            remaining = length
            while remaining:
                data = await reader.read(min(remaining, 1 << 20))
                if not data:
                    raise ConnectionError("connection closed mid-body")
                remaining -= len(data)
                on_data(data)
        else:
            while data := await reader.read(1 << 20):
                on_data(data)
            close = True
        if close:
            self.close()
        return status


class Client:
    """``concurrency`` raw connections to one target, handed out one per request."""

    def __init__(self, url: str, concurrency: int) -> None:
        rest = url.split("://", 1)[1]
        hostport, _, path = rest.partition("/")
        host, _, port = hostport.partition(":")
        self.path = "/" + path
        self.free = [RawConnection(host, int(port)) for _ in range(concurrency)]

    async def close(self) -> None:
        for conn in self.free:
            conn.close()

    def reset(self) -> None:
        """Drop every idle connection (servers close idle keep-alive connections after a few
        seconds; each burst starts on fresh ones)."""
        for conn in self.free:
            conn.close()

    async def post(self, body: bytes, headers: dict[str, str], on_data: Callable[[bytes], None]) -> int:
        conn = self.free.pop()
        try:
            return await asyncio.wait_for(conn.post(self.path, body, headers, on_data), REQUEST_TIMEOUT)
        except BaseException:
            conn.close()
            raise
        finally:
            self.free.append(conn)


async def one_request(client: Client, body: bytes, headers: dict[str, str], stream: bool) -> Sample:
    """One request; checks the answer (a completed response object, or a stream that reached
    ``response.completed`` without an ``error`` event) and notes latency and time to first event."""
    started = time.perf_counter()
    state: dict[str, Any] = {
        "tail": b"",
        "ttfe": None,
        "completed": False,
        "failed": False,
        "size": 0,
        "buf": [] if not stream else None,
    }

    def on_data(chunk: bytes) -> None:
        state["size"] += len(chunk)
        if not stream:
            state["buf"].append(chunk)
            return
        window = state["tail"] + chunk
        if state["ttfe"] is None and b"data:" in window:
            state["ttfe"] = time.perf_counter() - started
        if not state["completed"] and COMPLETED in window:
            state["completed"] = True
        if not state["failed"] and any(m in window for m in ERROR_MARKERS):
            state["failed"] = True
        state["tail"] = window[-400:] if state["failed"] else window[-64:]

    try:
        status = await client.post(body, headers, on_data)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        return Sample(time.perf_counter() - started, None, False, f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - started
    if not stream:
        data = b"".join(state["buf"])
        ok = status == 200 and b'"status":"completed"' in data.replace(b'": "', b'":"')
        return Sample(latency, None, ok, "" if ok else f"HTTP {status}: {data[-300:]!r}")
    ok = status == 200 and state["completed"] and not state["failed"]
    return Sample(latency, state["ttfe"], ok, "" if ok else f"HTTP {status}: {state['tail'][-300:]!r}")


async def read_all(client: Client, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    parts: list[bytes] = []
    status = await client.post(body, headers, parts.append)
    return status, b"".join(parts)


@dataclasses.dataclass
class Burst:
    samples: list[Sample]
    elapsed: float
    cpu: float  # server CPU seconds during the burst
    cut: int = 0  # requests still running at the hard cap, cancelled (not counted)
    wait: float = 0.0  # server seconds runnable but waiting for a CPU (`run_delay_seconds`)


async def burst(
    make: Callable[[Client], Awaitable[Sample]],
    client: Client,
    concurrency: int,
    seconds: float,
    max_requests: int,
    pids: list[int],
    hard_cap: float | None = None,
) -> Burst:
    """``concurrency`` workers issue requests until ``seconds`` pass or ``max_requests`` started;
    requests still running ``hard_cap`` seconds after the start are cancelled and counted as cut."""
    samples: list[Sample] = []
    started = 0
    client.reset()
    cpu0 = sum(cpu_seconds(pid) for pid in pids)
    wait0 = sum(run_delay_seconds(pid) for pid in pids)
    t0 = time.perf_counter()
    stop_at = t0 + seconds

    async def worker() -> None:
        nonlocal started
        while time.perf_counter() < stop_at and started < max_requests:
            started += 1
            samples.append(await make(client))

    tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=hard_cap or max(3 * seconds, seconds + 8))
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.perf_counter() - t0
    return Burst(
        samples,
        elapsed,
        sum(cpu_seconds(pid) for pid in pids) - cpu0,
        cut=len(pending),
        wait=sum(run_delay_seconds(pid) for pid in pids) - wait0,
    )


@dataclasses.dataclass
class Cell:
    """Every burst of one (scenario, concurrency, target)."""

    bursts: list[Burst] = dataclasses.field(default_factory=list)

    @property
    def samples(self) -> list[Sample]:
        return [s for b in self.bursts for s in b.samples]

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def errors(self) -> int:
        return sum(1 for s in self.samples if not s.ok)

    @property
    def cut(self) -> int:
        return sum(b.cut for b in self.bursts)

    @property
    def throughput(self) -> float:
        elapsed = sum(b.elapsed for b in self.bursts)
        return len(self.ok) / elapsed if elapsed else 0.0

    def rep_throughputs(self) -> list[float]:
        return [sum(1 for s in b.samples if s.ok) / b.elapsed for b in self.bursts if b.elapsed]

    def pct(self, q: float, attr: str = "latency") -> float | None:
        values = sorted(getattr(s, attr) for s in self.ok if getattr(s, attr) is not None)
        if not values:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def cpu_per_request(self) -> float | None:
        """Server CPU seconds per finished request, over the bursts that nothing was cut from."""
        whole = [b for b in self.bursts if not b.cut]
        n = sum(len(b.samples) for b in whole)
        return sum(b.cpu for b in whole) / n if n else None

    def core_shares(self) -> tuple[float, float] | None:
        """(CPU seconds, seconds waiting for a CPU) of the server per second of the bursts: how much
        of its core it used and how much it wanted but other processes had."""
        elapsed = sum(b.elapsed for b in self.bursts)
        if not elapsed:
            return None
        return sum(b.cpu for b in self.bursts) / elapsed, sum(b.wait for b in self.bursts) / elapsed

    def first_error(self) -> str:
        return next((s.error for s in self.samples if not s.ok), "")

    def rep_figures(self) -> list[tuple[float | None, float | None, float | None]]:
        """Per rep: throughput, CPU seconds per request (None if cut), TTFE p50 (None if not a stream)."""
        out: list[tuple[float | None, float | None, float | None]] = []
        for b in self.bursts:
            ok = [s for s in b.samples if s.ok]
            ttfe = [s.ttfe for s in ok if s.ttfe is not None]
            out.append(
                (
                    len(ok) / b.elapsed if b.elapsed else None,
                    b.cpu / len(b.samples) if b.samples and not b.cut else None,
                    statistics.median(ttfe) if ttfe else None,
                )
            )
        return out


def rep_ratios(a: Cell, b: Cell, figure: int) -> list[float]:
    """a / b rep by rep (the targets ran side by side in each rep) for one of `Cell.rep_figures`."""
    return [
        x[figure] / y[figure]
        for x, y in zip(a.rep_figures(), b.rep_figures(), strict=False)
        if x[figure] and y[figure]
    ]


# -- the tool loop ------------------------------------------------------------------------------
def completed_output(data: bytes, stream: bool) -> list[dict[str, Any]]:
    """The output items of a buffered response object or of a stream's response.completed."""
    if not stream:
        return list(json.loads(data).get("output") or [])
    for line in data.split(b"\n"):
        if line.startswith(b"data:") and COMPLETED in line[:80]:
            return list(json.loads(line[5:]).get("response", {}).get("output") or [])
    raise ValueError("no response.completed in the stream")


class McpPool:
    """Persistent MCP client sessions, one per worker (the client-side loop's tool calls)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stack = contextlib.AsyncExitStack()
        self.free: list[Any] = []

    async def open(self, n: int) -> None:
        import mcp

        for _ in range(n):
            self.free.append(await self.stack.enter_async_context(mcp.Client(self.url, cache=None)))

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.stack.aclose()


async def client_side_loop(client: Client, target: Target, stream: bool, pool: McpPool) -> Sample:
    """The three-round loop run by the client itself: 3 inference calls, 2 MCP tool calls."""
    started = time.perf_counter()
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "Look it up twice."}]
    mcp_client = pool.free.pop()
    try:
        for _ in range(3):
            body = json.dumps(
                {"model": "tools3", "input": items, "stream": stream, "store": False, "tools": [LOOKUP_FN]}
            ).encode()
            status, data = await read_all(client, body, target.headers)
            if status != 200:
                return Sample(time.perf_counter() - started, None, False, f"HTTP {status}: {data[:200]!r}")
            calls = [i for i in completed_output(data, stream) if i.get("type") == "function_call"]
            if not calls:
                return Sample(time.perf_counter() - started, None, True)
            for call in calls:
                result = await mcp_client.call_tool(call["name"], json.loads(call["arguments"]))
                text = "".join(getattr(c, "text", "") for c in result.content)
                items += [call, {"type": "function_call_output", "call_id": call["call_id"], "output": text}]
        return Sample(time.perf_counter() - started, None, False, "no final message after 3 rounds")
    except Exception as exc:  # a benchmark sample, reported
        return Sample(time.perf_counter() - started, None, False, f"{type(exc).__name__}: {exc}")
    finally:
        pool.free.append(mcp_client)


#: Rounds of ``bench/stream_cpu.py --app`` in the full run (about half a second each).
APP_CPU_ROUNDS = 15


async def app_cpu(pin: bool, rounds: int = APP_CPU_ROUNDS) -> dict[str, float] | str:
    """``bench/stream_cpu.py --app --json`` in its own process (on core 1 when `pin`), importing
    this tree's ``middleware``: its figures (µs; `stream_cpu.measure_app`'s keys), or why none
    (it failed or ran over 300 s)."""
    argv = [PY, str(BENCH / "stream_cpu.py"), "--app", "--json", "--rounds", str(rounds)]
    try:
        done = await asyncio.to_thread(
            subprocess.run,
            (["taskset", "-c", "1"] if pin else []) + argv,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "stream_cpu.py --app ran over 300 s"
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return f"stream_cpu.py --app exited {done.returncode}: {done.stderr.strip()[-300:]}"
    figures: dict[str, float] = json.loads(lines[-1])
    return figures


def app_cpu_line(figures: dict[str, float] | str | None) -> str:
    """The report's line on the in-process app CPU figures (µs), or why they are missing."""
    head = "App CPU in process (bench/stream_cpu.py --app, process CPU, best of its rounds): "
    if not isinstance(figures, dict):
        return head + (figures or "not run")
    return head + (
        f"{figures['one read']:.2f} µs per streamed event (stream - buffered) with the stream in one "
        f"read, {figures['one event per read']:.2f} µs with one event per read, "
        f"{figures['network reads']:.2f} µs in network reads (1448 bytes, most ending inside a frame); "
        f"{figures['buffered']:.0f} µs per buffered request"
    )


async def mcp_call_costs(url: str, n: int) -> tuple[float, float]:
    """p50 seconds of one ``tools/call``: on a persistent session, and on a fresh session each time
    (connect, initialize, call, close — what loopwarden does once per round)."""
    import mcp

    persistent: list[float] = []
    fresh: list[float] = []
    async with mcp.Client(url, cache=None) as session:
        await session.call_tool("lookup", {"q": "warm"})
        for _ in range(n):
            t = time.perf_counter()
            await session.call_tool("lookup", {"q": "x"})
            persistent.append(time.perf_counter() - t)
    for _ in range(max(3, n // 3)):
        t = time.perf_counter()
        async with mcp.Client(url, cache=None) as session:
            await session.call_tool("lookup", {"q": "x"})
        fresh.append(time.perf_counter() - t)
    return statistics.median(persistent), statistics.median(fresh)


# -- memory -------------------------------------------------------------------------------------
def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


@dataclasses.dataclass
class MemoryResult:
    label: str
    payload_bytes: int
    inflight: int
    rss_per_request: float
    charge_per_request: float | None
    peak_charge_per_request: float | None
    errors: int


async def memory_phase(
    procs: Processes,
    label: str,
    argv: list[str],
    url_base: str,
    body: bytes,
    warm_body: bytes,
    n: int,
    hold: float,
    is_gateway: bool,
    payload: int | None = None,
) -> MemoryResult:
    """A fresh server; two warm-up requests; then ``n`` concurrent requests that the upstream holds
    ``hold`` seconds. RSS is sampled every 5 ms; the in-flight ledger total is read mid-hold."""
    server = procs.start(f"mem {label}", argv, 1, url_base)
    try:
        await wait_ready(server, "/healthz")
        client = Client(url_base + "/responses", n)
        metrics_url = url_base.removesuffix("/v1") + "/metrics"
        try:
            for _ in range(2):
                await one_request(client, warm_body, {}, False)
            await asyncio.sleep(0.3)
            base = rss_bytes(server.pid)
            before = await get_text(metrics_url) if is_gateway else ""
            peak = base
            charge: float | None = None
            done = asyncio.Event()

            async def sample_rss() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss_bytes(server.pid))
                    await asyncio.sleep(0.005)

            async def sample_charge() -> None:
                nonlocal charge
                await asyncio.sleep(hold * 0.6)
                charge = metric_value(await get_text(metrics_url), "loopwarden_inflight_retained_bytes")

            sampler = asyncio.ensure_future(sample_rss())
            charger = asyncio.ensure_future(sample_charge()) if is_gateway else None
            results = await asyncio.gather(*(one_request(client, body, {}, False) for _ in range(n)))
            done.set()
            await sampler
            if charger is not None:
                await charger
            peak_charge = None
            if is_gateway:
                after = await get_text(metrics_url)
                total = metric_value(after, "loopwarden_retained_bytes_peak_sum") - metric_value(
                    before, "loopwarden_retained_bytes_peak_sum"
                )
                count = metric_value(after, "loopwarden_retained_bytes_peak_count") - metric_value(
                    before, "loopwarden_retained_bytes_peak_count"
                )
                peak_charge = total / count if count else None
        finally:
            await client.close()
        errors = sum(1 for r in results if not r.ok)
        if errors:
            print(f"  [{label}] {errors} errors, e.g. {next(r.error for r in results if not r.ok)[:300]}")
        return MemoryResult(
            label,
            payload or len(body),
            n,
            (peak - base) / n,
            charge / n if charge is not None else None,
            peak_charge,
            errors,
        )
    finally:
        procs.stop(server)


def max_body(model: str, store: bool | None, margin: int = 48 * 1024, limit: int = 64 * MIB) -> bytes:
    """The largest create body (one big ``input`` string) the default ledger admits, less `margin`
    bytes for what the small answer adds. The middleware admits every body at the store-on rate
    (64 x raw bytes + 512 x nodes) before it knows ``store``, whatever the request says."""
    skeleton = request_body(model, False, store)
    raw = (limit - 512 * 8) // 64 - margin
    pad = raw - len(skeleton)
    return skeleton.replace(b'"Say hello."', b'"' + b"x" * pad + b'"')


# -- reporting ----------------------------------------------------------------------------------
def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f}"


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.3f}"


def print_table(title: str, rows: list[list[str]], header: list[str], left: int = 3) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, *rows]:
        cells = [
            str(c).ljust(w) if i < left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  " + "  ".join(cells))


# -- main ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    reps: int
    seconds: float
    warm: float
    max_requests: int
    loop_seconds: float
    mem_hold: float
    mem_inflight: int
    memory_phases: tuple[str, ...]
    sqlite: bool
    hard_cap: float
    slow_concurrencies: tuple[int, ...]  # for the 1 MiB stream and the MCP loop


FULL = Plan(
    reps=3,
    seconds=2.0,
    warm=0.4,
    max_requests=20_000,
    loop_seconds=2.0,
    mem_hold=2.0,
    mem_inflight=8,
    memory_phases=("input", "input_store", "buffered_output", "bare"),
    sqlite=True,
    hard_cap=10.0,
    slow_concurrencies=(1, 16),
)
QUICK = Plan(
    reps=1,
    seconds=0.4,
    warm=0.1,
    max_requests=5_000,
    loop_seconds=0.5,
    mem_hold=1.0,
    mem_inflight=4,
    memory_phases=("input",),
    sqlite=False,
    hard_cap=1.5,
    slow_concurrencies=(1,),
)


def wanted(only: list[str] | None, name: str, conc: int | None) -> bool:
    """Whether ``--only`` (``NAME`` or ``NAME:C`` items) selects this cell; no ``--only``: all."""
    return not only or name in only or f"{name}:{conc}" in only


def check_tree(server: Server, tree: Path) -> None:
    """The gateway must have imported `middleware` from `tree` (its start line says where from)."""
    line = next(
        (
            ln
            for ln in server.log.read_text(errors="replace").splitlines()
            if ln.startswith("gateway: serving")
        ),
        "",
    )
    served = line.rpartition(" from ")[2]
    if not served or Path(served).resolve() != tree.resolve():
        raise RuntimeError(f"{server.name} serves {served or '?'}, not {tree} (log: {server.log})")


def tree_commit(tree: Path) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip()[:90] or "unknown commit"
    return "unknown commit"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    if args.reps:
        plan = dataclasses.replace(plan, reps=args.reps)
    if args.seconds:
        plan = dataclasses.replace(plan, seconds=args.seconds, loop_seconds=args.seconds)
    base_tree = Path(args.base_tree).resolve() if args.base_tree else None
    if base_tree is not None and not (base_tree / "middleware" / "__init__.py").is_file():
        raise SystemExit(f"--base-tree {base_tree}: no middleware package there")
    t_start = time.monotonic()
    pin = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    if pin:
        os.sched_setaffinity(0, {0})
    workdir = Path(tempfile.mkdtemp(prefix="loopwarden-bench-"))
    procs = Processes(workdir, pin)
    results: dict[str, Any] = {"machine": machine_description(), "cells": {}, "loop": {}, "memory": []}
    if base_tree is not None:
        results["machine"] += f"\nloopwarden@base: {base_tree} at {tree_commit(base_tree)}"
    results["mcp_call"] = (0.0, 0.0)
    results["app_cpu"] = "not run in --quick mode" if args.quick else "not selected by --only"
    print(results["machine"])
    print(
        f"mode: {'quick' if args.quick else 'full'}, {plan.reps} reps; load generator, upstream and MCP server on core 0, "
        f"each server under test on core 1 (pinned: {pin}); logs in {workdir}",
        flush=True,
    )
    try:
        up_port, mcp_port = free_port(), free_port()
        upstream = procs.start(
            "upstream",
            [PY, str(BENCH / "upstream.py"), "--port", str(up_port)],
            0,
            f"http://127.0.0.1:{up_port}/v1",
        )
        mcp_srv = procs.start(
            "mcp",
            [PY, str(BENCH / "mcp_server.py"), "--port", str(mcp_port)],
            0,
            f"http://127.0.0.1:{mcp_port}",
        )
        mcp_url = f"http://127.0.0.1:{mcp_port}/mcp"

        def proxy(client: str, fast: bool = False) -> Server:
            port = free_port()
            return procs.start(
                f"bare {client}" + (" fast" if fast else ""),
                [
                    PY,
                    str(BENCH / "proxy_bare.py"),
                    "--client",
                    client,
                    "--upstream",
                    upstream.url,
                    "--port",
                    str(port),
                ],
                1,
                f"http://127.0.0.1:{port}/v1",
                env=FAST_ENV if fast else None,
            )

        def floor(fast: bool = False) -> Server:
            port = free_port()
            argv = [PY, str(BENCH / "proxy_floor.py"), "--upstream", upstream.url, "--port", str(port)]
            name = "floor" + (" fast" if fast else "")
            return procs.start(name, argv, 1, f"http://127.0.0.1:{port}/v1", env=FAST_ENV if fast else None)

        def gateway(name: str, *extra: str, env: dict[str, str] | None = None) -> Server:
            port = free_port()
            argv = [
                PY,
                str(BENCH / "gateway.py"),
                "--upstream",
                upstream.url,
                "--port",
                str(port),
                "--mcp-server",
                f"tools={mcp_url}",
                *extra,
            ]
            return procs.start(name, argv, 1, f"http://127.0.0.1:{port}/v1", env=env)

        bare_httpx, bare_aiohttp = proxy("httpx"), proxy("aiohttp")
        floor_h11 = floor()
        lw = gateway("loopwarden")
        lw_idle = None
        if args.mcp_idle_sessions is not None:
            n_idle = str(args.mcp_idle_sessions)
            lw_idle = gateway(f"loopwarden idle{n_idle} (MCP)", "--mcp-idle-sessions-per-server", n_idle)
        fast_servers: dict[str, Server] = {}
        if not args.no_fast:
            fast_servers = {
                "bare aiohttp fast": proxy("aiohttp", fast=True),
                "floor fast": floor(fast=True),
                "loopwarden fast": gateway("loopwarden fast", env=FAST_ENV),
            }
        lw_big = gateway("loopwarden 256MiB", "--max-retained-bytes", str(256 * MIB))
        trees = {lw.name: ROOT, lw_big.name: ROOT}
        lw_base = lw_base_big = None
        if base_tree is not None:
            base_env = {"PYTHONPATH": str(base_tree), "PYTHONPYCACHEPREFIX": str(workdir / "pycache")}
            lw_base = gateway("loopwarden@base", env=base_env)
            lw_base_big = gateway(
                "loopwarden@base 256MiB", "--max-retained-bytes", str(256 * MIB), env=base_env
            )
            trees.update({lw_base.name: base_tree, lw_base_big.name: base_tree})
        lw_sqlite = (
            gateway("loopwarden sqlite", "--store", f"sqlite:///{workdir}/lw.db") if plan.sqlite else None
        )
        litellm_bin = None if args.no_litellm else find_litellm(args.litellm)
        litellm: Server | None = None
        litellm_note = "not run (--no-litellm)" if args.no_litellm else "not found (see bench/README.md)"
        if litellm_bin:
            port = free_port()
            litellm_config(upstream.url, workdir / "litellm.yaml")
            litellm = procs.start(
                "litellm",
                [
                    litellm_bin,
                    "--config",
                    str(workdir / "litellm.yaml"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                1,
                f"http://127.0.0.1:{port}/v1",
                env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},
            )
        portkey, portkey_note = start_portkey(args, procs, upstream.url, workdir)
        for server, path in [
            (upstream, "/healthz"),
            (mcp_srv, "/mcp"),
            (bare_httpx, "/healthz"),
            (bare_aiohttp, "/healthz"),
            (floor_h11, "/healthz"),
            (lw, "/healthz"),
            (lw_big, "/healthz"),
            *((server, "/healthz") for server in fast_servers.values()),
            *([(lw_idle, "/healthz")] if lw_idle is not None else []),
        ]:
            await wait_ready(server, path)
        if lw_sqlite:
            await wait_ready(lw_sqlite, "/healthz")
        for server in [lw, lw_big, lw_sqlite, lw_base, lw_base_big]:
            if server is not None:
                await wait_ready(server, "/healthz")
                check_tree(server, trees.get(server.name, ROOT))
        if litellm is not None:
            try:
                await wait_ready(litellm, "/health/liveliness", timeout=90)
                litellm_note = f"ran ({litellm_bin}, {litellm_version(litellm_bin)})"
            except RuntimeError as exc:
                litellm_note = f"did not start: {str(exc)[-300:]}"
                procs.stop(litellm)
                litellm = None
        results["litellm"] = litellm_note
        portkey_stream = False
        if portkey is not None:
            portkey, portkey_stream, portkey_note = await probe_portkey(
                procs, portkey, portkey_note, upstream.url
            )
        results["portkey"] = portkey_note
        results["peers"] = {"litellm": f"LiteLLM {litellm_note}", "portkey": f"Portkey {portkey_note}"}
        print(f"LiteLLM: {litellm_note}", flush=True)
        print(f"Portkey: {portkey_note}; servers up after {time.monotonic() - t_start:.1f} s", flush=True)

        auth = {"authorization": f"Bearer {MASTER_KEY}"}
        targets_default = [
            Target("direct", upstream),
            Target("bare httpx", bare_httpx),
            Target("bare aiohttp", bare_aiohttp),
            Target("floor", floor_h11),
            Target("loopwarden", lw),
            Target("loopwarden store=memory", lw, store=None),
        ]
        extra_targets = [Target(name, server) for name, server in fast_servers.items()]
        if lw_base is not None:  # each next to its counterpart
            targets_default[4:4] = [Target("loopwarden@base", lw_base)]
            targets_default.append(Target("loopwarden@base store=memory", lw_base, store=None))
        if lw_sqlite:
            targets_default.append(Target("loopwarden store=sqlite", lw_sqlite, store=None))
        if litellm:
            targets_default.append(Target("litellm", litellm, headers=auth))
        targets_1mb = [t for t in targets_default if not t.name.startswith(("loopwarden", "floor"))]
        targets_default += extra_targets
        portkey_target = (
            Target("portkey", portkey, headers=peers.portkey_headers(upstream.url)) if portkey else None
        )
        targets_1mb[3:3] = [
            Target("loopwarden 256MiB", lw_big),
            Target("loopwarden 256MiB store=memory", lw_big, store=None),
        ]
        if lw_base_big is not None:
            targets_1mb[4:4] = [Target("loopwarden@base 256MiB", lw_base_big)]
            targets_1mb[6:6] = [Target("loopwarden@base 256MiB store=memory", lw_base_big, store=None)]

        # what the default limits do to the 1 MiB stream (by design, DESIGN.md §4)
        probe = Client(lw.url + "/responses", 1)
        sample = await one_request(probe, request_body("text1mb", True, False), {}, True)
        await probe.close()
        results["stream1mb_default_limits"] = "completed" if sample.ok else "refused: " + sample.error
        print(
            f"1 MiB stream through loopwarden at the default 64 MiB limit: "
            f"{results['stream1mb_default_limits'][:400]}",
            flush=True,
        )

        for scenario in SCENARIOS:
            targets = targets_1mb if scenario.name == "stream1mb" else list(targets_default)
            portkey_here = portkey_stream or not scenario.stream
            if portkey_target is not None and portkey_here and scenario.name != "stream1mb":
                targets.append(portkey_target)
            for conc in plan.slow_concurrencies if scenario.name == "stream1mb" else (1, 16):
                if not wanted(args.only, scenario.name, conc):
                    continue
                cells = {t.name: Cell() for t in targets}
                clients = {t.name: Client(t.url, conc) for t in targets}
                try:
                    for rep in range(plan.reps):
                        for target in targets:
                            cell = cells[target.name]
                            if cell.cut:  # too slow to finish inside the cap: one burst says enough
                                continue
                            body = request_body(scenario.model, scenario.stream, target.store)

                            def make(
                                client: Client,
                                target: Target = target,
                                body: bytes = body,
                                stream: bool = scenario.stream,
                            ) -> Awaitable[Sample]:
                                return one_request(client, body, target.headers, stream)

                            if rep == 0:
                                await burst(
                                    make,
                                    clients[target.name],
                                    conc,
                                    plan.warm,
                                    10 * conc,
                                    [],
                                    min(plan.warm + 3, plan.hard_cap),
                                )
                            cell.bursts.append(
                                await burst(
                                    make,
                                    clients[target.name],
                                    conc,
                                    plan.seconds,
                                    plan.max_requests,
                                    [target.server.pid],
                                    plan.hard_cap,
                                )
                            )
                finally:
                    for client in clients.values():
                        await client.close()
                results["cells"][(scenario.name, conc)] = cells
                print(f"  done {scenario.name} c={conc} ({time.monotonic() - t_start:.0f} s)", flush=True)

        # the three-round MCP loop
        persistent, fresh = await mcp_call_costs(mcp_url, 30 if not args.quick else 10)
        results["mcp_call"] = (persistent, fresh)
        loop_targets = [
            Target("direct (client loop)", upstream),
            Target("bare aiohttp (client loop)", bare_aiohttp),
            Target("loopwarden (MCP)", lw),
        ]
        if lw_idle is not None:
            loop_targets.append(Target(lw_idle.name, lw_idle))
        if fast_servers:
            loop_targets += [
                Target("bare aiohttp fast (client loop)", fast_servers["bare aiohttp fast"]),
                Target("loopwarden fast (MCP)", fast_servers["loopwarden fast"]),
            ]
        if lw_base is not None:
            loop_targets.append(Target("loopwarden@base (MCP)", lw_base))
        for stream in (False, True):
            for conc in plan.slow_concurrencies:
                if not wanted(args.only, "loop-stream" if stream else "loop-buffered", conc):
                    continue
                cells = {t.name: Cell() for t in loop_targets}
                pool = McpPool(mcp_url)
                await pool.open(conc)
                clients = {t.name: Client(t.url, conc) for t in loop_targets}
                try:
                    for rep in range(plan.reps):
                        for target in loop_targets:
                            if target.name.startswith("loopwarden"):
                                body = request_body("tools3", stream, False, tools=MCP_TOOLS)

                                def make_loop(
                                    client: Client, body: bytes = body, stream: bool = stream
                                ) -> Awaitable[Sample]:
                                    return one_request(client, body, {}, stream)
                            else:

                                def make_loop(
                                    client: Client,
                                    target: Target = target,
                                    stream: bool = stream,
                                    pool_: McpPool = pool,
                                ) -> Awaitable[Sample]:
                                    return client_side_loop(client, target, stream, pool_)

                            if rep == 0:
                                await burst(
                                    make_loop,
                                    clients[target.name],
                                    conc,
                                    plan.warm,
                                    4 * conc,
                                    [],
                                    min(plan.warm + 3, plan.hard_cap),
                                )
                            cells[target.name].bursts.append(
                                await burst(
                                    make_loop,
                                    clients[target.name],
                                    conc,
                                    plan.loop_seconds,
                                    plan.max_requests,
                                    [target.server.pid],
                                    plan.hard_cap,
                                )
                            )
                finally:
                    for client in clients.values():
                        await client.close()
                    await pool.close()
                results["loop"][("stream" if stream else "buffered", conc)] = cells
                print(
                    f"  done loop {'stream' if stream else 'buffered'} c={conc} "
                    f"({time.monotonic() - t_start:.0f} s)",
                    flush=True,
                )

        # memory: peak RSS per in-flight maximum-size request against its ledger charge
        stop = [
            bare_httpx,
            bare_aiohttp,
            floor_h11,
            lw,
            lw_big,
            lw_sqlite,
            lw_base,
            lw_base_big,
            litellm,
            portkey,
        ]
        for server in [*stop, lw_idle, *fast_servers.values()]:
            if server is not None:
                procs.stop(server)
        hold, n = plan.mem_hold, plan.mem_inflight

        def gw_argv(port: int) -> list[str]:
            return [PY, str(BENCH / "gateway.py"), "--upstream", upstream.url, "--port", str(port)]

        for phase in plan.memory_phases if wanted(args.only, "memory", None) else ():
            port = free_port()
            base = f"http://127.0.0.1:{port}/v1"
            if phase == "input":
                res = await memory_phase(
                    procs,
                    "loopwarden: max create body, store off",
                    gw_argv(port),
                    base,
                    max_body(f"hold:{hold}", False),
                    max_body("hold:0.01", False),
                    n,
                    hold,
                    True,
                )
            elif phase == "input_store":
                res = await memory_phase(
                    procs,
                    "loopwarden: max create body, store on (memory)",
                    gw_argv(port),
                    base,
                    max_body(f"hold:{hold}", None),
                    max_body("hold:0.01", None),
                    n,
                    hold,
                    True,
                )
            elif phase == "buffered_output":
                size = 600_000
                res = await memory_phase(
                    procs,
                    f"loopwarden: {size // 1000} KB buffered answer, store off",
                    gw_argv(port),
                    base,
                    request_body(f"bigjson:{size}:{hold}", False, False),
                    request_body(f"bigjson:{size}:0.01", False, False),
                    n,
                    hold,
                    True,
                    payload=size,
                )
            else:
                argv = [
                    PY,
                    str(BENCH / "proxy_bare.py"),
                    "--client",
                    "aiohttp",
                    "--upstream",
                    upstream.url,
                    "--port",
                    str(port),
                ]
                res = await memory_phase(
                    procs,
                    "bare aiohttp: the same max create body",
                    argv,
                    base,
                    max_body(f"hold:{hold}", False),
                    max_body("hold:0.01", False),
                    n,
                    hold,
                    False,
                )
            results["memory"].append(res)
        print(f"  done memory ({time.monotonic() - t_start:.0f} s)", flush=True)
        if not args.quick and wanted(args.only, "app-cpu", None):  # no load runs now
            results["app_cpu"] = await app_cpu(pin)
            print(f"  done app CPU ({time.monotonic() - t_start:.0f} s)", flush=True)
    finally:
        procs.stop_all()
    results["elapsed"] = time.monotonic() - t_start
    return results


def litellm_version(binary: str) -> str:
    python = Path(binary).parent / "python"
    try:
        out = subprocess.run(
            [str(python), "-c", "from importlib.metadata import version; print(version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return "litellm " + out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "litellm version unknown"


def comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every loopwarden / loopwarden@base pair of every cell: per-rep ratios new/base (throughput,
    CPU per request, TTFE p50) and both trees' per-rep ratios against the bare aiohttp proxy."""
    out: list[dict[str, Any]] = []
    for key, bare_name in (("cells", "bare aiohttp"), ("loop", "bare aiohttp (client loop)")):
        for (scenario, conc), cells in results[key].items():
            bare = cells.get(bare_name)
            for name, new in cells.items():
                base = cells.get(name.replace("loopwarden", "loopwarden@base", 1))
                if not name.startswith("loopwarden") or "@base" in name or base is None:
                    continue
                row: dict[str, Any] = {
                    "scenario": scenario if key == "cells" else f"loop-{scenario}",
                    "c": conc,
                }
                row["target"] = name
                for label, figure in (("rps", 0), ("cpu", 1), ("ttfe", 2)):
                    row[label] = rep_ratios(new, base, figure)
                for tree, cell in (("new", new), ("base", base)):
                    row[f"{tree}_x_bare"] = rep_ratios(cell, bare, 0) if bare else []
                    # CPU x bare: bare's CPU per request / this one's (a capacity ratio, higher is better)
                    row[f"{tree}_cpu_x_bare"] = [1 / r for r in rep_ratios(cell, bare, 1)] if bare else []
                out.append(row)
    return out


def med(values: list[float], reps: bool = True) -> str:
    if not values:
        return "-"
    text = f"{statistics.median(values):.3f}"
    return text + (" (" + " ".join(f"{v:.2f}" for v in values) + ")" if reps else "")


def compare_report(results: dict[str, Any]) -> None:
    rows = [
        [
            r["scenario"],
            str(r["c"]),
            r["target"],
            med(r["rps"]),
            med(r["cpu"]),
            med(r["ttfe"]),
            med(r["new_x_bare"], False),
            med(r["base_x_bare"], False),
            med(r["new_cpu_x_bare"], False),
            med(r["base_cpu_x_bare"], False),
        ]
        for r in comparisons(results)
    ]
    if rows:
        print_table(
            "This tree (new) against loopwarden@base, side by side in each rep: median of the per-rep "
            "ratios new/base (the reps in brackets; req/s: higher is better for new, CPU/req and TTFE: "
            "lower is), and the median per-rep ratios against the bare aiohttp proxy of both trees",
            rows,
            [
                "scenario",
                "c",
                "target",
                "req/s new/base",
                "CPU/req new/base",
                "TTFE p50 new/base",
                "new x bare",
                "base x bare",
                "new CPU x bare",
                "base CPU x bare",
            ],
        )


def report(results: dict[str, Any]) -> None:
    print("\n" + "=" * 100)
    print(results["machine"])
    print(f"LiteLLM: {results['litellm']}")
    header = [
        "scenario",
        "c",
        "target",
        "req/s",
        "x direct",
        "x bare-aiohttp",
        "p50 ms",
        "p99 ms",
        "+p50 ms",
        "TTFE p50 ms",
        "CPU ms/req",
        "CPU x bare-aiohttp",
        "n",
        "err",
    ]
    rows: list[list[str]] = []
    notes: list[str] = []
    for (scenario, conc), cells in results["cells"].items():
        direct = cells.get("direct")
        bare = cells.get("bare aiohttp")
        for name, cell in cells.items():
            p50 = cell.pct(0.5)
            d50 = direct.pct(0.5) if direct else None
            added = p50 - d50 if p50 is not None and d50 is not None else None
            count = f"{len(cell.ok)}" + (f"+{cell.cut}cut" if cell.cut else "")
            rows.append(
                [
                    scenario,
                    str(conc),
                    name,
                    f"{cell.throughput:.1f}",
                    ratio(cell.throughput, direct.throughput if direct else None),
                    ratio(cell.throughput, bare.throughput if bare else None),
                    ms(p50),
                    ms(cell.pct(0.99)),
                    ms(added),
                    ms(cell.pct(0.5, "ttfe")),
                    ms(cell.cpu_per_request),
                    ratio(bare.cpu_per_request if bare else None, cell.cpu_per_request),
                    count,
                    str(cell.errors),
                ]
            )
            if cell.errors:
                notes.append(f"  {scenario} c={conc} {name}: {cell.first_error()[:300]}")
    print_table(
        "Throughput and latency (ratios from this one run). CPU = the server process's own CPU time "
        "per request; 'CPU x bare-aiohttp' = bare aiohttp CPU/req / this CPU/req (capacity ratio)",
        rows,
        header,
    )
    if notes:
        print("errors:\n" + "\n".join(notes))
    print(
        f"\n1 MiB stream through loopwarden at the default 64 MiB limit: {results['stream1mb_default_limits'][:300]}"
    )

    persistent, fresh = results["mcp_call"]
    print(
        f"\nOne MCP tools/call from the load generator: p50 {persistent * 1000:.2f} ms on a persistent session, "
        f"{fresh * 1000:.2f} ms on a fresh session (connect + initialize + call + close)"
    )
    rows = []
    for (mode, conc), cells in results["loop"].items():
        direct = cells.get("direct (client loop)")
        bare = cells.get("bare aiohttp (client loop)")
        for name, cell in cells.items():
            shares = cell.core_shares()
            rows.append(
                [
                    mode,
                    str(conc),
                    name,
                    f"{cell.throughput:.1f}",
                    ratio(cell.throughput, direct.throughput if direct else None),
                    ratio(cell.throughput, bare.throughput if bare else None),
                    ms(cell.pct(0.5)),
                    ms(cell.pct(0.99)),
                    ms(cell.cpu_per_request),
                    "-" if shares is None else f"{shares[0]:.2f}",
                    "-" if shares is None else f"{shares[1]:.2f}",
                    str(cell.errors),
                ]
            )
            if cell.errors:
                print(f"  loop error {mode} c={conc} {name}: {cell.first_error()[:300]}")
    print_table(
        "Three-round loop, two MCP tool calls (loops/s; a client loop keeps one MCP session per worker; "
        "CPU = the server's own process per loop; busy / runq = its CPU seconds / seconds runnable but "
        "waiting for a CPU, per second)",
        rows,
        [
            "mode",
            "c",
            "target",
            "loops/s",
            "x direct",
            "x bare-aiohttp",
            "p50 ms",
            "p99 ms",
            "CPU ms/loop",
            "busy",
            "runq",
            "err",
        ],
    )

    rows = []
    for m in results["memory"]:
        rows.append(
            [
                m.label,
                f"{m.payload_bytes / MIB:.2f} MiB",
                str(m.inflight),
                f"{m.rss_per_request / MIB:.2f}",
                "-" if m.charge_per_request is None else f"{m.charge_per_request / MIB:.2f}",
                "-" if m.peak_charge_per_request is None else f"{m.peak_charge_per_request / MIB:.2f}",
                ratio(m.peak_charge_per_request, m.rss_per_request),
                str(m.errors),
            ]
        )
    print_table(
        "Memory: peak RSS growth per in-flight request vs its charges (MiB). 'reserved' = the worker "
        "pool's in-flight total (loopwarden_inflight_retained_bytes) mid-hold / requests; 'ledger peak' = "
        "mean loopwarden_retained_bytes_peak of those requests",
        rows,
        [
            "phase",
            "payload",
            "in flight",
            "RSS/request",
            "reserved/request",
            "ledger peak/request",
            "ledger peak / RSS",
            "err",
        ],
        left=1,
    )

    print("\n" + app_cpu_line(results.get("app_cpu")))

    print("\nIssue 8 targets (ratios from this run)")
    cells = results["cells"]

    def cell_of(scenario: str, conc: int, name: str) -> Cell | None:
        cell = cells.get((scenario, conc), {}).get(name)
        return cell if cell and cell.ok else None

    for lw_name in ("loopwarden", "loopwarden store=memory"):
        for scenario in ("buffered", "stream100", "stream1mb"):
            name = lw_name.replace("loopwarden", "loopwarden 256MiB") if scenario == "stream1mb" else lw_name
            for conc in (1, 16):
                lwc, bare, lite = (cell_of(scenario, conc, n) for n in (name, "bare aiohttp", "litellm"))
                a = lwc.throughput if lwc else None
                b = bare.throughput if bare else None
                verdict = "n/a" if not a or not b else ("MET" if a / b >= 0.9 else "NOT MET")
                print(
                    f"  {name:<31} {scenario:<9} c={conc:<2} throughput >= 0.9 x bare aiohttp: "
                    f"{ratio(a, b):>6}  {verdict}"
                )
                if lite is not None:
                    c = lite.throughput
                    verdict = "n/a" if not a else ("MET" if a / c >= 25 else "NOT MET")
                    print(
                        f"  {name:<31} {scenario:<9} c={conc:<2} throughput >= 25 x LiteLLM:        "
                        f"{ratio(a, c):>6}  {verdict}"
                    )
        for scenario in ("stream100", "stream1mb"):
            name = lw_name.replace("loopwarden", "loopwarden 256MiB") if scenario == "stream1mb" else lw_name
            lwc, bare = cell_of(scenario, 1, name), cell_of(scenario, 1, "bare aiohttp")
            a = lwc.pct(0.5, "ttfe") if lwc else None
            b = bare.pct(0.5, "ttfe") if bare else None
            verdict = "n/a" if not a or not b else ("MET" if a / b <= 1.2 else "NOT MET")
            print(
                f"  {name:<31} {scenario:<9} c=1  TTFE p50 <= 1.2 x bare aiohttp:  {ratio(a, b):>6}  {verdict}"
            )
    compare_report(results)
    print(f"\nPortkey: {results.get('portkey', '-')}")
    targets21.print_rows(targets21.rows(results))
    print(f"\ntotal run time {results['elapsed']:.0f} s")


def summary(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "machine": results["machine"],
        "litellm": results["litellm"],
        "cells": [],
        "loop": [],
        "stream1mb_default_limits": results["stream1mb_default_limits"],
        "mcp_call": results["mcp_call"],
    }
    for key, dest in (("cells", "cells"), ("loop", "loop")):
        for (scenario, conc), cells in results[key].items():
            for name, cell in cells.items():
                out[dest].append(
                    {
                        "scenario": scenario,
                        "c": conc,
                        "target": name,
                        "rps": cell.throughput,
                        "rep_rps": cell.rep_throughputs(),
                        "p50": cell.pct(0.5),
                        "p99": cell.pct(0.99),
                        "ttfe_p50": cell.pct(0.5, "ttfe"),
                        "cpu_per_req": cell.cpu_per_request,
                        "rep_cpu_per_req": [f[1] for f in cell.rep_figures()],
                        "rep_ttfe_p50": [f[2] for f in cell.rep_figures()],
                        "ok": len(cell.ok),
                        "cut": cell.cut,
                        "errors": cell.errors,
                    }
                )
    out["memory"] = [dataclasses.asdict(m) for m in results["memory"]]
    out["compare"] = comparisons(results)
    out["portkey"] = results.get("portkey")
    out["app_cpu"] = results.get("app_cpu")
    out["issue21"] = [dataclasses.asdict(r) for r in targets21.rows(results)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, under a minute")
    parser.add_argument(
        "--litellm",
        help="path of the litellm executable (default: $LITELLM_BIN, PATH, "
        "the venv, /tmp/litellm-venv/bin/litellm)",
    )
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument(
        "--portkey",
        metavar="DIR",
        help="npm prefix holding @portkey-ai/gateway (default: $PORTKEY_DIR, /tmp/portkey-gw)",
    )
    parser.add_argument("--no-portkey", action="store_true")
    parser.add_argument("--no-fast", action="store_true", help="no httptools + uvloop targets")
    parser.add_argument(
        "--mcp-idle-sessions",
        type=int,
        metavar="N",
        help="also run the MCP loop through a gateway keeping N idle MCP sessions per server (default 4)",
    )
    parser.add_argument("--seconds", type=float, help="seconds per burst (default 2, --quick 0.4)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the issue-21 table (Markdown) to FILE")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--base-tree",
        metavar="PATH",
        help="also run loopwarden@base: PATH's middleware on this tree's gateway.py (PYTHONPATH=PATH)",
    )
    parser.add_argument("--reps", type=int, help="reps per cell (default 3, --quick 1)")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="CELL",
        help="only these cells: buffered, stream100, stream1mb, loop-buffered, loop-stream "
        "(each optionally :C for one concurrency), memory, app-cpu (full mode only)",
    )
    args = parser.parse_args()
    results = asyncio.run(run(args))
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(summary(results), indent=1))
    if args.markdown:
        Path(args.markdown).write_text(targets21.markdown(targets21.rows(results)) + "\n")


if __name__ == "__main__":
    main()
