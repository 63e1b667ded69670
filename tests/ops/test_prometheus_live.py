"""Observability against a real Prometheus (issue 7 item 3).

A loopback Prometheus (1 s scrape) scrapes a real gateway while a short, bounded workload hits
every cap that exists; then every dashboard query and alert expression (Grafana macros
substituted) must return at least one series (alerts, which fire only under fault, may be empty),
every metric a dashboard queries must be registered in the app's registry, and `promtool check
metrics` must accept /metrics.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from dashboards.promql import referenced_metrics
from dashboards.queries import all_expressions
from tests.helpers import FC, gateway, message_item, response_obj
from tests.loop.test_loop_e2e import TOOLS_DECL, build_server
from tests.mock_upstream import MockUpstream, Reply
from tests.servers import free_port as _free_port
from tests.servers import serve_asgi

# Empty only after a fault this workload must not cause (every dashboard panel query must have data).
MAY_BE_EMPTY = {"signal:LoopwardenInternalErrors"}


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    assert path is not None, "prometheus is not installed: run scripts/ensure-prometheus.sh (make test does)"
    return path


@pytest.fixture(scope="module")
def live(prometheus_binary: str) -> Iterator[tuple[str, str]]:
    """(gateway URL, Prometheus URL) after the workload, with at least two scrapes since."""
    mcp = build_server()
    with MockUpstream() as upstream, serve_asgi(mcp.streamable_http_app()) as mcp_base:
        gw = gateway(
            upstream,
            mcp_server=(f"tools={mcp_base}/mcp",),
            tool_timeout=0.5,
            client_body_timeout=0.5,
            max_infer_iters=2,
        )
        with gw as (url, _), tempfile.TemporaryDirectory() as tmp:
            port = _free_port()
            target = url.removeprefix("http://")
            config = Path(tmp) / "prometheus.yml"
            config.write_text(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: loopwarden\n"
                f"    static_configs:\n      - targets: ['{target}']\n"
            )
            prom = subprocess.Popen(
                [
                    prometheus_binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp}/data",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                prom_url = f"http://127.0.0.1:{port}"
                _wait_ready(prom_url)
                _wait_scrapes(prom_url, 1)  # the scrape manager starts its targets a few seconds late
                before = _scrapes(prom_url)
                _workload(url, upstream)
                _wait_scrapes(prom_url, before + 3)  # rate() needs two samples after the workload
                yield url, prom_url
            finally:
                prom.terminate()
                prom.wait(timeout=20)


def _wait_ready(prom_url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(prom_url + "/-/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("prometheus did not become ready within 30 s")


def _scrapes(prom_url: str) -> int:
    r = httpx.get(prom_url + "/api/v1/query", params={"query": "count_over_time(up[10m])"}, timeout=5)
    result = r.json()["data"]["result"]
    return int(result[0]["value"][1]) if result else 0


def _wait_scrapes(prom_url: str, n: int) -> None:
    deadline = time.monotonic() + 40
    while _scrapes(prom_url) < n:
        assert time.monotonic() < deadline, f"prometheus made fewer than {n} scrapes in 40 s"
        time.sleep(0.25)


def _workload(url: str, upstream: MockUpstream) -> None:
    """Bounded: about 20 requests, each cap that exists hit at least once."""
    post = lambda body, **kw: httpx.post(url + "/v1/responses", json=body, timeout=30, **kw)  # noqa: E731
    plain = {"model": "m", "input": "hi"}
    for _ in range(3):
        upstream.push(
            Reply.json(
                response_obj(
                    [message_item("ok")], usage={"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}
                )
            )
        )
        assert post(plain).status_code == 200
    assert post({"model": "m", "input": "a" * 800_000}).status_code == 413  # request_body (2/3 MiB)
    items = [{"role": "user", "content": "a"}] * 5000
    assert post({"model": "m", "input": items}).status_code == 413  # max_retained_bytes
    upstream.push(Reply.json(response_obj([message_item("x" * 500_000)])))
    assert post(plain).status_code == 502  # upstream_body (2/5 MiB)
    upstream.push(*[Reply.json(response_obj([FC(f"c{i}", "lookup", "{}")])) for i in range(2)])
    assert post({**plain, "tools": [TOOLS_DECL]}).status_code == 508
    upstream.push(Reply.json(response_obj([FC("a", "lookup", "{}"), FC("b", "lookup", "{}")])))
    assert post({**plain, "tools": [TOOLS_DECL], "max_tool_calls": 1}).json()["status"] == "incomplete"
    upstream.push(
        Reply.json(response_obj([FC("h", "hang", "{}")])), Reply.json(response_obj([message_item("done")]))
    )
    assert post({**plain, "tools": [TOOLS_DECL]}).status_code == 200  # tool_timeout
    upstream.push(
        Reply.sse(
            [
                b'event: response.created\ndata: {"type":"response.created","response":{"id":"r","status":"in_progress","output":[]}}\n\n',
                b'data: {"type":"response.output_text.delta","delta":"'
                + b"y" * 300_000
                + b'","output_index":0}\n\n',
            ]
        )
    )
    r = post({**plain, "stream": True})
    assert b"event: error" in r.content  # max_retained_bytes after commit
    upstream.push(Reply(status=500, parts=[b"boom"]))
    assert post(plain).status_code == 502
    with socket.create_connection(tuple(url.removeprefix("http://").split(":"))) as s:  # type: ignore[arg-type]
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        assert b"408" in s.recv(65536)


def test_every_dashboard_query_and_alert_returns_series(live: tuple[str, str]) -> None:
    _, prom_url = live
    empty = []
    for expression in all_expressions({"job": "loopwarden"}):
        r = httpx.get(prom_url + "/api/v1/query", params={"query": expression.expr}, timeout=10)
        assert r.status_code == 200, (expression.key, r.text)
        body = r.json()
        assert body["status"] == "success", (expression.key, body)
        if (
            not body["data"]["result"]
            and not expression.key.startswith("alert:")
            and expression.key not in MAY_BE_EMPTY
        ):
            empty.append(expression.key)
    assert empty == [], f"queries with no series after the workload: {empty}"


def test_every_queried_metric_is_registered_in_the_app() -> None:
    registered = set()
    for family in REGISTRY.collect():
        registered.update(sample.name for sample in family.samples)
        registered.add(family.name)
    queried: set[str] = set()
    for expression in all_expressions():
        queried.update(name for name in referenced_metrics(expression.expr) if name.startswith("loopwarden_"))
    missing = sorted(name for name in queried if name not in registered)
    assert queried and missing == [], f"dashboards query metrics the app does not register: {missing}"


def test_promtool_accepts_the_metrics_page(live: tuple[str, str]) -> None:
    url, _ = live
    text = httpx.get(url + "/metrics", timeout=10).text
    assert "loopwarden_cap_hits_total" in text
    proc = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cap_hits_were_scraped_with_the_right_labels(live: tuple[str, str]) -> None:
    _, prom_url = live
    r = httpx.get(prom_url + "/api/v1/query", params={"query": "loopwarden_cap_hits_total > 0"}, timeout=10)
    hit = {(s["metric"]["limit"], s["metric"]["outcome"]) for s in r.json()["data"]["result"]}
    want = {
        ("request_body", "413"),
        ("max_retained_bytes", "413"),
        ("upstream_body", "502"),
        ("max_infer_iters", "508"),
        ("max_tool_calls", "incomplete"),
        ("tool_timeout", "tool_error"),
        ("max_retained_bytes", "sse_error"),
        ("client_body_timeout", "408"),
    }
    assert want <= hit, want - hit


def test_capacity_report_on_the_ci_workload(
    live: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from middleware.cli import main

    _, prom_url = live
    assert main(["capacity", "--prometheus", prom_url, "--window", "10m", "--plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in (
        "retained_bytes_peak",
        "retained_utilization_ratio",
        "inference_rounds",
        "tool_call_duration",
    ):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "<svg" in (tmp_path / f"{name}.svg").read_text()
    print(out)
    assert "retained bytes per request" in out
    assert "recommended: max_retained_bytes=" in out
    assert "inference rounds per request" in out
    # the workload's one 508 at max_infer_iters=2 is counted as stopped by a cap of 2 (not 0 %)
    assert "1 of " in out and "were stopped at max_infer_iters=2" in out
    # the workload's largest ledger peak is about 1 MiB (its limit), so 8 MiB stops only the refused ones
    assert re.search(r"^ +8 MiB  0[.]00 [.][.] \d", out, re.M), out


def test_capacity_without_prometheus_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from middleware.cli import main

    assert main(["capacity", "--prometheus", f"http://127.0.0.1:{_free_port()}"]) == 1
    assert "cannot query Prometheus" in capsys.readouterr().err
