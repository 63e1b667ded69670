"""Sizes (issue 22.3): the ten longest functions and classes of `budget/` and `middleware/`, printed.

The target is a function of at most 60 lines and a class of at most 300 outside
`middleware/store/` (declarative data aside). The table is printed, not asserted (issue 22: a
size is a reader's measure, not a gate); run ``pytest -s tests/unit/test_sizes.py`` to see it. What is
asserted is the measure itself: a node's length counts its ``def``/``class`` line through its last
line, decorators excluded, nested definitions measured on their own as well.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("budget", "middleware")
FUNCTION_TARGET = 60
CLASS_TARGET = 300


@dataclass(frozen=True, order=True)
class Size:
    """One function or class: its length in lines, where it starts (``path:line``) and its name."""

    lines: int
    where: str
    name: str
    is_class: bool


def sizes_of(source: str, path: str) -> list[Size]:
    """Every function, method and class of `source` (nested ones too), with its length in lines
    from the ``def``/``class`` line through its last line (decorators not counted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            found.append(Size(lines, f"{path}:{node.lineno}", node.name, isinstance(node, ast.ClassDef)))
    return found


def measured() -> list[Size]:
    """The sizes of every module of `PACKAGES`, longest first."""
    rows = [
        size
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for size in sizes_of(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    ]
    return sorted(rows, reverse=True)


def table(rows: list[Size], target: int) -> str:
    """Ten rows as text, each marked ``over`` when it is longer than `target` lines."""
    return "\n".join(
        f"  {r.lines:4d}  {r.where:48s} {r.name}{'  over' if r.lines > target else ''}" for r in rows[:10]
    )


def test_the_measure_counts_def_through_last_line_without_decorators() -> None:
    source = "@decorator\n@another(1)\ndef f(x):\n    y = x\n\n    return y\n\n\nclass C:\n    def m(self):\n        pass\n"
    by_name = {s.name: s for s in sizes_of(source, "m.py")}
    assert (by_name["f"].lines, by_name["f"].where) == (4, "m.py:3")
    assert (by_name["C"].lines, by_name["C"].is_class) == (3, True)
    assert (by_name["m"].lines, by_name["m"].is_class) == (2, False)


def test_print_the_ten_longest() -> None:
    rows = measured()
    functions = [r for r in rows if not r.is_class]
    classes = [r for r in rows if r.is_class]
    outside_store = [r for r in functions if "/store/" not in r.where]
    over = sum(r.lines > FUNCTION_TARGET for r in outside_store)
    print(f"\nten longest functions (target <= {FUNCTION_TARGET} lines; {over} over outside store/):")
    print(table(functions, FUNCTION_TARGET))
    print(f"ten longest classes (target <= {CLASS_TARGET} lines):")
    print(table(classes, CLASS_TARGET))
    # the walk found the packages' code (a wrong root would print an empty table)
    assert any(r.where.startswith("budget/") for r in rows)
    assert any(r.where.startswith("middleware/") for r in rows)
