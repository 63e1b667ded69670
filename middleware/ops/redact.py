"""Keeping operator secrets and URL credentials out of messages and logs.

`register_secret` remembers an operator secret (an upstream or gateway API key); `redact` replaces
every registered secret in a text with ``***`` (upstream error messages can echo keys back).
The registry is process-wide: secrets come from the process's configuration.

`redact_url` is the one way a URL (an MCP ``server_url``, a store DSN) is shown in a message, a
``repr`` or a log line: without its password, its query or its fragment. `RedactUrls` is the
logging filter that applies it to the URLs other libraries log (installed by
`middleware.ops.request_id.log_config`).
"""

from __future__ import annotations

import logging
import re
from typing import Final

_SECRETS: set[str] = set()


def register_secret(value: str | None) -> None:
    """Remember an operator secret (6 characters or more) so `redact` hides it."""
    if value and len(value) >= 6:
        _SECRETS.add(value)


def redact(text: str) -> str:
    """`text` with every registered secret replaced by ``***``."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, "***")
    return text


def redact_url(url: str) -> str:
    """`url` as it may be shown: scheme, host, port and path kept, every credential masked.

    * a userinfo ``user:password@`` becomes ``user:***@``; a userinfo without a colon becomes
      ``***@`` (a lone userinfo is often a token, as in ``https://TOKEN@host/``);
    * a query, which may carry a token or a ``password=``, becomes ``?***``;
    * a fragment is dropped.

    ``postgresql://u:pw@db:5432/lw?sslmode=require`` -> ``postgresql://u:***@db:5432/lw?***``;
    ``https://mcp.example/v1?key=s3cret`` -> ``https://mcp.example/v1?***``.

    The authority ends at the first ``/`` after ``scheme://`` (RFC 3986 §3.2, as libpq reads a
    DSN), so a ``?`` or ``#`` inside a password does not expose the rest of it. Never raises: text
    that is not a URL (no ``scheme://``) is read as an authority followed by a path.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    end = rest.find("/")
    authority, path = (rest, "") if end < 0 else (rest[:end], rest[end:])
    userinfo, at, host = authority.rpartition("@")
    shown = f"{scheme}{sep}"
    if at:
        user, colon, _ = userinfo.partition(":")
        shown += f"{user}:***@" if colon else "***@"
    # Host, port and path, up to a query or fragment (looked for only after the userinfo is cut
    # off, so that a "?" or "#" in a password never counts as the start of one).
    located = host + path
    for index, char in enumerate(located):
        if char in "?#":
            return shown + located[:index] + ("?***" if char == "?" else "")
    return shown + located


_URL_RE: Final = re.compile(r"https?://[^\s'\"]+")


class RedactUrls(logging.Filter):
    """Rewrites every ``http(s)://`` URL in a log record's message with `redact_url`.

    For the loggers of the MCP SDK's HTTP stack (``httpx2``, which logs every request URL at
    INFO, and ``mcp.client.streamable_http``): a client-declared ``server_url`` may carry a token
    in its query, and it must not reach the gateway's logs. `middleware.ops.request_id.log_config`
    installs it on those loggers; nothing installs it at import. A logger's filters see only the
    records logged on that logger itself, not those propagated from its children.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message:
            shown = _URL_RE.sub(lambda match: redact_url(match.group()), message)
            if shown != message:
                record.msg = shown
                record.args = None
        return True
