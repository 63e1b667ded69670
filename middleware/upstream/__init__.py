"""The upstream (model server) side: the client interface, its failures, two clients, the SSE
parser and the reader of upstream bodies under the ledger.

`protocol` (UpstreamClient, UpstreamResponse, CallTiming), `errors` (the UpstreamError tree),
`aiohttp_client` (the default), `httpx_client` (the fallback), `sse` (parser and encoder),
`reader` (streams and buffered bodies under the ledger).
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
