"""JSON node counting: a simple byte-at-a-time reference, chunking independence, depth cap."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget import JsonNodeCounter, JsonTooDeep, count_json_nodes
from budget.errors import JsonRejected

NUMBER_BYTES = frozenset(b"-+.0123456789eE")


def reference(data: bytes, max_depth: int | None = None) -> tuple[int, int, int]:
    """The lexical rules of budget/nodes.py, one byte at a time: (nodes, depth, deepest).

    Backslashes pair up everywhere; an unpaired one escapes the next byte, and an escaped quote
    never opens or closes a string."""
    nodes = depth = deepest = 0
    in_string = escaped = False
    prev_is_number = False
    for byte in data:
        if escaped:
            escaped = False
            if in_string or byte in b'\\"':
                prev_is_number = False
                continue
            # outside strings the escaped byte is otherwise an ordinary byte
        elif byte == 0x5C:
            escaped = True
            prev_is_number = False
            continue
        if in_string:
            if byte == 0x22:
                in_string = False
            continue
        if byte == 0x22:
            nodes += 1
            in_string = True
        elif byte in b"{[":
            nodes += 1
            depth += 1
            deepest = max(deepest, depth)
            if max_depth is not None and depth > max_depth:
                raise JsonTooDeep(depth=depth, max_depth=max_depth)
        elif byte in b"}]":
            depth = max(depth - 1, 0)
        elif byte in b"tfn":
            nodes += 1
        if byte in b"-0123456789" and not prev_is_number:
            nodes += 1
        prev_is_number = byte in NUMBER_BYTES
    return nodes, depth, deepest


def tree_nodes(value: object) -> int:
    """Nodes of a parsed JSON value: every value and every key counts one."""
    if isinstance(value, dict):
        return 1 + sum(1 + tree_nodes(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(tree_nodes(v) for v in value)
    return 1


def feed_split(data: bytes, cuts: list[int], max_depth: int | None = 10**9) -> JsonNodeCounter:
    counter = JsonNodeCounter(max_depth=max_depth)
    last = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts):
        counter.feed(data[last:cut])
        counter.feed(b"")  # empty chunks change nothing
        last = max(last, cut)
    counter.feed(data[last:])
    return counter


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=12),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(alphabet=st.characters(codec="utf-8"), max_size=6), children, max_size=5)
    ),
    max_leaves=30,
)


@st.composite
def encoded(draw: st.DrawFn) -> tuple[object, bytes]:
    value = draw(json_values)
    ascii_only = draw(st.booleans())
    indent = draw(st.sampled_from([None, 0, 2]))
    raw = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    return value, raw


@given(encoded(), st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
@settings(max_examples=300, deadline=None)
def test_valid_json_counts_every_value_and_key_under_any_chunking(
    doc: tuple[object, bytes], cuts: list[int]
) -> None:
    value, raw = doc
    expected = tree_nodes(value)
    assert count_json_nodes(raw) == expected
    assert reference(raw)[0] == expected
    counter = feed_split(raw, cuts)
    assert counter.nodes == expected
    assert counter.depth == 0
    assert not counter.in_string


# Bytes that matter to the lexer, plus a few that do not; long backslash runs are drawn on purpose.
lexical = st.lists(
    st.sampled_from(
        [
            *(b'"', b"\\", b"\\\\", b"\\" * 9, b'\\"', b'\\\\"'),
            *(b"{", b"}", b"[", b"]", b"t", b"f", b"n", b"0", b"-", b"1e+5", b".", b",", b":"),
            *(b" ", b"x", b"u00e9", "é".encode(), "😀".encode()),
        ]
    ),
    max_size=80,
).map(b"".join)


@given(lexical, st.lists(st.integers(min_value=0, max_value=400), max_size=10))
@settings(max_examples=400, deadline=None)
def test_arbitrary_bytes_match_the_reference_under_any_chunking(data: bytes, cuts: list[int]) -> None:
    nodes, depth, deepest = reference(data)
    assert count_json_nodes(data) == nodes
    counter = feed_split(data, cuts)
    assert (counter.nodes, counter.depth, counter.max_depth_seen) == (nodes, depth, deepest)


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0, max_value=300), max_size=6))
@settings(max_examples=200, deadline=None)
def test_random_binary_never_raises_and_matches_reference(data: bytes, cuts: list[int]) -> None:
    nodes, depth, deepest = reference(data)
    counter = feed_split(data, cuts)
    assert (counter.nodes, counter.depth, counter.max_depth_seen) == (nodes, depth, deepest)


def test_byte_at_a_time_equals_one_shot_on_a_responses_body() -> None:
    from budget.calibrate import responses_body

    raw = responses_body(40_000)
    value = json.loads(raw)
    counter = JsonNodeCounter()
    for i in range(len(raw)):
        counter.feed(raw[i : i + 1])
    assert counter.nodes == count_json_nodes(raw) == tree_nodes(value)
    assert counter.depth == 0 and counter.max_depth_seen == 6  # response.tools[].parameters.properties.city


@pytest.mark.parametrize(
    ("raw", "nodes"),
    [
        (b"", 0),
        (b"{}", 1),
        (b'{"a":1}', 3),
        (b'["a","b"]', 3),
        (b"[true,false,null]", 4),
        (b"[-1.5e+10,0,12]", 4),
        (b'"tfn{[123"', 1),  # nothing inside a string counts
        (b'"a\\"b"', 1),  # an escaped quote does not end the string
        (b'"a\\\\"1', 2),  # an escaped backslash does: then the number counts
        (b'["\\\\\\\\\\\\\\\\\\\\",1]', 3),  # ten backslashes (the slow path) then a real quote
        (b'["\\\\\\\\\\\\\\\\\\",1]', 2),  # nine: the quote is escaped, the string never ends
        (b'"\\u00e9\\ud83d\\ude00"', 1),
        ('["é😀", 1]'.encode(), 3),
        (b"[1 2]", 3),
        (b"truefalse", 2),  # lexical: first letters
        (b"]]]][", 1),  # depth never below zero
    ],
)
def test_known_counts(raw: bytes, nodes: int) -> None:
    assert count_json_nodes(raw) == nodes
    assert reference(raw)[0] == nodes


@pytest.mark.parametrize(
    "raw",
    [
        b'{"key": "value with \\"quotes\\" and \\\\ and \\u00e9", "n": [1, -2.5e-3, true, null]}',
        '{"emoji": "😀😀", "mix": "é漢"}'.encode(),
        b'{"x": "' + b"\\\\" * 7 + b'", "y": 10}',
        b'{"deep": ' + b"[" * 50 + b"1" + b"]" * 50 + b"}",
    ],
)
def test_every_split_point_of_tricky_documents(raw: bytes) -> None:
    expected = count_json_nodes(raw)
    for cut in range(len(raw) + 1):
        for cut2 in (cut, min(cut + 1, len(raw)), min(cut + 2, len(raw))):
            counter = JsonNodeCounter()
            counter.feed(raw[:cut])
            counter.feed(raw[cut:cut2])
            counter.feed(raw[cut2:])
            assert counter.nodes == expected, (cut, cut2)


def test_pieces_larger_than_the_internal_step_and_strings_spanning_them() -> None:
    rnd = random.Random(1)
    parts = []
    for i in range(3000):
        s = "".join(rnd.choice('ab\\"é😀 ') for _ in range(rnd.randint(0, 200)))
        parts.append(json.dumps({"k": s, "i": i, "f": [1.5, None, True]}, ensure_ascii=bool(i % 2)))
    raw = ("[" + ",".join(parts) + ',"' + "x" * 200_000 + '"]').encode()
    expected = tree_nodes(json.loads(raw))
    assert count_json_nodes(raw) == expected
    assert count_json_nodes(bytearray(raw)) == expected
    assert count_json_nodes(memoryview(raw)) == expected
    counter = JsonNodeCounter()
    for start in range(0, len(raw), 70_001):
        counter.feed(raw[start : start + 70_001])
    assert counter.nodes == expected


def test_depth_128_is_allowed_and_129_raises() -> None:
    counter = JsonNodeCounter(max_depth=128)
    assert counter.feed(b"[" * 128 + b"]" * 128) == 128
    assert counter.max_depth_seen == 128 and counter.depth == 0

    counter = JsonNodeCounter(max_depth=128)
    with pytest.raises(JsonTooDeep) as info:
        counter.feed(b"[" * 129 + b"]" * 129)
    err = info.value
    assert (err.depth, err.max_depth, err.code, err.param) == (129, 128, "json_too_deep", None)
    assert isinstance(err, JsonRejected)
    assert str(err) == (
        "JSON nesting reaches depth 129, over the cap of 128 levels; send a payload nested at most 128 levels deep"
    )
    with pytest.raises(JsonTooDeep):  # the counter stays spent
        counter.feed(b"1")


def test_depth_cap_across_chunks_and_inside_strings() -> None:
    counter = JsonNodeCounter(max_depth=128)
    for _ in range(128):
        counter.feed(b"{")
        counter.feed(b'"k":')
    assert counter.depth == 128
    counter.feed(b'"[[[[[[[[["')  # brackets inside a string do not nest
    with pytest.raises(JsonTooDeep):
        counter.feed(b"[")


def test_no_cap_when_max_depth_is_none() -> None:
    assert count_json_nodes(b"[" * 10_000) == 10_000
    with pytest.raises(JsonTooDeep):
        count_json_nodes(b"[" * 10, max_depth=9)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "128"])
def test_max_depth_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="max_depth must be a positive int or None"):
        JsonNodeCounter(max_depth=bad)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=64), st.data())
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_number_and_literal_splits(n: int, data: st.DataObject) -> None:
    raw = (
        "[" + ",".join(["true", "false", "null", "-12.5e+3", "0", "123456789"] * (n % 5 + 1)) + "]"
    ).encode()
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(raw)), max_size=8))
    assert feed_split(raw, cuts).nodes == tree_nodes(json.loads(raw))
