"""`new_id`: the gateway's one id format, ``<prefix>_`` + 32 random hex digits (128 bits).

Every object the gateway mints gets one (responses ``resp_``, conversations ``conv_``, items
``msg_`` / ``fc_`` / ``mcp_`` / ...).

Ids are opaque to clients and never capabilities: every store read also checks the caller's owner.
128 random bits make a collision between gateways sharing one database negligible (about 2⁻⁶⁴
after 2³² ids).
"""

from __future__ import annotations

import secrets

__all__ = ["new_id"]


def new_id(prefix: str) -> str:
    """A fresh id: ``prefix`` + ``_`` + 32 hex digits from `secrets` (e.g. ``resp_3f2a…``)."""
    return f"{prefix}_{secrets.token_hex(16)}"
