"""Production operation (issue 10): admission control, memory pressure, deadlines, graceful drain,
secrets, request ids and model routing — against a real uvicorn and a scripted upstream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import ChargeModel
from middleware.app import create_app
from middleware.asgi.auth import owner_of_key
from middleware.config import Settings
from middleware.ops.admission import DRAIN, ProcessPool
from middleware.store.store import open_store
from tests.helpers import (
    DONE,
    PRE,
    CountingApp,
    MetricDelta,
    gateway,
    message_item,
    metric,
    raw_http,
    response_json,
    response_obj,
    sse_events,
    text_delta,
)
from tests.mock_upstream import MockUpstream, Reply
from tests.servers import free_port as _free_port
from tests.servers import serve_asgi, wait_healthy

SMALL = {"id": "r", "object": "response", "status": "completed", "output": []}


def body_of(size: int) -> bytes:
    prefix, suffix = b'{"model":"m","store":false,"input":"', b'"}'
    return prefix + b"a" * (size - len(prefix) - len(suffix)) + suffix


def post(url: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/responses",
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )


def wait_metric_zero(name: str, within: float = 3.0) -> float:
    """The gauge's value once it is 0, or after `within` seconds (a request's bookkeeping ends just
    after its last byte is sent, so a client can see the answer a moment before)."""
    deadline = time.monotonic() + within
    while metric(name) and time.monotonic() < deadline:
        time.sleep(0.02)
    return metric(name)


# -- admission control ---------------------------------------------------------------------------
def test_pool_admits_two_400k_reservations_and_refuses_the_third_before_reading_it(
    upstream: MockUpstream,
) -> None:
    """Pool 1 MiB, reservations 400 KiB (Content-Length 51,200 x the measured model's 8 budget
    bytes per byte, `ChargeModel.reserve_per_byte`); one
    caller may hold the whole pool here (the per-caller share is tests/ops/test_caller_share.py)."""
    gates = [threading.Event(), threading.Event()]
    upstream.push(
        *[
            Reply(
                headers=[("content-type", "application/json")],
                parts=[g, b'{"id":"r","object":"response","status":"completed","output":[]}'],
            )
            for g in gates
        ]
    )
    body = body_of(51_200)
    assert 51_200 * ChargeModel.measured().reserve_per_byte() == 400 * 1024
    with gateway(
        upstream, max_inflight_retained_bytes=1_048_576, max_inflight_share_per_caller=1.0, retry_after=2.0
    ) as (url, counter):
        m = MetricDelta()
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(post(url, body).status_code)) for _ in gates
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(upstream.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(upstream.requests) == 2
        assert metric("loopwarden_admission_reserved_bytes") >= 2 * 400 * 1024
        read_before = counter.body_bytes
        head = b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 51200\r\n\r\n"
        status, headers, refused = response_json(raw_http(url, head, body[:100]))
        read_by_third = counter.body_bytes - read_before
        for gate in gates:
            gate.set()
        for t in threads:
            t.join(20)
        upstream.push(Reply.json(SMALL))
        again = post(url, body)
        idle_reserved = wait_metric_zero("loopwarden_admission_reserved_bytes")
        idle_inflight = wait_metric_zero("loopwarden_inflight_requests")
    assert status == 503
    assert refused["error"]["code"] == "server_overloaded"
    assert "--max-inflight-retained-bytes" in refused["error"]["message"]
    assert headers["retry-after"] == "2" and headers["connection"] == "close"
    assert read_by_third == 0, "the refused request's body was not read"
    assert results == [200, 200]
    assert again.status_code == 200
    assert len(upstream.requests) == 3, "the upstream never saw the refused request"
    assert idle_reserved == 0 and idle_inflight == 0
    assert m.delta("loopwarden_cap_hits_total", limit="admission", outcome="503") == 1


def test_reservation_larger_than_the_pool_is_413_at_once(upstream: MockUpstream) -> None:
    with gateway(upstream, max_inflight_retained_bytes=100_000) as (url, _):
        r = post(url, body_of(6400))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "process_budget_exceeded"
    assert r.headers["x-should-retry"] == "false"
    assert upstream.requests == []


def test_concurrency_cap_refuses_with_503(upstream: MockUpstream) -> None:
    gate = threading.Event()
    upstream.push(
        Reply(
            headers=[("content-type", "application/json")],
            parts=[gate, b'{"id":"r","status":"completed","output":[]}'],
        )
    )
    with gateway(upstream, max_concurrent_requests=1) as (url, _):
        first = threading.Thread(target=lambda: post(url, body_of(200)))
        first.start()
        while not upstream.requests:
            time.sleep(0.02)
        second = post(url, body_of(200))
        gate.set()
        first.join(10)
    assert second.status_code == 503
    assert "--max-concurrent-requests=1" in second.json()["error"]["message"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "take", "give", "close"]),
            st.integers(0, 400_000),
            st.sampled_from("abc"),
        ),
        max_size=60,
    )
)
def test_pool_never_exceeds_its_budget_or_goes_negative(ops: list[tuple[str, int, str]]) -> None:
    pool = ProcessPool(1_000_000, max_share_per_caller=0.5)
    live: list[Any] = []
    for op, n, caller in ops:
        if op == "admit" and pool.share_refusal(n, caller=caller) is None and pool.refusal(n) is None:
            live.append(pool.admit(n, caller=caller))
        elif op == "take" and live:
            live[n % len(live)].try_take(n)
        elif op == "give" and live:
            res = live[n % len(live)]
            res.give_back(min(n, res.charged))
        elif op == "close" and live:
            live.pop(n % len(live)).close()
        assert 0 <= pool.reserved <= pool.budget
        assert pool.charged == sum(r.charged for r in live)  # the live gauge is the sum of the ledgers
        assert 0 <= pool.charged <= pool.reserved
        assert all(r.charged <= r.held or r.held == 0 for r in live)
        held_by = {c: sum(r.held for r in live if r.caller == c) for c in "abc"}
        assert pool.held_by == {c: held for c, held in held_by.items() if held}  # no entry at 0
        assert all(held <= pool.caller_cap for held in pool.held_by.values())
    for res in live:
        res.close()
    assert pool.reserved == 0 and pool.requests == 0 and pool.charged == 0 and pool.held_by == {}


def test_memory_pressure_sheds_new_requests_and_readyz_reports_it(upstream: MockUpstream) -> None:
    pressure = {"value": 0.5}
    app = CountingApp(
        create_app(
            Settings(upstream=upstream.base_url, store="memory"), pressure_source=lambda: pressure["value"]
        )
    )
    upstream.push(Reply.json(SMALL))
    with serve_asgi(app) as url:
        ok = post(url, body_of(200))
        ready = httpx.get(url + "/readyz")
        pressure["value"] = 0.95
        time.sleep(1.1)  # the source is polled at most once a second
        shed = post(url, body_of(200))
        not_ready = httpx.get(url + "/readyz")
        gauge = metric("loopwarden_memory_pressure_ratio")
    assert ok.status_code == 200 and ready.status_code == 200
    assert shed.status_code == 503 and "memory pressure is 95%" in shed.json()["error"]["message"]
    assert not_ready.status_code == 503 and not_ready.json() == {"status": "saturated"}
    assert gauge == 0.95
    assert len(upstream.requests) == 1


def test_upstream_503_is_distinguishable_from_gateway_overload(upstream: MockUpstream) -> None:
    upstream.push(Reply.json({"error": {"message": "vllm queue full"}}, status=503))
    with gateway(upstream) as (url, _):
        m = MetricDelta()
        r = post(url, body_of(200))
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    assert "vllm queue full" in r.json()["error"]["message"]
    assert m.delta("loopwarden_upstream_errors_total", kind="status_5xx") == 1
    assert m.delta("loopwarden_cap_hits_total", limit="admission", outcome="503") == 0


def test_client_disconnect_mid_stream_releases_its_reservation(upstream: MockUpstream) -> None:
    parts: list[Any] = [*PRE()]
    for i in range(100):
        parts += [0.05, text_delta(2 + i, "z")]
    upstream.push(Reply.sse(parts))
    with gateway(upstream) as (url, _):
        with httpx.stream(
            "POST", url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10
        ) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen == 3:
                    assert metric("loopwarden_admission_reserved_bytes") > 0
                    break
        reserved = wait_metric_zero("loopwarden_admission_reserved_bytes")
        inflight = wait_metric_zero("loopwarden_inflight_retained_bytes")
    assert reserved == 0 and inflight == 0


# -- deadlines -------------------------------------------------------------------------------------
def test_request_deadline_buffered_and_streamed(upstream: MockUpstream, tmp_path: Path) -> None:
    upstream.push(
        Reply(headers=[("content-type", "application/json")], parts=[3.0, b"{}"]),
        Reply.sse([*PRE(), 3.0, DONE(2, [message_item("late")])]),
    )
    with gateway(
        upstream, request_deadline=1.0, upstream_read_timeout=10, store=f"sqlite:///{tmp_path}/s.db"
    ) as (url, _):
        m = MetricDelta()
        started = time.monotonic()
        buffered = post(url, b'{"model":"m","input":"x"}')
        took = time.monotonic() - started
        streamed = httpx.post(
            url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=10
        )
        events = sse_events(streamed.content)
        stored = httpx.get(url + f"/v1/responses/{events[0][1]['response']['id']}")
    assert buffered.status_code == 504 and buffered.json()["error"]["code"] == "request_deadline_exceeded"
    assert 0.9 < took < 2.5
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert events[-2][1]["code"] == "request_deadline_exceeded"
    assert stored.json()["status"] == "failed"
    assert m.delta("loopwarden_cap_hits_total", limit="request_deadline", outcome="504") == 1
    assert m.delta("loopwarden_cap_hits_total", limit="request_deadline", outcome="sse_error") == 1


# -- drain -----------------------------------------------------------------------------------------
def test_readyz_turns_not_ready_at_once_when_draining(upstream: MockUpstream) -> None:
    with gateway(upstream) as (url, _):
        assert httpx.get(url + "/readyz").status_code == 200
        DRAIN.start(30.0, time.monotonic())
        try:
            not_ready = httpx.get(url + "/readyz")
            refused = post(url, body_of(200))
        finally:
            DRAIN.draining, DRAIN.deadline = False, None
    assert not_ready.status_code == 503 and not_ready.json() == {"status": "draining"}
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert upstream.requests == []


def _serve(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`loopwarden serve` in a subprocess, output to `log`; returns once /healthz answers."""
    port = _free_port()
    cli = str(Path(sys.executable).parent / "loopwarden")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [cli, "serve", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("LOOPWARDEN_")}, **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log=log)
    return proc, url


