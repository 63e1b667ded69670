"""What a client's retry logic reads from the gateway (issue 18 items 4 and 5).

* B30 (BerriAI/litellm #21553): an upstream 429 / 503 ``Retry-After`` (and ``retry-after-ms``,
  which openai-python reads first) and ``x-ratelimit-*`` reach
  the client before commit, on the pass-through path and the loop path, buffered and streamed;
  the official SDK waits the provider's cool-down before its retry.
* B32 (kubernetes-sigs/agent-sandbox #1352): once a gateway tool with side effects ran, a later
  failure carries ``x-should-retry: false`` and the SDK's default retries do not run it again;
  tools annotated ``readOnlyHint`` / ``idempotentHint`` (real MCP annotations) leave it retryable.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import FC, gateway, message_item, response_obj, sdk
from tests.mcp_servers import Probe, build_tools_server, serve_mcp
from tests.mock_upstream import MockUpstream, Reply

RATE_HEADERS = [
    ("retry-after", "3"),
    ("retry-after-ms", "3000"),
    ("x-ratelimit-reset-requests", "3s"),
    ("x-ratelimit-remaining-requests", "0"),
]
TOOLS = [{"type": "mcp", "server_label": "tools", "require_approval": "never"}]


def limited(status: int) -> Reply:
    code = "rate_limit_exceeded" if status == 429 else "overloaded"
    body = json.dumps({"error": {"message": "slow down", "type": "requests", "code": code}}).encode()
    return Reply(status=status, headers=[("content-type", "application/json"), *RATE_HEADERS], parts=[body])


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("path", ["passthrough", "loop"])
def test_rate_limit_headers_reach_the_client(
    upstream: MockUpstream, status: int, stream: bool, path: str
) -> None:
    """B30: the pass-through path (store false, no tools) and the loop path (store on)."""
    upstream.push(limited(status))
    body: dict[str, Any] = {"model": "m", "input": "x", "stream": stream}
    if path == "passthrough":
        body["store"] = False
    with gateway(upstream) as (url, _):
        r = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert r.status_code == (429 if status == 429 else 502), r.text
    assert r.headers["content-type"].startswith("application/json")  # before commit: the envelope
    for name, value in RATE_HEADERS:
        assert r.headers[name] == value, name
    assert r.json()["error"]["code"] == ("rate_limit_exceeded" if status == 429 else "overloaded")
    assert "x-should-retry" not in r.headers  # a retry after the cool-down can help
    assert len(upstream.requests) == 1


@pytest.mark.slow
def test_the_sdk_waits_the_upstreams_retry_after(upstream: MockUpstream) -> None:
    """B30: ``max_retries=1``; the retry comes no sooner than ``Retry-After: 3`` allows."""
    upstream.push(limited(429), Reply.json(response_obj([message_item("ok")])))
    with gateway(upstream) as (url, _):
        started = time.monotonic()
        answer = sdk(url, max_retries=1).responses.create(model="m", input="x")
        elapsed = time.monotonic() - started
    assert answer.output_text == "ok" and len(upstream.requests) == 2
    assert elapsed >= 3.0, elapsed


def _tool_then_500(name: str, args: str, rounds: int) -> list[Reply]:
    replies = []
    for i in range(rounds):
        replies.append(Reply.json(response_obj([FC(f"call_{i}", name, args)])))
        replies.append(
            Reply.json({"error": {"message": "the model server broke", "type": "server_error"}}, 500)
        )
    return replies


def test_a_side_effecting_tool_runs_once_under_the_sdks_default_retries(upstream: MockUpstream) -> None:
    """B32: ``charge_card`` (no annotations) runs once; the 502 says not to retry, and the SDK
    (default ``max_retries=2``) sends one request."""
    probe = Probe()
    with serve_mcp(build_tools_server(probe)) as (mcp, _):
        upstream.push(*_tool_then_500("charge_card", '{"amount":100}', 3))
        with (
            gateway(upstream, mcp_server=(f"tools={mcp}",)) as (url, app),
            pytest.raises(openai.InternalServerError) as info,
        ):
            sdk(url).responses.create(model="m", input="pay 100", tools=TOOLS)  # type: ignore[arg-type]
    assert info.value.status_code == 502
    assert info.value.response.headers["x-should-retry"] == "false"
    assert probe.names() == ["charge_card"] and app.requests == 1 and len(upstream.requests) == 2


@pytest.mark.parametrize(
    ("name", "args"),
    [("lookup", '{"q":"a"}'), ("put_record", '{"key":"k","value":"v"}')],
    ids=["readOnlyHint", "idempotentHint"],
)
def test_tools_annotated_safe_to_repeat_leave_the_failure_retryable(
    upstream: MockUpstream, name: str, args: str
) -> None:
    """A 5xx after only read-only or idempotent tools ran is retried like any 5xx (not shielded)."""
    probe = Probe()
    with serve_mcp(build_tools_server(probe)) as (mcp, _):
        upstream.push(*_tool_then_500(name, args, 2))
        with (
            gateway(upstream, mcp_server=(f"tools={mcp}",)) as (url, app),
            pytest.raises(openai.InternalServerError) as info,
        ):
            sdk(url, max_retries=1).responses.create(model="m", input="go", tools=TOOLS)  # type: ignore[arg-type]
    assert "x-should-retry" not in info.value.response.headers
    assert app.requests == 2 and probe.names() == [name, name] and len(upstream.requests) == 4


def test_one_side_effecting_tool_among_safe_ones_makes_the_failure_final(upstream: MockUpstream) -> None:
    probe = Probe()
    with serve_mcp(build_tools_server(probe)) as (mcp, _):
        upstream.push(
            Reply.json(
                response_obj([FC("c1", "lookup", '{"q":"a"}'), FC("c2", "charge_card", '{"amount":1}')])
            ),
            Reply.json({"error": {"message": "broke"}}, 500),
        )
        with gateway(upstream, mcp_server=(f"tools={mcp}",)) as (url, _):
            r = httpx.post(
                f"{url}/v1/responses", json={"model": "m", "input": "x", "tools": TOOLS}, timeout=30
            )
    assert r.status_code == 502 and r.headers["x-should-retry"] == "false"
    assert sorted(probe.names()) == ["charge_card", "lookup"]


# -- a client configured for Chat Completions -------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_chat_completions_is_a_404_that_says_loopwarden_serves_the_responses_api(
    upstream: MockUpstream, path: str
) -> None:
    with gateway(upstream) as (url, _):
        r = httpx.post(f"{url}{path}", json={"model": "m", "messages": []}, timeout=30)
        with pytest.raises(openai.NotFoundError) as info:
            sdk(url).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    message = r.json()["error"]["message"]
    assert "serves the OpenAI Responses API (POST /v1/responses), not " + path in message
    assert 'wire_api = "responses"' in message and "use_responses_api=True" in message
    assert "Responses API" in str(info.value) and upstream.requests == []
