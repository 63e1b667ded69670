"""Function names the upstream accepts for MCP tools (case B29, openai/codex #8174).

MCP allows tool names such as ``calendar.get_time`` (the 2025-11-25 spec's tool names may hold
dots and slashes); OpenAI's function tools, and the servers that copy its schema, accept only
`FUNCTION_NAME` (``^[a-zA-Z0-9_-]{1,64}$``). `upstream_name` gives such a tool a conforming name
that is unique within one request; the catalog keeps the MCP name next to it
(`middleware.tools.resolved.GatewayTool`), so calls run, and client-visible items show, the
real name. The rule follows codex's fix (openai/codex PR #8694: every other character becomes
``_``), plus a short digest suffix when that or the 64-character cut would collide.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Container
from typing import Final

__all__ = ["FUNCTION_NAME", "upstream_name"]

#: The function-name grammar of OpenAI's Responses API (and Anthropic's tool names).
FUNCTION_NAME: Final = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_OTHER: Final = re.compile(r"[^a-zA-Z0-9_-]")
_DIGEST_CHARS: Final = 8


def upstream_name(wanted: str, taken: Container[str]) -> str:
    """The function name the upstream sees for a tool the gateway would call `wanted`.

    `wanted` itself when it matches `FUNCTION_NAME` (a clash with `taken` is then the caller's
    to report: two tools really share the name). Otherwise every character outside
    ``[a-zA-Z0-9_-]`` becomes ``_`` and the result is cut to 64 characters; when that is in
    `taken` (names already given in this request, client function tools included), the first 55
    characters, ``_`` and 8 hex digits of the SHA-256 of `wanted` are used instead. Pure.
    """
    if FUNCTION_NAME.fullmatch(wanted):
        return wanted
    base = _OTHER.sub("_", wanted)[:64] or "tool"
    if base not in taken:
        return base
    digest = hashlib.sha256(wanted.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"{base[: 64 - _DIGEST_CHARS - 1]}_{digest}"