def test_sigterm_drains_finishes_what_it_can_and_stores_the_true_status(
    upstream: MockUpstream, tmp_path: Path
) -> None:
    fast = [Reply.sse([*PRE(), 1.0, DONE(2, [message_item("done")])]) for _ in range(5)]
    slow = [Reply.sse([*PRE(), 20.0, DONE(2, [message_item("never")])]) for _ in range(5)]
    for pair in zip(fast, slow, strict=True):
        upstream.push(*pair)
    db = tmp_path / "drain.db"
    proc, url = _serve(
        ["--upstream", upstream.base_url, "--store", f"sqlite:///{db}", "--drain-timeout", "3"],
        tmp_path / "log",
    )
    bodies: list[bytes] = []
    lock = threading.Lock()

    def client() -> None:
        r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "x", "stream": True}, timeout=30)
        with lock:
            bodies.append(r.content)

    threads = [threading.Thread(target=client) for _ in range(10)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(upstream.requests) < 10 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    proc.wait(timeout=30)
    outcomes = sorted(sse_events(b)[-1][0] for b in bodies)
    assert outcomes == ["response.completed"] * 5 + ["response.failed"] * 5
    errors = [sse_events(b)[-2][1] for b in bodies if sse_events(b)[-1][0] == "response.failed"]
    assert {e["code"] for e in errors} == {"server_shutting_down"}
    ids = {sse_events(b)[0][1]["response"]["id"]: sse_events(b)[-1][0] for b in bodies}

    async def statuses() -> dict[str, str]:
        async with open_store(f"sqlite:///{db}") as store:
            out = {}
            for rid in ids:
                stored = await store.get_response(rid, owner_of_key(""))
                out[rid] = stored.status if stored else "missing"
            return out

    stored = asyncio.run(statuses())
    for rid, last in ids.items():
        assert stored[rid] == ("completed" if last == "response.completed" else "failed"), (rid, stored[rid])


# -- secrets ---------------------------------------------------------------------------------------
def test_no_planted_secret_appears_in_the_store_logs_or_responses(
    upstream: MockUpstream, tmp_path: Path
) -> None:
    from tests.loop.test_loop_e2e import build_server

    upstream_key, gateway_key, mcp_secret = (
        "sk-upstream-PLANTED-1",
        "gw-key-PLANTED-2",
        "mcp-header-PLANTED-3",
    )
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"# gateway keys\n{gateway_key}\n")
    db = tmp_path / "s.db"
    log = tmp_path / "log"
    with serve_asgi(build_server().streamable_http_app()) as mcp_base:
        mcp_url = mcp_base + "/mcp"
        upstream.push(
            Reply.json(
                response_obj(
                    [
                        {
                            "type": "function_call",
                            "id": "fc_1",
                            "call_id": "c1",
                            "name": "lookup",
                            "arguments": "{}",
                            "status": "completed",
                        }
                    ]
                )
            ),
            Reply.json(response_obj([message_item("done")])),
            Reply.json({"error": {"message": "bad"}}, status=401),
        )
        proc, url = _serve(
            [
                "--upstream",
                upstream.base_url,
                "--store",
                f"sqlite:///{db}",
                "--api-key-file",
                str(keyfile),
                "--mcp-allow",
                mcp_base + "/",
                "--log-level",
                "debug",
                "--log-format",
                "json",
            ],
            log,
            env={"LOOPWARDEN_UPSTREAM_API_KEY": upstream_key},
        )
        try:
            auth = {"authorization": f"Bearer {gateway_key}"}
            declared = {
                "type": "mcp",
                "server_label": "mine",
                "server_url": mcp_url,
                "require_approval": "never",
                "headers": {"x-token": mcp_secret},
            }
            answers = [
                httpx.post(
                    url + "/v1/responses",
                    json={"model": "m", "input": "x", "tools": [declared]},
                    headers=auth,
                    timeout=20,
                ),
                httpx.post(
                    url + "/v1/responses", json={"model": "m", "input": "x"}, headers=auth, timeout=20
                ),
                httpx.post(
                    url + "/v1/responses",
                    json={"model": "m", "input": "x"},
                    headers={"authorization": "Bearer wrong"},
                    timeout=20,
                ),
            ]
            answers.append(
                httpx.get(url + f"/v1/responses/{answers[0].json()['id']}", headers=auth, timeout=20)
            )
            answers.append(httpx.get(url + "/metrics", timeout=20))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert answers[0].status_code == 200 and answers[1].status_code == 502 and answers[2].status_code == 401
    assert upstream.requests[0].headers["authorization"] == f"Bearer {upstream_key}"
    seen = b"".join(r.content + str(r.headers).encode() for r in answers)
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("s.db*"))
    logs = log.read_bytes()
    assert b'"request_id"' in logs and b"POST /v1/responses" in logs
    for secret in (upstream_key, gateway_key, mcp_secret):
        assert secret.encode() not in seen, secret
        assert secret.encode() not in stored, secret
        assert secret.encode() not in logs, secret
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert upstream_key not in ps and gateway_key not in ps


