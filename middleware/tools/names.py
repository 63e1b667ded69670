"""Function names the upstream accepts for MCP tools (case B29, openai/codex #8174).

MCP allows tool names such as ``calendar.get_time`` (the 2025-11-25 spec's tool names may hold
dots and slashes); OpenAI's function tools, and the servers that copy its schema, accept only
`FUNCTION_NAME` (``^[a-zA-Z0-9_-]{1,64}$``). `upstream_name` gives such a tool a conforming name
that is unique within one request; the catalog keeps the MCP name next to it
(`middleware.tools.resolved.GatewayTool`), so calls run, and client-visible items show, the
real name. The rule follows codex's fix (openai/codex PR #8694: every other character becomes
``_``), plus a short digest suffix when that or the 64-character cut would collide.
`upstream_names` names all the MCP tools of a request at once, so that the result does not
depend on their order: ``cal.get`` next to a tool really named ``cal_get`` becomes
``cal_get_<8 hex>`` whichever the server lists first, and two names that sanitise alike
(``cal.get``, ``cal/get``) both get their suffix.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Container, Sequence
from typing import Final

__all__ = ["FUNCTION_NAME", "upstream_name", "upstream_names"]

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
    base = _sanitised(wanted)
    return base if base not in taken else _suffixed(base, wanted)


def upstream_names(wanted: Sequence[str], taken: Container[str]) -> list[str]:
    """`upstream_name` of each of `wanted` (one request's MCP tools), order-independent.

    A conforming name is kept (a clash of two is the caller's to report). A renamed one is the
    sanitised name unless that is in `taken` (the client's function tools) or is what another of
    `wanted` keeps or sanitises to; then it carries the 8-hex SHA-256 suffix of its own `wanted`
    (stable: the same MCP name always gets the same suffix). Pure."""
    bases = [w if FUNCTION_NAME.fullmatch(w) else _sanitised(w) for w in wanted]
    claims = Counter(bases)
    return [
        base
        if FUNCTION_NAME.fullmatch(name) or (claims[base] == 1 and base not in taken)
        else _suffixed(base, name)
        for name, base in zip(wanted, bases, strict=True)
    ]


def _sanitised(wanted: str) -> str:
    return _OTHER.sub("_", wanted)[:64] or "tool"


def _suffixed(base: str, wanted: str) -> str:
    digest = hashlib.sha256(wanted.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"{base[: 64 - _DIGEST_CHARS - 1]}_{digest}"
