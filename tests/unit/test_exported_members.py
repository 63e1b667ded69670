"""`middleware`'s public API is exactly its `__all__` (as httpx's tests/test_exported_members.py)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

import middleware

EXPECTED = {
    "BudgetMiddleware",
    "Failure",
    "ResponsesApp",
    "Settings",
    "SettingsError",
    "create_app",
    "load_settings",
}


def test_all_is_the_stated_api_sorted() -> None:
    assert set(middleware.__all__) == EXPECTED
    assert middleware.__all__ == sorted(middleware.__all__)


def test_public_names_are_exactly_all() -> None:
    """Every public, non-module name the package shows is in `__all__`, and the reverse."""
    shown = {
        name
        for name in dir(middleware)
        if not name.startswith("_") and not isinstance(getattr(middleware, name, None), types.ModuleType)
    }
    assert shown == set(middleware.__all__)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_name_resolves_from_its_home_and_has_a_docstring(name: str) -> None:
    value = getattr(middleware, name)
    home = sys.modules[value.__module__]
    assert getattr(home, name) is value
    assert home.__name__.startswith("middleware.")
    doc = inspect.getdoc(value)
    assert doc and doc.strip(), f"middleware.{name} has no docstring"


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        middleware.nope  # noqa: B018


def test_importing_the_package_or_a_submodule_does_not_import_the_app() -> None:
    """The names are lazy (PEP 562): a submodule import pays for that submodule only."""
    code = (
        "import sys, middleware, middleware.upstream.sse\n"
        "heavy = [m for m in ('middleware.app', 'middleware.asgi.guard', 'middleware.loop.app', 'starlette')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from middleware import Settings\n"
        "assert 'middleware.app' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
