"""Log hygiene an operator trusts (issue 20, item 7).

A real ``loopwarden serve`` (embedded development model) is started, used and stopped: each
lifecycle line once, none of the development model's uvicorn lines, every line with a request id
or the reason it has none. A client that resets its connection during a streamed answer leaves no
burst of asyncio's ``socket.send() raised exception.`` (the writes are dropped and counted);
``--workers N --store memory`` warns at start-up; the README lists every exported metric.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from middleware.config import Settings
from middleware.ops import metrics
from middleware.ops.connections import connection_options
from tests.helpers import MetricDelta
from tests.ops.test_prometheus_live import _free_port
from tests.servers import serve_asgi

ROOT = Path(__file__).resolve().parents[2]
SERVE = "from middleware.cli import main; raise SystemExit(main())"
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ (\S+) \[([^\]]*)\] (.*)$")
LIFECYCLE = (
    "Started server process",
    "Waiting for application startup.",
    "Application startup complete.",
    "Uvicorn running on",
    "Shutting down",
    "Waiting for application shutdown.",
    "Application shutdown complete.",
    "Finished server process",
)


def _serve(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", *args], env=env, stderr=subprocess.PIPE, text=True
    )


def _wait_up(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(url + "/metrics", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("the gateway did not start within 40 s")


@pytest.fixture(scope="module")
def gateway_log() -> list[str]:
    """The stderr lines of one gateway run: start, 3 requests (one 508, one streamed), stop."""
    port = _free_port()
    proc = _serve("--port", str(port))
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url, proc)
        demo = {"type": "mcp", "server_label": "demo", "require_approval": "never"}
        assert httpx.post(url + "/v1/responses", json={"model": "dev", "input": "hi"}).status_code == 200
        loop = {"model": "dev", "input": "loop forever", "tools": [demo]}
        assert httpx.post(url + "/v1/responses", json=loop, timeout=30).status_code == 508
        streamed = httpx.post(url + "/v1/responses", json={"model": "dev", "input": "hi", "stream": True})
        assert b"response.completed" in streamed.content
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    return err.splitlines()


def test_each_lifecycle_line_once(gateway_log: list[str]) -> None:
    for text in LIFECYCLE:
        found = [line for line in gateway_log if text in line]
        assert len(found) == 1, (text, found)


def test_the_development_model_logs_no_access_or_lifecycle_lines(gateway_log: list[str]) -> None:
    access = [line for line in gateway_log if "uvicorn.access" in line]
    # the gateway's own: /metrics once (the start-up probe may retry: at least once) and 3 requests
    responses = [line for line in access if "/v1/responses" in line]
    assert len(responses) == 3, access
    assert all(re.search(r"\[req_[0-9a-f]{32}\]", line) for line in responses), responses
    assert not any("devmodel." in line and "INFO" in line for line in gateway_log)
    assert sum("serving the embedded development model" in line for line in gateway_log) == 1


def test_every_line_carries_a_request_id_or_says_why_not(gateway_log: list[str]) -> None:
    logged = [LINE.match(line) for line in gateway_log if not line.startswith("loopwarden: ")]
    assert logged and all(logged), [line for line in gateway_log if not LINE.match(line)]
    reasons = {m.group(2) for m in logged if m and not m.group(2).startswith("req_")}
    assert reasons <= {"process", "connection"}, reasons
    outcome = [m for m in logged if m and m.group(1) == "loopwarden.outcome"]
    assert outcome and all(m.group(2).startswith("req_") for m in outcome)


def test_workers_with_the_memory_store_warn_at_start_up() -> None:
    proc = _serve("--port", str(_free_port()), "--workers", "2", "--store", "memory")
    try:
        assert proc.stderr is not None
        deadline, seen = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
            if "each worker has its own in-memory store" in line:
                assert line.startswith("loopwarden: WARNING: --workers 2 with --store memory")
                break
        else:
            raise AssertionError(seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


async def _streaming(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """One chunk, then (while the client resets) a burst of 50 writes in one loop turn: what a
    streamed answer does when the reset arrives mid-burst. The blocking sleep holds the event loop,
    so the reset is met by a write (as mid-burst), not first by a read."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"x" * 256, "more_body": True})
    time.sleep(0.5)  # blocking on purpose (see the docstring)
    for _ in range(50):
        await send({"type": "http.response.body", "body": b"x" * 256, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("stack", ["h11", "httptools"])
def test_a_reset_client_leaves_no_burst_of_send_warnings(
    stack: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(http=stack, upstream="http://127.0.0.1:9/v1", store="memory")
    caplog.set_level(logging.WARNING, logger="asyncio")
    m = MetricDelta()
    with serve_asgi(_streaming, **connection_options(settings)) as url:
        client = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)
        client.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        head = b""
        while b"x" not in head:
            head += client.recv(1000)
        assert head.startswith(b"HTTP/1.1 200")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset, as from a client that crashed
        deadline = time.monotonic() + 10
        while m.delta("loopwarden_dropped_writes_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    warnings = [r for r in caplog.records if "socket.send() raised exception" in r.getMessage()]
    assert warnings == []
    assert m.delta("loopwarden_dropped_writes_total") >= 1


def test_readme_lists_every_exported_metric() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Metrics\n")[1].split("\n## ")[0]
    missing = [
        name
        for name in metrics.METRICS
        if f"`{name.removeprefix('loopwarden_')}" not in section and name not in section
    ]
    assert missing == [], f"README's Metrics section does not list {missing}"


def test_the_development_models_writes_after_a_cancel_are_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A streamed background response from the embedded development model whose client stops
    reading, then is cancelled: the gateway closes its upstream connection while the development
    model's uvicorn is still writing the answer (one delta per word). Those writes are dropped
    and counted, not a burst of asyncio's ``socket.send() raised exception.`` from its thread."""
    from middleware.app import create_app
    from tests.asgi.test_slow_clients import non_reading_client

    settings = Settings(
        upstream=None, store="memory", client_write_timeout=2.0, max_retained_bytes=268_435_456
    )
    caplog.set_level(logging.WARNING, logger="asyncio")
    m = MetricDelta()
    body = {"model": "dev", "input": "word " * 180_000, "stream": True, "background": True}
    with (
        serve_asgi(create_app(settings), **connection_options(settings)) as url,
        non_reading_client(url, body) as response_id,
    ):
        time.sleep(1.0)  # the answer streams: 180,000 deltas (a body under aiohttp's 1 MiB warning)
        cancelled = httpx.post(f"{url}/v1/responses/{response_id}/cancel", timeout=20).json()
        assert cancelled["status"] == "cancelled", cancelled.get("error")
        deadline = time.monotonic() + 15
        while m.delta("loopwarden_dropped_writes_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    warnings = [r for r in caplog.records if "socket.send() raised exception" in r.getMessage()]
    assert warnings == [], [(r.threadName, r.getMessage()) for r in warnings[:3]]
    assert m.delta("loopwarden_dropped_writes_total") >= 1
