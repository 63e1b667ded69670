"""Compaction items: sealing what the gateway hands out, and lowering them for an upstream.

Every ``compaction`` item the gateway returns (``POST /v1/responses/compact``,
`middleware.loop.compact`) carries ``encrypted_content`` sealed by `CompactionSeal`::

    lwc1.<base64url(JSON payload)>.<base64url(HMAC-SHA256(secret, "lwc1." + payload part))>

The payload is ``{"k": kind, "u": upstream id, "c": content}``: ``kind`` ``gateway`` (``c`` is
the summary text the gateway's own summarising call wrote) or ``upstream`` (``c`` is the
``encrypted_content`` of the upstream's own compaction item, readable by that upstream only;
``u`` is a hash of its base URL). The MAC makes the item tamper-evident, not secret: the summary
is the client's own conversation, signed so that nobody can make the gateway feed an upstream
text or blobs it did not write itself (the Open Responses item is opaque to clients, "not
intended to be human-interpretable"). The secret is ``--compact-secret`` / ``compact_secret_file``
(DESIGN.md §3 precedence), else random per process — shared by ``--workers`` — so items survive
neither a restart nor another host unless it is set (README "Compaction").

`lower_compaction_window` is the model input rule for a request whose input (or restored
history) holds compaction items (`../shared/specs/compaction.md` §3.5.3): items before the latest
compaction item are dropped except user messages (the compaction supersedes them, and calls and
outputs are dropped in pairs); a gateway item becomes an assistant message with the summary
(`SUMMARY_PREFIX`); an upstream's item goes back to that upstream as its own item; an item no
upstream of this request can read, or one whose seal does not verify, is a 400 naming it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from middleware.errors import InvalidRequest

PREFIX = "lwc1."
#: What the summary of a gateway compaction item is preceded by in the assistant message it becomes.
SUMMARY_PREFIX = "[Previous conversation summary]\n\n"
MIN_SECRET_BYTES = 16


def upstream_id(base_url: str) -> str:
    """A short stable id of an upstream (16 hex digits of SHA-256 of its base URL): which
    upstream an ``upstream`` compaction item came from, without putting the URL in the item."""
    return hashlib.sha256(base_url.encode()).hexdigest()[:16]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclasses.dataclass(frozen=True, slots=True)
class Sealed:
    """The opened payload of a gateway compaction item: ``kind`` (``gateway`` | ``upstream``),
    ``upstream`` (`upstream_id` of who made it), ``content`` (summary text, or the upstream's
    own ``encrypted_content``)."""

    kind: str
    upstream: str
    content: str


class CompactionSeal:
    """Seals and opens compaction items with one HMAC-SHA256 key.

    ``secret``: the key (bytes, at least `MIN_SECRET_BYTES`); None makes a random one (this
    process only). Raises ValueError for a shorter key.
    """

    def __init__(self, secret: bytes | None = None) -> None:
        key = secret if secret is not None else secrets.token_bytes(32)
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"compact_secret must be at least {MIN_SECRET_BYTES} bytes, got {len(key)}")
        self._key = key

    def __repr__(self) -> str:
        return "CompactionSeal(<secret>)"

    def _mac(self, head: str) -> str:
        return _b64(hmac.new(self._key, head.encode("ascii"), hashlib.sha256).digest())

    def seal(self, kind: str, upstream: str, content: str) -> str:
        """The ``encrypted_content`` of a new compaction item (see the module docstring)."""
        payload = json.dumps({"k": kind, "u": upstream, "c": content}, separators=(",", ":"))
        head = PREFIX + _b64(payload.encode())
        return f"{head}.{self._mac(head)}"

    def open(self, content: str) -> Sealed | None:
        """The payload of a sealed ``encrypted_content``; None when it does not verify (a foreign
        blob, a tampered item, another secret). Constant-time MAC comparison."""
        head, dot, mac = content.rpartition(".")
        if not dot or not head.startswith(PREFIX) or not hmac.compare_digest(mac, self._mac(head)):
            return None
        try:
            payload = json.loads(_unb64(head[len(PREFIX) :]))
        except (ValueError, binascii.Error):
            return None
        if not isinstance(payload, dict) or not all(isinstance(payload.get(k), str) for k in "kuc"):
            return None
        if payload["k"] not in ("gateway", "upstream"):
            return None
        return Sealed(payload["k"], payload["u"], payload["c"])


def is_compaction(item: Any) -> bool:
    """True for a ``compaction`` input item."""
    return isinstance(item, dict) and item.get("type") == "compaction"


def has_compaction(value: Any) -> bool:
    """True when a request's ``input`` (a string or a list of items) holds a compaction item."""
    return isinstance(value, list) and any(is_compaction(item) for item in value)


def summary_message(summary: str) -> dict[str, Any]:
    """The assistant message a gateway compaction item becomes for the upstream."""
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": SUMMARY_PREFIX + summary, "annotations": []}],
    }


