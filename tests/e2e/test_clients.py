"""Real clients in their default modes (issue 18 items 1, 2, 6, 7): the OpenAI Agents SDK's
hosted-MCP approval flows (callback and manual, `Runner.run` and `Runner.run_streamed`), its
function tools, LangChain's ``ChatOpenAI(use_responses_api=True)``, the official ``openai`` SDK
feeding back what the gateway emitted; cases B29 (dotted MCP tool names, openai/codex #8174), B37
(``item_reference``, continuedev/continue #9101) and B39 (``tool_choice`` naming an MCP tool,
ogx-ai/ogx PR #4106).

Real parts: the gateway on uvicorn, a real MCP server (the ``mcp`` SDK) on a loopback port, the
clients themselves; the model server is scripted (`MockUpstream`), and every body the gateway sent
it is checked by a strict Responses server's rules (`tests.strict_upstream.input_problems`).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

from tests.helpers import FC, gateway, message_item, response_obj, sdk
from tests.mock_upstream import MockUpstream, Reply
from tests.servers import serve_asgi
from tests.strict_upstream import input_problems

TOOLS = {"type": "mcp", "server_label": "tools", "require_approval": "never"}
ALWAYS = {"type": "mcp", "server_label": "tools", "require_approval": "always"}
AUTH = {"authorization": "Bearer client-key"}


class Calls:
    """What the MCP server ran: (tool name, arguments), thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def add(self, name: str, args: dict[str, Any]) -> None:
        with self.lock:
            self.seen.append((name, args))


CALLS = Calls()


def build_server() -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("tools", log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def lookup(q: str = "") -> str:
        """Look something up."""
        CALLS.add("lookup", {"q": q})
        return f"found {q}"

    @server.tool(name="calendar.get_time")
    async def get_time() -> str:
        """What time it is (an MCP name with a dot, case B29)."""
        CALLS.add("calendar.get_time", {})
        return "12:00"

    @server.tool()
    async def charge(amount: int) -> str:
        """Charge a card (has side effects)."""
        CALLS.add("charge", {"amount": amount})
        return f"charged {amount}"

    return server


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with serve_asgi(build_server().streamable_http_app()) as url:
        yield url + "/mcp"


@pytest.fixture(autouse=True)
def fresh_calls() -> None:
    CALLS.seen.clear()


def loop(upstream: MockUpstream, mcp_url: str, **kw: Any) -> Any:
    kw.setdefault("mcp_server", (f"tools={mcp_url}",))
    kw.setdefault("max_retained_bytes", 8 * 1048576)
    kw.setdefault("tool_timeout", 5.0)
    return gateway(upstream, **kw)


def fc(*calls: dict[str, Any]) -> Reply:
    return Reply.json(
        response_obj(list(calls), usage={"input_tokens": 5, "output_tokens": 1, "total_tokens": 6})
    )


def text(answer: str) -> Reply:
    return Reply.json(
        response_obj([message_item(answer)], usage={"input_tokens": 5, "output_tokens": 1, "total_tokens": 6})
    )


def sent(upstream: MockUpstream) -> list[dict[str, Any]]:
    """Every body the gateway sent upstream, each checked by a strict server's rules."""
    bodies = [r.json() for r in upstream.requests]
    for body in bodies:
        assert input_problems(body) == [], (input_problems(body), body.get("input"))
    return bodies


def outputs_of(body: dict[str, Any]) -> dict[str, str]:
    return {i["call_id"]: i["output"] for i in body["input"] if i.get("type") == "function_call_output"}


def post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, headers={**AUTH, **headers}, timeout=20)


# --- item 1: stateless approvals -------------------------------------------------------------------


