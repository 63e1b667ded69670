"""Run loopwarden for the benchmarks: ``create_app(Settings(...))`` on uvicorn (a script, not a test).

Usage: ``python bench/gateway.py --upstream URL --port PORT [--store memory|sqlite:///PATH]
[--mcp-server tools=URL] [--max-retained-bytes N] [--mcp-idle-sessions-per-server N]``

Default limits unless given; the same uvicorn configuration as the bare proxies
(`proxy_bare.serve`: asyncio loop, no access log) so that only the app differs.

The code served is this file's own tree, unless ``$PYTHONPATH`` names a tree with a ``middleware``
package: then that one (``run.py --base-tree PATH`` serves an older checkout this way). The tree
actually imported is printed at start (``gateway: serving middleware from PATH``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# the first $PYTHONPATH entry with a middleware package, else this file's tree
sys.path.insert(
    0,
    next(
        (
            p
            for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and (Path(p) / "middleware" / "__init__.py").is_file()
        ),
        str(Path(__file__).resolve().parent.parent),
    ),
)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_bare import serve

import middleware
from middleware.app import create_app
from middleware.config import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="base URL including /v1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--store", default="memory")
    parser.add_argument("--mcp-server", action="append", default=[])
    parser.add_argument("--max-retained-bytes", type=int, default=None)
    parser.add_argument("--mcp-idle-sessions-per-server", type=int, default=None)
    args = parser.parse_args()
    extra = {}
    if args.max_retained_bytes is not None:
        extra["max_retained_bytes"] = args.max_retained_bytes
    if args.mcp_idle_sessions_per_server is not None:
        extra["mcp_idle_sessions_per_server"] = args.mcp_idle_sessions_per_server
    settings = Settings(upstream=args.upstream, store=args.store, mcp_server=tuple(args.mcp_server), **extra)
    print(f"gateway: serving middleware from {Path(middleware.__file__).resolve().parent.parent}", flush=True)
    serve(create_app(settings), args.port)


if __name__ == "__main__":
    main()
