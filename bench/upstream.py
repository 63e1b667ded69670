"""A fast, deterministic, scripted Responses API upstream for the benchmarks (a script, not a test).

Usage: ``python bench/upstream.py --port PORT``

Raw asyncio (`asyncio.Protocol`, HTTP/1.1 keep-alive, Content-Length or chunked request bodies):
every answer is pre-encoded at start-up and written with one ``transport.write``, so the upstream
costs next to nothing and the proxies in front of it are what the benchmark measures.

``POST /v1/responses`` (any path ending in ``/responses``). The request's ``model`` picks the
script, its ``stream`` flag the encoding (a JSON response object, or an SSE stream sent with
chunked transfer encoding, one HTTP chunk per event, ``sequence_number`` 0..N-1):

* ``small``   — one message of 92 words: buffered, the response object (~1.6 KB); streamed,
  exactly 100 events (created, in_progress, item added, part added, 92 ``output_text.delta``,
  text done, part done, item done, completed).
* ``text1mb`` — one message of 1 MiB of text: streamed as 256 deltas of 4096 characters, and — as
  OpenAI does — the whole text again in ``output_text.done``, ``content_part.done``,
  ``output_item.done`` and ``response.completed`` (265 events, ~5 MiB on the wire).
* ``tools3``  — a three-round tool loop: the number of ``function_call_output`` items in the
  request's input decides the round: 0 and 1 -> a ``function_call`` of ``lookup`` (``call_1``,
  ``call_2``), 2 or more -> a message ``"done"``.
* ``paced:GAP`` — streamed only: the ``small`` stream written one event (one HTTP chunk) at a
  time, GAP seconds apart (default 0.001): a token-paced model server, one event per read.
* ``hold``    — sleeps ``HOLD`` seconds (default 2.0; ``hold:SECONDS`` in the model name sets it),
  then answers like ``small`` (buffered: the response object, streamed: the 100 events): keeps
  requests in flight for the memory measurement.
* ``bigjson:BYTES[:HOLD]`` — buffered only: a response object whose one message holds BYTES of
  text; with HOLD, all but the last byte is written at once and the last byte HOLD seconds later
  (the gateway holds the partly read body meanwhile: the memory measurement).
* ``bigstream:CHARS[:DELTA[:HOLD]]`` — streamed only: one message of CHARS characters of text in
  deltas of DELTA characters (default 1000), the whole text again in the ``.done`` events and
  ``response.completed`` (as ``text1mb``); with HOLD, the stream starts HOLD seconds late.
* ``echotools[:HOLD]`` — buffered: like ``small``, but the response object's ``tools`` echoes the
  request's ``tools`` (as OpenAI does); with HOLD, answered HOLD seconds late.

``GET /healthz`` answers 200. Anything else is a 404 JSON error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import socket
from typing import Any

CREATED_AT = 1_700_000_000
HOLD = 2.0
_FCO = re.compile(rb'"function_call_output"')


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def response_object(model: str, output: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    """A response object shaped like OpenAI's (the fields a client and a gateway look at)."""
    return {
        "id": "resp_bench0000000000000000000000000001",
        "object": "response",
        "created_at": CREATED_AT,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": {
            "input_tokens": 12,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 91,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 103,
        },
        "user": None,
        "metadata": {},
    }


def message_item(text: str, item_id: str = "msg_bench0001") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": "fc_" + call_id,
        "type": "function_call",
        "status": "completed",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def sse_frame(obj: dict[str, Any]) -> bytes:
    """One SSE event, ``event: TYPE`` + ``data: JSON``."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + _dumps(obj) + b"\n\n"


def message_events(model: str, deltas: list[str]) -> list[dict[str, Any]]:
    """The events of a one-message streamed answer (before sequence numbering)."""
    text = "".join(deltas)
    item = message_item(text)
    in_progress = {**item, "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    base = response_object(model, [], status="in_progress")
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": base},
        {"type": "response.in_progress", "response": base},
        {"type": "response.output_item.added", "output_index": 0, "item": in_progress},
        {
            "type": "response.content_part.added",
            "item_id": item["id"],
            "output_index": 0,
            "content_index": 0,
            "part": part,
        },
    ]
    for delta in deltas:
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": item["id"],
                "output_index": 0,
                "content_index": 0,
                "delta": delta,
                "logprobs": [],
            }
        )
    events += [
        {
            "type": "response.output_text.done",
            "item_id": item["id"],
            "output_index": 0,
            "content_index": 0,
            "text": text,
            "logprobs": [],
        },
        {
            "type": "response.content_part.done",
            "item_id": item["id"],
            "output_index": 0,
            "content_index": 0,
            "part": {**part, "text": text},
        },
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": response_object(model, [item])},
    ]
    return events


def function_call_events(model: str, call: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed round that ends in one function call."""
    base = response_object(model, [], status="in_progress")
    added = {**call, "status": "in_progress", "arguments": ""}
    return [
        {"type": "response.created", "response": base},
        {"type": "response.in_progress", "response": base},
        {"type": "response.output_item.added", "output_index": 0, "item": added},
        {
            "type": "response.function_call_arguments.delta",
            "item_id": call["id"],
            "output_index": 0,
            "delta": call["arguments"],
        },
        {
            "type": "response.function_call_arguments.done",
            "item_id": call["id"],
            "output_index": 0,
            "arguments": call["arguments"],
        },
        {"type": "response.output_item.done", "output_index": 0, "item": call},
        {"type": "response.completed", "response": response_object(model, [call])},
    ]


