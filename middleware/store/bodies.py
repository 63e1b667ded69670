"""Admitted JSON bodies of the conversation routes (create, add items, update): `read_json_body`.

A conversation POST body is bounded like a ``POST /v1/responses`` body (DESIGN.md §3, the create
path in `middleware.asgi.intake`), in the same order:

1. the body clamp: the smaller of the route's own limit (``max_bytes``, 1 MiB by default:
   `middleware.store.routes.MAX_BODY_BYTES`) and the charge model's raw body clamp of the
   request's ``max_retained_bytes`` (`budget.ChargeModel.body_clamp`) — from ``Content-Length``
   without reading (413 ``request_too_large``, ``Connection: close``), then while reading;
2. admission before a byte is read (`StoreRead.open_body`: a reservation from the worker's pool,
   the create path's refusals);
3. the read, within ``client_body_timeout`` seconds (408 ``request_timeout``), counting JSON
   nodes (and the measured model's features) in the same pass; nesting over
   `budget.DEFAULT_MAX_DEPTH` is 400 ``json_too_deep`` at once;
4. the ledger charge of the whole body before it is parsed (`StoreRead.admit_body`: 413
   ``max_retained_bytes_exceeded`` for a body whose nodes cost more than the limit — a JSON
   bomb of small values);
5. the strict parse (`budget.loads_strict`: 400 with its code) and "a JSON object".

Everything raised is a failure for `middleware.outcomes` to answer; the read stays admitted
until the answer is sent (or the handler fails).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from budget import DEFAULT_MAX_DEPTH, JsonNodeCounter, JsonRejected, JsonTooDeep, loads_strict
from middleware.errors import BodyTimeout, BodyTooLarge, InvalidRequest
from middleware.store.reads import StoreRead

__all__ = ["read_json_body"]


def _too_large(size: int, clamp: int, max_bytes: int, limit: int, *, declared: bool) -> BodyTooLarge:
    how = "declares" if declared else "is at least"
    why = (
        f"this endpoint's limit of {max_bytes:,} bytes"
        if clamp == max_bytes
        else f"the {clamp:,} byte clamp of max_retained_bytes={limit:,}"
    )
    return BodyTooLarge(
        f"request body {how} {size:,} bytes, over {why}; send fewer or smaller items", size=size, clamp=clamp
    )


def _declared(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise InvalidRequest("Content-Length is not an integer")
    return int(value)


async def read_json_body(request: Request, read: StoreRead, max_bytes: int) -> dict[str, Any]:
    """The body of ``request`` as a JSON object (``{}`` when empty), admitted under ``read``
    (see the module docstring). ``max_bytes``: the route's own body limit (bytes). Raises
    `BodyTooLarge`, `BodyTimeout`, `InvalidRequest`, the admission refusals of `StoreRead.open_body`
    and `budget.BudgetExceeded` / `PoolExhausted` (phase ``input``); `ClientDisconnect` when the
    client goes away mid-body."""
    model, limit = read.reads.model, read.max_retained_bytes
    clamp = min(max_bytes, model.body_clamp(limit))
    declared = _declared(request)
    if declared is not None and declared > clamp:
        raise _too_large(declared, clamp, max_bytes, limit, declared=True)
    read.open_body(declared)
    counter = JsonNodeCounter(max_depth=DEFAULT_MAX_DEPTH, features=model.parse is not None)
    body = bytearray()
    timeout = read.reads.client_body_timeout
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                if len(body) + len(chunk) > clamp:
                    raise _too_large(len(body) + len(chunk), clamp, max_bytes, limit, declared=False)
                counter.feed(chunk)
                body += chunk
        features = counter.features() if model.parse is not None else None  # flushes the counter
    except JsonTooDeep as exc:
        raise InvalidRequest(str(exc), code="json_too_deep") from None
    except TimeoutError:
        raise BodyTimeout(
            f"the request body was not received within {timeout:g} s (--client-body-timeout); "
            "send the whole body promptly",
            seconds=timeout,
        ) from None
    raw = bytes(body)
    read.admit_body(raw, counter.nodes, features)
    if not raw.strip():
        return {}
    try:
        # its depth capped by the counter above, its ":" outside strings counted in `features`
        members = features.members if features is not None else None
        value = loads_strict(raw, members=members, depth_checked=True)
    except JsonRejected as exc:
        raise InvalidRequest(exc.message, code=exc.code, param=exc.param) from None
    if not isinstance(value, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_type")
    return value
