"""Running one round's gateway-owned tool calls (DESIGN.md §6 "Execution").

`run_tool_calls` takes the round's gateway-owned ``function_call`` output items and returns one
`ToolOutcome` per call, in the same order. Policy:

* **Window.** At most ``concurrency`` calls are in flight; calls start in output order and a new one
  starts as soon as any finishes (a sliding window, not batches).
* **Arguments.** ``arguments`` is parsed with ``json.loads``; ``""``, ``null`` or a missing field mean
  ``{}`` (CASES.md B07 b). Text that is not JSON (including NaN / Infinity and repeated keys), or JSON
  that is not an object, is *not* run: outcome ``invalid_arguments`` (B06 b).
* **Timeout.** Each call has ``timeout`` seconds from the moment it gets its window slot, including
  any wait for its server's session; then its MCP request is cancelled (the server sees the
  cancellation) and the output is ``<error: tool timed out after Ns>`` (B16). Counted as a cap hit
  ``loopwarden_cap_hits_total{limit="tool_timeout",outcome="tool_error"}``.
* **Result.** The ``CallToolResult`` as text (`middleware.tools.text.result_text`); lone surrogates
  replaced by U+FFFD first (B21 e); ``isError`` results keep the tool's text with outcome ``error``.
* **Cap, then charge.** A result whose UTF-8 encoding is over ``max_result_bytes`` becomes an error
  output (outcome ``too_large``) and is not charged. Every other tool result is charged with
  ``ledger.admit_tool_result(output bytes)`` before it is kept. The ledger's exception (a
  ``BudgetExceeded``, or ``PoolExhausted``) is the one failure that escapes: the other calls in
  flight are cancelled first, then it propagates out of `run_tool_calls` (B19).
* **Failures** — unknown tool, server unreachable, MCP protocol error, any exception — become
  outcome ``error`` with an ``<error: …>`` text for the model. Every call gets exactly one outcome.
* **Retry.** A call is sent again, once, on a new session only when the first attempt is proven
  not to have run (`middleware.tools.session.call_not_run`: the request never left the gateway, or
  the server answered 404 for a session it no longer knows, as after a restart). Any other failure
  is reported: a tool call may have side effects and must not run twice.
* **Denials.** A call the client denied is never run: `refuse_tool_call` is the one place that
  builds its outcome (``refused``, ``<the user denied this tool call…>``).

Gateway-made error texts are short (at most about 700 bytes: messages are truncated) and are not
charged; only what a tool returned is. Metrics: ``loopwarden_tool_calls_total{outcome}`` +1 for
every returned `ToolOutcome` (denials included) and ``loopwarden_tool_call_duration_seconds``
observed for every call that was run; calls cut short by a ledger overflow or by cancellation return
no outcome and are not counted.

**Sessions.** Each call leases a session from the catalog's `middleware.tools.pool.SessionPool`
(``resolved.pool``): an open session to its server (same URL, command or in-process server, same
header values) is reused across calls, rounds and requests, and shared by concurrent calls; one is
opened when none is free (within the catalog's ``connect_timeout``). A session on which a call is
cancelled or times out, or fails in a way that may have broken it, leaves the pool and is closed once
its other calls end. Without a pool (a `ResolvedTools` made by hand) the invocation uses a pool of
its own, closed before it returns.

**Cancellation.** Cancelling the task awaiting `run_tool_calls` (client disconnect) cancels every
running call — each MCP request is abandoned and the server's handler cancelled, and its session
is discarded from the pool — and re-raises the cancellation (CASES.md B14 b).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import anyio
import mcp

from middleware.ops.metrics import TOOL_CALLS, TOOL_DURATION, cap_hit
from middleware.tools.pool import SessionPool, SessionUnavailable
from middleware.tools.resolved import ResolvedTools
from middleware.tools.session import ANSWER_TOO_LARGE, call_not_run, session_failed
from middleware.tools.text import describe_exception, result_text, scrub_text

__all__ = ["Outcome", "ToolLedger", "ToolOutcome", "refuse_tool_call", "run_tool_calls"]

log = logging.getLogger("loopwarden.tools")

Outcome = Literal["ok", "error", "timeout", "invalid_arguments", "too_large", "refused"]
"""The ``loopwarden_tool_calls_total`` ``outcome`` label of one call."""

INVALID_JSON_TEXT: Final = "<error: arguments are not valid JSON>"
# One MCP message (SSE event or JSON body) answering a call may be this many times the per-call cap,
# plus 1 MiB, before the transport refuses it: JSON escaping and the structuredContent copy that
# MCPServer adds inflate text. Past it the call fails as "error" (the answer is never held whole).
MESSAGE_FACTOR: Final = 4


class ToolLedger(Protocol):
    """The part of `budget.Ledger` the tool layer uses.

    ``admit_tool_result(raw)`` charges a tool result of ``raw`` (UTF-8 bytes) and returns the charge
    in budget bytes, or raises (``BudgetExceeded``) leaving the ledger unchanged.
    """

    def admit_tool_result(self, raw: bytes) -> int:
        """Charge `raw` (UTF-8 bytes); the charge in budget bytes. Raises if it does not fit."""
        ...


@dataclass
class ToolOutcome:
    """The result of one gateway-owned call.

    * ``call_id`` — the ``function_call``'s ``call_id``;
    * ``output`` — what the model is fed back as the ``function_call_output`` (the tool's text, or an
      ``<error: …>`` text);
    * ``error`` — None when the call succeeded; else the error text (the same as ``output``), for
      the ``mcp_call`` item's ``error``;
    * ``outcome`` — the metric label (`Outcome`);
    * ``charge`` — budget bytes charged to the ledger for ``output`` (0 when not charged);
    * ``duration`` — seconds from the call's start (its window slot) to its outcome.
    """

    call_id: str
    output: str
    error: str | None
    outcome: Outcome
    charge: int = 0
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the tool ran and returned a result that is not an error."""
        return self.error is None


