"""Memory truth (issue 15, item 3): RSS growth of a real gateway process against its ledger peak.

Usage: ``python bench/memory.py [--k N ...] [--only SCENARIO ...] [--charge-model measured|reference ...]
[--store sqlite|memory]``

For each scenario, each charge model and each K (default 8 and 1), a fresh gateway —
``python -m middleware.cli serve`` (uvicorn, one worker, store on: the SQLite store in the run's
temp dir, ``--max-retained-bytes`` at its 64 MiB default, ``--max-inflight-retained-bytes`` 4 GiB
and ``--memory-pressure-threshold 1`` so that admission refuses nothing) in front of the scripted
upstream (`bench/upstream.py`, another process). Two warm-up batches of K small requests of the
same kind, then K concurrent copies of the scenario's request. Scenarios:

* ``image``     — a create body with a 5 MB image: 5,000,000 random bytes as a base64 data URL
  (6.67 MB) in an ``input_image`` content part; the upstream holds it 0.3 s (``hold:0.3``, so that
  the K bodies are alive together), then answers a small buffered response object;
* ``answer2mb`` — a buffered answer of one message with 2,000,000 characters of text
  (``bigjson:2000000:0.3``: the last byte 0.3 s after the rest, so the K answers arrive together);
* ``tools500``  — 500 function tools (`budget.costs.tool_definition`, 406 bytes each) in a buffered
  round; the upstream echoes them in its ``tools`` field, 0.3 s late (``echotools:0.3``);
* ``stream2mb`` — a streamed answer of 2,000,000 characters in 2,000 deltas, the whole text again in
  the ``.done`` events and ``response.completed`` (``bigstream:2000000:1000:0.3``, ~10 MB of SSE,
  starting 0.3 s late).

Measured, per scenario and model:

* **RSS growth** — the gateway's peak RSS during the K requests above its RSS just before them:
  ``VmHWM`` of ``/proc/PID/status`` after resetting it to the current RSS (``echo 5 >
  /proc/PID/clear_refs``, Linux >= 4.0) right before the requests, so the kernel's own peak is
  read and no short peak is missed; ``VmRSS`` is also sampled every 5 ms from this process
  (column ``sampled``) as a cross-check, and read again 0.5 s after the requests (``after``: what
  did not return).
* **ledger peak** — the sum over the K requests of each request's ledger peak: the delta of the
  gateway's ``loopwarden_retained_bytes_peak_sum`` histogram (observed once per request with
  ``ledger.peak`` when the request ends, `middleware/asgi/guard.py`) between ``/metrics`` scrapes
  before and after the requests; its ``_count`` delta must be K.
* **concurrent ledger** — the largest ``loopwarden_inflight_retained_bytes`` (the sum of live
  ledgers) of ``/metrics`` scrapes every ~10 ms during the requests: how far the K peaks coincide.

The target (issue 15): ledger peak >= RSS growth and <= 2 x RSS growth. With a K=1 and a K>1 row
of the same scenario and model, the RSS a further request adds, ``(RSS(K) - RSS(1)) / (K - 1)``,
is printed apart from what the first request costs on top of it (mostly the allocator's state:
see bench/README.md). A refused request (413, 502, or an SSE ``error`` event) is reported as such.
Loopback only; the load generator and the upstream on core 0, the gateway on core 1 (``taskset``);
every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # budget (the payload shapes)

from run import Processes, free_port, machine_description, metric_value, rss_bytes, wait_ready

from budget.costs import tool_definition

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
MIB = 1024 * 1024
POOL = 4 * 1024 * MIB
MODELS = ("measured", "reference")
SCENARIOS = ("image", "answer2mb", "tools500", "stream2mb")
REQUEST_TIMEOUT = 60.0


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def create(model: str, content: list[dict[str, Any]] | None = None, **extra: Any) -> bytes:
    """A create body (``store`` omitted: on, as the official SDKs send it)."""
    parts = [{"type": "input_text", "text": "What is in this picture?"}, *(content or [])]
    return _dumps({"model": model, "input": [{"role": "user", "content": parts}], **extra})


def image_part(size: int) -> dict[str, Any]:
    data = random.Random(size).randbytes(size)
    return {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(data).decode()}


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    label: str
    body: bytes
    warm: bytes
    stream: bool = False


def scenarios() -> dict[str, Scenario]:
    tools = [tool_definition(i) for i in range(500)]
    return {
        s.name: s
        for s in (
            Scenario(
                "image",
                "create body with a 5 MB image (6.67 MB data URL)",
                create("hold:0.3", [image_part(5_000_000)]),
                create("hold:0.05", [image_part(3_000)]),
            ),
            Scenario(
                "answer2mb",
                "2 MB buffered answer",
                create("bigjson:2000000:0.3"),
                create("bigjson:2000:0.05"),
            ),
            Scenario(
                "tools500",
                "500 echoed tool definitions, buffered",
                create("echotools:0.3", tools=tools),
                create("echotools", tools=tools[:5]),
            ),
            Scenario(
                "stream2mb",
                "2 MB streamed answer, 2,000 deltas",
                create("bigstream:2000000:1000:0.3", stream=True),
                create("bigstream:2000:100", stream=True),
                stream=True,
            ),
        )
    }


@dataclasses.dataclass
class Outcome:
    ok: bool
    what: str  # "ok", or how it failed: "413 max_retained_bytes_exceeded", "sse_error ..."


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> Outcome:
    headers = {"content-type": "application/json"}
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            data = await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(False, f"client error {type(exc).__name__}")
    if resp.status != 200:
        code = ""
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            code = json.loads(data)["error"].get("code") or ""
        return Outcome(False, f"{resp.status} {code}".strip())
    if stream:
        for frame in data.split(b"\n\n"):
            if frame.startswith(b"event: error") or b'"type":"error"' in frame[:200]:
                code = ""
                with contextlib.suppress(ValueError, AttributeError, TypeError, IndexError):
                    event = json.loads(frame.split(b"data: ", 1)[1])
                    code = (event.get("error") or event).get("code") or ""
                return Outcome(False, f"sse_error {code}".strip())
        return Outcome(
            b"event: response.completed" in data, "ok" if b"response.completed" in data else "truncated"
        )
    with contextlib.suppress(ValueError, AttributeError):
        if json.loads(data).get("status") == "completed":
            return Outcome(True, "ok")
    return Outcome(False, "not completed")


def reset_hwm(pid: int) -> bool:
    """Reset the peak RSS (``VmHWM``) of `pid` to its current RSS; False when the kernel refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclasses.dataclass
