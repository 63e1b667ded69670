"""MCP tool names that collide once made valid (``cal.get`` next to ``cal_get``): both are exposed,
the renamed one under ``cal_get_<8 hex of SHA-256("cal.get")>`` whatever order the server lists
them in (the README's hash suffix), and a call of either maps back to its own MCP tool.

A real MCP server (the ``mcp`` SDK, streamable HTTP on uvicorn), the gateway on a real uvicorn,
the official ``openai`` SDK as client, the scripted `MockUpstream` as the model server.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from mcp.server.mcpserver import MCPServer

from middleware.tools.names import FUNCTION_NAME, upstream_names
from tests.helpers import FC, gateway, message_item, response_obj, sdk
from tests.mock_upstream import MockUpstream, Reply
from tests.servers import serve_asgi

SUFFIXED = "cal_get_" + hashlib.sha256(b"cal.get").hexdigest()[:8]
MCP = {"type": "mcp", "server_label": "cal", "require_approval": "never"}


def build_server(dotted_first: bool) -> MCPServer:  # type: ignore[type-arg]
    server: MCPServer = MCPServer("cal", log_level="WARNING")  # type: ignore[type-arg]

    async def dotted() -> str:
        """The dotted tool."""
        return "from cal.get"

    async def plain() -> str:
        """The underscored tool."""
        return "from cal_get"

    order = [("cal.get", dotted), ("cal_get", plain)]
    for name, fn in order if dotted_first else order[::-1]:
        server.tool(name=name)(fn)
    return server


@pytest.fixture(params=[True, False], ids=["dotted_first", "underscored_first"])
def mcp_url(request: pytest.FixtureRequest) -> Iterator[str]:
    with serve_asgi(build_server(request.param).streamable_http_app()) as url:
        yield url + "/mcp"


def test_upstream_names_do_not_depend_on_order() -> None:
    for wanted in (["cal.get", "cal_get"], ["cal_get", "cal.get"]):
        got = dict(zip(wanted, upstream_names(wanted, ()), strict=True))
        assert got == {"cal.get": SUFFIXED, "cal_get": "cal_get"}
    # two names that sanitise alike both carry their own suffix; a client function claims too
    both = upstream_names(["cal.get", "cal/get"], ())
    assert both == [SUFFIXED, "cal_get_" + hashlib.sha256(b"cal/get").hexdigest()[:8]]
    assert upstream_names(["cal.get"], {"cal_get"}) == [SUFFIXED]
    assert upstream_names(["cal.get"], ()) == ["cal_get"]
    long = ["x" * 70, "x" * 64]
    renamed = upstream_names(long, ())
    assert (
        renamed[1] == "x" * 64
        and renamed[0] != renamed[1]
        and all(FUNCTION_NAME.fullmatch(n) for n in renamed)
    )


@pytest.mark.parametrize("called", [SUFFIXED, "cal_get"])
def test_colliding_mcp_names_are_both_exposed_and_each_call_maps_back(mcp_url: str, called: str) -> None:
    with MockUpstream() as upstream:
        upstream.push(
            Reply.json(response_obj([FC("call_1", called, "{}")])),
            Reply.json(response_obj([message_item("done")])),
        )
        with (
            gateway(upstream, mcp_server=(f"cal={mcp_url}",), tool_timeout=5.0) as (url, _),
            sdk(url) as client,
        ):
            r = client.responses.create(model="m", input="hi", store=False, tools=[MCP])  # type: ignore[list-item]
        first = upstream.requests[0].json()
    assert sorted(t["name"] for t in first["tools"]) == sorted([SUFFIXED, "cal_get"])
    call = next(i for i in r.output if i.type == "mcp_call")
    mcp_name = "cal.get" if called == SUFFIXED else "cal_get"
    assert (call.name, call.output) == (mcp_name, f"from {mcp_name}")
    listed = next(i for i in r.output if i.type == "mcp_list_tools")
    assert sorted(t.name for t in listed.tools) == ["cal.get", "cal_get"]
    assert r.output_text == "done"
