"""`BudgetMiddleware`: admission of the client body and the single outcome authority.

Pure ASGI (DESIGN.md §2, STYLE.md). For each ``POST /v1/responses`` it

0. checks the gateway API key (401 ``invalid_api_key``) and derives the caller's identity;
1. computes the request's effective `Limits` (server settings and the client's lowering headers
   ``loopwarden-max-retained-bytes`` / ``loopwarden-max-infer-iters``; the smallest wins);
2. enforces the raw body clamp ``max_retained_bytes // 32`` from ``Content-Length`` before reading
   (413 ``request_too_large`` with ``Connection: close``) and while reading; a body not received
   within ``client_body_timeout`` seconds is a 408;
3. counts JSON nodes in the same pass as it reads (depth over 128 is a 400 ``json_too_deep`` at
   once), charges the body with ``Ledger.admit_input`` (413 ``max_retained_bytes_exceeded``), then
   parses it strictly (400 ``invalid_json`` / ``duplicate_key`` / ``invalid_unicode`` /
   ``invalid_number``) and checks the fields (400 naming the field) — DESIGN.md §3 order;
4. lowers the ledger to a per-model limit when one is configured (413 if what is charged no longer
   fits);
5. runs the inner app with a `RequestContext` in ``scope["loopwarden"]``, cancels it when the client
   disconnects, and turns whatever it raises into exactly one answer (DESIGN.md §5): a JSON error
   before the response is committed, one SSE ``error`` frame after.

Every outcome is counted (``loopwarden_requests_total``, ``loopwarden_cap_hits_total``,
``loopwarden_stream_errors_total``, ``loopwarden_upstream_errors_total``,
``loopwarden_client_disconnects_total``, retained-bytes peak and utilization histograms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from budget import (
    BudgetExceeded,
    ChargeModel,
    JsonInvalid,
    JsonNodeCounter,
    JsonTooDeep,
    Ledger,
    Limits,
    PoolExhausted,
    loads_strict,
)
from middleware.asgi.auth import Authenticator
from middleware.asgi.models import ModelRouter
from middleware.asgi.validate import validate_request
from middleware.errors import (
    GatewayError,
    InvalidRequest,
    envelope_bytes,
    error_headers,
    sse_error_frame,
    with_request_id,
)
from middleware.loop.context import RequestContext
from middleware.ops import metrics
from middleware.ops.admission import DRAIN, DrainState, ProcessPool, RequestReservation
from middleware.upstream.httpx_client import UpstreamError

log = logging.getLogger("loopwarden")

MAX_JSON_DEPTH = 128
# Upstream failures detected while reading a body or stream -> loopwarden_upstream_errors_total{kind}.
UPSTREAM_FAILURE_KINDS = {"upstream_invalid_response": "protocol", "upstream_incomplete": "eof"}
LIMIT_OF_CODE = {
    "max_retained_bytes_exceeded": "max_retained_bytes",
    "max_infer_iters_exceeded": "max_infer_iters",
}
LIMIT_HEADERS = {
    b"loopwarden-max-retained-bytes": "max_retained_bytes",
    b"loopwarden-max-infer-iters": "max_infer_iters",
}


def _mib(n: int) -> str:
    return f"{n / 1048576:.2f} MiB" if n >= 1048576 else f"{n} bytes"


class _Answered(Exception):
    """Raised inside admission once an error answer has been decided (carries it)."""

    def __init__(self, error: GatewayError) -> None:
        self.error = error


class _ClientGone(Exception):
    """The client disconnected before the body was complete."""


class BudgetMiddleware:
    """Wraps the Responses app; see the module docstring for what it enforces.

    ``limits``: the server-wide `Limits`. ``router``: the configured models (their limits, and the
    ``model`` metric label; unknown models are a 404 when any is configured).
    ``client_body_timeout``: seconds to receive the whole body. ``pool``: the worker's admission
    pool. ``request_deadline``: seconds for the whole request. ``retry_after``: seconds in a 503.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        limits: Limits,
        client_body_timeout: float = 30.0,
        router: ModelRouter | None = None,
        authenticator: Authenticator | None = None,
        pool: ProcessPool | None = None,
        request_deadline: float = 1800.0,
        retry_after: float = 1.0,
        drain: DrainState = DRAIN,
    ) -> None:
        self.app = app
        self.authenticator = authenticator or Authenticator(())
        self.pool = pool or ProcessPool(1 << 62)
        self.request_deadline = request_deadline
        self.retry_after = retry_after
        self.drain = drain
        self.limits = limits
        self.client_body_timeout = client_body_timeout
        self.router = router or ModelRouter(())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await _Guard(self, scope, receive, send).run()


