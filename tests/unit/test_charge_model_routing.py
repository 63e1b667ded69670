"""Choosing the charge model (`--charge-model`, per model under ``models:``) through the guard, with
a stub inner app (no server): the clamp and the reservation use the most permissive configured
model, and the routed request is charged at its own model's price (413 if it no longer fits)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from budget import ChargeModel, Limits, json_features
from middleware.asgi.guard import BudgetMiddleware
from middleware.asgi.models import ModelRouter, parse_models
from middleware.config import Settings
from middleware.loop.context import context_of

LIMIT = 64 << 20


def body(model: str, image_chars: int) -> bytes:
    image = "data:image/png;base64," + "A" * image_chars
    content = [{"type": "input_image", "image_url": image}]
    return json.dumps(
        {"model": model, "input": [{"role": "user", "content": content}], "store": False}
    ).encode()


def serve(raw: bytes, *, server: str, models: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """POST ``raw`` through the guard; (status, what the inner app saw or the error body)."""
    seen: dict[str, Any] = {}
    sent: list[Message] = []

    async def main() -> None:
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive() -> Message:
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            sent.append(message)

        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            ctx = context_of(scope)
            seen.update(model=ctx.ledger.model.name, charged=ctx.ledger.charged)
            await ctx.client.answer_json(200, {"ok": True})

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/responses",
            "headers": [(b"content-length", str(len(raw)).encode())],
        }
        guard = BudgetMiddleware(
            inner,
            limits=Limits(max_retained_bytes=LIMIT),
            router=ModelRouter(parse_models(models or {})),
            charge_model=ChargeModel.named(server),
        )
        await guard(scope, receive, send)

    asyncio.run(main())
    start = next(m for m in sent if m["type"] == "http.response.start")
    if start["status"] != 200:
        seen.update(
            json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
        )
    return start["status"], seen


def test_the_measured_default_admits_what_the_reference_clamp_refuses() -> None:
    raw = body("m", 3 << 20)  # a 3 MiB body: over the reference clamp (64 MiB / 32 = 2 MiB)
    status, seen = serve(raw, server="measured")
    assert status == 200 and seen["model"] == "measured"
    assert seen["charged"] == ChargeModel.measured().measured_input(json_features(raw), False)
    status, seen = serve(raw, server="reference")
    assert status == 413 and seen["error"]["code"] == "request_too_large"
    assert "reference charge model" in seen["error"]["message"]


def test_a_routed_request_is_charged_again_at_its_models_price() -> None:
    models = {"big": {"charge_model": "measured"}, "small": {"charge_model": "reference"}}
    raw = body("big", 3 << 20)
    status, seen = serve(raw, server="reference", models=models)  # the clamp is the measured one
    assert (status, seen["model"]) == (200, "measured")
    status, seen = serve(body("small", 3 << 20), server="reference", models=models)
    # admitted under the permissive clamp, then re-charged at the reference price: 32 x 3 MiB > 64 MiB
    assert status == 413 and seen["error"]["code"] == "max_retained_bytes_exceeded"
    small = body("small", 1 << 20)  # 1 MiB fits the reference price (32 x 1 MiB = 32 MiB)
    assert serve(small, server="reference", models=models)[1]["model"] == "reference"


def test_a_body_over_the_most_permissive_clamp_is_refused_before_it_is_read() -> None:
    clamp = ChargeModel.measured().body_clamp(LIMIT)
    raw = body("m", clamp + 1)
    status, seen = serve(raw, server="measured")
    assert status == 413 and seen["error"]["code"] == "request_too_large"
    assert f"{clamp / 1048576:.2f} MiB clamp" in seen["error"]["message"]


def test_the_setting_is_measured_by_default_and_validated() -> None:
    assert Settings().loop.charge_model == "measured"
    assert Settings(charge_model="reference").loop.charge_model == "reference"
    with pytest.raises(ValueError, match="charge_model must be measured or reference"):
        Settings(charge_model="cpython")
