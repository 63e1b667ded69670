"""A bare pass-through proxy for ``POST /v1/responses``: the floor a Python gateway can reach.

Usage: ``python bench/proxy_bare.py --client httpx|aiohttp --upstream URL --port PORT``

Starlette (one `Route`, a pure ASGI endpoint, as loopwarden mounts its own) on uvicorn, with one
pooled upstream client per process: httpx (the client loopwarden uses) or aiohttp. It reads the
client body, POSTs it to ``UPSTREAM/responses``, and forwards the status, the content type and the
body bytes as they arrive — no ledger, no parsing, no loop, no store. Everything a gateway does
beyond this is its own cost.

`serve(app, port)` is the uvicorn configuration every ASGI server of the benchmark shares
(asyncio loop, uvicorn's default HTTP implementation, no access log).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

PASS_HEADERS = (b"content-type", b"content-length", b"cache-control")


async def read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client went away")
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


class HttpxForwarder:
    """Pure ASGI endpoint forwarding over one `httpx.AsyncClient` (the gateway's limits)."""

    def __init__(self, upstream: str) -> None:
        import httpx

        self.url = upstream.rstrip("/") + "/responses"
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=10.0),
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=100),
            trust_env=False,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        request = self.client.build_request(
            "POST", self.url, content=body, headers={"content-type": "application/json"}
        )
        response = await self.client.send(request, stream=True)
        try:
            headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() in PASS_HEADERS]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


class AiohttpForwarder:
    """Pure ASGI endpoint forwarding over one `aiohttp.ClientSession`."""

    def __init__(self, upstream: str) -> None:
        self.url = upstream.rstrip("/") + "/responses"
        self.session: Any = None

    async def start(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=100),
            timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=600.0),
            auto_decompress=False,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        async with self.session.post(
            self.url, data=body, headers={"content-type": "application/json"}
        ) as response:
            headers = [(k.lower(), v) for k, v in response.raw_headers if k.lower() in PASS_HEADERS]
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def aclose(self) -> None:
        await self.session.close()


def create_app(upstream: str, client: str) -> Starlette:
    """The bare proxy app for `upstream` (a base URL with ``/v1``) and `client` (httpx | aiohttp)."""
    forwarder: HttpxForwarder | AiohttpForwarder = (
        HttpxForwarder(upstream) if client == "httpx" else AiohttpForwarder(upstream)
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if isinstance(forwarder, AiohttpForwarder):
            await forwarder.start()
        try:
            yield
        finally:
            await forwarder.aclose()

    async def healthz(request: Any) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/responses", forwarder, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


#: The server stack every benchmarked ASGI server runs on: ``h11`` + ``asyncio`` (the issue-8 and
#: issue-21 ratios are taken there), or with ``LOOPWARDEN_BENCH_STACK=fast`` ``httptools`` +
#: ``uvloop`` (``loopwarden serve``'s default). Explicit: uvicorn's ``http="auto"`` silently
#: switches to httptools whenever it is importable.
STACKS = {"h11": ("h11", "asyncio"), "fast": ("httptools", "uvloop")}


def serve(app: Any, port: int, host: str = "127.0.0.1") -> None:
    """Run `app` on uvicorn the way every benchmarked ASGI server runs (TCP_NODELAY socket; the
    stack of `STACKS`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    http, loop = STACKS[os.environ.get("LOOPWARDEN_BENCH_STACK", "h11")]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", http=http, loop=loop, backlog=1024
    )
    uvicorn.Server(config).run(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", choices=("httpx", "aiohttp"), default="aiohttp")
    parser.add_argument("--upstream", required=True, help="base URL including /v1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve(create_app(args.upstream, args.client), args.port)


if __name__ == "__main__":
    main()
