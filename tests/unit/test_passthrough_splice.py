"""The buffered pass-through answers an upstream object that only lacked members by inserting them
into the upstream's own bytes (`middleware.loop.passthrough.splice_members`, issue 21): the client
gets the same object as a re-encode, the features charged cover every byte of the answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import ChargeModel, Ledger, json_features
from middleware.loop.echo import normalise_response
from middleware.loop.passthrough import splice_event_response, splice_members

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


# -- lifecycle and terminal events of a stream (`splice_event_response`) -------------------------
def event_answer(data: bytes) -> tuple[bytes | None, dict[str, Any]]:
    event = json.loads(data)
    before = dict(event["response"])
    normalise_response(event["response"], REQUEST, created_at=1)
    return splice_event_response(data, event, event["response"], before), event


_KEYS = st.permutations(["type", "response", "sequence_number"])
_WS = st.sampled_from(["", " ", "\n", "\t ", "\r\n"])


@settings(max_examples=300, deadline=None)
@given(
    order=_KEYS,
    drop=st.sets(st.sampled_from(sorted(UPSTREAM))),
    ws=st.lists(_WS, min_size=8, max_size=8),
    sequence=st.sampled_from(["3", "3.0", "-0", "30e-1", "true"]),
    escaped=st.booleans(),
)
def test_an_event_splice_is_the_re_encodes_event_or_refused(
    order: list[str], drop: set[str], ws: list[str], sequence: str, escaped: bool
) -> None:
    """Whatever the member order, whitespace and number spelling: the spliced bytes decode to the
    re-encode's event, members in the same order, the upstream's bytes kept; or there is no
    splice (the caller re-encodes). With ``response`` last, or before a ``sequence_number``
    written as an integer, there always is one."""
    response = {key: value for key, value in UPSTREAM.items() if key not in drop}
    members = {
        "type": json.dumps("response.completed"),
        "response": json.dumps(response, indent=1 if ws[0] else None),
        "sequence_number": sequence,
    }
    name = {"sequence_number": '"sequence\\u005fnumber"' if escaped else '"sequence_number"'}
    text = (
        "{"
        + ws[1]
        + ("," + ws[2]).join(
            f"{name.get(key, json.dumps(key))}{ws[3]}:{ws[4]}{members[key]}{ws[5]}" for key in order
        )
    )
    data = (text + "}" + ws[6]).encode()
    spliced, event = event_answer(data)
    if spliced is not None:
        assert json.loads(spliced) == event
        assert list(json.loads(spliced)["response"]) == list(event["response"])
        assert spliced.startswith(data[: data.index(b'"response"')])  # the upstream's bytes, as they came
    provable = response and (
        order[-1] == "response"
        or (order[1:] == ["response", "sequence_number"] and not escaped and sequence in ("3", "-0"))
    )
    if provable:
        assert spliced is not None


def test_an_event_whose_response_only_lacked_members_keeps_the_upstreams_bytes() -> None:
    data = json.dumps({"type": "response.created", "response": UPSTREAM, "sequence_number": 0}).encode()
    spliced, event = event_answer(data)
    assert spliced is not None and json.loads(spliced) == event
    cut = data.rindex(b'}, "sequence_number"')
    assert spliced[:cut] == data[:cut] and spliced.endswith(data[cut:])
    assert json.loads(spliced)["response"]["temperature"] == 0.5


def test_an_event_with_a_replaced_or_empty_response_is_re_encoded() -> None:
    replaced = {"type": "response.created", "response": {**UPSTREAM, "top_logprobs": None}}
    assert event_answer(json.dumps(replaced).encode())[0] is None
    assert event_answer(b'{"type":"response.created","response":{}}')[0] is None


def test_an_event_with_nothing_added_is_its_own_bytes() -> None:
    response = json.loads(json.dumps(UPSTREAM))
    normalise_response(response, REQUEST, created_at=1)
    data = json.dumps({"type": "response.created", "response": response}).encode()
    assert event_answer(data)[0] == data


def test_the_added_members_features_are_those_of_their_own_bytes_each_time() -> None:
    """The inserted members' features are cached by their bytes (`_added_features`): each answer
    still gets the features of what was inserted into it, not of an earlier request's members."""
    body = json.dumps(UPSTREAM).encode()
    seen = set()
    for request in (REQUEST, {**REQUEST, "temperature": 0.25, "metadata": {"k": "v" * 30}}, REQUEST):
        parsed = json.loads(body)
        before = dict(parsed)
        normalise_response(parsed, request, created_at=1)
        spliced = splice_members(body, json_features(body), parsed, before)
        assert spliced is not None
        data, features = spliced
        assert json.loads(data) == parsed
        added = {key: value for key, value in parsed.items() if key not in UPSTREAM}
        assert features == json_features(body).combine(
            json_features(json.dumps(added, separators=(",", ":")).encode())
        )
        seen.add(features)
    assert len(seen) == 2  # two different insertions, two different counts
