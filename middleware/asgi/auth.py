"""Gateway API keys and the caller's identity (DESIGN.md §7: stored responses belong to a key).

`Authenticator(keys)`: with keys configured, a request must present one of them as
``Authorization: Bearer KEY`` (or ``api-key: KEY``), else 401 ``invalid_api_key``. With none
configured the gateway is open (the CLI warns at start-up). Either way the caller's identity,
`owner`, is a SHA-256 hash of the presented key (of the empty string when none), so stored
responses are isolated per key and no key is ever stored. Keys are compared in constant time.

The *caller* whose share of the process pool a request counts against (DESIGN.md §4,
`Authenticator.caller`) is the owner when keys are configured; on an open gateway, where anyone
may present any key, it is the client address instead. That address is ``scope["client"]``,
which uvicorn's proxy-headers handling (on by default) has already replaced with the
``X-Forwarded-For`` client when the peer is a trusted proxy — uvicorn's ``forwarded_allow_ips``,
from ``$FORWARDED_ALLOW_IPS``, default ``127.0.0.1,::1``; a forwarded address from any other peer
is ignored. (uvicorn reads ``X-Forwarded-For`` only, not RFC 7239 ``Forwarded``.)
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import Scope

from middleware.errors import Unauthenticated


def presented_key(scope: Scope) -> str:
    """The key a request presents: ``Authorization: Bearer KEY`` or ``api-key: KEY`` ("" if none)."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
        elif lowered == b"api-key":
            return value.decode("latin-1").strip()
    return ""


def owner_of_key(key: str) -> str:
    """The caller identity stored with its responses: ``sha256:<hex>`` of the key."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


class Authenticator:
    """Checks a request's key against the configured ones and derives its owner."""

    #: Owners of keys already admitted, by key: two SHA-256 per request saved. Bounded (cleared
    #: when full); only admitted keys (a configured one, or any on an open gateway) go in.
    MAX_CACHED = 1024

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]
        self._owners: dict[str, str] = {}

    @property
    def open(self) -> bool:
        """True when no key is configured (every request is admitted)."""
        return not self._digests

    def caller(self, scope: Scope, owner: str) -> str:
        """The admission caller of a request whose `owner` is known: ``owner`` when keys are
        configured, else ``addr:<client host>`` (``addr:-`` when the server gives no address)."""
        if self._digests:
            return owner
        client = scope.get("client")
        return f"addr:{client[0] if client else '-'}"

    def owner(self, scope: Scope) -> str:
        """The request's owner; raises 401 ``invalid_api_key`` when keys are configured and the
        presented key is missing or not one of them."""
        key = presented_key(scope)
        owner = self._owners.get(key)
        if owner is not None:
            return owner
        if self._digests:
            digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
            if not any(hmac.compare_digest(digest, known) for known in self._digests):
                what = "no API key was presented" if not key else "the API key is not valid for this gateway"
                raise Unauthenticated(
                    f"{what}; send Authorization: Bearer <key> with one of the gateway's keys (the "
                    "operator configures them with --api-key, $LOOPWARDEN_API_KEY or --api-key-file)"
                )
        if len(self._owners) >= self.MAX_CACHED:
            self._owners.clear()
        owner = self._owners[key] = owner_of_key(key)
        return owner