def refuse_tool_call(call: Mapping[str, Any], reason: str | None = None) -> ToolOutcome:
    """The outcome of a call the client denied (``mcp_approval_response`` with ``approve: false``).

    The call is not run. ``output`` — the ``function_call_output`` the model is fed — is exactly
    ``<the user denied this tool call>``, or ``<the user denied this tool call: REASON>`` when
    `reason` (the client's ``reason``) is a non-empty string (anything else is left out; lone
    surrogates in it become U+FFFD). Outcome ``refused``, ``error`` the same text, ``charge`` and
    ``duration`` 0 (nothing ran). Counts ``loopwarden_tool_calls_total{outcome="refused"}`` once
    per call, and nothing in the duration histogram. Raises nothing.
    """
    shown = f": {scrub_text(reason)}" if isinstance(reason, str) and reason else ""
    text = f"<the user denied this tool call{shown}>"
    TOOL_CALLS.labels(outcome="refused").inc()
    return ToolOutcome(call_id=str(call.get("call_id")), output=text, error=text, outcome="refused")


class _LedgerRefused(Exception):
    """Carries the ledger's exception out of a worker (the one whole-request failure)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _ServerUnavailable(Exception):
    def __init__(self, label: str, failure: SessionUnavailable) -> None:
        detail = str(failure) if failure.cause is None else describe_exception(failure.cause)
        super().__init__(f"MCP server {label!r} is unavailable ({detail})")


def _no_constants(value: str) -> Any:
    raise ValueError(f"{value} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def parse_arguments(arguments: object) -> dict[str, Any] | str:
    """A call's ``arguments`` as a dict, or the ``<error: …>`` text if they cannot be used.

    ``""``, None (``null`` or missing) -> ``{}``; an already decoded dict is used as is.
    """
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        return INVALID_JSON_TEXT
    try:
        value = json.loads(arguments, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, ValueError) and "appears twice" in str(exc):
            return f"<error: arguments are not valid JSON: {scrub_text(str(exc))[:200]}>"
        return INVALID_JSON_TEXT
    if value is None:
        return {}
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")
        return f"<error: arguments must be a JSON object, got {kind}>"
    return value


class _Runner:
    """Per-invocation state of `run_tool_calls`."""

    def __init__(
        self,
        resolved: ResolvedTools,
        pool: SessionPool,
        ledger: ToolLedger,
        *,
        timeout: float,
        max_result_bytes: int,
    ) -> None:
        self.resolved = resolved
        self.pool = pool
        self.ledger = ledger
        self.timeout = timeout
        self.max_result_bytes = max_result_bytes
        self.max_message = MESSAGE_FACTOR * max_result_bytes + 1024 * 1024

    async def call(self, label: str, name: str, args: dict[str, Any]) -> mcp.types.CallToolResult:
        """``tools/call`` `name` on server `label` through a pooled session, sent again once on a
        new session if the first attempt provably did not run. Raises `_ServerUnavailable` when no
        session can be opened, else what the call raised."""
        endpoint = self.resolved.endpoint(label)
        for attempt in range(2):
            try:
                lease = await self.pool.acquire(
                    endpoint, max_message_bytes=self.max_message, fresh=attempt > 0
                )
            except SessionUnavailable as exc:
                unavailable = _ServerUnavailable(label, exc)
                log.warning("%s", unavailable)
                raise unavailable from exc
            try:
                result = await lease.client.call_tool(name, args)
            except BaseException as exc:
                # Cancelled (timeout, disconnect) or broken: the session may hold a half-done request.
                if isinstance(exc, Exception) and not session_failed(exc):
                    lease.release()
                else:
                    lease.discard()
                if attempt == 0 and isinstance(exc, Exception) and call_not_run(exc):
                    log.info(
                        "MCP server %r: the call was not run (%s); sending it again on a new session",
                        label,
                        describe_exception(exc),
                    )
                    continue
                raise
            lease.release()
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    async def attempt(self, name: str, arguments: object) -> tuple[Outcome, str, bool]:
        """Run one call: (outcome, text, whether the text came from the tool). Never raises
        except for cancellation."""
        tool = self.resolved.gateway_tool(name)
        if tool is None:
            return "error", f"<error: no gateway tool is named {scrub_text(name)[:100]!r}>", False
        args = parse_arguments(arguments)
        if isinstance(args, str):
            return "invalid_arguments", args, False
        result: mcp.types.CallToolResult | None = None
        failure: BaseException | None = None
        with anyio.move_on_after(self.timeout) as scope:
            try:
                result = await self.call(tool.server_label, tool.name, args)
            except Exception as exc:
                failure = exc
        if result is None and scope.cancel_called:
            cap_hit("tool_timeout", "tool_error")
            return "timeout", f"<error: tool timed out after {self.timeout:g}s>", False
        if result is None:
            if failure is not None and ANSWER_TOO_LARGE in describe_exception(failure):
                # The answer passed the transport's bound (a multiple of the cap): never held whole.
                return (
                    "too_large",
                    f"<error: the tool result is over the per-call cap of {self.max_result_bytes:,} bytes "
                    "(the answer was not read to its end); raise --tool-max-result-bytes or make the tool "
                    "return less>",
                    False,
                )
            if isinstance(failure, _ServerUnavailable):
                return "error", f"<error: {scrub_text(str(failure))}>", False
            detail = describe_exception(failure) if failure is not None else "no result"
            return "error", f"<error: the tool call failed ({detail})>", False
        try:
            text = scrub_text(result_text(result))
        except Exception as exc:
            return "error", f"<error: the tool result could not be read ({describe_exception(exc)})>", False
        if result.is_error:
            return "error", text or "<error: the tool reported an error without a message>", True
        return "ok", text, True

    async def execute(self, call: Mapping[str, Any]) -> ToolOutcome:
        """`attempt` plus the cap, the ledger charge and the metrics. Ledger errors propagate."""
        started = time.perf_counter()
        call_id = call["call_id"]
        outcome, text, from_tool = await self.attempt(call["name"], call.get("arguments"))
        charge = 0
        if from_tool:
            raw = text.encode("utf-8")
            if len(raw) > self.max_result_bytes:
                outcome = "too_large"
                text = (
                    f"<error: the tool result is {len(raw):,} bytes, {len(raw) - self.max_result_bytes:,} "
                    f"bytes over the per-call cap of {self.max_result_bytes:,} bytes; raise "
                    "--tool-max-result-bytes or make the tool return less>"
                )
            else:
                try:
                    charge = self.ledger.admit_tool_result(raw)
                except Exception as exc:
                    raise _LedgerRefused(exc) from exc
        duration = time.perf_counter() - started
        TOOL_CALLS.labels(outcome=outcome).inc()
        TOOL_DURATION.observe(duration)
        error = None if outcome == "ok" else text
        return ToolOutcome(call_id, text, error, outcome, charge, duration)


def _internal_error(call_id: str) -> ToolOutcome:
    text = "<error: the gateway failed to run this tool call>"
    TOOL_CALLS.labels(outcome="error").inc()
    return ToolOutcome(call_id, text, text, "error")


async def run_tool_calls(
    resolved: ResolvedTools,
    calls: Sequence[Mapping[str, Any]],
    *,
    ledger: ToolLedger,
    timeout: float = 60.0,
    concurrency: int = 5,
    max_result_bytes: int = 262_144,
) -> list[ToolOutcome]:
    """Run gateway-owned calls; one `ToolOutcome` per call, in the order of `calls`.

    `calls` are ``function_call`` output items (``{"call_id": str, "name": str, "arguments": str |
    None, ...}``) whose ``name`` is a function name of `resolved` (another name gives an ``error``
    outcome). `timeout` is seconds per call, `concurrency` the window (calls in flight),
    `max_result_bytes` the per-call cap in UTF-8 bytes. See the module docstring for the policy.

    Raises ValueError for a bad setting or a call without a string ``call_id`` / ``name`` (before
    anything runs); the ledger's exception (``BudgetExceeded``) when a result does not fit, after
    cancelling the other calls; and the cancellation itself when the awaiting task is cancelled.
    """
    _check_run(calls, timeout=timeout, concurrency=concurrency, max_result_bytes=max_result_bytes)
    if not calls:
        return []
    own_pool = resolved.pool is None
    pool = resolved.pool or SessionPool(connect_timeout=resolved.connect_timeout)
    runner = _Runner(resolved, pool, ledger, timeout=timeout, max_result_bytes=max_result_bytes)
    try:
        return await _run_window(runner, calls, concurrency)
    finally:
        if own_pool:
            with anyio.CancelScope(shield=True):
                await pool.aclose()


def _check_run(
    calls: Sequence[Mapping[str, Any]], *, timeout: float, concurrency: int, max_result_bytes: int
) -> None:
    """Raise ValueError for a bad setting of `run_tool_calls` or a call without a string
    ``call_id`` / ``name``."""
    if not timeout > 0:
        raise ValueError(f"tool timeout must be > 0 seconds, got {timeout!r}")
    if concurrency < 1:
        raise ValueError(f"tool concurrency must be >= 1, got {concurrency!r}")
    if max_result_bytes < 0:
        raise ValueError(f"tool max_result_bytes must be >= 0, got {max_result_bytes!r}")
    for call in calls:
        if not isinstance(call.get("call_id"), str) or not isinstance(call.get("name"), str):
            raise ValueError("every tool call needs a string call_id and name")


async def _run_window(
    runner: _Runner, calls: Sequence[Mapping[str, Any]], concurrency: int
) -> list[ToolOutcome]:
    """Run `calls` on `runner`, at most `concurrency` at a time, outcomes in the order of `calls`.
    A result the ledger refuses cancels the other calls and its exception is raised; any other
    exception of one call becomes that call's ``error`` outcome (logged)."""
    results: list[ToolOutcome | None] = [None] * len(calls)
    overflow: list[Exception] = []
    pending = iter(range(len(calls)))
    async with anyio.create_task_group() as workers:

        async def work() -> None:
            for index in pending:
                try:
                    results[index] = await runner.execute(calls[index])
                except _LedgerRefused as exc:
                    overflow.append(exc.cause)
                    workers.cancel_scope.cancel()
                    return
                except Exception:  # a bug here must not leave a call_id dangling
                    log.exception("tool call %r failed inside the gateway", calls[index]["call_id"])
                    results[index] = _internal_error(calls[index]["call_id"])

        for _ in range(min(concurrency, len(calls))):
            workers.start_soon(work)
    if overflow:
        raise overflow[0]
    done = [outcome for outcome in results if outcome is not None]
    assert len(done) == len(calls)
    return done
