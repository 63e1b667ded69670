"""Connection bounds (issue 17 item 2) on both of uvicorn's HTTP/1.1 stacks, h11 and httptools.

Real servers started the way ``loopwarden serve`` starts them (`middleware.cli.uvicorn_options`,
`middleware.ops.connections.connection_options`): in a thread for the socket-level checks, in a
``loopwarden serve`` subprocess where its file descriptors are counted (``/proc/PID/fd``) or
its workers are separate processes. Everything is measured in sockets, bytes and counters; the
time bounds are generous (a header timeout of 0.5 s must close within 5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import pickle
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from middleware.app import create_app
from middleware.cli import uvicorn_options
from middleware.config import Settings, SettingsError, load_settings
from middleware.ops import connections
from middleware.ops.connections import (
    FD_MARGIN,
    BoundedH11Protocol,
    BoundedHttpToolsProtocol,
    ConnectionGuard,
    connection_options,
    fd_headroom,
    fd_overcommit,
    resolve_backlog,
    resolve_max_connections,
)
from tests.helpers import DONE, PRE, MetricDelta, message_item, response_obj
from tests.mock_upstream import MockUpstream, Reply
from tests.servers import free_port as _free_port
from tests.servers import response_json, serve_asgi, wait_healthy

STACKS = ("h11", "httptools")
#: The event loop each stack runs on here: httptools + uvloop is `loopwarden serve`'s default
#: (``uvicorn[standard]``; uvloop's C transports take the `BoundedTransport` wrapper), h11 +
#: asyncio the pure-Python pair (asyncio's transports take the bounded close in place).
LOOP = {"h11": "asyncio", "httptools": "uvloop"}
HEADER_TIMEOUT = 0.5
WITHIN = 5.0  # seconds: the generous bound for "closed at the timeout"
NOWHERE = "http://127.0.0.1:9/v1"  # an upstream the connection tests never call
CAP = "loopwarden_cap_hits_total"


def settings_for(stack: str, **overrides: Any) -> Settings:
    overrides.setdefault("header_timeout", HEADER_TIMEOUT)
    overrides.setdefault("store", "memory")
    return Settings(http=stack, loop=LOOP[stack], upstream=NOWHERE, **overrides)


@contextlib.contextmanager
def bounded(stack: str, **overrides: Any) -> Iterator[tuple[str, int]]:
    """The gateway on `stack` with the bounds ``serve`` would pass; yields (base URL, port)."""
    settings = settings_for(stack, **overrides)
    with serve_asgi(create_app(settings), **connection_options(settings)) as url:
        yield url, int(url.rsplit(":", 1)[1])


_OPEN: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_client_sockets() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def connect(port: int, timeout: float = WITHIN) -> socket.socket:
    """A client socket to the server (closed after the test)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(timeout)
    _OPEN.append(sock)
    return sock


def closed_within(sock: socket.socket, seconds: float, since: float | None = None) -> float | None:
    """Seconds from `since` (default: now) until the server closed `sock` (EOF or reset), or None
    if it is still open `seconds` after the call."""
    start = time.monotonic() if since is None else since
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except (ConnectionResetError, BrokenPipeError):
        pass
    return time.monotonic() - start