def test_stateless_approval_runs_the_approved_call_without_previous_response_id(
    upstream: MockUpstream, mcp_url: str
) -> None:
    """The issue's report: approval items inline, no previous_response_id, was a 400 `no pending
    approval request … in the history`; now the approved call runs once, from the item."""
    upstream.push(fc(FC("call_A", "lookup", '{"q":"a"}')), text("found it"))
    with loop(upstream, mcp_url) as (url, _):
        r1 = post(url, {"model": "m", "input": "look a up", "tools": [ALWAYS], "store": False}).json()
        request = next(i for i in r1["output"] if i["type"] == "mcp_approval_request")
        assert CALLS.seen == []
        history = [{"type": "message", "role": "user", "content": "look a up"}, *r1["output"]]
        answer = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
        r2 = post(url, {"model": "m", "input": [*history, answer], "tools": [ALWAYS], "store": False})
    assert r2.status_code == 200, r2.text
    assert CALLS.seen == [("lookup", {"q": "a"})]
    body = r2.json()
    call = next(i for i in body["output"] if i["type"] == "mcp_call")
    assert (call["name"], call["output"], call["approval_request_id"]) == ("lookup", "found a", request["id"])
    assert body["output"][-1]["content"][0]["text"] == "found it"
    second = sent(upstream)[1]
    assert outputs_of(second) == {"call_A": "found a"}
    assert [i.get("type") for i in second["input"]] == ["message", "function_call", "function_call_output"]


def test_stateless_denial_feeds_the_refusal_and_runs_nothing(upstream: MockUpstream, mcp_url: str) -> None:
    upstream.push(text("ok, I will not charge"))
    request = {
        "type": "mcp_approval_request",
        "id": "mcpr_call_C",
        "server_label": "tools",
        "name": "charge",
        "arguments": '{"amount":100}',
    }
    deny = {
        "type": "mcp_approval_response",
        "approval_request_id": "mcpr_call_C",
        "approve": False,
        "reason": "too much",
    }
    with loop(upstream, mcp_url) as (url, _):
        r = post(url, {"model": "m", "input": [request, deny], "tools": [ALWAYS], "store": False})
    assert r.status_code == 200, r.text
    assert CALLS.seen == []
    refusal = outputs_of(sent(upstream)[0])["call_C"]
    assert "denied" in refusal and "too much" in refusal


@pytest.mark.parametrize(
    ("request_item", "tools", "param", "match"),
    [
        # a forged request for a server the request does not declare
        (
            {"server_label": "elsewhere", "name": "charge", "arguments": '{"amount":1}'},
            [ALWAYS],
            "tools",
            "do not expose",
        ),
        # a tool that allowed_tools filters out is not exposed either
        (
            {"server_label": "tools", "name": "charge", "arguments": '{"amount":1}'},
            [{**ALWAYS, "allowed_tools": ["lookup"]}],
            "tools",
            "do not expose",
        ),
        # arguments the declared tool's input schema refuses
        (
            {"server_label": "tools", "name": "charge", "arguments": '{"amount":"lots"}'},
            [ALWAYS],
            "input[0].arguments",
            "not of type",
        ),
        (
            {"server_label": "tools", "name": "charge", "arguments": "[1]"},
            [ALWAYS],
            "input[0].arguments",
            "not a JSON object",
        ),
        # a repeated key: the schema check saw one value, the tool may read the other
        (
            {"server_label": "tools", "name": "charge", "arguments": '{"amount":1,"amount":1000000}'},
            [ALWAYS],
            "input[0].arguments",
            'duplicate key "amount"',
        ),
        (
            {"server_label": "tools", "name": "charge", "arguments": '{"amount":NaN}'},
            [ALWAYS],
            "input[0].arguments",
            "NaN",
        ),
    ],
)
def test_stateless_approval_checks_the_item_against_the_declared_tools(
    upstream: MockUpstream,
    mcp_url: str,
    request_item: dict[str, Any],
    tools: list[Any],
    param: str,
    match: str,
) -> None:
    item = {"type": "mcp_approval_request", "id": "mcpr_call_F", **request_item}
    answer = {"type": "mcp_approval_response", "approval_request_id": "mcpr_call_F", "approve": True}
    with loop(upstream, mcp_url) as (url, _):
        r = post(url, {"model": "m", "input": [item, answer], "tools": tools, "store": False})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and match in error["message"], error
    assert CALLS.seen == [] and upstream.requests == []


