"""`RequestContext`: one admitted request, as `middleware.asgi.intake` hands it to the loop.

Read-only after admission: the guard creates it and the inner app reads it from
``scope["loopwarden"]`` (`context_of`). The two objects in it that change are owned by one writer
each: ``client``, the `ClientStream` that alone writes to the client, and ``hooks``, which the
loop fills so that the guard can store a failure's true status (`middleware.outcomes`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from budget import Ledger, Limits

if TYPE_CHECKING:
    from middleware.asgi.client_stream import ClientStream
    from middleware.asgi.models import ModelRoute
    from middleware.loop.memory import ConnectionMemory

#: ``persist_failure(status, error)``: store the response with ``status`` (``failed`` or
#: ``cancelled``) and its ``error`` object (or None).
PersistFailure = Callable[[str, "dict[str, Any] | None"], Awaitable[None]]


@dataclasses.dataclass(eq=False)
class RequestHooks:
    """What the loop tells the guard: ``persist_failure`` once the response object exists, and
    ``tools_ran`` once a gateway tool with side effects has run — one not annotated ``readOnlyHint``
    or ``idempotentHint`` (a retry would run it again: deterministic, shielded)."""

    persist_failure: PersistFailure | None = None
    tools_ran: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class RequestContext:
    """What one request carries through its rounds.

    ``raw``: the client body (bytes, as admitted). ``request``: the parsed JSON object.
    ``stream``: the client asked for SSE. ``store``: the request's ``store`` (default true).
    ``model_label``: the ``model`` metric label. ``owner``: the caller's identity (a hash of its
    API key) that stored responses belong to. ``route``: the configured model route (None: not
    configured). ``client``: the one writer to the client. ``hooks``: see `RequestHooks`.
    ``memory``: the connection-local memory of the WebSocket connection this request is a turn
    of (None: an HTTP request). ``created_at``: epoch seconds at admission, what every response
    object of this request says when the upstream sent no ``created_at``.
    ``response_id``: the id the response object gets (None: the loop makes one; a background
    response's was stored ``queued`` before the loop started, `middleware.loop.background`).
    """

    ledger: Ledger
    limits: Limits
    raw: bytes
    request: dict[str, Any]
    stream: bool
    store: bool
    client: ClientStream
    model_label: str = "other"
    owner: str = ""
    route: ModelRoute | None = None
    hooks: RequestHooks = dataclasses.field(default_factory=RequestHooks)
    memory: ConnectionMemory | None = None
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))
    response_id: str | None = None


def context_of(scope: MutableMapping[str, Any]) -> RequestContext:
    """The `RequestContext` the guard put in `scope`; KeyError when there is none."""
    ctx = scope["loopwarden"]
    assert isinstance(ctx, RequestContext)
    return ctx
