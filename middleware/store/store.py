"""Persistence of responses and conversations (DESIGN.md §7, issue 6): the `Store`.

`open_store(url)` picks the backend; ``await store.open()`` connects and applies the schema
migrations (idempotent; safe when several gateways start at once against one PostgreSQL);
``await store.close()`` releases everything. ``async with open_store(url) as store:`` does both.

=====================================  ===================================================
URL                                    backend
=====================================  ===================================================
``memory``                             SQLite in memory (tests, throwaway runs) — the same
                                       SQL and code path as a file
``sqlite:///relative/path.db``         SQLite file, relative to the working directory
``sqlite:////absolute/path.db``        SQLite file, absolute path (parents are created)
``postgresql://user@host:port/db``     PostgreSQL (psycopg 3, a small async pool); several
                                       gateway hosts may share one database
=====================================  ===================================================

The schema is described in `middleware.store.schema`; the backends in
`middleware.store.backends`. Every statement is written once, here, and runs on both.

What is stored for a response (one transaction, `Store.save_response`): the response row (the
final response object as returned to the client, the request parameters, status, owner, ...)
and its items in three roles — ``input`` (the request's input items as the client sent them),
``output`` (the client-visible output items) and ``replay`` (the upstream form of the output,
gateway ``mcp_call``s as their ``function_call`` / ``function_call_output`` pairs). Restoring a
``previous_response_id`` chain sends, oldest response first, each response's ``input`` then its
``replay`` items (`Store.load_chain`); the size of that history is summed in SQL first
(`Store.chain_size`) so the ledger can admit it (``Ledger.admit_history_size``) before a single
row is decoded.

Reads are admitted the same way (`middleware.store.reads`): a page's sizes come first
(`Store.input_item_sizes`, `Store.conversation_item_sizes`: ids and stored sizes of at most
``limit + 1`` rows, the item column never selected), then `Store.load_page` fetches and decodes
only the rows the caller admitted; a stored response's size (`Store.response_size`) comes before
its text (`Store.response_json`, served as stored, never decoded).

Sizes: ``size_bytes`` is the length in bytes of the item's compact UTF-8 JSON
(``separators=(",", ":")``, non-ASCII kept as UTF-8); ``node_count`` is
``budget.count_json_nodes`` of those bytes. A response row's ``size_bytes`` is the length in bytes
of its stored ``response`` text (schema version 2; NULL on rows written before it).

Ids the store mints (``conv_...``, and items stored without an ``id``) come from
`middleware.ids.new_id`, the gateway's one id format.

Secrets: the `SECRET_TOOL_FIELDS` (MCP ``headers`` and ``authorization``) of the ``tools`` of the
request and of the response object are dropped here, whatever the caller already did.

Ownership: every read, delete and append takes the caller's ``owner`` (a hash of its API key);
another owner's objects behave as if they did not exist (None / False → HTTP 404).

Errors: `StoreError` and its subclasses (`StoreUnavailable` for database failures,
`DuplicateId`, `ConversationNotFound`, `UnknownCursor`, `SchemaTooNew`); `ValueError` for an
invalid URL or argument (a caller bug).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from budget import count_json_nodes
from middleware.ids import new_id
from middleware.store.backends import (
    Backend,
    ConversationNotFound,
    DuplicateId,
    ExecuteMany,
    Fetch,
    Params,
    PostgresBackend,
    Row,
    SchemaTooNew,
    SqliteBackend,
    StoreError,
    StoreUnavailable,
    UniqueViolation,
    UnknownCursor,
    Work,
    redact_url,
    single,
)
from middleware.store.schema import MIGRATIONS, MIGRATIONS_TABLE

__all__ = [
    "CONTINUABLE_STATUSES",
    "RESPONSE_STATUSES",
    "SECRET_TOOL_FIELDS",
    "ChainInfo",
    "ConversationNotFound",
    "DuplicateId",
    "ItemLocation",
    "ItemSize",
    "Order",
    "Page",
    "PageSizes",
    "SchemaTooNew",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "StoredResponse",
    "UnknownCursor",
    "encode_json",
    "open_store",
    "present_item",
    "strip_secrets",
]

JsonObject = dict[str, Any]
Order = Literal["asc", "desc"]

#: The store's one JSON decoder: every stored item, request and response is decoded through it
#: (tests patch it to prove that `Store.chain_size` and `Store.conversation_size` decode nothing).
_loads = json.loads

#: Statuses a response can be stored with (OpenAI's ``ResponseStatus``).
RESPONSE_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled", "in_progress", "queued"})
#: Only these may be continued with ``previous_response_id`` (DESIGN.md §7).
CONTINUABLE_STATUSES = frozenset({"completed", "incomplete"})
#: Fields of a tool definition that carry credentials: never stored (`strip_secrets` deletes them).
#: The one definition: a response that echoes its tools shows these as null.
SECRET_TOOL_FIELDS = frozenset({"headers", "authorization"})
#: A chain walk stops after this many responses (a guard against a corrupt, cyclic chain).
MAX_CHAIN_LENGTH = 100_000
#: Page sizes accepted by the list methods (as OpenAI's API).
MIN_LIMIT, MAX_LIMIT = 1, 100

_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
    "mcp_call": "mcp",
    "mcp_list_tools": "mcpl",
    "mcp_approval_request": "mcpr",
    "mcp_approval_response": "mcpa",
}


# --- public value types ------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    ``created_at``: epoch seconds. ``status``: one of `RESPONSE_STATUSES` (the true one: a
    response whose client went away is ``cancelled``). ``response``: the final response object as
    returned to the client. ``request``: the request parameters (instructions, tools,
    tool_choice, metadata, ...; not the input, which is stored as items).
    """

    id: str
    owner: str
    created_at: int
    status: str
    model: str | None
    previous_response_id: str | None
    conversation_id: str | None
    response: JsonObject = field(repr=False)
    request: JsonObject = field(repr=False)


