"""Per-request limits (DESIGN.md §3): a small frozen, validated configuration object."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Final

from .errors import ConfigError

__all__ = ["Limits", "upstream_body_clamp"]

MAX_INFER_ITERS_RANGE: Final = (1, 100)
MAX_RETAINED_BYTES_RANGE: Final = (4096, 268_435_456)


def _check_int(field: str, value: object, low: int, high: int) -> None:
    allowed = f"{low}..={high}"
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(field, value, allowed, f"{field} must be an int in {allowed}, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(field, value, allowed)


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """The limits one request runs under.

    * ``max_infer_iters`` — inference calls per client request, ``1..=100`` (default 10). A model
      that still asks for gateway tools after the last one gets HTTP 508.
    * ``max_retained_bytes`` — the request ledger's limit in budget bytes,
      ``4096..=268435456`` (default 67108864, 64 MiB). It cannot be disabled.

    Out-of-range or non-int values raise `ConfigError` (a `ValueError`) naming the field, the
    range and the value, e.g. ``max_retained_bytes must be in 4096..=268435456, got 4095``.
    When several limits apply (server default, per-model override, client headers, a nested
    loop) the smallest wins: `Limits.smallest`.
    """

    max_infer_iters: int = 10
    max_retained_bytes: int = 67_108_864

    def __post_init__(self) -> None:
        _check_int("max_infer_iters", self.max_infer_iters, *MAX_INFER_ITERS_RANGE)
        _check_int("max_retained_bytes", self.max_retained_bytes, *MAX_RETAINED_BYTES_RANGE)

    @classmethod
    def smallest(cls, *limits: Limits) -> Limits:
        """Field-wise minimum of one or more `Limits` (the strictest of each). Raises
        `ValueError` when called with none, `TypeError` for anything that is not a `Limits`."""
        if not limits:
            raise ValueError("Limits.smallest() needs at least one Limits")
        for item in limits:
            if not isinstance(item, Limits):
                raise TypeError(f"Limits.smallest() takes Limits, got {type(item).__name__}")
        return cls(**{f.name: min(getattr(item, f.name) for item in limits) for f in fields(cls)})

    @property
    def request_body_clamp(self) -> int:
        """The reference charge model's raw body clamp, in bytes: ``max_retained_bytes // 32``
        (DESIGN.md §3). The gateway reads up to its configured model's clamp instead,
        `budget.ChargeModel.body_clamp` (``limit * 2 // 3`` for the measured default)."""
        return self.max_retained_bytes // 32

    @property
    def upstream_body_clamp(self) -> int:
        """Largest buffered upstream body read, in bytes: `upstream_body_clamp` of the limit."""
        return upstream_body_clamp(self.max_retained_bytes)


def upstream_body_clamp(max_retained_bytes: int) -> int:
    """The reference charge model's buffered upstream clamp for a ledger of `max_retained_bytes`,
    in bytes: ``max_retained_bytes // 8`` (DESIGN.md §3). The gateway's reader takes its ledger's
    model's clamp, `budget.ChargeModel.upstream_clamp`."""
    return max_retained_bytes // 8
