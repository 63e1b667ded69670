"""The gateway-owned tool layer (issue 5 items 5, 6 and 8; DESIGN.md §6 "Tool exposure", "Execution").

Real MCP servers built with the ``mcp`` SDK (tests/mcp_servers.py), served over streamable HTTP by a
real uvicorn on loopback, in-process, and over stdio. Cases B06 b, B07 b, B14 b, B16, B19 (the
ledger part) and B21 e of ../shared/cases/CASES.md are named in the tests.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import threading
import time
from collections.abc import Coroutine, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

import middleware.tools
from budget import BudgetExceeded, Ledger
from middleware.dev.demo_tools import demo_catalog, evaluate
from middleware.errors import Failure, InvalidRequest, McpServerUnavailable
from middleware.outcomes import resolve, retryable
from middleware.tools import (
    McpServerConfig,
    ResolvedTools,
    ToolCatalog,
    UrlAllowlist,
    refuse_tool_call,
    run_tool_calls,
)
from middleware.tools.endpoints import normalize_url
from middleware.tools.text import SurrogateEscapeFixer, scrub_text
from tests.logs import gateway_log_filters
from tests.mcp_servers import (
    STDIO_COMMAND,
    Probe,
    Recorder,
    build_other_server,
    build_tools_server,
    serve_mcp,
)
from tests.servers import free_port, serve_asgi

T = TypeVar("T")
NEVER = "never"


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class FakeLedger:
    """The `budget.Ledger` tool-result charge (32 x bytes) with a limit; records what it charged."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.limit = limit
        self.charged = 0
        self.admitted: list[int] = []

    def admit_tool_result(self, raw: bytes) -> int:
        charge = 32 * len(raw)
        if self.charged + charge > self.limit:
            raise BudgetExceeded("tool_result", charge, self.charged, self.limit)
        self.charged += charge
        self.admitted.append(len(raw))
        return charge


def call(call_id: str, name: str, arguments: Any = "{}") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def mcp_tool(label: str = "tools", **extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "require_approval": NEVER, **extra}


@pytest.fixture(scope="module")
def tools_http() -> Iterator[tuple[str, Recorder, Probe]]:
    probe = Probe()
    with serve_mcp(build_tools_server(probe)) as (url, recorder):
        yield url, recorder, probe


@pytest.fixture(scope="module")
def other_http() -> Iterator[tuple[str, Recorder, Probe]]:
    probe = Probe()
    with serve_mcp(build_other_server(probe)) as (url, recorder):
        yield url, recorder, probe


@pytest.fixture
def probe(tools_http: tuple[str, Recorder, Probe]) -> Probe:
    tools_http[2].reset()
    return tools_http[2]


@pytest.fixture
def catalog(tools_http: tuple[str, Recorder, Probe], other_http: tuple[str, Recorder, Probe]) -> ToolCatalog:
    return ToolCatalog(
        [McpServerConfig(label="tools", url=tools_http[0]), McpServerConfig(label="other", url=other_http[0])]
    )


async def resolve_and_run(
    catalog: ToolCatalog, calls: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **kw: Any
) -> tuple[ResolvedTools, list[Any]]:
    resolved = await catalog.resolve(tools or [mcp_tool()])
    kw.setdefault("ledger", FakeLedger())
    return resolved, await run_tool_calls(resolved, calls, **kw)


def refused(excinfo: pytest.ExceptionInfo[Failure]) -> tuple[type[Failure], str | None, str | None]:
    """What `ToolCatalog.resolve` raised: (failure type, ``code``, ``param``). Raise sites name no
    HTTP status; `middleware.outcomes` maps the failure to one."""
    return type(excinfo.value), excinfo.value.code, excinfo.value.param


# --- exposure: tools/list, names, filters, approval ---------------------------------------------------

LOOKUP_SCHEMA = {
    "properties": {
        "location": {"default": "", "title": "Location", "type": "string"},
        "p": {"default": "", "title": "P", "type": "string"},
        "q": {"default": "", "title": "Q", "type": "string"},
    },
    "title": "lookupArguments",
    "type": "object",
}
FAST1_SCHEMA = {"properties": {}, "title": "fast1Arguments", "type": "object"}


def test_resolve_replaces_the_mcp_entry_with_function_tools_and_passes_others_through(
    catalog: ToolCatalog,
) -> None:
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    search = {"type": "web_search"}
    resolved = run(catalog.resolve([weather, mcp_tool(allowed_tools=["lookup", "fast1"]), search]))
    assert resolved.upstream_tools == [
        weather,
        {
            "type": "function",
            "name": "lookup",
            "description": "Look something up.",
            "parameters": LOOKUP_SCHEMA,
            "strict": False,
        },
        {
            "type": "function",
            "name": "fast1",
            "description": "Sleeps 0.3 s, returns ok1.",
            "parameters": FAST1_SCHEMA,
            "strict": False,
        },
        search,
    ]
    [item] = resolved.list_items
    assert item["id"].startswith("mcpl_") and len(item["id"]) > 10
    assert {k: v for k, v in item.items() if k != "id"} == {
        "type": "mcp_list_tools",
        "server_label": "tools",
        "tools": [
            {
                "name": "lookup",
                "description": "Look something up.",
                "input_schema": LOOKUP_SCHEMA,
                "annotations": {"readOnlyHint": True},
            },
            {
                "name": "fast1",
                "description": "Sleeps 0.3 s, returns ok1.",
                "input_schema": FAST1_SCHEMA,
                "annotations": None,
            },
        ],
    }
    tool = resolved.gateway_tool("lookup")
    assert tool is not None
    assert (tool.server_label, tool.name, tool.function_name, tool.require_approval) == (
        "tools",
        "lookup",
        "lookup",
        False,
    )
    assert resolved.gateway_tool("get_weather") is None  # client-owned
    assert resolved.gateway_tool("slow") is None  # filtered out by allowed_tools


