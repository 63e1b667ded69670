"""Write loopwarden's Grafana dashboards, Grafana provisioning files and Prometheus alert rules.

Usage (from the repository root, with the project's dependencies installed: the metric contract
is `middleware.ops.metrics`, which needs prometheus-client)::

    python -m dashboards.generate           # (re)write the files under dashboards/
    python -m dashboards.generate --check   # exit 1 if a committed file differs from what this writes

Everything is derived from `dashboards.queries` (PromQL, thresholds, the re-exported metric
contract), so a dashboard, an alert and the live check can never disagree about a query. Output is
deterministic: stable uids, stable panel ids, sorted nothing that order matters for.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboards import queries as q
from dashboards.promql import referenced_metrics, substitute

__all__ = ["Panel", "Row", "alert_rules", "dashboards", "main", "outputs", "to_yaml"]

PACKAGE_DIR = Path(__file__).resolve().parent
GRAFANA_DIR = "grafana"
#: Where the dashboards provider expects the JSON files inside the Grafana container.
GRAFANA_DASHBOARDS_PATH = "/var/lib/grafana/dashboards/loopwarden"
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

JSON = dict[str, Any]


# --- panels ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Panel:
    """One Grafana panel: what it shows (`text`, to which the metric list is appended) and its queries."""

    title: str
    text: str
    queries: Sequence[str]  # keys of `dashboards.queries.QUERIES`
    kind: str = "timeseries"  # timeseries, stat, bargauge, heatmap
    unit: str = "short"
    width: int = 12
    height: int = 8
    options: Mapping[str, Any] = field(default_factory=dict)
    instant: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    text: str


def _metric_families(keys: Iterable[str]) -> list[str]:
    names = q.series_names()
    families: set[str] = set()
    for key in keys:
        for series in referenced_metrics(substitute(q.QUERIES[key].expr, q.DASHBOARD_VARIABLES)):
            families.add(names.get(series, series))
    return sorted(families)


def _description(panel: Panel) -> str:
    metrics = ", ".join(f"`{name}`" for name in _metric_families(panel.queries))
    return f"{panel.text}\n\nMetrics: {metrics}." if metrics else panel.text


def _target(key: str, ref_id: str, panel: Panel) -> JSON:
    query = q.QUERIES[key]
    target: JSON = {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": query.expr,
        "legendFormat": query.legend or "__auto",
        "range": not panel.instant,
        "instant": panel.instant,
        "refId": ref_id,
    }
    if panel.kind == "heatmap":
        target["format"] = "heatmap"
    return target


def _field_config(panel: Panel) -> JSON:
    defaults: JSON = {"unit": panel.unit, "color": {"mode": "palette-classic"}}
    overrides: list[JSON] = []
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "axisSoftMin": 0,
        }
        # Reference lines (configured limit, worker memory) are dashed and not filled.
        for key in panel.queries:
            if q.QUERIES[key].expr.startswith("vector("):
                overrides.append(
                    {
                        "matcher": {"id": "byName", "options": q.QUERIES[key].legend},
                        "properties": [
                            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                            {"id": "custom.fillOpacity", "value": 0},
                            {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                        ],
                    }
                )
    elif panel.kind in {"stat", "bargauge"}:
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [
                {"color": "green", "value": None},
                {"color": "orange", "value": 0.01},
                {"color": "red", "value": 0.05},
            ]
            if panel.unit == "percentunit"
            else [{"color": "green", "value": None}],
        }
        if panel.unit == "percentunit":
            defaults["min"] = 0
            defaults["max"] = 1
    return {"defaults": defaults, "overrides": overrides}


def _options(panel: Panel) -> JSON:
    if panel.kind == "timeseries":
        options: JSON = {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
                "calcs": ["mean", "max", "lastNotNull"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif panel.kind == "stat":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    elif panel.kind == "bargauge":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "horizontal",
            "displayMode": "gradient",
            "showUnfilled": True,
            "valueMode": "color",
        }
    elif panel.kind == "heatmap":
        options = {
            "calculate": False,
            "cellGap": 1,
            "color": {
                "mode": "scheme",
                "scheme": "Oranges",
                "scale": "exponential",
                "exponent": 0.5,
                "steps": 64,
            },
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "le"},
            "tooltip": {"mode": "single", "yHistogram": True},
            "yAxis": {"axisPlacement": "left", "unit": "percentunit"},
        }
    else:  # pragma: no cover - guarded by the Panel definitions below
        raise ValueError(f"unknown panel kind {panel.kind!r}")
    return {**options, **panel.options}


def _layout(items: Sequence[Panel | Row]) -> list[JSON]:
    """Grafana panels with ids and a 24-column grid, filled left to right, top to bottom."""
    result: list[JSON] = []
    x = y = row_height = 0
    for panel_id, item in enumerate(items, start=1):
        if isinstance(item, Row):
            y += row_height
            x = row_height = 0
            result.append(
                {
                    "type": "row",
                    "id": panel_id,
                    "title": item.title,
                    "description": item.text,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                    "panels": [],
                }
            )
            y += 1
            continue
        if x + item.width > 24:
            y += row_height
            x = row_height = 0
        result.append(
            {
                "type": item.kind,
                "id": panel_id,
                "title": item.title,
                "description": _description(item),
                "datasource": DATASOURCE,
                "gridPos": {"h": item.height, "w": item.width, "x": x, "y": y},
                "targets": [_target(key, chr(ord("A") + i), item) for i, key in enumerate(item.queries)],
                "fieldConfig": _field_config(item),
                "options": _options(item),
            }
        )
        x += item.width
        row_height = max(row_height, item.height)
    return result


# --- dashboards --------------------------------------------------------------------------------


def _datasource_variable() -> JSON:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }


def _job_variable() -> JSON:
    definition = f"label_values({q.JOB_VARIABLE_METRIC}, job)"
    return {
        "name": "job",
        "label": "Job",
        "type": "query",
        "datasource": DATASOURCE,
        "definition": definition,
        "query": {"query": definition, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "current": {},
        "hide": 0,
        "includeAll": True,
        "multi": True,
        "options": [],
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
    }


def _textbox_variable(name: str, label: str, description: str) -> JSON:
    value = q.DASHBOARD_VARIABLES[name]
    return {
        "name": name,
        "label": label,
        "description": description,
        "type": "textbox",
        "query": value,
        "current": {"selected": False, "text": value, "value": value},
        "options": [{"selected": True, "text": value, "value": value}],
        "hide": 0,
        "skipUrlSync": False,
    }


def _dashboard(
    uid: str, title: str, description: str, items: Sequence[Panel | Row], variables: list[JSON]
) -> JSON:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["loopwarden"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "title": "loopwarden dashboards",
                "type": "dashboards",
                "tags": ["loopwarden"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "templating": {"list": [_datasource_variable(), _job_variable(), *variables]},
        "panels": _layout(items),
    }


def _quantile_keys(prefix: str) -> list[str]:
    return [f"{prefix}_p{round(v * 100)}" for v in q.QUANTILES]


def _operations() -> JSON:
    items: list[Panel | Row] = [
        Row("Traffic", "Requests answered, in flight and abandoned."),
        Panel(
            "Requests by status",
            "Requests answered per second, by HTTP status. Errors sent after a stream was committed keep"
            " status 200: see 'SSE error frames' below.",
            ["requests_by_status"],
            unit="reqps",
        ),
        Panel(
            "Requests by model",
            "Requests answered per second, by model label (configured model names; every other model is 'other').",
            ["requests_by_model"],
            unit="reqps",
        ),
        Panel(
            "Non-2xx share",
            "Share of requests answered with a status other than 2xx.",
            ["non_2xx_ratio"],
            kind="stat",
            unit="percentunit",
            width=6,
            height=6,
        ),
        Panel(
            "Gateway targets up",
            "Scrape targets of the selected jobs that answered Prometheus' last scrape, and how many there are.",
            ["targets_up", "targets_total"],
            kind="stat",
            width=6,
            height=6,
        ),
        Panel(
            "Requests in flight",
            "Requests being served now, per instance.",
            ["inflight_requests"],
            width=6,
            height=6,
        ),
        Panel(
            "Client disconnects",
            "Requests per second whose client went away before the answer was complete; upstream reads and"
            " running tools are cancelled. Dropped writes: writes per second to a connection that was already"
            " closing (a client reset mid-stream), dropped and counted instead of logged.",
            ["client_disconnects", "dropped_writes"],
            unit="reqps",
            width=6,
            height=6,
        ),
        Panel(
            "Retry shield hits",
            "Requests per second answered by the retry shield: identical to one of the same caller that failed"
            " deterministically within --retry-shield-seconds, answered again without an upstream call (a"
            " client retrying what it should not).",
            ["retry_shield_hits"],
            unit="reqps",
            width=6,
            height=6,
        ),
        Panel(
            "Background responses running",
            "background: true responses running now, per instance (each holds its reservation and ledger).",
            ["background_tasks_by_instance"],
            width=12,
            height=6,
        ),
        Panel(
            "Background responses ended",
            "Background responses ended per second, by stored status (completed, incomplete, failed,"
            " cancelled); failed includes background_worker_lost (a worker's lease passed) and"
            " server_shutting_down.",
            ["background_outcomes"],
            unit="ops",
            width=12,
            height=6,
        ),
        Row("Cap hits", "Requests stopped or cut by a limit, and what the client got."),
        Panel(
            "Cap hits by limit and outcome",
            "Cap hits per second by limit (max_retained_bytes, request_body, upstream_body, max_infer_iters,"
            " max_tool_calls, tool_timeout, client_body_timeout, request_deadline, admission, caller_share,"
            " client_write_timeout, header_timeout, max_connections, websocket_lifetime, websocket_idle,"
            " websocket_message_size)"
            " and outcome"
            " (HTTP status, sse_error, incomplete, tool_error).",
            ["cap_hits_by_limit_outcome"],
            unit="ops",
        ),
        Panel(
            "Cap hits per request",
            "Cap hits divided by requests answered; max_tool_calls is left out because it is the client's own"
            " request field. The LoopwardenCapHitRatioHigh alert fires above"
            f" {q.CAP_HIT_RATIO_THRESHOLD:.0%}.",
            ["cap_hit_ratio"],
            unit="percentunit",
        ),
        Panel(
            "413 / 502 / 508 and SSE errors",
            "Requests per second answered 413 (request too large or ledger overflow on the payload), 502"
            " (ledger overflow or bad upstream answer before commit), 508 (max_infer_iters: loop detected),"
            " and SSE error frames sent after commit, which the status counter cannot show.",
            ["status_413_502_508", "sse_errors"],
            unit="reqps",
        ),
        Panel(
            "SSE error frames by code",
            "Error frames per second sent after a stream was committed, by error code (upstream-chosen codes"
            " count as upstream_error).",
            ["sse_errors_by_code"],
            unit="ops",
        ),
        Row("WebSocket mode", "Persistent WebSocket connections at /v1/responses and their turns."),
        Panel(
            "WebSocket connections",
            "WebSocket connections open now, per instance (each counts toward --max-connections).",
            ["websocket_connections"],
            width=8,
        ),
        Panel(
            "WebSocket turns by outcome",
            "response.create turns per second by how they ended: completed, incomplete, failed (an error"
            " envelope or response.failed), cancelled (the client went away or stopped reading).",
            ["websocket_turns_by_outcome"],
            unit="ops",
            width=8,
        ),
        Panel(
            "Cap hits by transport",
            "Cap hits per second by transport (http, websocket) and limit; websocket_lifetime,"
            " websocket_idle and websocket_message_size are the connection's own.",
            ["cap_hits_by_transport"],
            unit="ops",
            width=8,
        ),
        Row("Gateway tools", "Gateway-owned (MCP) tool calls run by the loop."),
        Panel(
            "Tool calls by outcome",
            "Gateway tool calls per second by outcome: ok, error, timeout, refused, invalid_arguments, too_large."
            " Every failure is fed back to the model as an error output.",
            ["tool_calls_by_outcome"],
            unit="ops",
            width=8,
        ),
        Panel(
            "Tool timeouts and errors",
            "Share of gateway tool calls that did not succeed, by outcome (timeout, error, ...).",
            ["tool_failure_ratio"],
            unit="percentunit",
            width=8,
        ),
        Panel(
            "Tool call latency",
            "Gateway tool call duration quantiles (p50, p90, p99).",
            _quantile_keys("tool_duration"),
            unit="s",
            width=8,
        ),
        Row("Compaction", "POST /v1/responses/compact: who compacted, and how it ended."),
        Panel(
            "Compactions by mode and outcome",
            "Compactions per second by mode (upstream: the upstream's own /responses/compact; gateway: one"
            " summarising inference call) and outcome (ok, failed; fallback: auto mode found no upstream"
            " compact route, once per upstream and process).",
            ["compactions_by_mode_outcome"],
            unit="ops",
        ),
        Panel(
            "Chat translation failures by reason",
            "Chat Completions translations that failed per second (--upstream-api chat), by reason: a request"
            " the Chat API cannot express (unsupported_request), a reply that cannot be translated, or a"
            " translation cap (limit_*).",
            ["translation_failures_by_reason"],
            unit="ops",
        ),
        Row("Upstream", "The model server behind the gateway."),
        Panel(
            "Upstream errors by kind",
            "Upstream failures per second: connect, timeout, eof, protocol, decode, status_4xx, status_5xx,"
            " stream_error.",
            ["upstream_errors_by_kind"],
            unit="ops",
            width=8,
        ),
        Panel(
            "Upstream latency",
            "Duration quantiles (p50, p90, p99) of one upstream inference call.",
            _quantile_keys("upstream_duration"),
            unit="s",
            width=8,
        ),
        Panel(
            "Upstream time to first byte",
            "Time-to-first-byte quantiles (p50, p90, p99) of upstream inference calls.",
            _quantile_keys("upstream_ttfb"),
            unit="s",
            width=8,
        ),
    ]
    return _dashboard(
        "loopwarden-operations",
        "loopwarden / operations",
        "Traffic, cap hits, errors, gateway tools and upstream latency of the loopwarden gateway.",
        items,
        [],
    )


def _capacity() -> JSON:
    retained = [
        f"rejected_at_{limit // q.MiB}mib{suffix}"
        for limit in q.CANDIDATE_RETAINED_LIMITS
        for suffix in ("", "_max")
    ]
    iters = [f"rejected_at_{n}_iters{suffix}" for n in q.CANDIDATE_INFER_ITERS for suffix in ("", "_max")]
    items: list[Panel | Row] = [
        Row("Retained bytes", "How much of max_retained_bytes requests really use."),
        Panel(
            "Peak retained bytes per request",
            "Quantiles (p50, p90, p99) and mean of the peak retained bytes charged to one request's ledger,"
            " against the configured max_retained_bytes (dashboard variable, default 64 MiB). Quantiles are"
            " interpolated inside buckets 2^(1/8) apart (about 9 %).",
            [*_quantile_keys("retained_peak"), "retained_peak_mean", "max_retained_bytes"],
            unit="bytes",
        ),
        Panel(
            "Utilization of max_retained_bytes",
            "Distribution of peak retained bytes divided by the request's own max_retained_bytes limit, per"
            " time bucket. Mass near 100% means legitimate requests run close to the cap.",
            ["utilization_heatmap"],
            kind="heatmap",
            unit="percentunit",
        ),
        Panel(
            "Requests near their limit",
            "Share of requests whose peak retained bytes went over 50% and over 90% of their limit.",
            ["utilization_over_50", "utilization_over_90"],
            unit="percentunit",
        ),
        Panel(
            "Requests each max_retained_bytes would reject",
            "Over the dashboard's time range: at least / at most the share of requests each candidate limit"
            " would have stopped, the same figures as `loopwarden capacity`. Requests refused at the current"
            " max_retained_bytes (dashboard variable) are censored: they needed more than it, how much is"
            " unknown, so a candidate at or above the current limit shows a range (at most = at least + the"
            " censored share); below it they are all stopped.",
            retained,
            kind="bargauge",
            unit="percentunit",
            instant=True,
        ),
        Row("Rounds", "Inference calls per client request (the agentic loop)."),
        Panel(
            "Rounds per request",
            "Quantiles (p50, p90, p99) and mean of inference calls made for one client request.",
            [*_quantile_keys("rounds"), "rounds_mean"],
            unit="short",
        ),
        Panel(
            "Requests each max_infer_iters would reject",
            "Over the dashboard's time range: at least / at most the share of requests each candidate"
            " max_infer_iters would have stopped (508 or an SSE error), the same figures as `loopwarden"
            " capacity`. Requests stopped at the current cap (dashboard variable max_infer_iters) needed"
            " more rounds than it: they count as stopped by every candidate up to the cap, and as unknown"
            " (the range) above it.",
            iters,
            kind="bargauge",
            unit="percentunit",
            instant=True,
        ),
        Panel(
            "Requests stopped at the current caps (censored)",
            "Over the dashboard's time range: share of requests stopped at the current max_retained_bytes"
            " and max_infer_iters. Their need is unknown (more than the cap); `loopwarden capacity` says"
            " whether they look like runaway loops before recommending a higher cap.",
            ["censored_share"],
            kind="bargauge",
            unit="percentunit",
            instant=True,
        ),
        Row("Memory", "What the requests in flight may keep alive, per instance."),
        Panel(
            "In-flight retained bytes vs worker memory",
            "Per instance: retained bytes charged to all live ledgers (an upper bound on what the requests in"
            " flight keep alive), the largest worker's resident memory now and at start (the gateway's own"
            " baseline; loopwarden_worker_*resident_memory_bytes, exported in multiprocess mode too), and the worker"
            f" memory budget (dashboard variable, default {q.WORKER_MEMORY_BYTES // q.GiB} GiB;"
            " LoopwardenInflightRetainedNearWorkerMemory fires at"
            f" {q.WORKER_MEMORY_FRACTION:.0%} of it).",
            [
                "inflight_retained_by_instance",
                "resident_memory_by_instance",
                "baseline_memory_by_instance",
                "worker_memory",
            ],
            unit="bytes",
        ),
        Panel(
            "In-flight retained share of worker memory",
            "Per instance: retained bytes of all live ledgers divided by the worker memory budget.",
            ["inflight_retained_share"],
            unit="percentunit",
            width=6,
        ),
        Panel(
            "Requests in flight",
            "Requests being served now, per instance: with the peak retained bytes above, the concurrency a"
            " worker's memory must carry.",
            ["inflight_requests"],
            width=6,
        ),
        Panel(
            "Admission pool: reserved vs budget",
            "Per instance: budget bytes reserved from the admission pool by the requests in flight (each"
            " reserves before its body is read, then its ledger charges draw from that reservation), against"
            " the pool (--max-inflight-retained-bytes, summed over workers). A new request that does not fit"
            " is answered 503 server_overloaded; compare with the live ledger charges above.",
            ["admission_reserved_by_instance", "admission_budget_by_instance"],
            unit="bytes",
        ),
        Panel(
            "Memory pressure",
            "Per instance: used / allowed memory (cgroup memory.current / memory.max, else RSS / RAM) as"
            " last polled by admission control; new requests are shed above --memory-pressure-threshold"
            " (default 90%).",
            ["memory_pressure_by_instance"],
            unit="percentunit",
        ),
    ]
    return _dashboard(
        "loopwarden-capacity",
        "loopwarden / capacity planning",
        "Size max_retained_bytes, max_infer_iters and worker memory from observed traffic.",
        items,
        [
            _textbox_variable(
                "max_retained_bytes",
                "max_retained_bytes",
                "The gateway's configured max_retained_bytes, in bytes (drawn as a reference line).",
            ),
            _textbox_variable(
                "max_infer_iters",
                "max_infer_iters",
                "The gateway's configured max_infer_iters (requests stopped at it are censored).",
            ),
            _textbox_variable(
                "worker_memory_bytes",
                "Worker memory (bytes)",
                "Memory one scrape target may use, in bytes (drawn as a reference line).",
            ),
        ],
    )


def dashboards() -> dict[str, JSON]:
    """Every dashboard by its file name under ``dashboards/grafana/``."""
    return {"loopwarden-operations.json": _operations(), "loopwarden-capacity.json": _capacity()}


# --- YAML (a small emitter: mappings, lists, strings, numbers, booleans) ------------------------

_PLAIN = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./-]*$")
_YAML_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"})


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if not isinstance(value, str):
        raise TypeError(f"cannot write {type(value).__name__} as YAML")
    if _PLAIN.match(value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value, ensure_ascii=False)


def _block(value: str, indent: int) -> str | None:
    """A literal block scalar (``|-``) for multi-line text, when YAML can keep it exactly."""
    lines = value.split("\n")
    if (
        len(lines) < 2
        or any(line != line.rstrip() or "\t" in line for line in lines)
        or lines[0].startswith(" ")
    ):
        return None
    pad = " " * indent
    return "|-\n" + "\n".join(pad + line if line else "" for line in lines)


def _yaml_lines(value: object, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, Mapping):
        lines: list[str] = []
        for key, item in value.items():
            if isinstance(item, Mapping | list) and item:
                lines.append(f"{pad}{_scalar(key)}:")
                lines.extend(_yaml_lines(item, indent + 2))
            elif isinstance(item, str) and (block := _block(item, indent + 2)) is not None:
                lines.append(f"{pad}{_scalar(key)}: {block}")
            else:
                empty = (
                    "{}" if isinstance(item, Mapping) else "[]" if isinstance(item, list) else _scalar(item)
                )
                lines.append(f"{pad}{_scalar(key)}: {empty}")
        return lines
    if isinstance(value, list):
        lines = []
        for item in value:
            inner = _yaml_lines(item, indent + 2)
            lines.append(f"{pad}- {inner[0].lstrip()}")
            lines.extend(inner[1:])
        return lines
    return [pad + _scalar(value)]


def to_yaml(value: object, header: str = "") -> str:
    """`value` (nested dicts, lists, strings, numbers, booleans) as block-style YAML text."""
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + "\n".join(_yaml_lines(value, 0)) + "\n"


# --- outputs -----------------------------------------------------------------------------------

_GENERATED = "Generated by `python -m dashboards.generate` from dashboards/queries.py: do not edit by hand."


def alert_rules() -> JSON:
    """The Prometheus rule file (``dashboards/alerts.yml``) as data."""
    return {
        "groups": [
            {
                "name": "loopwarden",
                "rules": [
                    {
                        "alert": alert.name,
                        "expr": alert.expr,
                        "for": alert.for_,
                        "labels": {"severity": alert.severity},
                        "annotations": {"summary": alert.summary, "description": alert.description},
                    }
                    for alert in q.ALERTS
                ],
            }
        ]
    }


def _provider() -> JSON:
    return {
        "apiVersion": 1,
        "providers": [
            {
                "name": "loopwarden",
                "orgId": 1,
                "folder": "loopwarden",
                "folderUid": "loopwarden",
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 60,
                "options": {"path": GRAFANA_DASHBOARDS_PATH, "foldersFromFilesStructure": False},
            }
        ],
    }


def _datasource() -> JSON:
    return {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "Prometheus",
                "type": "prometheus",
                "uid": "prometheus",
                "access": "proxy",
                "url": "http://prometheus:9090",
                "isDefault": True,
                "editable": False,
                "jsonData": {"timeInterval": "15s", "httpMethod": "POST"},
            }
        ],
    }


def outputs() -> dict[str, str]:
    """Every generated file: path relative to ``dashboards/`` -> exact text."""
    files = {
        f"{GRAFANA_DIR}/{name}": json.dumps(board, indent=2, ensure_ascii=False) + "\n"
        for name, board in dashboards().items()
    }
    files["alerts.yml"] = to_yaml(
        alert_rules(),
        header=f"Prometheus alerting rules for loopwarden. {_GENERATED}\n"
        "Tests: promtool test rules dashboards/alerts_test.yml",
    )
    files["provisioning/dashboards/loopwarden.yaml"] = to_yaml(
        _provider(),
        header="Grafana dashboards provider: copy to /etc/grafana/provisioning/dashboards/ and mount\n"
        f"dashboards/grafana/ at {GRAFANA_DASHBOARDS_PATH}. {_GENERATED}",
    )
    files["provisioning/datasources/prometheus.example.yaml"] = to_yaml(
        _datasource(),
        header="Example Grafana datasource: copy to /etc/grafana/provisioning/datasources/ and set url.\n"
        "The dashboards pick any Prometheus datasource through their `datasource` variable; set\n"
        "timeInterval to your scrape interval so $__rate_interval covers at least four scrapes.\n"
        + _GENERATED,
    )
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with ``--check`` compare) every generated file; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m dashboards.generate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a file differs from what would be written"
    )
    parser.add_argument(
        "--out", type=Path, default=PACKAGE_DIR, help="output directory (default: the dashboards package)"
    )
    args = parser.parse_args(argv)
    out: Path = args.out
    stale: list[str] = []
    for relative, text in outputs().items():
        path = out / relative
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current == text:
            continue
        if args.check:
            stale.append(f"{path} is {'missing' if current is None else 'stale'}")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    if stale:
        print("\n".join(stale), file=sys.stderr)
        print(
            "the generated dashboards are out of date: rerun `python -m dashboards.generate` and commit the result",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
