"""The guard (`BudgetMiddleware`) supervising a stub inner app, with fake ``receive`` / ``send``.

What the intake refuses before the app runs, what the guard does when the client goes away or the
whole-request deadline passes while the app is still working, and that scopes other than
``http`` pass through untouched. The outcomes of an app that raises are
tests/unit/test_guard_units.py's; a stalled client is tests/unit/test_write_bound_units.py's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from budget import Limits
from middleware.asgi.auth import Authenticator
from middleware.asgi.guard import BudgetMiddleware
from middleware.loop.context import RequestContext, context_of

BODY = json.dumps({"model": "m", "input": "x", "stream": True}).encode()
App = Callable[[RequestContext], Awaitable[None]]


@dataclass
class Served:
    """What one request through the guard left behind."""

    sent: list[Message] = field(default_factory=list)
    stored: list[tuple[str, dict[str, Any] | None]] = field(default_factory=list)
    ran: list[RequestContext] = field(default_factory=list)
    cancelled: bool = False

    @property
    def error(self) -> dict[str, Any]:
        """The error object of a JSON envelope answer."""
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        error: dict[str, Any] = json.loads(body)["error"]
        return error


def client_receive(body: bytes, disconnect_after: float | None) -> Receive:
    """An ASGI ``receive`` of one client: `body` in one ``http.request`` message, then an
    ``http.disconnect`` `disconnect_after` seconds later (None: never; it waits forever)."""
    messages: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        if disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after or 0.0)
        return {"type": "http.disconnect"}

    return receive


def serve(
    app: App,
    body: bytes = BODY,
    *,
    disconnect_after: float | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    **guard: Any,
) -> Served:
    """One POST /v1/responses through the guard around `app`. ``disconnect_after``: seconds
    after the body until the client's ``http.disconnect`` (None: it stays)."""
    out = Served()

    async def main() -> None:
        receive = client_receive(body, disconnect_after)

        async def send(message: Message) -> None:
            out.sent.append(message)

        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            ctx = context_of(scope)
            out.ran.append(ctx)

            async def persist(status: str, error: dict[str, Any] | None) -> None:
                out.stored.append((status, error))

            ctx.hooks.persist_failure = persist
            try:
                await app(ctx)
            except asyncio.CancelledError:
                out.cancelled = True
                raise

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/responses",
            "headers": [(b"content-length", str(len(body)).encode()), *(headers or [])],
        }
        guard.setdefault("limits", Limits(max_retained_bytes=1 << 22))
        await BudgetMiddleware(inner, **guard)(scope, receive, send)

    asyncio.run(main())
    return out


async def forever(ctx: RequestContext) -> None:
    await asyncio.Event().wait()


def test_a_scope_other_than_http_reaches_the_app_untouched() -> None:
    seen: list[Scope] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope)
        await send({"type": "lifespan.startup.complete"})

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    scope = {"type": "lifespan"}
    asyncio.run(BudgetMiddleware(inner, limits=Limits())(scope, receive, send))
    assert seen == [scope] and seen[0] is scope and "loopwarden" not in scope
    assert sent == [{"type": "lifespan.startup.complete"}]


def test_invalid_json_is_refused_before_the_app_runs() -> None:
    out = serve(forever, b'{"model": "m", "input": ')
    assert out.ran == [] and out.sent[0]["status"] == 400
    assert out.error["code"] == "invalid_json" and out.error["type"] == "invalid_request_error"


def test_a_wrong_api_key_is_refused_before_the_app_runs() -> None:
    out = serve(
        forever,
        authenticator=Authenticator(["right-key"]),
        headers=[(b"authorization", b"Bearer wrong-key")],
    )
    assert out.ran == [] and out.sent[0]["status"] == 401 and out.error["code"] == "invalid_api_key"


def test_the_right_api_key_reaches_the_app() -> None:
    async def app(ctx: RequestContext) -> None:
        await ctx.client.answer_json(200, b"{}")

    out = serve(
        app, authenticator=Authenticator(["right-key"]), headers=[(b"authorization", b"Bearer right-key")]
    )
    assert len(out.ran) == 1 and out.ran[0].request == json.loads(BODY) and out.ran[0].stream is True
    assert out.sent[0]["status"] == 200 and out.stored == []


def test_a_client_that_goes_away_cancels_the_app_and_is_stored_cancelled() -> None:
    out = serve(forever, disconnect_after=0.05)
    assert out.cancelled and out.sent == []  # nobody to answer
    assert out.stored == [("cancelled", None)]


def test_the_request_deadline_cancels_the_app_and_answers_504() -> None:
    out = serve(forever, request_deadline=0.2)
    assert out.cancelled and out.sent[0]["status"] == 504
    assert out.error["code"] == "request_deadline_exceeded"
    assert "--request-deadline" in out.error["message"]  # the message names the knob to change
    assert out.stored == [("failed", {"code": "request_deadline_exceeded", "message": out.error["message"]})]


def test_the_deadline_after_commit_ends_the_stream_with_response_failed() -> None:
    async def app(ctx: RequestContext) -> None:
        await ctx.client.event("response.created", {"type": "response.created", "response": {"id": "r"}})
        await asyncio.Event().wait()

    out = serve(app, request_deadline=0.2)
    body = b"".join(m.get("body", b"") for m in out.sent if m["type"] == "http.response.body")
    names = [block.split(b"\n")[0] for block in body.split(b"\n\n") if block]
    assert out.sent[0]["status"] == 200 and names == [
        b"event: response.created",
        b"event: error",
        b"event: response.failed",
        b"data: [DONE]",
    ]
    assert out.stored[0][0] == "failed" and out.stored[0][1] is not None
    assert out.stored[0][1]["code"] == "request_deadline_exceeded"
