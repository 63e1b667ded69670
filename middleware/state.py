"""Process-wide gateway state, created in the lifespan."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from middleware.config import Settings
from middleware.upstream import UpstreamClient

if TYPE_CHECKING:
    from middleware.store import Store
    from middleware.tools import ToolCatalog


@dataclasses.dataclass
class GatewayState:
    """The settings, the process's upstream client, MCP tool catalog and response store (None until
    the lifespan has started them)."""

    settings: Settings
    upstream: UpstreamClient | None = None
    catalog: ToolCatalog | None = None
    store: Store | None = None
