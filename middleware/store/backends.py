"""The two database backends of the store: SQLite (a file, or in memory) and PostgreSQL.

A backend only opens connections and runs transactions; every SQL statement and every decision
lives in `middleware.store.store`, written once with ``?`` placeholders, so SQLite and PostgreSQL run
the same statements against the same schema (`middleware.store.schema`).

A transaction is a unit of `Work`: a generator that yields its statements (`Fetch`,
`ExecuteMany`) one at a time and is sent each statement's rows back, so a fetch can decide the
statements after it; its return value is the transaction's result. The backend drives it
(`Backend.run`) and owns BEGIN / COMMIT / ROLLBACK. The work itself never waits on anything but
its statements, which lets SQLite run a whole transaction in one job of its worker thread.

* `SqliteBackend` — one `sqlite3` connection owned by one worker thread. A transaction is one
  job there (never on the event loop): one thread hop per transaction, not one per statement;
  the single worker runs one job at a time, so transactions never interleave. ``path=None`` is
  an in-memory database: the same code path as a file. Files get WAL mode,
  ``synchronous=NORMAL`` and a busy timeout, so several processes may share one file. Write
  transactions start with ``BEGIN IMMEDIATE`` (writers are serialized, readers are not blocked);
  reads run in autocommit, one snapshot per statement, as under PostgreSQL's READ COMMITTED.
* `PostgresBackend` — a psycopg 3 `AsyncConnectionPool` (autocommit connections), ``?``
  rewritten to ``%s``; each statement is one round trip. Writes run in an explicit transaction;
  reads run in autocommit (under READ COMMITTED each statement takes its own snapshot either
  way, so BEGIN and COMMIT would only cost two round trips). Schema transactions take a
  transaction-scoped advisory lock, so gateways starting together against one server migrate
  one at a time.

Driver errors are translated into the store's exception tree (`StoreError` and subclasses,
defined here so both backends and the store share them).
"""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar

from middleware.ops.redact import redact_url

__all__ = [
    "Backend",
    "ConversationNotFound",
    "DuplicateId",
    "ExecuteMany",
    "Fetch",
    "Params",
    "PostgresBackend",
    "Row",
    "SchemaTooNew",
    "SqliteBackend",
    "Statement",
    "StoreError",
    "StoreUnavailable",
    "UniqueViolation",
    "UnknownCursor",
    "Work",
    "redact_url",
    "single",
]

_T = TypeVar("_T")
Row = tuple[Any, ...]
Params = Sequence[object]

#: Key of the PostgreSQL advisory lock held while migrations run ("lwstore1" as an int64).
ADVISORY_LOCK_KEY = 0x6C7773746F726531
#: Seconds a SQLite writer waits for another process's write lock before failing.
SQLITE_BUSY_TIMEOUT = 10.0

# --- exception tree ----------------------------------------------------------------------------


class StoreError(Exception):
    """Base of every failure the store reports. ``str()`` is a message for operators."""


class StoreUnavailable(StoreError):
    """The database failed (cannot connect, I/O error, lock or pool timeout, driver error).

    Not the client's fault; a retry may help. The driver's exception is the ``__cause__``.
    """


class SchemaTooNew(StoreError):
    """The database was migrated by a newer loopwarden: ``found`` > ``known`` schema versions."""

    def __init__(self, found: int, known: int) -> None:
        self.found = found
        self.known = known
        super().__init__(
            f"the store's schema is at version {found} but this loopwarden knows versions up to {known}; "
            "upgrade loopwarden (or point --store at another database)"
        )


class DuplicateId(StoreError):
    """An object with this id is already stored (``save_response`` twice for one id)."""

    def __init__(self, kind: str, object_id: str) -> None:
        self.kind = kind
        self.object_id = object_id
        super().__init__(f"a {kind} with id {object_id!r} is already stored")


class ConversationNotFound(StoreError):
    """``save_response`` names a conversation that does not exist (or belongs to another owner);
    nothing was stored."""

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        super().__init__(f"conversation {conversation_id!r} not found; the response was not stored")


class UnknownCursor(StoreError):
    """A list's ``after`` names no item of that list (HTTP 400, ``param`` ``after``)."""

    def __init__(self, cursor: str) -> None:
        self.cursor = cursor
        super().__init__(
            f"no item with id {cursor!r} in this list; pass an id from an earlier page as 'after'"
        )


class UniqueViolation(StoreError):
    """A primary-key / unique constraint failed; `middleware.store.store` turns it into `DuplicateId`."""


# --- units of work -----------------------------------------------------------------------------


class Fetch(NamedTuple):
    """Run ``sql`` (``?`` placeholders) once; the work is sent all its rows (``[]`` for a
    statement without rows)."""

    sql: str
    params: Params = ()


