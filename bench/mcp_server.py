"""An MCP server (streamable HTTP, built with the `mcp` SDK) for the tool-loop benchmark.

Usage: ``python bench/mcp_server.py --port PORT`` — serves ``/mcp`` with one tool, ``lookup(q)``,
which answers ``"ok: " + q`` at once (the tool itself costs nothing; the benchmark measures the
gateway's MCP round trips). Same server shape as ``tests/loop/test_loop_e2e.py:build_server()``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mcp.server.mcpserver import MCPServer
from proxy_bare import serve


def build_server() -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("tools")

    @server.tool()
    async def lookup(q: str = "") -> str:
        """Look something up."""
        return "ok: " + q

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve(build_server().streamable_http_app(), args.port)


if __name__ == "__main__":
    main()
