"""dashboards/: generated files are current, dashboards and alerts keep the metric contract.

A typo'd metric name or label value in a dashboard query makes Prometheus answer with zero
series, not an error, so every expression is checked against the metric contract
(`middleware.ops.metrics`, re-exported by `dashboards.queries`; tests/unit/test_metrics_contract.py
holds it to DESIGN.md §8), and parsed by a real ``promtool`` after the Grafana macros are
substituted. ``promtool`` comes from ``scripts/ensure-prometheus.sh`` (``make test`` runs it);
without it these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from prometheus_client import utils as prometheus_utils

from dashboards import generate
from dashboards import queries as q
from dashboards.promql import (
    PromQLLexError,
    go_float,
    le_forms,
    le_regex,
    referenced_metrics,
    selectors,
    substitute,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
GRAFANA = DASHBOARDS / "grafana"
DASHBOARD_FILES = sorted(GRAFANA.glob("*.json"))
#: How the app's prometheus-client writes a bucket bound in ``le`` (``4096.0``, ``1.6777216e+07``).
floatToGoString = cast(Callable[[float], str], prometheus_utils.floatToGoString)


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _dashboard_targets() -> list[tuple[str, str]]:
    """(where, expr) for every target of every committed dashboard, macros not substituted."""
    return [
        (f"{path.name}: {panel['title']} ({target['refId']})", target["expr"])
        for path in DASHBOARD_FILES
        for panel in _panels(_load(path))
        for target in panel.get("targets", [])
    ]


def _alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"]]


def _all_expressions() -> list[tuple[str, str]]:
    """(where, plain PromQL) for every dashboard target, alert rule and alert signal."""
    found = [(where, substitute(expr, q.DASHBOARD_VARIABLES)) for where, expr in _dashboard_targets()]
    found += [(f"alerts.yml: {rule['alert']}", rule["expr"]) for rule in _alert_rules()]
    found += [(f"signal of {alert.name}", alert.signal) for alert in q.ALERTS]
    return found


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not on PATH: run scripts/ensure-prometheus.sh (make test runs it first)",
            pytrace=False,
        )
    return path


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, check=False)


def _rules_file(tmp_path: Path, expressions: list[tuple[str, str]]) -> Path:
    """A rule file recording each expression (JSON is YAML), so ``promtool check rules`` parses them."""
    rules = [
        {"record": f"loopwarden_check:expr_{i:03d}", "expr": expr} for i, (_, expr) in enumerate(expressions)
    ]
    path = tmp_path / "queries.rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard-queries", "rules": rules}]}, indent=1))
    return path


# --- generator ---------------------------------------------------------------------------------


def test_committed_files_are_what_the_generator_writes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dashboards.generate", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_stale_or_missing_file_and_says_to_rerun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    board = tmp_path / "grafana" / "loopwarden-capacity.json"
    board.write_text(board.read_text().replace("loopwarden_inference_rounds", "loopwarden_inference_round"))
    (tmp_path / "alerts.yml").unlink()

    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "loopwarden-capacity.json is stale" in err
    assert "alerts.yml is missing" in err
    assert "rerun `python -m dashboards.generate`" in err


def test_generated_yaml_reads_back_as_the_data_it_was_written_from() -> None:
    assert yaml.safe_load((DASHBOARDS / "alerts.yml").read_text()) == generate.alert_rules()
    for relative, text in generate.outputs().items():
        if relative.endswith((".yml", ".yaml")):
            assert isinstance(yaml.safe_load(text), dict), relative
    tricky = {"a": ["yes", "1", "x: y", "#not a comment", "two\nlines", " lead\nx", "é"], "b": {}, "c": []}
    assert yaml.safe_load(generate.to_yaml(tricky)) == tricky


# --- dashboard structure -----------------------------------------------------------------------


def test_both_dashboards_are_committed_with_stable_uids() -> None:
    assert [p.name for p in DASHBOARD_FILES] == ["loopwarden-capacity.json", "loopwarden-operations.json"]
    assert {_load(p)["uid"] for p in DASHBOARD_FILES} == {"loopwarden-capacity", "loopwarden-operations"}


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_shape(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    board = _load(path)
    assert board["schemaVersion"] == 39
    assert "__inputs" not in text and "${DS_" not in text, (
        "exported-for-sharing dashboards cannot be provisioned"
    )
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["definition"] == f"label_values({q.JOB_VARIABLE_METRIC}, job)"
    assert q.JOB_VARIABLE_METRIC in q.METRICS
    ids = [panel["id"] for panel in _panels(board)]
    assert len(ids) == len(set(ids))
    for panel in _panels(board):
        assert panel.get("description", "").strip(), f"panel {panel['title']!r} has no description"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            if panel["type"] == "heatmap":
                assert target["format"] == "heatmap"


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_every_panel_description_names_the_metrics_it_queries(path: Path) -> None:
    names = q.series_names()
    for panel in _panels(_load(path)):
        for target in panel.get("targets", []):
            for series in referenced_metrics(substitute(target["expr"], q.DASHBOARD_VARIABLES)):
                assert f"`{names[series]}`" in panel["description"], (panel["title"], series)


def test_rates_use_grafana_intervals_not_fixed_windows() -> None:
    for where, expr in _dashboard_targets():
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
        windows = re.findall(r"\[([^\]]*)\]", outside_strings)
        if "rate(" in expr or "increase(" in expr:
            assert windows, where
        for window in windows:
            assert window in {"$__rate_interval", "$__range"}, (where, window)


def test_every_design_metric_is_on_a_dashboard() -> None:
    names = q.series_names()
    shown = {
        names[series]
        for _, expr in _dashboard_targets()
        for series in referenced_metrics(substitute(expr, q.DASHBOARD_VARIABLES))
    }
    assert set(q.METRICS) <= shown


def test_dashboards_and_alerts_run_exactly_the_catalogued_expressions() -> None:
    """The live check runs `all_expressions()`: it must cover everything that ships."""
    catalogued = {query.expr for query in q.QUERIES.values()}
    used = {expr for _, expr in _dashboard_targets()}
    assert used == catalogued
    assert [rule["expr"] for rule in _alert_rules()] == [alert.expr for alert in q.ALERTS]
    keys = [e.key for e in q.all_expressions()]
    assert len(keys) == len(set(keys)) == len(q.QUERIES) + 2 * len(q.ALERTS)
    for expression in q.all_expressions():
        assert "$" not in expression.expr, expression.key


# --- the metric contract -----------------------------------------------------------------------


def test_every_expression_keeps_the_metric_contract() -> None:
    problems = [
        f"{where}: {problem}" for where, expr in _all_expressions() for problem in q.contract_problems(expr)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("sum(rate(loopwarden_request_total[1m]))", "loopwarden_request_total is not a metric"),
        ("loopwarden_retained_bytes_peak", "loopwarden_retained_bytes_peak is not a metric"),
        ("process_cpu_seconds_total", "is not a metric"),
        ('loopwarden_cap_hits_total{limit="max_retained_byte"}', "'max_retained_byte' is not one of"),
        ('loopwarden_cap_hits_total{outcome=~"5[0-9][0-9]x"}', "the regex matches none"),
        ('loopwarden_upstream_errors_total{code="timeout"}', "has no label 'code'"),
        ('loopwarden_requests_total{status="600"}', "'600' is not one of"),
        ('loopwarden_retained_bytes_peak_bucket{le="16777216"}', "selects 0 bucket bounds"),
        ('loopwarden_retained_bytes_peak_bucket{le=~"1.*"}', "bucket bounds, not 1"),
        ('{__name__="loopwarden_requests_total"}', "selector without a metric name"),
    ],
)
def test_contract_check_catches_what_prometheus_would_answer_with_nothing(expr: str, problem: str) -> None:
    assert any(problem in found for found in q.contract_problems(expr)), q.contract_problems(expr)


def test_free_form_labels_and_target_labels_pass() -> None:
    assert q.contract_problems('loopwarden_requests_total{model="gpt-4o", job="x", instance="y:1"}') == []
    assert q.contract_problems('loopwarden_retained_bytes_peak_bucket{le="1.6777216e+07"}') == []


def test_cap_hit_pairs_use_known_limits_and_outcomes() -> None:
    assert len(set(q.CAP_HIT_PAIRS)) == len(q.CAP_HIT_PAIRS)
    assert {limit for limit, _ in q.CAP_HIT_PAIRS} == set(q.CAP_LIMITS)
    assert {outcome for _, outcome in q.CAP_HIT_PAIRS} <= set(q.CAP_OUTCOMES)


# --- buckets -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", [s for s in q.METRICS.values() if s.type == "histogram"], ids=lambda s: s.name
)
def test_histogram_buckets_are_increasing_and_le_regexes_pick_exactly_one(spec: q.MetricSpec) -> None:
    assert spec.buckets is not None
    assert list(spec.buckets) == sorted(set(spec.buckets))
    for bound in spec.buckets:
        exposed = floatToGoString(bound)  # what the app's prometheus-client writes in `le`
        assert go_float(bound) == exposed
        assert exposed in le_forms(bound)
        pattern = le_regex(bound)
        assert re.fullmatch(pattern, exposed)
        others = [b for b in spec.buckets if b != bound and re.fullmatch(pattern, floatToGoString(b))]
        assert others == [], (bound, others)


def test_bucket_ranges_follow_design() -> None:
    assert q.RETAINED_BYTES_BUCKETS[0] == 4096 and q.RETAINED_BYTES_BUCKETS[-1] == 268435456
    # 8 bounds per doubling (issue 20): every power of two is a bound, 7 integers between each pair
    powers = [float(4096 * 2**i) for i in range(17)]
    assert q.RETAINED_BYTES_BUCKETS[::8] == tuple(powers)
    assert len(q.RETAINED_BYTES_BUCKETS) == 16 * 8 + 1 and all(
        b.is_integer() for b in q.RETAINED_BYTES_BUCKETS
    )
    ratios = [b2 / b1 for b1, b2 in zip(q.RETAINED_BYTES_BUCKETS, q.RETAINED_BYTES_BUCKETS[1:], strict=False)]
    assert all(abs(r - 2 ** (1 / 8)) < 1e-3 for r in ratios), ratios
    assert tuple(float(i) for i in range(1, 101)) == q.ROUNDS_BUCKETS  # every integer up to the largest cap
    assert {0.5, 0.25, 0.125, 0.9, 0.95, 0.99} <= set(q.UTILIZATION_BUCKETS)
    assert q.LATENCY_BUCKETS[-1] == 600
    assert q.UTILIZATION_BUCKETS[-1] == 1.0
    assert set(q.CANDIDATE_RETAINED_LIMITS) <= set(q.RETAINED_BYTES_BUCKETS)
    assert q.DEFAULT_MAX_RETAINED_BYTES in q.RETAINED_BYTES_BUCKETS
    assert set(q.CANDIDATE_INFER_ITERS) <= set(q.ROUNDS_BUCKETS)
    assert {0.5, 0.9} <= set(q.UTILIZATION_BUCKETS)


# --- Grafana macros and the PromQL reader ------------------------------------------------------


def test_substitute_replaces_every_grafana_form_and_rejects_unknown_variables() -> None:
    text = 'rate(x{job=~"$job"}[$__rate_interval]) / ${max_retained_bytes} + [[job]] + $__range_s + $__range'
    assert (
        substitute(text, {"job": ".+", "max_retained_bytes": "7"})
        == 'rate(x{job=~".+"}[1m]) / 7 + .+ + 3600 + 1h'
    )
    with pytest.raises(PromQLLexError, match=r"\$nope"):
        substitute("rate(x[$nope])")
    with pytest.raises(PromQLLexError, match="substitute"):
        selectors("rate(x[$__rate_interval])")


def test_selectors_skip_functions_keywords_and_grouping_labels() -> None:
    expr = (
        'sum by (le) (rate(a_bucket{k="v", j=~"x|y"}[5m])) / on (job) group_left b'
        " and sum without (instance) (c) unless d[5m:1m] offset 1h > bool Inf"
    )
    assert referenced_metrics(expr) == {"a_bucket", "b", "c", "d"}
    assert selectors('x{a!="1", b!~`r\\.`}')[0].matchers == (("a", "!=", "1"), ("b", "!~", "r\\."))


# --- promtool ----------------------------------------------------------------------------------


def test_every_dashboard_query_and_alert_expression_parses_with_promtool(
    promtool: str, tmp_path: Path
) -> None:
    expressions = _all_expressions()
    result = _promtool(promtool, "check", "rules", str(_rules_file(tmp_path, expressions)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout


def test_promtool_rejects_unsubstituted_macros_and_bad_syntax(promtool: str, tmp_path: Path) -> None:
    """The parse check above is only worth something if promtool does fail on these."""
    for expr in (
        "rate(loopwarden_requests_total[$__rate_interval])",
        "sum(rate(loopwarden_requests_total[1m])",
    ):
        result = _promtool(promtool, "check", "rules", str(_rules_file(tmp_path, [("bad", expr)])))
        assert result.returncode != 0, expr


def test_alert_rules_pass_promtool_check(promtool: str) -> None:
    result = _promtool(promtool, "check", "rules", str(DASHBOARDS / "alerts.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rule_unit_tests_pass(promtool: str) -> None:
    result = _promtool(promtool, "test", "rules", str(DASHBOARDS / "alerts_test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    cases = yaml.safe_load((DASHBOARDS / "alerts_test.yml").read_text(encoding="utf-8"))["tests"]
    checks = [check for case in cases for check in case["alert_rule_test"]]
    fired = {check["alertname"] for check in checks if check["exp_alerts"]}
    silent = {check["alertname"] for check in checks if not check["exp_alerts"]}
    names = {alert.name for alert in q.ALERTS}
    assert fired == names
    assert silent == names


def test_alerts_say_what_to_do() -> None:
    for rule in _alert_rules():
        assert rule["for"], rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    settings = re.compile(r"--[a-z-]+|WORKER_MEMORY_BYTES|no setting fixes this")
    for alert in q.ALERTS:
        assert settings.search(alert.description), f"{alert.name}: name the setting to change"


def _histogram_input(
    spec: q.MetricSpec, job: str, per_minute: dict[float, float], le_text: Any
) -> list[dict[str, str]]:
    """promtool input series for histogram `spec`: `per_minute[bound]` observations at or below bound."""
    assert spec.buckets is not None
    series = []
    for bound in [*spec.buckets, float("inf")]:
        below = max((n for b, n in per_minute.items() if b <= bound), default=0.0)
        le = "+Inf" if bound == float("inf") else le_text(bound)
        labels = f'job="{job}", instance="gw-1:8000", le="{le}"'
        series.append({"series": f"{spec.name}_bucket{{{labels}}}", "values": f"0+{below}x60"})
    total = max(per_minute.values())
    series.append(
        {"series": f'{spec.name}_count{{job="{job}", instance="gw-1:8000"}}', "values": f"0+{total}x60"}
    )
    return series


def _go_client_le(bound: float) -> str:
    """``le`` as Go's client writes it (``%g``-like shortest form: ``4096``, ``1.6777216e+07``)."""
    text = floatToGoString(bound)
    return text.removesuffix(".0")


