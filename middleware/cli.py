"""The ``loopwarden`` command: ``serve``, ``devmodel`` and ``capacity``.

``serve`` runs the gateway, ``devmodel`` the scripted development model alone, and ``capacity``
recommends limits from a Prometheus that scrapes the gateway (`middleware.ops.capacity`).

Every ``serve`` flag has a ``LOOPWARDEN_<NAME>`` environment variable and a config-file key of the
same name; flags win over the environment, which wins over the file (DESIGN.md §3). An invalid
value exits with status 2 and a message naming the field, the range and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import uvicorn

from middleware.config import Settings, SettingsError, load_settings
from middleware.ops.admission import install_drain_hook
from middleware.ops.connections import connection_options, fd_overcommit, resolve_max_connections
from middleware.ops.request_id import log_config


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve the gateway", argument_default=None)
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080)")
    p.add_argument(
        "--upstream",
        help="base URL of a Responses-compatible server, e.g. http://127.0.0.1:8000/v1 "
        "(default: start the embedded development model)",
    )
    p.add_argument(
        "--upstream-api-key", help="bearer token sent upstream (prefer $LOOPWARDEN_UPSTREAM_API_KEY)"
    )
    p.add_argument("--upstream-connect-timeout", type=float, help="seconds to connect upstream (default 10)")
    p.add_argument(
        "--upstream-read-timeout",
        type=float,
        help="seconds allowed for the first byte and between any two reads (default 600)",
    )
    p.add_argument("--upstream-deadline", type=float, help="seconds for a whole upstream call (default 1800)")
    p.add_argument("--upstream-max-connections", type=int, help="pooled upstream connections (default 100)")
    p.add_argument("--upstream-client", help="upstream HTTP client: aiohttp (default) or httpx")
    # chat: new settings
    p.add_argument(
        "--upstream-api",
        help="what the upstream speaks: responses (default; /v1/responses) or chat (/v1/chat/completions, translated)",
    )
    p.add_argument(
        "--reasoning-dialect",
        help="chat upstreams: the field reasoning arrives in: reasoning_content (default), reasoning or none",
    )
    p.add_argument(
        "--reasoning-replay",
        help="chat upstreams: replayed reasoning goes on the next assistant message as "
        "reasoning_content or reasoning, or is dropped: omit (default)",
    )
    p.add_argument(
        "--max-tokens-field",
        help="chat upstreams: what max_output_tokens becomes: max_completion_tokens (default) or max_tokens",
    )
    p.add_argument(
        "--tool-call-profile",
        help="chat upstreams: strict (default; tool-call stream quirks fail) or tolerant (every call on "
        "index 0, fragments without index, calls without id)",
    )
    p.add_argument(
        "--developer-role",
        help="chat upstreams: the role developer messages are sent as: developer (default) or system",
    )
    # chat: end of new settings
    p.add_argument("--max-infer-iters", type=int, help="inference calls per request, 1..=100 (default 10)")
    p.add_argument(
        "--max-retained-bytes",
        type=int,
        help="retained-bytes budget per request, 4096..=268435456 (default 67108864)",
    )
    p.add_argument(
        "--charge-model",
        help="ledger prices: measured (default; what CPython really retains) or reference (DESIGN.md §4 numbers)",
    )
    p.add_argument("--client-body-timeout", type=float, help="seconds to receive a request body (default 30)")
    p.add_argument(
        "--client-write-timeout",
        type=float,
        help="seconds one write to the client may make no progress before the request ends as a "
        "disconnect (default 30)",
    )
    p.add_argument(
        "--keepalive-interval", type=float, help="seconds between SSE keep-alive comments (default 15)"
    )
    p.add_argument("--workers", type=int, help="worker processes (default 1)")
    p.add_argument("--http", help="uvicorn's HTTP/1.1 stack: httptools (default) or h11")
    p.add_argument("--loop", help="uvicorn's event loop: uvloop (default) or asyncio")
    p.add_argument(
        "--header-timeout",
        type=float,
        help="seconds a connection has to send a complete request head, else it is closed (default 10)",
    )
    p.add_argument(
        "--keepalive-timeout",
        type=float,
        help="seconds an idle keep-alive connection stays open after a response (uvicorn's "
        "timeout_keep_alive; default 5); not --keepalive-interval, the SSE comment interval",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="open client connections per worker; more are closed at accept (default 0: the "
        "file-descriptor limit minus room for the upstream pools and 64 more)",
    )
    p.add_argument(
        "--backlog",
        type=int,
        help="listen queue, and sockets accepted per wake-up (uvicorn's backlog; default 0: "
        "min(2048, the file-descriptor limit // 8))",
    )
    p.add_argument(
        "--max-header-bytes",
        type=int,
        help="bytes of one request head, 1024..=1048576; over it: 431 (default 65536)",
    )
    p.add_argument(
        "--max-inflight-retained-bytes",
        type=int,
        help="budget bytes all requests of one worker may hold together (default 0: a quarter of "
        "the memory limit / workers)",
    )
    p.add_argument(
        "--max-concurrent-requests", type=int, help="requests in flight per worker (default 0: no cap)"
    )
    p.add_argument(
        "--max-inflight-share-per-caller",
        type=float,
        help="share of the worker's pool one caller (API key, or client address when open) may hold, "
        "in (0, 1] (default 0.5)",
    )
    p.add_argument(
        "--retry-after", type=float, help="Retry-After seconds on a 503 overload refusal (default 1)"
    )
    p.add_argument(
        "--retry-shield-seconds",
        type=float,
        help="seconds a deterministic failure is answered again at once to the same caller's identical "
        "request, without an upstream call (per worker; default 30; 0: off)",
    )
    p.add_argument(
        "--retry-shield-max-entries",
        type=int,
        help="failures the retry shield remembers per worker (default 4096)",
    )
    p.add_argument(
        "--retry-shield-max-bytes",
        type=int,
        help="budget bytes the retry shield may hold per worker, drawn from its pool (default 16777216)",
    )
    p.add_argument(
        "--memory-pressure-threshold",
        type=float,
        help="shed new requests above this used/allowed memory ratio (default 0.9)",
    )
    p.add_argument(
        "--request-deadline", type=float, help="seconds for a whole request, all rounds (default 1800)"
    )
    p.add_argument(
        "--websocket-max-lifetime",
        type=float,
        help="seconds a WebSocket connection at /v1/responses may live (default 3600, the spec's 60 "
        "minutes; then websocket_connection_limit_reached and close 1001)",
    )
    p.add_argument(
        "--websocket-idle-timeout",
        type=float,
        help="seconds a WebSocket connection may wait for its next message between turns (default 300; "
        "then close 1001)",
    )
    p.add_argument(
        "--drain-timeout", type=float, help="seconds in-flight requests get after SIGTERM (default 30)"
    )
    p.add_argument(
        "--background-lease-seconds",
        type=float,
        help="seconds a background response's worker may go silent before another marks it failed (default 30)",
    )
    p.add_argument(
        "--background-event-log-bytes",
        type=int,
        help="bytes of SSE events a streamed background response keeps for resuming, oldest dropped "
        "first, charged to its ledger (default 8388608; 0: no resume)",
    )
    p.add_argument(
        "--background-event-log-retention",
        type=float,
        help="seconds a background response's event log is kept after it ends (default 600)",
    )
    p.add_argument(
        "--mcp-server",
        action="append",
        help="an operator MCP server, LABEL=URL (streamable HTTP); repeatable. Requests use it with "
        '{"type":"mcp","server_label":"LABEL"}',
    )
    p.add_argument(
        "--mcp-allow",
        action="append",
        help="URL prefix a client-declared MCP server_url must match; repeatable (default: none allowed)",
    )
    p.add_argument(
        "--mcp-list-ttl", type=float, help="seconds a server's tools/list is cached (default 300; 0: never)"
    )
    p.add_argument(
        "--mcp-list-cache-bytes",
        type=int,
        help="bytes all cached tools/list results may keep alive, LRU-evicted (default 16777216; 0: never cache)",
    )
    p.add_argument(
        "--mcp-session-idle-timeout",
        type=float,
        help="seconds an unused pooled MCP session stays open (default 60)",
    )
    p.add_argument(
        "--mcp-idle-sessions-per-server",
        type=int,
        help="idle MCP sessions kept per server, headers and caller (default 4; 0: no reuse)",
    )
    p.add_argument("--tool-timeout", type=float, help="seconds one gateway tool call may take (default 60)")
    p.add_argument(
        "--tool-concurrency", type=int, help="gateway tool calls in flight per request (default 5)"
    )
    p.add_argument(
        "--tool-max-result-bytes", type=int, help="per-call tool result cap in bytes (default 262144)"
    )
    p.add_argument("--log-level", help="critical, error, warning, info or debug (default info)")
    p.add_argument(
        "--log-format", help="text or json (one JSON object per line); every line has the request id"
    )
    p.add_argument(
        "--store",
        help="where responses are stored: sqlite:///PATH (default sqlite:///./.loopwarden/loopwarden.db), "
        "postgresql://USER@HOST/DB, or memory",
    )
    p.add_argument(
        "--api-key",
        action="append",
        help="a gateway API key clients must present; repeatable (prefer --api-key-file or $LOOPWARDEN_API_KEY)",
    )
    p.add_argument(
        "--upstream-compact",
        help="who answers POST /v1/responses/compact: auto (default: the upstream's own "
        "/responses/compact, else the gateway on 404/405), upstream or gateway",
    )
    p.add_argument(
        "--compact-max-output-tokens",
        type=int,
        help="the gateway's compaction summary cap, 1..=131072 (default 4096)",
    )
    p.add_argument(
        "--compact-secret-file",
        help="file whose first line is the key that signs compaction items (shared by every host; "
        "default: a random key per process, shared by --workers; or $LOOPWARDEN_COMPACT_SECRET)",
    )
    p.add_argument("--api-key-file", help="file with gateway API keys, one per line")
    p.add_argument("--config", help="YAML or TOML file with settings (flags override it)")


def shared_compact_secret(settings: Settings) -> Settings:
    """`settings` for ``--workers`` > 1: without a configured compaction key, one random key
    (64 hex digits) that every worker of this host gets, so that a compaction item one worker
    signed verifies on the others (README "Compaction"). Raises SettingsError like
    `Settings.compact_key`."""
    if settings.compact_key() is not None:
        return settings
    return dataclasses.replace(settings, compact_secret=secrets.token_hex(32))


def _multiprocess_metrics_dir() -> None:
    """Give the workers one fresh ``PROMETHEUS_MULTIPROC_DIR`` (the operator's, wiped, or a new one)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="loopwarden-metrics-")


def uvicorn_options(settings: Settings, nofile: int | None = None) -> dict[str, Any]:
    """The ``uvicorn.run`` keywords ``serve`` uses for `settings`, single worker and ``--workers``
    > 1 alike: address, logging, the graceful-shutdown cut-off, the event loop (``loop``:
    ``uvloop`` or ``asyncio``) and the connection bounds
    (`middleware.ops.connections.connection_options`; ``nofile``: the file-descriptor limit to
    derive ``max_connections`` from, None: this process's). Raises SettingsError when the
    derived ``max_connections`` is too small."""
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "log_config": log_config(settings.log_level, json_lines=settings.log_format == "json"),
        # uvicorn's own cut-off comes after ours, so drained requests get their error frame first
        "timeout_graceful_shutdown": settings.drain_timeout + 5,
        "loop": settings.loop,
        **connection_options(settings, nofile),
    }


