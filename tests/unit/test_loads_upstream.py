"""`loads_upstream` and `budget.loads_strict` decode with msgspec first and fall back to
``json.loads`` for whatever msgspec refuses (issue 21): each must give exactly its old answer — the
same value (types, key order, the last of a repeated key) or the same failure with the same
message — for every text, and keep to texts that provably nest no deeper than 256 levels
(msgspec's own nesting limit is a few levels above ``json.loads``'). `loads_strict` keeps
msgspec's value only when it provably repeats no key (the exact path names the repeat)."""

from __future__ import annotations

import gc
import json
import math
import tracemalloc
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import JsonInvalid, JsonTooDeep, json_features, loads_strict, msgspec_may_decode
from budget.jsonstrict import _first_decode, _loads_exact
from middleware.upstream.errors import UpstreamInvalid
from middleware.upstream.reader import _UPSTREAM_DECODER, MAX_UPSTREAM_DEPTH, loads_upstream


def reference(data: bytes) -> Any:
    """What `loads_upstream` ran before msgspec came first: ``json.loads`` with its hooks."""
    return _UPSTREAM_DECODER.decode(data.decode("utf-8", "surrogatepass"))


def outcome(call: Any, data: bytes) -> tuple[str, Any]:
    try:
        return "value", call(data)
    except (JsonInvalid, JsonTooDeep) as exc:  # loads_strict's refusals: code, message and param
        return type(exc).__name__, (getattr(exc, "code", None), str(exc), getattr(exc, "param", None))
    except (ValueError, RecursionError, UpstreamInvalid) as exc:  # UnicodeDecodeError is a ValueError
        return type(exc).__name__, str(exc)


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types, keys in the same order (``1`` is not ``1.0`` or ``True``;
    ``-0.0`` is not ``0.0``). Iterative: the values may nest as deep as ``json.loads`` allows."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            stack.extend((x[key], y[key]) for key in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif isinstance(x, float):
            if x != y or math.copysign(1.0, x) != math.copysign(1.0, y):
                return False
        elif x != y:
            return False
    return True


def assert_as_before(data: bytes) -> None:
    new, old = outcome(loads_upstream, data), outcome(reference, data)
    assert new[0] == old[0], (data[:200], new, old)
    if new[0] == "value":
        assert same(new[1], old[1]), data[:200]
        # a caller that counted the depth itself gets the same answer
        if data.count(b"[") + data.count(b"{") <= MAX_UPSTREAM_DEPTH:
            assert same(loads_upstream(data, depth_checked=True), old[1])
    else:
        assert new[1] == old[1]  # the same message: json.loads gave the verdict
    # an SSE frame's caller (a size-only charge: msgspec takes one-character strings too) where
    # that changes the route (deeper text goes to json.loads either way; at the interpreter's
    # recursion limit one more call frame moves where json.loads refuses: the depth test)
    if len(data) <= 512 or data.count(b"[") + data.count(b"{") <= 256:
        framed = outcome(lambda text: loads_upstream(text, size_priced=True), data)
        assert framed[0] == old[0], (data[:200], framed, old)
        assert same(framed[1], old[1]) if framed[0] == "value" else framed[1] == old[1], data[:200]


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities too: json.dumps writes them as NaN / Infinity
    | st.text()  # lone surrogates too: json.dumps writes \ud800
    | st.sampled_from(["\ud83d\ude00", "é", "\x00", '"\\/'])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
#: Bytes whose insertion or replacement makes the edge cases: structure, escapes, number syntax,
#: whitespace JSON does and does not allow, invalid and surrogate UTF-8, a byte order mark.
NOISE = [
    b"{",
    b"}",
    b"[",
    b"]",
    b'"',
    b",",
    b":",
    b"\\",
    b"\\u",
    b"d8",
    b"00",
    b"-",
    b"+",
    b".",
    b"e",
    b"E",
    b"0",
    b"9",
    b" ",
    b"\t",
    b"\n",
    b"\r",
    b"\x0c",
    b"\x00",
    b"\xed\xa0\x80",
    b"\xff",
    b"\xc3\xa9",
    b"\xef\xbb\xbf",
    b"NaN",
    b"1e400",
    b"true",
    b"null",
    b"\xf0\x9f\x98\x80",
    b"7" * 4300,
    b"7" * 4301,
]  # (the last two: either side of the int digit limit)


