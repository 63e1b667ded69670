"""Request ids (issue 10): accept or mint ``x-request-id``, return it, and put it in every log line.

`RequestIdMiddleware` (pure ASGI, outermost) takes the client's ``x-request-id`` when it is 1 to
128 characters of ``[A-Za-z0-9._:-]`` (anything else is replaced, never echoed), else mints
``req_<32 hex>``; stores it in the `REQUEST_ID` context variable for the request's task tree and
adds it to the response headers. `RequestIdFilter` stamps ``record.request_id`` on log records
(outside a request, the reason there is none: `NO_REQUEST`); `DevModelFilter` keeps the
embedded development model's uvicorn lines (a second server in the process, same loggers) out;
`log_config` is the ``logging.config.dictConfig`` that puts it on every line (one JSON object per
line with ``json_lines=True``) and hides URL credentials logged by the MCP SDK's HTTP stack
(`middleware.ops.redact.RedactUrls`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from middleware.ops.redact import RedactUrls

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("loopwarden_request_id", default="-")
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_of(scope: Scope) -> str:
    """The client's ``x-request-id`` if well-formed, else a fresh ``req_<hex>``."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for name, value in headers:
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1")
            if _VALID.fullmatch(text):
                return text
            break
    return "req_" + secrets.token_hex(16)


class RequestIdMiddleware:
    """Sets `REQUEST_ID` and the ``x-request-id`` response header for every HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope)
        token = REQUEST_ID.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


#: The ``request_id`` of a line logged outside any request, by logger: why it has no id.
NO_REQUEST: dict[str, str] = {
    "loopwarden.connections": "connection",  # connection-level, before any request exists
    "uvicorn.error": "process",  # start-up, shutdown, server errors
}
#: The default reason for other loggers.
NO_REQUEST_DEFAULT = "process"
#: The thread the embedded development model's uvicorn runs in (`middleware.dev.embedded`).
DEVMODEL_THREAD = "loopwarden-devmodel"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to every record it sees: the request's id, else why there is none
    (`NO_REQUEST`: ``process`` for start-up / shutdown / background lines, ``connection`` for
    connection-level ones)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        record.request_id = rid if rid != "-" else NO_REQUEST.get(record.name, NO_REQUEST_DEFAULT)
        return True


class DevModelFilter(logging.Filter):
    """Drops the embedded development model's uvicorn lines below WARNING (its lifecycle lines
    would repeat the gateway's, its access lines look like the gateway's); what it logs at WARNING
    or above stays, under the logger name ``devmodel.<name>`` so it cannot be mistaken."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName != DEVMODEL_THREAD or not record.name.startswith("uvicorn"):
            return True
        if record.levelno < logging.WARNING:
            return False
        record.name = "devmodel." + record.name
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, request_id, message (and exc when present)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", REQUEST_ID.get()),
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def log_config(level: str, *, json_lines: bool) -> dict[str, object]:
    """A `logging.config.dictConfig` for uvicorn and the gateway: every line carries the request id.

    `level` is a logging level name (``"info"``); ``json_lines`` picks `JsonFormatter`. The
    loggers that print MCP server URLs (``httpx2``, ``mcp.client.streamable_http``) get the
    ``redact_urls`` filter (`RedactUrls`): a client-declared URL's query may hold a token.
    """
    formatter: dict[str, object] = (
        {"()": JsonFormatter}
        if json_lines
        else {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "request_id": {"()": RequestIdFilter},
            "devmodel": {"()": DevModelFilter},
            "redact_urls": {"()": RedactUrls},
        },
        "formatters": {"default": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "filters": ["devmodel", "request_id"],
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "": {"handlers": ["stderr"], "level": level.upper()},
            "uvicorn": {"handlers": [], "level": level.upper(), "propagate": True},
            "uvicorn.error": {"handlers": [], "level": level.upper(), "propagate": True},
            "uvicorn.access": {"handlers": [], "level": level.upper(), "propagate": True},
            # HTTP clients log every request at INFO: the access log already has one line each
            "httpx": {"handlers": [], "level": "WARNING", "propagate": True},
            "httpx2": {"handlers": [], "level": "WARNING", "propagate": True, "filters": ["redact_urls"]},
            "mcp.client.streamable_http": {"filters": ["redact_urls"]},
        },
    }