def test_no_mcp_tools_means_no_io_and_unchanged_tools() -> None:
    catalog = ToolCatalog([McpServerConfig(label="down", url="http://127.0.0.1:9/mcp")])
    tools = [{"type": "function", "name": "f", "parameters": {}}]
    resolved = run(catalog.resolve(tools))
    assert resolved.upstream_tools == tools and resolved.list_items == [] and resolved.gateway_tools == {}
    assert run(catalog.resolve(None)).upstream_tools == []


def test_two_servers_sharing_a_name_both_get_mangled(catalog: ToolCatalog) -> None:
    resolved = run(catalog.resolve([mcp_tool(allowed_tools=["lookup", "fast1"]), mcp_tool("other")]))
    names = [t["name"] for t in resolved.upstream_tools]
    assert names == ["tools__lookup", "fast1", "other__lookup", "weather"]
    mangled = resolved.gateway_tool("other__lookup")
    assert mangled is not None and (mangled.server_label, mangled.name) == ("other", "lookup")
    assert resolved.gateway_tool("lookup") is None
    # mcp_list_tools shows the servers' own names
    assert [t["name"] for t in resolved.list_items[1]["tools"]] == ["lookup", "weather"]
    # and the mangled name calls the right server's tool
    outcomes = run(run_tool_calls(resolved, [call("c1", "other__lookup", '{"q":"x"}')], ledger=FakeLedger()))
    assert outcomes[0].output == "other lookup x"


def test_no_mangling_when_allowed_tools_removes_the_clash(catalog: ToolCatalog) -> None:
    resolved = run(
        catalog.resolve([mcp_tool(allowed_tools=["lookup"]), mcp_tool("other", allowed_tools=["weather"])])
    )
    assert [t["name"] for t in resolved.upstream_tools] == ["lookup", "weather"]


@pytest.mark.parametrize(
    ("allowed", "names"),
    [
        (["fast1", "fast2", "no_such_tool"], ["fast1", "fast2"]),
        ({"tool_names": ["fast2"]}, ["fast2"]),
        ({"read_only": True}, ["lookup"]),
        ({"tool_names": ["lookup", "fast1"], "read_only": False}, ["fast1"]),
        ([], []),
    ],
)
def test_allowed_tools_forms(catalog: ToolCatalog, allowed: Any, names: list[str]) -> None:
    resolved = run(catalog.resolve([mcp_tool(allowed_tools=allowed)]))
    assert list(resolved.gateway_tools) == names
    assert [t["name"] for t in resolved.list_items[0]["tools"]] == names


@pytest.mark.parametrize(
    ("require_approval", "lookup", "fast1"),
    [
        ("always", True, True),
        (None, True, True),  # the default, as in OpenAI's API
        ("never", False, False),
        ({"never": {"tool_names": ["fast1"]}}, True, False),
        ({"always": {"tool_names": ["fast1"]}}, True, True),  # unmatched tools still need approval
        ({"always": {"tool_names": ["lookup"]}, "never": {"tool_names": ["lookup", "fast1"]}}, True, False),
        ({"never": {"read_only": True}}, False, True),
        ({"never": {}}, True, True),  # an empty filter matches nothing
    ],
)
def test_require_approval_forms(
    catalog: ToolCatalog, require_approval: Any, lookup: bool, fast1: bool
) -> None:
    entry = {"type": "mcp", "server_label": "tools", "allowed_tools": ["lookup", "fast1"]}
    if require_approval is not None:
        entry["require_approval"] = require_approval
    resolved = run(catalog.resolve([entry]))
    assert resolved.gateway_tools["lookup"].require_approval is lookup
    assert resolved.gateway_tools["fast1"].require_approval is fast1


@pytest.mark.parametrize(
    "entry",
    [
        {"require_approval": "sometimes"},
        {"require_approval": {"maybe": {}}},
        {"allowed_tools": "lookup"},
        {"allowed_tools": {"tool_names": [1]}},
        {"allowed_tools": {"read_only": "yes"}},
        {"server_label": "1bad"},
        {"server_label": None},
    ],
)
def test_malformed_mcp_entries_are_400_invalid_value(catalog: ToolCatalog, entry: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve([{"type": "mcp", "server_label": "tools", **entry}]))
    assert refused(excinfo) == (InvalidRequest, "invalid_value", "tools")
    assert excinfo.value.message.startswith("tools[0]: ")


