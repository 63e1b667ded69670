"""Measure what CPython really retains when it parses JSON, and derive `ChargeModel.cpython`.

Run ``python -m budget.calibrate`` (``--size BYTES`` per payload, default 1 MiB). For each shape
in `SHAPES` — the pathological ones (``[{},{},…]``, ``[[],[],…]``, one-character strings, long
strings in the worst string representation, floats, big ints, nesting to the cap) and a
Responses-shaped body — it parses the payload with ``json.loads``, msgspec (and ``orjson.loads``
when installed) under `tracemalloc`, and records retained bytes (what the parsed value keeps alive)
and the peak during parsing. From those it fits, per parser and then the worst of them:

* ``a`` — retained bytes per wire byte: the largest ratio over string-dominated shapes;
* ``b`` — retained bytes per node: the largest ``(retained - a*len) / nodes`` over all shapes;

and the same two for the parse peak. It prints a table and a `ChargeModel(...)` with a safety
margin (``--margin``, default 1.25) built as documented in `derive_model`, ready to paste into
`ChargeModel.cpython`. No I/O besides stdout; nothing here runs when `budget` is imported.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import json
import math
import platform
import random
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from .jsonstrict import _loads_exact, decode_first, loads_strict
from .model import ChargeModel
from .nodes import count_json_nodes, json_features

__all__ = [
    "SHAPES",
    "Measurement",
    "derive_model",
    "measure",
    "measured_charge",
    "parsers",
    "pipeline_peak",
    "ratios",
    "responses_body",
]

Parser = Callable[[bytes], object]


def _array(item: Callable[[int], str], size: int) -> bytes:
    parts: list[str] = []
    total = 2
    i = 0
    while total < size:
        text = item(i)
        parts.append(text)
        total += len(text.encode()) + 1
        i += 1
    return ("[" + ",".join(parts) + "]").encode()


def _printable(i: int) -> str:
    return json.dumps(chr(0x21 + (i % 94)))


def _long_string(unit: str, size: int, prefix: str = "") -> bytes:
    count = max(size // len(unit.encode()), 1)
    return json.dumps([prefix + unit * count], ensure_ascii=False).encode()


def _nested(size: int, depth: int = 128) -> bytes:
    one = "[" * (depth - 1) + "]" * (depth - 1)  # inside a top-level array: depth levels in all
    return _array(lambda i: one, size)


#: The words of the calibration messages: ASCII, accented Latin and an astral emoji.
_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "météo", "Paris", "😀", "données"]


def _echoed_tools(count: int = 20) -> list[dict[str, object]]:
    """The ``count`` strict function tool definitions a response object echoes."""
    return [
        {
            "type": "function",
            "name": f"tool_{i}",
            "description": "Look things up for the user.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        }
        for i in range(count)
    ]


def _message_item(i: int, rnd: random.Random) -> dict[str, object]:
    """Output item ``i``: an assistant message of 10-300 words of UTF-8 text."""
    text = " ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(10, 300)))
    return {
        "type": "message",
        "id": f"msg_{i:08x}",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _function_call_item(i: int, rnd: random.Random) -> dict[str, object]:
    """Output item ``i``: a function call whose arguments are JSON in JSON (escapes, floats, nulls)."""
    args = {
        "city": "Paris",
        "days": rnd.randint(1, 14),
        "filters": {"tags": ["a", "b"], "score": rnd.random(), "path": "C:\\tmp\\x"},
        "rows": [{"x": j, "y": [j, j * 0.5, None, True]} for j in range(rnd.randint(1, 6))],
    }
    return {
        "type": "function_call",
        "id": f"fc_{i:08x}",
        "call_id": f"call_{i:08x}",
        "name": "get_weather",
        "arguments": json.dumps(args),
        "status": "completed",
    }


def _reasoning_item(i: int, rnd: random.Random) -> dict[str, object]:
    """Output item ``i``: a reasoning item with 100-2000 random bytes of base64 ``encrypted_content``."""
    return {
        "type": "reasoning",
        "id": f"rs_{i:08x}",
        "summary": [{"type": "summary_text", "text": "Thinking."}],
        "encrypted_content": base64.b64encode(rnd.randbytes(rnd.randint(100, 2000))).decode(),
    }


def _tool_output_item(i: int, rnd: random.Random) -> dict[str, object]:
    """Output item ``i``: the output of the call two items back, 12 floats and escapes as JSON text."""
    result = {"temperature": [round(rnd.uniform(-10, 30), 3) for _ in range(12)], "note": 'a "b" \\ c'}
    return {"type": "function_call_output", "call_id": f"call_{i - 2:08x}", "output": json.dumps(result)}


#: The four output item kinds, in the order item ``i`` cycles through them (``i % 4``).
_ITEM_KINDS = (_message_item, _function_call_item, _reasoning_item, _tool_output_item)


def responses_body(size: int, seed: int = 7) -> bytes:
    """A Responses-API-shaped response object of about ``size`` bytes: messages with UTF-8 text,
    function calls with JSON-in-JSON arguments, reasoning items with base64, tool outputs with
    floats, and the echoed tool definitions. Deterministic for a given seed."""
    rnd = random.Random(seed)
    output: list[object] = []
    total = 0
    i = 0
    while total < size:
        item = _ITEM_KINDS[i % 4](i, rnd)
        output.append(item)
        total += len(json.dumps(item, ensure_ascii=False).encode())
        i += 1
    body = {
        "id": "resp_calibrate",
        "object": "response",
        "created_at": 1_730_000_000,
        "status": "completed",
        "model": "gpt-4o",
        "instructions": "You are a helpful assistant.",
        "output": output,
        "tools": _echoed_tools(),
        "parallel_tool_calls": True,
        "usage": {"input_tokens": 123, "output_tokens": 456, "total_tokens": 579},
        "metadata": {},
        "temperature": 1.0,
    }
    return json.dumps(body, ensure_ascii=False).encode()


SHAPES: dict[str, Callable[[int], bytes]] = {
    "empty_objects": lambda n: _array(lambda i: "{}", n),
    "empty_arrays": lambda n: _array(lambda i: "[]", n),
    "one_char_strings": lambda n: _array(_printable, n),
    "short_distinct_strings": lambda n: _array(lambda i: f'"{i:x}"', n),
    "distinct_keys_object": lambda n: _array(lambda i: f'{{"k{i:x}":0}}', n),
    "wide_object": lambda n: ("{" + ",".join(f'"k{i}":{i}' for i in range(max(n // 12, 1))) + "}").encode(),
    "small_objects": lambda n: _array(lambda i: '{"type":"x","id":1}', n),
    "floats": lambda n: _array(lambda i: repr(i * 1.000001 + 0.5), n),
    "big_ints": lambda n: _array(lambda i: str(10**12 + i), n),
    "small_ints": lambda n: _array(lambda i: str(i % 100), n),
    "literals": lambda n: _array(lambda i: ("true", "false", "null")[i % 3], n),
    "nesting_to_cap": _nested,
    "long_ascii_string": lambda n: _long_string("abcdefgh", n),
    "long_ucs4_string": lambda n: _long_string("abcdefgh", n, prefix="😀"),
    "long_ucs2_string": lambda n: _long_string("漢字かな", n),
    "long_latin1_string": lambda n: _long_string("é", n),
    "escaped_string": lambda n: _long_string("\\n\\u00e9", n).replace(b"\\\\", b"\\"),
    "responses_body": responses_body,
}
"""Payload generators, ``size -> bytes`` (about ``size`` bytes), by shape name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One payload parsed once: sizes in bytes, ``nodes`` counted lexically."""

    shape: str
    parser: str
    nbytes: int
    nodes: int
    retained: int
    peak: int


def parsers() -> dict[str, Parser]:
    """The parsers to measure: ``json.loads``, msgspec's decode (the gateway's first route,
    `budget.decode_first`: the size-only charge of a lifecycle or delta frame must cover it with
    no condition on its strings) and ``orjson.loads`` when installed."""
    found: dict[str, Parser] = {"json.loads": json.loads, "msgspec": msgspec.json.decode}
    try:
        import orjson
    except ImportError:  # pragma: no cover - orjson is a test dependency
        return found
    found["orjson.loads"] = orjson.loads
    return found


def _window(parse: Parser, payload: bytes) -> tuple[int, int]:
    gc.collect(0)  # young objects only: a full collection per measurement is too slow in tests
    gc.disable()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        value = parse(payload)
        peak = tracemalloc.get_traced_memory()[1]
        gc.enable()
        gc.collect(0)  # cyclic garbage the parser left behind (all young) is not retained
        after = tracemalloc.get_traced_memory()[0]
        del value
    finally:
        gc.enable()
    return after - before, peak - before


def _ignore(payload: bytes) -> None:
    return None


def measure(parse: Parser, payload: bytes) -> tuple[int, int]:
    """Parse ``payload`` once under `tracemalloc`; return (retained, peak) in bytes, both relative
    to before the call and net of what the measuring itself allocates (measured with a parser
    that does nothing). ``payload`` itself is allocated before and not counted; cyclic garbage
    is collected before "retained" is read."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        with contextlib.suppress(Exception):  # a prefix is rarely valid JSON; this only warms caches
            parse(payload[:64])  # (orjson's key cache, interned names) outside the measured window
        _window(_ignore, payload)
        base_retained, base_peak = _window(_ignore, payload)
        retained, peak = _window(parse, payload)
    finally:
        if started:
            tracemalloc.stop()
    return max(retained - base_retained, 0), max(peak - base_peak, 0)


