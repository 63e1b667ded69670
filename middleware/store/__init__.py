"""The response store (DESIGN.md §7): responses and conversations, history, and their routes.

* `store` — `Store` and `open_store(url)`: responses, items and conversations on one schema
  (`StoredResponse`, `ChainInfo`, `Page`; `SECRET_TOOL_FIELDS` are never stored).
* `backends` — the SQLite and PostgreSQL backends, units of `Work`, and the `StoreError` tree.
* `schema` — the versioned migrations, the same on both backends.
* `background` — `BackgroundStore`: background task rows (lease, cancel flag) and event logs.
* `history` — `restore_history`: admit a stored history's size summed in SQL, then load it (`Restored`).
* `routes` — `store_routes`: ``/v1/responses/{id}…`` and ``/v1/conversations…``; their failures are
  answered by `middleware.outcomes`.

`store_routes` is imported on first use (PEP 562): `routes` needs `middleware.outcomes`, which
needs this package for `StoreUnavailable`, so importing `routes` here would be an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from middleware.store.backends import (
    ConversationNotFound,
    DuplicateId,
    SchemaTooNew,
    StoreError,
    StoreUnavailable,
    UnknownCursor,
)
from middleware.store.history import Restored, restore_history
from middleware.store.store import (
    CONTINUABLE_STATUSES,
    RESPONSE_STATUSES,
    SECRET_TOOL_FIELDS,
    ChainInfo,
    Page,
    Store,
    StoredResponse,
    open_store,
)

if TYPE_CHECKING:
    from middleware.store.routes import store_routes

__all__ = [
    "CONTINUABLE_STATUSES",
    "RESPONSE_STATUSES",
    "SECRET_TOOL_FIELDS",
    "ChainInfo",
    "ConversationNotFound",
    "DuplicateId",
    "Page",
    "Restored",
    "SchemaTooNew",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "StoredResponse",
    "UnknownCursor",
    "open_store",
    "restore_history",
    "store_routes",
]


def __getattr__(name: str) -> object:
    if name == "store_routes":
        from middleware.store.routes import store_routes

        return store_routes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
