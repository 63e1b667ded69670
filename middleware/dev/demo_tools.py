"""The demo MCP server that ``make run`` exposes: a clock and a calculator, served in-process.

`create_demo_server()` builds it; the gateway registers it under the label ``demo`` whenever it runs
the embedded development model (`middleware.app.build_catalog`), and `demo_catalog()` is a
`ToolCatalog` holding it alone (for tests). A request declaring ``{"type": "mcp", "server_label":
"demo", "require_approval": "never"}`` then lets the development model call ``get_time`` ("what is
get_time") or ``calculate`` ("calculate 6*7") and shows a multi-round loop with ``mcp_list_tools``
and ``mcp_call`` items.

* ``get_time()`` — the current UTC time as an ISO 8601 timestamp, e.g. ``2026-01-02T03:04:05+00:00``.
* ``calculate(expression)`` — exact arithmetic on decimal numbers with ``+ - * /``, unary signs and
  parentheses, evaluated by a small recursive-descent parser (never ``eval``); at most
  `MAX_EXPRESSION_CHARS` characters and `MAX_DEPTH` nested levels. Integral results print as
  integers (``42``), others as the nearest float (``0.3333333333333333``). Anything else is a tool
  error (``isError``) whose text says what is wrong.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any, Final

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from middleware.tools import McpServerConfig, ToolCatalog

__all__ = ["DEMO_LABEL", "calculate", "create_demo_server", "demo_catalog", "evaluate"]

DEMO_LABEL: Final = "demo"
MAX_EXPRESSION_CHARS: Final = 1000
MAX_DEPTH: Final = 100

_TOKEN_RE: Final = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\S))")


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    unary := ('+'|'-') unary | NUMBER | '(' expr ')'"""

    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            match = _TOKEN_RE.match(text, position)
            if match is None:  # only trailing whitespace is left
                break
            number, symbol = match.groups()
            if number is not None:
                self.tokens.append(("num", number))
            elif symbol in {"+", "-", "*", "/", "(", ")"}:
                self.tokens.append(("op", symbol))
            else:
                raise ValueError(f"unexpected character {symbol!r}; use numbers, + - * / and parentheses")
            position = match.end()
        self.index = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.index][1] if self.index < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def parse(self) -> Fraction:
        if not self.tokens:
            raise ValueError("the expression is empty")
        value = self.expr()
        if self.index != len(self.tokens):
            raise ValueError(f"unexpected {self.peek()!r} after a complete expression")
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            right = self.term()
            value = value + right if op == "+" else value - right
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()[1]
            right = self.unary()
            if op == "*":
                value *= right
            elif right == 0:
                raise ValueError("division by zero")
            else:
                value /= right
        return value

    def unary(self) -> Fraction:
        if self.index >= len(self.tokens):
            raise ValueError("the expression ends too early")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ValueError(f"the expression nests more than {MAX_DEPTH} levels")
        try:
            kind, text = self.take()
            if kind == "num":
                return Fraction(text)
            if text in ("+", "-"):
                value = self.unary()
                return value if text == "+" else -value
            if text == "(":
                value = self.expr()
                if self.peek() != ")":
                    raise ValueError("a '(' is not closed")
                self.take()
                return value
            raise ValueError(f"unexpected {text!r}")
        finally:
            self.depth -= 1


def evaluate(expression: str) -> str:
    """The value of `expression` as text (see the module docstring). Raises ValueError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters, over {MAX_EXPRESSION_CHARS}")
    value = _Parser(expression).parse()
    if value.denominator == 1:
        return str(value.numerator)
    try:
        return repr(float(value))
    except OverflowError:
        raise ValueError("the result is too large to show") from None


def get_time() -> str:
    """The current time in UTC as an ISO 8601 timestamp."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "6*7" or "(1+2)/4"."""
    try:
        return evaluate(expression)
    except ValueError as exc:
        raise ToolError(str(exc)) from None


def create_demo_server() -> MCPServer[Any]:
    """A new demo ``MCPServer`` with the ``get_time`` and ``calculate`` tools.

    ``MCPServer()`` calls ``logging.basicConfig`` (a handler on the root logger at INFO); the
    gateway's logging is its own, so the root logger is restored afterwards.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        server: MCPServer[Any] = MCPServer("loopwarden-demo", log_level="WARNING")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    # both only read: a failure after them may be retried (x-should-retry is not forced false)
    read_only = ToolAnnotations(read_only_hint=True)
    server.tool(annotations=read_only)(get_time)
    server.tool(annotations=read_only)(calculate)
    return server


def demo_catalog() -> ToolCatalog:
    """A `ToolCatalog` with the demo server registered in-process under the label ``demo``."""
    return ToolCatalog([McpServerConfig(label=DEMO_LABEL, app=create_demo_server())])
