"""The gateway ASGI application: routes, lifespan, and the middleware stack.

`create_app(settings)` returns a Starlette app serving ``POST /v1/responses`` (buffered and
``"stream": true``; `ResponsesApp` wrapped in `BudgetMiddleware`), its WebSocket mode (``GET
/v1/responses`` with an upgrade: `middleware.asgi.websocket`, each turn through the same guard),
``POST /v1/responses/compact`` (`middleware.loop.compact.CompactApp`, behind the same guard), the store routes
(`middleware.store.routes`: ``/v1/responses/{id}``, ``/input_items``, ``/cancel``,
``/v1/conversations…``), background responses (`middleware.loop.background`: their tasks are
drained in the lifespan's shutdown, before the store closes),
``GET /v1/models``, ``GET /healthz``, ``GET /readyz`` and ``GET /metrics``; every failure of a
plain route, an unknown path (404) and a wrong method (405, with ``Allow``) is answered by
`middleware.outcomes`. The upstream HTTP client is created in the lifespan (one per process). Without
``settings.upstream`` the lifespan starts the embedded development model (`middleware.dev.devmodel`)
on a loopback port and uses it as the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from budget import ChargeModel
from middleware import outcomes
from middleware.asgi.auth import Authenticator
from middleware.asgi.guard import BudgetMiddleware
from middleware.asgi.models import ModelRouter
from middleware.asgi.validate import validate_compact_request
from middleware.asgi.websocket import WebSocketConfig, WebSocketResponses
from middleware.config import DIALECT_SETTINGS, Settings
from middleware.dev.embedded import BackgroundServer
from middleware.errors import Failure, MethodNotAllowed, UnknownRoute
from middleware.loop.app import ResponsesApp
from middleware.loop.background import BackgroundTasks
from middleware.loop.compact import CompactApp
from middleware.loop.compaction import CompactionSeal
from middleware.ops import metrics
from middleware.ops.admission import (
    DRAIN,
    ProcessPool,
    default_pool_bytes,
    install_drain_hook,
    memory_pressure,
)
from middleware.ops.redact import register_secret
from middleware.ops.request_id import REQUEST_ID, RequestIdMiddleware, request_id_of
from middleware.ops.shield import RetryShield
from middleware.state import GatewayState
from middleware.store.reads import StoreReads
from middleware.store.routes import store_routes
from middleware.store.store import Store, open_store
from middleware.tools import McpServerConfig, PoolLimits, ToolCatalog
from middleware.upstream.aiohttp_client import AiohttpUpstream
from middleware.upstream.chat import ChatDialect, ChatUpstream
from middleware.upstream.errors import UpstreamBodyTooLarge, read_limited, status_failure
from middleware.upstream.httpx_client import HttpxUpstream
from middleware.upstream.protocol import UpstreamClient

log = logging.getLogger("loopwarden")


def freeze_startup_objects() -> None:
    """After start-up, in a gateway served from the main thread (``loopwarden serve``): collect
    once, then move everything alive (modules, the SDKs, pydantic models, the app) out of the
    collector's generations (`gc.freeze`), so that the full collections request garbage triggers
    no longer walk them: p99 at 16 concurrent requests fell from ~100 ms to 18-31 ms in the
    measurement of issue 21 (``../shared/reviews/performance.md`` §7). A gateway served from
    another thread (the tests' `BackgroundServer`) leaves its host process's collector alone."""
    if threading.current_thread() is threading.main_thread():
        gc.collect()
        gc.freeze()


def failure_response(exc: BaseException) -> Response:
    """Any failure of a plain route as its `middleware.outcomes` answer (counted and logged)."""
    outcome = outcomes.resolve(exc)
    outcomes.record(outcome)
    status, headers, body = outcomes.render_json(outcome)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})


async def failure_handler(request: Request, exc: Exception) -> Response:
    """Starlette exception handler: a `Failure` raised by a plain route (e.g. 401), or an
    unexpected exception (500 ``internal_error``, through the same table)."""
    return failure_response(exc)


#: Appended to the 405 of a plain ``GET /v1/responses`` (WebSocket mode is a GET with an upgrade).
WEBSOCKET_HINT = (
    "; create a response with POST, or open WebSocket mode with a GET that carries the WebSocket "
    "upgrade (Connection: Upgrade, Upgrade: websocket; e.g. ws://HOST/v1/responses)"
)


async def route_error_response(request: Request, exc: Exception) -> Response:
    """Unknown paths (404 ``unknown_url``) and wrong methods (405 with ``Allow``)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        allow = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "")
        message = f"{request.method} is not allowed on {request.url.path}"
        if request.url.path == "/v1/responses" and request.method == "GET":
            message += WEBSOCKET_HINT
        return failure_response(MethodNotAllowed(message, allow=allow))
    return failure_response(UnknownRoute(f"no route {request.url.path}"))


