"""Shared test helpers: the gateway on a real uvicorn, metric deltas, raw HTTP, CASES.md notation."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from openai import OpenAI
from prometheus_client import REGISTRY
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from middleware.app import create_app
from middleware.config import Settings
from tests.mock_upstream import E, MockUpstream
from tests.servers import raw_http as raw_http  # re-exported: the raw-HTTP helpers live with the servers
from tests.servers import response_json as response_json
from tests.servers import serve_asgi

B = 1_048_576  # CASES.md knob: max_retained_bytes


class CountingApp:
    """ASGI wrapper counting requests and the request-body bytes the gateway read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests = 0
        self.body_bytes = 0
        self.largest_message = 0  # the largest single http.request body the server delivered
        self.response_messages = 0  # http.response.body messages the gateway sent (all requests)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/responses":
            self.requests += 1

            async def counting_receive() -> Message:
                message = await receive()
                if message["type"] == "http.request":
                    size = len(message.get("body", b""))
                    self.body_bytes += size
                    self.largest_message = max(self.largest_message, size)
                return message

            async def counting_send(message: Message) -> None:
                if message["type"] == "http.response.body":
                    self.response_messages += 1
                await send(message)

            await self.app(scope, counting_receive, counting_send)
        else:
            await self.app(scope, receive, send)


@contextlib.contextmanager
def gateway(
    upstream: MockUpstream | None, *, http: str | None = None, **overrides: Any
) -> Iterator[tuple[str, CountingApp]]:
    """The gateway (wrapped in `CountingApp`) on a real uvicorn; yields (base URL, counter).

    ``http``: uvicorn's HTTP stack (``"h11"`` or ``"httptools"``; None: uvicorn's default).
    The retry shield is off unless the test sets ``retry_shield_seconds``: property tests and
    module-scoped gateways send identical failing requests on purpose, each to be checked afresh
    (tests/ops/test_retry_shield.py tests the shield)."""
    overrides.setdefault("max_retained_bytes", B)
    overrides.setdefault("retry_shield_seconds", 0)
    overrides.setdefault("store", "memory")
    overrides.setdefault("max_infer_iters", 3)
    overrides.setdefault("upstream_read_timeout", 2.0)
    overrides.setdefault("upstream_connect_timeout", 2.0)
    settings = Settings(upstream=upstream.base_url if upstream else None, **overrides)
    app = CountingApp(create_app(settings))
    with serve_asgi(app, **({"http": http} if http else {})) as url:
        yield url, app


def shielded_gateway(
    upstream: MockUpstream | None, **overrides: Any
) -> contextlib.AbstractContextManager[tuple[str, CountingApp]]:
    """`gateway` with the retry shield at its default, 30 s (the helpers run it off), unless the
    test sets ``retry_shield_seconds``."""
    overrides.setdefault("retry_shield_seconds", 30.0)
    return gateway(upstream, **overrides)


def sdk(url: str, **kw: Any) -> OpenAI:
    kw.setdefault("max_retries", 0)
    return OpenAI(base_url=url + "/v1", api_key="client-key", **kw)


#: Metrics with a ``transport`` label (``http`` unless a test names ``websocket``).
TRANSPORT_LABELLED = frozenset({"loopwarden_cap_hits_total"})


def _with_transport(name: str, labels: dict[str, str]) -> dict[str, str]:
    if name in TRANSPORT_LABELLED and "transport" not in labels:
        return {**labels, "transport": "http"}
    return labels


def metric(name: str, **labels: str) -> float:
    """Current value of a sample in the process registry (0 when absent); a cap-hit sample is
    the ``transport="http"`` one unless ``transport`` is given."""
    return REGISTRY.get_sample_value(name, _with_transport(name, labels)) or 0.0


