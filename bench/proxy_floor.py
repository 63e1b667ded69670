"""The floor build: the bare proxy plus only the per-request work DESIGN.md mandates (issue 21).

Usage: ``python bench/proxy_floor.py --upstream URL --port PORT`` (``LOOPWARDEN_BENCH_STACK=fast``
for httptools + uvloop, as every benchmarked ASGI server).

`bench/proxy_bare.py`'s aiohttp forwarder (one Starlette `Route`, a pure ASGI endpoint, one pooled
`aiohttp.ClientSession`) plus, per request, exactly the work any gateway keeping loopwarden's
guarantees must do, done with loopwarden's own functions (`budget`, `middleware.asgi.validate`,
`middleware.upstream.fastpath`'s decoder idea):

* a request id (``x-request-id`` on the answer);
* the body read up to the reference clamp (`budget.Limits.request_body_clamp`), its JSON nodes
  counted with the depth cap (`budget.JsonNodeCounter`, depth 128) as it arrives, and the input
  charged before it is parsed (`budget.Ledger.admit_input`);
* the strict parse (`budget.loads_strict`: duplicate keys, lone surrogates, NaN) and the field
  validation (`middleware.asgi.validate.validate_request`);
* a disconnect watcher (one task reading ``http.disconnect``, cancelling the forward);
* buffered answers: the upstream body charged chunk by chunk at its exact node count
  (`Ledger.admit_output`), validated as one JSON object (msgspec, plus a UTF-8 check of the
  strings it skips) and the terminal encoding charged (`Ledger.admit_terminal`);
* streamed answers: per upstream read, one ledger bound (`Ledger.stream_read_fits`, the 48 × read
  term and one frame at a node per byte), every frame of the read validated (msgspec decode of
  ``type`` and ``sequence_number``, UTF-8 checked) and in-band ``error`` events detected; the
  read is forwarded as received, in one send;
* five Prometheus metrics (requests by outcome, duration, ledger peak, in-flight, upstream
  bytes), module-level, in their own registry.

What it leaves out, on purpose: error answers beyond a refusal (a fixed 400 / 502 envelope or an
SSE ``error`` frame), keep-alive comments, deadlines, renumbering, lifecycle normalisation, the
store, the loop, retries. It is the reference for "what any sound design costs", not a gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_bare import PASS_HEADERS, serve

from budget import JsonNodeCounter, Ledger, Limits, loads_strict
from budget.errors import BudgetError, BudgetExceeded, PoolExhausted
from middleware.asgi.validate import validate_request
from middleware.errors import InvalidRequest

LIMITS: Final = Limits()
MAX_DEPTH: Final = 128
REGISTRY: Final = CollectorRegistry()
REQUESTS: Final = Counter("floor_requests", "Requests by outcome.", ["outcome"], registry=REGISTRY)
DURATION: Final = Histogram("floor_request_duration_seconds", "Request duration.", registry=REGISTRY)
PEAK: Final = Histogram(
    "floor_retained_bytes_peak",
    "Ledger peak per request.",
    buckets=(1e4, 1e5, 1e6, 1e7, 1e8),
    registry=REGISTRY,
)
INFLIGHT: Final = Gauge("floor_inflight_requests", "Requests in flight.", registry=REGISTRY)
UPSTREAM_BYTES: Final = Counter("floor_upstream_bytes", "Upstream body bytes.", registry=REGISTRY)


class _Head(msgspec.Struct):
    """The two fields a frame's check needs; the rest of the JSON text is validated, not built."""

    type: Any = None
    sequence_number: Any = None


class _Object(msgspec.Struct):
    """A buffered answer: any JSON object; validated whole, nothing built."""


_HEAD: Final = msgspec.json.Decoder(_Head)
_OBJECT: Final = msgspec.json.Decoder(_Object)
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]


