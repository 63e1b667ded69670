"""``tools/list``: charged to the request that fetches it, cached within a byte cap (issue 15
"memory truth", item 4; ../shared/cases/CASES.md B35).

Real MCP servers built with the ``mcp`` SDK, served over streamable HTTP by a real uvicorn on
loopback — in this process, or in a child process where ``tracemalloc`` must see the gateway's
allocations alone — and the gateway on a real uvicorn with a scripted upstream for the end-to-end
cases. Counts come from the servers' own request logs (`tests.mcp_servers.Recorder`) and from
the catalog's `ListingCache` (entries and bytes), never from RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import socket
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import mcp_types
import pytest
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import Tool, ToolListChangedNotification
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from budget import BudgetExceeded, JsonNodeCounter, Ledger, count_json_nodes
from middleware import cli
from middleware.config import Settings, SettingsError, load_settings
from middleware.outcomes import resolve as outcome_of
from middleware.tools import McpServerConfig, ToolCatalog, run_tool_calls
from middleware.tools.catalog import DEFAULT_LIST_CACHE_BYTES, _listed, _serialized
from middleware.tools.endpoints import Endpoint
from middleware.tools.listing import LISTING_MODEL, ListingCache, ListingMeter, listing_size
from tests.helpers import FC, B, gateway, message_item, response_obj, sdk
from tests.mcp_servers import Probe, Recorder, build_tools_server, serve_mcp
from tests.mock_upstream import MockUpstream, Reply
from tests.servers import free_port, serve_asgi

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def mcp_tool(label: str = "tools", **extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "require_approval": "never", **extra}


def declared_url(url: str, **extra: Any) -> dict[str, Any]:
    return mcp_tool("mine", server_url=url, **extra)


# --- servers -------------------------------------------------------------------------------------------


def typical_tool(i: int) -> Tool:
    """A typical tool definition (about 380 bytes and 40 JSON nodes on the wire)."""
    return Tool(
        name=f"get_weather_{i}",
        description="Get the current weather and a short forecast for a city.",
        input_schema={
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "units"],
            "additionalProperties": False,
        },
    )


def build_listing_server(tools: int) -> MCPServer[Any]:
    """A server whose ``tools/list`` answers `tools` typical tools (it runs none of them)."""
    server: MCPServer[Any] = MCPServer("big", log_level="WARNING")
    listing = [typical_tool(i) for i in range(tools)]

    async def list_tools() -> list[Tool]:
        return listing

    server.list_tools = list_tools  # type: ignore[method-assign]
    return server


def build_beta_server() -> MCPServer[Any]:
    """CASES.md B35's ``tools`` server: ``enable_beta`` adds the tool ``beta`` and sends
    ``notifications/tools/list_changed`` on the call's own stream."""
    server: MCPServer[Any] = MCPServer("tools", log_level="WARNING")

    async def beta() -> str:
        """The tool enable_beta adds."""
        return "beta ran"

    @server.tool()
    async def lookup(q: str = "") -> str:
        """Look something up."""
        return f"lookup {q}"

    @server.tool()
    async def enable_beta(ctx: Context) -> str:
        """Adds the tool beta, then says so on this call's stream."""
        if server._tool_manager.get_tool("beta") is None:
            server.add_tool(beta, name="beta")
        await ctx.session.send_notification(ToolListChangedNotification(), related_request_id=ctx.request_id)
        return "beta enabled"

    return server


