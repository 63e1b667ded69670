"""The app's Prometheus metrics are exactly the contract in `middleware.ops.metrics`, and that
contract is DESIGN.md §8.

`middleware.ops.metrics` defines the contract (`METRICS`: names, types, label names and allowed
values, buckets) and creates every metric from it; these tests hold the registered collectors
to it, keep metrics from being created anywhere else, and compare it with ../shared/DESIGN.md:
§8's table and cap-hit limits, §5's after-commit codes and the outcome table
(`middleware.outcomes`). What §8 declares for a capability that is not built yet is listed in a
``PENDING_*`` mapping with the issue that builds it, and must not be registered: whoever builds
it moves it out of the mapping and into the contract.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from middleware import outcomes
from middleware.ops import metrics

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT.parent / "shared" / "DESIGN.md"
METRIC_CLASSES = frozenset({"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"})

#: Metrics DESIGN.md §8 declares for capabilities not built yet, with the issue that builds each.
PENDING_METRICS: Mapping[str, str] = {}
#: Metrics the app registers that DESIGN.md §8 does not declare: each needs its §8 row, then
#: leaves this mapping.
UNDECLARED_METRICS: Mapping[str, str] = {
    "loopwarden_memory_pressure_ratio": "issue 10 (memory-pressure shedding): gauge, no labels",
    "loopwarden_worker_resident_memory_bytes": "issue 20 (capacity): gauge, no labels (largest live worker)",
    "loopwarden_worker_baseline_resident_memory_bytes": "issue 20 (capacity): gauge, no labels",
    "loopwarden_dropped_writes_total": "issue 20 (log hygiene): counter, no labels",
    "loopwarden_compactions_total": "issue 24 (compaction): counter, labels mode (upstream, gateway), "
    "outcome (ok, failed, fallback)",
    "loopwarden_background_tasks": "issue 23 (background responses): gauge, no labels; running here now",
    "loopwarden_background_outcomes_total": (
        "issue 23 (background responses): counter, `outcome` (completed, incomplete, failed, cancelled)"
    ),
}
#: Cap-hit ``limit`` values DESIGN.md §8 adds for the second batch, not built yet. The WebSocket
#: and translation values belong to those capabilities. (``caller_share``, issue "memory truth",
#: and ``client_write_timeout`` / ``header_timeout`` / ``max_connections``, issue 17 "hostile
#: network", are built: `metrics.CAP_LIMITS` values, pre-initialised.)
PENDING_CAP_LIMITS: Mapping[str, str] = {}
#: Labels the app's metrics have that DESIGN.md §8's table does not list yet: each needs its §8
#: entry (the capability's closing note proposes it), then leaves this mapping.
UNDECLARED_LABELS: Mapping[str, frozenset[str]] = {
    "loopwarden_cap_hits_total": frozenset(
        {"transport"}
    ),  # issue "WebSocket mode": §8 says "where it applies"
}
#: Cap-hit ``outcome`` values the app uses that DESIGN.md §8 does not list yet: each needs its §8
#: entry (the capability's closing note proposes it), then leaves this mapping.
UNDECLARED_CAP_OUTCOMES: Mapping[str, str] = {
    "closed": 'issue 17 (client_write_timeout): nothing answered, the connection closed (DESIGN §5 "client stops reading")',
}
#: Codes the gateway can send after commit that DESIGN.md §5 does not list as an error frame.
BEYOND_SECTION_5: Mapping[str, str] = {
    "internal_error": "a gateway defect (500 before commit), not a §5 row",
    "process_budget_exceeded": "the outcome table's pool_later row (PoolExhausted mid-request); §5 has no row",
    "store_unavailable": "the outcome table's store row (DESIGN §7); §5 has no row",
    "upstream_response_too_large": "the outcome table marks it after_commit; §5 shows no frame for it",
}


def _registered() -> dict[str, MetricWrapperBase]:
    """Every ``loopwarden_*`` metric in the process registry, by its full name."""
    found: dict[str, MetricWrapperBase] = {}
    for collector in list(REGISTRY._collector_to_names):  # no public way to list collectors
        if isinstance(collector, MetricWrapperBase) and collector._name.startswith("loopwarden_"):
            name = collector._name + ("_total" if collector._type == "counter" else "")
            found[name] = collector
    return found


def test_registered_collectors_are_the_contract() -> None:
    registered = _registered()
    assert sorted(registered) == sorted(metrics.METRICS)
    for name, collector in registered.items():
        spec = metrics.METRICS[name]
        assert collector._type == spec.type, name
        assert collector._documentation == spec.documentation, name
        assert collector._labelnames == tuple(spec.labels), name
        if spec.type == "histogram":
            assert spec.buckets is not None
            assert tuple(collector._upper_bounds) == (*spec.buckets, float("inf")), name
        else:
            assert spec.buckets is None, name


def test_preinitialised_label_sets_are_allowed_values_and_exported() -> None:
    exported = {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in REGISTRY.collect()
        for sample in family.samples
    }
    expected = [
        ("loopwarden_cap_hits_total", {"limit": limit, "outcome": outcome, "transport": transport})
        for limit, outcome in metrics.CAP_HIT_PAIRS
        for transport in metrics.TRANSPORTS
        if transport == "websocket" or limit not in metrics.WEBSOCKET_CAP_LIMITS
    ]
    expected += [
        ("loopwarden_websocket_turns_total", {"outcome": o}) for o in metrics.WEBSOCKET_TURN_OUTCOMES
    ]
    expected += [("loopwarden_upstream_errors_total", {"kind": k}) for k in metrics.UPSTREAM_ERROR_KINDS]
    expected += [("loopwarden_tool_calls_total", {"outcome": o}) for o in metrics.TOOL_OUTCOMES]
    expected += [("loopwarden_stream_errors_total", {"code": c}) for c in metrics.STREAM_ERROR_CODES]
    for name, labels in expected:
        allowed = metrics.METRICS[name].labels
        for label, value in labels.items():
            values = allowed[label]
            assert values is not None and value in values, (name, label, value)
        assert (name, tuple(sorted(labels.items()))) in exported, (name, labels)


def test_stream_error_label_folds_unknown_codes_into_upstream_error() -> None:
    assert metrics.stream_error_label("overloaded_error") == "upstream_error"
    assert metrics.stream_error_label("max_infer_iters_exceeded") == "max_infer_iters_exceeded"
    assert all(metrics.stream_error_label(code) == code for code in metrics.STREAM_ERROR_CODES)


def test_metrics_are_created_only_in_ops_metrics() -> None:
    """A metric created elsewhere would escape the contract (and the dashboards' checks)."""
    offenders = []
    for path in sorted((ROOT / "middleware").rglob("*.py")):
        if path == ROOT / "middleware" / "ops" / "metrics.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prometheus_client"):
                offenders += [f"{path}: imports {a.name}" for a in node.names if a.name in METRIC_CLASSES]
            if (
                isinstance(node, ast.Attribute)
                and node.attr in METRIC_CLASSES
                and isinstance(node.value, ast.Name)
                and node.value.id == "prometheus_client"
            ):
                offenders.append(f"{path}: uses prometheus_client.{node.attr}")
    assert offenders == []


