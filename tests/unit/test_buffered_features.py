"""A buffered upstream body is node-counted once (issue 21 item 2): `read_response_object` hands
its `JsonFeatures` on, and the pass-through's unchanged answer is charged (`admit_terminal`) with
them instead of counting the same bytes again: the same charge, so the same 502/413 boundary."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pytest

from budget import BudgetExceeded, ChargeModel, Ledger, json_features
from middleware.upstream.reader import read_response_object

MEASURED = ChargeModel.measured()  # the gateway's default (a bare Ledger's is the reference)
ITEM = {
    "type": "message",
    "id": "msg_1",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "héllo \\u00e9 " * 40, "annotations": []}],
}
BODY = json.dumps(
    {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": [ITEM, ITEM]},
    indent=1,
).encode()


def response_of(parts: list[bytes]) -> Any:
    class Response:
        status_code = 200
        headers: ClassVar[dict[str, str]] = {"content-type": "application/json"}

        async def chunks(self) -> AsyncIterator[bytes]:
            for part in parts:
                yield part

        async def aclose(self) -> None:
            return None

    return Response()


def read(ledger: Ledger, cut: int) -> Any:
    parts = [BODY[:cut], BODY[cut:]] if cut else [BODY]
    return asyncio.run(read_response_object(response_of(parts), ledger))


@pytest.mark.parametrize("cut", [0, 1, 7, len(BODY) // 2, len(BODY) - 1])
def test_the_features_handed_on_are_the_bodys_whatever_the_chunking(cut: int) -> None:
    answer = read(Ledger(1 << 26, MEASURED), cut)
    assert answer.body == BODY
    assert answer.features == json_features(BODY)


def test_the_reference_model_hands_on_no_features() -> None:
    answer = read(Ledger(1 << 26, ChargeModel.reference()), 0)
    assert answer.features is None


@pytest.mark.parametrize("store", [False, True])
def test_the_terminal_charge_and_its_boundary_are_byte_exact(store: bool) -> None:
    answer = read(Ledger(1 << 26, MEASURED, store=store), 5)
    counted = Ledger(1 << 26, MEASURED, store=store).admit_terminal(BODY)
    assert Ledger(1 << 26, MEASURED, store=store).admit_terminal(BODY, features=answer.features) == counted
    # at the boundary: the answer fits a ledger with exactly that many bytes, not one fewer
    fits = Ledger(counted, MEASURED, store=store)
    assert fits.admit_terminal(BODY, features=answer.features) == counted
    assert fits.charged == fits.limit
    with pytest.raises(BudgetExceeded) as info:
        Ledger(counted - 1, MEASURED, store=store).admit_terminal(BODY, features=answer.features)
    assert info.value.phase == "terminal"
