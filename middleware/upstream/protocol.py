"""The upstream client's interface: `UpstreamClient` opens a request, `UpstreamResponse` reads it.

`UpstreamClient.post(path, body, stream=...)` opens one request to the Responses-compatible model
server and returns an `UpstreamResponse` whose body is read incrementally with `chunks()`. Both
raise only `middleware.upstream.errors.UpstreamError` subclasses, never a library's exception.
`CallTiming` observes the upstream timing metrics of one call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from middleware.ops import metrics


class UpstreamResponse(Protocol):
    """One upstream answer: status, lower-cased headers, and its body read incrementally."""

    status_code: int
    headers: Mapping[str, str]

    def chunks(self) -> AsyncIterator[bytes]:
        """Yield decoded body bytes as they arrive; raises UpstreamError subclasses."""
        ...

    async def aclose(self) -> None:
        """Release the connection (idempotent)."""
        ...


class UpstreamClient(Protocol):
    """A process-wide client for one model server."""

    async def post(self, path: str, body: bytes, *, stream: bool) -> UpstreamResponse:
        """POST `body` (JSON bytes) to ``base_url + path``; raises UpstreamError subclasses."""
        ...

    async def get(self, path: str) -> UpstreamResponse:
        """GET ``base_url + path`` (e.g. ``/models``); raises UpstreamError subclasses."""
        ...

    async def aclose(self) -> None:
        """Close every pooled connection."""
        ...


class CallTiming:
    """The timing metrics of one upstream call, each observed once: ``first_byte()`` at the first
    body byte (``loopwarden_upstream_ttfb_seconds``), ``done()`` when the response is closed
    (``loopwarden_upstream_duration_seconds``; True the first time). ``started``: monotonic seconds."""

    __slots__ = ("_done", "_first_byte", "_started")

    def __init__(self, started: float) -> None:
        self._started = started
        self._first_byte = False
        self._done = False

    def first_byte(self) -> None:
        if not self._first_byte:
            self._first_byte = True
            metrics.UPSTREAM_TTFB.observe(time.monotonic() - self._started)

    def done(self) -> bool:
        if self._done:
            return False
        self._done = True
        metrics.UPSTREAM_DURATION.observe(time.monotonic() - self._started)
        return True