def test_unknown_label_is_400_unknown_mcp_server(catalog: ToolCatalog) -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve([{"type": "function", "name": "f"}, mcp_tool("nope")]))
    assert refused(excinfo) == (InvalidRequest, "unknown_mcp_server", "tools")
    assert "tools[1]" in excinfo.value.message and "'nope'" in excinfo.value.message
    assert "configured: tools, other" in excinfo.value.message


def test_function_tool_with_an_mcp_tool_name_is_400_duplicate_tool_name(catalog: ToolCatalog) -> None:
    tools = [mcp_tool(), {"type": "function", "name": "fast1", "parameters": {}}]
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve(tools))
    assert refused(excinfo) == (InvalidRequest, "duplicate_tool_name", "tools")
    assert "tools[1]" in excinfo.value.message
    # the final (mangled) name is what counts: "lookup" no longer clashes once mangled
    tools = [mcp_tool(), mcp_tool("other"), {"type": "function", "name": "lookup", "parameters": {}}]
    assert run(catalog.resolve(tools)).upstream_tools[-1]["name"] == "lookup"
    tools = [mcp_tool(), mcp_tool("other"), {"type": "function", "name": "other__lookup", "parameters": {}}]
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve(tools))
    assert refused(excinfo) == (InvalidRequest, "duplicate_tool_name", "tools")


def test_a_label_declared_twice_is_400(catalog: ToolCatalog) -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve([mcp_tool(), mcp_tool()]))
    assert refused(excinfo) == (InvalidRequest, "duplicate_mcp_server", "tools")


def test_headers_cannot_be_sent_to_an_operator_server(catalog: ToolCatalog) -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve([mcp_tool(headers={"X-User": "admin"})]))
    assert refused(excinfo) == (InvalidRequest, "invalid_value", "tools")
    assert "admin" not in excinfo.value.message


# --- the allowlist: client-declared server_url ----------------------------------------------------------

ALLOW = ["http://good.example", "https://api.example.com/mcp/", "http://10.0.0.1:8080/tools"]


@pytest.mark.parametrize(
    "url",
    [
        "http://good.example",
        "http://GOOD.example./x",
        "http://good.example:80/any/path?token=1",
        "https://api.example.com/mcp",
        "https://api.example.com:443/mcp/v1",
        "https://api.example.com/%6Dcp/v1",  # %6D is "m"
        "http://10.0.0.1:8080/tools/a",
    ],
)
def test_allowlist_accepts(url: str) -> None:
    assert UrlAllowlist(ALLOW).allows(url) and UrlAllowlist(ALLOW).allows(normalize_url(url))


@pytest.mark.parametrize(
    "url",
    [
        "http://good.example.evil.com/",  # host prefix is not a host
        "http://evil.com/http://good.example",
        "https://good.example/",  # other scheme
        "http://good.example:8080/",  # other port
        "https://api.example.com/mcpx",  # path prefix at a segment boundary only
        "https://api.example.com/mcp/../admin",  # dot segments are refused (issue 17)
        "https://api.example.com/mcp/%2e%2e/admin",  # escaped dots too
        "https://api.example.com/other/../mcp/x",  # even when they would resolve inside the prefix
        "https://api.example.com/",
        "http://10.0.0.1:8081/tools",
        "http://10.0.0.10:8080/tools",
    ],
)
def test_allowlist_refuses_with_400_mcp_server_not_allowed(url: str) -> None:
    catalog = ToolCatalog([], allow_prefixes=ALLOW)
    assert not UrlAllowlist(ALLOW).allows(url)
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve([{"type": "mcp", "server_label": "mine", "server_url": url}]))
    assert refused(excinfo) == (InvalidRequest, "mcp_server_not_allowed", "tools")
    assert "--mcp-allow" in excinfo.value.message


@pytest.mark.parametrize(
    "url",
    [
        "http://good.example@evil.com/",  # userinfo: the host is evil.com
        "http://user:pw@good.example/",
        "ftp://good.example/",
        "http://good.example\\@evil.com/",
        "http:///path",
        "http://good.example:99999/",
        42,
    ],
)
def test_unusable_server_urls_are_400_invalid_value(url: Any) -> None:
    catalog = ToolCatalog([], allow_prefixes=ALLOW)
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve([{"type": "mcp", "server_label": "mine", "server_url": url}]))
    assert refused(excinfo) == (InvalidRequest, "invalid_value", "tools")
    if isinstance(url, str) and "pw" in url:
        assert "pw" not in excinfo.value.message


def test_nothing_is_allowed_without_prefixes(tools_http: tuple[str, Recorder, Probe]) -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        run(ToolCatalog([]).resolve([{"type": "mcp", "server_label": "x", "server_url": tools_http[0]}]))
    assert refused(excinfo) == (InvalidRequest, "mcp_server_not_allowed", "tools")


@pytest.mark.parametrize(
    "headers",
    [{"Host": "internal.example"}, {"Mcp-Session-Id": "x"}, {"X-A": "a\r\nX-B: b"}, {"bad name": "v"}, ["x"]],
)
def test_client_headers_the_gateway_owns_are_refused(
    tools_http: tuple[str, Recorder, Probe], headers: Any
) -> None:
    catalog = ToolCatalog([], allow_prefixes=[tools_http[0]])
    entry = {"type": "mcp", "server_label": "mine", "server_url": tools_http[0], "headers": headers}
    with pytest.raises(InvalidRequest) as excinfo:
        run(catalog.resolve([entry]))
    assert refused(excinfo) == (InvalidRequest, "invalid_value", "tools")


