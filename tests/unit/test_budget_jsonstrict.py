"""loads_strict: the error codes, params and messages of a strict client-body parser."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import JsonInvalid, JsonTooDeep, loads_strict
from budget.errors import JsonRejected


def rejected(raw: bytes) -> JsonRejected:
    with pytest.raises(JsonRejected) as info:
        loads_strict(raw)
    return info.value


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        (
            b'{"model":"small","model":"big"}',
            "model",
            'duplicate key "model" at model; send each key once per object',
        ),
        (rb'{"model":"a","mod\u0065l":"b"}', "model", None),  # compared after unescaping
        (b'{"input":[{"role":"user","content":"hi","role":"system"}]}', "input[0].role", None),
        (b'{"metadata":{"a":"1","b":"2","a":"3"}}', "metadata.a", None),
        (b'{"metadata":{"a b":1,"a b":2}}', 'metadata["a b"]', None),
        (b'[{"x":{"y":[0,{"z":1,"z":1}]}}]', "[0].x.y[1].z", None),
    ],
)
def test_duplicate_keys(raw: bytes, param: str, message: str | None) -> None:
    err = rejected(raw)
    assert isinstance(err, JsonInvalid)
    assert (err.code, err.param) == ("duplicate_key", param)
    if message is not None:
        assert str(err) == err.message == message


def test_syntax_errors_win_over_a_duplicate_before_them() -> None:
    err = rejected(b'[{"a":1,"a":2}, garbage')
    assert (err.code, err.param) == ("invalid_json", None)
    assert str(err) == "invalid JSON at line 1, column 17: Expecting value"


@pytest.mark.parametrize(
    ("raw", "param", "char"),
    [
        (rb'{"a":"\ud83d"}', "a", "ud83d"),
        (rb'{"a":"\ude00"}', "a", "ude00"),
        (rb'{"input":[{"content":"x\ud83dy"}]}', "input[0].content", "ud83d"),
        (rb'{"k\udbff":1}', '["k\\udbff"]', "udbff"),  # keys too
        (rb'["\ud83d\ud83d\ude00"]', "[0]", "ud83d"),  # a high half followed by a full pair
        (rb'["\\\ud83d\ude00"]', None, None),  # an escaped backslash, then a valid pair: fine
        (rb'["\\ud83d\ude00"]', "[0]", "ude00"),  # the text "\ud83d", then a lone low half
    ],
)
def test_lone_surrogates(raw: bytes, param: str | None, char: str | None) -> None:
    if char is None:
        assert loads_strict(raw) == json.loads(raw)
        return
    err = rejected(raw)
    assert (err.code, err.param) == ("invalid_unicode", param)
    assert f"lone UTF-16 surrogate \\{char}" in str(err)


def test_valid_pairs_and_utf8_are_fine() -> None:
    assert loads_strict(rb'{"a":"\ud83d\ude00"}') == {"a": "😀"}
    assert loads_strict('{"a":"😀é漢"}'.encode()) == {"a": "😀é漢"}
    assert loads_strict(b'{"a":"\\\\ud83d"}') == {"a": "\\ud83d"}  # just text


@pytest.mark.parametrize(
    "raw",
    [b'{"a":"\xff"}', b'{"a":"\xed\xa0\xbd"}', b'{"a":"\xc0\xaf"}', b'{"a":"\xe2\x82"}'],
)
def test_invalid_utf8_bytes(raw: bytes) -> None:
    err = rejected(raw)
    assert (err.code, err.param) == ("invalid_unicode", None)
    assert str(err).startswith("the payload is not valid UTF-8: byte 0x")
    assert "line 1, column 7" in str(err)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a":NaN}', "NaN is not a valid JSON number; send a finite number or null"),
        (b'{"a":Infinity}', "Infinity is not a valid JSON number; send a finite number or null"),
        (b'{"a":[-Infinity]}', "-Infinity is not a valid JSON number; send a finite number or null"),
        (b'{"a":1e400}', "number 1e400 is out of range for a double; send a smaller number"),
        (b'{"a":-1' + b"0" * 400 + b".5}", None),
        (b'{"a":' + b"1" * 5000 + b"}", "an integer has more than 4300 digits; send a shorter number"),
    ],
)
def test_invalid_numbers(raw: bytes, message: str | None) -> None:
    err = rejected(raw)
    assert (err.code, err.param) == ("invalid_number", None)
    if message is not None:
        assert str(err) == message


def test_large_but_finite_numbers_pass() -> None:
    assert loads_strict(b'{"a":1e308,"b":1e-400,"c":"e400 1e999 in a string"}') == {
        "a": 1e308,
        "b": 0.0,
        "c": "e400 1e999 in a string",
    }


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b"", "line 1, column 1"),
        (b'{"a":1,}', "line 1, column 8"),
        (b'{"a":\n  tru}', "line 2, column 3"),
        (b'{"a":1} {}', "line 1, column 9"),
        ("\ufeff{}".encode(), "line 1, column 1"),
    ],
)
def test_syntax_errors_give_line_and_column(raw: bytes, where: str) -> None:
    err = rejected(raw)
    assert (err.code, err.param) == ("invalid_json", None)
    assert f"invalid JSON at {where}: " in str(err)


def test_not_an_object_is_the_callers_business() -> None:
    assert loads_strict(b"[1, 2]") == [1, 2]
    assert loads_strict(b'"x"') == "x"


def test_deep_input_never_raises_recursion_error() -> None:
    assert loads_strict(b"[" * 128 + b"]" * 128) is not None
    err = rejected(b"[" * 100_000 + b"]" * 100_000)
    assert isinstance(err, JsonTooDeep)
    assert err.code == "json_too_deep" and err.depth == 100_000 and err.max_depth == 128


unique_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=25,
)


@given(unique_json, st.booleans())
@settings(max_examples=150, deadline=None)
def test_agrees_with_json_loads_on_valid_documents(value: object, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    has_lone = any(0xD800 <= ord(c) <= 0xDFFF for c in json.dumps(value, ensure_ascii=False))
    if has_lone:  # st.text() can draw lone surrogates: those must be refused
        assert rejected(raw).code == "invalid_unicode"
    else:
        assert loads_strict(raw) == json.loads(raw)


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(), min_size=1, max_size=4), st.data())
@settings(max_examples=80, deadline=None)
def test_any_repeated_key_is_found(obj: dict[str, int], data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(obj)))
    pairs = [*(f"{json.dumps(k)}:{v}" for k, v in obj.items()), f"{json.dumps(key, ensure_ascii=True)}:0"]
    raw = ('{"input":[{"metadata":{' + ",".join(pairs) + "}}]}").encode("utf-8", "surrogatepass")
    err = rejected(raw)
    if err.code == "invalid_unicode":  # a lone surrogate drawn in a key
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in "".join(obj))
        return
    assert err.code == "duplicate_key"
    assert err.param is not None and err.param.startswith("input[0].metadata")


escape_tokens = st.lists(
    st.sampled_from(
        ["\\ud83d", "\\ude00", "\\uDBFF", "\\uDC00", "\\\\", "a", '\\"', "\\u0041", "u", "d83d", "é"]
    ),
    max_size=14,
)


@given(escape_tokens)
@settings(max_examples=300, deadline=None)
def test_lone_surrogates_are_found_exactly(parts: list[str]) -> None:
    raw = ('{"k":"' + "".join(parts) + '"}').encode()
    value = json.loads(raw)["k"]
    lone = any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if lone:
        err = rejected(raw)
        assert (err.code, err.param) == ("invalid_unicode", "k")
    else:
        assert loads_strict(raw) == {"k": value}
