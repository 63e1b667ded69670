"""`GatewayState`: the process-wide objects every request of one worker shares."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from middleware.config import Settings
from middleware.upstream.protocol import UpstreamClient

if TYPE_CHECKING:
    from middleware.loop.compaction import CompactionSeal
    from middleware.ops.admission import ProcessPool
    from middleware.store.store import Store
    from middleware.tools import ToolCatalog


@dataclasses.dataclass
class GatewayState:
    """The settings and the process's shared objects.

    ``pool`` (the admission pool) is set by `middleware.app.create_app`; the upstream clients
    (``upstream``, and ``upstreams`` per model route), the MCP tool ``catalog`` and the response
    ``store`` are None (empty) until the app's lifespan has started them."""

    settings: Settings
    upstream: UpstreamClient | None = None
    catalog: ToolCatalog | None = None
    store: Store | None = None
    pool: ProcessPool | None = None
    upstreams: dict[str, UpstreamClient] = dataclasses.field(default_factory=dict)  # per model route
    seal: CompactionSeal | None = None  # signs compaction items (set by create_app)
    #: upstream base URL -> whether it has its own /responses/compact (``auto`` mode learns it once)
    compact_support: dict[str, bool] = dataclasses.field(default_factory=dict)
    upstream_urls: dict[str, str] = dataclasses.field(default_factory=dict)  # route name -> base URL

    def upstream_for(self, route: object) -> UpstreamClient:
        """The upstream client of a request's model route (its own, else the default)."""
        name = getattr(route, "name", None)
        client = self.upstreams.get(name) if name is not None else None
        client = client or self.upstream
        assert client is not None, "the lifespan creates the upstream client"
        return client

    def upstream_url(self, route: object) -> str:
        """The base URL of a request's upstream (its route's, else the default): what identifies
        the upstream that made a compaction item."""
        name = getattr(route, "name", None)
        return self.upstream_urls.get(name or "", "") or self.upstream_urls.get("", "")
