"""`WebSocketTurn`: what makes one WebSocket ``response.create`` message a create request.

The WebSocket endpoint (`middleware.asgi.websocket`) runs each turn through the same guard and
intake as ``POST /v1/responses``: the message bytes are the body, so the body clamp, the ledger
charge before parsing and the strict parse all apply unchanged. After the strict parse, the intake
hands the parsed object to `WebSocketTurn.prepare` (found in the scope under `SCOPE_KEY`), which
applies the Open Responses rules for WebSocket requests ("WebSocket Transport"):

* ``type`` must be ``response.create`` (removed before the create-request checks); OpenAI-only
  extras of its WebSocket mode that the spec does not define (``response.steer``, stream lanes:
  ``stream_id``)
  are refused with a clear error (400 ``invalid_value``, ``param`` ``type``);
* the HTTP/SSE-only fields ``stream``, ``stream_options`` and ``background`` must not be sent
  (400 ``unknown_parameter``, ``param`` the field);
* the turn streams: its events are the SSE events' objects, one WebSocket message each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import Any, Final

from middleware.errors import InvalidRequest
from middleware.loop.memory import ConnectionMemory

#: The scope key under which a WebSocket turn's synthetic HTTP scope carries its `WebSocketTurn`.
SCOPE_KEY: Final = "loopwarden.websocket"
#: Fields of the create body that belong to HTTP/SSE only (the spec: they MUST NOT be sent).
HTTP_ONLY_FIELDS: Final = ("stream", "stream_options", "background")
#: Message types OpenAI's WebSocket mode has and the Open Responses spec does not define.
OPENAI_ONLY_TYPES: Final = frozenset({"response.steer"})
#: The field of OpenAI's stream lanes (``stream_id``: responses multiplexed over one socket),
#: which the spec forbids ("MUST NOT multiplex").
LANE_FIELDS: Final = ("stream_id",)


@dataclasses.dataclass(eq=False)
class WebSocketTurn:
    """One turn of a WebSocket connection. ``memory``: the connection's memory. ``parsed``: the
    message was parsed (its ``previous_response_id`` is then ``memory.referenced``)."""

    memory: ConnectionMemory
    parsed: bool = False

    def prepare(self, request: dict[str, Any]) -> dict[str, Any]:
        """The create request of a parsed ``response.create`` message (``type`` removed,
        ``stream`` on); raises `InvalidRequest` as the module docstring says."""
        self.parsed = True
        previous = request.get("previous_response_id")
        self.memory.referenced = previous if isinstance(previous, str) else None
        kind = request.pop("type", None)
        if kind != "response.create":
            raise InvalidRequest(_type_message(kind), code="invalid_value", param="type")
        for field in HTTP_ONLY_FIELDS:
            if field in request:
                raise InvalidRequest(
                    f"{field} is an HTTP/SSE field and must not be sent on a WebSocket (Open Responses, "
                    f"WebSocket Transport): drop it; every WebSocket turn streams its events",
                    code="unknown_parameter",
                    param=field,
                )
        for field in LANE_FIELDS:
            if field in request:
                raise InvalidRequest(
                    f"{field}: stream lanes are an OpenAI-only extra of its WebSocket mode that the Open "
                    "Responses specification does not define; this gateway serves one response at a time "
                    "per connection: drop it, and open another connection for parallel runs",
                    code="unknown_parameter",
                    param=field,
                )
        request["stream"] = True
        return request


def _type_message(kind: object) -> str:
    if isinstance(kind, str) and kind in OPENAI_ONLY_TYPES:
        return (
            f"{kind} is an OpenAI-only extra of its WebSocket mode that the Open Responses specification "
            "does not define; this gateway does not offer it: send a new response.create (with "
            "previous_response_id) once the response in flight has ended"
        )
    shown = kind[:64] if isinstance(kind, str) else kind
    return f'every WebSocket message must be {{"type": "response.create", ...}}; got type {shown!r}'


def turn_of(scope: MutableMapping[str, Any]) -> WebSocketTurn | None:
    """The `WebSocketTurn` of a WebSocket turn's scope; None for an HTTP request."""
    turn = scope.get(SCOPE_KEY)
    return turn if isinstance(turn, WebSocketTurn) else None
