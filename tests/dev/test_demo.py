"""What `make run` shows a person: the embedded dev model plus the in-process demo MCP server."""

from __future__ import annotations

import openai
import pytest

from middleware.app import create_app
from middleware.config import Settings
from tests.helpers import sdk
from tests.servers import serve_asgi

DEMO = {"type": "mcp", "server_label": "demo", "require_approval": "never"}


def test_demo_multi_round_loop_with_mcp_calls() -> None:
    with serve_asgi(create_app(Settings(store="memory"))) as url, sdk(url) as client:
        response = client.responses.create(model="dev", input="calculate 6*7", tools=[DEMO])  # type: ignore[list-item]
        with client.responses.stream(model="dev", input="what does get_time say?", tools=[DEMO]) as stream:  # type: ignore[list-item]
            types = [event.type for event in stream]
            streamed = stream.get_final_response()
    assert [item.type for item in response.output] == ["mcp_list_tools", "mcp_call", "message"]
    call = response.output[1]
    assert (call.name, call.arguments, call.output) == ("calculate", '{"expression":"6*7"}', "42")
    assert response.output_text == "Tool results: calculate -> 42."
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.mcp_call.completed" in types
    assert [item.type for item in streamed.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert streamed.output_text.startswith("Tool results: get_time -> ")


def test_demo_loop_forever_is_508() -> None:
    with (
        serve_asgi(create_app(Settings(max_infer_iters=3, store="memory"))) as url,
        sdk(url) as client,
        pytest.raises(openai.APIStatusError) as info,
    ):
        client.responses.create(model="dev", input="loop forever", tools=[DEMO])  # type: ignore[list-item]
    assert info.value.status_code == 508
    assert "max_infer_iters=3" in info.value.message