def test_client_declared_headers_reach_that_server_only_and_are_never_shown(
    tools_http: tuple[str, Recorder, Probe],
    other_http: tuple[str, Recorder, Probe],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, recorder, _ = tools_http
    secret = "s3cret-value-9f2"
    catalog = ToolCatalog([McpServerConfig(label="other", url=other_http[0])], allow_prefixes=[url])
    entry = {
        "type": "mcp",
        "server_label": "mine",
        "server_url": url + "?key=" + secret,
        "headers": {"X-Api-Key": secret},
        "authorization": secret + "-tok",
        "require_approval": "never",
        "allowed_tools": ["echo"],
    }
    seen_before = len(recorder.headers)
    with caplog.at_level(logging.DEBUG), gateway_log_filters():
        resolved, outcomes = run(
            resolve_and_run(
                catalog, [call("c1", "echo"), call("c2", "weather")], tools=[entry, mcp_tool("other")]
            )
        )
    assert [o.outcome for o in outcomes] == ["ok", "ok"]
    mine = recorder.headers[seen_before:]
    assert mine and all(h.get("x-api-key") == secret for h in mine)
    assert all(h.get("authorization") == f"Bearer {secret}-tok" for h in mine)
    assert all("x-api-key" not in h and "authorization" not in h for h in other_http[1].headers)
    # The test MCP server's own uvicorn access log (not the gateway's) is left out.
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name != "uvicorn.access")
    shown = repr(resolved) + repr(resolved.endpoint("mine")) + repr(catalog) + logged
    shown += json.dumps(resolved.upstream_tools) + json.dumps(resolved.list_items)
    assert secret not in shown


def test_each_client_credential_gets_its_own_cached_list(tools_http: tuple[str, Recorder, Probe]) -> None:
    url, recorder, _ = tools_http
    catalog = ToolCatalog([], allow_prefixes=[url])
    before = recorder.count("tools/list")

    def declare(key: str) -> list[dict[str, Any]]:
        return [{"type": "mcp", "server_label": "m", "server_url": url, "headers": {"X-Key": key}}]

    run(catalog.resolve(declare("a")))
    run(catalog.resolve(declare("a")))
    run(catalog.resolve(declare("b")))
    assert recorder.count("tools/list") - before == 2


# --- listing: cache and failures -------------------------------------------------------------------------


def test_tools_list_is_cached_for_list_ttl(tools_http: tuple[str, Recorder, Probe]) -> None:
    url, recorder, _ = tools_http
    cached = ToolCatalog([McpServerConfig(label="tools", url=url)], list_ttl=300)
    before = recorder.count("tools/list")
    for _ in range(3):
        run(cached.resolve([mcp_tool()]))
    assert recorder.count("tools/list") - before == 1
    uncached = ToolCatalog([McpServerConfig(label="tools", url=url)], list_ttl=0)
    before = recorder.count("tools/list")
    for _ in range(2):
        run(uncached.resolve([mcp_tool()]))
    assert recorder.count("tools/list") - before == 2


def test_a_server_that_is_down_fails_the_request_with_502() -> None:
    catalog = ToolCatalog([McpServerConfig(label="down", url=f"http://127.0.0.1:{free_port()}/mcp")])
    for _ in range(2):  # failures are not cached
        with pytest.raises(McpServerUnavailable) as excinfo:
            run(catalog.resolve([mcp_tool("down")]))
        assert refused(excinfo) == (McpServerUnavailable, None, "tools")
        outcome = resolve(excinfo.value)
        assert (outcome.status, outcome.code, retryable(outcome)) == (502, "mcp_server_unavailable", True)
        assert excinfo.value.message.startswith(
            "MCP server 'down' is unavailable: listing its tools failed ("
        )


def test_a_server_that_never_answers_is_502_after_connect_timeout() -> None:
    release = threading.Event()

    async def hanging_app(scope: Any, receive: Any, send: Any) -> None:
        while scope["type"] == "http" and not release.is_set():  # accepts, never answers
            await asyncio.sleep(0.02)

    with serve_asgi(hanging_app, lifespan="off") as base:
        catalog = ToolCatalog([McpServerConfig(label="hung", url=f"{base}/mcp")], connect_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(McpServerUnavailable) as excinfo:
            run(catalog.resolve([mcp_tool("hung")]))
        elapsed = time.monotonic() - started
        release.set()
    assert refused(excinfo) == (McpServerUnavailable, None, "tools")
    assert resolve(excinfo.value).status == 502
    assert "no answer within 0.5s" in excinfo.value.message
    assert 0.5 <= elapsed < 1.5


# --- configuration --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"label": "x"}, "exactly one of url, command or app"),
        ({"label": "x", "url": "http://a", "command": ["b"]}, "exactly one of url, command or app"),
        ({"label": "9x", "url": "http://a"}, "server_label must be a letter"),
        ({"label": "x", "url": "ftp://a"}, "http or https"),
        ({"label": "x", "command": "python server.py"}, "non-empty list of strings"),
        ({"label": "x", "command": ["a"], "headers": {"A": "b"}}, "headers apply to a url server only"),
        ({"label": "x", "url": "http://a", "headers": {"A": "b\n"}}, "without CR, LF or NUL"),
    ],
)
def test_server_config_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        McpServerConfig(**kwargs)