# -- request ids -----------------------------------------------------------------------------------
def test_request_ids_are_accepted_or_minted_and_named_in_errors(upstream: MockUpstream) -> None:
    upstream.push(Reply.json(SMALL))
    with gateway(upstream) as (url, _):
        given_id = post(url, body_of(200), **{"x-request-id": "trace-42"})
        minted = post(url, b"{bad")
        hostile = post(url, b"{bad", **{"x-request-id": "x" * 500})
    assert given_id.headers["x-request-id"] == "trace-42"
    assert upstream.requests[0].headers["x-request-id"] == "trace-42"
    rid = minted.headers["x-request-id"]
    assert rid.startswith("req_") and f"[request id {rid}]" in minted.json()["error"]["message"]
    assert hostile.headers["x-request-id"].startswith("req_")


def test_every_error_envelope_names_the_request_id(upstream: MockUpstream) -> None:
    """Store routes, unknown URLs and wrong methods answer outside the budget middleware: their
    error messages carry the request id too, exactly once."""
    with gateway(upstream) as (url, _):
        answers = [
            httpx.get(url + "/v1/responses/resp_nope", headers={"x-request-id": "trace-7"}, timeout=10),
            httpx.delete(url + "/v1/responses/resp_nope", headers={"x-request-id": "trace-7"}, timeout=10),
            httpx.get(url + "/v1/nowhere", headers={"x-request-id": "trace-7"}, timeout=10),
            httpx.get(url + "/v1/responses", headers={"x-request-id": "trace-7"}, timeout=10),
        ]
    assert [r.status_code for r in answers] == [404, 404, 404, 405]
    for r in answers:
        message = r.json()["error"]["message"]
        assert message.endswith(" [request id trace-7]") and message.count("[request id") == 1, message


