"""The upstream clients behind `UpstreamClient`: every behaviour the gateway relies on, run against
both `AiohttpUpstream` (the default) and `HttpxUpstream`, made by `default_upstream` from settings.

A real loopback server everywhere (the scripted `MockUpstream`, or a raw socket): timeouts,
resets and framing are what is tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from middleware.app import default_upstream
from middleware.config import Settings, SettingsError, load_settings
from middleware.ops.request_id import REQUEST_ID
from middleware.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamDecodeError,
    UpstreamError,
    UpstreamIncomplete,
    UpstreamResponse,
    UpstreamTimeout,
)
from middleware.upstream.aiohttp_client import AiohttpUpstream
from middleware.upstream.httpx_client import HttpxUpstream
from tests.helpers import DONE, PRE, MetricDelta, message_item
from tests.mock_upstream import RST, MockUpstream, Reply

Factory = Callable[..., UpstreamClient]


@pytest.fixture(params=["aiohttp", "httpx"])
def client_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make(client_name: str) -> Factory:
    """``make(base_url, **settings)``: the client `default_upstream` builds for these settings."""

    def factory(base_url: str, **overrides: Any) -> UpstreamClient:
        overrides.setdefault("upstream_connect_timeout", 2.0)
        overrides.setdefault("upstream_read_timeout", 2.0)
        settings = Settings(upstream=base_url, upstream_client=client_name, **overrides)
        return default_upstream(settings, base_url)

    return factory


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A listening socket that never accepts: connections complete, no byte ever comes back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


@contextlib.contextmanager
def one_shot_server(answer: bytes) -> Iterator[str]:
    """Accepts one connection, reads the request head, writes `answer` (raw bytes) and closes."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def serve() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        thread.join(5)
        sock.close()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


async def read_all(response: UpstreamResponse) -> list[bytes]:
    try:
        return [chunk async for chunk in response.chunks()]
    finally:
        await response.aclose()


async def post_and_read(
    client: UpstreamClient, *, stream: bool = False, path: str = "/responses"
) -> tuple[UpstreamResponse, bytes]:
    try:
        response = await client.post(path, b'{"model":"m"}', stream=stream)
        return response, b"".join(await read_all(response))
    finally:
        await client.aclose()


def expect(error: type[UpstreamError], coro: Coroutine[Any, Any, Any]) -> UpstreamError:
    with pytest.raises(error) as info:
        run(coro)
    return info.value


def test_default_is_aiohttp_and_httpx_is_selectable() -> None:
    assert Settings().upstream.client == "aiohttp"
    url = "http://127.0.0.1:1/v1"
    assert isinstance(default_upstream(Settings(upstream=url), url), AiohttpUpstream)
    assert isinstance(default_upstream(Settings(upstream=url, upstream_client="httpx"), url), HttpxUpstream)


# -- a plain exchange ---------------------------------------------------------------------------
def test_chunks_yield_every_byte_in_bounded_pieces(make: Factory, upstream: MockUpstream) -> None:
    body = bytes(range(256)) * 1200  # 300 KiB, in uneven HTTP chunks
    parts = [body[i : i + 7001] for i in range(0, len(body), 7001)]
    upstream.push(Reply(headers=[("content-type", "application/json")], parts=parts, framing="chunked"))

    async def go() -> list[bytes]:
        client = make(upstream.base_url)
        try:
            return await read_all(await client.post("/responses", b"{}", stream=False))
        finally:
            await client.aclose()

    chunks = run(go())
    assert b"".join(chunks) == body
    assert max(len(c) for c in chunks) <= 65536
    assert all(chunks)


def test_content_length_body_is_read_whole(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply.json({"ok": True}))
    response, body = run(post_and_read(make(upstream.base_url)))
    assert (response.status_code, body) == (200, b'{"ok":true}')


def test_get_reads_the_model_list(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply.json({"object": "list", "data": []}))

    async def go() -> bytes:
        client = make(upstream.base_url)
        try:
            return b"".join(await read_all(await client.get("/models")))
        finally:
            await client.aclose()

    assert run(go()) == b'{"object":"list","data":[]}'
    assert (upstream.requests[0].method, upstream.requests[0].path) == ("GET", "/v1/models")
    assert upstream.requests[0].headers["accept"] == "application/json"


