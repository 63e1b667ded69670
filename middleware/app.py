"""The gateway ASGI application: routes, lifespan and the ``POST /v1/responses`` endpoint.

`create_app(settings)` returns a Starlette app serving ``POST /v1/responses`` (buffered and
``"stream": true``), ``GET /healthz`` and ``GET /metrics``. The upstream HTTP client is created in
the lifespan (one per process). Without ``settings.upstream`` the lifespan starts the embedded
development model (`middleware.devmodel`) on a loopback port and uses it as the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from middleware import metrics
from middleware.config import Settings
from middleware.embedded import BackgroundServer
from middleware.errors import (
    GatewayError,
    InvalidRequest,
    envelope_bytes,
    error_headers,
    sse_error_frame,
)
from middleware.sse import KEEPALIVE, SSEParser, encode_event
from middleware.upstream import (
    HttpxUpstream,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
)

log = logging.getLogger("loopwarden")

# Upstream error bodies are read only this far (bytes) to build the normalised envelope.
ERROR_BODY_LIMIT = 64 * 1024
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclasses.dataclass
class GatewayState:
    """Process-wide state, created in the lifespan: the settings and the upstream client."""

    settings: Settings
    upstream: UpstreamClient | None = None


def _upstream_status_error(status: int, body: bytes) -> GatewayError:
    """Normalise an upstream HTTP error answer into the §5 outcome (status, code, message)."""
    message, code, param = f"upstream answered HTTP {status}", None, None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
        text = body[:500].decode("utf-8", "replace").strip()
        if text:
            message = f"{message}: {text}"
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        if isinstance(err, dict):
            if isinstance(err.get("message"), str):
                message = err["message"]
            raw_code = err.get("code") or err.get("type")
            code = raw_code if isinstance(raw_code, str) else None
            param = err.get("param") if isinstance(err.get("param"), str) else None
        elif isinstance(err, str):
            message = err
    if status in (401, 403):
        return GatewayError(
            f"the upstream refused the gateway's credentials (HTTP {status}): {message}; "
            "check --upstream-api-key",
            status=502,
            code="upstream_auth_failed",
        )
    if status >= 500:
        return GatewayError(message, status=502, code=code or "upstream_error")
    if status in (400, 404, 409, 422, 429):
        return GatewayError(
            message, status=status, code=code or "upstream_error", param=param, retryable=status in (409, 429)
        )
    return GatewayError(message, status=502, code=code or "upstream_error")


class ResponsesEndpoint:
    """Pure ASGI endpoint for ``POST /v1/responses``; per-request work lives in `_Responder`."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # pragma: no cover - routed only for http
            return
        await _Responder(self.state, scope, receive, send).run()