@st.composite
def texts(draw: st.DrawFn) -> bytes:
    value = draw(values)
    ensure_ascii = draw(st.booleans())
    indent = draw(st.none() | st.sampled_from([0, 1, "\t"]))
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)
    data = text.encode("utf-8", "surrogatepass")
    for _ in range(draw(st.integers(0, 3))):  # a few edits: insert, replace or delete
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["insert", "replace", "delete"]))
        noise = draw(st.sampled_from(NOISE))
        if kind == "insert":
            data = data[:at] + noise + data[at:]
        elif kind == "replace":
            data = data[:at] + noise + data[at + len(noise) :]
        else:
            data = data[:at] + data[at + 1 :]
    return data


def assert_strict_as_before(data: bytes) -> None:
    """`loads_strict`, with and without the caller's ``:`` count and depth cap, against its exact
    path alone."""
    old = outcome(_loads_exact, data)
    calls = [lambda text: loads_strict(text)]
    if data.count(b"[") + data.count(b"{") <= 128:  # what the intake's counter proves
        members = json_features(data).members
        calls.append(lambda text: loads_strict(text, members=members, depth_checked=True))
    for call in calls:
        new = outcome(call, data)
        assert new[0] == old[0], (data[:200], new, old)
        assert same(new[1], old[1]) if new[0] == "value" else new[1] == old[1], data[:200]


@settings(max_examples=1500, deadline=None)
@given(texts())
def test_every_text_decodes_or_fails_as_json_loads_alone_did(data: bytes) -> None:
    assert_as_before(data)
    assert_strict_as_before(data)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(NOISE), max_size=12).map(b"".join))
def test_token_soup_decodes_or_fails_as_json_loads_alone_did(data: bytes) -> None:
    assert_as_before(data)
    assert_strict_as_before(data)


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":1,"b":2,"a":3}',  # the last of a repeated key, in the first one's place
        b'{"\\u0061":1,"a":2}',
        b'"\\ud800"',  # a lone surrogate: json.loads keeps it (refused later, with its own message)
        b'"\xed\xa0\x80"',  # raw surrogate bytes: the same
        b'"\\ud83d\\ude00"',
        b"[1e400]",  # UpstreamInvalid, out of range
        b"[-1e400]",
        b"[NaN]",
        b"[1e-400]",
        b"1" * 4301,  # over the int digit limit: ValueError
        b"1" * 4300,
        b"\xef\xbb\xbf{}",  # a byte order mark
        b"{}\x0c",
        b"-0",
        b"-0.0",
        b'{"a":1}{"b":2}',
        b'"\\udc00\\ud800"',  # surrogates in the wrong order, two highs, a high before a non-low
        b'"\\ud800\\ud800"',
        b'"\\ud83d\\u0041"',
        b'"\\ud83dx"',
        b'"\\udbff\\udfff"',
        b'"\\\\ud800"',  # an escaped backslash, then text
        b'{"a":{"b":1,"b":2}}',  # a repeat in a nested object: loads_strict names input path a.b
        b'{"k":"x:y","k":1}',  # a repeat hidden by a ":" inside a string
        b'{"k":"x:y","j":1}',  # no repeat, but more ":" than keys: the exact path decides
        b'{"input":[{"role":"user","content":"hi"},{"role":"user","role":"user"}]}',
    ],
)
def test_edge_cases_as_before(data: bytes) -> None:
    assert_as_before(data)
    assert_strict_as_before(data)


