"""The measured model's lexical features (budget/features.py): the shared small ints, counted
with bytes operations, against their definition, and the features' named-tuple shape."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from budget import JsonFeatures, JsonNodeCounter, JsonTooDeep, json_features
from budget.features import _small_ints

NUMBER_BYTES = frozenset(b"-+.eE0123456789")
#: The definition: a number token CPython parses to a shared int (-5..=256), written as such,
#: that is a maximal run of number bytes followed by a byte that is not one (the regex the
#: counter used before issue 21 made it a bytes operation).
DEFINITION = re.compile(
    rb"(?<![-+.eE0-9])(?:[0-9]|[1-9][0-9]|1[0-9][0-9]|2[0-4][0-9]|25[0-6]|-[1-5])(?=[^-+.eE0-9])"
)

outside_text = st.binary(max_size=80) | st.lists(
    st.sampled_from(
        [b"-", b"+", b".", b"e", b"E", b"0", b"1", b"2", b"5", b"6", b"9", b",", b" ", b"[", b"t"]
    ),
    max_size=60,
).map(b"".join)


@given(outside_text, st.booleans())
@settings(max_examples=600, deadline=None)
def test_small_ints_are_the_definitions_matches(text: bytes, after_number: bool) -> None:
    subject = (b"0" if after_number else b" ") + text
    assert _small_ints(subject) == DEFINITION.subn(b"", subject)[1]


def test_small_ints_of_a_document() -> None:
    # shared: 0, 256, -5, 7 (inside the array); not: 257, -6, 1.0, 1e2, 007, and the last token
    # (it may go on in the next piece)
    subject = b" [0,256,-5,257,-6,1.0,1e2,007,7] 12"
    assert _small_ints(subject) == 4


def test_a_document_prices_its_small_ints_as_shared() -> None:
    f = json_features(b'{"a":[1,300,-4,1.5,true,null,"x","",{}],"b":256}')
    assert (f.numbers, f.small_ints) == (5, 3)  # 1, -4, 256 are shared; 300 and 1.5 are not


def test_features_are_an_immutable_named_tuple() -> None:
    f = json_features(b'{"a":1}')
    assert isinstance(f, tuple) and f._fields == JsonFeatures._fields
    assert f == JsonFeatures(**f._asdict())
    assert f.combine(f).nbytes == 2 * f.nbytes


def general_path(data: bytes, max_depth: int | None) -> tuple[object, ...]:
    """The counter's general per-piece path on `data` (one piece), bypassing the whole-text
    shortcut: features, nodes, depth, deepest."""
    counter = JsonNodeCounter(max_depth=max_depth, features=True)
    counter.nbytes = len(data)
    if data:
        counter._piece(data)
    tally = counter._ensure_tally()
    return tally.result(counter.nbytes, counter.nodes), counter.nodes, counter.depth, counter.max_depth_seen


def counted(data: bytes, max_depth: int | None) -> tuple[object, ...]:
    counter = JsonNodeCounter(max_depth=max_depth, features=True)
    counter.feed(data)
    return counter.features(), counter.nodes, counter.depth, counter.max_depth_seen


def outcome(
    count: Callable[[bytes, int | None], tuple[object, ...]], data: bytes, depth: int | None
) -> object:
    try:
        return count(data, depth)
    except JsonTooDeep as exc:
        return ("too deep", exc.depth)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-300, 300)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=25,
)
plain_bytes = st.lists(
    st.sampled_from(
        [b'"', b"{", b"}", b"[", b"]", b":", b",", b"1", b"-", b"e", b"t", b"n", b" ", b"a", b"0"]
    ),
    max_size=60,
).map(b"".join)


@given(json_values, st.booleans(), st.sampled_from([None, 2, 128]))
@settings(max_examples=400, deadline=None)
def test_the_whole_text_shortcut_counts_valid_json_as_the_general_path(
    value: object, ascii_only: bool, depth: int | None
) -> None:
    data = json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":") if ascii_only else None).encode()
    assert outcome(counted, data, depth) == outcome(general_path, data, depth)


@given(plain_bytes, st.sampled_from([None, 1, 3, 128]))
@settings(max_examples=600, deadline=None)
def test_the_whole_text_shortcut_counts_any_bytes_as_the_general_path(data: bytes, depth: int | None) -> None:
    general = outcome(general_path, data, depth)
    assert outcome(counted, data, depth) == general
    one_shot = outcome(lambda d, m: (json_features(d, max_depth=m),), data, depth)
    assert one_shot == (general if general[0] == "too deep" else general[:1])  # type: ignore[index]


def test_a_counter_fed_after_its_features_goes_on_from_the_whole_text() -> None:
    first, second = b'{"a":[1,2],"b":"x"', b',"c":{}}'
    counter = JsonNodeCounter(max_depth=128, features=True)
    counter.feed(first)
    counter.features()  # counted at once (plain), state kept
    counter.feed(second)
    assert counter.features() == json_features(first + second)