class _Responder:
    """One client request: read the body, call upstream, answer once (JSON or SSE)."""

    def __init__(self, state: GatewayState, scope: Scope, receive: Receive, send: Send) -> None:
        self.state = state
        self.scope = scope
        self.receive = receive
        self._send = send
        self.committed = False  # response headers sent
        self.finished = False  # the last body message sent
        self.sequence = 0  # next SSE sequence_number the client would see
        self.status = 500
        self.model: object = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.committed = True
            self.status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def run(self) -> None:
        metrics.INFLIGHT.inc()
        try:
            await self._run()
        finally:
            metrics.INFLIGHT.dec()
            metrics.REQUESTS.labels(status=str(self.status), model=metrics.model_label(self.model)).inc()

    async def _run(self) -> None:
        try:
            body = await self._read_body()
        except _ClientGone:
            metrics.CLIENT_DISCONNECTS.inc()
            self.status = 499
            return
        work = asyncio.ensure_future(self._handle_with_outcome(body))
        watcher = asyncio.ensure_future(self._watch_disconnect())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                metrics.CLIENT_DISCONNECTS.inc()
                if not self.committed:
                    self.status = 499
            watcher.cancel()
            for task in (work, watcher):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _read_body(self) -> bytes:
        parts: list[bytes] = []
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return

    async def _handle_with_outcome(self, body: bytes) -> None:
        """The outcome authority: whatever fails becomes exactly one answer."""
        try:
            await self._handle(body)
        except GatewayError as error:
            await self._fail(error)
        except UpstreamError as exc:
            metrics.UPSTREAM_ERRORS.labels(kind=exc.kind).inc()
            status = 504 if exc.code == "upstream_timeout" else 502
            await self._fail(GatewayError(exc.message, status=status, code=exc.code))

    async def _fail(self, error: GatewayError) -> None:
        if self.finished:
            return
        if not self.committed:
            body = envelope_bytes(error)
            headers = error_headers(error, extra=[(b"content-length", str(len(body)).encode())])
            await self.send({"type": "http.response.start", "status": error.status, "headers": headers})
            await self.send({"type": "http.response.body", "body": body})
            return
        metrics.STREAM_ERRORS.labels(code=error.code).inc()
        await self.send(
            {"type": "http.response.body", "body": sse_error_frame(error, self.sequence), "more_body": False}
        )

    async def _handle(self, body: bytes) -> None:
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            raise InvalidRequest("request body is not valid JSON", code="invalid_json") from None
        if not isinstance(request, dict):
            raise InvalidRequest("request body must be a JSON object", code="invalid_request")
        self.model = request.get("model")
        stream = request.get("stream") is True
        assert self.state.upstream is not None
        response = await self.state.upstream.post("/responses", body, stream=stream)
        try:
            if response.status_code >= 400:
                raise _upstream_status_error(
                    response.status_code, await _read_limited(response, ERROR_BODY_LIMIT)
                )
            is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
            if stream and is_sse:
                await self._forward_stream(response)
            elif is_sse:
                await self._answer_json(await self._aggregate_stream(response))
            else:
                raw = b"".join([c async for c in response.chunks()])
                try:
                    json.loads(raw)
                except ValueError:
                    raise GatewayError(
                        "upstream answered with a body that is not JSON",
                        status=502,
                        code="upstream_invalid_response",
                    ) from None
                await self._answer_json(raw, status=response.status_code)
        finally:
            await response.aclose()

    async def _answer_json(self, raw: bytes, status: int = 200) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": raw})

    async def _events(self, response: UpstreamResponse) -> AsyncIterator[tuple[str, str]]:
        """Upstream SSE events as (type, data), with keep-alive comments while waiting after commit."""
        parser = SSEParser()
        chunks = response.chunks()
        interval = self.state.settings.keepalive_interval
        next_chunk: asyncio.Future[bytes] | None = None
        try:
            while True:
                next_chunk = asyncio.ensure_future(anext(chunks))
                while True:
                    done, _ = await asyncio.wait({next_chunk}, timeout=interval if self.committed else None)
                    if done:
                        break
                    await self.send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                try:
                    chunk = next_chunk.result()
                except StopAsyncIteration:
                    break
                finally:
                    next_chunk = None
                for event in parser.feed(chunk):
                    yield _event_type(event.event, event.data), event.data
        finally:
            if next_chunk is not None:
                next_chunk.cancel()
                with contextlib.suppress(BaseException):
                    await next_chunk
            with contextlib.suppress(Exception):
                await chunks.aclose()  # type: ignore[attr-defined]

    async def _forward_stream(self, response: UpstreamResponse) -> None:
        terminal = False
        async for event_type, data in self._events(response):
            if not self.committed:
                await self.send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"),
                        ],
                    }
                )
            self.sequence += 1
            await self.send(
                {"type": "http.response.body", "body": encode_event(event_type, data), "more_body": True}
            )
            if event_type in TERMINAL_EVENTS or event_type == "error":
                terminal = True
                break
        if not terminal:
            raise GatewayError(
                "upstream stream ended without a terminal event", status=502, code="upstream_incomplete"
            )
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _aggregate_stream(self, response: UpstreamResponse) -> bytes:
        """A buffered client call answered with SSE: the terminal event's response object."""
        async for event_type, data in self._events(response):
            if event_type in TERMINAL_EVENTS:
                try:
                    payload = json.loads(data)
                except ValueError:
                    break
                if isinstance(payload, dict) and isinstance(payload.get("response"), dict):
                    return json.dumps(payload["response"], separators=(",", ":")).encode()
                break
        raise GatewayError(
            "upstream stream ended without a terminal event", status=502, code="upstream_incomplete"
        )


def _event_type(name: str, data: str) -> str:
    """The event's type: the JSON ``type`` field (some servers send no ``event:`` line), else its name."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return name
    kind = parsed.get("type") if isinstance(parsed, dict) else None
    return kind if isinstance(kind, str) else name


class _ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def _read_limited(response: UpstreamResponse, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in response.chunks():
        parts.append(chunk[: limit - size])
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)


async def healthz(request: Request) -> Response:
    """Liveness: 200 ``{"status": "ok"}`` while the process serves."""
    return JSONResponse({"status": "ok"})


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus text exposition of the process registry."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def create_app(
    settings: Settings,
    *,
    upstream_factory: Callable[[Settings, str], UpstreamClient] | None = None,
) -> Starlette:
    """Build the gateway app for `settings`.

    `upstream_factory(settings, base_url)` makes the upstream client (default: `HttpxUpstream`).
    """
    state = GatewayState(settings=settings)

    def default_factory(s: Settings, base_url: str) -> UpstreamClient:
        return HttpxUpstream(
            base_url,
            api_key=s.upstream_api_key,
            connect_timeout=s.upstream_connect_timeout,
            read_timeout=s.upstream_read_timeout,
            deadline=s.upstream_deadline,
            max_connections=s.upstream_max_connections,
        )

    factory = upstream_factory or default_factory

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        devmodel: BackgroundServer | None = None
        base_url = settings.upstream
        if base_url is None:
            from middleware.devmodel import create_devmodel_app

            devmodel = BackgroundServer(create_devmodel_app())
            base_url = (await asyncio.to_thread(devmodel.start)) + "/v1"
            log.warning(
                "no --upstream given: serving the embedded development model at %s "
                "(a scripted stand-in, not a real model; pass --upstream URL for vLLM, SGLang or OpenAI)",
                base_url,
            )
        state.upstream = factory(settings, base_url)
        try:
            yield
        finally:
            await state.upstream.aclose()
            if devmodel is not None:
                await asyncio.to_thread(devmodel.stop)

    routes: list[Any] = [
        Route("/v1/responses", ResponsesEndpoint(state), methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def create_app_from_env() -> Starlette:
    """Factory for uvicorn workers: the settings come from the environment (`Settings.to_env`)."""
    return create_app(Settings.from_env_json())
