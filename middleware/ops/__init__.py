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
* `shield` — `RetryShield`: the per-worker retry shield (a deterministic failure answered again
  to the same caller's identical request, without an upstream call).
* `capacity` — ``loopwarden capacity``: limits and worker memory from observed traffic.
* `plot` — `bar_chart_png`: the dependency-free PNG chart of ``loopwarden capacity --plot``.

Nothing is re-exported here: import from the module.
"""
