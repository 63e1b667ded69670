"""The ``loopwarden`` command: ``serve``, ``devmodel`` and ``capacity``.

``serve`` runs the gateway, ``devmodel`` the scripted development model alone, and ``capacity``
recommends limits from a Prometheus that scrapes the gateway (`middleware.ops.capacity`).

Every ``serve`` flag has a ``LOOPWARDEN_<NAME>`` environment variable and a config-file key of the
same name; flags win over the environment, which wins over the file (DESIGN.md §3). The flags are
generated from the settings' field metadata (`add_setting_flags`, `middleware.config`). An invalid
value exits with status 2 and a message naming the field, the range and the value.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import uvicorn

from middleware.config import (
    FIELDS,
    FlatSetting,
    Settings,
    SettingsError,
    default_text,
    ignored_dialect_settings,
    load_settings,
)
from middleware.ops.admission import install_drain_hook
from middleware.ops.connections import connection_options, fd_overcommit, resolve_max_connections
from middleware.ops.request_id import log_config


def add_setting_flags(parser: argparse.ArgumentParser, specs: Mapping[str, FlatSetting] = FIELDS) -> None:
    """One flag per setting of `specs` that has one (`Spec.flag`), generated from the field
    metadata: ``--upstream-read-timeout`` with ``type=float`` and the help "… (default 600 s;
    $LOOPWARDEN_UPSTREAM_READ_TIMEOUT)";
    repeatable (``action="append"``) for a list. Unset flags parse as None (``argument_default``)."""
    for entry in specs.values():
        if not entry.spec.flag:
            continue
        shown = [part for part in (default_text(entry, markdown=False), f"${entry.env}") if part]
        help = f"{entry.spec.help} ({'; '.join(shown)})"
        kwargs: dict[str, Any] = {"help": help.replace("%", "%%"), "dest": entry.name}
        if entry.spec.choices:
            kwargs["metavar"] = "{" + ",".join(entry.spec.choices) + "}"
        if entry.type == "tuple[str, ...]":
            kwargs["action"] = "append"
        elif entry.type in ("int", "float"):
            kwargs["type"] = int if entry.type == "int" else float
        parser.add_argument(entry.flag, **kwargs)


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve the gateway", argument_default=None)
    add_setting_flags(p)


def shared_compact_secret(settings: Settings) -> Settings:
    """`settings` for ``--workers`` > 1: without a configured compaction key, one random key
    (64 hex digits) that every worker of this host gets, so that a compaction item one worker
    signed verifies on the others (README "Compaction"). Raises SettingsError like
    `Settings.compact_key`."""
    if settings.compact_key() is not None:
        return settings
    return settings.replace(compact_secret=secrets.token_hex(32))


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
        "host": settings.transport.host,
        "port": settings.transport.port,
        "log_level": settings.logging.level,
        "log_config": log_config(settings.logging.level, json_lines=settings.logging.format == "json"),
        # uvicorn's own cut-off comes after ours, so drained requests get their error frame first
        "timeout_graceful_shutdown": settings.transport.drain_timeout + 5,
        "loop": settings.transport.loop,
        **connection_options(settings, nofile),
    }


def start_up_line(settings: Settings) -> str:
    """The line ``serve`` prints before uvicorn starts: the address, the upstream and the API it
    speaks (``upstream_api=chat``), the limits and uvicorn's stack."""
    t = settings.transport
    return (
        f"loopwarden: starting on http://{t.host}:{t.port} "
        f"(upstream: {settings.upstream.url or 'embedded development model'}, "
        f"upstream_api={settings.upstream.api}, "
        f"max_infer_iters={settings.loop.max_infer_iters}, max_retained_bytes={settings.loop.max_retained_bytes}, "
        f"http={t.http}, loop={t.loop}, max_connections={resolve_max_connections(settings)} per worker)"
    )


def dialect_warning(ignored: list[str]) -> str:
    """The one start-up warning for the dialect settings `ignored_dialect_settings` found
    (``name=value`` / ``models.NAME.name=value``): an upstream that speaks ``responses`` never
    reads them."""
    return (
        f"loopwarden: WARNING: ignored, the upstream speaks responses: {', '.join(ignored)}; these "
        "settings apply only with upstream_api chat (server-wide or that model's)"
    )


def _warn_per_worker_store(settings: Settings) -> None:
    """With ``--workers`` > 1 an in-memory store is one store per worker: say so at start-up."""
    if settings.transport.workers > 1 and settings.store.url in (
        "memory",
        "sqlite://:memory:",
        "sqlite:///:memory:",
    ):
        print(
            f"loopwarden: WARNING: --workers {settings.transport.workers} with --store {settings.store.url}: each worker has "
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


#: ``loopwarden --help``: plain text (the module docstring is reStructuredText).
DESCRIPTION = (
    "loopwarden: a gateway for the OpenAI Responses API that runs the tool loop server-side under "
    "hard limits. Commands: serve (the gateway), devmodel (the embedded development model alone), "
    "capacity (recommend limits from Prometheus)."
)
#: ``loopwarden devmodel --help``.
DEVMODEL_DESCRIPTION = (
    "Serve the embedded development model alone: a scripted stand-in that speaks the Responses API "
    "(POST /v1/responses) and Chat Completions (POST /v1/chat/completions), for trying the gateway "
    "and its clients without a real model (loopwarden serve --upstream http://HOST:PORT/v1)."
)


def _parser() -> argparse.ArgumentParser:
    """The ``loopwarden`` parser: ``serve`` (flags generated from the settings), ``devmodel``
    and ``capacity``."""
    parser = argparse.ArgumentParser(prog="loopwarden", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    dev = sub.add_parser(
        "devmodel",
        help="serve only the embedded development model (no real model inside)",
        description=DEVMODEL_DESCRIPTION,
    )
    dev.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    dev.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``loopwarden`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "capacity":
        return _capacity(args)

    if args.command == "devmodel":
        from middleware.dev.devmodel import create_devmodel_app

        uvicorn.run(create_devmodel_app(), host=args.host, port=args.port, log_level="info")
        return 0
    return _serve({k: v for k, v in vars(args).items() if k != "command"})


def _serve(flags: dict[str, Any]) -> int:
    """``loopwarden serve`` with the parsed `flags`: resolve and check the settings (exit 2 when
    invalid), warn about risky ones, then run uvicorn (one process or ``--workers``)."""
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
    print(start_up_line(settings), file=sys.stderr, flush=True)
    _warn_per_worker_store(settings)
    if ignored := ignored_dialect_settings(settings):
        print(dialect_warning(ignored), file=sys.stderr)
    if over := fd_overcommit(settings):
        print(
            f"loopwarden: WARNING: --max-connections, --backlog and the upstream pools may need {over} "
            "file descriptors more than ulimit -n allows: raise it or lower them (0 derives both)",
            file=sys.stderr,
        )
    install_drain_hook(settings.transport.drain_timeout)
    if settings.transport.workers == 1:
        from middleware.app import create_app

        uvicorn.run(create_app(settings), **common)
    else:
        os.environ.update(shared_compact_secret(settings).to_env())
        _multiprocess_metrics_dir()
        uvicorn.run(
            "middleware.app:create_app_from_env", factory=True, workers=settings.transport.workers, **common
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