def test_server_config_repr_hides_header_values_and_query() -> None:
    config = McpServerConfig(
        label="x", url="http://a.example/mcp?token=qqq", headers={"Authorization": "Bearer zzz"}
    )
    assert repr(config) == (
        "McpServerConfig(label='x', url='http://a.example/mcp?***', headers={'Authorization': '***'})"
    )
    assert config.url == "http://a.example/mcp?token=qqq"


def test_catalog_validation() -> None:
    with pytest.raises(ValueError, match="configured twice"):
        ToolCatalog([McpServerConfig(label="a", url="http://a"), McpServerConfig(label="a", url="http://b")])
    with pytest.raises(ValueError, match=r"allowlist prefix 'good\.example' is invalid"):
        ToolCatalog([], allow_prefixes=["good.example"])
    with pytest.raises(ValueError, match="must not have a query"):
        ToolCatalog([], allow_prefixes=["http://good.example/?a=1"])
    with pytest.raises(ValueError, match="mcp_list_ttl"):
        ToolCatalog([], list_ttl=-1)


# --- execution -------------------------------------------------------------------------------------------


def test_a_call_returns_the_tool_text_and_charges_exactly_its_bytes(
    catalog: ToolCatalog, probe: Probe
) -> None:
    ok_before = sample("loopwarden_tool_calls_total", outcome="ok")
    count_before = sample("loopwarden_tool_call_duration_seconds_count")
    ledger = FakeLedger()
    _, [outcome] = run(
        resolve_and_run(
            catalog, [call("call_L", "lookup", '{"q": "a", "location": "Bøston"}')], ledger=ledger
        )
    )
    text = "lookup q=a p= location=Bøston"
    assert (outcome.call_id, outcome.output, outcome.error, outcome.outcome) == ("call_L", text, None, "ok")
    assert outcome.ok
    assert outcome.charge == 32 * len(text.encode()) == ledger.charged
    assert ledger.admitted == [len(text.encode())]
    assert 0 < outcome.duration < 5
    assert probe.calls == [("lookup", {"q": "a", "p": "", "location": "Bøston"})]
    assert sample("loopwarden_tool_calls_total", outcome="ok") - ok_before == 1
    assert sample("loopwarden_tool_call_duration_seconds_count") - count_before == 1


def test_b16_a_hung_tool_times_out_while_the_others_finish(
    catalog: ToolCatalog, tools_http: tuple[str, Recorder, Probe], probe: Probe
) -> None:
    timeouts = sample("loopwarden_tool_calls_total", outcome="timeout")
    caps = sample("loopwarden_cap_hits_total", limit="tool_timeout", outcome="tool_error", transport="http")
    calls = [call("call_s", "slow"), call("call_f1", "fast1"), call("call_f2", "fast2")]
    started = time.monotonic()
    _, outcomes = run(resolve_and_run(catalog, calls, timeout=1.0, concurrency=2))
    wall = time.monotonic() - started
    assert [(o.call_id, o.outcome, o.output) for o in outcomes] == [
        ("call_s", "timeout", "<error: tool timed out after 1s>"),
        ("call_f1", "ok", "ok1"),
        ("call_f2", "ok", "ok2"),
    ]
    assert outcomes[0].error == "<error: tool timed out after 1s>"
    assert 1.0 <= outcomes[0].duration < 1.5
    assert 1.0 <= wall < 2.0
    assert probe.peak == 2  # never more than the window, and the window was used
    assert probe.wait_cancelled("slow")  # the MCP request was cancelled at the server
    assert probe.finished == {"fast1", "fast2"}
    assert sample("loopwarden_tool_calls_total", outcome="timeout") - timeouts == 1
    assert (
        sample("loopwarden_cap_hits_total", limit="tool_timeout", outcome="tool_error", transport="http")
        - caps
        == 1
    )


def test_the_window_slides_instead_of_batching(catalog: ToolCatalog, probe: Probe) -> None:
    calls = [
        call("a", "sleep", '{"tag": "a", "seconds": 0.2}'),
        call("b", "sleep", '{"tag": "b", "seconds": 0.8}'),
        call("c", "sleep", '{"tag": "c", "seconds": 0.2}'),
        call("d", "sleep", '{"tag": "d", "seconds": 0.2}'),
    ]
    _, outcomes = run(resolve_and_run(catalog, calls, concurrency=2))
    assert [o.output for o in outcomes] == ["a", "b", "c", "d"]
    assert probe.peak == 2
    # c starts when a ends, d when c ends: both while b is still running (batches would wait for b)
    assert probe.ends["a"] <= probe.starts["c"] < probe.ends["b"]
    assert probe.ends["c"] <= probe.starts["d"] < probe.ends["b"]


