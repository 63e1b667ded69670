"""Small, dependency-free PromQL helpers used by the generator, the tests and the live check.

* `substitute` replaces Grafana macros and dashboard variables (``$__rate_interval``,
  ``${job}``, ``[[var]]``) with concrete values, so the result is plain PromQL that
  ``promtool`` or a real Prometheus accepts. Grafana macros are not PromQL.
* `referenced_metrics` and `selectors` read which metric names and label matchers an
  expression uses. They lex the expression (strings, durations, keywords, grouping
  clauses); they do not build a full AST, which is enough to check names and label
  values against the contract (`middleware.ops.metrics`, via `dashboards.queries`). Syntax
  itself is ``promtool``'s job.
* `go_float` and `le_regex` deal with the text form of histogram ``le`` labels, which is
  not stable: Python's prometheus-client writes ``4096.0`` and ``1.6777216e+07``, Go's
  client ``4096``, and Prometheus 3 normalises to ``4096.0``. A query that must pick one
  bucket uses `le_regex` so it matches every form.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "GRAFANA_MACROS",
    "PromQLLexError",
    "Selector",
    "go_float",
    "le_forms",
    "le_regex",
    "referenced_metrics",
    "selectors",
    "substitute",
]

#: What each Grafana macro becomes when a query is validated or run outside Grafana.
#: ``1m`` is what Grafana picks for ``$__rate_interval`` at a 15 s scrape interval.
GRAFANA_MACROS: Mapping[str, str] = {
    "__rate_interval": "1m",
    "__rate_interval_ms": "60000",
    "__interval": "1m",
    "__interval_ms": "60000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)(?::\w+)?\]\]|\$(\w+)")


class PromQLLexError(ValueError):
    """An expression could not be lexed (unterminated string, stray character, unknown variable)."""


def substitute(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """Return `expr` with Grafana macros and dashboard `variables` replaced by their values.

    `variables` maps a variable name (without ``$``) to its value; `GRAFANA_MACROS` are always
    known. Raises `PromQLLexError` naming the variable when `expr` uses one that is not given,
    so a new dashboard variable cannot slip through validation unsubstituted.
    """
    values = {**GRAFANA_MACROS, **(variables or {})}

    def replace(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group is not None)
        if name not in values:
            raise PromQLLexError(
                f"unknown Grafana variable ${name} in {expr!r}; give it a value to substitute"
            )
        return values[name]

    return _VARIABLE.sub(replace, expr)


# --- lexing -----------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<duration>(?:\d+(?:ms|s|m|h|d|w|y))+(?![\w.]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]@:])
    """,
    re.VERBOSE,
)

_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
)
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_NUMBER_WORDS = frozenset({"inf", "nan"})


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str


def _lex(expr: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            hint = "; substitute() Grafana variables first" if expr[pos] == "$" else ""
            raise PromQLLexError(f"cannot lex PromQL at offset {pos}: {expr[pos : pos + 20]!r}{hint}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            tokens.append(_Token(kind, match.group()))
        pos = match.end()
    return tokens


def _unquote(text: str) -> str:
    if text[0] == "`":
        return text[1:-1]
    body = text[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


@dataclass(frozen=True)
class Selector:
    """One vector selector: the metric name (``None`` for ``{...}`` alone) and its label matchers.

    Each matcher is ``(label, op, value)`` with op one of ``=``, ``!=``, ``=~``, ``!~`` and the
    value unquoted.
    """

    metric: str | None
    matchers: tuple[tuple[str, str, str], ...]


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in `expr` (already `substitute`d), in order of appearance.

    Identifiers that are keywords, function or aggregation names (followed by ``(``, or by
    ``by``/``without`` as in ``sum by (le) (...)``), label
    names in grouping clauses (``by (le)``, ``on (job)``) or ``inf``/``nan`` are not selectors.
    Raises `PromQLLexError` for text that is not PromQL at the lexical level.
    """
    tokens = _lex(expr)
    found: list[Selector] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if token.kind == "ident" and token.text in _GROUPING:
            i += 1
            if i < len(tokens) and tokens[i].text == "(":
                while i < len(tokens) and tokens[i].text != ")":
                    i += 1
                i += 1
            continue
        if token.kind == "ident" and (
            token.text in _KEYWORDS
            or token.text.lower() in _NUMBER_WORDS
            or (nxt is not None and nxt.text in {"(", "by", "without"})
        ):
            i += 1
            continue
        if token.text == "[":  # range or subquery: durations only
            while i < len(tokens) and tokens[i].text != "]":
                i += 1
            i += 1
            continue
        if token.kind == "ident" or token.text == "{":
            metric = token.text if token.kind == "ident" else None
            if token.kind == "ident":
                i += 1
            matchers: list[tuple[str, str, str]] = []
            if i < len(tokens) and tokens[i].text == "{":
                i += 1
                while i < len(tokens) and tokens[i].text != "}":
                    if tokens[i].text == ",":
                        i += 1
                        continue
                    if i + 2 >= len(tokens):
                        raise PromQLLexError(f"unterminated label matchers in {expr!r}")
                    label, op, value = tokens[i], tokens[i + 1], tokens[i + 2]
                    if (
                        label.kind != "ident"
                        or op.text not in {"=", "!=", "=~", "!~"}
                        or value.kind != "string"
                    ):
                        raise PromQLLexError(f"bad label matcher near {label.text!r} in {expr!r}")
                    matchers.append((label.text, op.text, _unquote(value.text)))
                    i += 3
                i += 1
            found.append(Selector(metric, tuple(matchers)))
            continue
        i += 1
    return found


def referenced_metrics(expr: str) -> frozenset[str]:
    """The metric (series) names `expr` selects, e.g. ``loopwarden_retained_bytes_peak_bucket``.

    A selector without a name but with ``__name__="..."`` counts under that name.
    """
    names: set[str] = set()
    for selector in selectors(expr):
        if selector.metric is not None:
            names.add(selector.metric)
        names.update(value for label, op, value in selector.matchers if label == "__name__" and op == "=")
    return frozenset(names)


# --- histogram bucket labels ------------------------------------------------------------------------


def go_float(value: float) -> str:
    """`value` as Python's prometheus-client writes it in ``le`` (its ``floatToGoString``).

    ``4096.0`` -> ``"4096.0"``, ``16777216.0`` -> ``"1.6777216e+07"``, ``0.5`` -> ``"0.5"``.
    """
    value = float(value)
    if value == float("inf"):
        return "+Inf"
    if value == float("-inf"):
        return "-Inf"
    if value != value:
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def le_forms(value: float) -> frozenset[str]:
    """Every text the ``le`` label for bucket bound `value` may carry once scraped.

    Python client (``4096.0``, ``1.6777216e+07``), Go client (``4096``), Prometheus 3's
    normalised float form (same as the Python client's) and the plain integer forms.
    """
    python_form = go_float(value)
    forms = {python_form, python_form.removesuffix(".0")}
    if float(value).is_integer():
        forms.update({str(int(value)), f"{int(value)}.0"})
    return frozenset(forms)


def le_regex(value: float) -> str:
    """A regular expression (for ``le=~"..."``) matching every form in `le_forms`.

    Uses character classes (``[.]``, ``[+]``) instead of backslashes, so the result can sit
    in a PromQL double-quoted string, JSON and YAML without further escaping.
    """
    escaped = (re.sub(r"([.+])", r"[\1]", form) for form in sorted(le_forms(value)))
    return "|".join(escaped)
