"""The worker's RSS gauge after a request (issue 21 item 2): read at scrape time in one process,
written at most every 50 ms with ``--workers`` > 1 (multiprocess files have no scrape-time read)."""

from __future__ import annotations

import pytest

from middleware.ops import metrics


def calls(monkeypatch: pytest.MonkeyPatch, multiprocess: bool, clock: list[float]) -> int:
    written: list[int] = []
    monkeypatch.setattr(metrics, "MULTIPROCESS", multiprocess)
    monkeypatch.setattr(metrics, "_rss_written_at", float("-inf"))
    monkeypatch.setattr(metrics, "publish_resident_memory", lambda: written.append(1))
    for now in clock:
        monkeypatch.setattr(metrics.time, "monotonic", lambda now=now: now)
        metrics.publish_resident_memory_after_request()
    return len(written)


def test_one_process_writes_nothing_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    assert calls(monkeypatch, False, [0.0, 1.0, 2.0]) == 0


def test_multiprocess_writes_at_most_every_50_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10.0 writes; 10.01 and 10.049 are within 50 ms; 10.05 writes; 10.07 not; 10.2 writes
    assert calls(monkeypatch, True, [10.0, 10.01, 10.049, 10.05, 10.07, 10.2]) == 3


def test_a_scrape_reads_the_rss_itself() -> None:
    metrics.WORKER_RSS.set(0)
    page = metrics.exposition().decode()
    line = next(x for x in page.splitlines() if x.startswith("loopwarden_worker_resident_memory_bytes "))
    assert float(line.split()[1]) == pytest.approx(metrics.resident_memory_bytes(), rel=0.5)
    assert float(line.split()[1]) > 0