#: The message of a Chat Completions (or legacy Completions) request: what the gateway serves instead.
CHAT_COMPLETIONS_MESSAGE = (
    "loopwarden serves the OpenAI Responses API (POST /v1/responses), not {path}: configure the "
    'client for the Responses API (openai SDK: client.responses.create; Codex: wire_api = "responses"; '
    "LangChain: use_responses_api=True)"
)


#: The Chat Completions paths a misconfigured client may call.
CHAT_COMPLETIONS_PATHS = ("/v1/chat/completions", "/v1/completions")


async def chat_completions_not_served(request: Request) -> Response:
    """``/v1/chat/completions`` and ``/v1/completions``: 404 ``unknown_url`` for every method, whose
    message says that the gateway serves the Responses API and how to point a client at it."""
    return failure_response(UnknownRoute(CHAT_COMPLETIONS_MESSAGE.format(path=request.url.path)))


async def passthrough_models(upstream: UpstreamClient) -> Response:
    """The upstream's ``GET /models`` answer (read up to 1 MiB); raises upstream failures."""
    response = await upstream.get("/models")
    try:
        if response.status_code >= 400:
            raise status_failure(response.status_code, await read_limited(response), response.headers)
        body = b""
        async for chunk in response.chunks():
            body += chunk
            if len(body) > 1 << 20:
                raise UpstreamBodyTooLarge(
                    "the upstream's model list is over 1 MiB", size=len(body), clamp=1 << 20
                )
    finally:
        await response.aclose()
    return Response(body, status_code=200, media_type="application/json")


