"""The store-on stream fast path (issue 21 item 1): the loop's rounds, stitched and accumulated.

The property: on every generated stream (lifecycle events, items added and done, text and
argument deltas, the irregular frames of `tests.unit.test_stream_fastpath`, frames the stitcher must
rewrite, read splits, ledger limits), one round read as `AgentLoop._round_stream` reads it — a
`StreamStitcher` forwarding, a `StreamAccumulator` keeping, store surcharges on — gives with the
fast path (``on_run`` + ``accept``) and without it the same client bytes, the same outcome, the
same stored response (what the loop stores: the terminal response and its output on success, the
items the client saw on failure), and the same charges left on the ledger.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget import BudgetExceeded, ChargeModel, Ledger, PoolExhausted
from middleware.asgi.client_stream import ClientStream
from middleware.loop.stitcher import StreamStitcher
from middleware.tools import ResolvedTools
from middleware.upstream.errors import UpstreamError
from middleware.upstream.reader import StreamAccumulator, read_round
from tests.unit.test_stream_fastpath import (
    _ALSO_REGULAR,
    _CONSERVATIVE,
    _IRREGULAR,
    _frame,
    _numbered,
    _Response,
    split_reads,
)

REQUEST = {"model": "m", "input": "x", "stream": True}
MESSAGE = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_time", "arguments": ""}


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return _frame(kind, {"type": kind, "sequence_number": seq, **fields})


def _text(seq: int, text: str, index: int = 0) -> bytes:
    return _event(
        "response.output_text.delta", seq, item_id="msg_1", output_index=index, content_index=0, delta=text
    )


def _args(seq: int, text: str) -> bytes:
    return _event("response.function_call_arguments.delta", seq, item_id="fc_1", output_index=1, delta=text)


def _done_message(text: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}]
    return {**MESSAGE, "status": "completed", "content": content}


def stitched_round(
    reads: list[bytes], *, fast: bool, limit: int, model: str
) -> tuple[bytes, str, Any, int, int]:
    """(client bytes, outcome, stored response, ledger charge left, runs taken) of one round read
    as the loop reads it; outcome is the terminal type or ``Class:code``."""

    async def go() -> tuple[bytes, str, Any, int, int]:
        out: list[bytes] = []
        runs = 0

        async def on_run(frames: bytes, count: int) -> None:
            nonlocal runs
            runs += 1
            await client.forward_run(frames, count)

        async def send(message: Any) -> None:
            if message["type"] == "http.response.body":
                out.append(message["body"])

        client = ClientStream(send)
        ledger = Ledger(limit, model=ChargeModel.named(model), store=True)
        resolved = ResolvedTools(
            upstream_tools=[], list_items=[], gateway_tools={}, endpoints={}, connect_timeout=1
        )
        stitcher = StreamStitcher(
            client, resolved, "resp_gw", REQUEST, [], ledger=ledger, created_at=1_700_000_000
        )
        acc = StreamAccumulator(ledger)
        try:
            outcome = await read_round(
                _Response(reads),
                ledger,
                client=client,
                acc=acc,
                on_event=stitcher.forward,
                on_run=on_run if fast else None,
                accept=stitcher.fast_count if fast else None,
            )
            stored: Any = {"terminal": acc.terminal, "output": acc.output()}
        except (UpstreamError, BudgetExceeded, PoolExhausted) as exc:
            outcome = f"{type(exc).__name__}:{getattr(exc, 'code', None)}"
            stored = stitcher.seen_items(acc.delta_text, acc.items)
        await client.flush()
        return b"".join(out), outcome, json.loads(json.dumps(stored)), ledger.charged, runs

    return asyncio.run(go())


def _opening() -> list[bytes]:
    response = {"id": "resp_up", "object": "response", "status": "in_progress", "output": []}
    return [
        _event("response.created", 0, response=response),
        _event("response.in_progress", 1, response=response),
        _event("response.output_item.added", 2, output_index=0, item=MESSAGE),
    ]


@st.composite
def rounds(draw: st.DrawFn) -> list[bytes]:
    """One round: opening events, then deltas for the message (and a client function call) with
    irregular and rewritten frames mixed in, the items done and a terminal event (or the stream
    cut short), split into reads."""
    parts = _opening() if draw(st.integers(0, 9)) else _opening()[2:]  # rarely: no lifecycle
    seq, text, args, called = 3, "", "", False
    for _ in range(draw(st.integers(0, 14))):
        pick = draw(st.integers(0, 9))
        if pick == 0:
            parts.append(_numbered(draw(st.sampled_from(_IRREGULAR + _ALSO_REGULAR + _CONSERVATIVE)), seq))
        elif pick == 1 and not called:
            parts.append(_event("response.output_item.added", seq, output_index=1, item=CALL))
            called = True
        elif pick == 2 and called:
            piece = draw(st.sampled_from(['{"tz":', '"UTC"}']))
            parts.append(_args(seq, piece))
            args += piece
        elif pick == 3:  # frames the stitcher rewrites or adds: not taken as received
            parts.append(
                draw(
                    st.sampled_from(
                        [
                            _text(seq, "?", index=5),  # an index never added: mapped to the next one
                            _event("response.x.delta", seq, output_index=0, delta="r", response={"id": "u"}),
                            _event("response.x.delta", seq, output_index=True, delta="b"),
                        ]
                    )
                )
            )
        else:
            piece = draw(st.sampled_from(["Hel", "lo ", "wörld", "x" * 500, ""]))
            parts.append(_text(seq, piece))
            text += piece
        seq += 1
    if draw(st.integers(0, 4)):
        parts.append(_event("response.output_item.done", seq, output_index=0, item=_done_message(text)))
        output = [_done_message(text), *([{**CALL, "arguments": args}] if called else [])]
        response = {"id": "resp_up", "object": "response", "status": "completed", "output": output}
        parts.append(_event("response.completed", seq + 1, response=response))
    return split_reads(draw, b"".join(parts))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rounds(),
    st.sampled_from([4096 * 24, 400_000, 2_000_000, 64 << 20]),
    st.sampled_from(["reference", "measured"]),
)
def test_fast_and_exact_paths_agree_on_bytes_outcome_stored_response_and_charges(
    reads: list[bytes], limit: int, model: str
) -> None:
    fast = stitched_round(reads, fast=True, limit=limit, model=model)
    exact = stitched_round(reads, fast=False, limit=limit, model=model)
    assert fast[:4] == exact[:4]
    assert exact[4] == 0


def test_a_regular_round_goes_out_as_received_and_its_text_is_kept() -> None:
    deltas = [_text(3 + i, "word ") for i in range(50)]
    output = [_done_message("word " * 50)]
    tail = [
        _event("response.output_item.done", 53, output_index=0, item=output[0]),
        _event("response.completed", 54, response={"id": "resp_up", "status": "completed", "output": output}),
    ]
    reads = [b"".join(_opening() + deltas + tail)]
    fast = stitched_round(reads, fast=True, limit=64 << 20, model="reference")
    assert fast[:4] == stitched_round(reads, fast=False, limit=64 << 20, model="reference")[:4]
    out, outcome, stored, _, runs = fast
    assert outcome == "response.completed"
    assert runs == 1  # the fifty deltas in one run
    assert b"".join(deltas) in out  # the fifty deltas byte for byte, as received
    assert stored["output"] == output


def test_a_round_cut_short_stores_the_text_the_client_saw_incomplete() -> None:
    reads = [b"".join([*_opening(), _text(3, "Hel"), _text(4, "lo")])]
    for fast in (True, False):
        _, outcome, stored, _, _ = stitched_round(reads, fast=fast, limit=64 << 20, model="reference")
        assert outcome == "UpstreamIncomplete:upstream_incomplete"
        assert stored == [
            {
                **MESSAGE,
                "status": "incomplete",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
            }
        ]


def test_the_delta_text_is_charged_as_the_exact_path_charges_it() -> None:
    """Store on: 2 x (32 x bytes) per kept delta (reference prices); the same left charged."""
    reads = [b"".join([*_opening(), *(_text(3 + i, "abcd") for i in range(20))])]
    fast = stitched_round(reads, fast=True, limit=64 << 20, model="reference")
    exact = stitched_round(reads, fast=False, limit=64 << 20, model="reference")
    assert fast[3] == exact[3]
    assert fast[4] == 1
    assert fast[3] >= 20 * 2 * 32 * 4  # the kept text at least (plus the added item's snapshot)


@pytest.mark.parametrize("model", ["reference", "measured"])
def test_admit_accumulated_texts_charges_each_text_as_admit_accumulated_does(model: str) -> None:
    texts = [b"", b"abc", "wörld".encode(), "\U0001f600".encode(), b"x" * 5000]
    one_by_one = Ledger(64 << 20, model=ChargeModel.named(model), store=True)
    expected = [one_by_one.admit_accumulated(text, nodes=0) for text in texts]
    ledger = Ledger(64 << 20, model=ChargeModel.named(model), store=True)
    assert ledger.admit_accumulated_texts(texts) == expected
    assert ledger.charged == one_by_one.charged == sum(expected) > 0


def test_admit_accumulated_texts_is_all_or_nothing() -> None:
    ledger = Ledger(4096 * 24, store=True)
    charges = ledger.admit_accumulated_texts([b"x" * 100])
    with pytest.raises(BudgetExceeded):
        ledger.admit_accumulated_texts([b"y" * 10, b"z" * 4096 * 24])  # the first alone would fit
    assert ledger.charged == sum(charges)
