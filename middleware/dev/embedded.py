"""Serve an ASGI app with uvicorn in a background thread on a loopback port.

Used to run the embedded development model next to the gateway, and by the tests to run real
servers. A background thread is used (not a task on the caller's loop) so that uvicorn does not
install signal handlers over the caller's.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class BackgroundServer:
    """A uvicorn server on ``host``:<ephemeral port> in a daemon thread.

    `start()` returns the base URL ``http://HOST:PORT``; raises RuntimeError if the server has not
    started within `startup_timeout` seconds. `stop()` asks it to exit and joins the thread.
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        log_level: str | None = None,
        thread_name: str | None = None,
        **config: Any,
    ) -> None:
        # proto=IPPROTO_TCP lets asyncio set TCP_NODELAY on accepted connections (no 40 ms delayed-ACK stalls)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config.setdefault("lifespan", "on")
        # uvicorn's default, "auto", is httptools whenever it is installed (a dependency since the
        # connection bounds): keep the stack explicit, `loopwarden serve`'s default, unless asked
        config.setdefault("http", "h11")
        # and the event loop: "auto" would be uvloop whenever it is installed (`connection_options`
        # names `loopwarden serve`'s own, settings.loop)
        config.setdefault("loop", "asyncio")
        # Leave the host process's logging alone: uvicorn applies log_config, log_level and
        # access_log=False to the process-wide "uvicorn.*" loggers, which would silence the
        # gateway's own access log.
        config.setdefault("log_config", None)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, **config))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True, name=thread_name
        )

    @property
    def url(self) -> str:
        """``http://HOST:PORT``."""
        return f"http://{self.host}:{self.port}"

    def start(self, startup_timeout: float = 20.0) -> str:
        """Start serving; return `url`."""
        self._thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"embedded server on {self.url} did not start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the server to exit and wait up to `timeout` seconds."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        self._sock.close()
