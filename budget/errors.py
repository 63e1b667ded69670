"""The errors `budget` raises on purpose, as one documented tree.

```
BudgetError                      base: everything below, nothing else
├── ConfigError (ValueError)     a `Limits` / `ChargeModel` / `Ledger` setting out of range
├── BudgetExceeded               a ledger charge would pass `max_retained_bytes`
├── PoolExhausted                the process-wide pool behind a ledger refused a charge
└── JsonRejected                 a client JSON payload is refused; carries `code` and `param`
    ├── JsonTooDeep              nesting over the depth cap (code ``json_too_deep``)
    └── JsonInvalid              syntax, duplicate key, bad Unicode, bad number
```

Each class carries structured fields so the outcome authority in `middleware` can map
(exception, phase, committed?) to exactly one HTTP status or SSE error frame and one error `code`
(DESIGN.md §5) without parsing messages. Messages say what overflowed or what is wrong, by how
much, and which setting or input to change.

Misuse of the API itself (a negative size, releasing more than was charged, a wrong type) raises
plain `ValueError` / `TypeError`: those are bugs in the caller, not outcomes.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "PHASES",
    "BudgetError",
    "BudgetExceeded",
    "ConfigError",
    "JsonInvalid",
    "JsonInvalidCode",
    "JsonRejected",
    "JsonTooDeep",
    "Phase",
    "PoolExhausted",
]

Phase = Literal[
    "input",
    "output",
    "stream",
    "stream_frame",
    "accumulated",
    "terminal",
    "tool_result",
    "history",
    "reserve",
    "limit",
]
"""Which ledger owner a charge belongs to; see `BudgetExceeded.phase`."""

PHASES: Final[tuple[Phase, ...]] = (
    "input",
    "output",
    "stream",
    "stream_frame",
    "accumulated",
    "terminal",
    "tool_result",
    "history",
    "reserve",
    "limit",
)

# What each phase charges for, and what a user or operator can do about an overflow in it.
_WHAT: Final[dict[Phase, str]] = {
    "input": "the request body",
    "output": "a buffered upstream response body",
    "stream": "streamed upstream bytes waiting in the SSE parser",
    "stream_frame": "parsing one streamed SSE frame (transient)",
    "accumulated": "streamed output kept by the accumulator",
    "terminal": "encoding the final response",
    "tool_result": "a gateway tool result",
    "history": "restored conversation history",
    "reserve": "a reservation",
    "limit": "lowering the ledger limit",
}
_ADVICE: Final[dict[Phase, str]] = {
    "input": "raise max_retained_bytes or send a smaller request body",
    "output": "raise max_retained_bytes or ask for less output (max_output_tokens, fewer tools echoed)",
    "stream": "raise max_retained_bytes or have the upstream send smaller SSE frames",
    "stream_frame": "raise max_retained_bytes or have the upstream send smaller SSE frames",
    "accumulated": "raise max_retained_bytes or ask for less output (max_output_tokens)",
    "terminal": "raise max_retained_bytes or ask for less output (max_output_tokens)",
    "tool_result": "raise max_retained_bytes or make the tool return less",
    "history": "raise max_retained_bytes or continue from a shorter history",
    "reserve": "raise max_retained_bytes",
    "limit": "raise the lower limit or send a smaller request body",
}


class BudgetError(Exception):
    """Base of every error `budget` raises on purpose (see the module docstring for the tree)."""


class ConfigError(BudgetError, ValueError):
    """A configuration value is outside its allowed range (or of the wrong type).

    Fields: ``field`` (the setting's name), ``value`` (what was given), ``allowed`` (the range as
    text, e.g. ``"4096..=268435456"``). The message names all three, e.g.
    ``max_retained_bytes must be in 4096..=268435456, got 4095`` (DESIGN.md §3). It is also a
    `ValueError`, so start-up code that catches `ValueError` keeps working.
    """

    def __init__(self, field: str, value: object, allowed: str, message: str | None = None) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        if message is None:
            message = f"{field} must be in {allowed}, got {value!r}"
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.field, self.value, self.allowed, str(self)))


def _b(n: int) -> str:
    """Format a byte count for messages: exact, with thousands separators."""
    return f"{n:,}"


class BudgetExceeded(BudgetError):
    """A charge would take the ledger past its limit; the ledger is unchanged.

    Fields, all ints in budget bytes except ``phase``:

    * ``phase`` — which owner asked (`Phase`): ``input``, ``output``, ``stream``,
      ``stream_frame`` (transient), ``accumulated``, ``terminal``, ``tool_result``, ``history``,
      ``reserve`` or ``limit`` (lowering the limit below what is already charged);
    * ``requested`` — what had to fit on top of ``charged`` (for a stream chunk: the retained
      charge plus its transient peak; for ``limit``: 0);
    * ``charged`` — what the ledger held when the charge was refused;
    * ``limit`` — the ledger's limit (``max_retained_bytes`` or a lowered value);
    * ``over`` — ``charged + requested - limit``, how far past the limit the charge would go.

    ``str()`` says what overflowed, by how many bytes, and which setting to change.
    """

    def __init__(self, phase: Phase, requested: int, charged: int, limit: int) -> None:
        self.phase: Phase = phase
        self.requested = requested
        self.charged = charged
        self.limit = limit
        super().__init__(self._message())

    @property
    def over(self) -> int:
        """How many budget bytes past the limit the refused charge would have gone."""
        return self.charged + self.requested - self.limit

    def _message(self) -> str:
        what = _WHAT.get(self.phase, self.phase)
        advice = _ADVICE.get(self.phase, "raise max_retained_bytes")
        if self.phase == "limit":
            return (
                f"max_retained_bytes exceeded by {what}: {_b(self.charged)} bytes are already charged, "
                f"{_b(self.over)} bytes over the new limit of {_b(self.limit)}; {advice}"
            )
        remaining = max(self.limit - self.charged, 0)
        return (
            f"max_retained_bytes exceeded by {what} ({self.phase}): it needs {_b(self.requested)} bytes "
            f"but only {_b(remaining)} of {_b(self.limit)} remain ({_b(self.over)} bytes over); {advice}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.phase, self.requested, self.charged, self.limit))


class PoolExhausted(BudgetError):
    """The process-wide pool attached to a ledger refused a charge the ledger itself would allow.

    Fields: ``phase`` (`Phase`) and ``requested`` (budget bytes). The ledger is unchanged. The
    gateway answers this with 503 ``server_overloaded`` before the body is read, or with the
    §5 row for the phase later on; the fix is capacity (a larger pool or fewer concurrent
    requests), not the request.
    """

    def __init__(self, phase: Phase, requested: int) -> None:
        self.phase: Phase = phase
        self.requested = requested
        super().__init__(
            f"the process-wide retained-bytes pool cannot supply {_b(requested)} bytes for "
            f"{_WHAT.get(phase, phase)} ({phase}); retry later, or give the process a larger pool"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.phase, self.requested))


JsonInvalidCode = Literal["invalid_json", "duplicate_key", "invalid_unicode", "invalid_number"]


class JsonRejected(BudgetError):
    """A client JSON payload is refused (HTTP 400 before a stream commits).

    Fields: ``code`` (the OpenAI-envelope error code), ``param`` (the JSON path of the offending
    member, like ``input[0].role``, or ``None`` when the problem has no single place) and
    ``message`` (also ``str()``).
    """

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        self.code = code
        self.param = param
        self.message = message
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.code, self.message, self.param))


class JsonTooDeep(JsonRejected):
    """JSON nesting went past the depth cap (code ``json_too_deep``, ``param`` ``None``).

    Fields: ``depth`` — the first nesting level over the cap that was reached (``max_depth + 1``
    when raised by `JsonNodeCounter`; the deepest level seen when raised by `loads_strict` after
    the interpreter's own recursion limit), and ``max_depth`` — the cap.
    """

    def __init__(self, depth: int, max_depth: int) -> None:
        self.depth = depth
        self.max_depth = max_depth
        super().__init__(
            "json_too_deep",
            f"JSON nesting reaches depth {depth}, over the cap of {max_depth} levels; "
            f"send a payload nested at most {max_depth} levels deep",
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.depth, self.max_depth))


class JsonInvalid(JsonRejected):
    """A payload is not acceptable JSON; ``code`` says why.

    * ``invalid_json`` — a syntax error; the message gives line and column;
    * ``duplicate_key`` — an object repeats a key (compared after unescaping); ``param`` is the
      path of the repeated key, e.g. ``input[0].role``;
    * ``invalid_unicode`` — bytes that are not UTF-8, or a lone UTF-16 surrogate escape such as
      ``"\\ud83d"``; ``param`` is the path of the string when known;
    * ``invalid_number`` — ``NaN``, ``Infinity``, ``-Infinity``, a number that overflows a double,
      or an integer longer than the interpreter converts.
    """

    def __init__(self, code: JsonInvalidCode, message: str, param: str | None = None) -> None:
        super().__init__(code, message, param)
        self.code: JsonInvalidCode = code
