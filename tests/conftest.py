"""Fixtures shared by the test folders (pytest finds them here for every file below tests/).

* ``pg_server``: one throwaway PostgreSQL server (`tests.pg.running_postgres`) for the whole
  session, started the first time a test asks for it. Tests isolate themselves with
  ``pg_server.create_schema(...)`` (a fresh schema in well under a millisecond), never by
  restarting the server. Missing binaries FAIL the test (a skipped backend would hide a broken
  store): run ``bash scripts/ensure-postgres.sh``.
* ``upstream``: a fresh scripted model server (`tests.mock_upstream.MockUpstream`) on a loopback
  port per test; queue answers with ``upstream.push(Reply...)``, read ``upstream.requests``.

A file that needs a different scope or a differently built server defines its own fixture of the
same name, which overrides these (tests/e2e/test_fuzz_limits.py keeps a module-scoped upstream for
Hypothesis).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.mock_upstream import MockUpstream
from tests.pg import PgServer, PostgresMissing, running_postgres


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """The session's PostgreSQL server; ``pytest.fail`` (not skip) when it cannot run here."""
    try:
        with running_postgres() as server:
            yield server
    except PostgresMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def upstream() -> Iterator[MockUpstream]:
    """A scripted upstream model server for one test, stopped after it."""
    with MockUpstream() as mock:
        yield mock