class Result:
    scenario: str
    model: str
    k: int
    outcomes: list[str]
    ledger_peak: float  # bytes, sum over the requests
    ledger_count: float
    ledger_concurrent: float  # bytes, the largest loopwarden_inflight_retained_bytes scraped
    rss_growth: float  # bytes, VmHWM (or the sampled peak when the reset is refused)
    rss_sampled: float
    rss_after: float
    hwm_reset: bool
    seconds: float

    @property
    def refused(self) -> bool:
        return any(o != "ok" for o in self.outcomes)

    def verdict(self) -> str:
        if self.refused:
            counts: dict[str, int] = {}
            for o in self.outcomes:
                counts[o] = counts.get(o, 0) + 1
            return "refused " + ", ".join(f"{what} x{n}" for what, n in counts.items())
        if self.rss_growth <= 0:
            return "no RSS growth"
        ratio = self.ledger_peak / self.rss_growth
        if ratio < 1:
            return "no (under RSS)"
        if ratio > 2:
            return "no (over 2x)"
        return "yes"


async def measure(
    procs: Processes, upstream: str, workdir: Path, sc: Scenario, model: str, k: int, store: str
) -> Result:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [
        PY, "-m", "middleware.cli", "serve",
        "--host", "127.0.0.1", "--port", str(port),
        "--upstream", upstream,
        "--store", f"sqlite:///{workdir}/{sc.name}-{model}-{k}.db" if store == "sqlite" else "memory",
        "--charge-model", model,
        "--max-inflight-retained-bytes", str(POOL),
        "--memory-pressure-threshold", "1",
        "--log-level", "warning",
    ]  # fmt: skip
    server = procs.start(f"gateway {sc.name} {model}", argv, 1, base + "/v1", env={"PYTHONPATH": str(ROOT)})
    started = time.monotonic()
    try:
        await wait_ready(server, "/healthz", timeout=30)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        connector = aiohttp.TCPConnector(limit=k + 1)  # + 1: the /metrics scrapes
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            url = base + "/v1/responses"
            for _ in range(2):  # code paths, K client and upstream connections, the store
                warm = await asyncio.gather(
                    *(one_request(session, url, sc.warm, sc.stream) for _ in range(k))
                )
                if not all(o.ok for o in warm):
                    raise RuntimeError(f"warm-up failed: {warm[0].what} (log: {server.log})")
            await asyncio.sleep(0.3)
            async with session.get(base + "/metrics") as resp:
                before = await resp.text()
            baseline = rss_bytes(server.pid, "VmRSS")
            hwm_reset = reset_hwm(server.pid)
            sampled = baseline
            concurrent = 0.0
            done = asyncio.Event()

            async def sample() -> None:
                nonlocal sampled
                while not done.is_set():
                    sampled = max(sampled, rss_bytes(server.pid, "VmRSS"))
                    await asyncio.sleep(0.005)

            async def scrape() -> None:
                nonlocal concurrent
                while not done.is_set():
                    async with session.get(base + "/metrics") as resp:
                        text = await resp.text()
                    concurrent = max(concurrent, metric_value(text, "loopwarden_inflight_retained_bytes"))
                    await asyncio.sleep(0.01)

            sampler = asyncio.ensure_future(sample())
            scraper = asyncio.ensure_future(scrape())
            outcomes = await asyncio.gather(
                *(one_request(session, url, sc.body, sc.stream) for _ in range(k))
            )
            done.set()
            await sampler
            await scraper
            hwm = rss_bytes(server.pid, "VmHWM") if hwm_reset else sampled
            async with session.get(base + "/metrics") as resp:
                after = await resp.text()
            await asyncio.sleep(0.5)
            settled = rss_bytes(server.pid, "VmRSS")
    finally:
        procs.stop(server)

    def delta(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    return Result(
        sc.name,
        model,
        k,
        [o.what for o in outcomes],
        delta("loopwarden_retained_bytes_peak_sum"),
        delta("loopwarden_retained_bytes_peak_count"),
        concurrent,
        hwm - baseline,
        sampled - baseline,
        settled - baseline,
        hwm_reset,
        time.monotonic() - started,
    )


def mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def table(results: list[Result], labels: dict[str, str]) -> str:
    head = (
        "| scenario | model | K | ledger peak MiB | RSS growth MiB | ledger / RSS | target (1x..2x) "
        "| per request: ledger / RSS MiB | sampled RSS MiB | RSS after MiB | concurrent ledger MiB |"
    )
    rows = [head, "|" + "---|" * 2 + "---:|" * 4 + "---|" + "---:|" * 4]
    for r in results:
        ledger = mib(r.ledger_peak) if r.ledger_count else "-"
        ok = not r.refused and r.rss_growth > 0
        ratio = f"{r.ledger_peak / r.rss_growth:.2f}" if ok else "-"
        per = f"{mib(r.ledger_peak / r.k)} / {mib(r.rss_growth / r.k)}" if ok else "-"
        rows.append(
            f"| {labels[r.scenario]} | {r.model} | {r.k} | {ledger} | {mib(r.rss_growth)} | {ratio} "
            f"| {r.verdict()} | {per} | {mib(r.rss_sampled)} | {mib(r.rss_after)} | {mib(r.ledger_concurrent)} |"
        )
    return "\n".join(rows)


def marginal_table(results: list[Result], labels: dict[str, str]) -> str:
    """From a K=1 row and a K>1 row of one scenario and model (both served): the RSS a further
    request adds, ``(RSS(K) - RSS(1)) / (K - 1)``, and what the first one costs on top of it."""
    rows = [
        "| scenario | model | K | RSS per further request MiB | RSS first-request extra MiB "
        "| ledger per request MiB | ledger / RSS per further request |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    one = {(r.scenario, r.model): r for r in results if r.k == 1 and not r.refused}
    for r in results:
        first = one.get((r.scenario, r.model))
        if r.k == 1 or r.refused or first is None:
            continue
        marginal = (r.rss_growth - first.rss_growth) / (r.k - 1)
        ratio = f"{first.ledger_peak / marginal:.2f}" if marginal > 0 else "-"
        rows.append(
            f"| {labels[r.scenario]} | {r.model} | 1, {r.k} | {mib(marginal)} | {mib(first.rss_growth - marginal)} "
            f"| {mib(first.ledger_peak)} | {ratio} |"
        )
    return "\n".join(rows) if len(rows) > 2 else ""


async def run(args: argparse.Namespace) -> int:
    all_scenarios = scenarios()
    chosen = [all_scenarios[name] for name in (args.only or all_scenarios)]
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {0})
    results: list[Result] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lw-membench-") as tmp:
        workdir = Path(tmp)
        procs = Processes(workdir, pin)
        try:
            up_port = free_port()
            upstream = procs.start(
                "upstream",
                [PY, str(BENCH / "upstream.py"), "--port", str(up_port)],
                0,
                f"http://127.0.0.1:{up_port}/v1",
            )
            await wait_ready(upstream, "/healthz", timeout=30)
            for sc in chosen:
                for model, k in itertools.product(args.charge_model or MODELS, args.k):
                    res = await measure(procs, upstream.url, workdir, sc, model, k, args.store)
                    if res.ledger_count == 0 and res.refused:
                        print(f"  [{sc.name} {model}] refused before a ledger existed (no ledger peak)")
                    elif res.ledger_count != res.k:
                        print(
                            f"  [{sc.name} {model}] ledger peak observed {res.ledger_count:g} times, not {res.k}"
                        )
                    if not res.hwm_reset:
                        print(
                            f"  [{sc.name} {model}] VmHWM reset refused: RSS growth is the 5 ms sampled peak"
                        )
                    print(
                        f"  {sc.name:<10} {model:<9} K={res.k} ledger {mib(res.ledger_peak)} MiB, "
                        f"RSS +{mib(res.rss_growth)} MiB ({res.seconds:.1f} s): {res.verdict()}",
                        flush=True,
                    )
                    results.append(res)
        finally:
            for server in reversed(procs.servers):
                procs.stop(server)
    print()
    print(machine_description())
    print(
        "\nMemory truth (issue 15 item 3): K concurrent copies of the request, a fresh gateway per row "
        f"(store on: {args.store}; max_retained_bytes 64 MiB). RSS growth = VmHWM after a reset (clear_refs 5) "
        "right before the requests, minus VmRSS then; ledger peak = the sum of the K requests' ledger "
        "peaks (loopwarden_retained_bytes_peak_sum delta); sampled RSS = the peak of 5 ms VmRSS samples; "
        "RSS after = VmRSS 0.5 s after the requests, above the baseline; concurrent ledger = the largest "
        "loopwarden_inflight_retained_bytes (sum of live ledgers) of /metrics scrapes every ~10 ms."
    )
    print()
    labels = {name: s.label for name, s in all_scenarios.items()}
    print(table(results, labels))
    marginal = marginal_table(results, labels)
    if marginal:
        print(
            "\nFixed and per-request parts of the RSS growth, from the K=1 and K>1 rows (two points, "
            "a fresh gateway each: read them against the rows' spread from run to run):\n"
        )
        print(marginal)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[8, 1],
        help="concurrent copies of each request; several values: a row (a fresh gateway) each (default 8 1)",
    )
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, help="scenarios to run (default: all)")
    parser.add_argument("--charge-model", nargs="+", choices=MODELS, help="charge models (default: both)")
    parser.add_argument(
        "--store", choices=("sqlite", "memory"), default="sqlite", help="the gateway's store (default sqlite)"
    )
    args = parser.parse_args()
    if min(args.k) < 1:
        parser.error("--k must be >= 1")
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