def still_open(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except ConnectionResetError:
        return False


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length body (the connection may stay open)."""
    out = b""
    while b"\r\n\r\n" not in out:
        data = sock.recv(65536)
        assert data, f"closed after {out!r}"
        out += data
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        data = sock.recv(65536)
        assert data
        body += data
    return out


def read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            out += data
    return out


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"


# --- the request head ---------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_idle_sockets_that_never_send_a_byte_are_closed_at_the_header_timeout(stack: str) -> None:
    with bounded(stack) as (_, port):
        before = MetricDelta()
        opened = time.monotonic()
        socks = [connect(port) for _ in range(10)]
        waited = [closed_within(sock, WITHIN, since=opened) for sock in socks]
        assert all(w is not None and w < WITHIN for w in waited), waited
        assert min(w for w in waited if w is not None) >= HEADER_TIMEOUT * 0.8
        assert before.delta(CAP, limit="header_timeout", outcome="408") == 10


@pytest.mark.parametrize("stack", STACKS)
def test_a_slowloris_head_is_closed_at_the_header_timeout(stack: str) -> None:
    with bounded(stack) as (_, port):
        before = MetricDelta()
        sock = connect(port)
        start = time.monotonic()
        head = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Slow: " + b"a" * 1000
        sent, closed_at = 0, None
        while time.monotonic() - start < WITHIN:
            try:
                sock.sendall(head[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - start
                break
            sent += 1
            if not still_open(sock):
                closed_at = time.monotonic() - start
                break
            time.sleep(0.02)
        assert closed_at is not None, f"still open after {sent} bytes dribbled over {WITHIN} s"
        assert HEADER_TIMEOUT * 0.8 <= closed_at < WITHIN
        assert before.delta(CAP, limit="header_timeout", outcome="408") == 1


@pytest.mark.parametrize("stack", STACKS)
def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout(stack: str) -> None:
    with bounded(stack, header_timeout=30.0, keepalive_timeout=0.5) as (_, port):
        before = MetricDelta()
        sock = connect(port)
        sock.sendall(HEALTHZ)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        waited = closed_within(sock, WITHIN)
        assert waited is not None and waited >= 0.4
        assert before.delta(CAP, limit="header_timeout", outcome="408") == 0  # uvicorn's own timer


@pytest.mark.parametrize("stack", STACKS)
def test_the_next_head_on_a_kept_alive_connection_has_the_header_timeout_too(stack: str) -> None:
    """uvicorn cancels its keep-alive timer at the first byte of the next request: from there on,
    without the header deadline, a dribbled second head would hold the connection for ever."""
    with bounded(stack, keepalive_timeout=0.3) as (_, port):
        before = MetricDelta()
        sock = connect(port)
        sock.sendall(HEALTHZ)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        closed_at = None
        for byte in (b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 1000)[:400]:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - start
                break
            if not still_open(sock):
                closed_at = time.monotonic() - start
                break
            time.sleep(0.02)
        assert closed_at is not None and HEADER_TIMEOUT * 0.8 <= closed_at < WITHIN
        assert before.delta(CAP, limit="header_timeout", outcome="408") == 1


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("dribbled", [False, True], ids=["one_write", "in_chunks"])
def test_a_head_over_max_header_bytes_is_431_in_the_envelope(stack: str, dribbled: bool) -> None:
    with bounded(stack, header_timeout=30.0) as (_, port):
        sock = connect(port)
        head = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if dribbled:
                for i in range(0, len(head), 4096):
                    sock.sendall(head[i : i + 4096])
                    time.sleep(0.005)
            else:
                sock.sendall(head)
        status, headers, body = response_json(read_until_closed(sock))
        assert status == 431
        assert headers["content-type"] == "application/json" and headers["connection"] == "close"
        assert headers["x-should-retry"] == "false"
        assert body["error"]["code"] == "request_header_too_large"
        assert body["error"]["type"] == "invalid_request_error" and "65536" in body["error"]["message"]


@pytest.mark.parametrize("stack", STACKS)
def test_a_head_just_within_max_header_bytes_is_served(stack: str) -> None:
    with bounded(stack) as (_, port):
        prefix = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Big: "
        head = prefix + b"a" * (65_536 - len(prefix) - 4) + b"\r\n\r\n"
        assert len(head) == 65_536
        sock = connect(port)
        sock.sendall(head)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("stack", STACKS)
def test_a_request_the_parser_rejects_is_400_in_the_envelope(stack: str) -> None:
    with bounded(stack) as (_, port):
        sock = connect(port)
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = response_json(read_until_closed(sock))
        assert status == 400 and headers["content-type"] == "application/json"
        assert body["error"]["code"] == "invalid_request" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stack", STACKS)
def test_b25d_garbage_pipelined_after_a_body_is_answered_after_the_request_on_both_stacks(stack: str) -> None:
    """CASES B25d with `serve`'s protocols: the request's own outcome comes first (400
    ``invalid_json`` for its 10-byte body, in the envelope), then the unparsable rest gets the
    400 ``invalid_request`` envelope and the close. llhttp (httptools) fails on the rest before the
    app has answered, where uvicorn's own protocol answers a plain-text 400 instead of the
    request's; h11 reads the rest only after the response, and waits for its line end."""
    # h11 closes at the keep-alive timeout: short, well inside the socket's timeout
    with bounded(stack, charge_model="reference", keepalive_timeout=1.0) as (_, port):
        sock = connect(port)
        head = b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n"
        sock.sendall(head + b'{"model":"m","input":"' + b"a" * 178 + b'"}')
        raw = read_until_closed(sock)
    first = read_first(raw)
    status, headers, body = response_json(first)
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["error"]["code"] == "invalid_json"
    rest = raw[len(first) :]
    if stack == "h11":  # h11 waits for the rest's line end, then the keep-alive timeout closes
        assert rest == b""
        return
    status, headers, body = response_json(rest)
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["error"]["code"] == "invalid_request"
    assert headers["connection"] == "close"


def read_first(raw: bytes) -> bytes:
    """The first response of `raw` (it has a Content-Length body)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    return head + b"\r\n\r\n" + rest[:length]


@pytest.mark.parametrize("stack", STACKS)
def test_well_behaved_traffic_is_untouched_a_slow_body_is_not_a_slow_head(stack: str) -> None:
    """The deadline ends with the head: a body that takes longer than the header timeout, several
    requests on one kept-alive connection and a streamed answer are all served."""
    with MockUpstream() as upstream:
        for _ in range(2):
            upstream.push(Reply.json(response_obj([message_item("ok")])))
        upstream.push(Reply.sse([*PRE(), DONE(2, [message_item("streamed")])]))
        before = MetricDelta()
        settings = settings_for(stack)
        app = create_app(settings.replace(upstream=upstream.base_url))
        with serve_asgi(app, **connection_options(settings)) as url:
            port = int(url.rsplit(":", 1)[1])
            sock = connect(port)
            body = b'{"model":"m","store":false,"input":"hi"}'
            head = b"POST /v1/responses HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
            time.sleep(HEADER_TIMEOUT * 2)
            sock.sendall(body)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            with httpx.Client(base_url=url, timeout=10) as client:
                assert (
                    client.post(
                        "/v1/responses", json={"model": "m", "store": False, "input": "x"}
                    ).status_code
                    == 200
                )
                streamed = client.post(
                    "/v1/responses", json={"model": "m", "store": False, "input": "x", "stream": True}
                )
                assert streamed.status_code == 200 and b"response.completed" in streamed.content
                assert client.get("/healthz").status_code == 200
        assert before.delta(CAP, limit="header_timeout", outcome="408") == 0
        assert len(upstream.requests) == 3


# --- the connection cap -------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_connections_over_max_connections_are_closed_at_once_and_a_client_is_still_served(
    stack: str,
) -> None:
    with bounded(stack, header_timeout=30.0, max_connections=8) as (_, port):
        before = MetricDelta()
        held = [connect(port) for _ in range(8)]
        time.sleep(0.3)  # accepted by the server, not just by the kernel
        refused = [connect(port) for _ in range(8)]
        waited = [closed_within(sock, 2.0) for sock in refused]
        assert all(w is not None and w < 2.0 for w in waited), waited
        assert all(still_open(sock) for sock in held)
        assert before.delta(CAP, limit="max_connections", outcome="503") == 8
        # a well-behaved client on a connection it already has
        held[0].sendall(HEALTHZ)
        assert read_response(held[0]).startswith(b"HTTP/1.1 200 ")
        # and on a new one once others have gone
        for sock in held[4:]:
            sock.close()
        time.sleep(0.3)
        sock = connect(port)
        sock.sendall(HEALTHZ)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        assert before.delta(CAP, limit="max_connections", outcome="503") == 8


# --- loopwarden serve in a subprocess: file descriptors, workers --------------------------------


@contextlib.contextmanager
def serve(args: list[str], log: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`loopwarden serve` in a subprocess; yields (process, port) once /healthz answers."""
    port = _free_port()
    cli = str(Path(sys.executable).parent / "loopwarden")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWARDEN_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [cli, "serve", "--port", str(port), "--upstream", NOWHERE, "--store", "memory", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log=log)
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(port: int, limit: str, outcome: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    match = re.search(rf'^{CAP}{{limit="{limit}",outcome="{outcome}",transport="http"}} (\S+)$', text, re.M)
    assert match, f"no {limit}/{outcome} series"
    return float(match[1])


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/PID/fd")
@pytest.mark.parametrize("stack", STACKS)
def test_the_servers_file_descriptors_stay_bounded_under_a_flood_of_idle_sockets(
    stack: str, tmp_path: Path
) -> None:
    cap, batch = 20, 8  # batch: asyncio accepts up to --backlog sockets before refusing any
    args = [
        "--http",
        stack,
        "--loop",
        LOOP[stack],
        "--max-connections",
        str(cap),
        "--backlog",
        str(batch),
        "--header-timeout",
        "2",
    ]
    with serve(args, tmp_path / "log") as (proc, port):
        time.sleep(0.5)  # the start-up probe's connection is closed
        baseline = fd_count(proc.pid)
        flood: list[socket.socket] = []
        peak = baseline
        for i in range(2 * cap):
            flood.append(connect(port))
            peak = max(peak, fd_count(proc.pid))
            if i % batch == batch - 1:
                time.sleep(0.05)  # a full listen queue would drop SYNs (retried 1 s later)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            peak = max(peak, fd_count(proc.pid))
            time.sleep(0.01)
        assert peak <= baseline + cap + batch, (baseline, peak)
        closed = [closed_within(sock, 10.0) for sock in flood]
        assert all(c is not None for c in closed), closed
        time.sleep(0.3)
        assert fd_count(proc.pid) <= baseline + 1
        assert scrape(port, "max_connections", "503") == cap
        assert scrape(port, "header_timeout", "408") == cap
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200


@pytest.mark.parametrize("stack", STACKS)
def test_workers_get_the_bounds_too(stack: str, tmp_path: Path) -> None:
    args = ["--http", stack, "--loop", LOOP[stack], "--workers", "2", "--header-timeout", str(HEADER_TIMEOUT)]
    with serve(args, tmp_path / "log") as (_, port):
        socks = [connect(port) for _ in range(4)]
        waited = [closed_within(sock, WITHIN) for sock in socks]
        assert all(w is not None for w in waited), waited
        big = connect(port)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            big.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        assert response_json(read_until_closed(big))[0] == 431


# --- what the subclasses rely on in uvicorn -----------------------------------------------------


def _loaded_config(stack: str) -> uvicorn.Config:
    async def app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never called
        pass

    config = uvicorn.Config(app, http=stack, log_config=None)
    config.load()
    return config


@pytest.mark.parametrize(
    ("base", "names"),
    [
        (H11Protocol, ["connection_made", "data_received", "connection_lost", "send_400_response"]),
        (
            HttpToolsProtocol,
            [
                "connection_made",
                "data_received",
                "connection_lost",
                "send_400_response",
                "on_message_begin",
                "on_headers_complete",
            ],
        ),
    ],
    ids=["h11", "httptools"],
)
def test_uvicorn_still_has_the_hooks_the_subclasses_override(base: type, names: list[str]) -> None:
    """Checked against uvicorn `connections.CHECKED_UVICORN`: a release that renames, drops or
    stops calling one of these makes the bounds silently vanish, so this fails first."""
    for name in names:
        assert callable(getattr(base, name, None)), (
            f"uvicorn {uvicorn.__version__}: {base.__name__}.{name} is gone"
        )
    source = inspect.getsource(base.data_received)
    if base is H11Protocol:
        source += inspect.getsource(base.handle_events)
    assert "send_400_response" in source, "uvicorn no longer answers parser errors with send_400_response"
    assert "_unset_keepalive_if_required" in source, "uvicorn no longer cancels keep-alive on data"
    assert "timeout_keep_alive_handler" in inspect.getsource(base.on_response_complete)
    assert "self.connections.add(self)" in inspect.getsource(base.connection_made)
    if base is HttpToolsProtocol:
        assert "on_headers_complete" in dir(base) and "pipeline" in inspect.getsource(base.__init__)


def test_uvicorn_state_the_subclasses_read_is_still_there() -> None:
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        state = ServerState()
        h11_proto = H11Protocol(config=_loaded_config("h11"), server_state=state, app_state={}, _loop=loop)
        assert h11_proto.conn.their_state is h11.IDLE
        assert isinstance(h11_proto.conn.trailing_data[0], bytes)
        assert isinstance(state.connections, set) and isinstance(state.default_headers, list)
        tools = HttpToolsProtocol(
            config=_loaded_config("httptools"), server_state=state, app_state={}, _loop=loop
        )
        assert tools.cycle is None and len(tools.pipeline) == 0
    finally:
        loop.close()


@pytest.mark.parametrize("stack", STACKS)
def test_the_guard_is_called_from_the_uvicorn_hooks(stack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The overrides are really reached on this uvicorn: accept, every read, the parser's 400."""
    calls: dict[str, int] = {}
    for name in ("admit", "oversized", "after_data", "answer"):
        original = getattr(ConnectionGuard, name)

        def spy(
            self: ConnectionGuard, *args: Any, _name: str = name, _original: Any = original, **kw: Any
        ) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *args, **kw)

        monkeypatch.setattr(ConnectionGuard, name, spy)
    with bounded(stack) as (_, port):
        sock = connect(port)
        sock.sendall(HEALTHZ)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock = connect(port)
        sock.sendall(b"\x00\x01 garbage\r\n\r\n")
        assert response_json(read_until_closed(sock))[0] == 400
    assert calls.get("admit") == 2 and calls.get("answer") == 1, calls
    assert calls.get("oversized", 0) >= 2 and calls.get("after_data", 0) >= 1, calls


# --- settings and how serve builds the uvicorn config -------------------------------------------


def test_defaults_and_sources() -> None:
    s = Settings()
    assert (s.transport.http, s.transport.loop) == ("httptools", "uvloop")  # uvicorn[standard]
    assert uvicorn_options(s)["loop"] == "uvloop"
    assert (
        s.transport.http,
        s.transport.header_timeout,
        s.transport.keepalive_timeout,
        s.transport.max_connections,
        s.transport.max_header_bytes,
    ) == (
        "httptools",
        10.0,
        5.0,
        0,
        65_536,
    )
    assert s.transport.backlog == 0
    env = {
        "LOOPWARDEN_HEADER_TIMEOUT": "3",
        "LOOPWARDEN_MAX_CONNECTIONS": "500",
        "LOOPWARDEN_HTTP": "h11",
        "LOOPWARDEN_LOOP": "asyncio",
    }
    s = load_settings({"keepalive_timeout": 2.5, "max_header_bytes": 8192}, env)
    assert s.transport.loop == "asyncio"
    assert (
        s.transport.http,
        s.transport.header_timeout,
        s.transport.keepalive_timeout,
        s.transport.max_connections,
        s.transport.max_header_bytes,
    ) == (
        "h11",
        3.0,
        2.5,
        500,
        8192,
    )


def test_config_file_keys(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("header-timeout: 4\nkeepalive_timeout: 1\nmax-connections: 64\nhttp: httptools\n")
    s = load_settings({"config": str(path)}, {})
    assert (
        s.transport.header_timeout,
        s.transport.keepalive_timeout,
        s.transport.max_connections,
        s.transport.http,
    ) == (4.0, 1.0, 64, "httptools")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("header_timeout", 0, "header_timeout must be a positive number of seconds, got 0"),
        ("keepalive_timeout", -1.0, "keepalive_timeout must be a positive number of seconds, got -1.0"),
        ("max_connections", -1, "max_connections must be in 0..=1000000"),
        ("max_header_bytes", 1023, "max_header_bytes must be in 1024..=1048576, got 1023"),
        ("backlog", 65_536, "backlog must be in 0..=65535"),
        ("http", "zttp", "http must be h11 or httptools, got 'zttp'"),
        ("loop", "trio", "loop must be asyncio or uvloop, got 'trio'"),
    ],
)
def test_invalid_values_name_the_field_range_and_value(field: str, value: Any, message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        Settings(**{field: value})


def test_max_connections_default_is_the_fd_limit_minus_the_headroom() -> None:
    s = Settings(upstream=NOWHERE, upstream_max_connections=100)
    assert fd_headroom(s) == 100 + FD_MARGIN
    assert resolve_backlog(s, nofile=1024) == 128 and resolve_backlog(s, nofile=1_000_000) == 2048
    assert resolve_max_connections(s, nofile=1024) == 1024 - 164 - 128
    assert resolve_max_connections(s, nofile=20_000) == 20_000 - 164 - 2048
    assert fd_overcommit(s, nofile=1024) == 0
    embedded = Settings(upstream_max_connections=100)  # the dev model's sockets are ours too
    assert fd_headroom(embedded) == 200 + FD_MARGIN
    routed = Settings(upstream=NOWHERE, upstream_max_connections=10, models={"a": {}, "b": {}})
    assert fd_headroom(routed) == 30 + FD_MARGIN
    explicit = Settings(upstream=NOWHERE, max_connections=900, backlog=64)
    assert resolve_max_connections(explicit, nofile=10) == 900 and resolve_backlog(explicit, nofile=10) == 64
    assert fd_overcommit(explicit, nofile=1024) == 900 + 64 + 164 - 1024
    soft = connections.fd_limit()
    if soft - fd_headroom(s) - resolve_backlog(s) >= connections.MIN_DERIVED_CONNECTIONS:
        assert resolve_max_connections(s) == soft - fd_headroom(s) - resolve_backlog(s)


def test_a_too_low_fd_limit_stops_the_start_up_with_the_fix() -> None:
    with pytest.raises(SettingsError, match=r"ulimit -n\) is 100.*raise ulimit -n"):
        resolve_max_connections(Settings(upstream=NOWHERE), nofile=100)
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    code = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import resource,sys;resource.setrlimit(resource.RLIMIT_NOFILE,(100,{hard}));"
            f"from middleware.cli import main;sys.exit(main(['serve','--upstream','{NOWHERE}','--port','1']))",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        timeout=60,
    )
    assert code.returncode == 2 and "max_connections" in code.stderr, code.stderr


@pytest.mark.parametrize("stack", STACKS)
def test_serve_options_carry_the_bounds_and_survive_pickling_for_workers(stack: str) -> None:
    s = Settings(upstream=NOWHERE, http=stack, header_timeout=3, keepalive_timeout=2, max_connections=9)
    opts = uvicorn_options(s)
    assert opts["timeout_keep_alive"] == 2 and opts["h11_max_incomplete_event_size"] == 65_536
    assert opts["backlog"] == resolve_backlog(s)
    config = uvicorn.Config("middleware.app:create_app_from_env", factory=True, workers=2, **opts)
    clone = pickle.loads(pickle.dumps(config))  # what uvicorn's spawned workers receive
    factory = clone.http
    assert factory.func is (BoundedH11Protocol if stack == "h11" else BoundedHttpToolsProtocol)
    bounds = factory.keywords["bounds"]
    assert (bounds.header_timeout, bounds.max_connections, bounds.max_header_bytes) == (3, 9, 65_536)
    assert Settings.from_env_json(s.to_env()) == s  # the workers' settings: the same bounds again


def test_uvloop_transports_get_the_bounded_close_and_write_through_the_wrapper() -> None:
    """uvloop's C transports allow no attribute assignment: `ConnectionGuard.admit` wraps them
    (`BoundedTransport`), so a close whose client reads nothing is still aborted after the write
    timeout, and writes after the close are dropped and counted."""
    import uvloop

    bounds = connections.ConnectionBounds(
        header_timeout=30, max_connections=8, max_header_bytes=4096, write_timeout=0.5
    )
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        lost = loop.create_future()

        class Sink(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                guard = ConnectionGuard(bounds, loop)
                bounded = guard.admit(transport, 0)  # type: ignore[arg-type]
                seen["wrapped"] = type(bounded)
                assert bounded is not None
                bounded.write(b"x" * (8 << 20))  # far more than the socket buffers hold
                bounded.close()
                bounded.write(b"dropped")
                seen["closed_at"] = loop.time()

            def connection_lost(self, exc: Exception | None) -> None:
                lost.set_result(loop.time())

        server = await loop.create_server(Sink, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        sock = socket.create_connection(("127.0.0.1", port))  # never reads
        try:
            seen["lost_after"] = await asyncio.wait_for(lost, WITHIN) - seen["closed_at"]
        finally:
            sock.close()
            server.close()

    before = MetricDelta()
    uvloop.run(scenario())
    assert seen["wrapped"] is connections.BoundedTransport
    assert 0.4 <= seen["lost_after"] < WITHIN
    assert before.delta("loopwarden_dropped_writes_total") == 1