def test_a_fed_back_approval_already_carried_by_its_mcp_call_does_not_run_again(
    upstream: MockUpstream, mcp_url: str
) -> None:
    """The next stateless turn resends request, response and the resulting mcp_call: nothing runs."""
    upstream.push(text("anything else?"))
    history = [
        {"type": "message", "role": "user", "content": "charge 5"},
        {
            "type": "mcp_approval_request",
            "id": "mcpr_call_P",
            "server_label": "tools",
            "name": "charge",
            "arguments": '{"amount":5}',
        },
        {"type": "mcp_approval_response", "approval_request_id": "mcpr_call_P", "approve": True},
        {
            "type": "mcp_call",
            "id": "mcp_1",
            "server_label": "tools",
            "name": "charge",
            "arguments": '{"amount":5}',
            "output": "charged 5",
            "error": None,
            "approval_request_id": "mcpr_call_P",
        },
        {"type": "message", "role": "user", "content": "thanks"},
    ]
    with loop(upstream, mcp_url) as (url, _):
        r = post(url, {"model": "m", "input": history, "tools": [ALWAYS], "store": False})
    assert r.status_code == 200, r.text
    assert CALLS.seen == []
    body = sent(upstream)[0]
    assert outputs_of(body) == {"call_P": "charged 5"}
    assert [i["type"] for i in body["input"]] == [
        "message",
        "function_call",
        "function_call_output",
        "message",
    ]


# --- item 2: everything emitted accepted back ------------------------------------------------------


@pytest.mark.parametrize("store", [False, True])
def test_fed_back_output_is_lowered_even_without_mcp_tools(
    upstream: MockUpstream, mcp_url: str, store: bool
) -> None:
    """A response's whole output (mcp_list_tools, mcp_call, a failed mcp_call, a message) as the
    next input — no MCP tools declared, which took the pass-through path before — reaches the
    upstream as plain items."""
    upstream.push(fc(FC("call_1", "lookup", '{"q":"x"}')), text("first"), text("second"))
    with loop(upstream, mcp_url) as (url, _):
        r1 = post(url, {"model": "m", "input": "look x up", "tools": [TOOLS], "store": store}).json()
        failed = {
            "type": "mcp_call",
            "id": "mcp_failed",
            "server_label": "tools",
            "name": "charge",
            "arguments": "{}",
            "output": None,
            "error": {
                "type": "mcp_tool_execution_error",
                "content": [{"type": "text", "text": "card declined"}],
            },
        }
        again = [{"type": "message", "role": "user", "content": "look x up"}, *r1["output"], failed]
        r2 = post(
            url,
            {
                "model": "m",
                "input": [*again, {"type": "message", "role": "user", "content": "more"}],
                "store": store,
            },
        )
    assert r2.status_code == 200, r2.text
    body = sent(upstream)[2]
    kinds = [i["type"] for i in body["input"]]
    assert kinds == [
        "message",
        "function_call",
        "function_call_output",
        "message",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert list(outputs_of(body).values()) == ["found x", "card declined"]
    assert "tools" not in body or body["tools"] == []


def test_b37_item_reference_is_resolved_from_the_callers_store(upstream: MockUpstream, mcp_url: str) -> None:
    """continuedev/continue #9101: a reference reached an upstream that stored nothing."""
    upstream.push(Reply.json(response_obj([message_item("a fact", "msg_up0")])), text("another fact"))
    with loop(upstream, mcp_url) as (url, _):
        r1 = post(url, {"model": "m", "input": "tell me a fact"})
        assert r1.status_code == 200
        ref = [{"type": "item_reference", "id": "msg_up0"}, {"role": "user", "content": "and another one?"}]
        r2 = post(url, {"model": "m", "input": ref, "store": False})
        foreign = post(url, {"model": "m", "input": ref}, authorization="Bearer other-key")
        unknown = post(url, {"model": "m", "input": [{"type": "item_reference", "id": "msg_nope"}]})
    assert r2.status_code == 200, r2.text
    body = sent(upstream)[1]
    assert body["input"][0]["id"] == "msg_up0" and body["input"][0]["content"][0]["text"] == "a fact"
    assert all(i.get("type") != "item_reference" for i in body["input"])
    for answer, name in ((foreign, "msg_up0"), (unknown, "msg_nope")):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "input") and name in error["message"]
    assert len(upstream.requests) == 2


