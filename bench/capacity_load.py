"""A small scripted load for the capacity walk (README "Capacity planning", issue 20 item 5).

Against a gateway serving the embedded development model (``make run``, best with
``ARGS="--max-retained-bytes 8388608"`` so the oversized requests hit ``max_retained_bytes``
rather than the raw-body clamp), it sends a known mix, a few at a time:

* ``plain``: "hello" (1 inference round);
* ``tools``: "calculate 6*7" and "call get_time" with the demo MCP server (2 rounds, 1 tool call);
* ``medium``: 3000 one-letter input items (about 2.6 MiB charged, 1 round);
* ``loops``: "loop forever" with the demo MCP server: stopped at ``max_infer_iters`` (508);
* ``oversized``: 12000 input items (about 11 MiB charged): refused at ``max_retained_bytes`` (413).

Every request carries its own ``metadata`` (``{"load_request": "<n>"}``), so no two are identical:
the retry shield answers an identical repeat of a failed request again without running it, which
would keep the repeated 508s and 413s out of the histograms this load is read back from.

Prints one JSON object: the counts sent, the statuses seen, and the expected figures (requests,
cap hits). ``python bench/capacity_load.py [--url http://127.0.0.1:8080] [--scale 1]``; at scale 1
it sends 90 requests in a few seconds.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

DEMO = {"type": "mcp", "server_label": "demo", "require_approval": "never"}
MIX: dict[str, tuple[int, dict[str, Any], int]] = {
    # name: (count at scale 1, body, expected status)
    "plain": (40, {"model": "dev", "input": "hello"}, 200),
    "tools_calculate": (14, {"model": "dev", "input": "calculate 6*7", "tools": [DEMO]}, 200),
    "tools_time": (6, {"model": "dev", "input": "call get_time", "tools": [DEMO]}, 200),
    "medium": (20, {"model": "dev", "input": [{"role": "user", "content": "a"}] * 3000}, 200),
    "loops": (6, {"model": "dev", "input": "loop forever", "tools": [DEMO]}, 508),
    "oversized": (4, {"model": "dev", "input": [{"role": "user", "content": "a"}] * 12000}, 413),
}


def run(url: str, scale: int = 1, concurrency: int = 4) -> dict[str, Any]:
    """Send the mix to `url` (the gateway's base URL); returns what was sent and seen."""
    jobs = [
        (name, {**body, "metadata": {"load_request": str(i)}})
        for i, (name, body) in enumerate(
            (name, body) for name, (n, body, _) in MIX.items() for _ in range(n * scale)
        )
    ]
    jobs = jobs[::2] + jobs[1::2]  # interleave kinds a little
    statuses: Counter[str] = Counter()
    with httpx.Client(base_url=url, timeout=60) as client:

        def one(job: tuple[str, dict[str, Any]]) -> tuple[str, int]:
            name, body = job
            return name, client.post("/v1/responses", json=body).status_code

        with ThreadPoolExecutor(concurrency) as pool:
            for name, status in pool.map(one, jobs):
                statuses[f"{name}:{status}"] += 1
    sent = {name: n * scale for name, (n, _, _) in MIX.items()}
    unexpected = {k: v for k, v in statuses.items() if int(k.split(":")[1]) != MIX[k.split(":")[0]][2]}
    return {
        "requests": len(jobs),
        "sent": sent,
        "statuses": dict(statuses),
        "unexpected": unexpected,
        "max_infer_iters_hits": sent["loops"],
        "max_retained_bytes_hits": sent["oversized"],
        "tool_calls": sent["tools_calculate"] + sent["tools_time"],
    }


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(run(args.url, args.scale, args.concurrency), indent=1))


if __name__ == "__main__":
    main()
