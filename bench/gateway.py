"""Run loopwarden for the benchmarks: ``create_app(Settings(...))`` on uvicorn (a script, not a test).

Usage: ``python bench/gateway.py --upstream URL --port PORT [--store memory|sqlite:///PATH]
[--mcp-server tools=URL] [--max-retained-bytes N]``

Default limits unless given; the same uvicorn configuration as the bare proxies
(`proxy_bare.serve`: asyncio loop, no access log) so that only the app differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_bare import serve

from middleware.app import create_app
from middleware.config import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="base URL including /v1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--store", default="memory")
    parser.add_argument("--mcp-server", action="append", default=[])
    parser.add_argument("--max-retained-bytes", type=int, default=None)
    args = parser.parse_args()
    extra = {}
    if args.max_retained_bytes is not None:
        extra["max_retained_bytes"] = args.max_retained_bytes
    settings = Settings(upstream=args.upstream, store=args.store, mcp_server=tuple(args.mcp_server), **extra)
    serve(create_app(settings), args.port)


if __name__ == "__main__":
    main()