@dataclasses.dataclass(frozen=True, slots=True)
class Lowering:
    """How compaction items are lowered for one upstream: ``seal`` (the gateway's key),
    ``upstream`` (`upstream_id` of this request's upstream), ``native`` (that upstream compacts
    itself, so it reads compaction items it made, and foreign unsealed ones are passed to it)."""

    seal: CompactionSeal
    upstream: str
    native: bool

    def lower(self, item: dict[str, Any], where: str) -> dict[str, Any]:
        """One compaction item as the upstream should see it; `InvalidRequest` naming `where`."""
        content = item.get("encrypted_content")
        if not isinstance(content, str) or not content:
            raise InvalidRequest(
                f"{where} is a compaction item without encrypted_content; send the item as "
                "/v1/responses/compact returned it",
                code="invalid_value",
                param=where,
            )
        sealed = self.seal.open(content)
        if sealed is None:
            if self.native and not content.startswith(PREFIX):
                return {"type": "compaction", "encrypted_content": content}  # the upstream's own kind
            raise InvalidRequest(
                f"{where} is a compaction item whose encrypted_content does not verify: it was changed, "
                "made by another gateway (another compact_secret, or a restart without one) or by a "
                "provider this upstream cannot read; send the item unchanged, or compact the "
                "conversation again",
                code="invalid_value",
                param=where,
            )
        if sealed.kind == "gateway":
            return summary_message(sealed.content)
        if sealed.upstream != self.upstream:
            raise InvalidRequest(
                f"{where} was compacted by another upstream's own /responses/compact, and only that "
                "upstream can read it; continue with the model it was made for, or compact the "
                "conversation again for this one",
                code="invalid_value",
                param=where,
            )
        return {"type": "compaction", "encrypted_content": sealed.content}


def _is_user_message(item: dict[str, Any]) -> bool:
    return item.get("role") == "user" and item.get("type", "message") == "message"


def lower_compaction_window(
    parts: Sequence[Sequence[dict[str, Any]]],
    lowering: Lowering,
    where: Callable[[int, int, dict[str, Any]], str],
) -> list[list[dict[str, Any]]]:
    """Apply the model input rule to `parts` (e.g. restored history, then the new input), which
    the upstream sees concatenated; the same parts come back, lowered.

    Before the latest compaction item only user messages are kept (a ``function_call`` dropped
    there takes its later ``function_call_output`` with it: no orphaned output); every compaction
    item is lowered (`Lowering.lower`); a kept user message loses the null keys the ``openai``
    SDK's ``model_dump()`` of a compacted window adds (`_without_sdk_nulls`). ``where(part,
    index, item)`` names an item for a 400.
    Parts without a compaction item come back unchanged. Raises `InvalidRequest`.
    """
    flat = [(p, i, item) for p, part in enumerate(parts) for i, item in enumerate(part)]
    last = max((n for n, (_, _, item) in enumerate(flat) if is_compaction(item)), default=None)
    if last is None:
        return [list(part) for part in parts]
    out: list[list[dict[str, Any]]] = [[] for _ in parts]
    dropped_calls: set[Any] = set()
    for n, (p, i, item) in enumerate(flat):
        if is_compaction(item):
            if n == last:
                out[p].append(lowering.lower(item, where(p, i, item)))
            else:
                lowering.lower(item, where(p, i, item))  # superseded, but it must still verify
            continue
        if n < last and not _is_user_message(item):
            if item.get("type") == "function_call":
                dropped_calls.add(item.get("call_id"))
            continue
        if item.get("type") == "function_call_output" and item.get("call_id") in dropped_calls:
            continue
        out[p].append(_without_sdk_nulls(item) if n < last else item)
    return out


#: Keys the ``openai`` SDK adds as null when it dumps a compacted window's user messages: it types
#: ``CompactedResponse.output`` as output items, so a user message becomes a `ResponseOutputMessage`
#: (``phase``) whose ``input_text`` parts become `ResponseOutputText` (``annotations``,
#: ``logprobs``), which ``model_dump()`` writes back (with serializer warnings). The spec's and
#: OpenAI's window is user messages with ``input_text`` parts, which none of these belong to.
_SDK_NULL_MESSAGE_KEYS = frozenset({"phase"})
_SDK_NULL_PART_KEYS = frozenset({"annotations", "logprobs"})


def _without_sdk_nulls(item: dict[str, Any]) -> dict[str, Any]:
    """A retained user message of a compacted window without the SDK's null artefacts
    (`_SDK_NULL_MESSAGE_KEYS`, and `_SDK_NULL_PART_KEYS` of its ``input_*`` parts), so that the
    upstream is sent the window's own shape; anything not null is left as the client sent it."""
    content = item.get("content")
    if not any(item.get(k, 0) is None for k in _SDK_NULL_MESSAGE_KEYS) and not (
        isinstance(content, list) and any(_has_sdk_nulls(part) for part in content)
    ):
        return item
    out = {k: v for k, v in item.items() if not (k in _SDK_NULL_MESSAGE_KEYS and v is None)}
    if isinstance(content, list):
        out["content"] = [
            {k: v for k, v in part.items() if not (k in _SDK_NULL_PART_KEYS and v is None)}
            if _has_sdk_nulls(part)
            else part
            for part in content
        ]
    return out


def _has_sdk_nulls(part: Any) -> bool:
    return (
        isinstance(part, dict)
        and str(part.get("type", "")).startswith("input_")
        and any(part.get(k, 0) is None for k in _SDK_NULL_PART_KEYS)
    )
