"""Real servers on loopback ports for end-to-end tests, and raw HTTP/1.1 to them (no app imported)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from middleware.dev.embedded import BackgroundServer


@contextlib.contextmanager
def serve_asgi(app: Any, **config: Any) -> Iterator[str]:
    """Serve `app` with a real uvicorn on 127.0.0.1:<ephemeral>; yield ``http://127.0.0.1:PORT``."""
    server = BackgroundServer(app, **config)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a subprocess that binds it itself)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(
    url: str,
    proc: subprocess.Popen[Any],
    *,
    log: Path | None = None,
    timeout: float = 30.0,
    what: str = "the gateway",
) -> None:
    """Return once ``GET {url}/healthz`` answers 200 from the `loopwarden serve` subprocess `proc`.

    Polls every 0.1 s (1 s per attempt). Raises AssertionError, with what the process wrote (its
    `log` file, else its ``stderr`` pipe when it has one), when it exits first or after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        assert proc.poll() is None, _output(proc, log)
        assert time.monotonic() < deadline, f"{what} did not answer /healthz within {timeout:g} s"
        time.sleep(0.1)


def _output(proc: subprocess.Popen[Any], log: Path | None) -> object:
    """What a process that exited wrote: its log file, else its stderr pipe (else nothing)."""
    if log is not None:
        return log.read_text()
    return proc.stderr.read() if proc.stderr else ""


def raw_http(url: str, head: bytes, body: bytes = b"", *, read_timeout: float = 10.0) -> bytes:
    """Send raw bytes to the gateway and return everything it answers until it closes or times out."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(head + body)
        out = b""
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                out += data
                if b"\r\n\r\n" in out and _complete(out):
                    break
        except TimeoutError:
            pass
    return out


def _complete(raw: bytes) -> bool:
    head, _, body = raw.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def response_json(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """Parse the first raw HTTP/1.1 response (Content-Length body): (status, headers, JSON body)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    body = body[: int(headers.get("content-length", len(body)))]
    return status, headers, json.loads(body) if body else None