def _encode(value: object) -> bytes:
    # what the gateway's encoders do (middleware.upstream.reader.dumps_checked): compact, ASCII
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _input_pipeline(raw: bytes, store: bool, *, first: bool = False) -> object:
    held = bytes(bytearray(raw))  # the request's own copy of its body
    # `loads_strict`'s json.loads path (any body may take it), or (``first``) the route it takes,
    # msgspec's where it may: `pipeline_peak` measures both, the worse is the peak
    value = loads_strict(held) if first else _loads_exact(held)
    upstream = _encode(value)  # the re-serialised upstream body, alive while it is sent
    projection = _encode(value) if store else b""  # the persisted projection
    return held, value, upstream, projection


def _output_pipeline(raw: bytes, store: bool, *, first: bool = False) -> object:
    half = len(raw) // 2
    chunks = [bytes(bytearray(raw[:half])), bytes(bytearray(raw[half:]))]  # as read
    body = b"".join(chunks)
    # middleware.upstream.reader.loads_upstream's routes: json.loads (any body may take it), or
    # (``first``) msgspec where it may (`decode_first`; the caller counted the depth)
    done, value = decode_first(body, depth_checked=True) if first else (False, None)
    if not done:
        value = json.loads(body)
    return chunks, body, value  # what it keeps and encodes later is the accumulated / terminal charge