def test_nesting_past_the_depth_bound_is_left_to_json_loads() -> None:
    """msgspec accepts a few more levels than ``json.loads``: a text that nests past
    `MAX_UPSTREAM_DEPTH` goes to ``json.loads`` alone, so the deepest texts are refused as before
    (RecursionError), not decoded into values nothing after the decode could walk."""
    decoder = msgspec.json.Decoder()

    def nested(depth: int) -> bytes:
        return b'{"a":' * depth + b"1" + b"}" * depth

    # around the least depth json.loads refuses here (it depends on the stack the call runs on)
    depth = 200
    while outcome(reference, nested(depth))[0] == "value":
        depth += 1
    deepest = [outcome(decoder.decode, nested(d))[0] for d in range(depth, depth + 8)]
    assert "value" in deepest  # msgspec decodes deeper than json.loads: why the bound is needed
    for d in (
        *range(depth - 8, depth + 8),
        MAX_UPSTREAM_DEPTH - 1,
        MAX_UPSTREAM_DEPTH,
        MAX_UPSTREAM_DEPTH + 1,
    ):
        assert_as_before(nested(d))
    strict = 200  # the same around where loads_strict's exact path refuses
    while outcome(_loads_exact, nested(strict))[0] == "value":
        strict += 1
    assert "value" in [outcome(decoder.decode, nested(d))[0] for d in range(strict, strict + 8)]
    for d in (255, 256, 257):
        assert_strict_as_before(nested(d))
    for d in range(strict - 8, strict + 8):  # at json.loads' own limit: a value only where it gave one
        new, old = outcome(loads_strict, nested(d)), outcome(_loads_exact, nested(d))
        assert new[0] in ("value", "JsonTooDeep") and old[0] in ("value", "JsonTooDeep")
        if new[0] == "value":  # (a frame more on the stack may refuse a level earlier)
            assert old[0] == "value" and same(new[1], old[1])

    # msgspec's margin over json.loads is a few stack frames, so the guard itself is held too:
    # past 256 brackets msgspec is not asked unless the caller capped the depth
    def wide(depth: int) -> bytes:  # (a key of two characters: "a" sends a text to json.loads)
        return b'{"ab":' * depth + b"1" + b"}" * depth

    assert _first_decode(wide(256), None, depth_checked=False) == (True, json.loads(wide(256)))
    assert _first_decode(wide(257), None, depth_checked=False) == (False, None)
    assert _first_decode(wide(257), None, depth_checked=True)[0] is True
    assert msgspec_may_decode(wide(257), depth_checked=True)
    assert not msgspec_may_decode(nested(2), depth_checked=True)


def _peak(call: Any, data: bytes) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        value = call(data)
        peak = tracemalloc.get_traced_memory()[1] - base
        del value
    finally:
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(
    "value",
    [
        {"output": [{"type": "message", "content": [{"text": "word " * 4000}]}]},
        {"output": [{"text": "é" * 5000, "nn": list(range(2000))}]},
        {"items": [{"id": f"i{i}", "xx": 1.5, "ok": True, "kk": None} for i in range(1500)]},
        # keys msgspec cannot cache
        {"items": [{"long_key_" * 5 + str(i % 3000): [i, "ab"]} for i in range(3000)]},
        # a UCS-4 text: json.loads' str copy is 4 bytes a character
        {"output": [{"text": "\U0001f600" * 3000}]},
        # dense small values: loads_strict's duplicate-key walk must hold O(depth), not O(nodes)
        {"ab": [0] * 200_000},
        {"ab": [True] * 200_000},
        {"ab": [[] for _ in range(100_000)]},
    ],
)
def test_the_parse_peak_is_at_most_json_loads_which_is_what_is_priced(value: Any) -> None:
    """The charge model prices a body's parse as ``json.loads``' peak (`budget.calibrate`: an
    upstream body's, a client body's with `loads_strict`'s hooks); msgspec's first decode must
    hold no more at once, and a repeated key (msgspec's value dropped, the exact path run after
    it) no more than the exact path alone."""
    data = json.dumps(value, ensure_ascii=False).encode()
    assert msgspec_may_decode(data, depth_checked=True)  # (else the first route is json.loads too)
    first = max(_peak(lambda text: loads_upstream(text, depth_checked=True), data) for _ in range(3))
    assert first <= min(_peak(reference, data) for _ in range(3))
    members = json_features(data).members
    strict = max(
        _peak(lambda text: loads_strict(text, members=members, depth_checked=True), data) for _ in range(3)
    )
    assert strict <= min(_peak(_loads_exact, data) for _ in range(3))
    repeated = data[:-1] + b',"%s":0}' % next(iter(value)).encode()  # the last key repeats the first
    members = json_features(repeated).members

    def refused(text: bytes) -> None:
        with pytest.raises(JsonInvalid, match="duplicate key"):
            loads_strict(text, members=members, depth_checked=True)

    def exact(text: bytes) -> None:
        with pytest.raises(JsonInvalid, match="duplicate key"):
            _loads_exact(text)

    assert max(_peak(refused, repeated) for _ in range(3)) <= 1.05 * min(
        _peak(exact, repeated) for _ in range(3)
    )


