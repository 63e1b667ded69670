"""Fuzzed limit boundaries end to end (issue 9): Hypothesis against a real uvicorn, a scripted
upstream and a real MCP server.

* Create bodies: for generated bodies and ``loopwarden-max-retained-bytes`` values the gateway answers
  413 exactly when the ledger's input charge (the default measured model's, from the body's
  `budget.json_features`; the model's raw clamp first) exceeds the limit, and calls the upstream
  otherwise — the same for ``Content-Length`` and chunked uploads, whatever the chunking.
* Upstream SSE: the client-visible events and outcome of a generated stream do not depend on where
  the upstream's chunks were cut.
* Tool results: a generated result is refused with 502 / exactly one SSE error frame exactly when
  its charge (32 x bytes + 256 x nodes, x 2 with store) no longer fits on top of what the request
  holds; over ``tool_max_result_bytes`` it is an error output instead and never charged (that
  gateway runs the reference model, whose price these tests state).

Each property shares one gateway per module and resets the mock between examples.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from budget import ChargeModel, count_json_nodes, json_features
from tests.helpers import (
    DONE,
    FC,
    PRE,
    MetricDelta,
    gateway,
    message_item,
    response_obj,
    sse_events,
    text_delta,
)
from tests.loop.test_loop_e2e import LOG, TOOLS_DECL, build_server
from tests.mock_upstream import RST, E, MockUpstream, Reply
from tests.servers import serve_asgi

MODEL = ChargeModel.measured()  # the gateway's default, for create bodies
TOOL_MODEL = ChargeModel.reference()  # the tool gateway's (``charge_model="reference"``)
SERVER_LIMIT = 4 * 1048576  # the gateway's own max_retained_bytes in this module
TOOL_CAP = 20_000  # tool_max_result_bytes of the tool gateway
FUZZ = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HEADER = "loopwarden-max-retained-bytes"
PHASE = re.compile(r"\((\w+)\): it needs")


@pytest.fixture(scope="module")
def upstream() -> Iterator[MockUpstream]:
    with MockUpstream() as mock:
        yield mock


@pytest.fixture(scope="module")
def gw(upstream: MockUpstream) -> Iterator[str]:
    with gateway(upstream, max_retained_bytes=SERVER_LIMIT) as (url, _):
        yield url


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with serve_asgi(build_server().streamable_http_app()) as url:
        yield url + "/mcp"


@pytest.fixture(scope="module")
def tool_gw(upstream: MockUpstream, mcp_url: str) -> Iterator[str]:
    with gateway(
        upstream,
        charge_model="reference",
        max_retained_bytes=SERVER_LIMIT,
        mcp_server=(f"tools={mcp_url}",),
        tool_timeout=10.0,
        tool_max_result_bytes=TOOL_CAP,
    ) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def settled(m: MetricDelta, name: str, want: float, timeout: float = 2.0, **labels: str) -> float:
    """The metric's delta once it reaches `want` (the gateway counts an outcome just after it
    sent it, so a fast client can look first), or its value at the timeout."""
    deadline = time.monotonic() + timeout
    while m.delta(name, **labels) != want and time.monotonic() < deadline:
        time.sleep(0.005)
    return m.delta(name, **labels)


def reset(upstream: MockUpstream) -> None:
    upstream.replies.clear()
    upstream.requests.clear()


def ok_reply() -> Reply:
    return Reply.json(response_obj([message_item("ok")]))


# -- strategies -----------------------------------------------------------------------------------
# Any Unicode scalar except lone surrogates (those are a 400 of their own, B21).
CHARS = st.characters(codec="utf-8", exclude_categories=("Cs",))
PIECE = st.text(CHARS, max_size=12)


@st.composite
def long_text(draw: st.DrawFn, max_repeat: int = 700) -> str:
    """A text of up to ~8 KiB: a short generated piece repeated (generating long text is slow)."""
    return draw(PIECE) * draw(st.integers(0, max_repeat))


MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "developer", "assistant"]),
        "content": long_text(max_repeat=40),
    },
    optional={"type": st.just("message")},
)
EXTRAS = st.fixed_dictionaries(
    {},
    optional={
        "metadata": st.dictionaries(st.text("abcdefgh", min_size=1, max_size=8), PIECE, max_size=5),
        "temperature": st.floats(0, 2, allow_nan=False),
        "max_output_tokens": st.integers(1, 100_000),
        "instructions": long_text(max_repeat=100),
        "parallel_tool_calls": st.booleans(),
        "tools": st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "name": st.text("abcxyz_", min_size=1, max_size=10),
                    "parameters": st.just({"type": "object", "properties": {}}),
                }
            ),
            max_size=3,
            unique_by=lambda t: t["name"],
        ),
    },
)


@st.composite
def create_body(draw: st.DrawFn, store: Any = None) -> tuple[bytes, bool]:
    """(raw body, whether the store is on). ``store``: None (field absent), True or False."""
    body: dict[str, Any] = {"model": "m"}
    body["input"] = draw(st.one_of(long_text(), st.lists(MESSAGE, max_size=30)))
    body.update(draw(EXTRAS))
    if store is not None:
        body["store"] = store
    items = list(body.items())
    order = draw(st.permutations(range(len(items))))
    ordered = dict(items[i] for i in order)
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (",", ": ")]))
    indent = draw(st.sampled_from([None, None, 1]))
    raw = json.dumps(ordered, separators=separators, indent=indent, ensure_ascii=draw(st.booleans())).encode()
    return raw, store is not False


def chunks_of(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the given offsets; no empty pieces (an empty HTTP chunk would end the body)."""
    points = sorted({c for c in cuts if 0 < c < len(data)})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    return [p for p in pieces if p]


