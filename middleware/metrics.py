"""Prometheus metrics (DESIGN.md §8): module-level singletons, base units, bounded labels only.

Labels never carry ids, user strings, tool names or error messages; the ``model`` label is one of
the configured model names or ``other`` (see `model_label`).
"""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client import Counter, Gauge

REQUESTS = Counter(
    "loopwarden_requests_total",
    "Client requests answered, by HTTP status and model.",
    ["status", "model"],
)
CLIENT_DISCONNECTS = Counter(
    "loopwarden_client_disconnects_total",
    "Requests whose client went away before the answer was complete.",
)
UPSTREAM_ERRORS = Counter(
    "loopwarden_upstream_errors_total",
    "Failures of the upstream model server, by kind.",
    ["kind"],
)
STREAM_ERRORS = Counter(
    "loopwarden_stream_errors_total",
    "SSE error frames sent after a stream was committed, by error code.",
    ["code"],
)
INFLIGHT = Gauge("loopwarden_inflight_requests", "Requests being served now.")


def model_label(model: object, configured: Collection[str] = ()) -> str:
    """The bounded ``model`` label: `model` if it is a configured name, else ``other``."""
    return model if isinstance(model, str) and model in configured else "other"
