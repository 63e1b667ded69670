"""A throwaway PostgreSQL server on loopback for the store tests.

`running_postgres()` initialises a cluster in a fresh temporary directory, starts it on
127.0.0.1 at a free port (its unix socket inside that directory, never /var/run/postgresql),
creates a database and yields a `PgServer` whose ``url`` is
``postgresql://postgres@127.0.0.1:PORT/DB`` (trust authentication, loopback only). On exit the
server is stopped (``-m immediate``: nothing in it is worth a clean shutdown) and the directory
removed.

PostgreSQL refuses to run as root, so when the tests run as root the cluster directory is
handed to the ``postgres`` system user and ``initdb``/``pg_ctl`` run through ``runuser -u
postgres --`` (``su postgres -c`` where runuser is missing). As any other user they run as that
user.

Speed: ``initdb --no-sync`` and ``fsync=off``, ``synchronous_commit=off``,
``full_page_writes=off``, small ``shared_buffers``: durability is worthless here, start-up
time is not.

When the server binaries are missing this raises `PostgresMissing` (tests must FAIL, not skip:
a skipped backend would hide a broken store); run ``bash scripts/ensure-postgres.sh`` (``make
test`` does) to install Debian's ``postgresql`` package.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg

__all__ = ["PgServer", "PostgresMissing", "find_pg_bindir", "running_postgres"]

_HINT = "run `bash scripts/ensure-postgres.sh` (as root; `make test` runs it) to install Debian's postgresql package"


class PostgresMissing(RuntimeError):
    """The PostgreSQL server binaries (initdb, pg_ctl) are not installed, or cannot run here."""


def _version_key(path: str) -> tuple[int, ...]:
    version = os.path.basename(os.path.dirname(os.path.dirname(path)))
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def find_pg_bindir() -> str:
    """The directory holding ``initdb`` and ``pg_ctl``: the newest ``/usr/lib/postgresql/<ver>/bin``
    (where Debian installs them, off PATH), else the one on PATH. Raises `PostgresMissing`."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    for initdb in reversed(candidates):
        bindir = os.path.dirname(initdb)
        if os.access(initdb, os.X_OK) and os.access(os.path.join(bindir, "pg_ctl"), os.X_OK):
            return bindir
    initdb_on_path = shutil.which("initdb")
    if initdb_on_path and shutil.which("pg_ctl"):
        return os.path.dirname(os.path.realpath(initdb_on_path))
    raise PostgresMissing(
        "PostgreSQL server binaries (initdb, pg_ctl) were not found under /usr/lib/postgresql/*/bin "
        f"nor on PATH; {_HINT}"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class PgServer:
    """A running throwaway server. ``url`` names the database created at start-up."""

    host: str
    port: int
    database: str
    directory: str

    @property
    def url(self) -> str:
        """``postgresql://postgres@HOST:PORT/DATABASE``."""
        return self.url_for(self.database)

    def url_for(self, database: str) -> str:
        """The URL of another database on this server."""
        return f"postgresql://postgres@{self.host}:{self.port}/{database}"

    def create_schema(self, name: str) -> str:
        """``CREATE SCHEMA name`` in the database; a URL whose connections use only that schema
        (``options=-csearch_path=name``). A fresh, isolated namespace in well under a millisecond,
        where ``CREATE DATABASE`` takes a few hundred."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return f"{self.url}?options=-csearch_path%3D{name}"

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name`` (from template0, no WAL-logged copy of a big template); its URL."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.url_for(name)


def _runner() -> list[str]:
    """The command prefix that runs a program as a user PostgreSQL accepts."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresMissing(f"running as root but there is no 'postgres' system user; {_HINT}") from None
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", "postgres", "--"]
    return ["su", "postgres", "-s", "/bin/sh", "-c"]


def _run(prefix: list[str], argv: list[str], *, timeout: float = 60.0) -> None:
    cmd = [*prefix, shlex.join(argv)] if prefix[:1] == ["su"] else [*prefix, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(argv)} failed with exit status {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        )


@contextlib.contextmanager
def running_postgres(database: str = "loopwarden_test") -> Iterator[PgServer]:
    """Start a throwaway PostgreSQL server; yield it; stop it and remove its files.

    Raises `PostgresMissing` (with the fix) when the binaries are not installed and
    RuntimeError (with the server log) when the server does not start.
    """
    bindir = find_pg_bindir()
    prefix = _runner()
    directory = tempfile.mkdtemp(prefix="loopwarden-pg-")
    data = os.path.join(directory, "data")
    log = os.path.join(directory, "server.log")
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(directory, entry.pw_uid, entry.pw_gid)
    started = False
    try:
        _run(
            prefix,
            [
                os.path.join(bindir, "initdb"),
                "-D",
                data,
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ],
        )
        port = _free_port()
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(port),
            "unix_socket_directories": f"'{directory}'",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "16MB",
            "max_connections": "60",
            "logging_collector": "off",
        }
        conf = "".join(f"{key} = {value}\n" for key, value in settings.items())
        # Append as the directory's owner would: the file belongs to postgres, root may write it.
        with open(os.path.join(data, "postgresql.conf"), "a", encoding="utf-8") as fh:
            fh.write(conf)
        pg_ctl = os.path.join(bindir, "pg_ctl")
        try:
            _run(prefix, [pg_ctl, "-D", data, "-l", log, "-w", "-t", "30", "start"])
        except RuntimeError as exc:
            with contextlib.suppress(OSError), open(log, encoding="utf-8", errors="replace") as fh:
                raise RuntimeError(f"{exc}\nserver log:\n{fh.read()}") from None
            raise
        started = True
        server = PgServer("127.0.0.1", port, database, directory)
        deadline = time.monotonic() + 10
        while True:
            try:
                with psycopg.connect(server.url_for("postgres"), autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{database}" TEMPLATE template0')
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield server
    finally:
        if started:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _run(prefix, [os.path.join(bindir, "pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop"])
        shutil.rmtree(directory, ignore_errors=True)
