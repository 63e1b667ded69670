"""Hostile network (issue 17, item 5): what misbehaving clients hold, while a well-behaved one keeps
measuring its own success rate and latency (a script, not a test).

Usage: ``python bench/hostile.py [--idle 500] [--stalled 100] [--seconds 20] [--http h11|httptools]``

Loopback only, bounded in count and time. One gateway (``python -m middleware.cli serve``, one
worker, API keys configured: the attackers on theirs, the probe on its own — on loopback every
client shares one address) in front of the scripted upstream (`bench/upstream.py`, another
process), with short bounds so the run stays short: ``--header-timeout 2``,
``--client-write-timeout 2``, ``--client-body-timeout 5``, ``--request-deadline 30``. The attack,
all at once for ``--seconds``:

* ``idle``       — sockets that connect and never send a byte;
* ``stalled``    — streaming clients (1 MiB answers) that read the response head, then stop
  reading (receive buffer 4 KiB);
* ``slow_head``  — slowloris on headers: a byte of request head every second, never finished;
* ``slow_body``  — slowloris on bodies: a complete head with ``Content-Length: 100000``, then a
  byte a second;
* ``dropped``    — 200 streaming clients that disconnect after the first events;
* ``pipelined``  — connections that send two requests back to back before reading.

The probe sends a small buffered request, sequentially, for the whole run (and for
``--baseline-seconds`` before it, unloaded): success rate and p50 / p99 latency, loaded against
unloaded. Sampled every 0.25 s from ``/proc`` and ``/metrics``: the gateway's open file
descriptors, ``loopwarden_admission_reserved_bytes`` (pool bytes held), RSS. At the end every
attacker is closed and the script waits (up to 15 s) until descriptors and pool bytes are back to
their baseline, and prints how long that took.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import Processes, free_port, machine_description, metric_value, rss_bytes, wait_ready

BENCH = Path(__file__).resolve().parent
PY = sys.executable
PROBE_KEY = "probe-key"
ATTACK_KEY = "attack-key"


def fds(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


async def scrape(session: aiohttp.ClientSession, base: str) -> str:
    """The gateway's ``/metrics`` text ("" when it does not answer within 5 s)."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return await resp.text()
    return ""