@pytest.mark.parametrize(
    ("arguments", "output"),
    [
        ('{"path":"a.txt","content":"hel', "<error: arguments are not valid JSON>"),  # B06 b
        ("{}{}", "<error: arguments are not valid JSON>"),
        ("NaN", "<error: arguments are not valid JSON>"),
        ('{"path": Infinity}', "<error: arguments are not valid JSON>"),
        ("[" * 5000, "<error: arguments are not valid JSON>"),
        ('["a.txt"]', "<error: arguments must be a JSON object, got an array>"),
        ('"a.txt"', "<error: arguments must be a JSON object, got a string>"),
        ("3", "<error: arguments must be a JSON object, got a number>"),
        (
            '{"path":"a","path":"b","content":""}',
            "<error: arguments are not valid JSON: key 'path' appears twice>",
        ),
    ],
)
def test_invalid_arguments_are_not_run(
    catalog: ToolCatalog, tools_http: tuple[str, Recorder, Probe], probe: Probe, arguments: str, output: str
) -> None:
    before = sample("loopwarden_tool_calls_total", outcome="invalid_arguments")
    recorder = tools_http[1]
    calls_before = recorder.count("tools/call")
    ledger = FakeLedger()
    _, [outcome] = run(resolve_and_run(catalog, [call("call_W", "write_file", arguments)], ledger=ledger))
    assert (outcome.call_id, outcome.outcome, outcome.output, outcome.error) == (
        "call_W",
        "invalid_arguments",
        output,
        output,
    )
    assert probe.calls == [] and recorder.count("tools/call") == calls_before
    assert ledger.charged == 0
    assert sample("loopwarden_tool_calls_total", outcome="invalid_arguments") - before == 1


def test_b07_empty_null_and_missing_arguments_run_with_an_empty_object(
    catalog: ToolCatalog, tools_http: tuple[str, Recorder, Probe], probe: Probe
) -> None:
    recorder = tools_http[1]
    seen = len(recorder.tool_arguments())
    calls = [call("c1", "echo", ""), call("c2", "echo", None), call("c3", "echo", "null")]
    calls.append({"call_id": "c4", "name": "echo"})
    _, outcomes = run(resolve_and_run(catalog, calls))
    assert [o.outcome for o in outcomes] == ["ok"] * 4
    assert [o.output for o in outcomes] == ['{"tag":"echo","value":null}'] * 4
    assert recorder.tool_arguments()[seen:] == [("echo", {})] * 4


def test_a_result_over_the_cap_is_too_large_and_not_charged(catalog: ToolCatalog) -> None:
    before = sample("loopwarden_tool_calls_total", outcome="too_large")
    ledger = FakeLedger()
    calls = [call("big", "sized", '{"n": 1001}'), call("fits", "sized", '{"n": 1000}')]
    _, [big, fits] = run(resolve_and_run(catalog, calls, ledger=ledger, max_result_bytes=1000))
    text = (
        "<error: the tool result is 1,001 bytes, 1 bytes over the per-call cap of 1,000 bytes; "
        "raise --tool-max-result-bytes or make the tool return less>"
    )
    assert (big.outcome, big.output, big.error, big.charge) == ("too_large", text, text, 0)
    assert (fits.outcome, fits.output, fits.charge) == ("ok", "x" * 1000, 32_000)
    assert ledger.admitted == [1000] and ledger.charged == 32_000
    assert sample("loopwarden_tool_calls_total", outcome="too_large") - before == 1


def test_an_answer_far_over_the_cap_is_refused_while_reading_and_the_session_survives(
    catalog: ToolCatalog,
) -> None:
    calls = [call("huge", "sized", '{"n": 1100000}'), call("next", "sized", '{"n": 10}')]
    _, [huge, after] = run(resolve_and_run(catalog, calls, max_result_bytes=1000, concurrency=1))
    assert huge.outcome == "too_large" and huge.charge == 0
    assert "over the per-call cap of 1,000 bytes" in huge.output  # refused past 4 x 1000 + 1 MiB
    assert (after.outcome, after.output) == ("ok", "x" * 10)


def test_the_cap_counts_utf8_bytes_not_characters(catalog: ToolCatalog) -> None:
    _, [outcome] = run(
        resolve_and_run(catalog, [call("c", "sized", '{"n": 501, "char": "é"}')], max_result_bytes=1000)
    )
    assert outcome.outcome == "too_large" and "1,002 bytes, 2 bytes over" in outcome.output


def test_b19_a_ledger_overflow_raises_and_cancels_the_other_calls(catalog: ToolCatalog, probe: Probe) -> None:
    ledger = FakeLedger(limit=32 * 1000)
    calls = [
        call("slow", "sleep", '{"tag": "long", "seconds": 10}'),
        call("q", "query_db", '{"sql": "x", "size": 1001}'),
    ]
    started = time.monotonic()
    with pytest.raises(BudgetExceeded) as excinfo:
        run(resolve_and_run(catalog, calls, ledger=ledger, max_result_bytes=16 << 20))
    assert time.monotonic() - started < 1.0
    assert excinfo.value.phase == "tool_result" and excinfo.value.requested == 32 * 1001
    assert ledger.charged == 0  # the refused charge left the ledger unchanged
    assert probe.wait_cancelled("long")


