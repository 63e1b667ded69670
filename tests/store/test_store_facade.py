"""`middleware.store` is a facade: its ``__all__`` is pinned, each name is the object its module
defines, and importing it (or `middleware.outcomes`, which maps `StoreUnavailable`) in any order
creates no import cycle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import middleware.store
from middleware.store import backends, history, routes, store

EXPECTED = {
    "CONTINUABLE_STATUSES": store,
    "RESPONSE_STATUSES": store,
    "SECRET_TOOL_FIELDS": store,
    "ChainInfo": store,
    "ConversationNotFound": backends,
    "DuplicateId": backends,
    "Page": store,
    "Restored": history,
    "SchemaTooNew": backends,
    "Store": store,
    "StoreError": backends,
    "StoreUnavailable": backends,
    "StoredResponse": store,
    "UnknownCursor": backends,
    "open_store": store,
    "restore_history": history,
    "store_routes": routes,
}


def test_the_exported_names_are_pinned() -> None:
    assert sorted(middleware.store.__all__) == sorted(EXPECTED)
    for name, module in EXPECTED.items():
        assert getattr(middleware.store, name) is getattr(module, name), name


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = middleware.store.nope


@pytest.mark.parametrize(
    "first",
    ["middleware.store", "middleware.outcomes", "middleware.store.routes", "middleware.store.backends"],
)
def test_no_import_cycle_whatever_is_imported_first(first: str) -> None:
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({first!r})\n"
        "from middleware.store import *\n"
        "from middleware.store import store_routes\n"
        "from middleware import outcomes\n"
        "assert outcomes.row_of(StoreUnavailable('x')) == 'store_unavailable'\n"
        "assert callable(store_routes)\n"
    )
    if first == "middleware.store":
        code = "import middleware.store, sys\nassert 'middleware.outcomes' not in sys.modules\n" + code
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