def cuts_for(data: Any, size: int) -> list[int]:
    """Generated cut offsets for `size` bytes; sometimes one byte per chunk (small payloads)."""
    if size <= 600 and data.draw(st.booleans()):
        return list(range(1, size))
    return data.draw(st.lists(st.integers(0, max(size, 1)), max_size=12))


# -- 1. create bodies: 413 exactly at the input charge ---------------------------------------------
def expected_input_outcome(raw: bytes, store: bool, limit: int) -> tuple[int, str | None]:
    """(413, code) or (0, None) for "served", per DESIGN.md §3 order and §4 charges."""
    if len(raw) > MODEL.body_clamp(limit):
        return 413, "request_too_large"
    charge = MODEL.measured_input(json_features(raw), store)
    if charge > limit:
        return 413, "max_retained_bytes_exceeded"
    return 0, None


def check_input_property(
    client: httpx.Client, upstream: MockUpstream, url: str, raw: bytes, store: bool, header: int, data: Any
) -> None:
    limit = min(header, SERVER_LIMIT)
    want_status, want_code = expected_input_outcome(raw, store, limit)
    event(f"expected: {want_code or 'served'}")
    chunks = chunks_of(raw, cuts_for(data, len(raw)))
    assert b"".join(chunks) == raw
    m = MetricDelta()
    answers = post_both_ways_served(client, upstream, url, raw, chunks, {HEADER: str(header)})
    for mode, (response, called) in zip(("content-length", "chunked"), answers, strict=True):
        if want_status == 413:
            assert response.status_code == 413, (mode, response.text)
            error = response.json()["error"]
            assert error["code"] == want_code, (mode, error)
            assert error["type"] == "invalid_request_error"
            assert response.headers["x-should-retry"] == "false"
            assert called == 0, f"{mode}: the upstream was called for a refused body"
        else:
            assert response.status_code != 413, (mode, response.text)
            assert response.status_code in (200, 502), (mode, response.text)
            if response.status_code == 502:  # the reply, not the input, did not fit
                assert response.json()["error"]["code"] == "max_retained_bytes_exceeded", response.text
            assert called == 1, f"{mode}: an admitted body must reach the upstream"
    if want_status == 413:  # one cap hit per refused upload
        label = "request_body" if want_code == "request_too_large" else "max_retained_bytes"
        assert settled(m, "loopwarden_cap_hits_total", 2, limit=label, outcome="413") == 2


def post_both_ways_served(
    client: httpx.Client,
    upstream: MockUpstream,
    url: str,
    raw: bytes,
    chunks: list[bytes],
    headers: dict[str, str],
) -> list[tuple[httpx.Response, int]]:
    out = []
    for body in (raw, chunks):
        reset(upstream)
        upstream.push(ok_reply())
        content: Any = body if isinstance(body, bytes) else iter(body)
        response = client.post(
            url + "/v1/responses",
            content=content,
            headers={"content-type": "application/json", **headers},
        )
        out.append((response, len(upstream.requests)))
    reset(upstream)
    return out


