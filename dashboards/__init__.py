"""loopwarden's Grafana dashboards, Prometheus alert rules and the metric contract behind them.

`dashboards.queries` holds the metric names, label values, histogram buckets and every PromQL
expression; `dashboards.generate` writes the dashboards, provisioning files and ``alerts.yml``
from it; `dashboards.promql` substitutes Grafana macros and reads selectors out of PromQL.
"""