def pipeline_peak(raw: bytes, owner: str = "input", store: bool = False, repeat: int = 3) -> int:
    """The most memory the gateway's own steps hold at once for ``raw`` (bytes, `tracemalloc`
    peak above the start, ``raw`` itself not counted): for ``owner="input"`` the request's copy
    of the body, `loads_strict`, the re-serialised upstream body and with ``store`` the
    persisted projection; for ``"output"`` a buffered upstream body read in two chunks, joined
    and parsed (its encoding for the client is the terminal charge's). The least of
    ``repeat`` runs, for the worse of the two parse routes (``json.loads``, which any body may
    take, and msgspec where `decode_first` may). What the measured model's
    soundness (charge ≥ this) and tightness (charge ≤ 2 × this) are tested against."""
    run_it = _input_pipeline if owner == "input" else _output_pipeline
    worst = 1
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        for first in (False, True):  # both parse routes: the worse is the peak
            peaks = []
            # interned names, outside the window
            run_it(b'{"warm":["caches",1,2.5,true]}', store, first=first)
            gc.collect(0)  # young objects only: a full collection per call is too slow in a test run
            for _ in range(repeat):  # the least of a few runs: a stray allocation only adds
                gc.disable()
                before = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                kept = run_it(raw, store, first=first)
                peaks.append(tracemalloc.get_traced_memory()[1] - before)
                del kept
                gc.enable()
            worst = max(worst, min(peaks))
    finally:
        if started:
            tracemalloc.stop()
        gc.enable()
    return worst


def measured_charge(raw: bytes, owner: str = "input", store: bool = False) -> int:
    """The measured model's charge for ``raw`` as ``owner`` (``"input"`` or ``"output"``)."""
    model, features = ChargeModel.measured(), json_features(raw)
    if owner == "input":
        return model.measured_input(features, store)
    return model.measured_output(features, store)


def ratios(size: int) -> list[tuple[str, str, bool, float]]:
    """``(shape, owner, store, charge / pipeline peak)`` for every shape of `SHAPES`."""
    out = []
    for shape, make in SHAPES.items():
        payload = make(size)
        for owner in ("input", "output"):
            for store in (False, True):
                peak = pipeline_peak(payload, owner, store)
                out.append((shape, owner, store, measured_charge(payload, owner, store) / peak))
    return out


def run(size: int) -> list[Measurement]:
    """Measure every shape with every parser."""
    out: list[Measurement] = []
    tracemalloc.start()
    try:
        for shape, make in SHAPES.items():
            payload = make(size)
            nodes = count_json_nodes(payload)
            for name, parse in parsers().items():
                retained, peak = measure(parse, payload)
                out.append(
                    Measurement(
                        shape=shape,
                        parser=name,
                        nbytes=len(payload),
                        nodes=nodes,
                        retained=retained,
                        peak=peak,
                    )
                )
    finally:
        tracemalloc.stop()
    return out


def _fit(rows: list[Measurement], value: Callable[[Measurement], int]) -> tuple[float, float]:
    """(per byte, per node) covering every row: per byte from string-dominated rows, per node
    from what per byte leaves uncovered."""
    per_byte = max(value(r) / r.nbytes for r in rows if r.nodes * 1000 < r.nbytes)
    per_node = max((value(r) - per_byte * r.nbytes) / r.nodes for r in rows if r.nodes)
    return per_byte, max(per_node, 0.0)