@st.composite
def limit_near(draw: st.DrawFn, raw: bytes, store: bool) -> int:
    """A header value near the body's charge or its clamp (exact boundaries included)."""
    charge = MODEL.measured_input(json_features(raw), store)
    clamp_edge = -(-len(raw) * 3 // 2)  # the smallest limit whose clamp admits the body
    centre = draw(st.sampled_from([charge, clamp_edge, charge, SERVER_LIMIT]))
    delta = draw(st.one_of(st.integers(-3, 3), st.integers(-centre // 2, centre // 2)))
    return max(4096, min(268_435_456, centre + delta))


@FUZZ
@given(data=st.data())
def test_413_exactly_when_the_input_charge_exceeds_the_limit(
    data: Any, client: httpx.Client, upstream: MockUpstream, gw: str
) -> None:
    raw, store = data.draw(create_body(store=data.draw(st.sampled_from([None, True]))))
    header = data.draw(limit_near(raw, store))
    check_input_property(client, upstream, gw, raw, store, header, data)


@FUZZ
@given(data=st.data())
def test_store_false_bodies_are_charged_at_the_single_rate(
    data: Any, client: httpx.Client, upstream: MockUpstream, gw: str
) -> None:
    """DESIGN.md §4: only "store active (store not false)" doubles the input charge; README's cost
    table promises a 1.98 MiB create body at 64 MiB with the store off."""
    raw, store = data.draw(create_body(store=False))
    assert store is False
    header = data.draw(limit_near(raw, store))
    check_input_property(client, upstream, gw, raw, store, header, data)


def test_store_false_body_between_the_single_and_the_double_charge_is_served(
    client: httpx.Client, upstream: MockUpstream, gw: str
) -> None:
    """The minimal reproduction of the property above: 640,000 characters of text with "store":
    false fit a 4 MiB limit without the store's projection and would not with it."""
    raw = json.dumps({"model": "m", "input": "a" * 640_000, "store": False}, separators=(",", ":")).encode()
    assert MODEL.measured_input(json_features(raw), False) <= SERVER_LIMIT
    assert MODEL.measured_input(json_features(raw), True) > SERVER_LIMIT
    reset(upstream)
    upstream.push(ok_reply())
    r = client.post(gw + "/v1/responses", content=raw, headers={"content-type": "application/json"})
    called = len(upstream.requests)
    reset(upstream)
    assert r.status_code != 413, r.text
    assert called == 1


# -- 2. upstream SSE: the outcome does not depend on the chunking ---------------------------------
EOLS = (b"\n", b"\r\n", b"\r")
NOISE = (b": keep-alive", b":", b"retry: 3000", b"id: 7", b"event: ping", b"data:")
DELTA = st.text(CHARS, min_size=1, max_size=30)


@st.composite
def upstream_stream(draw: st.DrawFn) -> tuple[list[bytes], str]:
    """(the stream as logical blocks, how it ends)."""
    deltas = draw(st.lists(DELTA, min_size=1, max_size=8))
    ending = draw(st.sampled_from(["completed", "completed", "incomplete", "rst", "error", "call"]))
    blocks: list[bytes] = [*PRE()]
    blocks += [text_delta(2 + i, d) for i, d in enumerate(deltas)]
    seq = 2 + len(deltas)
    text = "".join(deltas)
    if ending == "call":
        args = json.dumps({"q": text})
        call = FC("call_c", "get_time", args)
        blocks.append(
            E(
                "response.output_item.added",
                {
                    "type": "response.output_item.added",
                    "sequence_number": seq,
                    "output_index": 1,
                    "item": {**call, "arguments": "", "status": "in_progress"},
                },
            )
        )
        cut = draw(st.integers(0, len(args)))
        for j, part in enumerate((args[:cut], args[cut:])):
            blocks.append(
                E(
                    "response.function_call_arguments.delta",
                    {
                        "type": "response.function_call_arguments.delta",
                        "sequence_number": seq + 1 + j,
                        "item_id": call["id"],
                        "output_index": 1,
                        "delta": part,
                    },
                )
            )
        blocks.append(DONE(seq + 3, [message_item(text), call]))
    elif ending == "completed":
        blocks.append(DONE(seq, [message_item(text)]))
    elif ending == "incomplete":
        blocks.append(
            E(
                "response.incomplete",
                {
                    "type": "response.incomplete",
                    "sequence_number": seq,
                    "response": response_obj(
                        [message_item(text)],
                        status="incomplete",
                        incomplete_details={"reason": "max_output_tokens"},
                    ),
                },
            )
        )
    elif ending == "error":
        blocks.append(
            b'event: error\ndata: {"type":"error","sequence_number":%d,"code":"server_error","message":"boom","param":null}\n\n'
            % seq
        )
        blocks.append(DONE(seq + 1, [message_item(text)]))
    noisy: list[bytes] = []
    for block in blocks:
        for line in draw(st.lists(st.sampled_from(NOISE), max_size=2)):
            noisy.append(line + b"\n\n")
        noisy.append(block)
    return noisy, ending


REQUEST_ID = re.compile(r" ?\[request id req_\w+\]")


def normalised(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Events with the per-request values (the minted response id, request ids, and the
    ``created_at`` the gateway fills when the upstream sent none: the request's own second) made
    constant."""
    out = []
    for name, data in events:
        data = json.loads(REQUEST_ID.sub("", json.dumps(data)))
        if isinstance(data.get("response"), dict) and "id" in data["response"]:
            data["response"]["id"] = "resp_gw"
            if "created_at" in data["response"]:
                data["response"]["created_at"] = 0
        out.append((name, data))
    return out


def run_stream(
    client: httpx.Client,
    upstream: MockUpstream,
    url: str,
    parts: list[Any],
    body: dict[str, Any],
    header: int,
) -> tuple[int, list[tuple[str, Any]], bytes]:
    reset(upstream)
    upstream.push(Reply.sse(parts))
    r = client.post(url + "/v1/responses", json=body, headers={HEADER: str(header)})
    reset(upstream)
    return r.status_code, normalised(sse_events(r.content)) if r.status_code == 200 else [], r.content


@FUZZ
@given(stream=upstream_stream(), data=st.data())
def test_client_events_do_not_depend_on_the_upstream_chunking(
    stream: tuple[list[bytes], str], data: Any, client: httpx.Client, upstream: MockUpstream, gw: str
) -> None:
    blocks, ending = stream
    eol = data.draw(st.sampled_from(EOLS))
    wire = b"".join(blocks).replace(b"\n", eol)
    tail: list[Any] = [RST] if ending == "rst" else []
    body = {"model": "m", "input": "x", "stream": True, "store": data.draw(st.booleans())}
    ref_status, reference, ref_raw = run_stream(client, upstream, gw, [wire, *tail], body, SERVER_LIMIT)
    status, events, raw = run_stream(
        client, upstream, gw, [*chunks_of(wire, cuts_for(data, len(wire))), *tail], body, SERVER_LIMIT
    )
    assert (status, events) == (ref_status, reference)
    assert ref_status == 200
    names = [n for n, _ in reference]
    assert names[0] == "response.created"
    terminal = {
        "completed": "response.completed",
        "call": "response.completed",
        "incomplete": "response.incomplete",
        "rst": "response.failed",
        "error": "response.failed",
    }[ending]
    assert names[-1] == terminal and names.count(terminal) == 1, names
    assert ending not in ("rst", "error") or names[-2] == "error"
    assert not any(n in ("response.completed", "response.incomplete") for n in names[:-1])
    assert b"\r" not in ref_raw and b"\r" not in raw
    assert [d["sequence_number"] for _, d in reference] == list(range(len(reference)))


@FUZZ
@given(stream=upstream_stream(), data=st.data())
def test_outcome_near_the_ledger_limit_does_not_depend_on_the_upstream_chunking(
    stream: tuple[list[bytes], str], data: Any, client: httpx.Client, upstream: MockUpstream, gw: str
) -> None:
    """The same under a tight limit, where the stream's charges decide between completing and one
    error frame (the frame parse is charged on the whole frame whatever the chunking, DESIGN.md §4)."""
    blocks, ending = stream
    wire = b"".join(blocks)
    tail: list[Any] = [RST] if ending == "rst" else []
    body = {"model": "m", "input": "x", "stream": True}
    header = data.draw(st.integers(16_384, 262_144))
    ref = run_stream(client, upstream, gw, [wire, *tail], body, header)
    cut = run_stream(client, upstream, gw, [*chunks_of(wire, cuts_for(data, len(wire))), *tail], body, header)
    assert (cut[0], outcome_of(cut[1])) == (ref[0], outcome_of(ref[1]))


def test_same_stream_in_one_chunk_or_three_has_the_same_outcome_at_every_limit(
    client: httpx.Client, upstream: MockUpstream, gw: str
) -> None:
    """The minimal case, swept: a 631-byte stream (PRE, DONE) written in one socket write or in
    three, at every limit from where it cannot start to where it completes. (Before the fix, a
    30,000-byte limit completed the three-write stream and refused the one-write one with 502: the
    chunk's 48 x 631 = 30,288-byte need was checked whole.)"""
    parts = [*PRE(), DONE(2, [message_item("hi")])]
    body = {"model": "m", "input": "x", "stream": True}
    seen = set()
    for limit in range(4_096, 30_001, 500):
        three = run_stream(client, upstream, gw, parts, body, limit)
        one = run_stream(client, upstream, gw, [b"".join(parts)], body, limit)
        assert (one[0], outcome_of(one[1])) == (three[0], outcome_of(three[1])), (limit, one[2][:300])
        seen.add(three[0] if three[0] != 200 else [n for n, _ in three[1]][-1])
    assert {"response.completed"} < seen, "the sweep crosses the stream's boundary"


def outcome_of(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Events with error frames reduced to their code (the message quotes ledger amounts)."""
    return [(n, d["code"] if n == "error" else d) for n, d in events]


# -- 3. tool results: 502 / one error frame exactly at the ledger boundary --------------------------
TOOL_TEXT = st.sampled_from(["r", "rn", "x1", "tf ", "ab[", "é"])
TOOL_CALL = FC("call_q", "query_db", "{}")
CALL_BODY = json.dumps(response_obj([TOOL_CALL]), separators=(",", ":")).encode()


CALL_STREAM = [*PRE(), DONE(2, [TOOL_CALL])]
REMAIN = re.compile(r"\(tool_result\): it needs [\d,]+ bytes but only ([\d,]+) of ([\d,]+) remain")


def tool_body(store: bool, stream: bool, input_size: int) -> bytes:
    return json.dumps(
        {"model": "m", "input": "q" * input_size, "tools": [TOOLS_DECL], "stream": stream, "store": store},
        separators=(",", ":"),
    ).encode()


def first_round(stream: bool) -> Reply:
    return Reply.sse(CALL_STREAM) if stream else Reply.json(CALL_BODY)


@pytest.fixture(scope="module")
def held_besides_input(
    client: httpx.Client, upstream: MockUpstream, tool_gw: str
) -> dict[tuple[bool, bool], int]:
    """What a one-round request holds, besides its input, when its tool results are charged
    (the tool lists, the round's answer until its items are recorded, ...), per (store, stream).

    Read once from the gateway itself: a probe whose 20,000-byte result cannot fit reports how
    much of its limit remained. The properties below then check the tool-result charge
    (32 x bytes + 256 x nodes, x 2 with store) exactly against that."""
    held = {}
    for store in (False, True):
        for stream in (False, True):
            body = tool_body(store, stream, 0)
            limit = 1048576 if store else 600_000
            LOG.__init__()  # type: ignore[misc]
            LOG.big_result = "r" * TOOL_CAP
            reset(upstream)
            upstream.push(first_round(stream), ok_reply())
            r = client.post(
                tool_gw + "/v1/responses",
                content=body,
                headers={"content-type": "application/json", HEADER: str(limit)},
            )
            reset(upstream)
            found = REMAIN.search(r.text.replace("\\", ""))
            assert found is not None, r.text[:600]
            remaining, of = (int(g.replace(",", "")) for g in found.groups())
            assert of == limit
            held[(store, stream)] = (
                limit - remaining - TOOL_MODEL.input_charge(len(body), count_json_nodes(body), store)
            )
            assert held[(store, stream)] >= 0
    return held


@FUZZ
@given(data=st.data())
def test_tool_result_is_refused_exactly_at_the_ledger_boundary(
    data: Any,
    client: httpx.Client,
    upstream: MockUpstream,
    tool_gw: str,
    held_besides_input: dict[tuple[bool, bool], int],
) -> None:
    store, stream = data.draw(st.booleans()), data.draw(st.booleans())
    body = tool_body(store, stream, data.draw(st.integers(0, 200)))
    held = (
        TOOL_MODEL.input_charge(len(body), count_json_nodes(body), store)
        + held_besides_input[(store, stream)]
    )
    # room for reading the first round's answer (a buffered body is charged whole while it is
    # parsed; a stream's chunks and frames need transient room) and some tool result
    output_room = TOOL_MODEL.output_charge(len(CALL_BODY), count_json_nodes(CALL_BODY), store)
    header = data.draw(st.integers(held + output_room + 65_536, SERVER_LIMIT))
    # a result size near the boundary, or anywhere up to past the per-call cap
    boundary = (header - held) // (TOOL_MODEL.tool_per_byte * (2 if store else 1))
    size = data.draw(
        st.one_of(st.integers(max(0, boundary - 40), boundary + 40), st.integers(0, TOOL_CAP + 2000))
    )
    unit = data.draw(TOOL_TEXT)
    text = (unit * (size // len(unit.encode()) + 1)).encode()[:size].decode("utf-8", "ignore")
    raw = text.encode()
    charge = TOOL_MODEL.tool_result_charge(len(raw), count_json_nodes(raw), store)

    LOG.__init__()  # type: ignore[misc]
    LOG.big_result = text
    reset(upstream)
    upstream.push(first_round(stream), ok_reply())
    m = MetricDelta()
    r = client.post(
        tool_gw + "/v1/responses",
        content=body,
        headers={"content-type": "application/json", HEADER: str(header)},
    )
    calls = len(upstream.requests)
    sent = upstream.requests[1].json()["input"] if calls > 1 else []
    reset(upstream)
    assert LOG.count("query_db") == 1, (r.status_code, r.text[:600])
    if stream:
        assert r.status_code == 200
        events = sse_events(r.content)
        names = [n for n, _ in events]
        assert names.count("error") <= 1
        failure = events[-2][1] if "error" in names else None
    else:
        failure = r.json()["error"] if r.status_code != 200 else None
        assert failure is None or r.status_code == 502, r.text
    found = PHASE.search(failure["message"]) if failure is not None else None
    phase = found.group(1) if found is not None else None
    outputs = [i["output"] for i in sent if i.get("type") == "function_call_output"]
    event(
        "over the per-call cap"
        if len(raw) > TOOL_CAP
        else "refused"
        if held + charge > min(header, SERVER_LIMIT)
        else "kept"
    )
    if len(raw) > TOOL_CAP:
        # over the per-call cap: an error output for the model, never charged
        assert phase != "tool_result", failure
        assert settled(m, "loopwarden_tool_calls_total", 1, outcome="too_large") == 1
        assert calls == 1 or (len(outputs) == 1 and "per-call cap" in outputs[0])
    elif held + charge > min(header, SERVER_LIMIT):
        assert failure is not None, f"a {charge}-byte result on top of {held} must not fit {header}"
        assert failure["code"] == "max_retained_bytes_exceeded"
        assert phase == "tool_result", failure["message"]
        assert calls == 1, "the refused result never goes upstream"
        outcome = "sse_error" if stream else "502"
        assert settled(m, "loopwarden_cap_hits_total", 1, limit="max_retained_bytes", outcome=outcome) == 1
    else:
        assert phase != "tool_result", failure
        assert settled(m, "loopwarden_tool_calls_total", 1, outcome="ok") == 1
        if failure is None:
            assert outputs == [text]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_result_exactly_at_the_limit_is_kept_one_byte_more_is_refused(
    stream: bool,
    client: httpx.Client,
    upstream: MockUpstream,
    tool_gw: str,
    held_besides_input: dict[tuple[bool, bool], int],
) -> None:
    """A result of ``n`` bytes of "r" (no nodes) costs exactly 64 x n with store on: with the limit
    set to what the request holds plus that, the result is kept; with one byte more it is refused."""
    body = tool_body(True, stream, 1)
    held = (
        TOOL_MODEL.input_charge(len(body), count_json_nodes(body), True) + held_besides_input[(True, stream)]
    )
    n = 8000  # 512,000 budget bytes: more than reading the first round's answer needs
    header = held + TOOL_MODEL.tool_result_charge(n, 0, True)
    phases = []
    for size in (n, n + 1):
        LOG.__init__()  # type: ignore[misc]
        LOG.big_result = "r" * size
        reset(upstream)
        upstream.push(first_round(stream), ok_reply())
        r = client.post(
            tool_gw + "/v1/responses",
            content=body,
            headers={"content-type": "application/json", HEADER: str(header)},
        )
        reset(upstream)
        if stream:
            events = sse_events(r.content)
            message = events[-2][1]["message"] if len(events) > 1 and events[-2][0] == "error" else ""
        else:
            message = r.json()["error"]["message"] if r.status_code != 200 else ""
        found = PHASE.search(message)
        phases.append(found.group(1) if found else None)
    assert phases[0] not in ("tool_result", "output", "input")  # kept; a later charge may still overflow
    assert phases[1] == "tool_result"
