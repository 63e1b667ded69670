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
from collections.abc import AsyncIterator, Callable
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
from middleware.config import Settings
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
from middleware.ops.request_id import RequestIdMiddleware
from middleware.ops.shield import RetryShield
from middleware.state import GatewayState
from middleware.store.reads import StoreReads
from middleware.store.routes import store_routes
from middleware.store.store import Store, open_store
from middleware.tools import McpServerConfig, PoolLimits, ToolCatalog
from middleware.upstream.aiohttp_client import AiohttpUpstream
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


async def route_error_response(request: Request, exc: Exception) -> Response:
    """Unknown paths (404 ``unknown_url``) and wrong methods (405 with ``Allow``)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        allow = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "")
        return failure_response(
            MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}", allow=allow)
        )
    return failure_response(UnknownRoute(f"no route {request.url.path}"))


#: The message of a Chat Completions (or legacy Completions) request: what the gateway serves instead.
CHAT_COMPLETIONS_MESSAGE = (
    "loopwarden serves the OpenAI Responses API (POST /v1/responses), not {path}: configure the "
    'client for the Responses API (openai SDK: client.responses.create; Codex: wire_api = "responses"; '
    "LangChain: use_responses_api=True)"
)


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
    client = AiohttpUpstream if settings.upstream_client == "aiohttp" else HttpxUpstream
    return client(
        base_url,
        api_key=settings.upstream_api_key,
        connect_timeout=settings.upstream_connect_timeout,
        read_timeout=settings.upstream_read_timeout,
        deadline=settings.upstream_deadline,
        max_connections=settings.upstream_max_connections,
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
        header_timeout=settings.header_timeout,
        max_connections=settings.upstream_max_connections * pools,
        max_header_bytes=settings.max_header_bytes,
        write_timeout=settings.client_write_timeout,
    )
    return protocol_factory("h11", bounds)


def build_catalog(settings: Settings, *, demo: bool = False) -> ToolCatalog:
    """The process's MCP `ToolCatalog`: ``--mcp-server LABEL=URL`` entries, the ``--mcp-allow``
    prefixes, and (``demo``) the in-process demo server under the label ``demo``."""
    servers = []
    for entry in settings.mcp_server:
        label, _, url = entry.partition("=")
        servers.append(McpServerConfig(label=label, url=url))
    if demo and not any(server.label == "demo" for server in servers):
        from middleware.dev.demo_tools import create_demo_server

        servers.append(McpServerConfig(label="demo", app=create_demo_server()))
    return ToolCatalog(
        servers,
        allow_prefixes=settings.mcp_allow,
        list_ttl=settings.mcp_list_ttl,
        list_cache_bytes=settings.mcp_list_cache_bytes,
        connect_timeout=settings.upstream_connect_timeout,
        pool_limits=PoolLimits(
            idle_timeout=settings.mcp_session_idle_timeout,
            max_idle_per_server=settings.mcp_idle_sessions_per_server,
        ),
    )


def create_app(
    settings: Settings,
    *,
    upstream_factory: Callable[[Settings, str], UpstreamClient] = default_upstream,
    pressure_source: Callable[[], float] = memory_pressure,
) -> Starlette:
    """Build the gateway app for `settings`.

    `upstream_factory(settings, base_url)` makes the upstream client (default `default_upstream`);
    `pressure_source()` reports used/allowed memory for the admission safety net.
    """
    state = GatewayState(settings=settings)
    compact_key = settings.compact_key()
    state.seal = CompactionSeal(compact_key)
    keys = settings.api_keys()
    authenticator = Authenticator(keys)
    secrets = (settings.upstream_api_key, *keys, *(r.upstream_api_key for r in settings.model_routes))
    for secret in (*secrets, compact_key.decode() if compact_key else None):
        register_secret(secret)
    router = ModelRouter(settings.model_routes)

    async def list_models(request: Request) -> Response:
        """``GET /v1/models``: the configured models, else the default upstream's own list."""
        authenticator.owner(request.scope)
        if router.configured:
            data = [
                {"id": r.name, "object": "model", "created": 0, "owned_by": "loopwarden"}
                for r in router.routes
            ]
            return JSONResponse({"object": "list", "data": data})
        assert state.upstream is not None
        return await passthrough_models(state.upstream)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        devmodel: BackgroundServer | None = None
        base_url = settings.upstream
        model = ChargeModel.named(settings.charge_model)
        limit = settings.max_retained_bytes
        log.info(
            "charge model %s: raw body clamp %d bytes, buffered upstream clamp %d bytes "
            "(max_retained_bytes=%d)",
            model.name,
            model.body_clamp(limit),
            model.upstream_clamp(limit),
            limit,
        )
        if base_url is None:
            from middleware.dev.devmodel import create_devmodel_app
            from middleware.ops.request_id import DEVMODEL_THREAD

            # its uvicorn logs from this thread: `DevModelFilter` keeps its lifecycle and access
            # lines out of the gateway's log (the warning below says it is there, once)
            devmodel = BackgroundServer(
                create_devmodel_app(), thread_name=DEVMODEL_THREAD, http=devmodel_protocol(settings)
            )
            base_url = (await asyncio.to_thread(devmodel.start)) + "/v1"
            log.warning(
                "no --upstream given: serving the embedded development model at %s "
                "(a scripted stand-in, not a real model; pass --upstream URL for vLLM, SGLang or OpenAI)",
                base_url,
            )
        state.upstream = upstream_factory(settings, base_url)
        state.upstream_urls[""] = base_url
        for route in settings.model_routes:
            state.upstream_urls[route.name] = route.upstream or base_url
            overrides = {
                field: getattr(route, field)
                for field in (
                    "upstream_api_key",
                    "upstream_connect_timeout",
                    "upstream_read_timeout",
                    "upstream_deadline",
                )
                if getattr(route, field) is not None
            }
            if route.upstream is not None or overrides:
                routed = dataclasses.replace(settings, **overrides)
                state.upstreams[route.name] = upstream_factory(routed, route.upstream or base_url)
        state.catalog = build_catalog(settings, demo=devmodel is not None)
        state.store = open_store(settings.store)
        await state.store.open()
        metrics.publish_resident_memory(baseline=True)  # before any request: the gateway's own RSS
        freeze_startup_objects()
        await background.start()
        try:
            yield
        finally:
            await background.close()  # drains the background tasks while the store is open
            await state.catalog.aclose()  # pooled MCP sessions end (HTTP DELETE, stdio process exits)
            await state.store.close()
            await state.upstream.aclose()
            for client in state.upstreams.values():
                await client.aclose()
            if devmodel is not None:
                await asyncio.to_thread(devmodel.stop)
            metrics.worker_exited()

    pool = ProcessPool(
        settings.max_inflight_retained_bytes or default_pool_bytes(settings.workers),
        max_requests=settings.max_concurrent_requests,
        max_share_per_caller=settings.max_inflight_share_per_caller,
        pressure=pressure_source,
        pressure_threshold=settings.memory_pressure_threshold,
    )
    state.pool = pool
    if pool.caller_cap < settings.max_retained_bytes <= pool.budget:
        log.warning(
            "one caller's share of the pool (%d budget bytes: --max-inflight-share-per-caller=%g of %d) is "
            "under max_retained_bytes=%d: a request without Content-Length reserves max_retained_bytes and "
            "will be refused (413); raise --max-inflight-retained-bytes or the share",
            pool.caller_cap,
            pool.share,
            pool.budget,
            settings.max_retained_bytes,
        )

    def guarded(app: Any, **body: Any) -> BudgetMiddleware:
        """`app` behind the guard: the clamps, ledger, admission and outcome table of create."""
        return BudgetMiddleware(
            app,
            limits=settings.limits,
            client_body_timeout=settings.client_body_timeout,
            authenticator=authenticator,
            router=router,
            pool=pool,
            request_deadline=settings.request_deadline,
            retry_after=settings.retry_after,
            keepalive_interval=settings.keepalive_interval,
            client_write_timeout=settings.client_write_timeout,
            charge_model=ChargeModel.named(settings.charge_model),
            **body,
        )

    inner = ResponsesApp(state)

    def get_store() -> Store:
        assert state.store is not None, "the lifespan opens the store"
        return state.store

    background = BackgroundTasks(inner, get_store, settings)
    responses = guarded(
        inner,
        background=background,
        shield=RetryShield(
            seconds=settings.retry_shield_seconds,
            max_entries=settings.retry_shield_max_entries,
            max_bytes=settings.retry_shield_max_bytes,
            pool=pool,
        ),
    )
    compact = guarded(CompactApp(state), validate=validate_compact_request, create=False)  # issue 24

    websocket = WebSocketResponses(
        responses,
        WebSocketConfig(
            limits=settings.limits,
            authenticator=authenticator,
            pool=pool,
            charge_model=ChargeModel.named(settings.charge_model),
            max_lifetime=settings.websocket_max_lifetime,
            idle_timeout=settings.websocket_idle_timeout,
            write_timeout=settings.client_write_timeout,
            keepalive_interval=settings.keepalive_interval,
            retry_after=settings.retry_after,
        ),
    )

    async def readyz(request: Request) -> Response:
        """Readiness: 503 while draining or saturated (pool, concurrency or memory pressure)."""
        if DRAIN.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if pool.saturated:
            return JSONResponse({"status": "saturated"}, status_code=503)
        return JSONResponse({"status": "ready"})

    def owner_of(request: Request) -> str:
        return authenticator.owner(request.scope)

    routes: list[Any] = [
        Route("/v1/responses", responses, methods=["POST"]),
        WebSocketRoute("/v1/responses", websocket),  # WebSocket mode (middleware.asgi.websocket)
        Route("/v1/responses/compact", compact, methods=["POST"]),
        *(
            Route(path, chat_completions_not_served, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
            for path in ("/v1/chat/completions", "/v1/completions")
        ),
        *store_routes(
            get_store,
            owner_of,
            reads=StoreReads(
                limits=settings.limits,
                pool=pool,
                retry_after=settings.retry_after,
                model=ChargeModel.named(settings.charge_model),
                caller_of=authenticator.caller,
                client_body_timeout=settings.client_body_timeout,
            ),
            background=background,
        ),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/metrics/", metrics_endpoint, methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {
        Failure: failure_handler,
        Exception: failure_handler,  # a defect: 500 internal_error (Starlette logs and re-raises it)
        404: route_error_response,
        405: route_error_response,
    }
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[Middleware(RequestIdMiddleware)],
    )


def create_app_from_env() -> Starlette:
    """Factory for uvicorn workers: the settings come from the environment (`Settings.to_env`)."""
    settings = Settings.from_env_json()
    install_drain_hook(settings.drain_timeout)
    return create_app(settings)