# -- model routing ---------------------------------------------------------------------------------
def test_two_models_routed_to_two_upstreams_with_their_own_limits() -> None:
    with MockUpstream() as a, MockUpstream() as b:
        models = {
            "alpha": {"upstream": a.base_url, "max_retained_bytes": 4 * 1048576},
            "beta-*": {"upstream": b.base_url, "upstream_api_key": "beta-key", "max_retained_bytes": 262144},
        }
        a.push(Reply.json(SMALL))
        b.push(Reply.json(SMALL))
        with gateway(None, models=models, max_retained_bytes=16 * 1048576) as (url, _):
            m = MetricDelta()
            ra = httpx.post(
                url + "/v1/responses",
                json={"model": "alpha", "input": "x" * 60_000, "store": False},
                timeout=10,
            )
            rb_small = httpx.post(
                url + "/v1/responses", json={"model": "beta-1", "input": "hi", "store": False}, timeout=10
            )
            rb_big = httpx.post(
                url + "/v1/responses",
                json={"model": "beta-2", "input": "x" * 60_000, "store": False},
                timeout=10,
            )
            unknown = httpx.post(url + "/v1/responses", json={"model": "gamma", "input": "hi"}, timeout=10)
            listed = httpx.get(url + "/v1/models", timeout=10)
    assert ra.status_code == 200 and rb_small.status_code == 200
    assert rb_big.status_code == 413  # beta's 256 KiB limit, not alpha's or the server's
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert len(a.requests) == 1 and len(b.requests) == 1
    assert b.requests[0].headers["authorization"] == "Bearer beta-key"
    assert [d["id"] for d in listed.json()["data"]] == ["alpha", "beta-*"]
    assert m.delta("loopwarden_requests_total", status="200", model="alpha") == 1
    assert m.delta("loopwarden_requests_total", status="200", model="beta-*") == 1
    assert m.delta("loopwarden_requests_total", status="404", model="other") == 1


def test_models_list_passes_the_upstream_through_when_none_is_configured(upstream: MockUpstream) -> None:
    upstream.push(Reply.json({"object": "list", "data": [{"id": "up-model", "object": "model"}]}))
    with gateway(upstream) as (url, _):
        r = httpx.get(url + "/v1/models", timeout=10)
    assert r.json()["data"][0]["id"] == "up-model"
    assert upstream.requests[0].method == "GET" and upstream.requests[0].path == "/v1/models"


def test_invalid_models_config_names_the_model_and_field(tmp_path: Path) -> None:
    from middleware.config import SettingsError, load_settings

    cfg = tmp_path / "m.yaml"
    cfg.write_text("models:\n  alpha:\n    max_retained_bytes: 10\n")
    with pytest.raises(
        SettingsError, match=r"models.alpha: max_retained_bytes must be in 4096..=268435456, got 10"
    ):
        load_settings({"config": str(cfg)}, {})
