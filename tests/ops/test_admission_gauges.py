"""The admission gauges: ``loopwarden_inflight_retained_bytes`` is the sum of live ledgers,
``loopwarden_admission_reserved_bytes`` the pool's reservations, and charges write no gauge.

Unit tests on `ProcessPool` / `RequestReservation` with real `budget.Ledger`s, read through
`metrics.exposition()` (what ``GET /metrics`` serves in one process).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from budget import Ledger, PoolExhausted
from middleware.ops import metrics
from middleware.ops.admission import PUBLISH_INTERVAL, ProcessPool

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024
LIVE = "loopwarden_inflight_retained_bytes"
RESERVED = "loopwarden_admission_reserved_bytes"


def _scrape() -> dict[str, float]:
    """The unlabelled samples of the metrics page, by name."""
    page = metrics.exposition().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if not sample.labels
    }


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcessPool]:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    yield ProcessPool(16 * MiB)


def test_live_ledger_gauge_is_the_sum_of_charges_not_the_reservations(pool: ProcessPool) -> None:
    first, second = pool.admit(1 * MiB, caller="a"), pool.admit(2 * MiB, caller="b")
    a = Ledger(64 * MiB, pool=first)
    b = Ledger(64 * MiB, pool=second)
    a.admit_input(b'{"model":"m","input":"' + b"x" * 1000 + b'"}')
    b.reserve(3 * MiB)  # past its 2 MiB reservation: 1 MiB more drawn from the pool
    during = _scrape()
    assert a.charged > 0 and b.charged == 3 * MiB
    assert during[LIVE] == a.charged + b.charged == pool.charged
    assert during[RESERVED] == pool.reserved == 1 * MiB + 3 * MiB
    assert during[LIVE] != during[RESERVED]

    b.release(2 * MiB)  # back under its reservation: the reservation keeps its 2 MiB
    assert _scrape()[LIVE] == a.charged + b.charged
    assert _scrape()[RESERVED] == 1 * MiB + 2 * MiB

    for ledger, reservation in ((a, first), (b, second)):
        ledger.release_all()
        reservation.close()
    after = _scrape()
    assert after[LIVE] == 0 and after[RESERVED] == 0
    assert pool.charged == pool.reserved == pool.requests == 0


def _record_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    writes: list[tuple[str, float]] = []
    for gauge, name in ((metrics.INFLIGHT_RETAINED, LIVE), (metrics.ADMISSION_RESERVED, RESERVED)):
        monkeypatch.setattr(gauge, "set", lambda value, name=name: writes.append((name, value)))
    return writes


def test_one_process_writes_no_gauge_per_request(pool: ProcessPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process: the scrape reads both numbers live, so neither a charge nor a request start
    or end writes a gauge (issue 21: gauges read at scrape time)."""
    monkeypatch.setattr(metrics, "MULTIPROCESS", False)
    writes = _record_writes(monkeypatch)
    reservation = pool.admit(4096, caller="a")
    ledger = Ledger(64 * MiB, pool=reservation)
    ledger.release(ledger.reserve(64 * 1024))
    reservation.close()
    assert writes == []


def test_charges_and_releases_write_no_gauge_start_and_end_do(
    pool: ProcessPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multiprocess mode exports what `Gauge.set` wrote: at request start and end, not per charge
    (a synchronous caller, no event loop: each write at once)."""
    monkeypatch.setattr(metrics, "MULTIPROCESS", True)
    writes = _record_writes(monkeypatch)
    reservation = pool.admit(4096, caller="a")
    assert writes == [(RESERVED, 4096), (LIVE, 0)]
    writes.clear()
    ledger = Ledger(64 * MiB, pool=reservation)
    for _ in range(50):
        ledger.release(ledger.reserve(64 * 1024))  # each one past the reservation: pool take and give
    ledger.reserve(1000)
    assert writes == []
    reservation.close()  # the ledger still holds 1000: they leave the live sum with the request
    assert writes == [(RESERVED, 0), (LIVE, 0)]
    assert pool.charged == 0


def test_multiprocess_writes_are_throttled_with_one_trailing_write(
    pool: ProcessPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the event loop, requests that start and end within `PUBLISH_INTERVAL` of a write are
    written once, at the interval's end, with the numbers then."""
    monkeypatch.setattr(metrics, "MULTIPROCESS", True)
    writes = _record_writes(monkeypatch)

    async def run() -> None:
        await asyncio.sleep(PUBLISH_INTERVAL * 2)  # past the write the pool made when created
        first = pool.admit(4096, caller="a")  # the first write of the interval: at once
        assert writes == [(RESERVED, 4096), (LIVE, 0)]
        for _ in range(20):
            pool.admit(1024, caller="b").close()
        first.close()
        assert len(writes) == 2  # nothing more yet
        await asyncio.sleep(PUBLISH_INTERVAL * 6)

    asyncio.run(run())
    assert writes[2:] == [(RESERVED, 0), (LIVE, 0)]


def test_a_refused_charge_changes_neither_number(pool: ProcessPool) -> None:
    reservation = pool.admit(1 * MiB, caller="a")
    ledger = Ledger(64 * MiB, pool=reservation)
    with pytest.raises(PoolExhausted):
        ledger.reserve(32 * MiB)  # over the 16 MiB pool
    assert pool.charged == ledger.charged == 0 and pool.reserved == 1 * MiB
    reservation.close()


_MULTIPROCESS_SCRIPT = """
import asyncio
import json
from prometheus_client.parser import text_string_to_metric_families
from budget import Ledger
from middleware.ops import metrics
from middleware.ops.admission import PUBLISH_INTERVAL, ProcessPool

def scrape():
    page = metrics.exposition().decode()
    return {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples if not s.labels}

pool = ProcessPool(16 << 20)
reservation = pool.admit(1 << 20, caller="a")
ledger = Ledger(64 << 20, pool=reservation)
ledger.reserve(1 << 19)  # under the reservation: charged 512 KiB, reserved 1 MiB
during = scrape()
ledger.release_all()
reservation.close()
print(json.dumps({"charged": 1 << 19, "reserved": 1 << 20, "during": during, "after": scrape()}))
"""


def test_multiprocess_mode_publishes_the_live_sum_before_a_scrape(tmp_path: Path) -> None:
    """With ``--workers`` > 1 the page is read from files: the scraped worker writes first."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _MULTIPROCESS_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["during"][LIVE] == seen["charged"] and seen["during"][RESERVED] == seen["reserved"]
    assert seen["after"][LIVE] == 0 and seen["after"][RESERVED] == 0
