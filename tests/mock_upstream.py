"""A scripted model server on a real loopback socket, controlling exact bytes and timing.

`MockUpstream` is a FIFO: each incoming HTTP/1.1 request pops the next `Reply` and is recorded
(`requests`). A `Reply` writes its status line and headers, then its body ``parts`` one socket
write each: ``bytes`` are written (as one HTTP chunk with ``framing="chunked"``, raw otherwise),
a ``float`` sleeps that many seconds, a ``threading.Event`` is waited for, `RST` closes the
connection at once without a terminator. Every reply closes its connection afterwards.
Counters: ``bytes_written`` (body bytes the mock managed to write), ``peer_closed`` (the gateway
closed the connection before the reply was fully written).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

RST = object()


@dataclasses.dataclass
class Reply:
    """One scripted HTTP answer. ``framing``: "chunked", "length" (Content-Length = the body's total
    size, or ``declared_length``) or "close" (no length; the body ends when the connection closes)."""

    status: int = 200
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    parts: list[Any] = dataclasses.field(default_factory=list)
    framing: str = "length"
    declared_length: int | None = None

    @classmethod
    def json(cls, obj: Any, status: int = 200, **kw: Any) -> Reply:
        """A JSON body (compact), with Content-Length."""
        body = obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode()
        return cls(status=status, headers=[("content-type", "application/json")], parts=[body], **kw)

    @classmethod
    def sse(cls, parts: Iterable[Any], **kw: Any) -> Reply:
        """An event stream, chunked, one socket write per part."""
        kw.setdefault("framing", "chunked")
        return cls(headers=[("content-type", "text/event-stream; charset=utf-8")], parts=list(parts), **kw)


@dataclasses.dataclass
class Recorded:
    """One request the mock received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def E(event_type: str, data: Any) -> bytes:
    """``event: <type>\\ndata: <compact json>\\n\\n``."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"event: {event_type}\ndata: {payload}\n\n".encode()


class MockUpstream:
    """The scripted server; use as a context manager, ``base_url`` ends in ``/v1``."""

    def __init__(self) -> None:
        self.replies: collections.deque[Reply] = collections.deque()
        self.requests: list[Recorded] = []
        self.bytes_written = 0
        self.peer_closed = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> MockUpstream:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def push(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    # -- serving -----------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.requests.append(Recorded(method, path, headers, body))
            reply = (
                self.replies.popleft()
                if self.replies
                else Reply.json({"error": {"message": "no scripted reply"}}, 599)
            )
            await self._write(reply, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.peer_closed += 1
        finally:
            writer.close()

    async def _write(self, reply: Reply, writer: asyncio.StreamWriter) -> None:
        head = [f"HTTP/1.1 {reply.status} X"]
        head += [f"{k}: {v}" for k, v in reply.headers]
        if reply.framing == "chunked":
            head.append("transfer-encoding: chunked")
        elif reply.framing == "length":
            total = sum(len(p) for p in reply.parts if isinstance(p, bytes))
            head.append(
                f"content-length: {reply.declared_length if reply.declared_length is not None else total}"
            )
        head.append("connection: close")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        await writer.drain()
        for part in reply.parts:
            if part is RST:
                writer.transport.abort()
                return
            if isinstance(part, (int, float)):
                await asyncio.sleep(part)
                continue
            if isinstance(part, threading.Event):
                await asyncio.to_thread(part.wait, 30)
                continue
            data = part if reply.framing != "chunked" else b"%x\r\n%s\r\n" % (len(part), part)
            if writer.transport.is_closing():
                raise ConnectionResetError
            writer.write(data)
            await writer.drain()
            self.bytes_written += len(part)
        if reply.framing == "chunked":
            writer.write(b"0\r\n\r\n")
        await writer.drain()


# -- cassettes ---------------------------------------------------------------------------------

CASSETTES_DIR = Path(__file__).resolve().parents[2] / "shared" / "cassettes"


def cassettes_dir() -> Path | None:
    """``$LOOPWARDEN_CASSETTES`` or ``../shared/cassettes`` if it exists, else None."""
    import os

    env = os.environ.get("LOOPWARDEN_CASSETTES")
    path = Path(env) if env else CASSETTES_DIR
    return path if path.is_dir() else None


@dataclasses.dataclass
class Turn:
    """One recorded request/response pair of a cassette."""

    request: dict[str, Any]
    reply: Reply
    events: list[dict[str, Any]] | None  # the recorded SSE data objects, when streamed
    body: dict[str, Any] | None  # the recorded JSON body, when buffered


def _sse_bytes(lines: list[str]) -> list[bytes]:
    out = []
    for line in lines:
        out.append((line if line.endswith("\n") else line + "\n\n").encode())
    return out


def _sse_events(parts: list[bytes]) -> list[dict[str, Any]]:
    events = []
    for line in b"".join(parts).decode().splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            if payload and payload != "[DONE]":
                events.append(json.loads(payload))
    return events


def load_cassette(path: Path) -> Iterator[Turn]:
    """The turns of a cassette (the agentic-api formats described in its NOTICE.md)."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    if "turns" not in doc:  # events/ fixture: one request + sse
        request = {"model": doc["model"], **doc["request"]}
        parts = _sse_bytes(doc["sse"])
        yield Turn(request, Reply.sse(parts), _sse_events(parts), None)
        return
    history: list[Any] = []
    for turn in doc["turns"]:
        resp = turn["response"]
        if "request" in turn:
            request = dict(turn["request"]["body"])
        else:  # tool_loop fixture: one top-level request; later turns continue it with tool_mock outputs
            request = {"model": doc["model"], **doc["request"]}
            if history:
                request["input"] = history
        if "sse" in resp:
            parts = _sse_bytes(resp["sse"])
            yield Turn(request, Reply.sse(parts), _sse_events(parts), None)
        else:
            body = resp["body"]
            parsed = json.loads(body) if isinstance(body, str) else body
            if "request" not in turn:
                if not history:
                    history = [{"type": "message", "role": "user", "content": doc["request"]["input"]}]
                for item in parsed["output"]:
                    history.append(item)
                    if item.get("type") == "function_call":
                        output = doc.get("tool_mock", {}).get(item["name"], "")
                        history.append(
                            {"type": "function_call_output", "call_id": item["call_id"], "output": output}
                        )
            yield Turn(request, Reply.json(parsed, status=resp.get("status_code", 200)), None, parsed)
