"""`HttpxUpstream`: the `UpstreamClient` on httpx (the fallback; aiohttp is the default).

httpx's exceptions are translated into `middleware.upstream.errors` by `_translate`, the one table
for this library.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import time
from collections.abc import AsyncIterator, Mapping

import httpx

from middleware.ops.request_id import REQUEST_ID
from middleware.upstream.errors import (
    UpstreamConnectError,
    UpstreamDecodeError,
    UpstreamError,
    UpstreamIncomplete,
    UpstreamTimeout,
)
from middleware.upstream.protocol import CallTiming, UpstreamResponse


def _translate(exc: httpx.HTTPError, *, during: str, timeouts: httpx.Timeout) -> UpstreamError:
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return UpstreamTimeout(
            f"upstream did not accept the connection within {timeouts.connect} s", phase="connect"
        )
    if isinstance(exc, httpx.TimeoutException):
        phase = "first_byte" if during == "headers" else "read"
        what = "send response headers" if during == "headers" else "send more of its body"
        return UpstreamTimeout(f"upstream did not {what} within {timeouts.read} s", phase=phase)
    if isinstance(exc, httpx.ConnectError):
        return UpstreamConnectError(f"cannot connect to the upstream: {exc}")
    if isinstance(exc, httpx.DecodingError):
        return UpstreamDecodeError(f"upstream body could not be decoded: {exc}")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return UpstreamIncomplete(f"upstream closed the connection early: {exc}")
    return UpstreamError(f"upstream request failed: {exc}")


class _HttpxResponse:
    """`UpstreamResponse` over an httpx streaming response, with the whole-call deadline."""

    def __init__(
        self, response: httpx.Response, deadline: float, timeouts: httpx.Timeout, started: float
    ) -> None:
        self._response = response
        self._timing = CallTiming(started)
        self._deadline = deadline
        self._timeouts = timeouts
        self.status_code = response.status_code
        self.headers: Mapping[str, str] = {k.lower(): v for k, v in response.headers.items()}

    async def chunks(self) -> AsyncIterator[bytes]:
        iterator = self._response.aiter_raw()
        while True:
            try:
                async with asyncio.timeout_at(self._deadline):
                    chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise UpstreamTimeout(
                    "upstream call passed its whole-call deadline (--upstream-deadline)", phase="deadline"
                ) from None
            except httpx.HTTPError as exc:
                raise _translate(exc, during="body", timeouts=self._timeouts) from None
            if chunk:
                self._timing.first_byte()
                yield chunk

    async def aclose(self) -> None:
        self._timing.done()
        await self._response.aclose()


class HttpxUpstream:
    """`UpstreamClient` on httpx: one pooled AsyncClient per process, explicit limits and timeouts.

    ``connect_timeout``: seconds to open a connection. ``read_timeout``: seconds allowed for the
    first byte and between any two reads. ``deadline``: seconds for the whole call, headers and
    body. ``api_key``: sent as ``Authorization: Bearer`` (the operator's credential, never the
    client's). No cookies are kept: an upstream's Set-Cookie is never replayed for another client.
    ``keepalive``: reuse connections (False: one connection per call, for an upstream whose
    framing cannot be trusted, see `AiohttpUpstream`).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        deadline: float = 1800.0,
        max_connections: int = 100,
        keepalive: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeouts = httpx.Timeout(
            connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout
        )
        self._deadline = deadline
        # identity: a compressed body could inflate past every clamp before a byte is checked
        headers = {
            "content-type": "application/json",
            "user-agent": "loopwarden",
            "accept-encoding": "identity",
        }
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(
            timeout=self._timeouts,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections if keepalive else 0
            ),
            headers=headers,
            follow_redirects=False,
            trust_env=False,
            # keep no cookies: an upstream's Set-Cookie must never be replayed for another client
            cookies=http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[])),
        )

    async def post(self, path: str, body: bytes, *, stream: bool) -> UpstreamResponse:
        accept = "text/event-stream" if stream else "application/json"
        return await self._send(
            self._client.build_request("POST", self.base_url + path, content=body, headers={"accept": accept})
        )

    async def get(self, path: str) -> UpstreamResponse:
        return await self._send(
            self._client.build_request("GET", self.base_url + path, headers={"accept": "application/json"})
        )

    async def _send(self, request: httpx.Request) -> UpstreamResponse:
        rid = REQUEST_ID.get()
        if rid != "-":
            request.headers["x-request-id"] = rid  # correlate the upstream's logs with ours
        started = time.monotonic()
        deadline = asyncio.get_running_loop().time() + self._deadline
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._client.send(request, stream=True)
        except TimeoutError:
            raise UpstreamTimeout(
                "upstream call passed its whole-call deadline (--upstream-deadline)", phase="deadline"
            ) from None
        except httpx.HTTPError as exc:
            raise _translate(exc, during="headers", timeouts=self._timeouts) from None
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            await response.aclose()
            raise UpstreamDecodeError(
                f"upstream sent Content-Encoding {encoding!r} though the gateway asked for identity; "
                "compressed bodies are refused (they could inflate past the read clamps)"
            )
        return _HttpxResponse(response, deadline, self._timeouts, started)

    async def aclose(self) -> None:
        await self._client.aclose()