_INPUT_PER_BYTE_STORED = ChargeModel().input_per_byte * 2  # per body byte, store on (reservations)


class _Guard:
    """Per-request responder of `BudgetMiddleware`."""

    def __init__(self, mw: BudgetMiddleware, scope: Scope, receive: Receive, send: Send) -> None:
        self.mw = mw
        self.scope = scope
        self.receive = receive
        self._send = send
        self.status = 0
        self.started = False
        self.finished = False
        self.ctx: RequestContext | None = None
        self.ledger: Ledger | None = None
        self.reservation: RequestReservation | None = None
        self.model_label = "other"
        self.lowered: set[str] = set()  # limits this request lowered with its own headers
        self.started_at = time.monotonic()
        self.counted = False

    async def send(self, message: Message) -> None:
        if self.finished:
            return
        if message["type"] == "http.response.start":
            self.started = True
            self.status = message["status"]
            if self.ctx is not None:
                self.ctx.committed = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
            self._count_request()  # before the last byte leaves: a client never sees it uncounted
        await self._send(message)

    def _count_request(self) -> None:
        if not self.counted:
            self.counted = True
            metrics.REQUESTS.labels(status=str(self.status or 499), model=self.model_label).inc()

    async def run(self) -> None:
        metrics.INFLIGHT.inc()
        try:
            try:
                ctx = await self._admit()
            except _Answered as answered:
                await self._answer_error(answered.error)
                return
            except _ClientGone:
                metrics.CLIENT_DISCONNECTS.inc()
                self.status = 499
                return
            self.ctx = ctx
            self.ledger = ctx.ledger
            await self._run_inner(ctx)
        finally:
            metrics.INFLIGHT.dec()
            self._count_request()
            if self.ledger is not None:
                self.ledger.release_all()  # the request is over: nothing it charged is retained
                metrics.RETAINED_PEAK.observe(self.ledger.peak)
                metrics.RETAINED_UTILIZATION.observe(self.ledger.peak / self.ledger.limit)
            if self.reservation is not None:
                self.reservation.close()

    # -- admission --------------------------------------------------------------------------
    def _effective_limits(self) -> Limits:
        lowered: dict[str, int] = {}
        for name, value in self.scope.get("headers", []):
            field = LIMIT_HEADERS.get(name.lower())
            if field is None:
                continue
            header = name.decode("latin-1").lower()
            try:
                number = int(value)
                Limits(**{**vars_of(self.mw.limits), field: number})
            except ValueError:
                low, high = (4096, 268435456) if field == "max_retained_bytes" else (1, 100)
                raise _Answered(
                    InvalidRequest(
                        f"header {header} must be an integer in {low}..={high}, got {value.decode('latin-1')!r}",
                        code="invalid_header",
                        param=header,
                    )
                ) from None
            lowered[field] = number
            if number < getattr(self.mw.limits, field):
                self.lowered.add(field)
        if not lowered:
            return self.mw.limits
        return Limits.smallest(self.mw.limits, Limits(**{**vars_of(self.mw.limits), **lowered}))

    async def _admit(self) -> RequestContext:
        try:
            owner = self.mw.authenticator.owner(self.scope)
        except GatewayError as error:
            raise _Answered(error) from None
        limits = self._effective_limits()
        clamp = limits.max_retained_bytes // 32
        declared = None
        for name, value in self.scope.get("headers", []):
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise _Answered(
                        InvalidRequest("Content-Length is not an integer", code="invalid_request")
                    ) from None
        if declared is not None and declared > clamp:
            raise _Answered(_too_large(declared, clamp, limits, declared=True))
        self.reservation = self._reserve(limits, declared)
        counter = JsonNodeCounter(max_depth=MAX_JSON_DEPTH)
        try:
            async with asyncio.timeout(self.mw.client_body_timeout):
                raw = await self._read_body(clamp, limits, counter)
        except TimeoutError:
            raise _Answered(
                GatewayError(
                    f"the request body was not received within {self.mw.client_body_timeout:g} s "
                    "(--client-body-timeout); send the whole body promptly",
                    status=408,
                    code="request_timeout",
                    retryable=False,
                    limit="client_body_timeout",
                )
            ) from None
        # The body's own charge (what parsing it retains) is admitted before it is parsed; whether
        # the store doubles it (the persisted projection) is known only after parsing, so the
        # doubled charge replaces the single one then — exact for both, and sound throughout.
        nodes = counter.nodes
        ledger = self._admit_body(limits, raw, nodes, store=False)
        try:
            request = loads_strict(raw)
        except JsonInvalid as exc:
            param = exc.param
            if exc.code == "invalid_number" and param is None:
                param = nonfinite_number_path(raw)
            elif exc.code == "invalid_unicode" and param is None:
                param = undecodable_field(raw)
            raise _Answered(InvalidRequest(exc.message, code=exc.code, param=param)) from None
        if not isinstance(request, dict):
            raise _Answered(
                InvalidRequest(
                    f"request body must be a JSON object, got {type(request).__name__}",
                    code="invalid_request",
                )
            )
        try:
            validate_request(request)
        except GatewayError as error:
            raise _Answered(error) from None
        route = self.mw.router.match(request["model"])
        if route is None and self.mw.router.configured:
            raise _Answered(
                GatewayError(
                    f"the model {request['model'][:200]!r} does not exist on this gateway; "
                    f"configured models: {', '.join(sorted(self.mw.router.labels))[:500]}",
                    status=404,
                    code="model_not_found",
                    param="model",
                    retryable=False,
                )
            )
        self.model_label = route.name if route is not None else "other"
        store = request.get("store") is not False
        if store:
            ledger.release_all()
            ledger = self._admit_body(limits, raw, nodes, store=True)
        if route is not None:
            limits = route.limits(limits)
            try:
                ledger.lower_limit(limits.max_retained_bytes)
            except BudgetExceeded as exc:
                raise _Answered(_budget_error(exc, status=413)) from None
        return RequestContext(
            ledger=ledger,
            limits=limits,
            raw=raw,
            request=request,
            stream=request.get("stream") is True,
            store=store,
            model_label=self.model_label,
            owner=owner,
            route=route,
        )

    def _reserve(self, limits: Limits, declared: int | None) -> RequestReservation:
        """Admission control before the body is read: 503 / 413 refusals, else a reservation."""
        pool = self.mw.pool
        if self.mw.drain.draining:
            raise _Answered(
                GatewayError(
                    "the gateway is shutting down; retry on another instance",
                    status=503,
                    code="server_shutting_down",
                    close_connection=True,
                    retry_after=self.mw.retry_after,
                )
            )
        per_byte = _INPUT_PER_BYTE_STORED  # the body is admitted as if store were on
        initial = (
            limits.max_retained_bytes
            if declared is None
            else min(limits.max_retained_bytes, declared * per_byte)
        )
        if initial > pool.budget:
            raise _Answered(
                GatewayError(
                    f"this request would reserve {initial} budget bytes, more than this worker's whole pool of "
                    f"{pool.budget} (--max-inflight-retained-bytes); lower loopwarden-max-retained-bytes or send less",
                    status=413,
                    code="process_budget_exceeded",
                    retryable=False,
                    limit="admission",
                    close_connection=True,
                )
            )
        reason = pool.refusal(initial)
        if reason is not None:
            raise _Answered(
                GatewayError(
                    f"the gateway is overloaded: {reason}; retry after {self.mw.retry_after:g} s",
                    status=503,
                    code="server_overloaded",
                    limit="admission",
                    close_connection=True,
                    retry_after=self.mw.retry_after,
                )
            )
        return pool.admit(initial)

    def _admit_body(self, limits: Limits, raw: bytes, nodes: int, *, store: bool) -> Ledger:
        """A new ledger for the request with the body admitted (``admit_input``); 413 otherwise."""
        ledger = Ledger(limits.max_retained_bytes, store=store, pool=self.reservation)
        self.ledger = ledger
        try:
            ledger.admit_input(raw, nodes=nodes)
        except BudgetExceeded as exc:
            raise _Answered(_budget_error(exc, status=413)) from None
        except PoolExhausted as exc:
            raise _Answered(self._pool_error(exc, status=413)) from None
        return ledger

    def _pool_error(self, exc: PoolExhausted, *, status: int) -> GatewayError:
        return GatewayError(
            f"the worker's process budget (--max-inflight-retained-bytes={self.mw.pool.budget}) has no room for "
            f"{exc.requested} more budget bytes for this request ({exc.phase}); retry later",
            status=status,
            code="process_budget_exceeded",
            limit="admission",
        )

    async def _read_body(self, clamp: int, limits: Limits, counter: JsonNodeCounter) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > clamp:
                    raise _Answered(_too_large(size, clamp, limits, declared=False))
                try:
                    counter.feed(chunk)
                except JsonTooDeep as exc:
                    raise _Answered(InvalidRequest(str(exc), code="json_too_deep")) from None
                parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    # -- running the inner app ----------------------------------------------------------------
    async def _run_inner(self, ctx: RequestContext) -> None:
        scope = {**self.scope, "loopwarden": ctx}
        work = asyncio.ensure_future(self._inner_with_outcome(scope))
        watcher = asyncio.ensure_future(self._watch_disconnect())
        deadline = self.started_at + self.mw.request_deadline
        ended: GatewayError | None = None
        try:
            while True:
                now = time.monotonic()
                drain_at = self.mw.drain.deadline if self.mw.drain.draining else None
                if drain_at is not None and now >= drain_at:
                    ended = GatewayError(
                        "the gateway is shutting down and this request did not finish within the drain timeout "
                        "(--drain-timeout); retry it",
                        status=503,
                        code="server_shutting_down",
                    )
                    break
                if now >= deadline:
                    ended = GatewayError(
                        f"the request did not finish within {self.mw.request_deadline:g} s (--request-deadline); "
                        "ask for less work (fewer rounds, shorter answers) or raise the deadline",
                        status=504,
                        code="request_deadline_exceeded",
                        limit="request_deadline",
                    )
                    break
                wake = min(deadline, drain_at if drain_at is not None else deadline) - now
                done, _ = await asyncio.wait(
                    {work, watcher}, timeout=min(max(wake, 0.0), 1.0), return_when=asyncio.FIRST_COMPLETED
                )
                if done:
                    break
        finally:
            gone = not work.done() and ended is None
            if not work.done():
                ctx.cancel_reason = ended
                work.cancel()
            watcher.cancel()
            for task in (work, watcher):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if gone:
                metrics.CLIENT_DISCONNECTS.inc()
                if not self.started:
                    self.status = 499
        if ended is not None:
            await self._answer_error(ended)

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return

    async def _inner_with_outcome(self, scope: Scope) -> None:
        try:
            await self.mw.app(scope, self._no_receive, self.send)
        except GatewayError as error:
            kind = UPSTREAM_FAILURE_KINDS.get(error.code)
            if kind is not None:
                metrics.UPSTREAM_ERRORS.labels(kind=kind).inc()
            await self._answer_error(error)
        except BudgetExceeded as exc:
            await self._answer_error(_budget_error(exc, status=502))
        except PoolExhausted as exc:
            await self._answer_error(self._pool_error(exc, status=502))
        except UpstreamError as exc:
            metrics.UPSTREAM_ERRORS.labels(kind=exc.kind).inc()
            await self._answer_error(
                GatewayError(exc.message, status=504 if exc.kind == "timeout" else 502, code=exc.code)
            )
        except Exception:
            log.exception("internal error while serving a request")
            await self._answer_error(
                GatewayError(
                    "the gateway failed while serving this request",
                    status=500,
                    code="internal_error",
                    retryable=False,
                )
            )

    async def _no_receive(self) -> Message:
        # The body has been consumed; the middleware alone watches for http.disconnect.
        await asyncio.Event().wait()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _answer_error(self, error: GatewayError) -> None:
        """Exactly one answer for `error`: JSON before commit, one SSE error frame after."""
        if self.finished:
            return
        error.message = with_request_id(error.message)
        field = LIMIT_OF_CODE.get(error.code)
        if field in self.lowered:
            header = next(name for name, f in LIMIT_HEADERS.items() if f == field).decode()
            error.message += (
                f" (this request lowered {field} with its {header} header: send a larger value or none)"
            )
        # Metrics first, so that they are counted before the client can see the answer.
        outcome = str(error.status) if not self.started else "sse_error"
        if error.limit is not None:
            metrics.CAP_HITS.labels(limit=error.limit, outcome=outcome).inc()
        if not self.started:
            body = envelope_bytes(error)
            extra = [(b"content-length", str(len(body)).encode())]
            if error.close_connection:
                extra.append((b"connection", b"close"))
            if error.retry_after is not None:
                extra.append((b"retry-after", str(max(1, round(error.retry_after))).encode()))
            await self.send(
                {
                    "type": "http.response.start",
                    "status": error.status,
                    "headers": error_headers(error, extra=extra),
                }
            )
            await self.send({"type": "http.response.body", "body": body})
        else:
            if self.ctx is not None and self.ctx.outbox is not None:
                # frames handled before the failure (a raise, the deadline, the drain) go first
                with contextlib.suppress(Exception):
                    await self.ctx.outbox.flush()
            sequence = self.ctx.next_sequence if self.ctx is not None else 0
            metrics.STREAM_ERRORS.labels(code=metrics.stream_error_label(error.code)).inc()
            await self.send(
                {"type": "http.response.body", "body": sse_error_frame(error, sequence), "more_body": False}
            )


