"""The README's capacity walk against a real Prometheus (issue 20, items 4-6).

The same four steps a person runs, as processes: the gateway as ``make run`` starts it (the
``loopwarden serve`` console entry, embedded development model, ``--max-retained-bytes 8 MiB``),
``scripts/run-prometheus.sh`` (what ``make prometheus`` runs; 1 s scrapes here), the scripted load
``bench/capacity_load.py``, then ``loopwarden capacity --report``. The report's figures are checked
against what the load did: requests, cap hits at ``max_infer_iters`` and ``max_retained_bytes``,
their shares, the recommendations, the memory lines; the capacity dashboard's queries must give
the same shares. The charts (PNG and SVG) go to the test's tmp dir, and also to
``$LOOPWARDEN_CHARTS_DIR`` when set (to look at them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dashboards.queries import DASHBOARD_VARIABLES, QUERIES, substitute
from middleware.ops.capacity import MIB
from tests.ops.test_prometheus_live import _free_port, _scrapes, _wait_ready, _wait_scrapes

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 8 * MIB


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "LOOPWARDEN_LOG_FORMAT": "text"}


def _wait_http(url: str, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} did not answer {url} within 40 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, object], Path]]:
    """(Prometheus URL, the load's summary, tmp dir) after the load and three more scrapes."""
    assert shutil.which("prometheus"), "prometheus is not installed: run scripts/ensure-prometheus.sh"
    tmp = tmp_path_factory.mktemp("walk")
    port, prom_port = _free_port(), _free_port()
    logs = contextlib.ExitStack()
    gateway_log = logs.enter_context((tmp / "gateway.log").open("wb"))
    prom_log = logs.enter_context((tmp / "prometheus.log").open("wb"))
    serve = "from middleware.cli import main; raise SystemExit(main())"
    gateway = subprocess.Popen(
        [sys.executable, "-c", serve, "serve", "--port", str(port), "--max-retained-bytes", str(LIMIT)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=gateway_log,
    )
    prom = None
    try:
        _wait_http(f"http://127.0.0.1:{port}/metrics", "the gateway", gateway)
        prom = subprocess.Popen(
            ["bash", str(ROOT / "scripts/run-prometheus.sh")],
            env={
                **_env(),
                "TARGET": f"127.0.0.1:{port}",
                "PORT": str(prom_port),
                "INTERVAL": "1s",
                "DATA": str(tmp),
            },
            stdout=subprocess.DEVNULL,
            stderr=prom_log,
        )
        prom_url = f"http://127.0.0.1:{prom_port}"
        _wait_ready(prom_url)
        _wait_scrapes(prom_url, 2)
        before = _scrapes(prom_url)
        load = subprocess.run(
            [sys.executable, str(ROOT / "bench/capacity_load.py"), "--url", f"http://127.0.0.1:{port}"],
            env=_env(),
            capture_output=True,
            timeout=120,
            check=True,
        )
        summary = json.loads(load.stdout)
        _wait_scrapes(prom_url, before + 4)
        yield prom_url, summary, tmp
    finally:
        if prom is not None:
            _stop(prom)
        _stop(gateway)
        logs.close()


@pytest.fixture(scope="module")
def report(walk: tuple[str, dict[str, object], Path]) -> tuple[str, Path]:
    """(text report, charts dir) of ``loopwarden capacity --report FILE.html --plot DIR``."""
    prom_url, _, tmp = walk
    charts, page = tmp / "charts", tmp / "capacity.html"
    cmd = [sys.executable, "-m", "middleware.cli", "capacity", "--prometheus", prom_url, "--window", "10m"]
    run = subprocess.run(
        [*cmd, "--report", str(page), "--plot", str(charts)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    keep = os.environ.get("LOOPWARDEN_CHARTS_DIR")
    if keep:
        shutil.copytree(charts, keep, dirs_exist_ok=True)
        shutil.copy(page, keep)
    print(run.stdout)
    return run.stdout, charts


def test_the_load_did_what_it_says(walk: tuple[str, dict[str, object], Path]) -> None:
    _, summary, _ = walk
    assert summary["unexpected"] == {} and summary["requests"] == 90
    assert (summary["max_infer_iters_hits"], summary["max_retained_bytes_hits"]) == (6, 4)


def test_report_figures_match_the_load(report: tuple[str, Path]) -> None:
    text, _ = report
    # 90 requests had a ledger; the 4 refused at intake never reached the loop (86 counted rounds)
    assert "over the last 10m (90 requests" in text
    assert "max_infer_iters inferred from its cap hits" in text
    assert "max_retained_bytes inferred from peak / utilization" in text
    assert "6 of 86 requests (6.98 %) were stopped at max_infer_iters=10" in text
    assert "4 of 90 requests (4.44 %) were stopped at max_retained_bytes=8388608" in text
    rows = dict(re.findall(r"^ +(\S+(?: [KM]iB)?)  (\d.*%)$", text, re.M))
    assert rows["10"] == "6.98 %"  # the bug report's "0.00 %": now every stopped request counts
    assert rows["3"] == "6.98 %" and rows["1"] == f"{100 * 26 / 86:.2f} %"  # 20 tool requests + 6 loops
    assert rows["20"] == "0.00 .. 6.98 %"  # above the cap: the stopped ones' need is unknown
    assert rows["8 MiB"] == "4.44 %" and rows["16 MiB"] == "0.00 .. 4.44 %"
    # 20 medium requests peak at about 3 MiB: stopped by 2 MiB, plus the 4 refused
    assert rows["2 MiB"] == f"{100 * 20 / 90:.2f} .. {100 * 24 / 90:.2f} %"
    assert "tool-call duration (74 calls, 0 timed out)" in text  # 20 + 6 loops x 9 rounds that ran tools
    assert "max_infer_iters=10, " in text and "keeping max_infer_iters=10: the 6 requests" in text
    assert "runaway loops (every request that finished used at most 2 rounds" in text
    assert "recommended: max_retained_bytes=8388608 (8 MiB)" in text
    assert "keeping max_retained_bytes=8388608: the 4 requests refused" in text


def test_report_memory_lines_come_from_the_gauges(report: tuple[str, Path]) -> None:
    text, _ = report
    baseline, peak = map(
        float, re.search(r"worker RSS: baseline ([\d.]+) MiB .*, peak ([\d.]+) MiB", text).groups()
    )  # type: ignore[union-attr]
    assert 20 < baseline <= peak < 2000, (baseline, peak)
    ledger = float(re.search(r"peak live ledger sum ([\d.]+) MiB", text).group(1))  # type: ignore[union-attr]
    assert 2 < ledger < 4 * 8, ledger  # up to 4 concurrent requests of about 3 MiB each
    memory = int(re.search(r"memory per worker=(\d+) MiB", text).group(1))  # type: ignore[union-attr]
    assert memory >= 1.25 * (baseline + 8), (memory, baseline)  # at least one 8 MiB request, +25 %
    assert "x 1.25 margin" in text and "workers=1" in text


def test_charts_carry_title_axes_and_limit_markers(report: tuple[str, Path]) -> None:
    _, charts = report
    expect = {
        "retained_bytes_peak": [
            "Retained bytes per request",
            "peak retained bytes",
            "current max_retained_bytes = 8 MiB",
        ],
        "retained_utilization_ratio": [
            "utilization (peak / limit)",
            "peak / max_retained_bytes",
            "current limit",
        ],
        "inference_rounds": [
            "Inference rounds per request, last 10m, 86 requests",
            "inference rounds",
            "current max_infer_iters = 10",
            "recommended = 10",
            "stopped at the cap: 6",
        ],
        "tool_call_duration": [
            "tool-call duration, last 10m, 74 calls",
            "seconds",
            "current tool_timeout = 60 s",
        ],
    }
    for name, texts in expect.items():
        svg = (charts / f"{name}.svg").read_text()
        png = (charts / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
        for t in [*texts, "share of", "recommended"]:
            assert t in svg.replace("&gt;", ">"), (name, t)


def test_html_report_is_one_self_contained_page(
    walk: tuple[str, dict[str, object], Path], report: tuple[str, Path]
) -> None:
    _, _, tmp = walk
    page = (tmp / "capacity.html").read_text()
    assert page.count("<svg") == 4 and "Share of requests each max_infer_iters would have stopped" in page
    assert "<td>10</td><td>6.98 %</td><td>6.98 %</td><td>exact</td>" in page
    assert not re.search(r"""(src|href)=["']?(http|/|\.)""", page), "the page must not load anything"


def test_capacity_dashboard_shows_the_report_figures(walk: tuple[str, dict[str, object], Path]) -> None:
    prom_url, _, _ = walk
    variables = {**DASHBOARD_VARIABLES, "max_retained_bytes": str(LIMIT), "__range": "10m", "job": ".+"}
    expected = {
        "rejected_at_10_iters": 6 / 86,
        "rejected_at_10_iters_max": 6 / 86,
        "rejected_at_20_iters": 0.0,
        "rejected_at_20_iters_max": 6 / 86,
        "rejected_at_3_iters": 6 / 86,
        "rejected_at_8mib": 4 / 90,
        "rejected_at_8mib_max": 4 / 90,
        "rejected_at_16mib_max": 4 / 90,
        "rejected_at_4mib": 4 / 90,
    }
    for key, value in expected.items():
        r = httpx.get(prom_url + "/api/v1/query", params={"query": substitute(QUERIES[key].expr, variables)})
        result = r.json()["data"]["result"]
        assert result, key
        assert abs(float(result[0]["value"][1]) - value) < 0.002, (key, result, value)