class Refused(Exception):
    """The floor refuses: ``status`` (int) and an OpenAI-style error ``code`` (str)."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(code)
        self.status, self.code = status, code


def _utf8(data: bytes) -> None:
    """msgspec does not check the strings it skips: raises `Refused` (502) on invalid UTF-8."""
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(502, "upstream_invalid_response") from None


def check_read(block: bytes, ledger: Ledger) -> None:
    """Validate the whole frames of one upstream read (``event: N\\ndata: J\\n\\n`` each, LF line
    ends), under one ledger bound. Raises `Refused` (502) for a bound that does not fit, invalid
    JSON or UTF-8, or an in-band ``error`` event; `budget.BudgetExceeded` when the bound does not
    fit and a frame's exact charge (`_exact_charges`) does not either. Keeps nothing charged."""
    frames = block.split(b"\n\n")
    frames.pop()  # what follows the last blank line: b"" (block ends at a frame boundary)
    datas = [f.partition(b"\ndata: ")[2] for f in frames]
    if not ledger.stream_read_fits(len(block), max(map(len, datas), default=0)):
        _exact_charges(block, datas, ledger)  # raises BudgetExceeded when a frame does not fit
    _utf8(block)
    try:
        heads = list(map(_HEAD.decode, datas))
    except msgspec.DecodeError:
        raise Refused(502, "upstream_invalid_response") from None
    if any(h.type == "error" for h in heads) or any(type(h.sequence_number) is not int for h in heads):
        raise Refused(502, "upstream_error")


def _exact_charges(block: bytes, datas: list[bytes], ledger: Ledger) -> None:
    """The per-frame charges the one bound stands for, made one by one (the bound did not fit):
    the read held (``48 ×`` its bytes), then each frame's parse at its counted nodes. Raises
    `budget.BudgetExceeded` like the gateway's exact path; leaves the ledger as it found it."""
    held = ledger.admit_stream_bytes(len(block))
    try:
        for data in datas:
            ledger.check_stream_frame_bounded(data)
    finally:
        ledger.release(held)


class FloorForwarder:
    """Pure ASGI endpoint: the bare aiohttp forward plus the mandatory work (module docstring).
    Config in `start`; per-request state in `_serve`'s locals."""

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

    async def aclose(self) -> None:
        await self.session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = uuid.uuid4().hex.encode()
        started = time.perf_counter()
        ledger = Ledger(LIMITS.max_retained_bytes)
        INFLIGHT.inc()
        state = {"started": False, "complete": False}
        outcome = "ok"
        try:
            body, nodes = await _read_body(receive)
            ledger.admit_input(body, nodes)
            request = loads_strict(body)
            if not isinstance(request, dict):
                raise Refused(400, "invalid_type")
            validate_request(request)
            await _watched(
                self._forward(body, bool(request.get("stream")), ledger, request_id, send, state),
                receive,
                state,
            )
        except (Refused, BudgetError, InvalidRequest) as exc:
            outcome = "refused"
            await _refuse(exc, request_id, send, state)
        except ConnectionError:
            outcome = "disconnect"
        finally:
            INFLIGHT.dec()
            REQUESTS.labels(outcome).inc()
            DURATION.observe(time.perf_counter() - started)
            PEAK.observe(ledger.peak)

    async def _forward(
        self, body: bytes, stream: bool, ledger: Ledger, request_id: bytes, send: Send, state: dict[str, bool]
    ) -> None:
        async with self.session.post(
            self.url, data=body, headers={"content-type": "application/json"}
        ) as response:
            headers = [(k.lower(), v) for k, v in response.raw_headers if k.lower() in PASS_HEADERS]
            headers.append((b"x-request-id", request_id))
            if response.status != 200:
                raise Refused(502, "upstream_error")
            if stream:
                await _forward_stream(response, ledger, headers, send, state)
            else:
                await _forward_buffered(response, ledger, headers, send, state)


