"""budget stays pure: importable without middleware, Starlette, httpx or an event loop."""

from __future__ import annotations

import subprocess
import sys


def test_budget_imports_nothing_from_the_asgi_side() -> None:
    code = (
        "import sys, budget\n"
        "from budget import Limits, ChargeModel, Ledger, BudgetExceeded, count_json_nodes, JsonNodeCounter\n"
        "from budget import JsonTooDeep, JsonInvalid, loads_strict\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'middleware', 'starlette', 'httpx', 'asyncio',"
        " 'uvicorn', 'anyio', 'orjson', 'ijson'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


def test_public_api() -> None:
    import budget

    assert set(budget.__all__) >= {
        "Limits",
        "ChargeModel",
        "Ledger",
        "BudgetExceeded",
        "count_json_nodes",
        "JsonNodeCounter",
        "JsonTooDeep",
        "JsonInvalid",
        "loads_strict",
    }
    for name in budget.__all__:
        assert getattr(budget, name) is not None
