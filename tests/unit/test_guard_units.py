"""The guard (`BudgetMiddleware`) with stub inner apps and fake ``receive`` / ``send``: whatever the
inner app raises, before or after commit, is settled once through the outcome table (no server)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from budget import BudgetExceeded, ChargeModel, Limits
from middleware.asgi.guard import BudgetMiddleware
from middleware.errors import LoopLimitReached
from middleware.loop.context import context_of
from middleware.upstream.errors import UpstreamTimeout

BODY = json.dumps({"model": "m", "input": "x", "stream": True}).encode()


def run(app: Any, body: bytes = BODY) -> tuple[list[Message], list[tuple[str, dict[str, Any] | None]]]:
    """Serve one POST through the guard around `app`; (messages sent, stored statuses)."""
    sent: list[Message] = []
    stored: list[tuple[str, dict[str, Any] | None]] = []

    async def main() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> Message:
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()  # the client stays connected
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            sent.append(message)

        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            ctx = context_of(scope)

            async def persist(status: str, error: dict[str, Any] | None) -> None:
                stored.append((status, error))

            ctx.hooks.persist_failure = persist
            await app(ctx)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/responses",
            "headers": [(b"content-length", str(len(body)).encode())],
        }
        await BudgetMiddleware(inner, limits=Limits(max_retained_bytes=1 << 22))(scope, receive, send)

    asyncio.run(main())
    return sent, stored


def body_of(sent: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (BudgetExceeded("tool_result", 10, 0, 5), 502, "max_retained_bytes_exceeded"),
        (LoopLimitReached("loop"), 508, "max_infer_iters_exceeded"),
        (UpstreamTimeout("slow", phase="read"), 504, "upstream_timeout"),
        (RuntimeError("a defect"), 500, "internal_error"),
    ],
)
def test_a_raise_before_commit_is_one_envelope_and_is_stored(exc: Exception, status: int, code: str) -> None:
    async def app(ctx: Any) -> None:
        raise exc

    sent, stored = run(app)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == status and sent[1].get("more_body", False) is False
    assert json.loads(sent[1]["body"])["error"]["code"] == code
    assert stored == [("failed", {"code": code, "message": json.loads(sent[1]["body"])["error"]["message"]})]


def test_a_raise_after_commit_is_error_then_failed_then_done() -> None:
    async def app(ctx: Any) -> None:
        ctx.client.snapshot = lambda: {"id": "resp_x", "object": "response", "output": [{"type": "message"}]}
        await ctx.client.event("response.created", {"type": "response.created", "response": {"id": "resp_x"}})
        await ctx.client.event(
            "response.output_text.delta", {"type": "response.output_text.delta", "delta": "a"}
        )
        raise BudgetExceeded("accumulated", 10, 0, 5)

    sent, stored = run(app)
    assert sent[0]["status"] == 200 and sent[-1].get("more_body", False) is False
    frames = [block for block in body_of(sent).split(b"\n\n") if block]
    names = [block.split(b"\n")[0] for block in frames]
    assert names == [
        b"event: response.created",
        b"event: response.output_text.delta",
        b"event: error",
        b"event: response.failed",
        b"data: [DONE]",
    ]
    error = json.loads(frames[2].split(b"data: ")[1])
    failed = json.loads(frames[3].split(b"data: ")[1])
    assert [error["sequence_number"], failed["sequence_number"]] == [2, 3]
    assert error["code"] == failed["response"]["error"]["code"] == "max_retained_bytes_exceeded"
    assert failed["response"]["id"] == "resp_x" and failed["response"]["status"] == "failed"
    assert failed["response"]["output"] == [{"type": "message"}]
    assert stored[0][0] == "failed"


def test_a_raise_after_the_last_byte_sends_nothing_more() -> None:
    async def app(ctx: Any) -> None:
        await ctx.client.answer_json(200, b"{}")
        raise RuntimeError("too late")

    sent, stored = run(app)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200 and stored == []


def test_a_body_over_the_clamp_is_refused_before_the_app_runs() -> None:
    ran = []

    async def app(ctx: Any) -> None:
        ran.append(ctx)

    clamp = ChargeModel.measured().body_clamp(1 << 22)  # the default model's, at the 4 MiB limit
    sent, _ = run(app, b"{" + b" " * (clamp - 1) + b"}")
    assert ran == [] and sent[0]["status"] == 413
    headers = dict(sent[0]["headers"])
    assert headers[b"connection"] == b"close" and headers[b"x-should-retry"] == b"false"
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
