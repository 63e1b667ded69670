"""Issue 17 item 4 end to end: an MCP server cannot lead the gateway outside the allowlist.

One loopback "site" serves two real MCP servers: the allowed one at ``/mcp``, behind a
`Redirector` that answers chosen requests with a redirect to ``/admin/mcp`` on the same host, and
an "admin" one at ``/admin/mcp`` whose every HTTP request is counted. Whatever the redirect
(301, 302, 307, 308; of the ``tools/list``, the ``tools/call`` or the GET stream), the admin server
must see zero requests: a redirected ``tools/list`` is a 502 ``mcp_server_unavailable``, a
redirected ``tools/call`` an error output fed back to the model. A ``server_url`` with encoded
traversal is refused (400 ``mcp_server_not_allowed``) before any connection is made.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.helpers import FC, gateway
from tests.loop.test_loop_e2e import fc_reply, final_reply, outputs_sent
from tests.mcp_servers import Probe, build_other_server, build_tools_server
from tests.mock_upstream import MockUpstream
from tests.servers import serve_asgi

REDIRECTS = [301, 302, 307, 308]


class Counter:
    """ASGI wrapper counting the HTTP requests that reach `app` (thread-safe)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests = 0
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            with self._lock:
                self.requests += 1
        await self.app(scope, receive, send)


