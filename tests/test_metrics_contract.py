"""The app's Prometheus metrics are exactly the contract in `middleware.ops.metrics` (DESIGN.md §8).

`middleware.ops.metrics` defines the contract (`METRICS`: names, types, label names and allowed
values, buckets) and creates every metric from it; these tests hold the registered collectors
to it, and keep metrics from being defined anywhere else.
"""

from __future__ import annotations

import ast
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from middleware.ops import metrics

ROOT = Path(__file__).resolve().parents[1]
METRIC_CLASSES = frozenset({"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"})


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
        ("loopwarden_cap_hits_total", {"limit": limit, "outcome": outcome})
        for limit, outcome in metrics.CAP_HIT_PAIRS
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