@dataclass(frozen=True)
class ChainInfo:
    """Size of the history a continuation would restore, summed in SQL, nothing decoded.

    ``size_bytes`` / ``node_count``: sums over the items `Store.load_chain` (or
    `Store.load_conversation`) would return — charge them with
    ``Ledger.admit_history_size(size_bytes, node_count)`` before loading. ``item_count``: how
    many items. ``length``: responses in the chain (1 = no previous response; 0 for a
    conversation). ``head_status``: the status of the response asked for (None for a
    conversation); only `CONTINUABLE_STATUSES` may be continued. ``missing_id``: the first
    ``previous_response_id`` of the chain that is no longer stored (deleted), None when the chain
    is whole. ``through_seq``: for a conversation, the last item ``seq`` counted (-1 when empty):
    pass it to `Store.load_conversation` so items appended meanwhile are not loaded unadmitted.
    """

    size_bytes: int
    node_count: int
    item_count: int
    length: int
    head_status: str | None
    missing_id: str | None = None
    through_seq: int | None = None


@dataclass(frozen=True)
class Page:
    """One page of a list, as OpenAI's cursor lists: ``data`` (items with ``id``s),
    ``first_id`` / ``last_id`` (None when empty), ``has_more``."""

    data: list[JsonObject]
    first_id: str | None
    last_id: str | None
    has_more: bool

    def to_json(self) -> JsonObject:
        """``{"object": "list", "data", "first_id", "last_id", "has_more"}``."""
        return {
            "object": "list",
            "data": self.data,
            "first_id": self.first_id,
            "last_id": self.last_id,
            "has_more": self.has_more,
        }


@dataclass(frozen=True)
class ItemSize:
    """One row of a list, as measured when it was written: ``seq`` (its position in the list's
    table), ``item_id``, ``size_bytes`` (bytes of its stored compact UTF-8 JSON) and
    ``node_count`` (`budget.count_json_nodes` of those bytes)."""

    seq: int
    item_id: str
    size_bytes: int
    node_count: int


@dataclass(frozen=True)
class ItemLocation:
    """Where `Store.find_item` found an item: ``table`` (``items`` or ``conversation_items``),
    ``key`` (the response or conversation id), ``role``, ``seq``, and the sizes measured when it
    was written (``size_bytes``, ``node_count``, as `ItemSize`)."""

    table: Literal["items", "conversation_items"]
    key: str
    role: str
    seq: int
    size_bytes: int
    node_count: int


@dataclass(frozen=True)
class _PageSource:
    """Where a list's rows live: ``table``'s rows whose ``key_column`` is ``key``, in ``roles``."""

    table: str
    key_column: str
    key: str
    roles: tuple[str, ...]


@dataclass(frozen=True)
class PageSizes:
    """The sizes of one page of a list, read without selecting a single item (nothing decoded).

    ``rows``: at most ``limit + 1`` `ItemSize` rows after the cursor, in page order (the extra
    one tells whether more remain). Admit a prefix of them, then pass its length to
    `Store.load_page`. Only the store builds it, from an owner-checked query.
    """

    rows: tuple[ItemSize, ...]
    limit: int
    source: _PageSource = field(repr=False)


# --- item helpers ------------------------------------------------------------------------------


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_COMPACT_ASCII = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def encode_json(value: object) -> str:
    """Compact JSON text of ``value`` (``,``/``:`` separators, non-ASCII kept). A string with a
    lone surrogate, which UTF-8 cannot encode, falls back to ASCII escapes. Raises `ValueError`
    for NaN or an infinity (not JSON) and `TypeError` for a value JSON cannot hold."""
    text = _COMPACT.encode(value)
    if not text.isascii():  # constant time: ASCII text always encodes
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = _COMPACT_ASCII.encode(value)
    return text


def strip_secrets(obj: JsonObject) -> JsonObject:
    """``obj`` with `SECRET_TOOL_FIELDS` removed from each entry of its ``tools`` (a shallow copy
    when something is removed; ``obj`` itself otherwise). Nested values are left alone: a
    function tool's JSON schema may well have a property named ``headers``."""
    tools = obj.get("tools")
    if not isinstance(tools, list) or not any(
        isinstance(tool, dict) and not SECRET_TOOL_FIELDS.isdisjoint(tool) for tool in tools
    ):
        return obj
    cleaned = [
        {key: value for key, value in tool.items() if key not in SECRET_TOOL_FIELDS}
        if isinstance(tool, dict)
        else tool
        for tool in tools
    ]
    return {**obj, "tools": cleaned}


def present_item(item: JsonObject, item_id: str) -> JsonObject:
    """A stored item as the list endpoints show it: with its ``id``; an easy message
    (``{"role", "content": "text"}``) as a full ``message`` item with a content list and a
    ``status``. The stored form (sent upstream as it is) is not changed."""
    shown: JsonObject = {"id": item_id}
    if "type" not in item and "role" in item:
        shown["type"] = "message"
    shown.update(item)
    if shown.get("type") == "message":
        content = shown.get("content")
        if isinstance(content, str):
            if shown.get("role") == "assistant":
                shown["content"] = [{"type": "output_text", "text": content, "annotations": []}]
            else:
                shown["content"] = [{"type": "input_text", "text": content}]
        shown.setdefault("status", "completed")
    return shown


@dataclass(frozen=True)
class _Prepared:
    item_id: str
    type: str
    text: str
    size_bytes: int
    node_count: int


#: Characters encoded at a time by `utf8_length` (at most 4 bytes each: a 4 MiB transient).
_UTF8_CHUNK = 1 << 20