class ExecuteMany(NamedTuple):
    """Run ``sql`` once per parameter row of ``rows``; the work is sent ``[]``."""

    sql: str
    rows: Sequence[Params]


Statement: TypeAlias = Fetch | ExecuteMany
#: One transaction: yields statements, is sent each one's rows, returns the result. It must not
#: wait on anything else (under SQLite it runs in the worker thread, off the event loop), and it
#: cannot catch a statement's failure: that fails the whole transaction.
Work: TypeAlias = Generator[Statement, list[Row], _T]


def single(sql: str, params: Params = ()) -> Work[list[Row]]:
    """The work of one statement: its rows."""
    rows = yield Fetch(sql, params)
    return rows


def _drive(work: Work[_T], execute: Callable[[Statement], list[Row]]) -> _T:
    """Run ``work`` to its end, each statement through ``execute``; return its result. The work
    is closed (its ``finally`` blocks run) when a statement fails."""
    try:
        statement = next(work)
        while True:
            statement = work.send(execute(statement))
    except StopIteration as stop:
        result: _T = stop.value
        return result
    finally:
        work.close()


# --- the backend protocol ----------------------------------------------------------------------


class Backend(Protocol):
    """Connections and transactions for one database; see the module docstring."""

    name: str
    #: Called with every statement's SQL before it runs (tests and debugging; under SQLite in the
    #: worker thread); None = off.
    on_statement: Callable[[str], None] | None

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def run(self, work: Work[_T], *, write: bool, schema: bool = False) -> _T:
        """Run ``work`` as one transaction and return its result: commits when it returns, rolls
        back when it or a statement raises. ``write`` starts a writing transaction (SQLite: the
        database write lock at once); ``schema`` also takes the migration lock. Raises what the
        work raises, `UniqueViolation` for a constraint failure, `StoreUnavailable` for any
        other database failure."""
        ...


# --- SQLite ------------------------------------------------------------------------------------


def _sqlite_error(exc: sqlite3.Error) -> StoreError:
    if isinstance(exc, sqlite3.IntegrityError) and "UNIQUE" in str(exc):
        return UniqueViolation(str(exc))
    return StoreUnavailable(f"SQLite error: {exc}")


class SqliteBackend:
    """SQLite through one connection in one worker thread. ``path=None``: in memory."""

    name = "sqlite"

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.on_statement: Callable[[str], None] | None = None
        self._conn: sqlite3.Connection | None = None
        self._executor: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"SqliteBackend(path={self.path!r})"

    async def run(self, work: Work[_T], *, write: bool, schema: bool = False) -> _T:
        """See `Backend.run`. The whole transaction is one job of the worker thread; writes take
        SQLite's write lock at once (``BEGIN IMMEDIATE``), which is the migration lock too;
        reads need no transaction.

        Cancelling the caller drops a transaction still queued behind others; one already
        running finishes (commits or rolls back) in the worker, its result discarded.
        """
        executor = self._executor
        if executor is None:
            raise StoreUnavailable("the SQLite store is not open; call `await store.open()` first")
        # Cancelling the awaiting task cancels the job only while it has not started.
        return await asyncio.wrap_future(executor.submit(self._transact, work, write or schema))

    def _transact(self, work: Work[_T], write: bool) -> _T:
        """In the worker thread: ``work`` in a transaction (autocommit when not ``write``);
        sqlite3 errors translated."""
        conn = self._conn
        if conn is None:
            raise StoreUnavailable("the SQLite store is closed")
        on_statement = self.on_statement

        def execute(statement: Statement) -> list[Row]:
            if on_statement is not None:
                on_statement(statement.sql)
            if isinstance(statement, Fetch):
                return conn.execute(statement.sql, statement.params).fetchall()
            conn.executemany(statement.sql, statement.rows)
            return []

        try:
            if not write:
                # Autocommit: each statement sees the latest commit, as under PostgreSQL's READ
                # COMMITTED; the single worker keeps them out of this process's writes.
                return _drive(work, execute)
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = _drive(work, execute)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return result
        except sqlite3.Error as exc:
            raise _sqlite_error(exc) from exc

    def _connect(self) -> None:
        if self.path is None:
            conn = sqlite3.connect(":memory:", isolation_level=None)
        else:
            parent = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(parent, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=SQLITE_BUSY_TIMEOUT)
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            if self.path is not None:
                # Switching a new file to WAL takes an exclusive lock without waiting on the busy
                # timeout, so two processes opening one file at once can see "database is locked":
                # retry for up to the busy timeout.
                deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT
                while True:
                    try:
                        conn.execute("PRAGMA journal_mode = WAL")
                        break
                    except sqlite3.OperationalError as exc:
                        if "locked" not in str(exc) or time.monotonic() > deadline:
                            raise
                        time.sleep(0.02)
                conn.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    async def open(self) -> None:
        """Connect (creating the file and its parent directories)."""
        if self._executor is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loopwarden-sqlite")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._connect)
        except (sqlite3.Error, OSError) as exc:
            self._executor.shutdown(wait=True)
            self._executor = None
            raise StoreUnavailable(f"cannot open SQLite database {self.path or ':memory:'}: {exc}") from exc

    async def close(self) -> None:
        """Close the connection once the transactions already submitted have run, and stop the
        worker; transactions started afterwards raise `StoreUnavailable`."""
        executor, self._executor = self._executor, None
        if executor is None:
            return

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        # Shielded: the connection is closed even when this close is cancelled.
        await asyncio.shield(asyncio.wrap_future(executor.submit(shut)))
        executor.shutdown(wait=True)


