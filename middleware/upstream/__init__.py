"""The upstream (model server) side: client interface, failures, two clients, SSE, body reader.

One job per module:

* `protocol` — `UpstreamClient`, `UpstreamResponse`, `CallTiming`: the interface the loop calls.
* `errors` — the `UpstreamError` tree, and the failures built from an error answer or event.
* `aiohttp_client` — `AiohttpUpstream`: the default client.
* `httpx_client` — `HttpxUpstream`: the fallback client.
* `sse` — `SSEParser` and `encode_event`: incremental Server-Sent Events parsing and encoding.
* `reader` — `read_stream_events`, `StreamAccumulator`, `read_buffered_body`: upstream bodies
  read under the ledger.

This package re-exports the interface and the failure tree (`__all__`); the clients and the reader
are imported from their modules.
"""

from middleware.upstream.errors import (
    UpstreamConnectError,
    UpstreamDecodeError,
    UpstreamError,
    UpstreamIncomplete,
    UpstreamInvalid,
    UpstreamStatus,
    UpstreamTimeout,
)
from middleware.upstream.protocol import CallTiming, UpstreamClient, UpstreamResponse

__all__ = [
    "CallTiming",
    "UpstreamClient",
    "UpstreamConnectError",
    "UpstreamDecodeError",
    "UpstreamError",
    "UpstreamIncomplete",
    "UpstreamInvalid",
    "UpstreamResponse",
    "UpstreamStatus",
    "UpstreamTimeout",
]