def http_json(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def http_sse(events: list[dict[str, Any]]) -> bytes:
    """A chunked ``text/event-stream`` answer, one HTTP chunk per event, numbered 0..N-1."""
    parts = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
    ]
    for number, event in enumerate(events):
        frame = sse_frame({**event, "sequence_number": number})
        parts.append(b"%x\r\n%s\r\n" % (len(frame), frame))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


SMALL_DELTAS = [f"w{i:02d} " for i in range(92)]
MB_DELTAS = ["abcdefghijklmnop" * 256 for _ in range(256)]  # 256 x 4096 = 1 MiB


class Scripts:
    """Every answer, pre-encoded (buffered and streamed forms)."""

    def __init__(self) -> None:
        small = "".join(SMALL_DELTAS)
        self.buffered: dict[str, bytes] = {
            "small": http_json(_dumps(response_object("small", [message_item(small)]))),
            "text1mb": http_json(_dumps(response_object("text1mb", [message_item("".join(MB_DELTAS))]))),
        }
        self.streamed: dict[str, bytes] = {
            "small": http_sse(message_events("small", SMALL_DELTAS)),
            "text1mb": http_sse(message_events("text1mb", MB_DELTAS)),
        }
        calls = [function_call_item(f"call_{n}", "lookup", json.dumps({"q": f"round {n}"})) for n in (1, 2)]
        self.tool_rounds_buffered = [
            http_json(_dumps(response_object("tools3", [calls[0]]))),
            http_json(_dumps(response_object("tools3", [calls[1]]))),
            http_json(_dumps(response_object("tools3", [message_item("done")]))),
        ]
        self.tool_rounds_streamed = [
            http_sse(function_call_events("tools3", calls[0])),
            http_sse(function_call_events("tools3", calls[1])),
            http_sse(message_events("tools3", ["do", "ne"])),
        ]
        self.bigjson: dict[int, bytes] = {}
        self.bigstream: dict[tuple[int, int], bytes] = {}
        self.not_found = http_json(
            _dumps({"error": {"message": "not found", "type": "invalid_request_error", "code": None}}),
            "404 Not Found",
        )
        self.bad = http_json(
            _dumps({"error": {"message": "unknown model", "type": "invalid_request_error", "code": None}}),
            "400 Bad Request",
        )
        self.health = http_json(b'{"status":"ok"}')
        # ``small`` streamed as separate writes (head + first event, then one chunk per event)
        small_stream = self.streamed["small"]
        head_end = small_stream.index(b"\r\n\r\n") + 4
        chunks = re.findall(rb"[0-9a-f]+\r\n.*?\r\n(?=[0-9a-f]+\r\n|$)", small_stream[head_end:], re.S)
        assert b"".join(chunks) == small_stream[head_end:], "chunk split"
        self.streamed_events = {"small": [small_stream[:head_end] + chunks[0], *chunks[1:]]}
        self.paced: dict[float, list[bytes | float]] = {}

    def answer(self, body: bytes) -> list[bytes | float]:
        """The HTTP answer as parts: bytes are written, a float waits that many seconds."""
        try:
            request = json.loads(body)
            model = str(request.get("model", ""))
            stream = request.get("stream") is True
        except (ValueError, AttributeError):
            return [self.bad]
        name, _, arg = model.partition(":")
        if name.startswith("openai/"):  # LiteLLM-style prefixed names
            name = name[len("openai/") :]
        if name in ("small", "text1mb"):
            return [(self.streamed if stream else self.buffered)[name]]
        if name == "tools3":
            rounds = self.tool_rounds_streamed if stream else self.tool_rounds_buffered
            return [rounds[min(len(_FCO.findall(body)), 2)]]
        if name == "hold":
            return [float(arg or HOLD), (self.streamed if stream else self.buffered)["small"]]
        if name == "paced" and stream:
            gap = float(arg or 0.001)
            if gap not in self.paced:
                events = self.streamed_events["small"]
                self.paced[gap] = [part for event in events for part in (event, gap)][:-1]
            return list(self.paced[gap])
        if name == "bigjson":
            size_text, _, hold = arg.partition(":")
            size = int(size_text or 1024)
            if size not in self.bigjson:
                self.bigjson[size] = http_json(_dumps(response_object("bigjson", [message_item("x" * size)])))
            answer = self.bigjson[size]
            return [answer[:-1], float(hold), answer[-1:]] if hold else [answer]
        if name == "bigstream":
            size_text, _, rest = arg.partition(":")
            delta_text, _, hold = rest.partition(":")
            key = (int(size_text or 1024), int(delta_text or 1000))
            if key not in self.bigstream:
                size, step = key
                deltas = ["x" * min(step, size - start) for start in range(0, size, step)]
                self.bigstream[key] = http_sse(message_events("bigstream", deltas))
            return [float(hold), self.bigstream[key]] if hold else [self.bigstream[key]]
        if name == "echotools":
            small = "".join(SMALL_DELTAS)
            echoed = {
                **response_object("echotools", [message_item(small)]),
                "tools": request.get("tools", []),
            }
            return [float(arg), http_json(_dumps(echoed))] if arg else [http_json(_dumps(echoed))]
        return [self.bad]


class UpstreamProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered in order."""

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue[tuple[list[bytes | float], bool]] | None = None
        self.worker: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker is not None:
            self.worker.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            parsed = self._parse()
            if parsed is None:
                return
            self._dispatch(*parsed)

    def _parse(self) -> tuple[str, bytes, bool] | None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        method, path, _ = head[0].split(" ", 2)
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        close = headers.get("connection", "").lower() == "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = bytearray()
            pos = start
            while True:
                line_end = self.buf.find(b"\r\n", pos)
                if line_end < 0:
                    return None
                size = int(bytes(self.buf[pos:line_end]).split(b";")[0], 16)
                if len(self.buf) < line_end + 2 + size + 2:
                    return None
                body += self.buf[line_end + 2 : line_end + 2 + size]
                pos = line_end + 2 + size + 2
                if size == 0:
                    break
            del self.buf[:pos]
            return f"{method} {path}", bytes(body), close
        length = int(headers.get("content-length", "0"))
        if len(self.buf) < start + length:
            return None
        body_bytes = bytes(self.buf[start : start + length])
        del self.buf[: start + length]
        return f"{method} {path}", body_bytes, close

    def _dispatch(self, request_line: str, body: bytes, close: bool) -> None:
        method, _, path = request_line.partition(" ")
        parts: list[bytes | float]
        if method == "POST" and path.split("?")[0].endswith("/responses"):
            parts = self.scripts.answer(body)
        elif method == "GET" and path.startswith("/healthz"):
            parts = [self.scripts.health]
        else:
            parts = [self.scripts.not_found]
        if len(parts) == 1 and self.queue is None:
            self._write(parts[0], close)  # type: ignore[arg-type]
            return
        if self.queue is None:  # keep answers in order once one of them waits
            self.queue = asyncio.Queue()
            self.worker = asyncio.get_running_loop().create_task(self._drain())
        self.queue.put_nowait((parts, close))

    async def _drain(self) -> None:
        assert self.queue is not None
        while True:
            parts, close = await self.queue.get()
            for index, part in enumerate(parts):
                if isinstance(part, float):
                    await asyncio.sleep(part)
                else:
                    self._write(part, close and index == len(parts) - 1)

    def _write(self, data: bytes, close: bool) -> None:
        if self.transport is None:
            return
        self.transport.write(data)
        if close:
            self.transport.close()


async def serve(host: str, port: int) -> None:
    scripts = Scripts()
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = await loop.create_server(lambda: UpstreamProtocol(scripts), sock=sock, backlog=1024)
    print(f"upstream listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
