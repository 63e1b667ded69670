"""`--workers 2`: the client library's multiprocess mode aggregates every worker's metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import wait_healthy


def _requests_200(text: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == "loopwarden_requests":
            return sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total") and s.labels.get("status") == "200"
            )
    return 0.0


def test_two_workers_report_aggregated_counters_whichever_answers() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="lw-test-metrics-")
    (Path(metrics_dir) / "stale_counter_999.db").write_bytes(b"junk from an earlier run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWARDEN_")}
    env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    cli = str(Path(sys.executable).parent / "loopwarden")
    proc = subprocess.Popen(
        [cli, "serve", "--port", str(port), "--workers", "2", "--log-level", "warning", "--store", "memory"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout=40, what="two workers")
        n = 40
        for _ in range(n):  # a new connection each time, so both workers get some
            r = httpx.post(base + "/v1/responses", json={"model": "dev", "input": "hi"}, timeout=20)
            assert r.status_code == 200
        scrapes = [httpx.get(base + "/metrics", timeout=10) for _ in range(6)]
        assert httpx.get(base + "/metrics/", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert all(s.status_code == 200 for s in scrapes)
    assert [_requests_200(s.text) for s in scrapes] == [float(n)] * len(scrapes)
    assert not (Path(metrics_dir) / "stale_counter_999.db").exists(), "the directory is wiped at start"
