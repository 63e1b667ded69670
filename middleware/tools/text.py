"""Text helpers of the tool layer: lone-surrogate scrubbing, MCP results as text, error summaries.

Everything a tool or MCP server says passes through here before the gateway keeps it, so a
``str`` that cannot be encoded as UTF-8 (a lone UTF-16 surrogate such as ``'\\udc8d'``, as produced
by ``surrogateescape`` decoding or a JSON ``"\\ud83d"`` escape) never reaches the upstream or the
client (CASES.md B21 e).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

import mcp_types
from mcp.shared.exceptions import MCPError

__all__ = ["SurrogateEscapeFixer", "describe_exception", "result_text", "scrub_json", "scrub_text"]

# Longest exception message fed back to the model (characters).
MAX_ERROR_CHARS: Final = 500


def scrub_text(text: str) -> str:
    """`text` with each lone surrogate code point replaced by U+FFFD.

    A surrogate *pair* stored as two code points (``'\\ud83d\\ude00'``) is joined into the
    character it encodes. Text that is already valid (the common case) is returned as is.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


# A run of backslashes, "u", a UTF-16 surrogate in hex, optionally followed by a low surrogate escape.
_SURROGATE_ESCAPE: Final = re.compile(
    rb"(\\+)u([dD][89a-fA-F][0-9a-fA-F]{2})(\\u[dD][c-fC-F][0-9a-fA-F]{2})?"
)
_SURROGATE_START: Final = re.compile(rb"\\u[dD][89a-fA-F]")
_LONGEST_ESCAPE: Final = 12  # a surrogate pair: \\uD83D\\uDE00


class SurrogateEscapeFixer:
    """Rewrites lone UTF-16 surrogate escapes in JSON text (``"\\udc8d"``) to ``"\\ufffd"``.

    Python MCP servers serialise a str holding a lone surrogate as such an escape; the SDK's JSON
    parser refuses it and the whole result would be lost, so the streamable HTTP transport passes
    response bytes through this first (CASES.md B21 e). Escaped backslashes (``"\\\\udc8d"`` is
    text, not an escape) and valid pairs are left alone. Feed chunks with `feed` — it holds back up
    to the last few bytes while an escape could still continue — and call `flush` at the end.
    """

    def __init__(self) -> None:
        self._carry = b""

    def feed(self, chunk: bytes) -> bytes:
        """The fixed bytes that can be released after `chunk`."""
        return self._process(self._carry + chunk, final=False)

    def flush(self) -> bytes:
        """Everything still held back, fixed."""
        return self._process(self._carry, final=True)

    def _process(self, buf: bytes, *, final: bool) -> bytes:
        if _SURROGATE_START.search(buf) is None:  # the common case: no surrogate escape here
            keep = len(buf) if final else max(len(buf) - 3, 0)  # hold back a possible "\\ud" prefix
            while 0 < keep < len(buf) and buf[keep - 1 : keep] == b"\\":
                keep -= 1
            self._carry = buf[keep:]
            return buf[:keep]
        limit = len(buf) if final else len(buf) - _LONGEST_ESCAPE
        out: list[bytes] = []
        position = 0  # buf[:position] is in `out`
        search = 0
        cut: int | None = None
        while (match := _SURROGATE_ESCAPE.search(buf, search)) is not None:
            if match.end() > limit:
                cut = match.start()
                break
            run, unit, low = match.group(1), match.group(2), match.group(3)
            search = match.start(3) if low is not None else match.end()
            if len(run) % 2 == 0:
                continue  # an escaped backslash followed by the text "u…"
            if low is not None and unit[1:2].lower() in b"89ab":
                search = match.end()  # a valid pair
                continue
            out.append(buf[position : match.start()])
            out.append(run + b"ufffd")
            position = match.end(2)
        if cut is None:
            cut = max(limit, position)
            while cut > position and buf[cut - 1 : cut] == b"\\":
                cut -= 1
        out.append(buf[position:cut])
        self._carry = buf[cut:]
        return b"".join(out)


def scrub_json(value: Any) -> Any:
    """A copy of the JSON value `value` with `scrub_text` applied to every string (keys too)."""
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, dict):
        return {scrub_text(str(k)): scrub_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub_json(v) for v in value]
    return value


def _summary(block: object) -> str:
    """One line standing in for a non-text content block (the model gets no binary data)."""
    if isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
        return f"[{block.type}: {block.mime_type}, {len(block.data)} base64 characters omitted]"
    if isinstance(block, mcp_types.ResourceLink):
        name = f" ({block.name})" if block.name else ""
        return f"[resource link: {block.uri}{name}]"
    if isinstance(block, mcp_types.EmbeddedResource):
        resource = block.resource
        mime = resource.mime_type or "binary"
        size = len(resource.blob) if isinstance(resource, mcp_types.BlobResourceContents) else 0
        return f"[resource {resource.uri}: {mime}, {size} base64 characters omitted]"
    return f"[{getattr(block, 'type', type(block).__name__)} content omitted]"


def result_text(result: mcp_types.CallToolResult) -> str:
    """What the model is fed for an MCP ``CallToolResult``, before scrubbing and the size cap.

    Text blocks and embedded text resources are joined with newlines, in order; other blocks
    (images, audio, blobs, resource links) become a one-line summary. When there is no text at all,
    ``structuredContent`` (if any) is given as compact JSON ahead of the summaries.
    """
    parts: list[str] = []
    has_text = False
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
            has_text = True
        elif isinstance(block, mcp_types.EmbeddedResource) and isinstance(
            block.resource, mcp_types.TextResourceContents
        ):
            parts.append(block.resource.text)
            has_text = True
        else:
            parts.append(_summary(block))
    if not has_text and result.structured_content is not None:
        parts.insert(0, json.dumps(result.structured_content, ensure_ascii=False, separators=(",", ":")))
    return "\n".join(parts)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def describe_exception(exc: BaseException) -> str:
    """A short, secret-free description of a tool or connection failure.

    Exception groups are unwrapped to their first leaf. MCP protocol errors keep their code and
    message, and ``RuntimeError`` / ``ValueError`` (the SDK's result validation) their message;
    anything else — notably HTTP client errors, whose text can include a URL with a token in its
    query — is reduced to the exception's type name. At most `MAX_ERROR_CHARS` characters.
    """
    leaf = _leaves(exc)[0]
    if isinstance(leaf, MCPError):
        text = f"MCP error {leaf.error.code}: {leaf.error.message}"
    elif isinstance(leaf, TimeoutError):
        text = "no answer in time"
    elif type(leaf) in (RuntimeError, ValueError) or type(leaf).__name__ == "ValidationError":
        text = f"{type(leaf).__name__}: {leaf}"
    else:
        text = type(leaf).__name__
    text = scrub_text(text)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"