def utf8_length(text: str) -> int:
    """The length in bytes of ``text`` encoded as UTF-8, without holding its whole encoding: ASCII
    text (the usual JSON) is its length; other text is encoded `_UTF8_CHUNK` characters at a time.
    Saving a response keeps two copies of its output (the item rows and the response row: the
    store's ×2 charge, DESIGN.md §4); a whole-text ``encode`` only to measure it was a third
    (attack report D3). Raises `UnicodeEncodeError` for a lone surrogate (`encode_json` never
    returns one)."""
    if text.isascii():
        return len(text)
    return sum(len(text[i : i + _UTF8_CHUNK].encode("utf-8")) for i in range(0, len(text), _UTF8_CHUNK))


def _encode_response(response: JsonObject, prepared: dict[int, _Prepared]) -> str:
    """`encode_json` of ``response``, its ``output`` spliced from the items' texts already encoded
    (``prepared``, keyed by ``id(item)``) when every output item is one of them: one join, so
    saving holds the item texts and the response text and nothing more (encoding the whole
    response again held the item texts and the encoder's fragments and their join: three copies
    of a large output where the store charges two; attack report D3). Any other output: encoded
    whole. The text equals `encode_json` of ``response`` (the items' texts are theirs)."""
    output = response.get("output")
    if not isinstance(output, list) or not output or any(id(item) not in prepared for item in output):
        return encode_json(response)
    marker = f"\x00loopwarden-output-{uuid.uuid4().hex}"  # encodes as a string nothing else holds
    head, found, tail = encode_json({**response, "output": marker}).partition(encode_json(marker))
    if not found:
        return encode_json(response)
    parts = [head, "["]
    for k, item in enumerate(output):
        parts += ("," if k else "", prepared[id(item)].text)
    parts += ("]", tail)
    return "".join(parts)


def _prepare(item: object) -> _Prepared:
    if not isinstance(item, dict):
        raise ValueError(f"a stored item must be a JSON object, got {type(item).__name__}")
    text = encode_json(item)
    data = text.encode("utf-8")
    raw_type = item.get("type")
    item_type = raw_type if isinstance(raw_type, str) else ("message" if "role" in item else "unknown")
    raw_id = item.get("id")
    item_id = raw_id if isinstance(raw_id, str) and raw_id else new_id(_ID_PREFIX.get(item_type, "item"))
    return _Prepared(item_id, item_type, text, len(data), count_json_nodes(data))


def _decode(text: str) -> Any:
    return _loads(text)


def _decode_object(text: str | None) -> JsonObject:
    value = _decode(text) if text is not None else {}
    return value if isinstance(value, dict) else {}


def _check_page_args(limit: int, order: str) -> None:
    if not MIN_LIMIT <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be in {MIN_LIMIT}..={MAX_LIMIT}, got {limit}")
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")


# --- SQL ---------------------------------------------------------------------------------------

_CHAIN_CTE = f"""
WITH RECURSIVE chain (id, prev, depth, status) AS (
    SELECT id, previous_response_id, 1, status FROM responses WHERE id = ? AND owner = ?
    UNION ALL
    SELECT r.id, r.previous_response_id, c.depth + 1, r.status
    FROM responses r JOIN chain c ON r.id = c.prev
    WHERE r.owner = ? AND c.depth < {MAX_CHAIN_LENGTH}
)
"""

# Never selects the item column: sizes were measured when the items were written.
_CHAIN_SIZE_SQL = (
    _CHAIN_CTE
    + """
SELECT h.n, h.status, t.prev, s.nbytes, s.nodes, s.nitems
FROM (SELECT COUNT(*) AS n, MAX(CASE WHEN depth = 1 THEN status END) AS status FROM chain) h,
     (SELECT prev FROM chain ORDER BY depth DESC LIMIT 1) t,
     (SELECT CAST(COALESCE(SUM(i.size_bytes), 0) AS BIGINT) AS nbytes,
             CAST(COALESCE(SUM(i.node_count), 0) AS BIGINT) AS nodes,
             COUNT(*) AS nitems
      FROM items i JOIN chain c ON i.response_id = c.id
      WHERE i.role IN ('input', 'replay')) s
"""
)

_LOAD_CHAIN_SQL = (
    _CHAIN_CTE
    + """
SELECT i.item FROM items i JOIN chain c ON i.response_id = c.id
WHERE i.role IN ('input', 'replay')
ORDER BY c.depth DESC, CASE i.role WHEN 'input' THEN 0 ELSE 1 END, i.seq
"""
)

_CONVERSATION_SIZE_SQL = """
SELECT c.next_seq,
       CAST(COALESCE(SUM(i.size_bytes), 0) AS BIGINT),
       CAST(COALESCE(SUM(i.node_count), 0) AS BIGINT),
       COUNT(i.seq)
FROM conversations c
LEFT JOIN conversation_items i ON i.conversation_id = c.id AND i.role IN ('input', 'replay')
WHERE c.id = ? AND c.owner = ?
GROUP BY c.next_seq
"""

# Rows written before schema version 2 have no size_bytes: 4 bytes per character bounds their
# UTF-8 length from above (COALESCE evaluates LENGTH only for them, on both databases).
_RESPONSE_SIZE = "SELECT COALESCE(size_bytes, 4 * LENGTH(response)) FROM responses WHERE id = ? AND owner = ?"
_RESPONSE_TEXT = "SELECT response FROM responses WHERE id = ? AND owner = ?"