def test_the_real_ledger_charges_and_refuses() -> None:
    ledger = Ledger(1 << 20)
    resolved = run(demo_catalog().resolve([mcp_tool("demo")]))
    [outcome] = run(
        run_tool_calls(resolved, [call("c", "calculate", '{"expression": "6*7"}')], ledger=ledger)
    )
    assert outcome.output == "42" and outcome.charge == ledger.charged > 0
    tight = Ledger(outcome.charge - 1)
    with pytest.raises(BudgetExceeded):
        run(run_tool_calls(resolved, [call("c", "calculate", '{"expression": "6*7"}')], ledger=tight))
    assert tight.charged == 0


@pytest.mark.parametrize("transport", ["http", "in-process"])
def test_b21e_lone_surrogates_in_tool_output_become_u_fffd(catalog: ToolCatalog, transport: str) -> None:
    if transport == "in-process":
        catalog = ToolCatalog([McpServerConfig(label="tools", app=build_tools_server(Probe()))])
    ledger = FakeLedger()
    _, [outcome] = run(resolve_and_run(catalog, [call("c", "surrogate")], ledger=ledger))
    assert (outcome.outcome, outcome.output) == ("ok", "café \ufffd end")
    assert ledger.admitted == [len("café \ufffd end".encode())]


def test_b14b_cancelling_the_caller_cancels_a_running_tool_promptly(
    catalog: ToolCatalog, probe: Probe
) -> None:
    async def scenario() -> float:
        resolved = await catalog.resolve([mcp_tool()])
        task = asyncio.create_task(
            run_tool_calls(
                resolved, [call("s", "sleep", '{"tag": "ten", "seconds": 10}')], ledger=FakeLedger()
            )
        )
        while "ten" not in probe.starts:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - cancelled_at

    assert run(scenario()) < 1.0
    assert probe.wait_cancelled("ten")
    assert "ten" not in probe.finished


def test_tool_errors_and_unknown_tools_are_error_outcomes(catalog: ToolCatalog) -> None:
    errors = sample("loopwarden_tool_calls_total", outcome="error")
    ledger = FakeLedger()
    calls = [call("c1", "fail", '{"message": "disk full"}'), call("c2", "no_such_tool")]
    _, [failed, unknown] = run(resolve_and_run(catalog, calls, ledger=ledger))
    assert (failed.outcome, failed.output, failed.error) == (
        "error",
        "Error executing tool fail: disk full",
        "Error executing tool fail: disk full",
    )
    assert failed.charge == 32 * len(failed.output)  # the tool's own text is a result: charged
    assert (unknown.outcome, unknown.output, unknown.charge) == (
        "error",
        "<error: no gateway tool is named 'no_such_tool'>",
        0,
    )
    assert sample("loopwarden_tool_calls_total", outcome="error") - errors == 2


def test_a_server_gone_at_call_time_is_an_error_outcome_for_each_call() -> None:
    probe = Probe()
    with serve_mcp(build_tools_server(probe)) as (url, _):
        catalog = ToolCatalog([McpServerConfig(label="gone", url=url)], connect_timeout=2)
        resolved = run(catalog.resolve([mcp_tool("gone")]))
    outcomes = run(run_tool_calls(resolved, [call("a", "fast1"), call("b", "fast2")], ledger=FakeLedger()))
    assert [o.outcome for o in outcomes] == ["error", "error"]
    assert all(o.output.startswith("<error: MCP server 'gone' is unavailable (") for o in outcomes)


def test_non_text_content_is_summarised_and_structured_content_used_without_text(
    catalog: ToolCatalog,
) -> None:
    _, [picture, structured] = run(resolve_and_run(catalog, [call("p", "picture"), call("s", "structured")]))
    assert picture.output == "a caption\n[image: image/png, 16 base64 characters omitted]"
    assert structured.output == '{"a":1,"b":"é"}'


def test_refused_calls_are_counted() -> None:
    before = sample("loopwarden_tool_calls_total", outcome="refused")
    outcome = refuse_tool_call(call("c", "write_file"), reason="not today")
    assert (outcome.call_id, outcome.outcome, outcome.ok) == ("c", "refused", False)
    assert outcome.output == outcome.error == "<the user denied this tool call: not today>"
    assert (outcome.charge, outcome.duration) == (0, 0.0)
    assert sample("loopwarden_tool_calls_total", outcome="refused") - before == 1


@pytest.mark.parametrize("reason", [None, "", 42])
def test_a_denial_without_a_reason_says_only_that(reason: Any) -> None:
    before = sample("loopwarden_tool_calls_total", outcome="refused")
    outcome = refuse_tool_call(call("c", "write_file"), reason)
    assert outcome.output == "<the user denied this tool call>"
    assert sample("loopwarden_tool_calls_total", outcome="refused") - before == 1


