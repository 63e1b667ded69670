"""`Ledger.admit_stream_bytes`: the by-size form of admit_stream_chunk, at its exact boundary."""

from __future__ import annotations

import pytest

from budget import BudgetExceeded, Ledger


@pytest.mark.parametrize("transient", [True, False])
def test_boundary(transient: bool) -> None:
    need_per_byte = 48 if transient else 32
    limit = 4096 * need_per_byte
    ledger = Ledger(limit)
    assert ledger.admit_stream_bytes(4096, transient=transient) == 32 * 4096  # need == limit: admitted
    ledger.release(32 * 4096)
    ledger.reserve(1)
    with pytest.raises(BudgetExceeded) as info:
        ledger.admit_stream_bytes(4096, transient=transient)  # one byte more than fits
    assert info.value.phase == "stream"
    assert ledger.charged == 1  # a refused charge leaves the ledger unchanged


def test_chunk_form_is_the_same_charge() -> None:
    a, b = Ledger(1 << 20), Ledger(1 << 20)
    assert a.admit_stream_chunk(b"x" * 1000) == b.admit_stream_bytes(1000)
    assert a.charged == b.charged == 32_000
