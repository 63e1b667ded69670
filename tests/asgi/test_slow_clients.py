"""Hostile clients at the connection level (issue 17, items 1 and 3), on both HTTP stacks uvicorn
offers (h11 and httptools): a streaming client that stops reading is ended by
``--client-write-timeout`` (and the request deadline bounds its final error frame), and a client
still uploading its body when the gateway shuts down gets 503 ``server_shutting_down``.

Real servers only: the gateway on a real uvicorn (or a real ``loopwarden serve`` process), a
scripted upstream, and raw sockets whose small receive buffer fills at once. What a stuck request
holds is counted in bytes from the pool's gauges, never from RSS.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import DONE, PRE, MetricDelta, gateway, message_item, metric, response_obj, text_delta
from tests.mock_upstream import MockUpstream, Reply
from tests.servers import free_port as _free_port
from tests.servers import wait_healthy

STACKS = ["h11", "httptools"]
DELTA = "x" * 16_384  # one text delta's bytes: a long answer in few events
GATEWAY_GAUGES = (
    "loopwarden_admission_reserved_bytes",
    "loopwarden_inflight_retained_bytes",
    "loopwarden_inflight_requests",
)


def long_answer(deltas: int, *, pause: float = 0.0) -> Reply:
    """A streamed answer of ``deltas`` × 16 KiB of text (then, with `pause`, that many seconds
    of silence before it completes)."""
    parts: list[Any] = [*PRE()]
    parts += [text_delta(2 + i, DELTA) for i in range(deltas)]
    if pause:
        parts.append(pause)
    parts.append(DONE(2 + deltas, [message_item("done")]))
    return Reply.sse(parts)


@contextlib.contextmanager
def non_reading_client(
    url: str, body: dict[str, Any], sockets: list[socket.socket] | None = None
) -> Iterator[str]:
    """POST `body` from a raw socket with a 4 KiB receive buffer, read the response head and its
    first event (``response.created``), then never read again; yields the response id. The
    socket stays open (and unread) until the block ends."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: sets the window
    if sockets is not None:  # the caller looks at the socket itself
        sockets.append(sock)
    try:
        sock.settimeout(10)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/responses HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(raw), raw)
        )
        seen = b""
        while (match := re.search(rb'"response":\{"id":"([^"]+)"', seen)) is None:
            data = sock.recv(1024)
            assert data, seen
            seen += data
        assert seen.startswith(b"HTTP/1.1 200"), seen[:100]
        yield match.group(1).decode()
    finally:
        sock.close()


def wait_until_idle(within: float) -> float:
    """Seconds until the gateway holds no request, no reservation and no charge (every gauge of
    `GATEWAY_GAUGES` at 0); fails after `within` seconds."""
    started = time.monotonic()
    while any(metric(name) for name in GATEWAY_GAUGES):
        held = {name: metric(name) for name in GATEWAY_GAUGES}
        assert time.monotonic() - started < within, f"still held after {within} s: {held}"
        time.sleep(0.05)
    return time.monotonic() - started


def stored(url: str, response_id: str) -> dict[str, Any]:
    answer = httpx.get(url + f"/v1/responses/{response_id}", timeout=10)
    assert answer.status_code == 200, answer.text
    out: dict[str, Any] = answer.json()
    return out


# -- item 1: every write to the client is bounded ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("http", STACKS)
def test_a_client_that_stops_reading_is_ended_by_the_write_timeout(upstream: MockUpstream, http: str) -> None:
    upstream.push(long_answer(1_000))  # 16 MiB of text: far more than the socket buffers hold
    with gateway(
        upstream,
        http=http,
        client_write_timeout=1.0,
        max_retained_bytes=268_435_456,
        upstream_read_timeout=30,
    ) as (url, _):
        m = MetricDelta()
        with non_reading_client(url, {"model": "m", "input": "x", "stream": True}) as response_id:
            assert metric("loopwarden_admission_reserved_bytes") > 0
            took = wait_until_idle(within=15)
            assert upstream.bytes_written < 1_000 * len(DELTA)  # the gateway stopped reading it
            assert stored(url, response_id)["status"] == "cancelled"
    assert took >= 1.0  # not before the client had stalled for the whole timeout
    assert m.delta("loopwarden_cap_hits_total", limit="client_write_timeout", outcome="closed") == 1
    assert m.delta("loopwarden_client_disconnects_total") == 1
    assert m.delta("loopwarden_stream_errors_total", code="request_deadline_exceeded") == 0


@pytest.mark.slow
@pytest.mark.parametrize("http", STACKS)
def test_the_request_deadline_bounds_the_error_frame_to_a_client_that_stops_reading(
    upstream: MockUpstream, http: str
) -> None:
    """The deadline fires while the client's buffers are full: its error frame cannot be
    written, and gets the write timeout, not forever."""
    upstream.push(long_answer(1_000))
    with gateway(
        upstream,
        http=http,
        request_deadline=1.5,
        client_write_timeout=4.0,
        max_retained_bytes=268_435_456,
        upstream_read_timeout=30,
    ) as (url, _):
        m = MetricDelta()
        started = time.monotonic()
        with non_reading_client(url, {"model": "m", "input": "x", "stream": True}) as response_id:
            wait_until_idle(within=15)
            took = time.monotonic() - started
            response = stored(url, response_id)
    assert response["status"] == "failed" and response["error"]["code"] == "request_deadline_exceeded"
    assert 1.5 <= took < 1.5 + 4.0 + 3.0  # the deadline, then at most the write timeout (+ margin)
    assert m.delta("loopwarden_cap_hits_total", limit="request_deadline", outcome="sse_error") == 1
    assert m.delta("loopwarden_cap_hits_total", limit="client_write_timeout", outcome="closed") == 1


