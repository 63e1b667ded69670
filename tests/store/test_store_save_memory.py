"""What saving a large response holds at once (attack report D3): the stored projection is
charged at write as two copies of the serialized output (the item row and the response row,
DESIGN.md §4), so `Store.save_response` must not hold a third one (it used to encode the whole
response text to UTF-8 only to measure its length). tracemalloc counts Python's own bytes; the
SQLite in-memory database (C allocations) is not traced."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

from middleware.store import StoredResponse, open_store
from middleware.store.store import encode_json

MB = 1_000_000


def _peak_of_save(text: str) -> int:
    """Traced bytes above the start that saving one response with one output item holding
    ``text`` peaks at (the item and the response are built before the measurement)."""

    async def main() -> int:
        async with open_store("memory") as store:
            item = {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "incomplete",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
            response = {"id": "resp_1", "object": "response", "status": "failed", "output": [item]}
            record = StoredResponse("resp_1", "o", 1, "failed", "m", None, None, response, {})
            gc.collect()
            tracemalloc.start()
            try:
                start = tracemalloc.get_traced_memory()[0]
                stored = await store.save_response(
                    record, input_items=[], output_items=[item], replay_items=[item]
                )
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert stored
            got = await store.response_json("resp_1", "o")
            assert got == encode_json(response).encode("utf-8")  # the spliced text is the whole encoding
            return peak - start

    return asyncio.run(main())


def test_saving_holds_at_most_the_two_charged_copies_of_an_ascii_output() -> None:
    text = "H" * (4 * MB)
    peak = _peak_of_save(text)
    # the item's JSON text and its UTF-8 bytes (counting nodes), then the item text and the
    # response text: two copies at a time, plus small rows and the thread's own objects
    assert 2 * len(text) <= peak < 2 * len(text) + MB, f"{peak:,} bytes traced"
