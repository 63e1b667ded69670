"""Model routing (issue 10): configured model names or patterns -> their upstream and limits.

The config file's ``models:`` mapping names each model (an exact name, or an ``fnmatch`` pattern
such as ``gpt-*``) with its own ``upstream`` base URL, ``upstream_api_key``, timeouts and limits::

    models:
      gpt-4o: {upstream: "https://api.openai.com/v1", upstream_api_key: "...", max_infer_iters: 5}
      "qwen*": {upstream: "http://127.0.0.1:8000/v1", max_retained_bytes: 33554432}
      dev: {}                       # the default --upstream, default limits

Exact names win over patterns; patterns are tried in file order. When any model is configured, a
request for another model is a 404 ``model_not_found`` before any upstream call, and the metric
``model`` label is the matching configured name (``other`` otherwise, DESIGN.md §8). A model's
limits combine with the server's and the client's: the smallest wins.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping
from typing import Any

from budget import Limits
from middleware.errors import choices_text
from middleware.upstream.chat.dialect import DIALECT_CHOICES

ROUTE_FIELDS = frozenset(
    {
        "upstream",
        "upstream_api_key",
        "upstream_connect_timeout",
        "upstream_read_timeout",
        "upstream_deadline",
        "max_retained_bytes",
        "max_infer_iters",
        "charge_model",
        "upstream_compact",
        "compact_max_output_tokens",
        # chat: new settings
        "upstream_api",
        "reasoning_dialect",
        "reasoning_replay",
        "max_tokens_field",
        "tool_call_profile",
        "developer_role",
    }
)


class ModelConfigError(ValueError):
    """An invalid ``models:`` entry; the message names the model and the field."""


#: ``upstream_compact upstream`` on a Chat upstream (refused at start-up, README "Compaction").
COMPACT_NEEDS_RESPONSES = "upstream_compact upstream needs upstream_api responses; use auto or gateway"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelRoute:
    """One configured model: ``name`` (exact or pattern), its upstream overrides (None: the
    server's), and its `Limits` (None: the server's). Timeouts in seconds."""

    name: str
    upstream: str | None = None
    upstream_api_key: str | None = dataclasses.field(default=None, repr=False)
    upstream_connect_timeout: float | None = None
    upstream_read_timeout: float | None = None
    upstream_deadline: float | None = None
    max_retained_bytes: int | None = None
    max_infer_iters: int | None = None
    charge_model: str | None = None
    upstream_compact: str | None = None
    compact_max_output_tokens: int | None = None
    # chat: new settings (None: the server's)
    upstream_api: str | None = None
    reasoning_dialect: str | None = None
    reasoning_replay: str | None = None
    max_tokens_field: str | None = None
    tool_call_profile: str | None = None
    developer_role: str | None = None

    @property
    def is_pattern(self) -> bool:
        """True for an ``fnmatch`` pattern (``*``, ``?``, ``[``)."""
        return any(c in self.name for c in "*?[")

    def api(self, server: str) -> str:
        """What this model's upstream speaks: its ``upstream_api``, else `server` (the
        server-wide ``upstream_api``: ``responses`` or ``chat``)."""
        return self.upstream_api or server

    def limits(self, server: Limits) -> Limits:
        """The server's limits lowered by this model's."""
        return Limits.smallest(
            server,
            Limits(
                max_retained_bytes=self.max_retained_bytes or server.max_retained_bytes,
                max_infer_iters=self.max_infer_iters or server.max_infer_iters,
            ),
        )


#: The fields of a route whose value is one of a few strings (the server-wide settings' choices).
CHOICE_FIELDS: dict[str, tuple[str, ...]] = {
    "charge_model": ("measured", "reference"),
    "upstream_compact": ("auto", "upstream", "gateway"),
    "upstream_api": ("responses", "chat"),
    **DIALECT_CHOICES,
}


def route_keys() -> list[str]:
    """Every ``models:`` entry key (`ROUTE_FIELDS`), in `ModelRoute` field order: what the
    README configuration table and the unknown-key message list."""
    return [f.name for f in dataclasses.fields(ModelRoute) if f.name in ROUTE_FIELDS]


def _integer(value: Any) -> bool:
    """An int that is not a bool (YAML's ``true`` is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    """A finite int or float that is not a bool (``.inf`` and ``true`` are not seconds)."""
    return _integer(value) or (isinstance(value, float) and math.isfinite(value))


def parse_models(raw: Mapping[str, Any]) -> tuple[ModelRoute, ...]:
    """Validate a ``models:`` mapping into routes (file order kept); entry keys may use dashes
    or underscores (``upstream-api`` is ``upstream_api``), like the file's top-level keys.
    Raises ModelConfigError naming the model and the field."""
    routes = []
    for name, entry in raw.items():
        if not isinstance(name, str) or not name:
            raise ModelConfigError(f"models: every key must be a model name, got {name!r}")
        entry = entry or {}
        if not isinstance(entry, Mapping):
            raise ModelConfigError(f"models.{name} must be a mapping of settings, got {type(entry).__name__}")
        entry = {str(key).replace("-", "_"): value for key, value in entry.items()}  # dashes too
        unknown = set(entry) - ROUTE_FIELDS
        if unknown:
            raise ModelConfigError(
                f"models.{name}: unknown setting(s) {sorted(unknown)}; known: {', '.join(route_keys())}"
            )
        upstream = entry.get("upstream")
        if upstream is not None and not str(upstream).startswith(("http://", "https://")):
            raise ModelConfigError(f"models.{name}.upstream must be an http(s):// URL, got {upstream!r}")
        route = ModelRoute(name=name, **dict(entry))
        try:
            Limits(  # 0 is out of range, not "the server's": only a missing key is
                max_retained_bytes=67_108_864
                if route.max_retained_bytes is None
                else route.max_retained_bytes,
                max_infer_iters=10 if route.max_infer_iters is None else route.max_infer_iters,
            )
        except ValueError as exc:
            raise ModelConfigError(f"models.{name}: {exc}") from None
        for field, choices in CHOICE_FIELDS.items():
            if getattr(route, field) not in (None, *choices):
                raise ModelConfigError(
                    f"models.{name}.{field} must be {choices_text(choices)}, got {getattr(route, field)!r}"
                )
        if route.upstream_compact == "upstream" and route.upstream_api == "chat":
            raise ModelConfigError(f"models.{name}: {COMPACT_NEEDS_RESPONSES}")
        tokens = route.compact_max_output_tokens
        if tokens is not None and not (_integer(tokens) and 1 <= tokens <= 131_072):
            raise ModelConfigError(
                f"models.{name}.compact_max_output_tokens must be in 1..=131072, got {tokens!r}"
            )
        for field in ("upstream_connect_timeout", "upstream_read_timeout", "upstream_deadline"):
            value = getattr(route, field)
            if value is not None and not (_number(value) and value > 0):
                raise ModelConfigError(
                    f"models.{name}.{field} must be a positive number of seconds, got {value!r}"
                )
        routes.append(route)
    return tuple(routes)


class ModelRouter:
    """Matches a request's ``model`` to its `ModelRoute`."""

    def __init__(self, routes: tuple[ModelRoute, ...]) -> None:
        self.routes = routes
        self._exact = {r.name: r for r in routes if not r.is_pattern}
        self._patterns = [r for r in routes if r.is_pattern]

    @property
    def configured(self) -> bool:
        """True when any model is configured (unknown models are then refused)."""
        return bool(self.routes)

    @property
    def labels(self) -> frozenset[str]:
        """The bounded values of the metric ``model`` label (besides ``other``)."""
        return frozenset(r.name for r in self.routes)

    def match(self, model: str) -> ModelRoute | None:
        """The route for `model`: the exact name, else the first matching pattern, else None."""
        route = self._exact.get(model)
        if route is not None:
            return route
        for pattern in self._patterns:
            if fnmatch.fnmatchcase(model, pattern.name):
                return pattern
        return None