@pytest.mark.parametrize(
    "token",
    [b'"x"', b'"\\n"', b'"\\""', b'{"a":0}', b'{"ab":"c"}', b'{"ab":["c"]}', b'{"a" : 0}', b'[ "x" ]'],
)
def test_one_character_strings_are_left_to_json_loads(token: bytes) -> None:
    """msgspec allocates a new ``str`` for each one-character ASCII string (key or value, raw or
    a two-byte escape), where ``json.loads`` shares CPython's (priced at nothing): a 1 MiB array
    of ``"x"`` peaks at 4.6 × ``json.loads``'. Such a text never takes msgspec's route, and the
    peak of the route taken is no more than ``json.loads``'."""
    data = b"[" + b",".join([token] * 40_000) + b"]"
    assert not msgspec_may_decode(data, depth_checked=True)
    ours = max(_peak(lambda text: loads_upstream(text, depth_checked=True), data) for _ in range(2))
    assert ours <= 1.05 * min(_peak(reference, data) for _ in range(2))
    assert msgspec_may_decode(b'{"ab":"cd","uu":"\\u0041"}')  # a \u escape: msgspec shares it too


def _array(token: bytes, size: int = 256 * 1024) -> bytes:
    return b"[" + b",".join([token] * (size // (len(token) + 1))) + b"]"


@pytest.mark.parametrize(
    "body",
    [
        _array(b'{"' + b"k" * 40 + b'":0}'),  # a long key: msgspec makes one str per occurrence
        b"[" + b",".join(b'{"k%d":0}' % (i % 2000) for i in range(25_000)) + b"]",  # keys past its cache
        _array(b'"ab"'),
        _array(b'{"ab":{}}'),
        _array(b'"\\u0041"'),
        _array(b'"\\u0001"'),
        _array('"é"'.encode()),
        _array('"€"'.encode()),
    ],
    ids=[
        "long-keys",
        "many-keys",
        "short-strings",
        "objects",
        "escaped-char",
        "escaped-control",
        "latin1-char",
        "bmp-char",
    ],
)
@pytest.mark.parametrize("owner", ["input", "output"])
def test_the_measured_charge_covers_msgspecs_route(body: bytes, owner: str) -> None:
    """Where msgspec decodes (these texts may take its route), the measured model's charge covers
    the worse route's peak (`budget.calibrate.pipeline_peak` measures both), keys msgspec
    allocates per occurrence included (the model prices every key token as its own string)."""
    from budget.calibrate import measured_charge, pipeline_peak

    assert msgspec_may_decode(body, depth_checked=True)
    for store in (False, True):
        assert measured_charge(body, owner, store) >= pipeline_peak(body, owner, store, repeat=2)


FRAME_SHAPES = {
    "one-char strings": b'"x"',
    "escaped one-char strings": b'"\\n"',
    "one-char keys and values": b'{"a":"b","c":"d"}',
    "empty objects": b"{}",
    "empty arrays": b"[]",
    "small objects": b'{"ab":1}',
    "floats": b"1.5",
    "literals": b"true",
    "small ints": b"7",
}


@pytest.mark.parametrize("token", FRAME_SHAPES.values(), ids=FRAME_SHAPES.keys())
@pytest.mark.parametrize("size", [600, 64 * 1024])
def test_an_sse_frames_size_only_charge_covers_msgspec_with_one_character_strings(
    token: bytes, size: int
) -> None:
    """A lifecycle or delta frame is decoded by msgspec whatever its strings
    (`loads_upstream(size_priced=True)`, the exact path's frames): its charge, `ChargeModel.frame_charge` per node (the measured model's
    88 bytes, fitted over msgspec too: `budget.calibrate.parsers`; the reference model's 512), must
    cover that parse's peak where msgspec allocates a ``str`` for each one-character string."""
    from budget import ChargeModel, count_json_nodes

    data = b'{"type":"response.output_text.delta","v":' + _array(token, size) + b"}"
    nodes = count_json_nodes(data)
    # msgspec's route wherever the nesting is provable (else json.loads': covered the same way)
    assert msgspec_may_decode(data, size_priced=True) == (data.count(b"[") + data.count(b"{") <= 256)
    peak = max(_peak(lambda text: loads_upstream(text, size_priced=True), data) for _ in range(2))
    for model in (ChargeModel.measured(), ChargeModel.reference()):
        for store in (False, True):
            assert model.frame_charge(nodes, store) >= peak, (model.name, store, peak, nodes)
    # the caller's bound before counting nodes: one node per byte (`check_stream_frame_bounded`)
    assert ChargeModel.measured().frame_charge(len(data), False) >= peak


def _kept_by_the_accumulator(kind: str, data: bytes, store: bool) -> tuple[int, int]:
    """What `StreamAccumulator.apply` keeps of one frame decoded by the exact path (`_decode`),
    in bytes (tracemalloc, after a collection), and what the measured model charged for it."""
    from budget import ChargeModel, Ledger
    from middleware.upstream.reader import StreamAccumulator, _decode
    from middleware.upstream.sse import SSEEvent

    ledger = Ledger(1 << 40, ChargeModel.measured(), store=store)
    accumulator = StreamAccumulator(ledger)
    frame = SSEEvent(kind, data)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        event = _decode(frame, ledger)
        assert event is not None
        accumulator.apply(event)
        del event
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert accumulator.items or accumulator.terminal is not None
    return kept, ledger.charged


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize(
    ("kind", "frame"),
    [
        (
            "response.output_item.done",
            '{"type":"response.output_item.done","output_index":0,'
            '"item":{"type":"message","id":"m","content":[],"pad":[%s]}}',
        ),
        (
            "response.completed",
            '{"type":"response.completed","response":{"id":"r","status":"completed","output":[],"pad":[%s]}}',
        ),
    ],
)
def test_what_the_accumulator_keeps_of_a_frame_is_within_its_charge(
    kind: str, frame: str, store: bool
) -> None:
    """An item or a terminal response is kept priced by its features, which price a one-character
    string at nothing (``json.loads`` shares it): such a frame must not take msgspec's route,
    which allocates a ``str`` for each (found by the attack on the change that let every frame
    take it: 11.6 MB kept against a 2.25 MB charge for 200,000 ``"x"``)."""
    data = (frame % ",".join(['"x"'] * 20_000)).encode()
    kept, charged = _kept_by_the_accumulator(kind, data, store)
    assert kept <= charged, (kept, charged)


def _one_char_strings(value: Any) -> bool:
    """Whether `value` holds a key or string json.dumps writes as one ASCII character raw or as a
    two-byte escape (``"x"``, ``"\\n"``, ``"\\""``)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and len(item) == 1 and (0x20 <= ord(item) < 0x7F or item in "\n\r\t\b\f"):
            return True
    return False


@settings(max_examples=1000, deadline=None)
@given(
    values, st.sampled_from([None, 0, 1, "\t"]), st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")])
)
def test_a_text_with_a_one_character_string_never_takes_msgspecs_route(
    value: Any, indent: Any, separators: tuple[str, str]
) -> None:
    """No false negative, whatever the whitespace: a one-character ASCII string anywhere (key or
    value, raw or a two-byte escape) keeps the text from msgspec (`msgspec_may_decode`)."""
    try:
        data = json.dumps(value, indent=indent, separators=separators).encode("utf-8", "surrogatepass")
    except ValueError:  # (a number json.dumps will not write)
        return
    if _one_char_strings(value):
        assert not msgspec_may_decode(data, depth_checked=True), data[:200]


def test_the_key_walk_holds_no_more_than_its_depth() -> None:
    """`key_total` runs while the parsed value is alive (loads_strict's duplicate-key proof, the
    buffered body's repeated-key check): what it holds must not grow with the value's nodes."""
    from budget import key_total

    value = {"ab": [0] * 500_000, "cd": [{"e": [{"f": 1}]}] * 1000, "g": {"h": [[[]]]}}
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        assert key_total(value) == 3 + 2 * 1000 + 1
        assert tracemalloc.get_traced_memory()[1] - base < 4096
    finally:
        tracemalloc.stop()
    assert key_total([]) == key_total(0) == key_total("a") == 0
    assert key_total([{"a": 1, "b": {"c": [{"d": 2}, {}]}}, [[{"e": None}]]]) == 5