def legacy_only(app: ASGIApp) -> ASGIApp:
    """`app` refusing ``server/discover`` (as a pre-2026 server does), so that clients fall back to
    the ``initialize`` handshake and the SDK's server answers requests as SSE streams."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        parsed = json.loads(body) if body else None
        if isinstance(parsed, dict) and parsed.get("method") == "server/discover":
            error = {"code": -32601, "message": "Method not found"}
            answer = json.dumps({"jsonrpc": "2.0", "id": parsed.get("id"), "error": error}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": answer})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await app(scope, replay, send)

    return wrapped


def _serve_listing(tools: int, port: int) -> None:
    """(child process) Serve `build_listing_server(tools)` on 127.0.0.1:`port` until killed."""
    import uvicorn

    uvicorn.run(
        build_listing_server(tools).streamable_http_app(), host="127.0.0.1", port=port, log_level="warning"
    )


@contextlib.contextmanager
def listing_server_process(tools: int) -> Iterator[str]:
    """`build_listing_server(tools)` in a child process (so that ``tracemalloc`` here sees the
    gateway side alone); yields its endpoint URL."""
    port = free_port()
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.tools.test_listing_cache import _serve_listing; _serve_listing({tools}, {port})"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the listing server did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tools_http() -> Iterator[tuple[str, Recorder]]:
    with serve_mcp(build_tools_server(Probe())) as (url, recorder):
        yield url, recorder


@pytest.fixture(scope="module")
def big_http() -> Iterator[tuple[str, Recorder]]:
    with serve_mcp(build_listing_server(2000)) as (url, recorder):
        yield url, recorder


@pytest.fixture
def beta_http() -> Iterator[tuple[str, Recorder]]:
    with serve_mcp(build_beta_server()) as (url, recorder):
        yield url, recorder


async def resolve_each(catalog: ToolCatalog, requests: list[tuple[list[dict[str, Any]], str]]) -> None:
    """Resolve each (tools, caller) in order, on one event loop."""
    for tools, tenant in requests:
        await catalog.resolve(tools, tenant=tenant)


def one_entry_size(url: str) -> int:
    """The cache size of the tools server's listing under a ``server_url`` as long as `url`."""
    catalog = ToolCatalog([], allow_prefixes=[url.partition("?")[0]])
    run(resolve_each(catalog, [([declared_url(url)], "caller")]))
    assert catalog.cache.entries == 1
    return catalog.cache.bytes


# --- the byte cap and LRU ------------------------------------------------------------------------------


def test_the_cache_never_grows_past_its_byte_cap_whatever_the_server_urls(
    tools_http: tuple[str, Recorder],
) -> None:
    url, recorder = tools_http
    one = one_entry_size(f"{url}?v=10")
    cap = 3 * one + one // 2
    catalog = ToolCatalog([], allow_prefixes=[url], list_cache_bytes=cap)
    before = recorder.count("tools/list")
    sizes: list[int] = []

    async def flood() -> None:
        try:
            for i in range(10, 50):  # 40 distinct query strings of one length
                await catalog.resolve([declared_url(f"{url}?v={i}")], tenant="caller")
                sizes.append(catalog.cache.bytes)
            assert recorder.count("tools/list") - before == 40  # every URL listed: none got another's
            await catalog.resolve([declared_url(f"{url}?v=49")], tenant="caller")  # still cached
            assert recorder.count("tools/list") - before == 40
            await catalog.resolve([declared_url(f"{url}?v=10")], tenant="caller")  # evicted long ago
            assert recorder.count("tools/list") - before == 41
        finally:
            await catalog.aclose()

    run(flood())
    assert max(sizes) <= cap
    assert sizes[:4] == [one, 2 * one, 3 * one, 3 * one]
    assert (catalog.cache.entries, catalog.cache.bytes) == (3, 3 * one)


def test_eviction_is_least_recently_used_not_least_recently_stored(tools_http: tuple[str, Recorder]) -> None:
    url, recorder = tools_http
    one = one_entry_size(f"{url}?v=a")
    catalog = ToolCatalog([], allow_prefixes=[url], list_cache_bytes=2 * one)
    a, b, c = ([declared_url(f"{url}?v={v}")] for v in "abc")
    before = recorder.count("tools/list")
    run(
        resolve_each(catalog, [(a, "caller"), (b, "caller"), (a, "caller"), (c, "caller")])
    )  # a used again: b is evicted
    assert recorder.count("tools/list") - before == 3
    before = recorder.count("tools/list")
    run(resolve_each(catalog, [(a, "caller"), (c, "caller")]))
    assert recorder.count("tools/list") - before == 0
    run(resolve_each(catalog, [(b, "caller")]))
    assert recorder.count("tools/list") - before == 1
    assert catalog.cache.entries == 2


def test_a_listing_larger_than_the_cap_is_not_cached(tools_http: tuple[str, Recorder]) -> None:
    url, recorder = tools_http
    one = one_entry_size(f"{url}?v=a")
    catalog = ToolCatalog([], allow_prefixes=[url], list_cache_bytes=one - 1)
    before = recorder.count("tools/list")
    run(resolve_each(catalog, [([declared_url(f"{url}?v=a")], "caller")] * 2))
    assert recorder.count("tools/list") - before == 2
    assert (catalog.cache.entries, catalog.cache.bytes) == (0, 0)