def derive_model(rows: list[Measurement], margin: float = 1.25) -> ChargeModel:
    """Build the CPython model from measurements; every field has ``margin`` on top.

    With ``a, b`` the retained bytes per wire byte / per node (worst over the parsers measured),
    ``ja, jb`` the ``json.loads`` parse *peak* (the gateway parses client bodies with it, via
    `loads_strict`) and ``pa, pb`` the parse peak of the worst parser:

    * input, tool result: ``1 + max(a, ja)`` per byte (the raw body is held too),
      ``max(b, jb)`` per node;
    * buffered output: ``2 + pa`` per byte (chunks, the joined body, the parse peak),
      ``2 * pb`` per node (the parsed body and the items built from it);
    * stream retained: ``5`` per byte (raw bytes plus their decoded text, at most 4 bytes per
      character); stream transient: ``2`` per byte (one copy while splitting frames);
    * frame: ``pb`` per node, and half of it more with store;
    * accumulated: ``a`` per byte, ``b`` per node;
    * terminal: ``5`` per byte (the encoded text and its bytes), half of it more with store;
    * history: ``1 + max(a, ja)`` per byte, ``2 * pb`` per node;
    * store multiplier ``2``, as in the reference design.
    """
    a, b = _fit(rows, lambda r: r.retained)
    ja, jb = _fit([r for r in rows if r.parser == "json.loads"], lambda r: r.peak)
    pa, pb = _fit(rows, lambda r: r.peak)

    def up(x: float, step: int = 1) -> int:
        return math.ceil(x * margin / step) * step

    return ChargeModel(
        input_per_byte=up(1 + max(a, ja)),
        input_per_node=up(max(b, jb), 8),
        output_per_byte=up(2 + pa),
        output_per_node=up(2 * pb, 8),
        stream_retained_per_byte=up(5),
        stream_transient_per_byte=up(2),
        frame_per_node=up(pb, 8),
        frame_store_extra_per_node=up(pb / 2, 8),
        accumulated_per_byte=up(a),
        accumulated_per_node=up(b, 8),
        terminal_per_byte=up(5),
        terminal_store_extra_per_byte=up(2.5),
        tool_per_byte=up(1 + max(a, ja)),
        tool_per_node=up(max(b, jb), 8),
        history_per_byte=up(1 + max(a, ja)),
        history_per_node=up(2 * pb, 8),
        store_multiplier=2,
    )


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: print measurements and the derived model."""
    parser = argparse.ArgumentParser(prog="python -m budget.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes per payload (default 1 MiB)")
    parser.add_argument("--margin", type=float, default=1.25, help="safety factor (default 1.25)")
    args = parser.parse_args(argv)
    rows = run(args.size)
    print(
        f"# {platform.python_implementation()} {platform.python_version()} ({platform.machine()}), ", end=""
    )
    print(f"payloads of ~{args.size} bytes")
    print(
        f"{'shape':24} {'parser':13} {'bytes':>9} {'nodes':>8} {'retained':>10} {'/byte':>6} {'peak/byte':>9}"
    )
    for r in rows:
        print(
            f"{r.shape:24} {r.parser:13} {r.nbytes:9d} {r.nodes:8d} {r.retained:10d} "
            f"{r.retained / r.nbytes:6.2f} {r.peak / r.nbytes:9.2f}"
        )
    a, b = _fit(rows, lambda r: r.retained)
    ja, jb = _fit([r for r in rows if r.parser == "json.loads"], lambda r: r.peak)
    pa, pb = _fit(rows, lambda r: r.peak)
    print(f"# retained (worst parser): {a:.2f} per byte + {b:.1f} per node")
    print(f"# json.loads peak: {ja:.2f} per byte + {jb:.1f} per node; worst peak: {pa:.2f} + {pb:.1f}")
    print("# measured model: charge / peak of the gateway's pipeline (sound >= 1, tight <= 2)")
    table = ratios(args.size)
    for shape in SHAPES:
        values = sorted(r for s, _o, _st, r in table if s == shape)
        print(
            f"#   {shape:24} min {values[0]:5.2f}  median {values[len(values) // 2]:5.2f}  max {values[-1]:5.2f}"
        )
    every = sorted(r for *_x, r in table)
    print(
        f"#   {'all shapes':24} min {every[0]:5.2f}  median {every[len(every) // 2]:5.2f}  max {every[-1]:5.2f}"
    )
    model = derive_model(rows, args.margin)
    print("# size-only bounds (the measured model's per-byte / per-node fields)")
    print(f"# --- generated by `python -m budget.calibrate` ({platform.python_implementation()} ", end="")
    print(f"{platform.python_version()}, {platform.machine()}) ---")
    print("return cls(")
    for name in model.__dataclass_fields__:
        if name != "parse":
            print(f"    {name}={getattr(model, name)},")
    print(")")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
