"""loopwarden's gateway: an ASGI app for the OpenAI Responses API, with its public API here.

::

    from middleware import Settings, create_app, load_settings

    app = create_app(load_settings({}))          # flags > LOOPWARDEN_* env > config file > defaults

* `create_app` — the gateway's Starlette app (routes, lifespan, the middleware stack);
* `Settings`, `load_settings`, `SettingsError` — its configuration and the error an invalid value
  or file raises;
* `BudgetMiddleware` — the guard around ``POST /v1/responses`` (intake, supervision, outcomes);
* `ResponsesApp` — the inner app behind the guard (the agent loop or the pass-through);
* `Failure` — the base of every failure the gateway raises (`middleware.errors`).

Each name is imported on first use (PEP 562), so ``import middleware.upstream.sse`` (or any other
submodule) does not pay for Starlette, aiohttp, the MCP SDK and the store; `__all__` is pinned by
tests/unit/test_exported_members.py. The pure budgeting code is the separate package `budget`.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from middleware.app import create_app
    from middleware.asgi.guard import BudgetMiddleware
    from middleware.config import Settings, SettingsError, load_settings
    from middleware.errors import Failure
    from middleware.loop.app import ResponsesApp

__all__ = [
    "BudgetMiddleware",
    "Failure",
    "ResponsesApp",
    "Settings",
    "SettingsError",
    "create_app",
    "load_settings",
]

_HOMES = {
    "BudgetMiddleware": "middleware.asgi.guard",
    "Failure": "middleware.errors",
    "ResponsesApp": "middleware.loop.app",
    "Settings": "middleware.config",
    "SettingsError": "middleware.config",
    "create_app": "middleware.app",
    "load_settings": "middleware.config",
}


def __getattr__(name: str) -> object:
    """Import a public name from its module on first use, then keep it here."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
