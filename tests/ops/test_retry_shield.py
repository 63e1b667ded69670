"""The retry shield (issue 18 item 3, DESIGN.md §5 last row) and the log lines of what it adds (item 8).

A deterministic failure decided after the whole body was read is remembered per worker under the
caller's identity, its limits and the body's digest; the same request within
``--retry-shield-seconds`` gets the same answer at once, with ``loopwarden-retry-shield: hit``,
no upstream call and no tool run. Transient failures are not shielded. The Codex CLI ignores
``x-should-retry: false`` and retried one request 30 times: `codex_like` retries like it, and the
upstream sees one call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import httpx
import pytest

from middleware import outcomes
from middleware.errors import InvalidRequest, LoopLimitReached, Overloaded, ShieldHit
from middleware.ops.admission import ProcessPool
from middleware.ops.shield import (
    ENTRY_OVERHEAD,
    POOL_CALLER,
    Remembered,
    RetryShield,
    canonical_digest,
    request_key,
)
from middleware.upstream.errors import status_failure
from tests.helpers import (
    FC,
    PRE,
    B,
    MetricDelta,
    message_item,
    response_obj,
    sse_events,
    text_delta,
)
from tests.helpers import shielded_gateway as gateway
from tests.mcp_servers import Probe, build_tools_server, serve_mcp
from tests.mock_upstream import MockUpstream, Reply

HIT = "loopwarden-retry-shield"
TOOLS = [{"type": "mcp", "server_label": "tools", "require_approval": "never"}]


# -- units ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def answer(body: bytes, at: float, code: str = "invalid_value") -> Remembered:
    return Remembered(
        400, ((b"content-type", b"application/json"),), body, "invalid_request", code, "rid", at
    )


def test_an_answer_is_remembered_for_the_window_then_forgotten() -> None:
    clock = Clock()
    shield = RetryShield(seconds=30, clock=clock)
    key = request_key("addr:1.2.3.4", (B, 10), b"\0" * 32)
    assert shield.remember(key, dataclasses.replace(answer(b"{}", clock.now), caller="addr:1.2.3.4"))
    clock.now += 29.9
    hit = shield.lookup(key)
    assert hit is not None and hit.body == b"{}"
    assert shield.knows("addr:1.2.3.4") and not shield.knows("addr:5.6.7.8")
    clock.now += 0.2  # 30.1 s after the failure
    assert shield.lookup(key) is None and len(shield) == 0 and shield.held == 0
    assert not shield.knows("addr:1.2.3.4")


def test_the_key_is_the_caller_the_limits_and_the_body() -> None:
    digest = b"\1" * 32
    keys = {
        request_key("sha256:a", (B, 10), digest),
        request_key("sha256:b", (B, 10), digest),
        request_key("sha256:a", (B // 2, 10), digest),
        request_key("sha256:a", (B, 3), digest),
        request_key("sha256:a", (B, 10), b"\2" * 32),
    }
    assert len(keys) == 5
    assert request_key("sha256:a", (B, 10), digest) in keys


def test_the_canonical_digest_ignores_key_order_and_spacing_not_values() -> None:
    a = json.loads(
        '{"model":"m","tools":[{"type":"function","name":"f","parameters":{"a":1,"b":[true,null]}}]}'
    )
    b = json.loads(
        '{ "tools" : [ {"parameters":{"b":[true, null],"a":1},"name":"f","type":"function"} ], "model":"m" }'
    )
    assert canonical_digest(a) == canonical_digest(b)
    distinct = [1, 1.0, True, "1", [1], {"1": 1}, [[1]], ["a", "b"], {"a": "b"}, ["ab"], None, [], {}, ""]
    assert len({canonical_digest(v) for v in distinct}) == len(distinct)
    deep: list[object] = []
    for _ in range(5000):  # no recursion limit (the intake caps depth at 128 anyway)
        deep = [deep]
    assert len(canonical_digest(deep)) == 32


def test_entries_and_bytes_are_bounded_oldest_first() -> None:
    clock = Clock()
    shield = RetryShield(seconds=30, max_entries=3, max_bytes=8 * (ENTRY_OVERHEAD + 200), clock=clock)
    cost = answer(b"x" * 100, 0).cost
    for i in range(5):
        clock.now += 1
        assert shield.remember(bytes([i]) * 32, answer(b"x" * 100, clock.now))
    assert len(shield) == 3 and shield.held == 3 * cost
    assert [shield.lookup(bytes([i]) * 32) is not None for i in range(5)] == [False, False, True, True, True]
    # an answer over max_bytes // 8 is not remembered; a large one evicts as many as it needs
    assert not shield.remember(b"big" * 11, answer(b"y" * shield.max_entry_bytes, clock.now))
    big = answer(b"y" * (shield.max_entry_bytes - ENTRY_OVERHEAD - 40), clock.now)
    assert shield.remember(b"b" * 32, big)
    assert (
        shield.held <= shield.max_bytes
        and shield.held
        == sum(e.cost for e in (shield.lookup(bytes([i]) * 32) for i in range(5)) if e is not None) + big.cost
    )


def test_the_entries_are_held_in_the_admission_pool() -> None:
    pool = ProcessPool(10_000)
    clock = Clock()
    shield = RetryShield(seconds=30, pool=pool, clock=clock)
    first = answer(b"a" * 500, clock.now)
    assert shield.remember(b"1" * 32, first)
    assert pool.reserved == first.cost == shield.held and pool.held(POOL_CALLER) == first.cost
    assert not shield.remember(
        b"2" * 32, answer(b"b" * (10_000 - first.cost), clock.now)
    )  # no room: not kept
    assert pool.reserved == first.cost
    clock.now += 31
    assert shield.lookup(b"1" * 32) is None and pool.reserved == 0 and pool.held(POOL_CALLER) == 0
    assert shield.remember(b"3" * 32, answer(b"c", clock.now)) and pool.reserved > 0
    shield.clear()
    assert pool.reserved == 0 and len(shield) == 0


def test_seconds_zero_turns_it_off() -> None:
    shield = RetryShield(seconds=0)
    assert not shield.enabled and not shield.remember(b"k" * 32, answer(b"{}", 0.0))
    with pytest.raises(ValueError, match="must be >= 0"):
        RetryShield(seconds=-1)


@pytest.mark.parametrize(
    ("exc", "after_tools", "expected"),
    [
        (InvalidRequest("bad", code="invalid_value"), False, True),
        (LoopLimitReached("loop", calls=3, limit=3), False, True),
        (status_failure(503, b'{"error":{"message":"busy"}}', {}), False, False),
        (status_failure(429, b'{"error":{"message":"slow"}}', {"retry-after": "3"}), False, False),
        (Overloaded("full", requested=1), False, False),
        (
            status_failure(503, b'{"error":{"message":"busy"}}', {}),
            True,
            True,
        ),  # a tool with side effects ran
        (ShieldHit(answer(b"{}", 0.0), age=1.0), False, False),  # a hit is not remembered again
    ],
    ids=["400", "508", "upstream-503", "upstream-429", "pool-full", "503-after-tools", "hit"],
)
def test_the_table_decides_what_is_shielded(exc: Exception, after_tools: bool, expected: bool) -> None:
    assert outcomes.shielded(outcomes.resolve(exc, after_tools=after_tools)) is expected


def test_every_shielded_row_is_deterministic() -> None:
    for key, row in outcomes.OUTCOMES.items():
        if row.shield:
            assert row.deterministic, key


# -- a Codex-like client ----------------------------------------------------------------------------
def codex_like(
    url: str, body: bytes, attempts: int, headers: dict[str, str] | None = None
) -> list[httpx.Response]:
    """Send `body` up to `attempts` times, as the Codex CLI does: it ignores ``x-should-retry``
    and retries a 5xx, and a stream that ended in ``error`` / ``response.failed``, with a short
    backoff; it stops at the first success."""
    answers = []
    with httpx.Client(timeout=30) as client:
        for attempt in range(attempts):
            r = client.post(
                f"{url}/v1/responses",
                content=body,
                headers={"content-type": "application/json", **(headers or {})},
            )
            answers.append(r)
            failed = r.status_code >= 400 or b"event: response.failed" in r.content
            if not failed:
                break
            time.sleep(0.005 * min(attempt, 4))
    return answers


def big_stream(deltas: int, size: int) -> list[bytes]:
    """An upstream stream of `deltas` text deltas of `size` bytes (no terminal event needed: the
    ledger trips first)."""
    parts = PRE()
    parts += [text_delta(2 + i, "x" * size) for i in range(deltas)]
    return parts


@pytest.mark.parametrize("stream", [True, False])
def test_thirty_codex_retries_after_a_budget_502_cost_one_upstream_call(
    upstream: MockUpstream, stream: bool
) -> None:
    """Issue 18: one 502 max_retained_bytes_exceeded, 30 attempts, one upstream inference call."""
    if stream:
        upstream.push(Reply.sse(big_stream(200, 2048)))
    else:
        upstream.push(Reply.json(response_obj([message_item("y" * 400_000)])))
    body = json.dumps({"model": "m", "input": "write a lot", "stream": stream}).encode()
    delta = MetricDelta()
    with gateway(upstream, max_retained_bytes=B) as (url, _):
        answers = codex_like(url, body, 30)
    assert len(answers) == 30 and len(upstream.requests) == 1
    first, retries = answers[0], answers[1:]
    assert HIT not in first.headers
    assert delta.delta("loopwarden_retry_shield_hits_total") == 29
    if stream:
        events = sse_events(first.content)
        assert first.status_code == 200 and events[-2][1]["code"] == "max_retained_bytes_exceeded"
        error, failed = events[-2][1], events[-1][1]
        for r in retries:
            replay = sse_events(r.content)
            assert r.status_code == 200 and r.headers[HIT] == "hit"
            assert r.headers["content-type"].startswith("text/event-stream")
            assert [name for name, _ in replay] == ["response.created", "error", "response.failed"]
            assert replay[0][1]["response"]["id"] == events[0][1]["response"]["id"]
            assert {**replay[1][1], "sequence_number": 0} == {**error, "sequence_number": 0}
            assert replay[2][1]["response"]["error"] == failed["response"]["error"]
            assert replay[2][1]["response"]["id"] == failed["response"]["id"]
    else:
        assert first.status_code == 502 and first.headers["x-should-retry"] == "false"
        assert first.json()["error"]["code"] == "max_retained_bytes_exceeded"
        for r in retries:
            assert (r.status_code, r.content, r.headers[HIT]) == (502, first.content, "hit")
            assert r.headers["x-should-retry"] == "false"


def test_a_508_is_shielded_with_no_upstream_call_and_no_tool_run(upstream: MockUpstream) -> None:
    probe = Probe()
    with serve_mcp(build_tools_server(probe)) as (mcp, _):
        upstream.push(*(Reply.json(response_obj([FC(f"c{i}", "lookup", "{}")])) for i in range(2)))
        body = json.dumps({"model": "m", "input": "loop", "tools": TOOLS}).encode()
        with gateway(upstream, mcp_server=(f"tools={mcp}",), max_infer_iters=2) as (url, _):
            answers = codex_like(url, body, 5)
    assert [r.status_code for r in answers] == [508] * 5
    assert [HIT in r.headers for r in answers] == [False, True, True, True, True]
    assert len(upstream.requests) == 2 and probe.names() == ["lookup"]
    assert all(r.json() == answers[0].json() for r in answers)


def test_a_validation_400_is_answered_again_byte_for_byte(upstream: MockUpstream) -> None:
    body = json.dumps({"model": "m", "input": "x", "temperature": "hot"}).encode()
    with gateway(upstream) as (url, _):
        first, second = codex_like(url, body, 2)
        other = codex_like(url, body.replace(b'"hot"', b'"hotter"'), 1)[0]  # another request: checked afresh
    assert first.status_code == 400 and HIT not in first.headers
    assert (second.status_code, second.content, second.headers[HIT]) == (400, first.content, "hit")
    assert second.headers["x-should-retry"] == "false"
    assert other.status_code == 400 and HIT not in other.headers
    assert other.headers["x-request-id"] != first.headers["x-request-id"]


def test_the_same_request_with_its_keys_in_another_order_is_the_same_request(upstream: MockUpstream) -> None:
    """The Codex CLI serialises its maps in a new order on every retry: still one upstream call."""
    upstream.push(Reply.json(response_obj([message_item("y" * 400_000)])))
    first = b'{"model":"m","input":"x","temperature":0.5,"metadata":{"a":"1","b":"2"}}'
    again = b'{"metadata":{"b":"2","a":"1"},"temperature":0.5, "input":"x","model":"m"}'
    with gateway(upstream) as (url, _):
        answers = codex_like(url, first, 1) + codex_like(url, again, 1)
    assert [r.status_code for r in answers] == [502, 502] and len(upstream.requests) == 1
    assert answers[1].headers[HIT] == "hit" and answers[1].content == answers[0].content


def test_the_parsed_digest_is_computed_only_for_a_caller_with_a_failure(
    upstream: MockUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    from middleware.asgi import intake

    walks: list[int] = []
    real = intake.canonical_digest

    def counting(obj: object) -> bytes:
        walks.append(1)
        return real(obj)

    monkeypatch.setattr(intake, "canonical_digest", counting)
    upstream.push(*(Reply.json(response_obj([message_item("ok")])) for _ in range(3)))
    with gateway(upstream) as (url, _):
        for i in range(3):  # successes: a SHA-256 of the bytes, no walk of the parsed request
            assert (
                codex_like(url, json.dumps({"model": "m", "input": str(i)}).encode(), 1)[0].status_code == 200
            )
        assert walks == []
        bad = json.dumps({"model": "m", "input": "x", "temperature": "hot"}).encode()
        first, second = codex_like(url, bad, 2)
    assert (first.status_code, HIT in first.headers, HIT in second.headers) == (400, False, True)
    assert len(walks) == 2  # once to remember the failure, once to find the retry


@pytest.mark.parametrize(
    "reply",
    [
        Reply.json({"error": {"message": "busy"}}, status=503),
        Reply(status=429, headers=[("content-type", "application/json"), ("retry-after", "1")],
              parts=[b'{"error":{"message":"slow down","code":"rate_limit_exceeded"}}']),
    ],
    ids=["503", "429"],
)  # fmt: skip
def test_transient_upstream_failures_are_not_shielded(upstream: MockUpstream, reply: Reply) -> None:
    upstream.push(reply, reply, Reply.json(response_obj([message_item("ok")])))
    body = json.dumps({"model": "m", "input": "x", "store": False}).encode()
    with gateway(upstream) as (url, _):
        answers = codex_like(url, body, 5)
    assert [r.status_code for r in answers] == [reply.status if reply.status == 429 else 502] * 2 + [200]
    assert not any(HIT in r.headers for r in answers)
    assert len(upstream.requests) == 3


def test_a_failure_after_a_side_effecting_tool_is_shielded_and_the_tool_runs_once(
    upstream: MockUpstream,
) -> None:
    """Item 3 + 4: a 5xx after ``charge_card`` ran is not retried (x-should-retry: false), and a
    client that retries anyway gets the same answer without charging the card again."""
    probe = Probe()
    with serve_mcp(build_tools_server(probe)) as (mcp, _):
        upstream.push(
            Reply.json(response_obj([FC("c1", "charge_card", '{"amount":100}')])),
            Reply.json({"error": {"message": "the model server broke"}}, status=500),
        )
        body = json.dumps({"model": "m", "input": "pay", "tools": TOOLS, "stream": False}).encode()
        with gateway(upstream, mcp_server=(f"tools={mcp}",)) as (url, _):
            answers = codex_like(url, body, 6)
    assert [r.status_code for r in answers] == [502] * 6
    assert all(r.headers["x-should-retry"] == "false" for r in answers)
    assert [HIT in r.headers for r in answers] == [False] + [True] * 5
    assert probe.names() == ["charge_card"] and len(upstream.requests) == 2
    assert "already ran for this request" in answers[0].json()["error"]["message"]


def test_another_caller_is_not_answered_from_the_shield(upstream: MockUpstream) -> None:
    upstream.push(*(Reply.json(response_obj([message_item("y" * 400_000)])) for _ in range(2)))
    body = json.dumps({"model": "m", "input": "x"}).encode()
    with gateway(upstream, api_key=("key-a", "key-b")) as (url, _):
        a = codex_like(url, body, 2, {"authorization": "Bearer key-a"})
        b = codex_like(url, body, 2, {"authorization": "Bearer key-b"})
    assert [HIT in r.headers for r in a + b] == [False, True, False, True]
    assert len(upstream.requests) == 2


def test_on_an_open_gateway_two_keys_from_one_address_are_two_callers(upstream: MockUpstream) -> None:
    """Without --api-key the admission caller is the client address, but the store's owner is the
    key presented: a failure of key Y (same address) must not answer key X's identical request."""
    upstream.push(*(Reply.json(response_obj([message_item("y" * 400_000)])) for _ in range(2)))
    body = json.dumps({"model": "m", "input": "x"}).encode()
    with gateway(upstream) as (url, _):
        y = codex_like(url, body, 2, {"authorization": "Bearer key-y"})
        x = codex_like(url, body, 1, {"authorization": "Bearer key-x"})
    assert [HIT in r.headers for r in y] == [False, True]
    assert HIT not in x[0].headers and x[0].status_code == y[0].status_code == 502
    assert len(upstream.requests) == 2