class MetricDelta:
    """Snapshot metrics now; `delta(name, **labels)` is the increase since."""

    def __init__(self) -> None:
        self._before: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in REGISTRY.collect():
            for sample in family.samples:
                self._before[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def delta(self, name: str, **labels: str) -> float:
        labels = _with_transport(name, labels)
        key = (name, tuple(sorted(labels.items())))
        return metric(name, **labels) - self._before.get(key, 0.0)


def settled(m: MetricDelta, name: str, want: float, timeout: float = 3.0, **labels: str) -> float:
    """The metric's delta once it reaches `want` (the gateway counts some outcomes just after it
    sent the answer, so a fast client can look first), or its value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while m.delta(name, **labels) != want and time.monotonic() < deadline:
        time.sleep(0.005)
    return m.delta(name, **labels)


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """True once `predicate()` is truthy (polled every 10 ms), False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- CASES.md notation --------------------------------------------------------------------------
def PRE() -> list[bytes]:
    created = {"id": "resp_up", "object": "response", "status": "in_progress", "output": []}
    return [
        E("response.created", {"type": "response.created", "sequence_number": 0, "response": created}),
        E(
            "response.in_progress",
            {"type": "response.in_progress", "sequence_number": 1, "response": created},
        ),
    ]


def message_item(text: str, item_id: str = "msg_1") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def FC(call_id: str, name: str, args: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": args,
        "status": "completed",
    }


def response_obj(output: list[dict[str, Any]], status: str = "completed", **extra: Any) -> dict[str, Any]:
    return {"id": "resp_up", "object": "response", "status": status, "output": output, **extra}


def DONE(seq: int, output: list[dict[str, Any]]) -> bytes:
    return E(
        "response.completed",
        {"type": "response.completed", "sequence_number": seq, "response": response_obj(output)},
    )


def text_delta(seq: int, delta: str) -> bytes:
    return E(
        "response.output_text.delta",
        {
            "type": "response.output_text.delta",
            "sequence_number": seq,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": delta,
        },
    )


def sse_events(body: bytes) -> list[tuple[str, Any]]:
    """(event name, parsed data) of every frame of an SSE body; comments skipped, and the
    ``data: [DONE]`` terminator skipped as the SDKs do (it must be the last frame when present)."""
    out = []
    done = False
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, data = "message", []
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data.append(line[5:].strip())
        if data:
            assert not done, "a frame after data: [DONE]"
            if data == [b"[DONE]"]:
                done = True
                continue
            out.append((name, json.loads(b"\n".join(data))))
    errors = [i for i, (name, _) in enumerate(out) if name == "error"]
    if errors:  # DESIGN.md §5: exactly one error, then exactly one response.failed, then [DONE]
        assert len(errors) == 1 and errors[0] == len(out) - 2, [n for n, _ in out]
        failed_name, failed = out[-1]
        assert failed_name == "response.failed" and failed["response"]["status"] == "failed", out[-1]
        assert failed["response"]["error"]["code"] == out[-2][1]["code"], out[-2:]
        assert failed["sequence_number"] == out[-2][1]["sequence_number"] + 1
        assert done, "a failed stream must end with data: [DONE]"
    return out


class CountingUpstream:
    """Wraps an `UpstreamClient`, counting the body bytes the gateway actually read from upstream."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bytes_read = 0

    async def post(self, path: str, body: bytes, *, stream: bool) -> Any:
        response = await self.inner.post(path, body, stream=stream)
        outer = self

        class _Counted:
            status_code = response.status_code
            headers = response.headers

            async def chunks(self) -> Any:
                async for chunk in response.chunks():
                    outer.bytes_read += len(chunk)
                    yield chunk

            async def aclose(self) -> None:
                await response.aclose()

        return _Counted()

    async def get(self, path: str) -> Any:
        return await self.inner.get(path)

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextlib.contextmanager
def counting_gateway(
    upstream: MockUpstream, **overrides: Any
) -> Iterator[tuple[str, CountingApp, CountingUpstream]]:
    """Like `gateway`, also counting the upstream body bytes the gateway read."""
    from middleware.app import default_upstream

    overrides.setdefault("max_retained_bytes", B)
    overrides.setdefault("store", "memory")
    overrides.setdefault("upstream_read_timeout", 2.0)
    overrides.setdefault("retry_shield_seconds", 0)  # as in `gateway`
    settings = Settings(upstream=upstream.base_url, **overrides)
    holder: list[CountingUpstream] = []

    def factory(s: Settings, base_url: str) -> Any:
        holder.append(CountingUpstream(default_upstream(s, base_url)))
        return holder[0]

    app = CountingApp(create_app(settings, upstream_factory=factory))
    with serve_asgi(app) as url:
        yield url, app, holder[0]
