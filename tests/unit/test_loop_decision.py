"""`classify_round` as a decision table (DESIGN.md §6), including its edges."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.loop.decision import (
    Continue,
    Done,
    Incomplete,
    LoopDetected,
    RequiresClientAction,
    RoundState,
    classify_round,
)


def call(n: int) -> dict[str, Any]:
    return {"type": "function_call", "call_id": f"call_{n}", "name": "lookup", "arguments": "{}"}


G1, G2, G3 = call(1), call(2), call(3)
C1 = {"type": "function_call", "call_id": "call_c", "name": "get_time", "arguments": "{}"}


@pytest.mark.parametrize(
    ("state", "decision"),
    [
        (RoundState(status="completed"), Done()),
        (RoundState(status="completed", gateway_calls=[G1]), Continue(run=(G1,))),
        (
            RoundState(status="completed", gateway_calls=[G1], inference_calls=3, max_infer_iters=3),
            LoopDetected(3),
        ),
        (
            RoundState(status="completed", inference_calls=3, max_infer_iters=3),
            Done(),
        ),  # last round, no gateway work
        (
            RoundState(status="completed", gateway_calls=[G1], client_calls=[C1]),
            RequiresClientAction(run=(G1,)),
        ),
        (  # client calls take precedence, even on the last allowed inference call
            RoundState(
                status="completed",
                gateway_calls=[G1],
                client_calls=[C1],
                inference_calls=3,
                max_infer_iters=3,
            ),
            RequiresClientAction(run=(G1,)),
        ),
        (RoundState(status="completed", client_calls=[C1]), RequiresClientAction(run=())),
        (  # upstream incomplete runs nothing, even with calls present
            RoundState(status="incomplete", incomplete_reason="max_output_tokens", gateway_calls=[G1]),
            Incomplete("max_output_tokens"),
        ),
        (RoundState(status="failed", gateway_calls=[G1]), Done()),
        (
            RoundState(status="completed", gateway_calls=[G1, G2, G3], tool_calls_left=2),
            Incomplete("max_tool_calls", run=(G1, G2)),
        ),
        (
            RoundState(status="completed", gateway_calls=[G1], tool_calls_left=0, client_calls=[C1]),
            Incomplete("max_tool_calls", run=()),
        ),
        (RoundState(status="completed", gateway_calls=[G1, G2], tool_calls_left=2), Continue(run=(G1, G2))),
        (  # the tool cap fires before the iteration cap
            RoundState(
                status="completed",
                gateway_calls=[G1],
                tool_calls_left=0,
                inference_calls=10,
                max_infer_iters=10,
            ),
            Incomplete("max_tool_calls", run=()),
        ),
    ],
)
def test_decision_table(state: RoundState, decision: object) -> None:
    assert classify_round(state) == decision


@given(
    n_gateway=st.integers(0, 5),
    n_client=st.integers(0, 2),
    left=st.one_of(st.none(), st.integers(0, 6)),
    made=st.integers(1, 12),
    cap=st.integers(1, 12),
)
def test_runs_never_exceed_the_tool_budget_and_508_only_without_client_calls(
    n_gateway: int, n_client: int, left: int | None, made: int, cap: int
) -> None:
    state = RoundState(
        status="completed",
        gateway_calls=[call(i) for i in range(n_gateway)],
        client_calls=[C1] * n_client,
        tool_calls_left=left,
        inference_calls=made,
        max_infer_iters=cap,
    )
    decision = classify_round(state)
    run = getattr(decision, "run", ())
    if left is not None:
        assert len(run) <= left
    if isinstance(decision, LoopDetected):
        assert n_client == 0 and n_gateway > 0 and made >= cap
    if isinstance(decision, Continue):
        assert made < cap and n_client == 0