def _first_path(root: Any, hit: Callable[[Any], bool]) -> str | None:
    """The path (``input[0].x``) of the first value or key in `root`, in document order, for
    which `hit` is true; None when there is none (or it is the root)."""
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, value = stack.pop()
        if hit(value):
            return path or None
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                child = f"{path}.{key}" if path else str(key)
                stack.append((child, item))
                if hit(key):
                    stack.append((child, key))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def nonfinite_number_path(raw: bytes) -> str | None:
    """Where the first non-finite number of `raw` is (``temperature``, ``input[0].x``), if a
    lenient parse finds one; None otherwise. Only called on the error path."""
    try:
        root = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return _first_path(root, lambda v: isinstance(v, float) and not math.isfinite(v))


def undecodable_field(raw: bytes) -> str | None:
    """The top-level field whose value holds the first byte that is not UTF-8 (``input``), found
    with a lenient parse; None when it cannot be told. Only called on the error path."""
    try:
        root = json.loads(raw.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return None
    path = _first_path(root, lambda v: isinstance(v, str) and any("\udc80" <= ch <= "\udcff" for ch in v))
    return re.split(r"[.\[]", path, maxsplit=1)[0] if path else None


def vars_of(limits: Limits) -> dict[str, int]:
    """`Limits` as keyword arguments."""
    return {"max_infer_iters": limits.max_infer_iters, "max_retained_bytes": limits.max_retained_bytes}


def _too_large(size: int, clamp: int, limits: Limits, *, declared: bool) -> GatewayError:
    how = "declares" if declared else "is at least"
    return GatewayError(
        f"request body {how} {_mib(size)}, over the {_mib(clamp)} clamp (max_retained_bytes // 32 with "
        f"max_retained_bytes={limits.max_retained_bytes}); send less, or raise max_retained_bytes",
        status=413,
        code="request_too_large",
        retryable=False,
        limit="request_body",
        close_connection=True,
    )


def _budget_error(exc: BudgetExceeded, *, status: int) -> GatewayError:
    return GatewayError(
        str(exc),
        status=status,
        code="max_retained_bytes_exceeded",
        retryable=False,
        limit="max_retained_bytes",
    )


def context_of(scope: Scope) -> RequestContext:
    """The `RequestContext` the middleware put in `scope`; KeyError when there is none."""
    ctx: Any = scope["loopwarden"]
    assert isinstance(ctx, RequestContext)
    return ctx
