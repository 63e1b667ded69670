"""Strict parsing of an already admitted client JSON body (RFC 8259, plus the gateway's rules).

`loads_strict` is what the gateway calls *after* a body was counted (depth capped at 128 by
`JsonNodeCounter`) and admitted by the ledger. It is one `json.loads` with hooks, and refuses
what Python's `json` accepts by default but a strict JSON consumer must not:

=====================  =================================================================
code                   refused
=====================  =================================================================
``invalid_json``       any syntax error (message gives line and column)
``duplicate_key``      an object repeating a key at any depth, compared after unescaping, so
                       ``{"model":"a","mod\\u0065l":"b"}`` is a duplicate; ``param`` is the path
                       of the key, e.g. ``input[0].role``
``invalid_unicode``    bytes that are not UTF-8; a lone UTF-16 surrogate escape such as
                       ``"\\ud83d"`` or ``"\\ude00"`` in any string or key (a valid pair
                       ``"\\ud83d\\ude00"`` is fine); ``param`` is the string's path
``invalid_number``     ``NaN``, ``Infinity``, ``-Infinity``; numbers that overflow a double
                       (``1e400``); integers longer than the interpreter converts
=====================  =================================================================

Whether the top level is an object is the caller's check, not this module's. Deep input does
not crash: a `RecursionError` inside the parser becomes `JsonTooDeep`.

Cost: one strict UTF-8 decode and one `json.loads` whose only Python hook runs once per JSON
object; the surrogate and overflow checks are regex scans of the text that fire only on
suspicious input (then a second, slower pass finds the exact place). Measured against plain
``json.loads`` in bench/ledger.py.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, Final, NoReturn

import msgspec

from .errors import JsonInvalid, JsonTooDeep
from .nodes import DEFAULT_MAX_DEPTH, JsonNodeCounter

__all__ = ["decode_first", "key_total", "loads_strict", "locate_invalid", "msgspec_may_decode"]

_H2: Final = rb"[0-9a-fA-F]{2}"
# A lone surrogate escape, or an escaped backslash before surrogate-like text (which can turn a
# textual pair into a lone half). Exact in one direction: whenever the parsed result holds a lone
# surrogate this matches (valid pairs alone never do); a match only triggers the exact check.
# Searched on the raw bytes (escapes are ASCII); every branch starts with the literal "\u[dD]".
_SURROGATE_HINT: Final = re.compile(
    rb"\\u[dD](?:"
    + (rb"[89abAB]" + _H2 + rb"(?!\\u[dD][c-fC-F]" + _H2 + rb")")  # a high half, no low half next
    + (
        rb"|[c-fC-F]" + _H2 + rb"(?<!\\u[dD][89abAB]" + _H2 + rb"\\u[dD][c-fC-F]" + _H2 + rb")"
    )  # a low half alone
    + rb"|(?<=\\\\u[dD])[89a-fA-F]"  # after an escaped backslash "\u..." is text, not an escape
    + rb")"
)
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
# A float can overflow a double only with an exponent of 100 or more, or 200+ digits in a row.
_BIG_EXPONENT: Final = re.compile(rb"[eE]\+?0*[1-9][0-9]{2}")
_DIGIT_CLASS: Final = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_LONG_DIGITS: Final = b"0" * 200
_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

PathPart = str | int


class _DuplicateKey(Exception):
    """Internal: aborts the first parse at the first object with a repeated key."""


def _pairs_strict(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey
    return obj


def _reject_constant(name: str) -> NoReturn:
    raise JsonInvalid("invalid_number", f"{name} is not a valid JSON number; send a finite number or null")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise JsonInvalid(
            "invalid_number", f"number {shown} is out of range for a double; send a smaller number"
        )
    return value


def format_path(parts: tuple[PathPart, ...]) -> str:
    """Render a JSON path the way API errors name params: ``input[0].role``, ``metadata["a b"]``."""
    out: list[str] = []
    for part in parts:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif _IDENTIFIER.match(part):
            out.append(f".{part}" if out else part)
        else:
            out.append(f"[{json.dumps(part)}]")
    return "".join(out)


def _walk(root: object) -> Iterator[tuple[tuple[PathPart, ...], object, bool]]:
    """Yield (path, value, is_key) for every key and value under ``root``, depth first, in
    document order; iterative (no recursion limit)."""
    stack: list[tuple[tuple[PathPart, ...], object]] = [((), root)]
    while stack:
        path, value = stack.pop()
        yield path, value, False
        if isinstance(value, dict):
            children: list[tuple[tuple[PathPart, ...], object]] = []
            for key, child in value.items():
                child_path = (*path, key)
                yield child_path, key, True
                children.append((child_path, child))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend(((*path, i), child) for i, child in reversed(list(enumerate(value))))


# Built once: `json.loads(..., **hooks)` would build a decoder per call, and the decoder and its
# scanner form a reference cycle (about 1 KiB of garbage per call until the cycle collector runs).
_STRICT: Final = json.JSONDecoder(object_pairs_hook=_pairs_strict, parse_constant=_reject_constant)
_STRICT_FINITE: Final = json.JSONDecoder(
    object_pairs_hook=_pairs_strict, parse_constant=_reject_constant, parse_float=_finite_float
)


def _parse(text: str, decoder: json.JSONDecoder) -> object:
    """Decode with ``decoder``; every parser failure becomes a `JsonRejected`."""
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as exc:
        raise JsonInvalid(
            "invalid_json", f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        counter = JsonNodeCounter(max_depth=sys.maxsize)
        counter.feed(text.encode("utf-8", "surrogatepass"))
        seen = counter.max_depth_seen
        raise JsonTooDeep(depth=seen, max_depth=min(DEFAULT_MAX_DEPTH, max(seen - 1, 1))) from None
    except ValueError:  # int() digit limit: "Exceeds the limit (4300 digits) ..."
        raise JsonInvalid(
            "invalid_number",
            f"an integer has more than {sys.get_int_max_str_digits()} digits; send a shorter number",
        ) from None


def _duplicate_error(text: str) -> JsonInvalid:
    """Second pass after a duplicate key: find the first repeated key and its path. Other errors
    later in the document (syntax, numbers) are raised instead, since they make it invalid JSON."""
    marker: list[object] = []

    class _Repeated:
        __slots__ = ("key",)

        def __init__(self, key: str) -> None:
            self.key = key

    def hook(pairs: list[tuple[str, object]]) -> object:
        obj = dict(pairs)
        if len(obj) != len(pairs) and not marker:
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    found = _Repeated(key)
                    marker.append(found)
                    return found
                seen.add(key)
        return obj

    decoder = json.JSONDecoder(
        object_pairs_hook=hook, parse_constant=_reject_constant, parse_float=_finite_float
    )
    root = _parse(text, decoder)
    target = marker[0]
    assert isinstance(target, _Repeated)
    for path, value, is_key in _walk(root):
        if value is target and not is_key:
            param = format_path((*path, target.key))
            return JsonInvalid(
                "duplicate_key",
                f"duplicate key {json.dumps(target.key)} at {param}; send each key once per object",
                param=param,
            )
    raise AssertionError("duplicate marker not found")  # pragma: no cover


def _lone_surrogate(value: object) -> tuple[tuple[PathPart, ...], str] | None:
    for path, item, _ in _walk(value):
        if isinstance(item, str):
            m = _SURROGATE.search(item)
            if m is not None:
                return path, m.group()
    return None


def key_total(value: Any) -> int:
    """The number of keys in every object of a decoded JSON value (distinct keys: a decoder keeps
    the last of a repeated one). Walks the containers depth first with one iterator per level,
    so what it holds while it walks is O(depth), not O(nodes) (a stack of the values was 4 MB
    for a 1 MiB array of ``0``, more than msgspec's parse saves). Raises nothing."""
    kind = type(value)
    if kind is dict:
        total, level = len(value), iter(value.values())
    elif kind is list:
        total, level = 0, iter(value)
    else:
        return 0
    stack = [level]
    while stack:
        for item in stack[-1]:
            kind = type(item)
            if kind is dict:
                total += len(item)
                stack.append(iter(item.values()))
                break
            if kind is list:
                stack.append(iter(item))
                break
        else:
            stack.pop()
    return total


#: The first decoder of `loads_strict` (plain JSON values; strict: no NaN, no trailing bytes).
_FIRST: Final = msgspec.json.Decoder()
#: Nesting a text may provably have for msgspec to decode it first: its own recursion limit is a
#: few levels above ``json.loads``', so deeper text goes to ``json.loads`` alone.
_FIRST_DEPTH: Final = 256
#: A string token (key or value) of one ASCII character, raw or a two-byte escape (``"x"``,
#: ``"\n"``): its opening quote where a token may start (after ``[ { , :`` or whitespace), its
#: closing quote where one may end (before ``, : ] }`` or whitespace). ``json.loads`` returns
#: CPython's shared one-character strings for them, which the charge model prices at nothing
#: (`JsonFeatures.string_bytes`); msgspec allocates a new ``str`` for each (50 bytes: a 1 MiB
#: ``["x","x",...]`` peaks at 15.4 MB, ``json.loads`` at 3.4 MB). Matching more than such tokens
#: (``"a "," b"``: a string ending and the next starting with a space) only sends a text to
#: ``json.loads``.
_ONE_ASCII_CHAR: Final = re.compile(rb'"(?<=[\[{,:\s]")(?:[^"\\\x80-\xff]|\\[^u])"(?=[,:\]}\s])')


def msgspec_may_decode(raw: bytes, *, depth_checked: bool = False, size_priced: bool = False) -> bool:
    """Whether msgspec may decode the JSON text `raw` in ``json.loads``' place: where it accepts
    the text, its value is the one ``json.loads`` returns (a differential property test,
    tests/unit/test_loads_upstream.py), and its memory is at most what the charge model prices
    for ``json.loads`` (it makes no ``str`` copy of the text; measured shape by shape in the same
    test) unless the text holds one-character ASCII strings (`_ONE_ASCII_CHAR`) or is one string.
    `size_priced`: the caller's charge for the parse is a size-only bound
    (`ChargeModel.frame_charge`: per node or per byte, fitted over msgspec's decode too,
    `budget.calibrate.parsers`), which prices every string, one-character ones included, and
    what it keeps of the value is priced so as well (a delta's text as a whole ``str``) or bounded
    by a constant — not by the value's features, which price a one-character string at nothing —
    so neither condition applies. Its nesting must be provably at most 256 levels:
    `depth_checked` (the caller's counter capped it), a text of at most 512 bytes, or at most 256
    ``[`` and ``{`` bytes. Pure; raises nothing. Cost: one regex scan, ~2 ns a byte where strings
    are dense, less in long strings (none when `size_priced`)."""
    if not (
        depth_checked or len(raw) <= 2 * _FIRST_DEPTH or raw.count(b"[") + raw.count(b"{") <= _FIRST_DEPTH
    ):
        return False
    return size_priced or (raw.lstrip()[:1] != b'"' and _ONE_ASCII_CHAR.search(raw) is None)


def decode_first(raw: bytes, *, depth_checked: bool = False, size_priced: bool = False) -> tuple[bool, Any]:
    """msgspec's decode of the JSON text `raw` where it may stand in for ``json.loads``
    (`msgspec_may_decode`, `depth_checked` and `size_priced` as there): ``(True, value)``, the
    value ``json.loads`` would return (dicts, lists, ``str``, ``int``, ``float``, ``bool``, None;
    a repeated key keeps its last value, as there). ``(False, None)`` when it may not or refuses
    the text (syntax, ``NaN``, lone surrogates, numbers out of range, bytes that are not UTF-8):
    the caller's ``json.loads`` path gives the verdict and its message. Raises nothing. The one
    first route of `loads_strict`, ``middleware.upstream.reader.loads_upstream`` and
    `budget.calibrate`'s pipelines."""
    if not msgspec_may_decode(raw, depth_checked=depth_checked, size_priced=size_priced):
        return False, None
    try:
        return True, _FIRST.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return False, None


def _first_decode(raw: bytes, members: int | None, depth_checked: bool) -> tuple[bool, object]:
    """`decode_first`, kept only when the value provably repeats no key, else ``(False, None)``:
    the exact path decides (`loads_strict`)."""
    done, value = decode_first(raw, depth_checked=depth_checked)
    # each key written is one ":" outside strings (`members`); without that count, every ":"
    # (those inside strings too) is at least the keys written: equal to the distinct keys, none
    # was repeated
    if done and key_total(value) == (members if members is not None else raw.count(b":")):
        return True, value
    return False, None


def loads_strict(
    data: bytes | bytearray | memoryview, *, members: int | None = None, depth_checked: bool = False
) -> object:
    """Parse a UTF-8 JSON payload strictly; return the value (any JSON type).

    Raises `JsonInvalid` with ``code`` ``invalid_json``, ``duplicate_key``, ``invalid_unicode`` or
    ``invalid_number`` (see the module docstring) and `JsonTooDeep` if the interpreter's recursion
    limit is hit. When several problems exist, syntax and number errors win over duplicate keys,
    which win over lone surrogates.

    msgspec decodes first where it may (`decode_first`: no one-character ASCII string,
    nesting provably at most 256 levels; no ``str`` copy of the text, no Python hook per
    object); what it refuses goes to the ``json.loads`` path below, which gives the verdict and
    its message (a differential property test: tests/unit/test_loads_upstream.py). Its value is
    kept only when it provably repeats no key: `members` — the ``:`` bytes outside strings,
    `JsonFeatures.members`, when the caller counted them — or else every ``:`` of the text
    equals the distinct keys (`key_total`); else the exact path finds the repeat.
    `depth_checked`: the caller capped the depth (the intake's counter does).
    """
    raw = data if isinstance(data, bytes) else bytes(data)
    done, value = _first_decode(raw, members, depth_checked)
    return value if done else _loads_exact(raw)


def _loads_exact(raw: bytes) -> object:
    """`loads_strict` by ``json.loads`` with its hooks: the verdicts and their messages."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        raise JsonInvalid(
            "invalid_unicode",
            f"the payload is not valid UTF-8: byte 0x{raw[exc.start]:02x} at line {line}, column {column} "
            f"({exc.reason}); send UTF-8",
        ) from None
    finite = _BIG_EXPONENT.search(raw) is not None or _LONG_DIGITS in raw.translate(_DIGIT_CLASS)
    try:
        value = _parse(text, _STRICT_FINITE if finite else _STRICT)
    except _DuplicateKey:
        raise _duplicate_error(text) from None
    if _SURROGATE_HINT.search(raw) is not None:
        found = _lone_surrogate(value)
        if found is not None:
            path, char = found
            param = format_path(path) or None
            where = f" at {param}" if param else ""
            raise JsonInvalid(
                "invalid_unicode",
                f"lone UTF-16 surrogate \\u{ord(char):04x}{where}; escape characters outside the "
                "Basic Multilingual Plane as a surrogate pair, or send them as UTF-8",
                param=param,
            )
    return value


def locate_invalid(raw: bytes, code: str) -> str | None:
    """Where a body that `loads_strict` refused with `code` is at fault, found with a lenient
    parse on the error path only: the path of the first non-finite number (``invalid_number``),
    the top-level field holding the first byte that is not UTF-8 (``invalid_unicode``); None
    when it cannot be told or for other codes."""
    if code == "invalid_number":
        return nonfinite_number_path(raw)
    if code == "invalid_unicode":
        return undecodable_field(raw)
    return None


def _first_path(root: Any, hit: Callable[[Any], bool]) -> str | None:
    """The path (``input[0].x``) of the first value or key in `root`, in document order, for
    which `hit` is true; None when there is none (or it is the root)."""
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, value = stack.pop()
        if hit(value):
            return path or None
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                child = f"{path}.{key}" if path else str(key)
                stack.append((child, item))
                if hit(key):
                    stack.append((child, key))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def nonfinite_number_path(raw: bytes) -> str | None:
    """Where the first non-finite number of `raw` is (``temperature``, ``input[0].x``), if a
    lenient parse finds one; None otherwise. Only called on the error path."""
    try:
        root = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return _first_path(root, lambda v: isinstance(v, float) and not math.isfinite(v))


def undecodable_field(raw: bytes) -> str | None:
    """The top-level field whose value holds the first byte that is not UTF-8 (``input``), found
    with a lenient parse; None when it cannot be told. Only called on the error path."""
    try:
        root = json.loads(raw.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return None
    path = _first_path(root, lambda v: isinstance(v, str) and any("\udc80" <= ch <= "\udcff" for ch in v))
    return re.split(r"[.\[]", path, maxsplit=1)[0] if path else None