async def healthz(request: Request) -> Response:
    """Liveness: 200 ``{"status": "ok"}`` while the process serves."""
    return JSONResponse({"status": "ok"})


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus text exposition (aggregated over workers in multiprocess mode)."""
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def default_upstream(settings: Settings, base_url: str) -> UpstreamClient:
    """The production upstream client configured from `settings`: `AiohttpUpstream` (default) or
    `HttpxUpstream` (``upstream_client: httpx``)."""
    client = AiohttpUpstream if settings.upstream.client == "aiohttp" else HttpxUpstream
    return client(
        base_url,
        api_key=settings.upstream.api_key,
        connect_timeout=settings.upstream.connect_timeout,
        read_timeout=settings.upstream.read_timeout,
        deadline=settings.upstream.deadline,
        max_connections=settings.upstream.max_connections,
    )


def devmodel_protocol(settings: Settings) -> Callable[..., asyncio.Protocol]:
    """The HTTP protocol the embedded development model's uvicorn serves with: the bounded h11
    protocol (`middleware.ops.connections.protocol_factory`), so that its writes to a connection
    the gateway closed (a cancelled background task, a client gone mid-stream) are dropped and
    counted in ``loopwarden_dropped_writes_total`` like the gateway's own, not a burst of
    asyncio's ``socket.send() raised exception.`` warnings. Its only client is the gateway's
    upstream pool: at most ``--upstream-max-connections`` per pool."""
    from middleware.ops.connections import ConnectionBounds, protocol_factory

    pools = 1 + len(settings.model_routes)
    bounds = ConnectionBounds(
        header_timeout=settings.transport.header_timeout,
        max_connections=settings.upstream.max_connections * pools,
        max_header_bytes=settings.transport.max_header_bytes,
        write_timeout=settings.transport.client_write_timeout,
    )
    return protocol_factory("h11", bounds)


def build_catalog(settings: Settings, *, demo: bool = False) -> ToolCatalog:
    """The process's MCP `ToolCatalog`: ``--mcp-server LABEL=URL`` entries, the ``--mcp-allow``
    prefixes, and (``demo``) the in-process demo server under the label ``demo``."""
    servers = []
    for entry in settings.tools.mcp_server:
        label, _, url = entry.partition("=")
        servers.append(McpServerConfig(label=label, url=url))
    if demo and not any(server.label == "demo" for server in servers):
        from middleware.dev.demo_tools import create_demo_server

        servers.append(McpServerConfig(label="demo", app=create_demo_server()))
    return ToolCatalog(
        servers,
        allow_prefixes=settings.tools.mcp_allow,
        list_ttl=settings.tools.mcp_list_ttl,
        list_cache_bytes=settings.tools.mcp_list_cache_bytes,
        connect_timeout=settings.upstream.connect_timeout,
        pool_limits=PoolLimits(
            idle_timeout=settings.tools.mcp_session_idle_timeout,
            max_idle_per_server=settings.tools.mcp_idle_sessions_per_server,
        ),
    )


def register_secrets(settings: Settings, keys: list[str], compact_key: bytes | None) -> None:
    """Register every configured secret (the upstream keys, per route too, the gateway API `keys`
    and the compaction key) with `middleware.ops.redact`, so that no log line or error message
    carries one."""
    routed = (r.upstream_api_key for r in settings.model_routes)
    for secret in (settings.upstream.api_key, *keys, *routed, compact_key.decode() if compact_key else None):
        register_secret(secret)


def build_pool(settings: Settings, pressure_source: Callable[[], float]) -> ProcessPool:
    """The worker's admission `ProcessPool` (budget bytes: ``max_inflight_retained_bytes``, else
    `default_pool_bytes`); logs a warning when one caller's share is under ``max_retained_bytes``,
    so that a request without Content-Length would always be refused (413)."""
    pool = ProcessPool(
        settings.admission.max_inflight_retained_bytes or default_pool_bytes(settings.transport.workers),
        max_requests=settings.admission.max_concurrent_requests,
        max_share_per_caller=settings.admission.max_inflight_share_per_caller,
        pressure=pressure_source,
        pressure_threshold=settings.admission.memory_pressure_threshold,
    )
    if pool.caller_cap < settings.loop.max_retained_bytes <= pool.budget:
        log.warning(
            "one caller's share of the pool (%d budget bytes: --max-inflight-share-per-caller=%g of %d) is "
            "under max_retained_bytes=%d: a request without Content-Length reserves max_retained_bytes and "
            "will be refused (413); raise --max-inflight-retained-bytes or the share",
            pool.caller_cap,
            pool.share,
            pool.budget,
            settings.loop.max_retained_bytes,
        )
    return pool


def log_charge_model(settings: Settings) -> None:
    """Log the charge model and the two clamps it gives ``max_retained_bytes`` (bytes)."""
    model = ChargeModel.named(settings.loop.charge_model)
    limit = settings.loop.max_retained_bytes
    log.info(
        "charge model %s: raw body clamp %d bytes, buffered upstream clamp %d bytes (max_retained_bytes=%d)",
        model.name,
        model.body_clamp(limit),
        model.upstream_clamp(limit),
        limit,
    )


async def start_devmodel(settings: Settings) -> tuple[BackgroundServer, str]:
    """Start the embedded development model on a loopback port; returns it and its base URL
    (``http://127.0.0.1:PORT/v1``). Logs a warning that it is a scripted stand-in."""
    from middleware.dev.devmodel import create_devmodel_app
    from middleware.ops.request_id import DEVMODEL_THREAD

    # its uvicorn logs from this thread: `DevModelFilter` keeps its lifecycle and access lines out
    # of the gateway's log (the warning below says it is there, once)
    devmodel = BackgroundServer(
        create_devmodel_app(), thread_name=DEVMODEL_THREAD, http=devmodel_protocol(settings)
    )
    base_url = (await asyncio.to_thread(devmodel.start)) + "/v1"
    log.warning(
        "no --upstream given: serving the embedded development model at %s "
        "(a scripted stand-in, not a real model; pass --upstream URL for vLLM, SGLang or OpenAI)",
        base_url,
    )
    return devmodel, base_url


def speaking(settings: Settings, client: UpstreamClient) -> UpstreamClient:
    """`client` as the loop calls it: itself for ``upstream_api: responses``, wrapped in a
    `ChatUpstream` with the settings' `ChatDialect` for ``upstream_api: chat``."""
    if settings.upstream.api != "chat":
        return client
    group = settings.upstream  # settings: group
    dialect = ChatDialect(**{field: getattr(group, field) for field in DIALECT_SETTINGS})
    return ChatUpstream(client, dialect)


#: The upstream settings a model route may override (None: the server-wide value).
ROUTE_UPSTREAM_FIELDS = (
    "upstream_api_key",
    "upstream_connect_timeout",
    "upstream_read_timeout",
    "upstream_deadline",
    "upstream_api",
    *DIALECT_SETTINGS,
)


def open_upstreams(
    state: GatewayState, base_url: str, factory: Callable[[Settings, str], UpstreamClient]
) -> None:
    """Create the default upstream client at `base_url` and one per model route that has its own
    URL or overrides one of `ROUTE_UPSTREAM_FIELDS`; record every route's base URL."""
    settings = state.settings
    state.upstream = speaking(settings, factory(settings, base_url))
    state.upstream_urls[""] = base_url
    for route in settings.model_routes:
        state.upstream_urls[route.name] = route.upstream or base_url
        overrides = {
            field: getattr(route, field)
            for field in ROUTE_UPSTREAM_FIELDS
            if getattr(route, field) is not None
        }
        if route.upstream is not None or overrides:
            routed = settings.replace(**overrides)
            state.upstreams[route.name] = speaking(routed, factory(routed, route.upstream or base_url))


async def close_process_objects(state: GatewayState, devmodel: BackgroundServer | None) -> None:
    """Close what the lifespan opened, in order: pooled MCP sessions (HTTP DELETE, stdio process
    exits), the store, the upstream clients, the embedded model; then mark the worker exited."""
    assert state.catalog is not None and state.store is not None and state.upstream is not None
    await state.catalog.aclose()
    await state.store.close()
    await state.upstream.aclose()
    for client in state.upstreams.values():
        await client.aclose()
    if devmodel is not None:
        await asyncio.to_thread(devmodel.stop)
    metrics.worker_exited()


def gateway_lifespan(
    state: GatewayState,
    background: BackgroundTasks,
    upstream_factory: Callable[[Settings, str], UpstreamClient],
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: starts the upstream clients (the embedded model without
    ``settings.upstream``), the tool catalog, the store and the background tasks; on shutdown it
    drains the background tasks while the store is still open, then closes the rest."""
    settings = state.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        devmodel: BackgroundServer | None = None
        log_charge_model(settings)
        base_url = settings.upstream.url
        if base_url is None:
            devmodel, base_url = await start_devmodel(settings)
        open_upstreams(state, base_url, upstream_factory)
        state.catalog = build_catalog(settings, demo=devmodel is not None)
        state.store = open_store(settings.store.url)
        await state.store.open()
        metrics.publish_resident_memory(baseline=True)  # before any request: the gateway's own RSS
        freeze_startup_objects()
        await background.start()
        try:
            yield
        finally:
            await background.close()  # drains the background tasks while the store is open
            await close_process_objects(state, devmodel)

    return lifespan


@dataclasses.dataclass(frozen=True)
class GatewayParts:
    """The process objects every request route shares: the settings, the API-key `authenticator`,
    the model `router`, the admission `pool` and the `state`; builds the guarded apps and the
    store reads from them."""

    settings: Settings
    authenticator: Authenticator
    router: ModelRouter
    pool: ProcessPool
    state: GatewayState

    def guarded(self, app: Any, **body: Any) -> BudgetMiddleware:
        """`app` behind the guard: the clamps, ledger, admission and outcome table of create;
        `body` are further `BudgetMiddleware` keywords (background, shield, validate, create)."""
        settings = self.settings
        return BudgetMiddleware(
            app,
            limits=settings.limits,
            client_body_timeout=settings.transport.client_body_timeout,
            authenticator=self.authenticator,
            router=self.router,
            pool=self.pool,
            request_deadline=settings.loop.request_deadline,
            retry_after=settings.admission.retry_after,
            keepalive_interval=settings.transport.keepalive_interval,
            client_write_timeout=settings.transport.client_write_timeout,
            charge_model=ChargeModel.named(settings.loop.charge_model),
            **body,
        )

    def websocket(self, responses: BudgetMiddleware) -> WebSocketResponses:
        """WebSocket mode (`middleware.asgi.websocket`): each turn through the create guard `responses`."""
        settings = self.settings
        config = WebSocketConfig(
            limits=settings.limits,
            authenticator=self.authenticator,
            pool=self.pool,
            charge_model=ChargeModel.named(settings.loop.charge_model),
            max_lifetime=settings.websocket.max_lifetime,
            idle_timeout=settings.websocket.idle_timeout,
            write_timeout=settings.transport.client_write_timeout,
            keepalive_interval=settings.transport.keepalive_interval,
            retry_after=settings.admission.retry_after,
        )
        return WebSocketResponses(responses, config)

    def store_reads(self) -> StoreReads:
        """The admission ladder of the store routes' reads (`middleware.store.reads`)."""
        settings = self.settings
        return StoreReads(
            limits=settings.limits,
            pool=self.pool,
            retry_after=settings.admission.retry_after,
            model=ChargeModel.named(settings.loop.charge_model),
            caller_of=self.authenticator.caller,
            client_body_timeout=settings.transport.client_body_timeout,
        )

    def get_store(self) -> Store:
        """The open store (the lifespan opens it before the first request)."""
        assert self.state.store is not None, "the lifespan opens the store"
        return self.state.store

    def owner_of(self, request: Request) -> str:
        """The store owner of `request` (its API key's owner); raises the 401 `Failure`."""
        return self.authenticator.owner(request.scope)


def models_endpoint(parts: GatewayParts) -> Callable[[Request], Awaitable[Response]]:
    """``GET /v1/models``: the configured model routes, else the default upstream's own list."""

    async def list_models(request: Request) -> Response:
        parts.authenticator.owner(request.scope)
        if parts.router.configured:
            data = [
                {"id": r.name, "object": "model", "created": 0, "owned_by": "loopwarden"}
                for r in parts.router.routes
            ]
            return JSONResponse({"object": "list", "data": data})
        assert parts.state.upstream is not None
        return await passthrough_models(parts.state.upstream)

    return list_models


def readyz_endpoint(pool: ProcessPool) -> Callable[[Request], Awaitable[Response]]:
    """``GET /readyz``: 503 while draining or saturated (pool, concurrency or memory pressure)."""

    async def readyz(request: Request) -> Response:
        if DRAIN.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if pool.saturated:
            return JSONResponse({"status": "saturated"}, status_code=503)
        return JSONResponse({"status": "ready"})

    return readyz


def build_routes(parts: GatewayParts, background: BackgroundTasks) -> list[Any]:
    """Every route of the gateway: create (HTTP and WebSocket), compact, the Chat Completions
    refusals, the store routes, health, readiness, models and metrics."""
    settings = parts.settings
    shield = RetryShield(
        seconds=settings.shield.seconds,
        max_entries=settings.shield.max_entries,
        max_bytes=settings.shield.max_bytes,
        pool=parts.pool,
    )
    responses = parts.guarded(background.app, background=background, shield=shield)
    compact = parts.guarded(
        CompactApp(parts.state), validate=validate_compact_request, create=False
    )  # issue 24
    any_method = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    return [
        Route("/v1/responses", responses, methods=["POST"]),
        WebSocketRoute("/v1/responses", parts.websocket(responses)),  # WebSocket mode
        Route("/v1/responses/compact", compact, methods=["POST"]),
        *(Route(path, chat_completions_not_served, methods=any_method) for path in CHAT_COMPLETIONS_PATHS),
        *store_routes(parts.get_store, parts.owner_of, reads=parts.store_reads(), background=background),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz_endpoint(parts.pool), methods=["GET"]),
        Route("/v1/models", models_endpoint(parts), methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/metrics/", metrics_endpoint, methods=["GET"]),
    ]


#: Starlette exception handlers: every failure of a plain route through `middleware.outcomes`.
EXCEPTION_HANDLERS: dict[Any, Any] = {
    Failure: failure_handler,
    Exception: failure_handler,  # a defect: 500 internal_error (Starlette logs and re-raises it)
    404: route_error_response,
    405: route_error_response,
}


class GatewayApp(Starlette):
    """The gateway's Starlette app, with one shortcut: ``POST /v1/responses`` (the request every
    client sends, and every streamed event's ``send``) goes from the outermost layer straight to
    its route's app, with no wrapper around ``send``: the request id is set here (its header is
    added by the route's `ClientStream`, the one writer of its answers), and a defect that
    escapes the guard (which settles every failure itself) is answered here as Starlette's
    `ServerErrorMiddleware` answers any route's (a 500 through `failure_handler`, when nothing
    was sent yet; then re-raised for the server to log). Any other request, a WebSocket upgrade,
    a ``root_path`` deployment and the lifespan go through Starlette as usual. ``responses``:
    that route's app."""

    def __init__(self, *, responses: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._responses = responses

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != "/v1/responses"
            or scope["method"] != "POST"
            or scope.get("root_path")
        ):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        rid = request_id_of(scope)
        token = REQUEST_ID.set(rid)
        try:
            await self._responses(scope, receive, send)
        except Exception as exc:
            response = await failure_handler(Request(scope), exc)
            response.headers["x-request-id"] = rid
            # refused by the server when the answer began already: then it is cut, as Starlette does
            with contextlib.suppress(Exception):
                await response(scope, receive, send)
            raise
        finally:
            REQUEST_ID.reset(token)


def create_app(
    settings: Settings,
    *,
    upstream_factory: Callable[[Settings, str], UpstreamClient] = default_upstream,
    pressure_source: Callable[[], float] = memory_pressure,
) -> GatewayApp:
    """Build the gateway app for `settings`.

    `upstream_factory(settings, base_url)` makes the upstream client (default `default_upstream`);
    `pressure_source()` reports used/allowed memory for the admission safety net. Raises
    `SettingsError` when a key file cannot be read.
    """
    state = GatewayState(settings=settings)
    compact_key = settings.compact_key()
    state.seal = CompactionSeal(compact_key)
    keys = settings.api_keys()
    register_secrets(settings, keys, compact_key)
    state.pool = build_pool(settings, pressure_source)
    parts = GatewayParts(settings, Authenticator(keys), ModelRouter(settings.model_routes), state.pool, state)
    background = BackgroundTasks(ResponsesApp(state), parts.get_store, settings)
    routes = build_routes(parts, background)
    create = routes[0]  # Route("/v1/responses", POST): the guarded create
    assert isinstance(create, Route) and create.path == "/v1/responses", create
    return GatewayApp(
        responses=create.app,
        routes=routes,
        lifespan=gateway_lifespan(state, background, upstream_factory),
        exception_handlers=dict(EXCEPTION_HANDLERS),
        middleware=[Middleware(RequestIdMiddleware)],
    )


def create_app_from_env() -> GatewayApp:
    """Factory for uvicorn workers: the settings come from the environment (`Settings.to_env`)."""
    settings = Settings.from_env_json()
    install_drain_hook(settings.transport.drain_timeout)
    return create_app(settings)