# An item by id among the owner's responses and conversations; no index covers item_id alone
# (a scan of item rows through the owner joins): fine at the embedded store's sizes.
_FIND_ITEM_SQL = """
SELECT source, item_key, role, seq, size_bytes, node_count FROM (
    SELECT 0 AS source, i.response_id AS item_key, i.role, i.seq, i.size_bytes, i.node_count,
           r.created_at AS created_at
    FROM items i JOIN responses r ON r.id = i.response_id
    WHERE i.item_id = ? AND r.owner = ? AND i.role IN ('output', 'input')
    UNION ALL
    SELECT 1, ci.conversation_id, ci.role, ci.seq, ci.size_bytes, ci.node_count, ci.created_at
    FROM conversation_items ci JOIN conversations c ON c.id = ci.conversation_id
    WHERE ci.item_id = ? AND c.owner = ? AND ci.role IN ('output', 'input')
) found
ORDER BY CASE WHEN role = 'output' THEN 0 ELSE 1 END, source, created_at DESC
LIMIT 1
"""

_GET_RESPONSE = (
    "SELECT id, owner, created_at, status, model, previous_response_id, conversation_id, response, request"
    " FROM responses WHERE id = ? AND owner = ?"
)
_INSERT_RESPONSE = """
INSERT INTO responses (id, owner, created_at, status, model, previous_response_id, conversation_id,
                       error, request, usage, response, size_bytes)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
#: A background response's end, over its ``queued`` / ``in_progress`` row (the columns of
#: `_INSERT_RESPONSE` after ``owner``, then id and owner).
_REPLACE_PENDING = """
UPDATE responses SET created_at = ?, status = ?, model = ?, previous_response_id = ?, conversation_id = ?,
                     error = ?, request = ?, usage = ?, response = ?, size_bytes = ?
