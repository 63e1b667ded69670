"""The development model speaks Chat Completions too (issue 25), so ``--upstream-api chat``
works with no model server: the gateway in front of its embedded dev model, through the SDK."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from middleware.dev.devmodel import create_devmodel_app
from tests.helpers import gateway, sdk, sse_events
from tests.servers import serve_asgi
from tests.spec_schema import assert_stream

DEMO = [{"type": "mcp", "server_label": "demo", "require_approval": "never"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with gateway(None, upstream_api="chat", upstream_read_timeout=10.0) as (base, _):
        yield base


def test_devmodel_answers_chat_completions_directly() -> None:
    with serve_asgi(create_devmodel_app()) as base, httpx.Client(timeout=10) as client:
        reply = client.post(
            f"{base}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 50},
        )
        streamed = client.post(
            f"{base}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
    body = reply.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == "You said: hello there"
    assert streamed.text.endswith("data: [DONE]\n\n") and '"object":"chat.completion.chunk"' in streamed.text


def test_gateway_over_the_chat_devmodel_buffered(url: str) -> None:
    with sdk(url) as client:
        response = client.responses.create(model="dev", input="hello there")
    assert response.output_text == "You said: hello there" and response.usage is not None


def test_gateway_runs_a_demo_mcp_loop_over_chat_streamed(url: str) -> None:
    """Round 1: the dev model calls the demo calculate tool (Chat tool_calls), the gateway runs it;
    round 2: the dev model answers the tool result. One logical Responses stream."""
    with httpx.Client(timeout=20) as client:
        raw = client.post(
            f"{url}/v1/responses",
            json={"model": "dev", "input": "calculate 6*7", "tools": DEMO, "stream": True},
        )
    events = sse_events(raw.content)
    assert_stream(events)
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.completed"
    types = [o["type"] for o in final["output"]]
    assert types[-2:] == ["mcp_call", "message"], types
    assert "42" in final["output"][-1]["content"][0]["text"]