def test_a_referenced_item_is_charged_before_it_is_decoded(upstream: MockUpstream, mcp_url: str) -> None:
    big = message_item("fact " * 20000, "msg_big")
    upstream.push(Reply.json(response_obj([big])))
    with loop(upstream, mcp_url) as (url, _):
        assert post(url, {"model": "m", "input": "tell me a long fact"}).status_code == 200
        ref = {"model": "m", "input": [{"type": "item_reference", "id": "msg_big"}], "store": False}
        r = post(url, ref, **{"loopwarden-max-retained-bytes": "65536"})
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("max_retained_bytes_exceeded", "input")
    assert len(upstream.requests) == 1


def test_item_reference_without_a_store_is_a_400() -> None:
    from budget import Ledger
    from middleware.errors import InvalidRequest
    from middleware.store.history import resolve_references

    with pytest.raises(InvalidRequest, match="without a store") as info:
        asyncio.run(
            resolve_references([{"type": "item_reference", "id": "msg_1"}], None, "o", Ledger(1 << 20))
        )
    assert info.value.param == "input"


def test_an_omitted_call_leaves_no_orphaned_reasoning_item(upstream: MockUpstream, mcp_url: str) -> None:
    """max_tool_calls omits the second call; the reasoning before it must not be continued from."""
    reasoning = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "e2"}
    upstream.push(
        fc(
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e1"},
            FC("call_1", "lookup", '{"q":"1"}'),
            reasoning,
            FC("call_2", "lookup", '{"q":"2"}'),
        ),
        text("continued"),
    )
    with loop(upstream, mcp_url) as (url, _):
        r1 = post(url, {"model": "m", "input": "two lookups", "tools": [TOOLS], "max_tool_calls": 1})
        assert r1.json()["status"] == "incomplete"
        r2 = post(
            url, {"model": "m", "previous_response_id": r1.json()["id"], "input": "go on", "tools": [TOOLS]}
        )
    assert r2.status_code == 200, r2.text
    body = sent(upstream)[1]
    assert [i.get("id") for i in body["input"] if i.get("type") == "reasoning"] == ["rs_1"]


# --- item 6: tool names (B29) ----------------------------------------------------------------------


def test_b29_dotted_mcp_tool_name_gets_a_valid_upstream_name_and_maps_back(
    upstream: MockUpstream, mcp_url: str
) -> None:
    """openai/codex #8174: `calendar.get_time` broke every request (name pattern)."""
    upstream.push(fc(FC("call_t", "calendar_get_time", "{}")), text("it is noon"))
    with loop(upstream, mcp_url) as (url, _), sdk(url) as client:
        r = client.responses.create(model="m", input="what time is it?", store=False, tools=[TOOLS])  # type: ignore[list-item]
    first = sent(upstream)[0]
    names = [t["name"] for t in first["tools"]]
    assert "calendar_get_time" in names and "calendar.get_time" not in names
    assert CALLS.seen == [("calendar.get_time", {})]
    listed = next(i for i in r.output if i.type == "mcp_list_tools")
    assert "calendar.get_time" in [t.name for t in listed.tools]
    call = next(i for i in r.output if i.type == "mcp_call")
    assert (call.name, call.output) == ("calendar.get_time", "12:00")
    assert r.output_text == "it is noon"


def test_b29_upstream_400_param_indexes_the_clients_tools(upstream: MockUpstream, mcp_url: str) -> None:
    """The MCP server expands to three function tools before the client's own function: the
    upstream's tools[3] is the client's tools[1]."""
    own = {"type": "function", "name": "bad name", "parameters": {"type": "object", "properties": {}}}
    upstream.push(
        Reply.json(
            {
                "error": {
                    "message": "Invalid 'tools[3].name': string does not match pattern.",
                    "type": "invalid_request_error",
                    "param": "tools[3].name",
                    "code": "invalid_value",
                }
            },
            status=400,
        )
    )
    with loop(upstream, mcp_url) as (url, _):
        r = post(url, {"model": "m", "input": "hi", "tools": [TOOLS, own], "store": False})
    assert len(upstream.requests[0].json()["tools"]) == 4
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools[1].name" and "tools[1].name" in error["message"], error