# --- PostgreSQL --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _pg_sql(sql: str) -> str:
    """``?`` placeholders to psycopg's ``%s`` (the store's SQL has no ``%`` and no literal ``?``)."""
    if "%" in sql:
        raise ValueError(f"store SQL must not contain '%': {sql!r}")
    return sql.replace("?", "%s")


class PostgresBackend:
    """PostgreSQL through a small psycopg 3 async connection pool.

    ``pool_size``: the most connections this process opens (one is kept open). ``open_timeout``:
    seconds `open` waits for the first connection, and a transaction for a free connection,
    before raising `StoreUnavailable`. Connections are checked before use, so a restarted
    server costs a reconnect, not a failed request.
    """

    name = "postgresql"

    def __init__(self, url: str, *, pool_size: int = 8, open_timeout: float = 10.0) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        self._url = url
        self.pool_size = pool_size
        self.open_timeout = open_timeout
        self.on_statement: Callable[[str], None] | None = None
        self._pool: Any = None

    def __repr__(self) -> str:
        return f"PostgresBackend(url={redact_url(self._url)!r}, pool_size={self.pool_size})"

    async def open(self) -> None:
        """Open the pool and wait for its first connection."""
        if self._pool is not None:
            return
        import psycopg
        from psycopg_pool import AsyncConnectionPool, PoolTimeout

        pool = AsyncConnectionPool(
            self._url,
            min_size=1,
            max_size=self.pool_size,
            open=False,
            kwargs={"autocommit": True},
            check=AsyncConnectionPool.check_connection,
            timeout=self.open_timeout,
            name="loopwarden-store",
        )
        try:
            await pool.open(wait=True, timeout=self.open_timeout)
        except (PoolTimeout, psycopg.Error) as exc:
            await pool.close()
            raise StoreUnavailable(
                f"cannot connect to PostgreSQL at {redact_url(self._url)} within {self.open_timeout:g} s: {exc}"
            ) from exc
        self._pool = pool

    async def close(self) -> None:
        """Close every pooled connection (waits for connections in use to come back)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def run(self, work: Work[_T], *, write: bool, schema: bool = False) -> _T:
        """See `Backend.run`. READ COMMITTED; reads in autocommit (no BEGIN / COMMIT round
        trips); ``schema`` takes the advisory lock."""
        import psycopg
        from psycopg_pool import PoolTimeout

        if self._pool is None:
            raise StoreUnavailable("the PostgreSQL store is not open; call `await store.open()` first")
        try:
            async with self._pool.connection() as conn:
                if not (write or schema):
                    return await self._drive(conn, work)
                async with conn.transaction():
                    if schema:
                        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_KEY,))
                    return await self._drive(conn, work)
        except psycopg.errors.UniqueViolation as exc:
            raise UniqueViolation(str(exc)) from exc
        except psycopg.Error as exc:
            raise StoreUnavailable(f"PostgreSQL error: {exc}") from exc
        except PoolTimeout as exc:
            raise StoreUnavailable(f"no PostgreSQL connection free: {exc}") from exc

    async def _drive(self, conn: Any, work: Work[_T]) -> _T:
        """`_drive`, awaiting each statement on ``conn``."""
        try:
            statement = next(work)
            while True:
                if self.on_statement is not None:
                    self.on_statement(statement.sql)
                rows: list[Row] = []
                if isinstance(statement, Fetch):
                    cur = await conn.execute(_pg_sql(statement.sql), statement.params)
                    if cur.description is not None:
                        rows = await cur.fetchall()
                elif statement.rows:
                    async with conn.cursor() as cur:
                        await cur.executemany(_pg_sql(statement.sql), statement.rows)
                statement = work.send(rows)
        except StopIteration as stop:
            result: _T = stop.value
            return result
        finally:
            work.close()
