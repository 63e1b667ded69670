"""Real servers on loopback ports for end-to-end tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from middleware.dev.embedded import BackgroundServer


@contextlib.contextmanager
def serve_asgi(app: Any, **config: Any) -> Iterator[str]:
    """Serve `app` with a real uvicorn on 127.0.0.1:<ephemeral>; yield ``http://127.0.0.1:PORT``."""
    server = BackgroundServer(app, **config)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()
