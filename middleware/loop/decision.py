"""The loop's decision function: one pure step from a round's outcome to what happens next.

`classify_round(state)` follows DESIGN.md §6 in this order:

1. upstream status ``incomplete``             -> `Incomplete` (the upstream's reason); nothing runs
2. upstream status not ``completed`` (failed) -> `Done`; nothing runs, the response passes through
3. no tool calls                              -> `Done`
4. more gateway calls than ``max_tool_calls`` allows
                                              -> `Incomplete("max_tool_calls")`: run the first
                                                 ``left`` gateway calls (output order), omit the rest,
                                                 hand back any client calls
5. client-owned calls (or calls awaiting approval) present
                                              -> `RequiresClientAction`: run this round's gateway
                                                 calls, hand the client calls back (also on the last
                                                 allowed inference call)
6. gateway calls only, ``max_infer_iters`` inference calls already made
                                              -> `LoopDetected` (508 / one SSE error frame); nothing runs
7. otherwise                                  -> `Continue`: run the gateway calls, next round
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from middleware.upstream.errors import UpstreamInvalid

if TYPE_CHECKING:
    from middleware.tools.resolved import ResolvedTools


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundState:
    """What `classify_round` needs to know about the round that just ended.

    ``status``: the upstream terminal status (completed, incomplete, failed, ...).
    ``incomplete_reason``: ``incomplete_details.reason`` when incomplete. ``gateway_calls``: the
    function calls of gateway-owned tools that may run now, in output order. ``client_calls``:
    client-owned calls (and gateway calls awaiting approval). ``tool_calls_left``: what remains of
    the request's ``max_tool_calls`` (None: no cap). ``inference_calls``: inference calls made so
    far, this round included. ``max_infer_iters``: the request's cap.
    """

    status: str
    incomplete_reason: str | None = None
    gateway_calls: Sequence[dict[str, Any]] = ()
    client_calls: Sequence[dict[str, Any]] = ()
    tool_calls_left: int | None = None
    inference_calls: int = 1
    max_infer_iters: int = 10


@dataclasses.dataclass(frozen=True)
class Continue:
    """Run ``run`` (every gateway call of the round) and make the next inference call."""

    run: tuple[dict[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Done:
    """The round's response is the final answer; nothing runs."""


@dataclasses.dataclass(frozen=True)
class RequiresClientAction:
    """Run ``run`` (the round's gateway calls), then answer with the client calls handed back."""

    run: tuple[dict[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Incomplete:
    """Answer ``status: "incomplete"`` with ``reason``; run ``run`` first. The round's other gateway
    calls are not run (the loop hides them: `middleware.loop.agent.AgentLoop`)."""

    reason: str
    run: tuple[dict[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class LoopDetected:
    """The model still asks for gateway tools after ``max_infer_iters`` inference calls."""

    inference_calls: int


LoopDecision = Continue | Done | RequiresClientAction | Incomplete | LoopDetected


def classify_round(state: RoundState) -> LoopDecision:
    """Decide what follows a round (DESIGN.md §6, the order in the module docstring)."""
    if state.status == "incomplete":
        return Incomplete(state.incomplete_reason or "unknown")
    if state.status != "completed":
        return Done()
    gateway = tuple(state.gateway_calls)
    if not gateway and not state.client_calls:
        return Done()
    left = state.tool_calls_left
    if left is not None and len(gateway) > left:
        return Incomplete("max_tool_calls", run=gateway[:left])
    if state.client_calls:
        return RequiresClientAction(run=gateway)
    if state.inference_calls >= state.max_infer_iters:
        return LoopDetected(state.inference_calls)
    return Continue(run=gateway)


#: Output item types that are always the client's to run (the gateway runs only MCP tools).
CLIENT_CALL_TYPES = frozenset({"custom_tool_call", "computer_call", "local_shell_call", "shell_call"})


def split_calls(
    output: Sequence[dict[str, Any]], resolved: ResolvedTools, seen: set[Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """A round's output items as (gateway calls that may run, client-owned calls, gateway calls
    awaiting approval), in output order — the inputs of `classify_round`.

    ``seen``: the ``call_id``s of the function calls already in the history, the input and this
    request's earlier rounds (updated). Raises `UpstreamInvalid` for a function call without a
    string ``call_id`` and ``name``, or one whose ``call_id`` was seen (DESIGN.md §5).
    """
    gateway: list[dict[str, Any]] = []
    client: list[dict[str, Any]] = []
    approvals: list[dict[str, Any]] = []
    for item in output:
        kind = item.get("type")
        if kind != "function_call":
            if kind in CLIENT_CALL_TYPES:
                client.append(item)
            continue
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
            raise UpstreamInvalid("upstream returned a function_call without a string call_id and name")
        if call_id in seen:
            raise UpstreamInvalid(f"upstream returned a duplicate call_id {call_id[:100]!r}")
        seen.add(call_id)
        tool = resolved.gateway_tool(name)
        if tool is None:
            client.append(item)
        elif tool.require_approval:
            approvals.append(item)
        else:
            gateway.append(item)
    return gateway, client, approvals