def test_two_callers_never_share_a_listing_entry(tools_http: tuple[str, Recorder]) -> None:
    url, recorder = tools_http
    catalog = ToolCatalog([McpServerConfig(label="tools", url=url)], allow_prefixes=[url])
    mine = [declared_url(url, headers={"X-Key": "same"})]
    before = recorder.count("tools/list")
    run(
        resolve_each(
            catalog, [(mine, "alice"), (mine, "bob"), ([mcp_tool()], "alice"), ([mcp_tool()], "bob")]
        )
    )
    assert recorder.count("tools/list") - before == 4
    assert catalog.cache.entries == 4
    run(
        resolve_each(
            catalog, [(mine, "alice"), (mine, "bob"), ([mcp_tool()], "alice"), ([mcp_tool()], "bob")]
        )
    )
    assert recorder.count("tools/list") - before == 4  # each caller's own entry serves it again


def test_listing_cache_unit_rules() -> None:
    now = [0.0]
    cache: ListingCache[str] = ListingCache(100, 10.0, clock=lambda: now[0])
    server = ("url", "http://a/mcp")
    assert cache.put("k1", server, "v1", 60, since=cache.epoch())
    assert cache.put("k2", server, "v2", 40, since=cache.epoch())
    assert (cache.entries, cache.bytes) == (2, 100)
    assert not cache.put("k3", ("url", "http://b/mcp"), "v3", 101, since=cache.epoch())  # over the cap
    since = cache.epoch()
    assert cache.invalidate(server) == 2 and (cache.entries, cache.bytes) == (0, 0)
    assert not cache.put("k1", server, "stale", 10, since=since)  # fetched before the change
    assert cache.put("k1", server, "fresh", 10, since=cache.epoch())  # fetched after it
    assert cache.put("k4", ("url", "http://b/mcp"), "v4", 10, since=since)  # another server
    now[0] = 10.0
    assert cache.get("k1") is None and cache.entries == 1  # expired entries are dropped when read
    assert not ListingCache(0, 10.0).enabled and not ListingCache(100, 0).enabled
    with pytest.raises(ValueError, match="mcp_list_cache_bytes must be an int >= 0"):
        ListingCache(-1, 1.0)
    with pytest.raises(ValueError, match="mcp_list_ttl must be >= 0 seconds"):
        ListingCache(1, -1.0)


# --- sizes and charges are sound ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        [typical_tool(i).model_dump(mode="json", by_alias=True, exclude_none=True) for i in range(300)],
        [
            {
                "name": f"t{i}",
                "inputSchema": {
                    "type": "object",
                    "properties": {f"p{j}": {"enum": ["a", 1, None, True]} for j in range(20)},
                },
            }
            for i in range(100)
        ],
        [
            {"name": f"a{i}", "description": "\U0001f600" + "x" * 2000, "inputSchema": {"type": "object"}}
            for i in range(50)
        ],
        [{"name": "one", "inputSchema": {"type": "object"}}],
    ],
    ids=["typical", "node_heavy", "ucs4", "one_tool"],
)
def test_a_cache_entry_is_sized_at_least_the_memory_it_keeps_alive(shape: list[dict[str, Any]]) -> None:
    wire = json.dumps({"tools": shape}).encode()
    key = ("client", "http://127.0.0.1:1/mcp?v=1", "0" * 64, "caller")
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = mcp_types.ListToolsResult.model_validate_json(wire)  # as the SDK parses an answer
        kept = tuple(_listed(tool) for tool in result.tools)  # what the cache holds
        del result
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    size = listing_size(_serialized(kept), key)
    assert retained <= size, (retained, size)


