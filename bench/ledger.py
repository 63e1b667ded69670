"""Node-counting and admission throughput next to json.loads / orjson.loads (a script, not a test).

Usage: ``python bench/ledger.py [--size BYTES] [--repeat N]``

Builds a ~10 MB Responses-shaped body (a response object with many output items: messages with
UTF-8 text, function calls with JSON-in-JSON arguments, reasoning items with base64, tool outputs
with floats, echoed tool definitions), plus the same body re-encoded with ``ensure_ascii=True``
(what Python's json.dumps sends by default), and prints MB/s for each operation — best of
``--repeat`` runs, all measured in this one run — and the ratio of counting + admission to one
``json.loads`` of the same bytes. Target (issue 3): ratio <= 1.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from budget import JsonNodeCounter, Ledger, count_json_nodes, loads_strict
from budget.calibrate import responses_body

CHUNK = 64 * 1024


def best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def chunked(raw: bytes) -> int:
    counter = JsonNodeCounter()  # default depth cap 128, as the gateway's counting pass
    for start in range(0, len(raw), CHUNK):
        counter.feed(raw[start : start + CHUNK])
    return counter.nodes


def admit(raw: bytes) -> int:
    return Ledger(1 << 40).admit_input(raw)  # a limit that fits 10 MB x 32, to time the work


def bench(label: str, raw: bytes, repeat: int) -> None:
    ops: dict[str, Callable[[], object]] = {
        "count_json_nodes": lambda: count_json_nodes(raw),
        "Ledger.admit_input": lambda: admit(raw),
        "JsonNodeCounter, 64 KiB chunks": lambda: chunked(raw),
        "json.loads": lambda: json.loads(raw),
        "loads_strict": lambda: loads_strict(raw),
    }
    try:
        import orjson

        ops["orjson.loads"] = lambda: orjson.loads(raw)
    except ImportError:  # pragma: no cover
        pass
    try:
        import collections

        import ijson

        if ijson.backend == "yajl2_c":
            ops["ijson yajl2_c basic_parse"] = lambda: collections.deque(
                ijson.basic_parse(io.BytesIO(raw), use_float=True), maxlen=0
            )
    except ImportError:  # pragma: no cover
        pass
    nodes = count_json_nodes(raw)
    assert chunked(raw) == nodes
    mb = len(raw) / 1e6
    print(f"\n{label}: {len(raw):,} bytes, {nodes:,} nodes")
    times = {name: best_of(fn, repeat) for name, fn in ops.items()}
    for name, seconds in times.items():
        print(f"  {name:32s} {seconds * 1e3:8.1f} ms  {mb / seconds:8.1f} MB/s")
    base = times["json.loads"]
    print(f"  ratio count_json_nodes / json.loads        {times['count_json_nodes'] / base:.2f}")
    print(f"  ratio admit_input (count+admit) / json.loads {times['Ledger.admit_input'] / base:.2f}")
    print(
        f"  ratio chunked counter / json.loads         {times['JsonNodeCounter, 64 KiB chunks'] / base:.2f}"
    )
    if "orjson.loads" in times:
        print(
            f"  ratio admit_input / orjson.loads           {times['Ledger.admit_input'] / times['orjson.loads']:.2f}"
        )
    print(f"  ratio loads_strict / json.loads            {times['loads_strict'] / base:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    raw = responses_body(args.size)
    print(f"Python {sys.version.split()[0]}; best of {args.repeat}")
    bench("Responses body, UTF-8 (ensure_ascii=False)", raw, args.repeat)
    bench("same body, ASCII-escaped (ensure_ascii=True)", json.dumps(json.loads(raw)).encode(), args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