class Redirector:
    """ASGI wrapper answering `status` with ``Location: /admin/mcp`` to every POST whose JSON-RPC
    method is in ``methods`` and, when ``get`` is set, to every GET; the rest reach `app`. With
    ``legacy`` set, ``server/discover`` is answered "method not found", as a server of the
    handshake era answers it: the SDK then falls back to ``initialize``, gets an
    ``Mcp-Session-Id`` and opens the standalone GET stream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.status = 307
        self.methods: set[str] = set()
        self.get = False
        self.legacy = False
        self.redirected = 0
        self.gets = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET":
            self.gets += 1
            if self.get:
                await self._redirect(send)
                return
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        with contextlib.suppress(ValueError):
            parsed = json.loads(body)
            if isinstance(parsed, dict) and parsed.get("method") in self.methods:
                await self._redirect(send)
                return
            if isinstance(parsed, dict) and self.legacy and parsed.get("method") == "server/discover":
                await _method_not_found(parsed.get("id"), send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _redirect(self, send: Send) -> None:
        self.redirected += 1
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [(b"location", b"/admin/mcp"), (b"content-length", b"0")],
            }
        )
        await send({"type": "http.response.body", "body": b""})


async def _method_not_found(request_id: Any, send: Send) -> None:
    body = json.dumps(
        {"jsonrpc": "2.0", "id": request_id, "error": {"code": -32601, "message": "Method not found"}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Site:
    """The two servers on one host: the allowed one (`redirector`, `probe`) and the admin one
    (`admin`, `admin_probe`)."""

    def __init__(self) -> None:
        self.probe = Probe()
        self.admin_probe = Probe()
        main = build_tools_server(self.probe)
        admin = build_other_server(self.admin_probe)
        self.redirector = Redirector(main.streamable_http_app())
        self.admin = Counter(admin.streamable_http_app())

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            # Mounted apps' own lifespans do not run: start both session managers here.
            async with main.session_manager.run(), admin.session_manager.run():
                yield

        self.app = Starlette(
            routes=[Mount("/admin", app=self.admin), Mount("/", app=self.redirector)], lifespan=lifespan
        )


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Site, str]]:
    site = Site()
    with serve_asgi(site.app) as base:
        yield site, base


@pytest.fixture
def site(served: tuple[Site, str]) -> Iterator[tuple[Site, str]]:
    site, base = served
    yield site, base
    site.redirector.methods = set()
    site.redirector.get = site.redirector.legacy = False
    site.redirector.status = 307
    site.redirector.redirected = site.redirector.gets = 0
    site.admin.requests = 0
    site.probe.reset()
    site.admin_probe.reset()


def declared(base: str) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "mine", "server_url": f"{base}/mcp", "require_approval": "never"}


def site_gateway(upstream: MockUpstream, base: str) -> Any:
    # mcp_list_ttl=0: every request lists afresh, so a test's redirect is met whatever ran before.
    return gateway(
        upstream,
        mcp_allow=(f"{base}/mcp",),
        mcp_list_ttl=0,
        max_retained_bytes=4 * 1048576,
        tool_timeout=5.0,
    )


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=30)


def test_the_site_works_without_redirects(upstream: MockUpstream, site: tuple[Site, str]) -> None:
    """The control: the same set-up with no redirect runs the call on the allowed server."""
    s, base = site
    upstream.push(fc_reply(FC("call_1", "lookup", '{"q":"a"}')), final_reply())
    with site_gateway(upstream, base) as (url, _):
        r = post(url, {"model": "m", "input": "x", "tools": [declared(base)]})
    assert r.status_code == 200 and r.json()["status"] == "completed"
    assert s.probe.names() == ["lookup"]
    assert s.admin.requests == 0


@pytest.mark.parametrize("status", REDIRECTS)
def test_a_redirected_handshake_is_mcp_server_unavailable_and_never_followed(
    upstream: MockUpstream, site: tuple[Site, str], status: int
) -> None:
    s, base = site
    s.redirector.status = status
    s.redirector.methods = {"server/discover", "initialize"}  # the handshake, either era
    with site_gateway(upstream, base) as (url, _):
        r = post(url, {"model": "m", "input": "x", "tools": [declared(base)]})
    assert s.redirector.redirected >= 1
    assert s.admin.requests == 0
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "mcp_server_unavailable"
    assert f"HTTP {status}" in error["message"] and "redirects are not followed" in error["message"]
    assert upstream.requests == []


@pytest.mark.parametrize("status", REDIRECTS)
def test_a_redirected_tools_list_is_mcp_server_unavailable_and_never_followed(
    upstream: MockUpstream, site: tuple[Site, str], status: int
) -> None:
    """The handshake is answered, only ``tools/list`` is redirected (on an established session)."""
    s, base = site
    s.redirector.status = status
    s.redirector.methods = {"tools/list"}
    with site_gateway(upstream, base) as (url, _):
        r = post(url, {"model": "m", "input": "x", "tools": [declared(base)]})
    assert s.redirector.redirected >= 1
    assert s.admin.requests == 0
    assert r.status_code == 502 and r.json()["error"]["code"] == "mcp_server_unavailable"
    assert f"HTTP {status}" in r.json()["error"]["message"]


@pytest.mark.parametrize("status", REDIRECTS)
def test_a_redirected_tools_call_is_a_tool_error_fed_back_to_the_model(
    upstream: MockUpstream, site: tuple[Site, str], status: int
) -> None:
    s, base = site
    s.redirector.status = status
    s.redirector.methods = {"tools/call"}
    upstream.push(fc_reply(FC("call_1", "lookup", '{"q":"a"}')), final_reply())
    with site_gateway(upstream, base) as (url, _):
        r = post(url, {"model": "m", "input": "x", "tools": [declared(base)]})
    assert s.admin.requests == 0
    assert s.admin_probe.names() == [] and s.probe.names() == []
    assert r.status_code == 200 and r.json()["status"] == "completed"
    fed_back = outputs_sent(upstream, 1)["call_1"]
    assert fed_back.startswith("<error:")
    assert f"HTTP {status}" in fed_back and "redirects are not followed" in fed_back
    [call] = [item for item in r.json()["output"] if item["type"] == "mcp_call"]
    assert call["error"]["content"][0]["text"] == fed_back
    assert s.redirector.redirected == 1  # not sent again: it may have run


def test_a_redirected_get_stream_is_never_followed(upstream: MockUpstream, site: tuple[Site, str]) -> None:
    """The standalone GET stream (server-to-client messages, handshake era only), which the SDK
    itself follows within the origin whatever the redirect status."""
    s, base = site
    s.redirector.status = 302
    s.redirector.get = s.redirector.legacy = True
    upstream.push(fc_reply(FC("call_1", "lookup", '{"q":"a"}')), final_reply())
    with site_gateway(upstream, base) as (url, _):
        r = post(url, {"model": "m", "input": "x", "tools": [declared(base)]})
        deadline = time.monotonic() + 5
        while s.redirector.gets == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # time for a followed redirect to arrive
    assert r.status_code == 200 and r.json()["status"] == "completed"
    assert s.redirector.gets >= 1
    assert s.admin.requests == 0
    assert s.probe.names() == ["lookup"]


@pytest.mark.parametrize(
    "path",
    [
        "/mcp/..%2Fadmin/mcp",
        "/mcp/..;/admin/mcp",
        "/mcp/%2e%2e/admin/mcp",
        "/mcp/..%5Cadmin/mcp",
        "/mcp/%252e%252e/admin/mcp",
    ],
)
def test_a_refused_server_url_opens_no_connection(upstream: MockUpstream, path: str) -> None:
    """The allowlist refuses before any request: the listening socket never sees a connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        tool = {**declared(base), "server_url": base + path}
        with gateway(upstream, mcp_allow=(f"{base}/mcp",), upstream_connect_timeout=0.5) as (url, _):
            r = post(url, {"model": "m", "input": "x", "tools": [tool]})
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            connected = False
        else:
            connection.close()
            connected = True
    assert not connected, f"the gateway connected to the refused {path}"
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "mcp_server_not_allowed"
    assert upstream.requests == []
