"""Keeping operator secrets and URL credentials out of messages and logs.

`register_secret` remembers an operator secret (an upstream or gateway API key); `redact` replaces
every registered secret in a text with ``***`` (upstream error messages can echo keys back).
The registry is process-wide: secrets come from the process's configuration.
"""

from __future__ import annotations

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