def test_a_listing_is_charged_while_read_and_a_refused_one_is_never_parsed() -> None:
    """The meter's price bounds what reading and parsing a real answer allocates (the server in a
    child process: ``tracemalloc`` sees the gateway alone), and an answer the request cannot
    afford stops being read: the gateway allocates less than the request's limit for it."""
    with listing_server_process(2000) as url:
        catalog = ToolCatalog([McpServerConfig(label="big", url=url)], list_ttl=0)
        measured: dict[str, Any] = {}

        async def main() -> None:
            try:
                (await catalog.pool.acquire(Endpoint(url=url))).release()  # the session is open
                for name, limit in (("refused", B), ("served", 64 * B)):
                    ledger = Ledger(limit)
                    gc.collect()
                    tracemalloc.start()
                    before = tracemalloc.get_traced_memory()[0]
                    tracemalloc.reset_peak()
                    try:
                        resolved = await catalog.resolve([mcp_tool("big")], ledger=ledger)
                        measured[name] = (ledger, resolved)
                    except BudgetExceeded as exc:
                        measured[name] = (ledger, exc)
                    finally:
                        peak = tracemalloc.get_traced_memory()[1] - before
                        tracemalloc.stop()
                    measured[name + "_peak"] = peak
            finally:
                await catalog.aclose()

        run(main())
    ledger, exc = measured["refused"]
    assert isinstance(exc, BudgetExceeded)
    outcome = outcome_of(exc)
    assert (outcome.status, outcome.code) == (502, "max_retained_bytes_exceeded")
    assert measured["refused_peak"] < B  # the 0.75 MB answer would take ~12 MB to parse
    assert (ledger.charged, ledger.limit) == (0, B) and ledger.peak <= B
    ledger, resolved = measured["served"]
    assert len(resolved.list_items[0]["tools"]) == 2000
    assert measured["served_peak"] <= ledger.peak  # the charge covers what reading and parsing took
    listed = json.dumps(resolved.list_items, separators=(",", ":")).encode()
    assert ledger.charged == LISTING_MODEL.accumulated_charge(len(listed), count_json_nodes(listed), False)
    assert catalog.cache.entries == 0


@pytest.mark.parametrize("transport", ["json", "sse"])
def test_a_refused_answer_fails_the_request_not_the_session(transport: str) -> None:
    """Refused while read, as a JSON body (2026 servers) or an SSE stream (the handshake era):
    the request gets `BudgetExceeded`, and the pooled session serves the next listing."""
    app = build_listing_server(2000).streamable_http_app()
    with serve_asgi(app if transport == "json" else legacy_only(app)) as base:
        catalog = ToolCatalog([McpServerConfig(label="big", url=f"{base}/mcp")], list_ttl=0)
        small, large = Ledger(B), Ledger(64 * B)
        found: list[Any] = []

        async def main() -> None:
            try:
                with pytest.raises(BudgetExceeded) as info:
                    await catalog.resolve([mcp_tool("big")], ledger=small)
                found.append(info.value)
                found.append(await catalog.resolve([mcp_tool("big")], ledger=large))
            finally:
                stats = catalog.pool.stats()
                await catalog.aclose()
            found.append(stats)

        run(main())
    refusal, resolved, stats = found
    assert (refusal.phase, refusal.limit) == ("reserve", B)
    assert (small.charged, small.peak <= B) == (0, True)
    assert len(resolved.list_items[0]["tools"]) == 2000 and large.charged > 0
    assert (stats.opened, stats.leases, stats.reused, stats.discarded) == (1, 2, 1, 0)


