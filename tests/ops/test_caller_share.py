"""One caller's share of the process pool (issue "memory truth", DESIGN.md §4):
``--max-inflight-share-per-caller``.

Units first (the share arithmetic, who the caller is, the settings), then a real uvicorn: a flood
of slow uploads — open connections that sent their headers and part of a chunked body, and no
more — from one API key is refused once that key holds its share, while another key is served at
the same time; the same flood without a share locks everyone out (what was measured before).
Everything is counted in budget bytes and requests, never RSS.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from budget import Ledger, PoolExhausted
from middleware import outcomes
from middleware.app import create_app
from middleware.asgi.auth import Authenticator, owner_of_key
from middleware.asgi.intake import Intake, IntakeConfig
from middleware.asgi.models import ModelRouter
from middleware.config import Settings, SettingsError, load_settings
from middleware.errors import CallerShareExhausted
from middleware.ops.admission import DrainState, ProcessPool, Refusal, share_bytes
from tests.helpers import (
    DONE,
    PRE,
    B,
    CountingApp,
    MetricDelta,
    gateway,
    metric,
    text_delta,
)
from tests.mock_upstream import MockUpstream, Reply
from tests.servers import raw_http, response_json, serve_asgi

SMALL = {"id": "r", "object": "response", "status": "completed", "output": []}
RESERVED = "loopwarden_admission_reserved_bytes"
CAP_HITS = "loopwarden_cap_hits_total"
KEY_A, KEY_B = "key-a", "key-b"
#: What a body without Content-Length reserves: all of max_retained_bytes (whatever the charge
#: model's per-byte price), so the pool arithmetic below is exact.
R = B
POOL = 8 * R  # with the default share 0.5, one caller may hold 4 R: four slow uploads
#: The part of a chunked body a slow upload sends before it stalls (one HTTP/1.1 chunk).
PART = b'{"model":"m","store":false,"input":"'
FIRST_CHUNK = f"{len(PART):x}\r\n".encode() + PART + b"\r\n"


# -- the share arithmetic ------------------------------------------------------------------------
def test_share_bytes_is_exact_floor_of_the_decimal_share() -> None:
    assert share_bytes(100, 0.29) == 29  # 100 * 0.29 is 28.999999999999996 in binary floating point
    assert share_bytes(1000, 0.5) == 500
    assert share_bytes(3, 0.5) == 1
    assert share_bytes(POOL, 1.0) == POOL
    assert ProcessPool(100, max_share_per_caller=0.29).caller_cap == 29


def test_exactly_the_share_is_admitted_and_one_byte_more_is_refused() -> None:
    pool = ProcessPool(1000, max_share_per_caller=0.5)
    first = pool.admit(300, caller="a")
    assert pool.share_refusal(200, caller="a") is None  # 300 + 200 = 500: exactly the share
    reason = pool.share_refusal(201, caller="a")
    assert reason is not None
    assert "hold 300 of the 500 budget bytes" in reason and "--max-inflight-share-per-caller=0.5" in reason
    assert pool.share_refusal(500, caller="b") is None  # another caller has a share of its own
    second = pool.admit(200, caller="a")
    assert pool.held("a") == 500 and pool.held_by == {"a": 500}

    ledger = Ledger(10_000, pool=second)
    ledger.reserve(200)  # within its own reservation: nothing drawn from the pool
    with pytest.raises(PoolExhausted):
        ledger.reserve(1)  # one byte past the share
    assert second.refusal == Refusal("caller_share", held=500, needed=1)
    assert (ledger.charged, pool.charged, pool.reserved, pool.held("a")) == (200, 200, 500, 500), "unchanged"

    other = pool.admit(500, caller="b")  # the pool has room for b while a is full
    for reservation in (first, second, other):
        reservation.close()
    assert pool.held_by == {} and pool.reserved == 0, "an entry leaves the map when it reaches 0"


def test_growth_refused_by_the_whole_pool_is_not_blamed_on_the_share() -> None:
    pool = ProcessPool(1000, max_share_per_caller=0.6)
    a, b = pool.admit(300, caller="a"), pool.admit(600, caller="b")
    ledger = Ledger(10_000, pool=a)
    ledger.reserve(300)
    with pytest.raises(PoolExhausted):
        ledger.reserve(200)  # a would hold 500, under its 600 share; the pool has only 100 left
    assert a.refusal == Refusal("admission", held=300, needed=200)
    ledger.reserve(100)  # what the pool still has
    assert pool.reserved == pool.budget and pool.held_by == {"a": 400, "b": 600}
    a.close()
    b.close()


def test_released_growth_returns_to_the_callers_share() -> None:
    pool = ProcessPool(1000, max_share_per_caller=0.5)
    reservation = pool.admit(100, caller="a")
    ledger = Ledger(10_000, pool=reservation)
    ledger.release(ledger.reserve(500))  # the share, then back to the reservation
    assert pool.held("a") == 100
    ledger.reserve(500)
    assert pool.held("a") == 500
    reservation.close()
    assert pool.held_by == {}


@pytest.mark.parametrize("share", [0.0, -0.5, 1.0000001, 2.0])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match=rf"max_inflight_share_per_caller must be in \(0, 1\], got {share}"):
        ProcessPool(1000, max_share_per_caller=share)
    with pytest.raises(SettingsError, match=r"max_inflight_share_per_caller must be in \(0, 1\]"):
        load_settings({"max_inflight_share_per_caller": share}, {})


def test_the_share_setting_from_flag_env_and_file(tmp_path: Path) -> None:
    assert load_settings({}, {}).admission.max_inflight_share_per_caller == 0.5
    cfg = tmp_path / "lw.yaml"
    cfg.write_text("max-inflight-share-per-caller: 0.25\n")
    assert load_settings({"config": str(cfg)}, {}).admission.max_inflight_share_per_caller == 0.25
    env = {"LOOPWARDEN_MAX_INFLIGHT_SHARE_PER_CALLER": "0.75"}
    assert load_settings({"config": str(cfg)}, env).admission.max_inflight_share_per_caller == 0.75
    assert (
        load_settings(
            {"config": str(cfg), "max_inflight_share_per_caller": 1.0}, env
        ).admission.max_inflight_share_per_caller
        == 1.0
    )


# -- who the caller is ---------------------------------------------------------------------------
def _scope(client: tuple[str, int] | None, key: str = "") -> dict[str, Any]:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return {"type": "http", "headers": headers, "client": client}


def test_the_caller_is_the_api_key_when_keys_are_configured() -> None:
    auth = Authenticator([KEY_A, KEY_B])
    scope = _scope(("10.0.0.1", 5000), KEY_A)
    assert auth.caller(scope, auth.owner(scope)) == owner_of_key(KEY_A)
    elsewhere = _scope(("10.0.0.2", 6000), KEY_A)
    assert auth.caller(elsewhere, auth.owner(elsewhere)) == owner_of_key(KEY_A), "one key, one share"


def test_the_caller_is_the_client_address_when_the_gateway_is_open() -> None:
    auth = Authenticator([])
    first, second = _scope(("10.0.0.1", 5000), "made-up-1"), _scope(("10.0.0.1", 5001), "made-up-2")
    assert (
        auth.caller(first, auth.owner(first)) == auth.caller(second, auth.owner(second)) == "addr:10.0.0.1"
    ), "any key is accepted on an open gateway: varying it must not buy another share"
    assert auth.caller(_scope(("10.0.0.2", 5000)), "") == "addr:10.0.0.2"
    assert auth.caller(_scope(None), "") == "addr:-"


def test_growth_refused_by_the_share_is_explained_as_the_caller_share_outcome() -> None:
    pool = ProcessPool(1000, max_share_per_caller=0.5)
    config = IntakeConfig(
        limits=Settings().limits,
        authenticator=Authenticator([]),
        router=ModelRouter(()),
        pool=pool,
        drain=DrainState(),
        client_body_timeout=30.0,
        retry_after=1.0,
    )
    intake = Intake(_scope(("10.0.0.1", 1)), _never_receive, config)
    intake.reservation = pool.admit(500, caller="addr:10.0.0.1")
    ledger = Ledger(10_000, pool=intake.reservation)
    ledger.reserve(500)
    with pytest.raises(PoolExhausted) as refused:
        ledger.reserve(1)
    explained = intake.explain(refused.value)
    assert isinstance(explained, CallerShareExhausted) and explained.phase == "reserve"
    outcome = outcomes.resolve(explained)
    assert (outcome.row, outcome.status, outcome.code, outcome.cap) == (
        "caller_share_later",
        502,
        "process_budget_exceeded",
        "caller_share",
    )
    assert "hold 500 of the 500 budget bytes" in outcome.message
    assert "--max-inflight-share-per-caller=0.5" in outcome.message
    other = PoolExhausted("reserve", 1)
    intake.reservation.refusal = Refusal("admission", held=500, needed=1)
    assert intake.explain(other) is other, "a refusal of the whole pool keeps today's outcome"
    intake.reservation.close()


async def _never_receive() -> dict[str, Any]:  # pragma: no cover - the intake above never reads
    raise AssertionError("not read")


# -- a real server (the upstream fixture is tests/conftest.py's) ---------------------------------
def _head(*, key: str = "", forwarded_for: str = "") -> bytes:
    lines = [b"POST /v1/responses HTTP/1.1", b"host: x", b"content-type: application/json"]
    lines.append(b"transfer-encoding: chunked")  # no Content-Length: the request reserves R
    if key:
        lines.append(f"authorization: Bearer {key}".encode())
    if forwarded_for:
        lines.append(f"x-forwarded-for: {forwarded_for}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


@contextlib.contextmanager
def slow_uploads(url: str, count: int, head: bytes) -> Iterator[list[socket.socket]]:
    """`count` open connections that sent `head` and `FIRST_CHUNK`, then nothing; closed on exit."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(count):
            sock = socket.create_connection((host, int(port)), timeout=10)
            socks.append(sock)
            sock.sendall(head + FIRST_CHUNK)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def wait_until(predicate: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def post(url: str, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/responses", json={"model": "m", "store": False, "input": "hi"}, headers=headers, timeout=30
    )


def test_a_slow_upload_flood_from_one_key_is_refused_while_another_key_is_served(
    upstream: MockUpstream,
) -> None:
    with gateway(
        upstream,
        api_key=(KEY_A, KEY_B),
        max_retained_bytes=R,
        max_inflight_retained_bytes=POOL,
        retry_after=3.0,
    ) as (url, counter):
        m = MetricDelta()
        with slow_uploads(url, 4, _head(key=KEY_A)):
            # A now holds exactly its share (4 R of 8 R): admitted, and reading its bodies
            assert wait_until(lambda: metric(RESERVED) == 4 * R and counter.body_bytes == 4 * len(PART))
            read_before = counter.body_bytes
            refused = [response_json(raw_http(url, _head(key=KEY_A), FIRST_CHUNK)) for _ in range(6)]
            read_by_refused = counter.body_bytes - read_before
            upstream.push(*[Reply.json(SMALL) for _ in range(3)])
            served_b = [post(url, authorization=f"Bearer {KEY_B}").status_code for _ in range(3)]
            # (a request's bookkeeping ends just after its last byte: B's may still be counted a moment)
            a_still_holds_its_share = wait_until(lambda: metric(RESERVED) == 4 * R)
        assert wait_until(lambda: metric(RESERVED) == 0), "A's uploads ended: its share is free again"
        upstream.push(Reply.json(SMALL))
        again = post(url, authorization=f"Bearer {KEY_A}")
    for status, headers, body in refused:
        assert status == 503 and body["error"]["code"] == "server_overloaded"
        assert "this caller's share of the pool is full" in body["error"]["message"]
        assert "--max-inflight-share-per-caller=0.5" in body["error"]["message"]
        assert headers["retry-after"] == "3" and headers["connection"] == "close"
    assert read_by_refused == 0, "a refused upload's body is not read"
    assert served_b == [200, 200, 200], "key B is served while key A's uploads hold its share"
    assert a_still_holds_its_share
    assert again.status_code == 200
    assert len(upstream.requests) == 4, "the upstream saw B's three requests and A's last one"
    assert m.delta(CAP_HITS, limit="caller_share", outcome="503") == 6 == len(refused)
    assert m.delta(CAP_HITS, limit="admission", outcome="503") == 0


def test_without_a_share_the_same_flood_locks_every_other_caller_out(upstream: MockUpstream) -> None:
    """What was measured before the share: one key's slow uploads reserve the whole pool."""
    with gateway(
        upstream,
        api_key=(KEY_A, KEY_B),
        max_retained_bytes=R,
        max_inflight_retained_bytes=POOL,
        max_inflight_share_per_caller=1.0,
    ) as (url, _):
        m = MetricDelta()
        with slow_uploads(url, 8, _head(key=KEY_A)):
            assert wait_until(lambda: metric(RESERVED) == POOL)
            locked_out = post(url, authorization=f"Bearer {KEY_B}")
    assert locked_out.status_code == 503
    assert "--max-inflight-retained-bytes" in locked_out.json()["error"]["message"]
    assert m.delta(CAP_HITS, limit="admission", outcome="503") == 1
    assert m.delta(CAP_HITS, limit="caller_share", outcome="503") == 0
    assert upstream.requests == []


@contextlib.contextmanager
def open_gateway(upstream: MockUpstream, forwarded_allow_ips: str) -> Iterator[str]:
    """A gateway without API keys behind uvicorn trusting `forwarded_allow_ips` for X-Forwarded-For."""
    settings = Settings(
        upstream=upstream.base_url,
        store="memory",
        max_retained_bytes=R,
        max_inflight_retained_bytes=POOL,
        upstream_read_timeout=2.0,
    )
    with serve_asgi(CountingApp(create_app(settings)), forwarded_allow_ips=forwarded_allow_ips) as url:
        yield url


def test_an_open_gateway_keys_the_share_by_client_address_forwarded_only_by_trusted_proxies(
    upstream: MockUpstream,
) -> None:
    flood, other = "203.0.113.7", "198.51.100.2"
    with open_gateway(upstream, forwarded_allow_ips="127.0.0.1") as url:  # the test client is the proxy
        m = MetricDelta()
        with slow_uploads(url, 4, _head(forwarded_for=flood)):
            assert wait_until(lambda: metric(RESERVED) == 4 * R)
            status, _, _ = response_json(
                raw_http(url, _head(forwarded_for=flood, key="another-key"), FIRST_CHUNK)
            )
            upstream.push(Reply.json(SMALL))
            served = post(url, **{"x-forwarded-for": other})
        trusted_refusals = m.delta(CAP_HITS, limit="caller_share", outcome="503")
    assert status == 503, "a new key does not buy a new share on an open gateway"
    assert served.status_code == 200, "another client address behind the same proxy is served"
    assert trusted_refusals == 1

    with open_gateway(upstream, forwarded_allow_ips="") as url:  # no proxy trusted: the header is ignored
        m = MetricDelta()
        with slow_uploads(url, 4, _head(forwarded_for=flood)):
            assert wait_until(lambda: metric(RESERVED) == 4 * R)
            spoofed = post(url, **{"x-forwarded-for": other})
        untrusted_refusals = m.delta(CAP_HITS, limit="caller_share", outcome="503")
    assert spoofed.status_code == 503, "an untrusted peer's X-Forwarded-For is not its address"
    assert "this caller's share of the pool is full" in spoofed.json()["error"]["message"]
    assert untrusted_refusals == 1


@pytest.mark.parametrize("stream", [False, True])
def test_growth_past_the_share_mid_request_is_the_pool_exhausted_outcome_naming_the_share(
    upstream: MockUpstream, stream: bool
) -> None:
    """An upstream answer of 2,000 deltas (4 MB of text, under any charge model more than 2 MiB)
    grows one request's ledger step by step until its caller's share (2 of the 4 MiB pool) is
    full; the ledger's own limit (64 MiB) and the pool would still have room. A buffered client
    request gets the aggregated stream (the upstream call is streamed either way)."""
    text = "x" * 2000
    upstream.push(Reply.sse([*PRE(), *(text_delta(2 + i, text) for i in range(2000)), DONE(2002, [])]))
    with gateway(upstream, max_retained_bytes=64 * B, max_inflight_retained_bytes=4 * B) as (url, _):
        m = MetricDelta()
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": stream}, timeout=30)
    if stream:
        error = next(e for e in r.text.split("\n\n") if e.startswith("event: error"))
        assert "process_budget_exceeded" in error and "--max-inflight-share-per-caller=0.5" in error
        assert m.delta(CAP_HITS, limit="caller_share", outcome="sse_error") == 1
    else:
        assert r.status_code == 502 and r.json()["error"]["code"] == "process_budget_exceeded"
        assert "this caller's share of the worker's process budget is full" in r.json()["error"]["message"]
        assert "--max-inflight-share-per-caller=0.5" in r.json()["error"]["message"]
        assert m.delta(CAP_HITS, limit="caller_share", outcome="502") == 1
    assert m.delta(CAP_HITS, limit="admission", outcome="502") == 0


def test_a_reservation_over_a_callers_whole_share_is_413_at_once(upstream: MockUpstream) -> None:
    with gateway(upstream, max_retained_bytes=R, max_inflight_retained_bytes=R + R // 2) as (url, _):
        m = MetricDelta()
        status, headers, body = response_json(raw_http(url, _head(), FIRST_CHUNK))
    assert status == 413 and body["error"]["code"] == "process_budget_exceeded"
    assert "more than one caller's whole share" in body["error"]["message"]
    assert headers["x-should-retry"] == "false" and headers["connection"] == "close"
    assert m.delta(CAP_HITS, limit="caller_share", outcome="413") == 1
    assert upstream.requests == []


@pytest.mark.parametrize("nbytes", [0, 100, 900, 901, 5_000, 10_000])
def test_can_take_answers_what_try_take_would_do_and_changes_nothing(nbytes: int) -> None:
    """`RequestReservation.can_take` (the stream fast path asks the pool for room without
    drawing): the same answer as `try_take`, the pool's and the reservation's figures unchanged."""
    pool = ProcessPool(10_000, max_share_per_caller=0.5)  # a caller may hold 5,000
    other = pool.reserve_request(1_000, caller="b", retry_after=1.0)
    reservation = pool.reserve_request(100, caller="a", retry_after=1.0)
    assert reservation.try_take(100)  # the reservation itself is used up
    before = (pool.reserved, pool.charged, dict(pool.held_by), reservation.held, reservation.charged)
    answer = reservation.can_take(nbytes)
    assert (pool.reserved, pool.charged, dict(pool.held_by), reservation.held, reservation.charged) == before
    assert reservation.refusal is None
    assert answer == reservation.try_take(nbytes)
    other.close()