def test_names_that_collide_after_sanitising_stay_unique() -> None:
    from middleware.tools.names import FUNCTION_NAME, upstream_name

    taken = {"calendar_get_time"}
    renamed = upstream_name("calendar.get_time", taken)
    assert renamed != "calendar_get_time" and FUNCTION_NAME.fullmatch(renamed)
    long = "x" * 70
    assert upstream_name(long, set()) == "x" * 64
    assert len(upstream_name(long, {"x" * 64})) == 64 and upstream_name(long, {"x" * 64}) != "x" * 64
    assert upstream_name("ok_name-1", {"ok_name-1"}) == "ok_name-1"  # a real clash is the catalog's 400


# --- item 7: tool_choice (B39) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "first", "later"),
    [
        (
            {"type": "mcp", "server_label": "tools", "name": "lookup"},
            {"type": "function", "name": "lookup"},
            "auto",
        ),
        (
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "mcp", "server_label": "tools"}],
            },
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": n} for n in ("lookup", "calendar_get_time", "charge")],
            },
            {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": n} for n in ("lookup", "calendar_get_time", "charge")],
            },
        ),
        (
            {"type": "mcp", "server_label": "tools", "name": "calendar.get_time"},
            {"type": "function", "name": "calendar_get_time"},
            "auto",
        ),
        (
            {"type": "mcp", "server_label": "tools"},
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": n} for n in ("lookup", "calendar_get_time", "charge")],
            },
            "auto",
        ),
        (
            {"type": "function", "name": "calendar.get_time"},
            {"type": "function", "name": "calendar_get_time"},
            "auto",
        ),
        ({"type": "function", "name": "lookup"}, {"type": "function", "name": "lookup"}, "auto"),  # control
    ],
)
def test_b39_tool_choice_naming_an_mcp_tool_is_translated(
    upstream: MockUpstream, mcp_url: str, choice: dict[str, Any], first: Any, later: Any
) -> None:
    upstream.push(fc(FC("call_l", "lookup", '{"q":"z"}')), text("done"))
    with loop(upstream, mcp_url) as (url, _):
        r = post(
            url, {"model": "m", "input": "look", "tools": [TOOLS], "tool_choice": choice, "store": False}
        )
    assert r.status_code == 200, r.text
    bodies = sent(upstream)
    assert [b["tool_choice"] for b in bodies] == [first, later]
    assert r.json()["tool_choice"] == choice


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "mcp", "server_label": "nope", "name": "lookup"},
        {"type": "mcp", "server_label": "tools", "name": "missing"},
        {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp", "server_label": "nope"}]},
    ],
)
def test_b39_tool_choice_naming_an_undeclared_mcp_tool_is_a_400(
    upstream: MockUpstream, mcp_url: str, choice: dict[str, Any]
) -> None:
    with loop(upstream, mcp_url) as (url, _):
        r = post(
            url, {"model": "m", "input": "look", "tools": [TOOLS], "tool_choice": choice, "store": False}
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice"
    assert upstream.requests == []


# --- the OpenAI Agents SDK -------------------------------------------------------------------------

agents = pytest.importorskip("agents")


def with_agent(url: str, tool: Any, body: Callable[[Any], Awaitable[Any]]) -> Any:
    """Run `body(agent)` on a fresh event loop: an Agents SDK agent whose model is the gateway."""
    from openai import AsyncOpenAI

    async def main() -> Any:
        agents.set_tracing_disabled(True)
        async with AsyncOpenAI(base_url=url + "/v1", api_key="client-key", max_retries=0) as client:
            model = agents.OpenAIResponsesModel(model="m", openai_client=client)
            return await body(
                agents.Agent(name="assistant", instructions="be brief", model=model, tools=[tool])
            )

    return asyncio.run(main())


async def _run(agent: Any, value: Any, streamed: bool) -> Any:
    if not streamed:
        return await agents.Runner.run(agent, value)
    result = agents.Runner.run_streamed(agent, value)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("approve", [True, False], ids=["approve", "deny"])
def test_agents_sdk_hosted_mcp_approval_callback(
    upstream: MockUpstream, mcp_url: str, streamed: bool, approve: bool
) -> None:
    """`HostedMCPTool(require_approval="always", on_approval_request=...)`, as in the SDK's own
    example: the SDK answers inline, without previous_response_id."""
    upstream.push(fc(FC("call_A", "lookup", '{"q":"agents"}')), text("approved" if approve else "refused"))
    asked: list[str] = []

    def on_approval(request: Any) -> Any:
        asked.append(request.data.name)
        return {"approve": True} if approve else {"approve": False, "reason": "not now"}

    tool = agents.HostedMCPTool(tool_config=ALWAYS, on_approval_request=on_approval)  # type: ignore[arg-type]
    with loop(upstream, mcp_url) as (url, _):
        result = with_agent(url, tool, lambda agent: _run(agent, "look up agents", streamed))
    assert asked == ["lookup"]
    assert CALLS.seen == ([("lookup", {"q": "agents"})] if approve else [])
    assert result.final_output == ("approved" if approve else "refused")
    bodies = sent(upstream)
    assert len(bodies) == 2 and all("previous_response_id" not in b for b in bodies)
    output = outputs_of(bodies[1])["call_A"]
    assert output == "found agents" if approve else "not now" in output


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_hosted_mcp_manual_approval(upstream: MockUpstream, mcp_url: str, streamed: bool) -> None:
    """No callback: the run stops with an interruption; `state.approve(...)` and run again."""
    upstream.push(fc(FC("call_M", "charge", '{"amount":7}')), text("charged"))
    tool = agents.HostedMCPTool(tool_config=ALWAYS)  # type: ignore[arg-type]

    async def main(agent: Any) -> Any:
        first = await _run(agent, "charge 7", streamed)
        assert [i.raw_item.name for i in first.interruptions] == ["charge"] and CALLS.seen == []
        state = first.to_state()
        for item in first.interruptions:
            state.approve(item)
        return await _run(agent, state, streamed)

    with loop(upstream, mcp_url) as (url, _):
        result = with_agent(url, tool, main)
    assert CALLS.seen == [("charge", {"amount": 7})]
    assert result.final_output == "charged"
    assert outputs_of(sent(upstream)[1]) == {"call_M": "charged 7"}


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_function_tool_through_the_gateway(
    upstream: MockUpstream, mcp_url: str, streamed: bool
) -> None:
    """A client-owned function tool: the gateway hands the call back, the SDK runs it and sends
    the output with the whole history (no store needed)."""
    ran: list[str] = []

    @agents.function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    upstream.push(fc(FC("call_w", "weather", '{"city":"Oslo"}')), text("It is sunny in Oslo."))
    with loop(upstream, mcp_url) as (url, _):
        result = with_agent(url, weather, lambda agent: _run(agent, "weather in Oslo?", streamed))
    assert ran == ["Oslo"] and result.final_output == "It is sunny in Oslo."
    assert outputs_of(sent(upstream)[1]) == {"call_w": "sunny in Oslo"}


# --- LangChain ---------------------------------------------------------------------------------------


def test_langchain_chat_openai_responses_api(upstream: MockUpstream, mcp_url: str) -> None:
    """`ChatOpenAI(use_responses_api=True)` with the gateway's MCP tools bound as a built-in tool."""
    langchain_openai = pytest.importorskip("langchain_openai")
    upstream.push(fc(FC("call_g", "lookup", '{"q":"lc"}')), text("langchain works"))
    with loop(upstream, mcp_url) as (url, _):
        llm = langchain_openai.ChatOpenAI(
            model="m", base_url=url + "/v1", api_key="client-key", use_responses_api=True, max_retries=0
        )
        answer = llm.bind_tools([TOOLS]).invoke("look up lc")
    assert CALLS.seen == [("lookup", {"q": "lc"})]
    assert "langchain works" in answer.text
    assert json.dumps(sent(upstream)[0]["tools"]).count('"type": "function"') == 3