def test_an_in_process_listing_is_charged_once_parsed() -> None:
    """An in-process server has no answer bytes to meter: its listing is charged from its
    serialized form right after parsing, at the same price."""
    catalog = ToolCatalog([McpServerConfig(label="big", app=build_listing_server(2000))], list_ttl=0)
    small, large = Ledger(B), Ledger(64 * B)
    with pytest.raises(BudgetExceeded) as info:
        run(catalog.resolve([mcp_tool("big")], ledger=small))
    assert (info.value.phase, small.charged) == ("reserve", 0)
    resolved = run(catalog.resolve([mcp_tool("big")], ledger=large))
    listed = json.dumps(resolved.list_items, separators=(",", ":")).encode()
    kept = LISTING_MODEL.accumulated_charge(len(listed), count_json_nodes(listed), False)
    answer = json.dumps(
        [
            [t["name"], t["description"], t["input_schema"], t["annotations"], False]
            for t in resolved.list_items[0]["tools"]
        ],
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode()
    assert large.charged == kept
    assert large.peak == kept + LISTING_MODEL.output_charge(len(answer), count_json_nodes(answer), False)


def test_a_malformed_frame_does_not_hide_the_nodes_of_the_next() -> None:
    """Nodes are counted lexically over the answer stream; a line ending inside a string (which a
    JSON string never spans) restarts the count, so a server cannot send one bad SSE frame to
    have the next, parsed one counted as string contents."""
    valid = b'{"a":[{},{},{},{},{},{},{},{}]}'
    lines = [b"event: message", b'data: {"oops":"', b"", b"event: message", b"data: " + valid, b"", b""]
    stream = b"\n".join(lines)
    expected_nodes = sum(count_json_nodes(line) for line in lines)
    for split in (1, 7, 40, len(stream)):
        ledger = Ledger(1 << 30)
        meter = ListingMeter(ledger)
        for start in range(0, len(stream), split):
            meter.feed(stream[start : start + split])
        assert meter.wire_bytes == len(stream)
        assert (
            meter.charged == ledger.charged == LISTING_MODEL.output_charge(len(stream), expected_nodes, False)
        )
        meter.release()
        assert ledger.charged == 0
    counter = JsonNodeCounter(max_depth=None)
    assert counter.feed(stream) < expected_nodes - 8  # a plain count misses the valid frame's nodes


def test_a_refused_meter_refuses_every_later_chunk() -> None:
    ledger = Ledger(1000)
    meter = ListingMeter(ledger)
    meter.feed(b"[1]")
    with pytest.raises(BudgetExceeded):
        meter.feed(b"x" * 100)
    with pytest.raises(BudgetExceeded):
        meter.feed(b"")
    assert meter.refused is not None and ledger.charged == meter.charged > 0
    meter.release()
    assert ledger.charged == 0


# --- list_changed (CASES.md B35) ----------------------------------------------------------------------


class CountingLedger:
    def __init__(self) -> None:
        self.charged = 0

    def admit_tool_result(self, raw: bytes) -> int:
        self.charged += 32 * len(raw)
        return 32 * len(raw)


def test_list_changed_drops_every_entry_of_that_server_and_no_other(
    beta_http: tuple[str, Recorder], tools_http: tuple[str, Recorder]
) -> None:
    url, recorder = beta_http
    catalog = ToolCatalog(
        [McpServerConfig(label="tools", url=url), McpServerConfig(label="other", url=tools_http[0])],
        allow_prefixes=[url],
    )
    names: dict[str, list[str]] = {}

    async def main() -> None:
        try:
            for tenant in ("alice", "bob"):
                await catalog.resolve([mcp_tool(), mcp_tool("other")], tenant=tenant)
            await catalog.resolve([declared_url(url, headers={"X-Key": "k"})], tenant="alice")
            assert catalog.cache.entries == 5
            resolved = await catalog.resolve([mcp_tool()], tenant="alice")  # cached
            names["before"] = [t["name"] for t in resolved.list_items[0]["tools"]]
            [outcome] = await run_tool_calls(
                resolved,
                [{"type": "function_call", "call_id": "call_e", "name": "enable_beta", "arguments": "{}"}],
                ledger=CountingLedger(),
            )
            assert (outcome.outcome, outcome.output) == ("ok", "beta enabled")
            names["entries"] = [str(catalog.cache.entries)]
            resolved = await catalog.resolve([mcp_tool()], tenant="bob")
            names["after"] = [t["name"] for t in resolved.list_items[0]["tools"]]
        finally:
            await catalog.aclose()

    run(main())
    assert names["before"] == ["lookup", "enable_beta"]
    assert names["entries"] == ["2"]  # both callers' "other" entries survive; the 3 of this server do not
    assert names["after"] == ["lookup", "enable_beta", "beta"]
    assert recorder.count("tools/list") >= 4


def fc_reply(*calls: dict[str, Any]) -> Reply:
    return Reply.json(response_obj(list(calls)))


def final_reply(text: str) -> Reply:
    return Reply.json(response_obj([message_item(text)]))


@pytest.mark.parametrize("control", [False, True], ids=["invalidated", "control_ttl_0.01"])
def test_b35_list_changed_makes_the_next_request_list_and_expose_the_new_tool(control: bool) -> None:
    tools = [mcp_tool()]
    with MockUpstream() as upstream, serve_mcp(build_beta_server()) as (mcp_url, recorder):
        upstream.push(
            fc_reply(FC("call_e", "enable_beta", "{}")), final_reply("enabled"), final_reply("second")
        )
        settings: dict[str, Any] = {"mcp_server": (f"tools={mcp_url}",), "max_retained_bytes": 4 * B}
        if control:
            settings["mcp_list_ttl"] = 0.01
        with gateway(upstream, **settings) as (url, _), sdk(url) as client:
            first = client.responses.create(model="m", input="enable beta", tools=tools)  # type: ignore[arg-type]
            if control:
                time.sleep(0.05)
            second = client.responses.create(model="m", input="anything", tools=tools)  # type: ignore[arg-type]
    assert [item.type for item in first.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert first.output[1].output == "beta enabled"  # type: ignore[union-attr]
    assert second.output[0].type == "mcp_list_tools"
    assert [t.name for t in second.output[0].tools] == ["lookup", "enable_beta", "beta"]
    assert [t["name"] for t in upstream.requests[2].json()["tools"]] == ["lookup", "enable_beta", "beta"]
    assert recorder.count("tools/list") >= 2


# --- the request's budget and the outcome table, end to end ------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_a_listing_over_the_requests_budget_is_a_502_and_is_not_cached(
    big_http: tuple[str, Recorder], stream: bool
) -> None:
    url, recorder = big_http
    body = {"model": "m", "input": "hi", "tools": [mcp_tool("big")], "stream": stream}
    with MockUpstream() as upstream, gateway(upstream, mcp_server=(f"big={url}",)) as (base, _):
        before = recorder.count("tools/list")
        answers = [httpx.post(base + "/v1/responses", json=body, timeout=30) for _ in range(2)]
        assert upstream.requests == []  # refused before anything went upstream
    for r in answers:
        assert r.status_code == 502, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.headers["x-should-retry"] == "false"
        assert r.json()["error"]["code"] == "max_retained_bytes_exceeded"
        assert "while reading the tools/list answer of MCP server 'big'" in r.json()["error"]["message"]
    assert recorder.count("tools/list") - before == 2  # a refused listing is never cached


# --- --mcp-list-ttl 0 and --mcp-list-cache-bytes, end to end -------------------------------------------


def test_ttl_0_is_accepted_and_never_caches(tools_http: tuple[str, Recorder]) -> None:
    url, recorder = tools_http
    assert load_settings({}, {"LOOPWARDEN_MCP_LIST_TTL": "0"}).tools.mcp_list_ttl == 0.0
    with MockUpstream() as upstream:
        upstream.push(final_reply("one"), final_reply("two"))
        with (
            gateway(upstream, mcp_server=(f"tools={url}",), mcp_list_ttl=0, max_retained_bytes=4 * B) as (
                base,
                _,
            ),
            sdk(base) as client,
        ):
            before = recorder.count("tools/list")
            for _ in range(2):
                response = client.responses.create(model="m", input="hi", tools=[mcp_tool()])  # type: ignore[list-item]
                assert response.output[0].type == "mcp_list_tools"
            assert recorder.count("tools/list") - before == 2


def test_list_cache_bytes_setting_sources_default_and_range(tmp_path: Path) -> None:
    assert Settings().tools.mcp_list_cache_bytes == DEFAULT_LIST_CACHE_BYTES == 16 * 1024 * 1024
    cfg = tmp_path / "lw.yaml"
    cfg.write_text("mcp-list-cache-bytes: 1000\nmcp_list_ttl: 0\n")
    assert load_settings({"config": str(cfg)}, {}).tools.mcp_list_cache_bytes == 1000
    assert (
        load_settings(
            {"config": str(cfg)}, {"LOOPWARDEN_MCP_LIST_CACHE_BYTES": "2000"}
        ).tools.mcp_list_cache_bytes
        == 2000
    )
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers())
    flags = vars(parser.parse_args(["serve", "--mcp-list-cache-bytes", "0", "--mcp-list-ttl", "0"]))
    settings = load_settings(flags, {})
    assert (settings.tools.mcp_list_cache_bytes, settings.tools.mcp_list_ttl) == (0, 0.0)
    for value in (-1, 1_073_741_825):
        with pytest.raises(SettingsError) as info:
            load_settings({"mcp_list_cache_bytes": value}, {})
        assert (
            str(info.value) == f"mcp_list_cache_bytes must be in 0..=1073741824 (0: never cache), got {value}"
        )
    with pytest.raises(SettingsError) as info:
        load_settings({"mcp_list_ttl": -1}, {})
    assert str(info.value) == "mcp_list_ttl must be a number of seconds >= 0 (0: never cache), got -1.0"
