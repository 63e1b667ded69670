"""Smoke test of the issue-21 bench targets: they start and answer (a few seconds).

Real processes on loopback, as `bench/run.py` starts them: the scripted upstream
(`bench/upstream.py`), the floor build (`bench/proxy_floor.py`) on h11 + asyncio and on httptools
+ uvloop, and the Portkey gateway when it is installed (`bench/peers.py`; skipped otherwise). The
official `openai` SDK is the client. Also checks the issue-21 table's arithmetic
(`bench/targets21.py`: medians of per-rep ratios) on known bursts.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402
import run as bench_run  # noqa: E402
import targets21  # noqa: E402

FAST = importlib.util.find_spec("httptools") is not None and importlib.util.find_spec("uvloop") is not None


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(
    argv: list[str], url: str, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `argv` (output to `log`) and wait until `url` answers below 500."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"{argv[1]} exited {proc.returncode}: {log.read_text(errors='replace')[-800:]}"
            )
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    _stop(proc)
    raise AssertionError(f"{argv} did not answer {url} within 30 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _port()
    argv = [sys.executable, str(BENCH / "upstream.py"), "--port", str(port)]
    log = tmp_path_factory.mktemp("upstream") / "upstream.log"
    proc = _start(argv, f"http://127.0.0.1:{port}/healthz", log)
    yield f"http://127.0.0.1:{port}/v1"
    _stop(proc)


@pytest.fixture(
    scope="module",
    params=[
        "h11",
        pytest.param("fast", marks=pytest.mark.skipif(not FAST, reason="httptools/uvloop absent")),
    ],
)
def floor(
    request: pytest.FixtureRequest, upstream: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    port = _port()
    argv = [sys.executable, str(BENCH / "proxy_floor.py"), "--upstream", upstream, "--port", str(port)]
    log = tmp_path_factory.mktemp("floor") / "floor.log"
    proc = _start(argv, f"http://127.0.0.1:{port}/healthz", log, {"LOOPWARDEN_BENCH_STACK": request.param})
    yield f"http://127.0.0.1:{port}/v1"
    _stop(proc)


def test_floor_answers_buffered_and_streamed(floor: str) -> None:
    with openai.OpenAI(base_url=floor, api_key="sk-bench", max_retries=0) as client:
        _ask(client)


def _ask(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(model="small", input="Say hello.", store=False)
    assert len(raw.headers["x-request-id"]) == 32
    response = raw.parse()
    assert response.status == "completed"
    assert response.output_text
    events = list(client.responses.create(model="small", input="Say hello.", store=False, stream=True))
    assert len(events) == 100
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(100))


def test_floor_refuses_what_the_design_refuses(floor: str) -> None:
    """The mandatory checks run: a duplicate key and a non-boolean ``stream`` are 400s with the
    error envelope; the requests show in the floor's metrics by outcome."""
    dup = httpx.post(floor + "/responses", content=b'{"model":"small","model":"x","input":"hi"}', timeout=10)
    assert dup.status_code == 400
    assert dup.json()["error"]["code"] == "duplicate_key"
    bad = httpx.post(
        floor + "/responses", json={"model": "small", "input": "hi", "stream": "yes"}, timeout=10
    )
    assert bad.status_code == 400
    assert (
        bad.json()["error"]["param"] is None
        and "stream must be true or false" in bad.json()["error"]["message"]
    )
    metrics = httpx.get(floor.removesuffix("/v1") + "/metrics", timeout=10).text
    refused = next(
        line for line in metrics.splitlines() if line.startswith('floor_requests_total{outcome="refused"}')
    )
    assert float(refused.rsplit(" ", 1)[1]) >= 2


