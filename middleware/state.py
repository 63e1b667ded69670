"""Process-wide gateway state, created in the lifespan."""

from __future__ import annotations

import dataclasses

from middleware.config import Settings
from middleware.upstream import UpstreamClient


@dataclasses.dataclass
class GatewayState:
    """The settings and the process's upstream client (None until the lifespan has started)."""

    settings: Settings
    upstream: UpstreamClient | None = None
