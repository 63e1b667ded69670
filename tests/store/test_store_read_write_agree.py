"""A response stored from streamed deltas can be read back (attack report D2): the write path
charges accumulated delta text at the measured model's feature price (its `str` and the persisted
projection, about 3.4 budget bytes per ASCII byte), far below the size-only prices that the read
ledger's limit was scaled from; a ``failed`` response kept from many deltas was then a 413 on
``GET /v1/responses/{id}``. A real uvicorn, a scripted upstream, SQLite, the measured model."""

from __future__ import annotations

from typing import Any

import httpx

from budget import ChargeModel
from middleware.store.reads import read_ledger_limit
from tests.helpers import PRE, gateway, sse_events, text_delta
from tests.mock_upstream import E, MockUpstream, Reply

ITEM = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
PART = {"type": "output_text", "text": "", "annotations": []}
HEAD = [
    E(
        "response.output_item.added",
        {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": ITEM},
    ),
    E(
        "response.content_part.added",
        {
            "type": "response.content_part.added",
            "sequence_number": 3,
            "output_index": 0,
            "item_id": "msg_1",
            "content_index": 0,
            "part": PART,
        },
    ),
]
AUTH = {"authorization": "Bearer client-key"}
MODEL = ChargeModel.measured()


def _stream_until_overflow(url: str) -> tuple[str, list[dict[str, Any]]]:
    r = httpx.post(
        url + "/v1/responses",
        json={"model": "m", "input": "x", "stream": True, "store": True},
        headers=AUTH,
        timeout=30,
    )
    events = [e for _, e in sse_events(r.content) if e is not None]
    return events[0]["response"]["id"], events


def test_a_failed_response_kept_from_many_deltas_reads_back(upstream: MockUpstream, tmp_path: Any) -> None:
    limit = 400_000
    delta = "H" * 2_000  # 300 deltas: 600 KB of text, far over what 400 KB of ledger can keep
    upstream.push(Reply.sse([*PRE(), *HEAD, *(text_delta(4 + i, delta) for i in range(300))]))
    with gateway(upstream, store=f"sqlite:///{tmp_path}/lw.db", max_retained_bytes=limit) as (url, _):
        rid, events = _stream_until_overflow(url)
        error = [e for e in events if e.get("type") == "error"]
        assert [e["code"] for e in error] == ["max_retained_bytes_exceeded"]
        got = httpx.get(f"{url}/v1/responses/{rid}", headers=AUTH, timeout=30)
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["status"] == "failed"
    assert body["error"]["code"] == "max_retained_bytes_exceeded"
    text = body["output"][0]["content"][0]["text"]
    kept = len(text) // len(delta)
    assert text == delta * kept and kept >= 10  # the deltas the ledger admitted, whole
    # What was stored fit the write ledger; reading it back fits the read ledger of that limit.
    stored = len(got.content)
    assert MODEL.history_charge(stored, 0) <= read_ledger_limit(limit, MODEL)