def test_response_headers_are_lower_cased_and_repeats_joined(make: Factory, upstream: MockUpstream) -> None:
    headers = [("Content-Type", "application/json"), ("X-Upstream-Thing", "a"), ("X-Upstream-Thing", "b")]
    upstream.push(Reply(headers=headers, parts=[b"{}"]))
    response, _ = run(post_and_read(make(upstream.base_url)))
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-upstream-thing"] == "a, b"
    assert all(name == name.lower() for name in response.headers)


def test_request_headers_are_exactly_the_gateways(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply.json({}))

    async def go() -> None:
        REQUEST_ID.set("req-abc123")
        await post_and_read(make(upstream.base_url, upstream_api_key="sk-operator"), stream=True)

    run(go())
    sent = upstream.requests[0]
    assert (sent.method, sent.path, sent.body) == ("POST", "/v1/responses", b'{"model":"m"}')
    assert sent.headers["user-agent"] == "loopwarden"
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["accept"] == "text/event-stream"
    assert sent.headers["accept-encoding"] == "identity"
    assert sent.headers["authorization"] == "Bearer sk-operator"
    assert sent.headers["x-request-id"] == "req-abc123"
    assert sent.headers["content-length"] == "13"
    # nothing else (httpx also sends "connection: keep-alive", HTTP/1.1's default)
    assert set(sent.headers) <= {
        "host",
        "user-agent",
        "content-type",
        "accept",
        "accept-encoding",
        "authorization",
        "x-request-id",
        "content-length",
        "connection",
    }


def test_no_request_id_header_outside_a_request(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply.json({}))
    run(post_and_read(make(upstream.base_url)))
    assert "x-request-id" not in upstream.requests[0].headers
    assert "authorization" not in upstream.requests[0].headers


def test_cookies_are_never_replayed(make: Factory, upstream: MockUpstream) -> None:
    cookie = [("set-cookie", "session=client-a-secret; Path=/"), ("content-type", "application/json")]
    upstream.push(Reply(headers=cookie, parts=[b"{}"]), Reply.json({}))

    async def go() -> None:
        client = make(upstream.base_url)
        try:
            for _ in range(2):
                await read_all(await client.post("/responses", b"{}", stream=False))
        finally:
            await client.aclose()

    run(go())
    assert len(upstream.requests) == 2
    assert "cookie" not in upstream.requests[1].headers


def test_redirects_are_not_followed(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply(status=307, headers=[("location", "/v1/elsewhere")], parts=[b""]), Reply.json({}))
    response, _ = run(post_and_read(make(upstream.base_url)))
    assert response.status_code == 307
    assert len(upstream.requests) == 1


def test_metrics_ttfb_on_first_byte_and_duration_once(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply.json({}))
    delta = MetricDelta()

    async def go() -> None:
        client = make(upstream.base_url)
        try:
            response = await client.post("/responses", b"{}", stream=False)
            assert delta.delta("loopwarden_upstream_ttfb_seconds_count") == 0
            await read_all(response)
            await response.aclose()  # idempotent
        finally:
            await client.aclose()

    run(go())
    assert delta.delta("loopwarden_upstream_ttfb_seconds_count") == 1
    assert delta.delta("loopwarden_upstream_duration_seconds_count") == 1


# -- failures -----------------------------------------------------------------------------------
def test_connection_refused_is_a_connect_error(make: Factory) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    err = expect(UpstreamConnectError, post_and_read(make(url)))
    assert (err.kind, err.code) == ("connect", "upstream_unavailable")
    assert err.message.startswith("cannot connect to the upstream: ")


def test_no_response_headers_is_a_first_byte_timeout(make: Factory) -> None:
    with silent_server() as url:
        started = time.monotonic()
        err = expect(UpstreamTimeout, post_and_read(make(url, upstream_read_timeout=0.3)))
    assert isinstance(err, UpstreamTimeout)
    assert err.phase == "first_byte"
    assert err.message == "upstream did not send response headers within 0.3 s"
    assert time.monotonic() - started < 2


