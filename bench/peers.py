"""The peer gateways of the benchmark, both opt-in: LiteLLM's proxy and the Portkey gateway.

Neither is a project dependency; each lives outside the project's venv, and `bench/run.py` says
"not installed" when it finds neither:

* LiteLLM (`find_litellm`): ``python3.11 -m venv /tmp/litellm-venv &&
  /tmp/litellm-venv/bin/pip install 'litellm[proxy]'`` (its pins must not touch the project's).
* Portkey (`find_portkey`): ``mkdir /tmp/portkey-gw && cd /tmp/portkey-gw && npm install
  @portkey-ai/gateway`` (Node 18+). Started as its ``npx`` entry point does (``node
  build/start-server.js --port=N --headless``), one Node process, with a ``--import`` shim that
  binds it to 127.0.0.1 (it listens on every interface otherwise) and ``TRUSTED_CUSTOM_HOSTS``
  naming the loopback upstream. Requests carry ``x-portkey-provider: openai`` and
  ``x-portkey-custom-host: UPSTREAM``. Run unpatched: its streamed ``/v1/responses`` failed in
  1.15.2 (``TypeError: immutable`` in its ``updateHeaders``; Portkey-AI/gateway#1550), so
  `bench/run.py` probes one streamed request and leaves Portkey out of the stream scenarios,
  saying why, when the probe fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

PORTKEY_DIRS = ("/tmp/portkey-gw",)
PORTKEY_SCRIPT = Path("node_modules/@portkey-ai/gateway/build/start-server.js")
#: Binds every `net.Server` of the process to 127.0.0.1, whatever host it asks for.
LOOPBACK_SHIM = """\
import net from "node:net";
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (args.length && typeof args[0] === "object" && args[0] !== null) {
    args[0] = { ...args[0], host: "127.0.0.1" };
  } else if (typeof args[1] === "string") {
    args[1] = "127.0.0.1";
  } else {
    args.splice(1, 0, "127.0.0.1");
  }
  return listen.apply(this, args);
};
"""


def find_litellm(explicit: str | None, python: str) -> str | None:
    """The ``litellm`` executable: `explicit`, ``$LITELLM_BIN``, ``PATH``, next to `python`, then
    ``/tmp/litellm-venv/bin/litellm``; None when none is an executable file."""
    candidates = [
        explicit,
        os.environ.get("LITELLM_BIN"),
        shutil.which("litellm"),
        str(Path(python).parent / "litellm"),
        "/tmp/litellm-venv/bin/litellm",
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_portkey(explicit: str | None) -> Path | None:
    """Portkey's ``start-server.js`` under `explicit`, ``$PORTKEY_DIR`` or ``/tmp/portkey-gw`` (an
    npm prefix holding ``@portkey-ai/gateway``), if ``node`` is on ``PATH``; else None."""
    if shutil.which("node") is None:
        return None
    for base in (explicit, os.environ.get("PORTKEY_DIR"), *PORTKEY_DIRS):
        if base and (Path(base) / PORTKEY_SCRIPT).is_file():
            return Path(base) / PORTKEY_SCRIPT
    return None


def portkey_version(script: Path) -> str:
    """``"@portkey-ai/gateway X.Y.Z, node vN"`` from its package.json and ``node --version``."""
    version = "?"
    with contextlib.suppress(OSError, ValueError, KeyError):
        version = json.loads((script.parent.parent / "package.json").read_text())["version"]
    node = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        node = subprocess.run(
            ["node", "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    return f"@portkey-ai/gateway {version}, node {node}"


def portkey_command(
    script: Path, port: int, workdir: Path, upstream: str
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` that start Portkey on 127.0.0.1:`port` trusting `upstream` (a base URL);
    writes the loopback shim into `workdir`."""
    shim = workdir / "force-loopback.mjs"
    shim.write_text(LOOPBACK_SHIM)
    host = upstream.split("://", 1)[1].split("/", 1)[0].split(":", 1)[0]
    argv = ["node", "--import", str(shim), str(script), f"--port={port}", "--headless"]
    return argv, {"TRUSTED_CUSTOM_HOSTS": host}


def portkey_headers(upstream: str) -> dict[str, str]:
    """The headers that route a request through Portkey to `upstream` (a base URL with ``/v1``)."""
    return {
        "x-portkey-provider": "openai",
        "x-portkey-custom-host": upstream,
        "authorization": "Bearer sk-upstream",
    }