# --- DESIGN.md ---------------------------------------------------------------------------------


def _section(number: str) -> str:
    if not DESIGN.is_file():
        pytest.skip(f"{DESIGN} not found: put ../shared beside the repo")
    return DESIGN.read_text(encoding="utf-8").split(f"\n## {number}.")[1].split("\n## ")[0]


def _declared() -> dict[str, tuple[str, set[str]]]:
    """§8's table: metric name -> (type, label names)."""
    declared: dict[str, tuple[str, set[str]]] = {}
    for row in _section("8").splitlines():
        if row.startswith("| `"):
            names_cell, type_cell, labels_cell = (cell.strip() for cell in row.strip("|").split("|"))
            for name in re.findall(r"`(\w+)`", names_cell):
                declared[name] = (type_cell, set(re.findall(r"`(\w+)`", labels_cell)))
    assert declared, "no metric rows found in DESIGN.md §8"
    return declared


def _listed(metric: str, label: str) -> set[str]:
    """The allowed values §8's table lists for `label` of `metric`."""
    row = next(line for line in _section("8").splitlines() if line.startswith(f"| `{metric}`"))
    match = re.search(rf"`{label}` \(([^)]*)\)", row)
    assert match is not None, (metric, label)
    return {v.strip() for v in match.group(1).split(",")}


