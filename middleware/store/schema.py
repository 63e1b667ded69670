"""The store's schema, as versioned migrations that run unchanged on SQLite and PostgreSQL.

Tables (schema version 1; version 2 below):

``schema_migrations``
    ``version`` INTEGER PK, ``name``, ``applied_at`` (epoch s). One row per applied migration.
``responses``
    One row per stored response. ``id`` TEXT PK (``resp_...``), ``owner`` (the caller's identity,
    a hash of its API key), ``created_at`` (epoch s), ``status`` (completed, incomplete, failed,
    cancelled, ...), ``model``, ``previous_response_id`` (no foreign key: a deleted response
    leaves the chains through it broken, which `ChainInfo.missing_id` reports),
    ``conversation_id``, ``error`` / ``usage`` (JSON or NULL, copied from the response object),
    ``request`` (JSON: the request parameters, MCP ``headers``/``authorization`` stripped),
    ``response`` (JSON: the final response object as returned to the client).
``items``
    Append-only item rows of a response: PK (``response_id``, ``role``, ``seq``), ``role`` one of
    ``input`` (the request's input items as the client sent them), ``output`` (the client-visible
    output items) or ``replay`` (the upstream form of the output: gateway ``mcp_call``s as their
    ``function_call`` / ``function_call_output`` pairs); ``seq`` 0.. within a role; ``item_id``
    (the item's own ``id``, else one the store made up, for paging); ``type``; ``item`` (compact
    UTF-8 JSON text); ``size_bytes`` (its length in bytes) and ``node_count``
    (`budget.count_json_nodes` of it), summed in SQL to charge history before decoding it.
    Deleted with their response (ON DELETE CASCADE).
``conversations``
    ``id`` TEXT PK (``conv_...``), ``owner``, ``created_at``, ``metadata`` (JSON object),
    ``next_seq`` — the next free item ``seq``; appends allocate from it with
    ``UPDATE ... RETURNING``, which locks the row until commit, so concurrent appends get
    disjoint, increasing ranges in commit order.
``conversation_items``
    PK (``conversation_id``, ``seq``); ``role`` as for ``items`` (items added directly are
    ``input``: both shown and sent upstream; ``output`` rows are shown, ``replay`` rows are sent
    upstream); ``item_id``, ``type``, ``item``, ``size_bytes``, ``node_count`` as above;
    ``response_id`` (the response that appended the row, NULL for direct adds); ``created_at``.

Only portable SQL: TEXT, INTEGER, BIGINT, CHECK, composite primary keys, ON DELETE CASCADE (SQLite
needs ``PRAGMA foreign_keys = ON``, which the backend sets). JSON is TEXT on both, never JSONB,
so the bytes stored are the bytes measured and decoded.

Schema version 2 adds ``responses.size_bytes`` (BIGINT): the length in bytes of the stored
``response`` text, measured when it is written, so a read is admitted before the text is fetched
(`Store.response_size`). Rows written before version 2 hold NULL there.

Schema version 3 adds the background tables (`middleware.store.background`):
``background_tasks`` (one row per ``background: true`` response: the worker running it, its lease,
the cancel request, when it ended) and ``background_events`` (the SSE frames of a streamed one,
for ``GET /v1/responses/{id}?stream=true&starting_after=N``).

A new migration is appended with the next version; released migrations never change.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIGRATIONS", "MIGRATIONS_TABLE", "Migration"]


@dataclass(frozen=True)
class Migration:
    """One schema step: ``version`` (1, 2, ...), a ``name``, and its DDL ``statements``."""

    version: int
    name: str
    statements: tuple[str, ...]


MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at BIGINT NOT NULL
)
"""

_V1 = (
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        status TEXT NOT NULL,
        model TEXT,
        previous_response_id TEXT,
        conversation_id TEXT,
        error TEXT,
        request TEXT NOT NULL,
        usage TEXT,
        response TEXT NOT NULL
    )
    """,
    "CREATE INDEX responses_owner_created ON responses (owner, created_at)",
    """
    CREATE TABLE items (
        response_id TEXT NOT NULL REFERENCES responses (id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('input', 'output', 'replay')),
        seq INTEGER NOT NULL,
        item_id TEXT NOT NULL,
        type TEXT NOT NULL,
        item TEXT NOT NULL,
        size_bytes BIGINT NOT NULL,
        node_count BIGINT NOT NULL,
        PRIMARY KEY (response_id, role, seq)
    )
    """,
    "CREATE INDEX items_item_id ON items (response_id, role, item_id)",
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        metadata TEXT NOT NULL,
        next_seq BIGINT NOT NULL DEFAULT 0
    )
    """,
    """
    CREATE TABLE conversation_items (
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        seq BIGINT NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('input', 'output', 'replay')),
        item_id TEXT NOT NULL,
        type TEXT NOT NULL,
        item TEXT NOT NULL,
        size_bytes BIGINT NOT NULL,
        node_count BIGINT NOT NULL,
        response_id TEXT,
        created_at BIGINT NOT NULL,
        PRIMARY KEY (conversation_id, seq)
    )
    """,
    "CREATE INDEX conversation_items_item_id ON conversation_items (conversation_id, item_id)",
)

_V2 = ("ALTER TABLE responses ADD COLUMN size_bytes BIGINT",)

_V3 = (
    """
    CREATE TABLE background_tasks (
        response_id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        worker TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('running', 'done')),
        stream INTEGER NOT NULL,
        lease_until BIGINT NOT NULL,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        finished_at BIGINT
    )
    """,
    "CREATE INDEX background_tasks_lease ON background_tasks (state, lease_until)",
    "CREATE INDEX background_tasks_worker ON background_tasks (worker, state)",
    """
    CREATE TABLE background_events (
        response_id TEXT NOT NULL,
        seq BIGINT NOT NULL,
        frame TEXT NOT NULL,
        PRIMARY KEY (response_id, seq)
    )
    """,
)

#: Every migration, oldest first. Applied in order at ``await store.open()``.
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial: responses, items, conversations", _V1),
    Migration(2, "responses.size_bytes: the stored response's size, for admitting reads", _V2),
    Migration(3, "background responses: tasks (worker, lease, cancel) and their event logs", _V3),
)