@pytest.mark.parametrize("http", STACKS)
def test_a_reading_client_still_gets_the_deadline_error_frame(upstream: MockUpstream, http: str) -> None:
    """The bound on the final frame takes nothing from a client that reads: it gets the error frame."""
    upstream.push(long_answer(3, pause=5.0))
    settings = {"request_deadline": 1.0, "client_write_timeout": 1.0, "upstream_read_timeout": 30}
    with gateway(upstream, http=http, **settings) as (url, _):
        m = MetricDelta()
        answer = httpx.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10
        )
    frames = [line for line in answer.text.splitlines() if line.startswith("event:")]
    assert frames[-2:] == ["event: error", "event: response.failed"]
    assert answer.text.endswith("data: [DONE]\n\n")
    assert m.delta("loopwarden_cap_hits_total", limit="client_write_timeout", outcome="closed") == 0


# -- item 3: shutdown during an upload ----------------------------------------------------------
#: `loopwarden serve` with uvicorn's HTTP stack chosen by the first argument (a test-only way:
#: there is no --http setting yet).
LAUNCH = (
    "import functools, sys, uvicorn; "
    "uvicorn.run = functools.partial(uvicorn.run, http=sys.argv.pop(1)); "
    "from middleware.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _serve(http: str, args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`loopwarden serve` on uvicorn's `http` stack in a subprocess; returns once /healthz answers."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWARDEN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, http, "serve", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log=log)
    return proc, url


@pytest.mark.slow
@pytest.mark.parametrize("http", STACKS)
def test_shutdown_during_an_upload_answers_503_server_shutting_down(
    upstream: MockUpstream, tmp_path: Path, http: str
) -> None:
    drain = 2.0
    proc, url = _serve(
        http,
        ["--upstream", upstream.base_url, "--store", "memory", "--drain-timeout", str(drain)],
        tmp_path / "log",
    )
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=drain + 15) as sock:
            sock.sendall(
                b"POST /v1/responses HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b'content-length: 4000\r\n\r\n{"model":"m","input":"'
            )
            time.sleep(0.5)  # the gateway is reading the body now
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            raw = b""
            with contextlib.suppress(TimeoutError, ConnectionError):
                while data := sock.recv(65536):
                    raw += data
        proc.wait(timeout=drain + 15)
        exited = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), (raw[:300], (tmp_path / "log").read_text()[-2000:])
    headers = dict(
        line.split(": ", 1) for line in head.decode("latin-1").lower().split("\r\n")[1:] if ": " in line
    )
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    envelope = json.loads(body[: int(headers["content-length"])])["error"]
    assert envelope["code"] == "server_shutting_down" and envelope["type"] == "server_error"
    assert exited < drain + 2.0, exited  # within the drain timeout (+ process exit)
    assert upstream.requests == []


@pytest.mark.parametrize("http", STACKS)
def test_a_closed_connection_whose_client_reads_nothing_is_aborted_not_kept(
    upstream: MockUpstream, http: str
) -> None:
    """A buffered 8 MB answer is one ``send``: what the kernel does not take waits in the
    transport's buffer, and a close (here the keep-alive timeout's) flushes it first. Without a
    bound, a client that never reads kept that socket, its megabytes and a connection slot for
    ever. With the connection bounds (`loopwarden serve`'s protocol) the closed connection is
    aborted once its buffer has not shrunk for a write timeout: the client that reads afterwards
    gets only what the kernel already held, then the end of the connection."""
    from middleware.app import create_app
    from middleware.config import Settings
    from middleware.ops.connections import connection_options
    from tests.servers import serve_asgi

    text = "x" * 8_000_000
    upstream.push(Reply.json(response_obj([message_item(text)])))
    settings = Settings(
        upstream=upstream.base_url,
        store="memory",
        http=http,
        client_write_timeout=1.0,
        keepalive_timeout=1.0,
        max_retained_bytes=268_435_456,
        upstream_read_timeout=30,
    )
    raw = json.dumps({"model": "m", "input": "x", "store": False}).encode()
    with serve_asgi(create_app(settings), **connection_options(settings)) as url:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        with sock:
            sock.connect((host, int(port)))
            sock.sendall(
                b"POST /v1/responses HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(raw), raw)
            )
            sock.settimeout(10)
            assert sock.recv(16).startswith(b"HTTP/1.1 200")
            time.sleep(5.0)  # keep-alive timeout (1 s), then the close lingers (1 s) and is aborted
            received = 0
            with contextlib.suppress(ConnectionResetError):
                while data := sock.recv(65536):
                    received += len(data)
    assert received < len(text), received  # not the whole answer: the rest was dropped with the socket