def test_every_registered_metric_is_declared_in_design_section_8_with_its_type_and_labels() -> None:
    declared = _declared()
    registered = _registered()
    assert set(UNDECLARED_METRICS) <= set(registered), "an undeclared metric is gone: drop it here"
    assert set(UNDECLARED_METRICS).isdisjoint(declared), "§8 declares it now: drop it from UNDECLARED_METRICS"
    for name in sorted(set(registered) - set(UNDECLARED_METRICS)):
        assert name in declared, f"{name} is registered but not declared in DESIGN.md §8"
        spec = metrics.METRICS.get(name)
        assert spec is not None, f"{name} is registered but not in metrics.METRICS"
        undeclared = UNDECLARED_LABELS.get(name, frozenset())
        assert undeclared.isdisjoint(declared[name][1]), f"§8 lists {name}'s labels now: drop them here"
        assert declared[name] == (spec.type, set(spec.labels) - undeclared), name


def test_every_design_metric_is_registered_or_pending_on_its_issue() -> None:
    declared = _declared()
    registered = _registered()
    built = sorted(set(PENDING_METRICS) & (set(registered) | set(metrics.METRICS)))
    assert built == [], f"built now: move {built} out of PENDING_METRICS"
    missing = sorted(set(declared) - set(registered) - set(PENDING_METRICS))
    assert missing == [], f"declared in §8, neither registered nor in PENDING_METRICS: {missing}"
    assert set(PENDING_METRICS) <= set(declared), "§8 no longer declares a PENDING_METRICS entry"


def test_label_values_are_the_design_lists() -> None:
    design_outcomes = _listed("loopwarden_cap_hits_total", "outcome")
    assert design_outcomes.isdisjoint(UNDECLARED_CAP_OUTCOMES), (
        "§8 lists it now: drop it from UNDECLARED_CAP_OUTCOMES"
    )
    assert design_outcomes | set(UNDECLARED_CAP_OUTCOMES) == set(metrics.CAP_OUTCOMES)
    assert _listed("loopwarden_upstream_errors_total", "kind") == set(metrics.UPSTREAM_ERROR_KINDS)
    assert _listed("loopwarden_tool_calls_total", "outcome") == set(metrics.TOOL_OUTCOMES)


def test_cap_limits_are_the_design_lists_with_unbuilt_ones_pending() -> None:
    section = _section("8")
    second = re.search(r"Cap-hit `limit` values added by the second batch:([^.]*)\.", section)
    assert second is not None, "DESIGN.md §8 lost its second-batch cap-hit limits"
    design = _listed("loopwarden_cap_hits_total", "limit") | set(re.findall(r"`(\w+)`", second.group(1)))
    assert set(metrics.CAP_LIMITS) | set(PENDING_CAP_LIMITS) == design
    assert set(metrics.CAP_LIMITS).isdisjoint(PENDING_CAP_LIMITS), (
        "built now: move it out of PENDING_CAP_LIMITS"
    )
    exported = {
        sample.labels["limit"]
        for family in REGISTRY.collect()
        if family.name == "loopwarden_cap_hits"
        for sample in family.samples
    }
    assert exported and exported.isdisjoint(PENDING_CAP_LIMITS)


def test_stream_error_codes_are_the_outcome_tables_and_cover_design_section_5() -> None:
    assert set(metrics.STREAM_ERROR_CODES) == outcomes.stream_error_codes()
    assert len(set(metrics.STREAM_ERROR_CODES)) == len(metrics.STREAM_ERROR_CODES)
    after_commit: set[str] = set()
    for line in _section("5").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and "error" in cells[2]:  # "error frame", "error + response.failed"
            after_commit.update(re.findall(r"`(\w+)`", cells[3]))
    assert {"upstream_unavailable", "mcp_server_unavailable"} <= after_commit, "the §5 parse found too little"
    assert after_commit <= set(metrics.STREAM_ERROR_CODES)
    assert set(metrics.STREAM_ERROR_CODES) - after_commit == set(BEYOND_SECTION_5)