WHERE id = ? AND owner = ? AND status IN ('queued', 'in_progress') RETURNING id
"""
_INSERT_ITEM = """
INSERT INTO items (response_id, role, seq, item_id, type, item, size_bytes, node_count)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""
_INSERT_CONVERSATION_ITEM = """
INSERT INTO conversation_items (conversation_id, seq, role, item_id, type, item, size_bytes, node_count,
                                response_id, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
# Locks the conversation row until commit: concurrent appends are serialized and get disjoint,
# increasing seq ranges in commit order (SQLite serializes writers anyway).
_ALLOCATE_SEQ = (
    "UPDATE conversations SET next_seq = next_seq + ? WHERE id = ? AND owner = ? RETURNING next_seq"
)


# --- the store ---------------------------------------------------------------------------------


class Store:
    """Responses and conversations on one database; see the module docstring.

    Build it with `open_store`; call `open` before use and `close` after. Safe for concurrent
    use by many tasks of one event loop (PostgreSQL: up to the pool size at once; SQLite: one
    transaction at a time). Every method is one transaction: a unit of `Work` (a generator of
    statements) that the backend runs, under SQLite as one job of its worker thread. Cancelling
    a caller never leaves half a transaction: it is rolled back or, once SQLite runs it, finished.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __repr__(self) -> str:
        return f"Store({self.backend!r})"

    # --- lifecycle -----------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect and apply missing migrations (idempotent). Raises `StoreUnavailable` when the
        database cannot be reached and `SchemaTooNew` when a newer loopwarden migrated it."""
        await self.backend.open()
        try:
            await self._migrate()
        except BaseException:
            await self.backend.close()
            raise

    async def close(self) -> None:
        """Close every connection (idempotent)."""
        await self.backend.close()

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _migrate(self) -> list[int]:
        known = max(migration.version for migration in MIGRATIONS)

        def work() -> Work[list[int]]:
            applied_now: list[int] = []
            yield Fetch(MIGRATIONS_TABLE)
            applied = {int(row[0]) for row in (yield Fetch("SELECT version FROM schema_migrations"))}
            if applied and max(applied) > known:
                raise SchemaTooNew(max(applied), known)
            for migration in MIGRATIONS:
                if migration.version in applied:
                    continue
                for statement in migration.statements:
                    yield Fetch(statement)
                yield Fetch(
                    "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                    (migration.version, migration.name, int(time.time())),
                )
                applied_now.append(migration.version)
            return applied_now

        return await self.backend.run(work(), write=True, schema=True)

    async def _read(self, sql: str, params: Params = ()) -> list[Row]:
        """The rows of one read-only statement."""
        return await self.backend.run(single(sql, params), write=False)

    async def schema_version(self) -> int:
        """The highest applied migration version."""
        rows = await self._read("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        return int(rows[0][0])

    # --- responses -----------------------------------------------------------------------------

    async def save_response(
        self,
        resp: StoredResponse,
        *,
        input_items: list[JsonObject],
        output_items: list[JsonObject],
        replay_items: list[JsonObject],
        replace_pending: bool = False,
        extra: tuple[Fetch, ...] = (),
    ) -> bool:
        """Store a finished response and its items in ONE transaction; return whether it was stored.

        ``replace_pending`` (a background response, `middleware.store.background`): the row is
        already stored ``queued`` / ``in_progress`` and is updated in place instead, only while it
        still has one of those statuses (False, nothing stored, when a cancel, a lease expiry or a
        shutdown stored its end first). ``extra``: statements run in the same transaction after it.

        When ``resp.conversation_id`` is set, the input, output and replay items are appended
        to that conversation in the same transaction (the output shown by list calls, the
        replay sent upstream by `load_conversation`). Nothing is stored when anything fails.

        Raises `DuplicateId` (this id is already stored), `ConversationNotFound` (the
        conversation is gone or another owner's), `StoreUnavailable`; `ValueError` for an
        unknown status or an item that is not a JSON object.
        """
        if resp.status not in RESPONSE_STATUSES:
            raise ValueError(f"status must be one of {sorted(RESPONSE_STATUSES)}, got {resp.status!r}")
        response = strip_secrets(resp.response)
        request = strip_secrets(resp.request)
        error, usage = response.get("error"), response.get("usage")
        # Most output items are also replay items (the same objects): encode and count them once.
        prepared_by_id: dict[int, _Prepared] = {}

        def prepare(items: list[JsonObject]) -> list[_Prepared]:
            out = []
            for item in items:
                p = prepared_by_id.get(id(item))
                if p is None:
                    p = prepared_by_id[id(item)] = _prepare(item)
                out.append(p)
            return out

        roles = (
            ("input", prepare(input_items)),
            ("output", prepare(output_items)),
            ("replay", prepare(replay_items)),
        )
        response_text = _encode_response(response, prepared_by_id)
        row = (
            resp.id,
            resp.owner,
            resp.created_at,
            resp.status,
            resp.model,
            resp.previous_response_id,
            resp.conversation_id,
            None if error is None else encode_json(error),
            encode_json(request),
            None if usage is None else encode_json(usage),
            response_text,
            utf8_length(response_text),
        )
        item_rows = [
            (resp.id, role, seq, p.item_id, p.type, p.text, p.size_bytes, p.node_count)
            for role, prepared in roles
            for seq, p in enumerate(prepared)
        ]
        conversation_id = resp.conversation_id

        def work() -> Work[bool]:
            if replace_pending:
                updated = yield Fetch(_REPLACE_PENDING, (*row[2:], resp.id, resp.owner))
                if not updated:
                    return False
            else:
                yield Fetch(_INSERT_RESPONSE, row)
            yield ExecuteMany(_INSERT_ITEM, item_rows)
            for statement in extra:  # noqa: UP028 (the backend sends rows back: a tuple cannot take them)
                yield statement
            if conversation_id is not None:
                flat = [(role, p) for role, prepared in roles for p in prepared]
                first = yield from _allocate(conversation_id, resp.owner, len(flat))
                if first is None:
                    raise ConversationNotFound(conversation_id)
                yield _insert_conversation_items(
                    conversation_id, first, flat, response_id=resp.id, created_at=int(time.time())
                )
            return True

        try:
            return await self.backend.run(work(), write=True)
        except UniqueViolation as exc:
            raise DuplicateId("response", resp.id) from exc

    async def get_response(self, response_id: str, owner: str) -> StoredResponse | None:
        """The stored response, or None when unknown or another owner's."""
        rows = await self._read(_GET_RESPONSE, (response_id, owner))
        if not rows:
            return None
        r = rows[0]
        return StoredResponse(
            id=r[0],
            owner=r[1],
            created_at=int(r[2]),
            status=r[3],
            model=r[4],
            previous_response_id=r[5],
            conversation_id=r[6],
            response=_decode_object(r[7]),
            request=_decode_object(r[8]),
        )

    async def response_size(self, response_id: str, owner: str) -> int | None:
        """Bytes of the stored response object's JSON text (what `response_json` returns), read
        without fetching the text; None when unknown or another owner's. Rows written before
        schema version 2 answer 4 bytes per character, an upper bound."""
        rows = await self._read(_RESPONSE_SIZE, (response_id, owner))
        return int(rows[0][0]) if rows else None

    async def response_json(self, response_id: str, owner: str) -> bytes | None:
        """The stored response object as stored: its compact UTF-8 JSON, never decoded (the
        same bytes the JSON of `get_response`'s ``response`` encodes to); None when unknown or
        another owner's. Call `response_size` and admit it first."""
        rows = await self._read(_RESPONSE_TEXT, (response_id, owner))
        return str(rows[0][0]).encode("utf-8") if rows else None

    async def response_status(self, response_id: str, owner: str) -> str | None:
        """The stored response's status (one of `RESPONSE_STATUSES`), nothing else fetched or
        decoded; None when unknown or another owner's."""
        rows = await self._read(
            "SELECT status FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
        )
        return str(rows[0][0]) if rows else None

    async def delete_response(self, response_id: str, owner: str) -> bool:
        """Delete a response and its items; False when unknown or another owner's. Responses
        continuing from it keep their own items; their chains report it as ``missing_id``.
        Items it appended to a conversation stay there."""
        rows = await self.backend.run(
            single("DELETE FROM responses WHERE id = ? AND owner = ? RETURNING id", (response_id, owner)),
            write=True,
        )
        return bool(rows)

    async def chain_size(self, response_id: str, owner: str) -> ChainInfo | None:
        """Size of the ``previous_response_id`` chain ending at ``response_id`` (its ``input`` and
        ``replay`` items), summed in SQL without reading any item; None when unknown or another
        owner's. One statement, a recursive CTE over ``responses``."""
        rows = await self._read(_CHAIN_SIZE_SQL, (response_id, owner, owner))
        if not rows or not rows[0][0]:
            return None
        length, status, missing, nbytes, nodes, count = rows[0]
        return ChainInfo(
            size_bytes=int(nbytes),
            node_count=int(nodes),
            item_count=int(count),
            length=int(length),
            head_status=status,
            missing_id=missing,
        )

    async def load_chain(self, response_id: str, owner: str) -> list[JsonObject]:
        """The upstream items of the whole chain ending at ``response_id``, oldest response
        first: each response's ``input`` items, then its ``replay`` items, each in stored order.
        ``[]`` when unknown or another owner's. Call `chain_size` and admit it first."""
        rows = await self._read(_LOAD_CHAIN_SQL, (response_id, owner, owner))
        return [_decode(row[0]) for row in rows]

    async def find_item(self, item_id: str, owner: str) -> ItemLocation | None:
        """Where the caller's item `item_id` is stored, for an ``item_reference``: an
        `ItemLocation` with its stored sizes, the item column never selected; None when no
        response or conversation of `owner` holds it. A client-visible form wins: an ``output``
        row, then an ``input`` row (a response's before a conversation's, the newest first);
        ``replay`` rows (the upstream form of gateway calls, never shown) are not referable.
        Admit the sizes, then `load_item`."""
        rows = await self._read(_FIND_ITEM_SQL, (item_id, owner, item_id, owner))
        if not rows:
            return None
        source, key, role, seq, nbytes, nodes = rows[0][:6]
        table: Literal["items", "conversation_items"] = "items" if int(source) == 0 else "conversation_items"
        return ItemLocation(table, str(key), str(role), int(seq), int(nbytes), int(nodes))

    async def load_item(self, where: ItemLocation) -> JsonObject | None:
        """The item `find_item` located, decoded; None when it was deleted since."""
        key_column = "response_id" if where.table == "items" else "conversation_id"
        role_clause = "role = ? AND " if where.table == "items" else ""
        params: Params = (
            (where.key, where.role, where.seq) if where.table == "items" else (where.key, where.seq)
        )
        table = "items" if where.table == "items" else "conversation_items"  # never a caller's string
        rows = await self._read(
            f"SELECT item FROM {table} WHERE {key_column} = ? AND {role_clause}seq = ?", params
        )
        if not rows:
            return None
        value = _decode(rows[0][0])
        return value if isinstance(value, dict) else None

    async def list_input_items(
        self,
        response_id: str,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> Page | None:
        """The response's input items, paged as OpenAI's ``GET /v1/responses/{id}/input_items``
        (default newest first); None when unknown or another owner's. Raises `UnknownCursor`
        when ``after`` names no input item of this response; `ValueError` for ``limit`` outside
        1..=100 or another ``order``."""
        _check_page_args(limit, order)

        def work() -> Work[Page | None]:
            if not (yield Fetch("SELECT 1 FROM responses WHERE id = ? AND owner = ?", (response_id, owner))):
                return None
            return (yield from _page(_input_items(response_id), after, limit, order))

        return await self.backend.run(work(), write=False)

    async def input_item_sizes(
        self,
        response_id: str,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> PageSizes | None:
        """The sizes of the `list_input_items` page with these arguments, no item selected or
        decoded; None when unknown or another owner's. Raises as `list_input_items`."""
        _check_page_args(limit, order)

        def work() -> Work[PageSizes | None]:
            if not (yield Fetch("SELECT 1 FROM responses WHERE id = ? AND owner = ?", (response_id, owner))):
                return None
            return (yield from _page_sizes(_input_items(response_id), after, limit, order))

        return await self.backend.run(work(), write=False)

    async def load_page(self, sizes: PageSizes, count: int) -> Page:
        """The page whose first ``count`` rows of ``sizes`` the caller admitted: those items
        fetched, decoded and shown as `present_item` shows them, in page order; ``has_more``
        when ``sizes`` holds more rows than ``count``. A row deleted since ``sizes`` was read
        (its conversation or response deleted) is left out; stored items never change. Raises
        `ValueError` for ``count`` outside ``0..=min(len(sizes.rows), sizes.limit)``."""
        if not 0 <= count <= min(len(sizes.rows), sizes.limit):
            raise ValueError(f"count must be in 0..={min(len(sizes.rows), sizes.limit)}, got {count}")
        chosen = sizes.rows[:count]
        source = sizes.source

        def work() -> Work[list[JsonObject]]:
            if not chosen:
                return []
            rows = yield Fetch(
                f"SELECT seq, item FROM {source.table} WHERE {_source_where(source)}"
                f" AND seq IN ({', '.join('?' * len(chosen))})",
                [source.key, *source.roles, *(row.seq for row in chosen)],
            )
            texts = {int(row[0]): row[1] for row in rows}
            return [
                present_item(_decode_object(texts[row.seq]), row.item_id)
                for row in chosen
                if row.seq in texts
            ]

        data = await self.backend.run(work(), write=False)
        return Page(
            data=data,
            first_id=data[0]["id"] if data else None,
            last_id=data[-1]["id"] if data else None,
            has_more=len(sizes.rows) > count,
        )

    # --- conversations -------------------------------------------------------------------------

    async def create_conversation(
        self, owner: str, *, items: list[JsonObject], metadata: dict[str, str] | None = None
    ) -> JsonObject:
        """Create a conversation holding ``items``; return the conversation object
        ``{"id": "conv_...", "object": "conversation", "created_at", "metadata"}``."""
        conversation_id, created_at = new_id("conv"), int(time.time())
        metadata = dict(metadata or {})
        prepared = [("input", _prepare(item)) for item in items]
        row = (conversation_id, owner, created_at, encode_json(metadata), len(prepared))

        def work() -> Work[None]:
            yield Fetch(
                "INSERT INTO conversations (id, owner, created_at, metadata, next_seq) VALUES (?, ?, ?, ?, ?)",
                row,
            )
            yield _insert_conversation_items(
                conversation_id, 0, prepared, response_id=None, created_at=created_at
            )

        await self.backend.run(work(), write=True)
        return {
            "id": conversation_id,
            "object": "conversation",
            "created_at": created_at,
            "metadata": metadata,
        }

    async def get_conversation(self, conversation_id: str, owner: str) -> JsonObject | None:
        """The conversation object, or None when unknown or another owner's."""
        rows = await self._read(
            "SELECT id, created_at, metadata FROM conversations WHERE id = ? AND owner = ?",
            (conversation_id, owner),
        )
        if not rows:
            return None
        return {
            "id": rows[0][0],
            "object": "conversation",
            "created_at": int(rows[0][1]),
            "metadata": _decode_object(rows[0][2]),
        }

    async def update_conversation(
        self, conversation_id: str, owner: str, metadata: dict[str, str]
    ) -> JsonObject | None:
        """Replace the conversation's ``metadata`` with ``metadata`` (OpenAI's ``POST
        /v1/conversations/{id}``: the new object replaces the old one, nothing is merged); return
        the updated conversation object, or None when unknown or another owner's."""
        rows = await self.backend.run(
            single(
                "UPDATE conversations SET metadata = ? WHERE id = ? AND owner = ? RETURNING id, created_at",
                (encode_json(metadata), conversation_id, owner),
            ),
            write=True,
        )
        if not rows:
            return None
        return {
            "id": rows[0][0],
            "object": "conversation",
            "created_at": int(rows[0][1]),
            "metadata": dict(metadata),
        }

    async def conversation_item_size(
        self, conversation_id: str, owner: str, item_id: str
    ) -> PageSizes | None:
        """The size of the visible item ``item_id`` (``input`` or ``output`` role; the first one
        when several rows share the id) as a one-row `PageSizes` for `load_page`, nothing
        selected or decoded: ``rows`` is empty when the conversation holds no such item. None
        when the conversation is unknown or another owner's."""
        source = _conversation_items(conversation_id)

        def work() -> Work[PageSizes | None]:
            if not (
                yield Fetch(
                    "SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)
                )
            ):
                return None
            rows = yield Fetch(
                f"SELECT seq, item_id, size_bytes, node_count FROM {source.table}"
                f" WHERE {_source_where(source)} AND item_id = ? ORDER BY seq LIMIT 1",
                [source.key, *source.roles, item_id],
            )
            sized = tuple(ItemSize(int(r[0]), str(r[1]), int(r[2]), int(r[3])) for r in rows)
            return PageSizes(rows=sized, limit=1, source=source)

        return await self.backend.run(work(), write=False)

    async def delete_conversation_item(
        self, conversation_id: str, owner: str, item_id: str
    ) -> tuple[JsonObject | None, bool]:
        """Delete the item ``item_id`` from the conversation, in one transaction: every row of
        the conversation with that id, shown (``input``, ``output``) and sent upstream
        (``input``, ``replay``: a response's message, function call or reasoning item is stored
        once in each role under its own id), so later requests no longer see it. Only an id the
        list shows can be deleted. A gateway ``mcp_call`` is replayed upstream as a
        ``function_call`` / ``function_call_output`` pair under other ids: that pair stays.

        Returns ``(conversation, deleted)``: the conversation object (None when the conversation
        is unknown or another owner's) and whether a shown item with that id was deleted."""

        def work() -> Work[tuple[JsonObject | None, bool]]:
            rows = yield Fetch(
                "SELECT id, created_at, metadata FROM conversations WHERE id = ? AND owner = ?",
                (conversation_id, owner),
            )
            if not rows:
                return None, False
            conversation = {
                "id": rows[0][0],
                "object": "conversation",
                "created_at": int(rows[0][1]),
                "metadata": _decode_object(rows[0][2]),
            }
            shown = yield Fetch(
                "SELECT 1 FROM conversation_items WHERE conversation_id = ? AND item_id = ?"
                " AND role IN ('input', 'output') LIMIT 1",
                (conversation_id, item_id),
            )
            if not shown:
                return conversation, False
            yield Fetch(
                "DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ? RETURNING seq",
                (conversation_id, item_id),
            )
            return conversation, True

        return await self.backend.run(work(), write=True)

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        """Delete a conversation and its items; False when unknown or another owner's. The
        responses that appended to it stay."""
        rows = await self.backend.run(
            single(
                "DELETE FROM conversations WHERE id = ? AND owner = ? RETURNING id", (conversation_id, owner)
            ),
            write=True,
        )
        return bool(rows)

    async def list_conversation_items(
        self,
        conversation_id: str,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> Page | None:
        """The conversation's visible items (``input`` and ``output`` roles), paged as
        `list_input_items`; None when unknown or another owner's."""
        _check_page_args(limit, order)

        def work() -> Work[Page | None]:
            if not (
                yield Fetch(
                    "SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)
                )
            ):
                return None
            return (yield from _page(_conversation_items(conversation_id), after, limit, order))

        return await self.backend.run(work(), write=False)

    async def conversation_item_sizes(
        self,
        conversation_id: str,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> PageSizes | None:
        """The sizes of the `list_conversation_items` page with these arguments, no item
        selected or decoded; None when unknown or another owner's. Raises as
        `list_input_items`."""
        _check_page_args(limit, order)

        def work() -> Work[PageSizes | None]:
            if not (
                yield Fetch(
                    "SELECT 1 FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)
                )
            ):
                return None
            return (yield from _page_sizes(_conversation_items(conversation_id), after, limit, order))

        return await self.backend.run(work(), write=False)

    async def add_conversation_items(
        self, conversation_id: str, owner: str, items: list[JsonObject]
    ) -> list[JsonObject] | None:
        """Append ``items`` (shown and sent upstream) in one transaction; return them as list
        calls show them (with ids). None when the conversation is unknown or another owner's.
        Concurrent appends never lose or interleave items: each gets a contiguous seq range."""
        prepared = [("input", _prepare(item)) for item in items]
        created_at = int(time.time())

        def work() -> Work[bool]:
            first = yield from _allocate(conversation_id, owner, len(prepared))
            if first is None:
                return False
            yield _insert_conversation_items(
                conversation_id, first, prepared, response_id=None, created_at=created_at
            )
            return True

        if not await self.backend.run(work(), write=True):
            return None
        return [present_item(item, p.item_id) for item, (_, p) in zip(items, prepared, strict=True)]

    async def conversation_size(self, conversation_id: str, owner: str) -> ChainInfo | None:
        """Size of what `load_conversation` would return (``input`` and ``replay`` items), summed
        in SQL without reading any item; None when unknown or another owner's. Pass its
        ``through_seq`` to `load_conversation`."""
        rows = await self._read(_CONVERSATION_SIZE_SQL, (conversation_id, owner))
        if not rows:
            return None
        next_seq, nbytes, nodes, count = rows[0]
        return ChainInfo(
            size_bytes=int(nbytes),
            node_count=int(nodes),
            item_count=int(count),
            length=0,
            head_status=None,
            through_seq=int(next_seq) - 1,
        )

    async def load_conversation(
        self, conversation_id: str, owner: str, *, through_seq: int | None = None
    ) -> list[JsonObject]:
        """The conversation's upstream items (``input`` and ``replay`` roles) in order, up to
        ``through_seq`` (from `conversation_size`) when given; ``[]`` when unknown or another
        owner's."""
        sql = (
            "SELECT i.item FROM conversation_items i JOIN conversations c ON c.id = i.conversation_id"
            " WHERE c.id = ? AND c.owner = ? AND i.role IN ('input', 'replay')"
        )
        params: list[object] = [conversation_id, owner]
        if through_seq is not None:
            sql += " AND i.seq <= ?"
            params.append(through_seq)
        rows = await self._read(sql + " ORDER BY i.seq", params)
        return [_decode(row[0]) for row in rows]


def _allocate(conversation_id: str, owner: str, count: int) -> Work[int | None]:
    """Reserve ``count`` seqs of the conversation (row-locked until commit); the first one, or
    None when the conversation is unknown or another owner's."""
    rows = yield Fetch(_ALLOCATE_SEQ, (count, conversation_id, owner))
    if not rows:
        return None
    return int(rows[0][0]) - count


def _insert_conversation_items(
    conversation_id: str,
    first: int,
    rows: list[tuple[str, _Prepared]],
    *,
    response_id: str | None,
    created_at: int,
) -> ExecuteMany:
    """The statement inserting ``(role, item)`` rows at seqs ``first``, ``first + 1``, ..."""
    return ExecuteMany(
        _INSERT_CONVERSATION_ITEM,
        [
            (
                conversation_id,
                first + n,
                role,
                p.item_id,
                p.type,
                p.text,
                p.size_bytes,
                p.node_count,
                response_id,
                created_at,
            )
            for n, (role, p) in enumerate(rows)
        ],
    )


def _input_items(response_id: str) -> _PageSource:
    """A response's input items (``GET /v1/responses/{id}/input_items``)."""
    return _PageSource("items", "response_id", response_id, ("input",))


def _conversation_items(conversation_id: str) -> _PageSource:
    """A conversation's visible items (``GET /v1/conversations/{id}/items``)."""
    return _PageSource("conversation_items", "conversation_id", conversation_id, ("input", "output"))


def _source_where(source: _PageSource) -> str:
    """The condition selecting ``source``'s rows; its parameters are ``key, *roles``."""
    return f"{source.key_column} = ? AND role IN ({', '.join('?' * len(source.roles))})"


def _page_where(source: _PageSource, after: str | None, order: Order) -> Work[tuple[str, list[object]]]:
    """The condition and parameters selecting ``source``'s rows after the cursor ``after``;
    `UnknownCursor` when it names no row of the list."""
    where = _source_where(source)
    params: list[object] = [source.key, *source.roles]
    if after is not None:
        found = yield Fetch(
            f"SELECT seq FROM {source.table} WHERE {where} AND item_id = ? ORDER BY seq LIMIT 1",
            [*params, after],
        )
        if not found:
            raise UnknownCursor(after)
        where += " AND seq > ?" if order == "asc" else " AND seq < ?"
        params.append(found[0][0])
    return where, params


def _page(source: _PageSource, after: str | None, limit: int, order: Order) -> Work[Page]:
    """One page of ``source``'s items, ordered by seq."""
    where, params = yield from _page_where(source, after, order)
    direction = "ASC" if order == "asc" else "DESC"
    rows = yield Fetch(
        f"SELECT item_id, item FROM {source.table} WHERE {where} ORDER BY seq {direction} LIMIT ?",
        [*params, limit + 1],
    )
    data = [present_item(_decode_object(row[1]), row[0]) for row in rows[:limit]]
    return Page(
        data=data,
        first_id=data[0]["id"] if data else None,
        last_id=data[-1]["id"] if data else None,
        has_more=len(rows) > limit,
    )


def _page_sizes(source: _PageSource, after: str | None, limit: int, order: Order) -> Work[PageSizes]:
    """The `ItemSize` rows of the `_page` with these arguments (``limit + 1`` at most); never
    selects the item column."""
    where, params = yield from _page_where(source, after, order)
    direction = "ASC" if order == "asc" else "DESC"
    rows = yield Fetch(
        f"SELECT seq, item_id, size_bytes, node_count FROM {source.table} WHERE {where}"
        f" ORDER BY seq {direction} LIMIT ?",
        [*params, limit + 1],
    )
    sized = tuple(ItemSize(int(r[0]), str(r[1]), int(r[2]), int(r[3])) for r in rows)
    return PageSizes(rows=sized, limit=limit, source=source)


# --- construction ------------------------------------------------------------------------------


def open_store(url: str, *, pool_size: int = 8) -> Store:
    """A `Store` for ``url`` (not yet open; see the module docstring for the URL forms).

    ``pool_size``: PostgreSQL connections this process may open. Raises `ValueError` naming the
    accepted forms when ``url`` is not one of them.
    """
    if url in ("memory", "sqlite://:memory:", "sqlite:///:memory:"):
        return Store(SqliteBackend(None))
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not path or path.endswith("/"):
            raise ValueError(
                f"store URL {url!r} names no file; use sqlite:///relative/path.db or sqlite:////abs/path.db"
            )
        return Store(SqliteBackend(path))
    if url.startswith(("postgresql://", "postgres://")):
        return Store(PostgresBackend(url, pool_size=pool_size))
    raise ValueError(
        f"unsupported store URL {redact_url(url)!r}: use 'memory', 'sqlite:///relative/path.db', "
        "'sqlite:////absolute/path.db' or 'postgresql://user@host:port/dbname'"
    )