def test_silence_mid_body_is_a_read_timeout(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([b"data: {}\n\n", 3.0, b"data: {}\n\n"]))
    got: list[bytes] = []

    async def go() -> None:
        client = make(upstream.base_url, upstream_read_timeout=0.3)
        try:
            response = await client.post("/responses", b"{}", stream=True)
            try:
                async for chunk in response.chunks():
                    got.append(chunk)
            finally:
                await response.aclose()
        finally:
            await client.aclose()

    err = expect(UpstreamTimeout, go())
    assert isinstance(err, UpstreamTimeout)
    assert err.phase == "read"
    assert err.message == "upstream did not send more of its body within 0.3 s"
    assert b"".join(got) == b"data: {}\n\n"


def test_waiting_for_a_pooled_connection_counts_as_connect(make: Factory, upstream: MockUpstream) -> None:
    gate = threading.Event()
    upstream.push(Reply.sse([b"data: {}\n\n", gate, b"data: {}\n\n"]))

    async def go() -> None:
        client = make(upstream.base_url, upstream_max_connections=1, upstream_connect_timeout=0.3)
        try:
            first = await client.post("/responses", b"{}", stream=True)
            try:
                await client.post("/responses", b"{}", stream=True)
            finally:
                gate.set()
                await first.aclose()
        finally:
            await client.aclose()

    err = expect(UpstreamTimeout, go())
    assert isinstance(err, UpstreamTimeout)
    assert err.phase == "connect"
    assert err.message == "upstream did not accept the connection within 0.3 s"


def test_whole_call_deadline_while_the_body_trickles(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([p for _ in range(30) for p in (b"data: {}\n\n", 0.1)]))
    err = expect(UpstreamTimeout, post_and_read(make(upstream.base_url, upstream_deadline=0.5), stream=True))
    assert isinstance(err, UpstreamTimeout)
    assert err.phase == "deadline"
    assert err.message == "upstream call passed its whole-call deadline (--upstream-deadline)"


def test_whole_call_deadline_before_the_headers(make: Factory) -> None:
    with silent_server() as url:
        err = expect(
            UpstreamTimeout, post_and_read(make(url, upstream_deadline=0.3, upstream_read_timeout=5.0))
        )
    assert isinstance(err, UpstreamTimeout)
    assert err.phase == "deadline"


