"""Real MCP servers for the tool-layer tests, built with the ``mcp`` SDK's ``MCPServer``.

* `build_tools_server(probe)` — the CASES.md ``tools`` server (``lookup``, ``slow``, ``fast1``,
  ``fast2``, ``query_db``, ``write_file``), ``charge_card`` (no annotations: side effects),
  ``put_record`` (``idempotentHint``) plus test helpers (``echo``, ``sized``, ``sleep``, ``fail``,
  ``surrogate``, ``picture``, ``structured``, ``hang``), instrumented by a `Probe`;
* `build_other_server(probe)` — a second server sharing the name ``lookup`` (for name mangling);
* `serve_mcp(server)` — serve one over streamable HTTP with a real uvicorn on a loopback port and
  yield its endpoint URL (``http://127.0.0.1:PORT/mcp``), wrapped in a `Recorder` that keeps each
  request's headers and JSON-RPC method;
* `STDIO_COMMAND` — argv that runs `build_tools_server` over stdio in a subprocess.

The servers run in uvicorn's thread (or on the test's loop when used in-process), so `Probe` is
thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, ToolAnnotations
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ROOT = Path(__file__).resolve().parent.parent
STDIO_COMMAND = [
    sys.executable,
    "-c",
    f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.mcp_servers import main; main()",
]


class Probe:
    """What the tools saw: calls with their arguments, start times, concurrency, cancellations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.starts: dict[str, float] = {}
        self.ends: dict[str, float] = {}
        self.cancelled: set[str] = set()
        self.finished: set[str] = set()
        self._cancel_event = threading.Event()

    def reset(self) -> None:
        """Forget everything seen so far."""
        with self._lock:
            self.active = self.peak = 0
            self.calls.clear()
            self.starts.clear()
            self.ends.clear()
            self.cancelled.clear()
            self.finished.clear()
            self._cancel_event.clear()

    @contextlib.contextmanager
    def running(self, key: str, args: dict[str, Any]) -> Iterator[None]:
        """Count one execution of tool call `key` (a name or a caller-chosen tag)."""
        with self._lock:
            self.calls.append((key, args))
            self.starts[key] = time.monotonic()
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            with self._lock:
                self.cancelled.add(key)
            self._cancel_event.set()
            raise
        else:
            with self._lock:
                self.finished.add(key)
                self.ends[key] = time.monotonic()
        finally:
            with self._lock:
                self.active -= 1

    def wait_cancelled(self, key: str, timeout: float = 2.0) -> bool:
        """Wait up to `timeout` seconds for `key` to observe a cancellation."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if key in self.cancelled:
                    return True
            self._cancel_event.wait(0.01)
        return False

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self.calls]


def _quiet(name: str) -> MCPServer[Any]:
    return MCPServer(name, log_level="WARNING")


def build_tools_server(probe: Probe, *, name: str = "tools") -> MCPServer[Any]:
    """The CASES.md ``tools`` server plus the helpers listed in the module docstring."""
    server = _quiet(name)

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def lookup(q: str = "", p: str = "", location: str = "") -> str:
        """Look something up."""
        with probe.running("lookup", {"q": q, "p": p, "location": location}):
            return f"lookup q={q} p={p} location={location}"

    @server.tool()
    async def slow() -> str:
        """Accepts the call and never replies."""
        with probe.running("slow", {}):
            await asyncio.Event().wait()
        return "unreachable"

    @server.tool()
    async def fast1() -> str:
        """Sleeps 0.3 s, returns ok1."""
        with probe.running("fast1", {}):
            await asyncio.sleep(0.3)
        return "ok1"

    @server.tool()
    async def fast2() -> str:
        """Sleeps 0.3 s, returns ok2."""
        with probe.running("fast2", {}):
            await asyncio.sleep(0.3)
        return "ok2"

    @server.tool()
    async def query_db(sql: str, size: int = 1000) -> str:
        """Returns `size` bytes of text."""
        with probe.running("query_db", {"sql": sql, "size": size}):
            return "r" * size

    @server.tool()
    async def write_file(path: str, content: str) -> str:
        """Pretends to write a file."""
        with probe.running("write_file", {"path": path, "content": content}):
            return f"wrote {len(content)} characters to {path}"

    @server.tool()
    async def charge_card(amount: int) -> str:
        """Charges a card (a side effect: no annotations)."""
        with probe.running("charge_card", {"amount": amount}):
            return f"charged {amount}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=True))
    async def put_record(key: str, value: str = "") -> str:
        """Stores a record under a key (idempotent: a second run changes nothing more)."""
        with probe.running("put_record", {"key": key, "value": value}):
            return f"stored {key}"

    @server.tool()
    async def echo(tag: str = "echo", value: Any = None) -> str:
        """Returns the arguments it got, as JSON."""
        args = {"tag": tag, "value": value}
        with probe.running(tag, args):
            return json.dumps(args, separators=(",", ":"))

    @server.tool()
    async def sized(n: int, char: str = "x") -> str:
        """Returns `char` repeated `n` times."""
        with probe.running(f"sized{n}", {"n": n}):
            return char * n

    @server.tool()
    async def sleep(tag: str, seconds: float) -> str:
        """Sleeps `seconds`, returns the tag."""
        with probe.running(tag, {"seconds": seconds}):
            await asyncio.sleep(seconds)
        return tag

    @server.tool()
    async def fail(message: str = "it broke") -> str:
        """Always fails with a ToolError (an isError result)."""
        with probe.running("fail", {}):
            raise ToolError(message)

    @server.tool()
    async def surrogate() -> str:
        """Returns text with a lone surrogate, as surrogateescape decoding makes."""
        with probe.running("surrogate", {}):
            return b"caf\xc3\xa9 \x8d end".decode("utf-8", "surrogateescape")

    @server.tool(structured_output=False)
    async def picture() -> list[Any]:
        """Returns a caption and a small PNG."""
        return ["a caption", Image(data=b"\x89PNG\r\n\x1a\n1234", format="png")]

    @server.tool()
    async def structured() -> CallToolResult:
        """Returns structured content and no content blocks."""
        return CallToolResult(content=[], structured_content={"a": 1, "b": "é"})

    return server


def build_other_server(probe: Probe) -> MCPServer[Any]:
    """A second server: ``lookup`` (clashes with the tools server) and ``weather``."""
    server = _quiet("other")

    @server.tool()
    async def lookup(q: str = "") -> str:
        """Another lookup."""
        with probe.running("other.lookup", {"q": q}):
            return f"other lookup {q}"

    @server.tool()
    async def weather(city: str = "Paris") -> str:
        """The weather."""
        return f"sunny in {city}"

    return server


class Recorder:
    """ASGI wrapper keeping, per HTTP request, its headers and the JSON-RPC message it carried."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.headers: list[dict[str, str]] = []
        self.messages: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self._lock:
            self.headers.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
        body = b""

        async def recording_receive() -> Message:
            nonlocal body
            message = await receive()
            if message["type"] == "http.request":
                body += message.get("body", b"")
                if not message.get("more_body", False) and body:
                    with contextlib.suppress(ValueError):
                        parsed = json.loads(body)
                        if isinstance(parsed, dict):
                            with self._lock:
                                self.messages.append(parsed)
            return message

        await self.app(scope, recording_receive, send)

    def count(self, method: str) -> int:
        """How many requests carried JSON-RPC `method`."""
        with self._lock:
            return sum(1 for m in self.messages if m.get("method") == method)

    def tool_arguments(self) -> list[tuple[Any, Any]]:
        """(tool name, ``arguments`` as sent — absent is ``"<absent>"``) of every ``tools/call``."""
        with self._lock:
            calls = [m.get("params") or {} for m in self.messages if m.get("method") == "tools/call"]
        return [(c.get("name"), c.get("arguments", "<absent>")) for c in calls]


@contextlib.contextmanager
def serve_mcp(server: MCPServer[Any]) -> Iterator[tuple[str, Recorder]]:
    """Serve `server` over streamable HTTP on a real uvicorn; yield (endpoint URL, recorder)."""
    from tests.servers import serve_asgi

    recorder = Recorder(server.streamable_http_app())
    with serve_asgi(recorder) as base:
        yield f"{base}/mcp", recorder


def main() -> None:
    """Run the tools server over stdio (for `STDIO_COMMAND`)."""
    build_tools_server(Probe()).run("stdio")


if __name__ == "__main__":
    main()