def _warn_per_worker_store(settings: Settings) -> None:
    """With ``--workers`` > 1 an in-memory store is one store per worker: say so at start-up."""
    if settings.workers > 1 and settings.store in ("memory", "sqlite://:memory:", "sqlite:///:memory:"):
        print(
            f"loopwarden: WARNING: --workers {settings.workers} with --store {settings.store}: each worker has "
            "its own in-memory store, so previous_response_id and conversations only find what the same "
            "worker stored (a load balancer spreads them); use --store sqlite:///PATH or postgresql://...",
            file=sys.stderr,
        )


def _capacity(args: argparse.Namespace) -> int:
    """``loopwarden capacity``: print the report; with --plot / --report write charts / HTML."""
    from pathlib import Path

    from middleware.ops.capacity_data import CapacityError, gather
    from middleware.ops.capacity_report import render_text, write_charts, write_html
    from middleware.ops.plot import PlotUnavailable

    try:
        obs = gather(
            args.prometheus,
            window=args.window,
            workers=args.workers,
            max_infer_iters=args.max_infer_iters,
            max_retained_bytes=args.max_retained_bytes,
            tool_timeout=args.tool_timeout,
        )
        if args.report:
            report = Path(args.report)
            print(write_html(obs, report, Path(args.plot) if args.plot else report.parent))
            print(f"\nwrote {report}")
        else:
            print(render_text(obs))
            if args.plot:
                for png, svg in write_charts(obs, Path(args.plot)):
                    print(f"wrote {png} and {svg}")
    except (CapacityError, PlotUnavailable) as exc:
        print(f"loopwarden capacity: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``loopwarden`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="loopwarden", description=__doc__.splitlines()[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    dev = sub.add_parser("devmodel", help="serve only the embedded development model (no real model inside)")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=8000)
    cap = sub.add_parser("capacity", help="recommend limits from a Prometheus that scrapes the gateway")
    cap.add_argument(
        "--prometheus", required=True, help="base URL of the Prometheus server, e.g. http://127.0.0.1:9090"
    )
    cap.add_argument("--window", default="1h", help="PromQL range to look back over (default 1h)")
    cap.add_argument("--plot", metavar="DIR", help="also write the four charts to DIR as PNG and SVG")
    cap.add_argument("--report", metavar="FILE.html", help="also write one self-contained HTML page")
    cap.add_argument("--workers", type=int, default=1, help="worker processes per scrape target (default 1)")
    cap.add_argument("--max-infer-iters", type=int, help="the cap in force (default: inferred, else 10)")
    cap.add_argument(
        "--max-retained-bytes", type=int, help="the limit in force (default: inferred, else 64 MiB)"
    )
    cap.add_argument("--tool-timeout", type=float, default=60.0, help="the tool timeout in force, seconds")
    args = parser.parse_args(argv)

    if args.command == "capacity":
        return _capacity(args)

    if args.command == "devmodel":
        from middleware.dev.devmodel import create_devmodel_app

        uvicorn.run(create_devmodel_app(), host=args.host, port=args.port, log_level="info")
        return 0

    flags = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        settings = load_settings(flags, os.environ)
    except SettingsError as exc:
        print(f"loopwarden: {exc}", file=sys.stderr)
        return 2
    try:
        keys = settings.api_keys()
        settings.compact_key()  # a compact_secret_file that cannot be read fails here, at start-up
        common = uvicorn_options(settings)
    except SettingsError as exc:
        print(f"loopwarden: {exc}", file=sys.stderr)
        return 2
    if not keys:
        print(
            "loopwarden: WARNING: no API key configured (--api-key-file, $LOOPWARDEN_API_KEY): "
            "the gateway is open to anyone who can reach it",
            file=sys.stderr,
        )
    print(
        f"loopwarden: starting on http://{settings.host}:{settings.port} "
        f"(upstream: {settings.upstream or 'embedded development model'}, "
        f"max_infer_iters={settings.max_infer_iters}, max_retained_bytes={settings.max_retained_bytes}, "
        f"http={settings.http}, loop={settings.loop}, max_connections={resolve_max_connections(settings)} per worker)",
        file=sys.stderr,
        flush=True,
    )
    _warn_per_worker_store(settings)
    if over := fd_overcommit(settings):
        print(
            f"loopwarden: WARNING: --max-connections, --backlog and the upstream pools may need {over} "
            "file descriptors more than ulimit -n allows: raise it or lower them (0 derives both)",
            file=sys.stderr,
        )
    install_drain_hook(settings.drain_timeout)
    if settings.workers == 1:
        from middleware.app import create_app

        uvicorn.run(create_app(settings), **common)
    else:
        os.environ.update(shared_compact_secret(settings).to_env())
        _multiprocess_metrics_dir()
        uvicorn.run("middleware.app:create_app_from_env", factory=True, workers=settings.workers, **common)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