def test_body_shorter_than_its_content_length_is_incomplete(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(
        Reply(headers=[("content-type", "application/json")], parts=[b"{" * 1000], declared_length=4000)
    )
    err = expect(UpstreamIncomplete, post_and_read(make(upstream.base_url)))
    assert (err.kind, err.code) == ("eof", "upstream_incomplete")
    assert err.message.startswith("upstream closed the connection early: ")


def test_reset_mid_stream_is_incomplete(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([b"data: {}\n\n", RST]))
    expect(UpstreamIncomplete, post_and_read(make(upstream.base_url), stream=True))


@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_bytes_before_a_reset_are_handed_over(make: Factory, upstream: MockUpstream, framing: str) -> None:
    """Everything that arrived before the connection broke is yielded, then the error (even when
    the break arrived before the caller read those bytes)."""
    parts = [b"data: 1\n\n", b"data: 2\n\n", RST]
    upstream.push(Reply(parts=parts, framing=framing, declared_length=4000 if framing == "length" else None))
    got: list[bytes] = []

    async def go() -> None:
        client = make(upstream.base_url)
        try:
            response = await client.post("/responses", b"{}", stream=True)
            await asyncio.sleep(0.3)  # the bytes and the close are in before the first read
            try:
                async for chunk in response.chunks():
                    got.append(chunk)
            finally:
                await response.aclose()
        finally:
            await client.aclose()

    expect(UpstreamIncomplete, go())
    assert b"".join(got) == b"data: 1\n\ndata: 2\n\n"


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\ncontent-le", b"SMTP ready\r\n\r\n"])
def test_close_or_garbage_before_the_headers_is_incomplete(make: Factory, answer: bytes) -> None:
    with one_shot_server(answer) as url:
        err = expect(UpstreamIncomplete, post_and_read(make(url)))
    assert err.message.startswith("upstream closed the connection early: ")


def test_compressed_body_is_refused(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply(headers=[("content-encoding", "gzip")], parts=[b"\x1f\x8b" + b"\0" * 20]))
    err = expect(UpstreamDecodeError, post_and_read(make(upstream.base_url)))
    assert (err.kind, err.code) == ("decode", "upstream_invalid_response")
    assert err.message == (
        "upstream sent Content-Encoding 'gzip' though the gateway asked for identity; "
        "compressed bodies are refused (they could inflate past the read clamps)"
    )


def test_identity_content_encoding_is_accepted(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(Reply(headers=[("content-encoding", "Identity")], parts=[b"{}"]))
    assert run(post_and_read(make(upstream.base_url)))[1] == b"{}"


def test_closing_early_closes_the_connection_instead_of_draining(
    make: Factory, upstream: MockUpstream
) -> None:
    # 32 MiB: more than loopback's socket buffers can absorb (autotuned up to a few MiB each way),
    # so the mock is still writing when the client closes and sees the reset
    body = b"x" * (32 << 20)
    upstream.push(Reply(parts=[body[i : i + 65536] for i in range(0, len(body), 65536)], framing="chunked"))
    read = 0

    async def go() -> None:
        nonlocal read
        client = make(upstream.base_url)
        try:
            response = await client.post("/responses", b"{}", stream=False)
            async for chunk in response.chunks():
                read += len(chunk)
                break
            await response.aclose()
            await response.aclose()
        finally:
            await client.aclose()

    run(go())
    deadline = time.monotonic() + 5
    while upstream.peer_closed == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert upstream.peer_closed == 1
    assert read <= 65536
    assert upstream.bytes_written < len(body)


# -- B25b: both Content-Length and Transfer-Encoding ----------------------------------------------
def conflicting_reply() -> Reply:
    headers = [("content-type", "text/event-stream"), ("content-length", "123")]
    return Reply(headers=headers, parts=[*PRE(), DONE(2, [message_item("ok")])], framing="chunked")


def test_b25b_conflicting_framing_is_read_as_chunked(
    make: Factory, client_name: str, upstream: MockUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx reads it as chunked; aiohttp refuses it, so the client switches this upstream to httpx
    for good and sends the request again (two upstream requests the first time, one afterwards)."""
    caplog.set_level(logging.WARNING, logger="loopwarden")
    upstream.push(conflicting_reply(), conflicting_reply(), conflicting_reply())
    counts: list[int] = []

    async def go() -> list[bytes]:
        client = make(upstream.base_url, upstream_api_key="sk-operator-secret")
        bodies = []
        try:
            for _ in range(2):
                response = await client.post("/responses", b"{}", stream=True)
                bodies.append(b"".join(await read_all(response)))
                counts.append(len(upstream.requests))
        finally:
            await client.aclose()
        return bodies

    bodies = run(go())
    assert all(b"response.completed" in body for body in bodies)
    assert counts == ([2, 3] if client_name == "aiohttp" else [1, 2])
    warnings = [r.getMessage() for r in caplog.records if r.name == "loopwarden"]
    if client_name == "aiohttp":
        assert len(warnings) == 1
        assert "httpx" in warnings[0] and "127.0.0.1" in warnings[0]
        assert "sk-operator-secret" not in warnings[0]
    else:
        assert warnings == []


def test_other_framing_errors_stay_errors(make: Factory, upstream: MockUpstream) -> None:
    upstream.push(
        Reply(headers=[("transfer-encoding", "chunked")], parts=[b"zz\r\nnot hex\r\n"], framing="close")
    )
    expect(UpstreamIncomplete, post_and_read(make(upstream.base_url)))
    assert len(upstream.requests) == 1


def test_a_bad_chunk_after_the_headers_fails_the_read(make: Factory, upstream: MockUpstream) -> None:
    """aiohttp's C parser closes the connection on a malformed chunk that arrives after the
    headers but never fails the body, and drops its read timeout: the read must still fail at
    once (it hung until the whole-call deadline)."""
    for _ in range(3):
        upstream.push(
            Reply(
                headers=[("transfer-encoding", "chunked")],
                parts=[0.05, b"zz\r\nnot hex\r\n"],
                framing="close",
            )
        )

    async def bounded() -> Any:
        return await asyncio.wait_for(post_and_read(make(upstream.base_url)), 10)

    for _ in range(3):
        expect(UpstreamIncomplete, bounded())


# -- the setting ---------------------------------------------------------------------------------
def test_setting_from_env_file_and_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "lw.yaml"
    cfg.write_text("upstream-client: httpx\n")
    assert load_settings({"config": str(cfg)}, {}).upstream.client == "httpx"
    assert load_settings({}, {"LOOPWARDEN_UPSTREAM_CLIENT": "httpx"}).upstream.client == "httpx"
    env = {"LOOPWARDEN_UPSTREAM_CLIENT": "httpx"}
    assert load_settings({"config": str(cfg), "upstream_client": "aiohttp"}, env).upstream.client == "aiohttp"


def test_invalid_setting_names_field_and_allowed_values() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings({}, {"LOOPWARDEN_UPSTREAM_CLIENT": "requests"})
    assert (
        str(info.value)
        == "upstream_client must be aiohttp or httpx, got 'requests' (from $LOOPWARDEN_UPSTREAM_CLIENT)"
    )


def test_cli_refuses_an_invalid_client_with_exit_2() -> None:
    cli = str(Path(sys.executable).parent / "loopwarden")
    proc = subprocess.run(
        [cli, "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"LOOPWARDEN_UPSTREAM_CLIENT": "urllib3", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert "upstream_client must be aiohttp or httpx, got 'urllib3'" in proc.stderr


def test_cli_flag_is_validated_and_wins_over_the_environment() -> None:
    cli = str(Path(sys.executable).parent / "loopwarden")
    proc = subprocess.run(
        [cli, "serve", "--upstream-client", "curl"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"LOOPWARDEN_UPSTREAM_CLIENT": "httpx", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert "upstream_client must be aiohttp or httpx, got 'curl'" in proc.stderr


def test_http_client_request_lines_stay_out_of_the_info_log() -> None:
    """httpx logs every request at INFO (seen with --upstream-client httpx): the gateway's log
    configuration keeps the HTTP clients at WARNING and the gateway at the chosen level."""
    code = (
        "import logging, logging.config\n"
        "from middleware.ops.request_id import log_config\n"
        "logging.config.dictConfig(log_config('info', json_lines=False))\n"
        "print(logging.getLogger('httpx').isEnabledFor(logging.INFO),"
        " logging.getLogger('httpx2').isEnabledFor(logging.INFO),"
        " logging.getLogger('httpx').isEnabledFor(logging.WARNING),"
        " logging.getLogger('loopwarden').isEnabledFor(logging.INFO))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False", "True", "True"]


def test_a_pooled_connection_does_not_collect_callbacks_from_its_responses() -> None:
    """The aiohttp client watches each response's connection for closing (a hang work-around);
    a kept-alive connection serves many responses, and their watchers must not pile up on it."""
    from middleware.upstream.aiohttp_client import AiohttpUpstream

    body = b'{"id":"r","object":"response","status":"completed","output":[]}'
    status = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = int(
                next(
                    v
                    for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                    if k.lower() == b"content-length"
                )
            )
            await reader.readexactly(length)
            # the body's last chunk comes later: the response is open (and watched) meanwhile
            writer.write(status + b"%x\r\n%s\r\n" % (len(body), body))
            await writer.drain()
            await asyncio.sleep(0.002)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def main() -> tuple[int, int]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = AiohttpUpstream(f"http://127.0.0.1:{port}/v1")
        futures = set()
        try:
            for _ in range(200):
                response = await client.post("/responses", b"{}", stream=False)
                assert response._watch is not None  # type: ignore[attr-defined]
                assert b"".join(await read_all(response)) == body
            session = client._session  # type: ignore[attr-defined]
            assert session is not None
            for proto in [c[0] for conns in session.connector._conns.values() for c in conns]:
                futures.add(proto.closed)
            callbacks = max(len(f._callbacks or ()) for f in futures if f is not None)  # CPython Future
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()
        return len(futures), callbacks

    connections, callbacks = run(main())
    assert connections == 1  # all 200 on one kept-alive connection
    assert callbacks <= 2  # not 200
