"""`middleware.loop.items.response_summary`: the scalar fields of an upstream response object kept
for a later ``response.failed`` without a ledger charge, so bounded by a constant whatever the
upstream sends (a ``response.created`` is decoded by msgspec whatever its strings: its value is
kept only as this summary, `middleware.upstream.reader._TRANSIENT_VALUES`)."""

from __future__ import annotations

import json
import tracemalloc

from middleware.loop.items import SUMMARY_FIELDS, SUMMARY_KEY_LIMIT, SUMMARY_TEXT_LIMIT, response_summary
from middleware.upstream.reader import loads_upstream

RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1700000000,
    "status": "in_progress",
    "error": None,
    "instructions": "x" * (SUMMARY_TEXT_LIMIT + 1),
    "model": "m",
    "output": [],
    "parallel_tool_calls": True,
    "temperature": 0.5,
    "reasoning": {"effort": None},
}


def test_a_usual_response_keeps_every_scalar_field() -> None:
    assert response_summary(RESPONSE) == {
        "id": "resp_1",
        "object": "response",
        "created_at": 1700000000,
        "status": "in_progress",
        "error": None,
        "model": "m",
        "parallel_tool_calls": True,
        "temperature": 0.5,
    }


def test_thousands_of_extra_fields_keep_a_bounded_summary() -> None:
    """An upstream's response object with 50,000 scalar fields of one-character values (each a
    ``str`` of its own when msgspec decodes it) and long keys: the summary keeps the first
    `SUMMARY_FIELDS` fields with keys up to `SUMMARY_KEY_LIMIT` characters, a few KB."""
    extra = {f"k{i}": "x" for i in range(50_000)}
    long_keys = {"k" * (SUMMARY_KEY_LIMIT + 1) + str(i): 1 for i in range(10)}
    data = json.dumps({**long_keys, **RESPONSE, **extra}).encode()
    response = loads_upstream(data, size_priced=True)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        summary = response_summary(response)
        kept = tracemalloc.get_traced_memory()[0] - base  # (the object itself is dropped later)
    finally:
        tracemalloc.stop()
    assert len(summary) == SUMMARY_FIELDS
    assert all(len(key) <= SUMMARY_KEY_LIMIT for key in summary)
    assert summary["model"] == "m" and summary["created_at"] == 1700000000  # the object's own come first
    assert kept < 16_384, kept
