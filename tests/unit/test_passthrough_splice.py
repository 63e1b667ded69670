"""The buffered pass-through answers an upstream object that only lacked members by inserting them
into the upstream's own bytes (`middleware.loop.passthrough.splice_members`, issue 21): the client
gets the same object as a re-encode, the features charged cover every byte of the answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from budget import ChargeModel, Ledger, json_features
from middleware.loop.echo import normalise_response
from middleware.loop.passthrough import splice_members

REQUEST = {"model": "m", "input": "hi", "temperature": 0.5}
UPSTREAM = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1700000000,
    "status": "completed",
    "model": "m",
    "output": [{"type": "message", "id": "msg_1", "role": "assistant", "content": []}],
    "tools": [],
}


def answer(body: bytes) -> tuple[tuple[bytes, Any] | None, dict[str, Any]]:
    parsed = json.loads(body)
    before = dict(parsed)
    assert normalise_response(parsed, REQUEST, created_at=1)
    return splice_members(body, json_features(body), parsed, before), parsed


@pytest.mark.parametrize("indent", [None, 2])
def test_added_members_are_inserted_into_the_upstreams_bytes(indent: int | None) -> None:
    body = json.dumps(UPSTREAM, indent=indent).encode() + b"\n"
    spliced, parsed = answer(body)
    assert spliced is not None
    data, features = spliced
    assert json.loads(data) == parsed  # the re-encode's object, members in the same order
    assert list(json.loads(data)) == list(parsed)
    assert data.startswith(body.rstrip()[:-1])  # the upstream's bytes, as they came
    assert json.loads(data)["temperature"] == 0.5  # the request's value, echoed
    added = {key: value for key, value in parsed.items() if key not in UPSTREAM}
    assert features == json_features(body).combine(
        json_features(json.dumps(added, separators=(",", ":")).encode())
    )


def test_the_features_charged_cover_the_answer() -> None:
    body = json.dumps(UPSTREAM).encode()
    spliced, _ = answer(body)
    assert spliced is not None
    data, features = spliced
    exact = json_features(data)
    for field in ("nbytes", "nodes", "strings", "numbers", "objects", "arrays", "members", "string_bytes"):
        assert getattr(features, field) >= getattr(exact, field), field
    model = ChargeModel.measured()
    charged = Ledger(1 << 26, model).admit_terminal(data, features=features)
    assert charged >= Ledger(1 << 26, model).admit_terminal(data)


def test_a_replaced_member_is_answered_by_a_re_encode() -> None:
    body = json.dumps({**UPSTREAM, "top_logprobs": None}).encode()  # null: the spec wants an int
    spliced, parsed = answer(body)
    assert spliced is None
    assert parsed["top_logprobs"] == 0


def test_nothing_added_keeps_the_body() -> None:
    parsed = json.loads(json.dumps(UPSTREAM))
    body = json.dumps(UPSTREAM).encode()
    f = json_features(body)
    assert splice_members(body, f, parsed, dict(parsed)) == (body, f)


def test_a_body_in_utf16_is_re_encoded() -> None:
    body = json.dumps(UPSTREAM).encode("utf-16-le")
    parsed = json.loads(body)  # json.loads reads UTF-16 as well
    before = dict(parsed)
    normalise_response(parsed, REQUEST, created_at=1)
    assert splice_members(body, None, parsed, before) is None
