"""Retained-bytes budgeting for one request: limits, charge model, ledger, JSON node counting.

Pure and synchronous: no I/O, no event loop, nothing from `middleware`, Starlette or httpx.
See DESIGN.md §3–§4 and the README section "Charge models".

The public API is `__all__` (checked by tests/unit/test_budget_imports.py); the usual imports::

    from budget import Limits, ChargeModel, Ledger, BudgetExceeded, count_json_nodes, JsonNodeCounter
    from budget import loads_strict, JsonInvalid, JsonTooDeep, BudgetError, ChargePool, PoolExhausted
"""

from .errors import (
    BudgetError,
    BudgetExceeded,
    ConfigError,
    JsonInvalid,
    JsonRejected,
    JsonTooDeep,
    Phase,
    PoolExhausted,
)
from .features import JsonFeatures
from .jsonstrict import decode_first, key_total, loads_strict, locate_invalid, msgspec_may_decode
from .ledger import ChargePool, Ledger
from .limits import Limits
from .model import ChargeModel, ParsePrices
from .nodes import DEFAULT_MAX_DEPTH, JsonNodeCounter, count_json_nodes, json_features

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "BudgetError",
    "BudgetExceeded",
    "ChargeModel",
    "ChargePool",
    "ConfigError",
    "JsonFeatures",
    "JsonInvalid",
    "JsonNodeCounter",
    "JsonRejected",
    "JsonTooDeep",
    "Ledger",
    "Limits",
    "ParsePrices",
    "Phase",
    "PoolExhausted",
    "count_json_nodes",
    "decode_first",
    "json_features",
    "key_total",
    "loads_strict",
    "locate_invalid",
    "msgspec_may_decode",
]