def test_run_tool_calls_validates_its_settings(catalog: ToolCatalog) -> None:
    resolved = ResolvedTools(
        upstream_tools=[], list_items=[], gateway_tools={}, endpoints={}, connect_timeout=1
    )
    assert run(run_tool_calls(resolved, [], ledger=FakeLedger())) == []
    for kwargs in ({"timeout": 0}, {"concurrency": 0}, {"max_result_bytes": -1}):
        with pytest.raises(ValueError):
            run(run_tool_calls(resolved, [call("c", "x")], ledger=FakeLedger(), **kwargs))
    with pytest.raises(ValueError, match="call_id"):
        run(run_tool_calls(resolved, [{"name": "x"}], ledger=FakeLedger()))


def test_a_stdio_server_works() -> None:
    catalog = ToolCatalog([McpServerConfig(label="tools", command=STDIO_COMMAND)])
    _, outcomes = run(resolve_and_run(catalog, [call("a", "lookup", '{"q": "s"}'), call("b", "fast1")]))
    assert [o.output for o in outcomes] == ["lookup q=s p= location=", "ok1"]


# --- the demo server (make run) ---------------------------------------------------------------------------


def test_demo_catalog_serves_get_time_and_calculate_in_process() -> None:
    catalog = demo_catalog()
    resolved = run(catalog.resolve([mcp_tool("demo")]))
    assert [t["name"] for t in resolved.upstream_tools] == ["get_time", "calculate"]
    assert resolved.upstream_tools[1]["parameters"]["required"] == ["expression"]
    calls = [
        call("t", "get_time", ""),
        call("c", "calculate", '{"expression":"6*7"}'),
        call("z", "calculate", '{"expression":"1/0"}'),
    ]
    now, answer, zero = run(run_tool_calls(resolved, calls, ledger=FakeLedger()))
    stamp = datetime.fromisoformat(now.output)
    assert stamp.utcoffset() is not None and abs(stamp.timestamp() - time.time()) < 5
    assert (answer.outcome, answer.output) == ("ok", "42")
    assert (zero.outcome, zero.output) == ("error", "Error executing tool calculate: division by zero")


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("6*7", "42"),
        ("(1+2)/4", "0.75"),
        ("1/3", "0.3333333333333333"),
        ("-(2 - 5) * .5", "1.5"),
        ("0.1+0.2", "0.3"),
        ("2*(3+4)-5/5", "13"),
        ("--1", "1"),
    ],
)
def test_calculator(expression: str, value: str) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("", "empty"),
        ("2**3", "unexpected '\\*'"),
        ("__import__('os')", "unexpected character '_'"),
        ("(1", "not closed"),
        ("1)", "after a complete expression"),
        ("1/0", "division by zero"),
        ("(" * 150 + "1" + ")" * 150, "nests more than 100"),
        ("1+" * 600 + "1", "over 1000"),
    ],
)
def test_calculator_refuses(expression: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


# --- text helpers --------------------------------------------------------------------------------------------


def test_scrub_text() -> None:
    assert scrub_text("ok") == "ok"
    assert scrub_text("a\udc8db\ud83d") == "a\ufffdb\ufffd"
    assert scrub_text("\ud83d\ude00") == "😀"


def _fix(data: bytes, sizes: list[int]) -> bytes:
    fixer = SurrogateEscapeFixer()
    out, position = b"", 0
    for size in sizes:
        out += fixer.feed(data[position : position + size])
        position += size
    return out + fixer.feed(data[position:]) + fixer.flush()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(["a", "\\", "u", "d8", "\udc8d", "\ud83d", "\ude00", "😀", "é", '"']), max_size=20
    ),
    st.lists(st.integers(0, 7), max_size=20),
)
def test_surrogate_escape_fixer_gives_valid_json_whatever_the_chunking(
    parts: list[str], sizes: list[int]
) -> None:
    text = "".join(parts)
    fixed = json.loads(_fix(json.dumps(text).encode(), sizes))
    assert fixed == scrub_text(text)


def test_surrogate_escape_fixer_keeps_escaped_backslashes_and_pairs() -> None:
    assert _fix(rb'"\\udc8d \ud83d\ude00 \\\udc8d"', [3, 3, 3]) == rb'"\\udc8d \ud83d\ude00 \\\ufffd"'


# --- the subpackage's shape ----------------------------------------------------------------------------------


def test_the_facade_exports_what_the_gateway_uses() -> None:
    assert middleware.tools.__all__ == [
        "GatewayTool",
        "McpServerConfig",
        "PoolLimits",
        "ResolvedTools",
        "ToolCatalog",
        "ToolLedger",
        "ToolOutcome",
        "UrlAllowlist",
        "refuse_tool_call",
        "run_tool_calls",
    ]
    for name in middleware.tools.__all__:
        assert getattr(middleware.tools, name).__module__.startswith("middleware.tools.")


def test_tool_modules_import_each_other_without_cycles() -> None:
    """catalog and execute share `resolved` and never import each other (the old cycle)."""
    package = Path(middleware.tools.__file__).parent
    edges: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        if path.stem == "__init__":
            continue
        tree = ast.parse(path.read_text())
        edges[path.stem] = {
            node.module.rsplit(".", 1)[1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("middleware.tools.")
        }
    assert "execute" not in edges["catalog"] and "catalog" not in edges["execute"]
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module not in done:
            for target in edges[module]:
                visit(target, (*path, module))
            done.add(module)

    for module in edges:
        visit(module, ())
