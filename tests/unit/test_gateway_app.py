"""`middleware.app.GatewayApp`: ``POST /v1/responses`` goes straight to its guard with no ``send``
wrapper (issue 21); the request id is still on every answer, and a defect that escapes the guard is
still a 500 ``internal_error`` envelope before anything was sent, a cut answer after."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from middleware.app import GatewayApp
from middleware.asgi.client_stream import ClientStream


def scope(path: str = "/v1/responses", method: str = "POST", rid: bytes | None = None) -> Scope:
    headers = [(b"x-request-id", rid)] if rid is not None else []
    return {"type": "http", "path": path, "method": method, "headers": headers, "query_string": b""}


def call(app: GatewayApp, s: Scope) -> tuple[list[Message], BaseException | None]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if sent and sent[0]["type"] == "http.response.start" and message["type"] == "http.response.start":
            raise RuntimeError("the answer began already")  # as uvicorn refuses a second start
        sent.append(message)

    async def go() -> BaseException | None:
        try:
            await app(s, receive, send)
        except Exception as exc:
            return exc
        return None

    return sent, asyncio.run(go())


def headers(sent: list[Message]) -> dict[bytes, bytes]:
    return dict(sent[0]["headers"])


def test_the_route_is_served_with_the_request_id_on_its_answer() -> None:
    async def route(s: Scope, receive: Receive, send: Send) -> None:
        await ClientStream(send).answer_json(200, b"{}")

    sent, failure = call(GatewayApp(responses=route), scope(rid=b"abc-1"))
    assert failure is None
    assert headers(sent)[b"x-request-id"] == b"abc-1"
    assert list(headers(sent)).count(b"x-request-id") == 1
    assert sent[1]["body"] == b"{}"


def test_a_defect_before_the_answer_is_a_500_envelope_with_the_request_id() -> None:
    async def route(s: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("a bug with a secret detail")

    sent, failure = call(GatewayApp(responses=route), scope(rid=b"abc-2"))
    assert isinstance(failure, RuntimeError)  # re-raised for the server to log
    assert sent[0]["status"] == 500 and headers(sent)[b"x-request-id"] == b"abc-2"
    body: dict[str, Any] = json.loads(sent[1]["body"])
    assert body["error"]["code"] == "internal_error" and "secret" not in sent[1]["body"].decode()


def test_a_defect_after_the_answer_began_is_not_answered_twice() -> None:
    async def route(s: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("a bug")

    sent, failure = call(GatewayApp(responses=route), scope())
    assert isinstance(failure, RuntimeError)
    assert [m["type"] for m in sent] == ["http.response.start"]


@pytest.mark.parametrize(("path", "method"), [("/v1/responses", "GET"), ("/healthz", "POST")])
def test_other_requests_go_through_starlette(path: str, method: str) -> None:
    async def route(s: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("not this route")

    sent, failure = call(GatewayApp(responses=route), scope(path, method))
    assert failure is None and sent[0]["status"] == 404  # no routes in this app
