"""Operating the gateway: admission control, metrics, request ids and logs, capacity planning.

One job per module:

* `admission` — `ProcessPool`, `RequestReservation`, `DrainState`: the per-worker budget pool,
  load shedding and the drain.
* `connections` — `connection_options`, `BoundedH11Protocol`, `BoundedHttpToolsProtocol`: the
  header timeout, head-size bound and connection cap on both uvicorn HTTP stacks.
* `metrics` — the DESIGN.md §8 metric contract (`METRICS`) and the Prometheus singletons.
* `request_id` — `RequestIdMiddleware` and `log_config`: ``x-request-id`` on every answer and
  log line.
* `redact` — `redact`, `redact_url`: operator secrets and URL credentials kept out of messages.
* `capacity` — ``loopwarden capacity``'s arithmetic: stopped shares with censored requests (cap
  hits), recommended limits, workers and memory per worker.
* `capacity_data` — `gather`: one window of the gateway's metrics read from Prometheus.
* `capacity_report` — the text report, the charts and the self-contained HTML page.
* `plot` — `chart`: one matplotlib chart (PNG and SVG) per histogram (the ``plots`` extra).
* `shield` — `RetryShield`: the per-worker retry shield (a deterministic failure answered again
  to the same caller's identical request, without an upstream call).

Nothing is re-exported here: import from the module.
"""