@pytest.mark.parametrize(
    "le_text", [floatToGoString, _go_client_le], ids=["python-client-le", "go-client-le"]
)
def test_candidate_limit_queries_compute_the_rejected_share(
    promtool: str, tmp_path: Path, le_text: Any
) -> None:
    """Run the capacity panels' PromQL on a known distribution in promtool's PromQL engine.

    Per minute: 100 requests; peaks: 60 up to 8 MiB, 25 up to 16 MiB, 10 up to 32 MiB, 5 up to
    64 MiB, and 5 more requests refused at max_retained_bytes=64 MiB (censored, recorded among the
    peaks above). Rounds: 70 with 1, 20 with up to 5, 10 stopped at max_infer_iters=10 (censored:
    recorded with 10 rounds, they needed more; the bug report's "a cap of 10 stops 0 %" case).
    """
    mib = float(q.MiB)
    peaks = {8 * mib: 60.0, 16 * mib: 85.0, 32 * mib: 95.0, 64 * mib: 100.0}
    rounds = {1.0: 70.0, 5.0: 90.0, 10.0: 100.0}
    utilization = {0.5: 80.0, 0.9: 96.0, 1.0: 100.0}
    hits = [
        {
            "series": f'loopwarden_cap_hits_total{{job="lw", instance="gw-1:8000", limit="{limit}", outcome="{o}", transport="http"}}',
            "values": f"0+{n}x60",
        }
        for limit, o, n in (("max_infer_iters", "508", 10), ("max_retained_bytes", "413", 5))
    ]
    series = (
        _histogram_input(q.METRICS["loopwarden_retained_bytes_peak"], "lw", peaks, le_text)
        + _histogram_input(q.METRICS["loopwarden_inference_rounds"], "lw", rounds, le_text)
        + _histogram_input(q.METRICS["loopwarden_retained_utilization_ratio"], "lw", utilization, le_text)
        + hits
    )
    expected = {
        "rejected_at_4mib": 1.0,
        "rejected_at_4mib_max": 1.0,
        "rejected_at_8mib": 0.4,
        "rejected_at_8mib_max": 0.45,
        "rejected_at_16mib": 0.15,
        "rejected_at_16mib_max": 0.2,
        "rejected_at_32mib": 0.05,
        "rejected_at_32mib_max": 0.1,
        "rejected_at_64mib": 0.05,  # every refused request needed more than 64 MiB
        "rejected_at_64mib_max": 0.05,
        "rejected_at_128mib": 0.0,
        "rejected_at_128mib_max": 0.05,  # unknown: they may need more than 128 MiB
        "rejected_at_3_iters": 0.3,
        "rejected_at_3_iters_max": 0.3,
        "rejected_at_5_iters": 0.1,
        "rejected_at_5_iters_max": 0.1,
        "rejected_at_10_iters": 0.1,  # the 10 stopped at the cap (the old query said 0)
        "rejected_at_10_iters_max": 0.1,
        "rejected_at_20_iters": 0.0,
        "rejected_at_20_iters_max": 0.1,
        "utilization_over_50": 0.2,
        "utilization_over_90": 0.04,
    }
    variables = {**q.DASHBOARD_VARIABLES, "job": "lw", "__range": "30m", "__rate_interval": "5m"}
    tests = [
        {
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [
                {
                    # round(): promtool compares floats exactly; 1 - 0.85 is 0.15000000000000002.
                    "expr": f"round({substitute(q.QUERIES[key].expr, variables)}, 0.0001)",
                    "eval_time": "50m",
                    "exp_samples": [{"labels": "{}", "value": value}],
                }
                for key, value in expected.items()
            ],
        }
    ]
    path = tmp_path / "capacity_test.yml"
    path.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m", "tests": tests}, indent=1))
    result = _promtool(promtool, "test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