def cap_hits(text: str) -> dict[str, float]:
    """``loopwarden_cap_hits_total`` summed per ``limit`` label."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("loopwarden_cap_hits_total{"):
            labels, value = line.rsplit(" ", 1)
            limit = labels.split('limit="', 1)[1].split('"', 1)[0]
            out[limit] = out.get(limit, 0.0) + float(value)
    return out


def request_bytes(port: int, body: dict[str, Any], key: str) -> bytes:
    """One complete ``POST /v1/responses`` (head and JSON body) with API key ``key``."""
    raw = json.dumps(body).encode()
    return (
        f"POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
    ).encode() + raw


class Attack:
    """The attackers of one run; every socket they open is closed by `close`."""

    def __init__(self, port: int, stop: asyncio.Event) -> None:
        self.port = port
        self.stop = stop
        self.writers: list[asyncio.StreamWriter] = []
        self.done: dict[str, int] = {}

    async def _open(self, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        self.writers.append(writer)
        return reader, writer

    def _count(self, kind: str) -> None:
        self.done[kind] = self.done.get(kind, 0) + 1

    async def idle(self) -> None:
        with contextlib.suppress(OSError):
            reader, _ = await self._open()
            self._count("idle")
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                await reader.read(1)  # b"" once the gateway closes it
                self._count("idle closed by the gateway")

    async def stalled(self) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            reader, writer = await self._open(rcvbuf=4096)
            body = {"model": "text1mb", "input": "x", "stream": True, "store": False}
            writer.write(request_bytes(self.port, body, ATTACK_KEY))
            await reader.readuntil(b"\r\n\r\n")
            self._count("stalled")
            await self.stop.wait()  # never reads again

    async def slow_head(self) -> None:
        with contextlib.suppress(OSError):
            reader, writer = await self._open()
            self._count("slow_head")
            head = (
                f"POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\nx-pad: ".encode()
                + b"a" * 10_000
            )
            for byte in head:
                if self.stop.is_set() or reader.at_eof():
                    break
                writer.write(bytes([byte]))
                await asyncio.sleep(1.0)
            self._count("slow_head ended")

    async def slow_body(self) -> None:
        with contextlib.suppress(OSError):
            reader, writer = await self._open()
            head = (
                f"POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\nauthorization: Bearer "
                f"{ATTACK_KEY}\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n"
            ).encode()
            writer.write(head)
            self._count("slow_body")
            while not self.stop.is_set() and not reader.at_eof():
                writer.write(b" ")
                await asyncio.sleep(1.0)
            self._count("slow_body ended")

    async def dropped(self, n: int) -> None:
        body = {"model": "text1mb", "input": "x", "stream": True, "store": False}
        for _ in range(n):
            if self.stop.is_set():
                return
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                reader, writer = await self._open()
                writer.write(request_bytes(self.port, body, ATTACK_KEY))
                await reader.readuntil(b"\r\n\r\n")
                await reader.read(2048)
                writer.transport.abort()  # gone mid-stream
                self._count("dropped")

    async def pipelined(self, n: int) -> None:
        body = {"model": "small", "input": "x", "store": False}
        for _ in range(n):
            if self.stop.is_set():
                return
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                reader, writer = await self._open()
                writer.write(request_bytes(self.port, body, ATTACK_KEY) * 2)
                await asyncio.wait_for(reader.read(65536), 10)
                writer.close()
                self._count("pipelined")
            await asyncio.sleep(0.2)

    def close(self) -> None:
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.transport.abort()


async def probe(url: str, stop: asyncio.Event, seconds: float | None = None) -> list[float | None]:
    """Latencies of sequential small requests (None for a failure) until ``stop`` or ``seconds``."""
    out: list[float | None] = []
    body = {"model": "small", "input": "hello", "store": False}
    end = None if seconds is None else time.monotonic() + seconds
    headers = {"authorization": f"Bearer {PROBE_KEY}"}
    async with aiohttp.ClientSession() as session:
        while not stop.is_set() and (end is None or time.monotonic() < end):
            started = time.monotonic()
            try:
                async with session.post(
                    url + "/v1/responses", json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=30)
                ) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            out.append(time.monotonic() - started if ok else None)
            await asyncio.sleep(0.02)
    return out


def summary(latencies: list[float | None]) -> tuple[float, float, float, int]:
    """(success rate, p50 ms, p99 ms, count)."""
    good = sorted(x for x in latencies if x is not None)
    if not good:
        return 0.0, 0.0, 0.0, len(latencies)
    p99 = good[min(len(good) - 1, int(0.99 * len(good)))]
    return len(good) / len(latencies), 1000 * statistics.median(good), 1000 * p99, len(latencies)


async def run(args: argparse.Namespace) -> int:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))  # the attackers' own sockets
    with tempfile.TemporaryDirectory(prefix="lw-hostile-") as tmp:
        procs = Processes(Path(tmp), pin=False)
        try:
            up_port, gw_port = free_port(), free_port()
            upstream = procs.start(
                "upstream",
                [PY, str(BENCH / "upstream.py"), "--port", str(up_port)],
                0,
                f"http://127.0.0.1:{up_port}/v1",
            )
            await wait_ready(upstream, "/healthz")
            argv = [PY, "-m", "middleware.cli", "serve", "--port", str(gw_port), "--upstream", upstream.url]
            argv += ["--api-key", PROBE_KEY, "--api-key", ATTACK_KEY, "--store", "memory"]
            argv += ["--header-timeout", "2", "--client-write-timeout", "2", "--client-body-timeout", "5"]
            argv += ["--request-deadline", "30", *args.gateway_arg]
            env = {"PYTHONPATH": str(BENCH.parent)}
            if args.http:
                argv += ["--http", args.http]
            gateway = procs.start("gateway", argv, 1, f"http://127.0.0.1:{gw_port}/v1", env=env)
            await wait_ready(gateway, "/healthz")
            base = gateway.url.removesuffix("/v1")
            pid = gateway.proc.pid
            async with aiohttp.ClientSession() as session:
                never = asyncio.Event()
                unloaded = summary(await probe(base, never, args.baseline_seconds))
                metrics0 = await scrape(session, base)
                base_fds, base_reserved = (
                    fds(pid),
                    metric_value(metrics0, "loopwarden_admission_reserved_bytes"),
                )
                base_rss = rss_bytes(pid)
                stop = asyncio.Event()
                attack = Attack(gw_port, stop)
                tasks = [asyncio.create_task(attack.idle()) for _ in range(args.idle)]
                tasks += [asyncio.create_task(attack.stalled()) for _ in range(args.stalled)]
                tasks += [asyncio.create_task(attack.slow_head()) for _ in range(args.slow)]
                tasks += [asyncio.create_task(attack.slow_body()) for _ in range(args.slow)]
                tasks += [asyncio.create_task(attack.dropped(args.dropped // 4)) for _ in range(4)]
                tasks += [asyncio.create_task(attack.pipelined(args.pipelined))]
                probe_task = asyncio.create_task(probe(base, stop))
                peak = {"fds": 0, "reserved": 0.0, "rss": 0}
                end = time.monotonic() + args.seconds
                while time.monotonic() < end:
                    text = await scrape(session, base)
                    peak["fds"] = max(peak["fds"], fds(pid))
                    peak["reserved"] = max(
                        peak["reserved"], metric_value(text, "loopwarden_admission_reserved_bytes")
                    )
                    peak["rss"] = max(peak["rss"], rss_bytes(pid))
                    await asyncio.sleep(0.25)
                stop.set()
                loaded = summary(await probe_task)
                attack.close()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                t0 = time.monotonic()
                while time.monotonic() - t0 < 15:
                    text = await scrape(session, base)
                    back = (
                        fds(pid) <= base_fds + 2
                        and metric_value(text, "loopwarden_admission_reserved_bytes") <= base_reserved
                    )
                    if back:
                        break
                    await asyncio.sleep(0.1)
                recovered = time.monotonic() - t0
                final = await scrape(session, base)
                hits0, hits = cap_hits(metrics0), cap_hits(final)
        finally:
            procs.stop_all()
    print(machine_description())
    print(
        f"\nstack: {args.http or 'loopwarden serve default (h11)'}; attack for {args.seconds:g} s; counts: {attack.done}"
    )
    print("\n| | success | p50 ms | p99 ms | requests |\n|---|---:|---:|---:|---:|")
    for name, (rate, p50, p99, n) in (("probe, unloaded", unloaded), ("probe, under attack", loaded)):
        print(f"| {name} | {100 * rate:.1f} % | {p50:.1f} | {p99:.1f} | {n} |")
    print(f"\np99 under attack / unloaded: {loaded[2] / max(unloaded[2], 1e-9):.2f}")
    print(
        f"gateway held at most: {peak['fds']} file descriptors (baseline {base_fds}), "
        f"{peak['reserved'] / 1048576:.1f} MiB of pool (baseline {base_reserved / 1048576:.1f}), "
        f"RSS {peak['rss'] / 1048576:.0f} MiB (baseline {base_rss / 1048576:.0f})"
    )
    print(f"back to baseline (descriptors and pool) {'after' if back else 'NOT within'} {recovered:.1f} s")
    print(
        "cap hits during the run: "
        + ", ".join(f"{k}={hits[k] - hits0.get(k, 0):g}" for k in sorted(hits) if hits[k] - hits0.get(k, 0))
    )
    return 0 if back and loaded[0] == 1.0 else 1


def main() -> None:
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # the attackers' writes to closed sockets
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=500, help="idle sockets (default 500)")
    parser.add_argument("--stalled", type=int, default=100, help="clients that stop reading (default 100)")
    parser.add_argument(
        "--slow", type=int, default=50, help="slowloris sockets on heads and on bodies (default 50 each)"
    )
    parser.add_argument(
        "--dropped", type=int, default=200, help="clients that disconnect mid-stream (default 200)"
    )
    parser.add_argument("--pipelined", type=int, default=20, help="pipelined connections (default 20)")
    parser.add_argument("--seconds", type=float, default=20.0, help="attack duration (default 20)")
    parser.add_argument("--baseline-seconds", type=float, default=5.0, help="unloaded probe (default 5)")
    parser.add_argument(
        "--http", choices=("h11", "httptools"), help="uvicorn HTTP stack (default: loopwarden serve's)"
    )
    parser.add_argument("--gateway-arg", action="append", default=[], help="extra flag for loopwarden serve")
    sys.exit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