def test_the_window_ends_and_zero_turns_the_shield_off(upstream: MockUpstream) -> None:
    big = Reply.json(response_obj([message_item("y" * 400_000)]))
    upstream.push(big, big, big, big)
    body = json.dumps({"model": "m", "input": "x"}).encode()
    with gateway(upstream, retry_shield_seconds=0.5) as (url, _):
        first = codex_like(url, body, 2)
        time.sleep(0.7)
        later = codex_like(url, body, 1)
    assert [HIT in r.headers for r in first + later] == [False, True, False]
    assert len(upstream.requests) == 2
    with gateway(upstream, retry_shield_seconds=0) as (url, _):
        off = codex_like(url, body, 2)
    assert [r.status_code for r in off] == [502, 502] and not any(HIT in r.headers for r in off)
    assert len(upstream.requests) == 4


# -- item 8: the log lines ---------------------------------------------------------------------------
def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    """The ``outcome`` log lines as field maps."""
    found = []
    for record in caplog.records:
        message = record.getMessage()
        if record.name == "loopwarden.outcome" and message.startswith("outcome "):
            found.append(dict(part.split("=", 1) for part in message.split()[1:]))
    return found


def test_the_outcome_log_lines_cover_side_effects_and_shield_hits(
    upstream: MockUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    probe = Probe()
    with serve_mcp(build_tools_server(probe)) as (mcp, _):
        upstream.push(
            Reply.json(response_obj([FC("c1", "charge_card", '{"amount":5}')])),
            Reply.json({"error": {"message": "broke"}}, status=500),
        )
        body = json.dumps({"model": "m", "input": "pay", "tools": TOOLS}).encode()
        with (
            caplog.at_level(logging.INFO, logger="loopwarden.outcome"),
            gateway(upstream, mcp_server=(f"tools={mcp}",)) as (url, _),
        ):
            first, second = codex_like(url, body, 2)
    lines = _lines(caplog)
    assert len(lines) == 2, lines
    failure, hit = lines
    assert (
        failure["row"] == "upstream_5xx"
        and failure["status"] == "502"
        and failure["code"] == "upstream_error"
    )
    assert failure["retry"] == "no" and failure["side_effects"] == "True" and failure["committed"] == "False"
    assert hit["row"] == "retry_shield" and hit["status"] == "502" and hit["code"] == "upstream_error"
    assert hit["original_row"] == "upstream_5xx" and hit["retry"] == "no"
    assert hit["original_request_id"] == first.headers["x-request-id"] != second.headers["x-request-id"]
    assert 0 <= float(hit["age"]) < 10
    assert hit["caller"] == failure["caller"] != "-"
    assert all("pay" not in line.values() for line in lines)  # never user content


def test_the_log_line_of_a_transient_failure_says_a_retry_can_help(
    upstream: MockUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.push(Reply.json({"error": {"message": "busy"}}, status=503))
    with caplog.at_level(logging.INFO, logger="loopwarden.outcome"), gateway(upstream) as (url, _):
        r = httpx.post(f"{url}/v1/responses", json={"model": "m", "input": "x"}, timeout=30)
    assert r.status_code == 502 and "x-should-retry" not in r.headers
    (line,) = _lines(caplog)
    assert (line["row"], line["retry"], line["side_effects"]) == ("upstream_5xx", "yes", "False")