async def _forward_stream(
    response: Any, ledger: Ledger, headers: list[tuple[bytes, bytes]], send: Send, state: dict[str, bool]
) -> None:
    """Check each read's whole frames (`check_read`) and forward them as received; a frame split
    across reads waits (charged at ``32 ×`` its bytes) for the rest."""
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    state["started"] = True
    tail = b""
    held = 0
    async for chunk in response.content.iter_any():
        UPSTREAM_BYTES.inc(len(chunk))
        data = tail + chunk if tail else chunk
        end = data.rfind(b"\n\n") + 2
        tail = data[end:]
        if end >= 2:
            check_read(data[:end], ledger)
            await send({"type": "http.response.body", "body": data[:end], "more_body": True})
        ledger.release(held)
        held = ledger.admit_stream_bytes(len(tail), transient=False) if tail else 0
    if tail:
        raise Refused(502, "upstream_invalid_response")
    state["complete"] = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _forward_buffered(
    response: Any, ledger: Ledger, headers: list[tuple[bytes, bytes]], send: Send, state: dict[str, bool]
) -> None:
    """Charge the upstream body chunk by chunk at its exact nodes, validate it as one object,
    charge its encoding, send it."""
    counter = JsonNodeCounter(MAX_DEPTH)
    parts: list[bytes] = []
    async for chunk in response.content.iter_any():
        UPSTREAM_BYTES.inc(len(chunk))
        before = counter.nodes
        ledger.admit_output(chunk, counter.feed(chunk) - before)
        parts.append(chunk)
    data = b"".join(parts)
    _utf8(data)
    try:
        _OBJECT.decode(data)
    except msgspec.DecodeError:
        raise Refused(502, "upstream_invalid_response") from None
    ledger.admit_terminal(data)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    state["started"] = state["complete"] = True
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _read_body(receive: Receive) -> tuple[bytes, int]:
    """The request body up to the clamp, its nodes counted (depth-capped) as it arrives: ``(body,
    nodes)``. Raises `Refused` (413) past the clamp, `JsonTooDeep`, `ConnectionError`."""
    counter = JsonNodeCounter(MAX_DEPTH)
    parts: list[bytes] = []
    size, clamp = 0, LIMITS.request_body_clamp
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > clamp:
            raise Refused(413, "request_too_large")
        counter.feed(chunk)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), counter.nodes


async def _watched(work: Any, receive: Receive, state: dict[str, bool]) -> None:
    """Run `work` in this task while one watcher task reads ``http.disconnect``; a disconnect
    before ``state["complete"]`` (set by the work before its last send: uvicorn answers
    ``http.disconnect`` once the response is complete) cancels the work (raises
    `ConnectionError`)."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        if state.get("complete"):
            return
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await work
    except asyncio.CancelledError:
        if gone:
            raise ConnectionError("client went away") from None
        raise
    finally:
        watcher.cancel()


async def _refuse(exc: Exception, request_id: bytes, send: Send, state: dict[str, bool]) -> None:
    """A refusal: the OpenAI error envelope (before headers) or an SSE ``error`` frame (after)."""
    code = str(getattr(exc, "code", None) or type(exc).__name__)
    status = exc.status if isinstance(exc, Refused) else 400
    if isinstance(exc, BudgetExceeded | PoolExhausted):
        status, code = 502, "max_retained_bytes_exceeded"
    error = {"type": "invalid_request_error", "code": code, "message": str(exc) or code, "param": None}
    if state["started"]:
        frame = b"event: error\ndata: " + json.dumps({"type": "error", **error}).encode() + b"\n\n"
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": frame, "more_body": False})
        return
    headers = [*_JSON_HEADERS, (b"x-request-id", request_id)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps({"error": error}).encode()})


def create_app(upstream: str) -> Starlette:
    """The floor app for `upstream` (a base URL with ``/v1``): ``POST /v1/responses``,
    ``GET /healthz``, ``GET /metrics`` (the five metrics, Prometheus text)."""
    forwarder = FloorForwarder(upstream)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await forwarder.start()
        try:
            yield
        finally:
            await forwarder.aclose()

    async def healthz(request: Any) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Any) -> Response:
        from prometheus_client import generate_latest

        return Response(generate_latest(REGISTRY), media_type="text/plain; version=0.0.4")

    return Starlette(
        routes=[
            Route("/v1/responses", forwarder, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="base URL including /v1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve(create_app(args.upstream), args.port)


if __name__ == "__main__":
    main()
