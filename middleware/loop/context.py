"""Per-request state shared by the budget middleware and the loop controller.

One `RequestContext` per client request, created by `BudgetMiddleware` after the body has been
admitted and parsed, and handed to the inner app in ``scope["loopwarden"]``. The middleware reads
``committed`` and ``next_sequence`` to decide between a JSON error and one SSE error frame.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from budget import Ledger, Limits
from middleware.asgi.client_stream import Outbox


@dataclasses.dataclass(eq=False)
class RequestContext:
    """What one request carries through its rounds.

    ``raw``: the client body (bytes, as admitted). ``request``: the parsed JSON object.
    ``stream``: the client asked for SSE. ``store``: the request's ``store`` (default true).
    ``next_sequence``: the ``sequence_number`` the next SSE event to the client will carry.
    ``committed``: the response headers have been sent. ``rounds``: inference calls made so far.
    ``owner``: the caller's identity (a hash of its API key) that stored responses belong to.
    ``outbox``: the `Outbox` holding SSE frames not yet sent (set by the Responses app); the
    middleware flushes it before it writes an error frame, so the frames come first, in order.
    """

    ledger: Ledger
    limits: Limits
    raw: bytes
    request: dict[str, Any]
    stream: bool
    store: bool
    model_label: str = "other"
    owner: str = ""
    route: Any = None  # the configured ModelRoute of the request's model (None: not configured)
    cancel_reason: Any = None  # the GatewayError the middleware ended this request with (deadline, drain)
    next_sequence: int = 0
    committed: bool = False
    outbox: Outbox | None = None
    rounds: int = 0