def test_portkey_answers_buffered(upstream: str, tmp_path: Path) -> None:
    script = peers.find_portkey(None)
    if script is None:
        pytest.skip(
            "Portkey is not installed (see bench/peers.py: npm install @portkey-ai/gateway under /tmp/portkey-gw)"
        )
    port = _port()
    argv, env = peers.portkey_command(script, port, tmp_path, upstream)
    proc = _start(argv, f"http://127.0.0.1:{port}/", tmp_path / "portkey.log", env)
    try:
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="sk-upstream",
            max_retries=0,
            default_headers=peers.portkey_headers(upstream),
        ) as client:
            response = client.responses.create(model="small", input="Say hello.", store=False)
        assert response.status == "completed"
        assert response.id == "resp_bench0000000000000000000000000001"
    finally:
        _stop(proc)


def _burst(ok: int, elapsed: float, cpu: float, latency: float) -> bench_run.Burst:
    return bench_run.Burst([bench_run.Sample(latency, latency / 2, True) for _ in range(ok)], elapsed, cpu)


def _cell(*bursts: bench_run.Burst) -> bench_run.Cell:
    return bench_run.Cell(list(bursts))


def test_issue21_rows_are_medians_of_per_rep_ratios() -> None:
    bare = _cell(_burst(100, 1.0, 1.0, 0.01), _burst(100, 1.0, 1.0, 0.01), _burst(100, 1.0, 1.0, 0.01))
    lw = _cell(_burst(70, 1.0, 2.0, 0.03), _burst(50, 1.0, 2.0, 0.03), _burst(60, 1.0, 4.0, 0.03))
    results = {
        "cells": {("stream100", 16): {"bare aiohttp": bare, "loopwarden": lw}},
        "loop": {},
        "peers": {"portkey": "Portkey not installed"},
    }
    found = {r.what: r for r in targets21.rows(results)}
    row = found["loopwarden x bare (req/s)"]
    assert row.reps == (0.7, 0.5, 0.6)
    assert row.value == pytest.approx(0.6)
    assert row.met is False and row.target == ">= 0.65"
    cpu = found["loopwarden CPU capacity x bare"]  # bare CPU/req / loopwarden's, per rep
    assert cpu.reps == pytest.approx((0.01 / (2 / 70), 0.01 / (2 / 50), 0.01 / (4 / 60)))
    p99 = found["p99 loopwarden / bare"]
    assert p99.value == pytest.approx(3.0) and p99.met is False
    assert "loopwarden x Portkey (req/s)" not in found  # no target on streams: reported only if run
    assert "loopwarden / floor (req/s)" not in found  # floor not run, no target: left out
    assert found["fast stack: loopwarden req/s / h11's"].note == "loopwarden fast not run"
    assert (
        "| stream100 | 16 | loopwarden x bare (req/s) | 0.600 (0.50-0.70) | >= 0.65: not met |"
        in targets21.markdown(list(found.values()))
    )


def test_app_cpu_rows_are_microseconds_per_event_against_two() -> None:
    figures = {"buffered": 500.0, "one read": 1.5, "one event per read": 9.25, "network reads": 2.0}
    found = {r.scenario: r for r in targets21.rows({"cells": {}, "loop": {}, "app_cpu": figures})}
    assert found["one read"].met is True and found["event per read"].met is False
    assert found["network reads"].met is True  # at the target: met
    assert (
        "| event per read | 1 | app CPU per streamed event (in-process, stream − buffered) | 9.25 µs | <= 2: not met |"
        in targets21.markdown(list(found.values()))
    )
    missing = targets21.rows({"cells": {}, "loop": {}, "app_cpu": "not run in --quick mode"})
    assert [(r.value, r.met, r.note) for r in missing] == [(None, None, "not run in --quick mode")] * 3


def test_app_cpu_measures_completed_answers_in_process() -> None:
    """`stream_cpu.measure_app` drives the real app (its checks raise on any other answer); in a
    thread, so that the app's start-up leaves this process's collector alone."""
    import stream_cpu

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        out = pool.submit(stream_cpu.measure_app, rounds=1, requests=2).result(timeout=60)
    assert set(out) == {"buffered", "one read", "one event per read", "network reads"}
    assert out["buffered"] > 0
