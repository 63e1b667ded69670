"""Prints (does not assert) the ten longest functions and classes in `budget/` and `middleware/`.

Issue 22 item 3 keeps the measure in view: ``pytest -s tests/unit/test_sizes_report.py``. Lines
are counted from the ``def`` / ``class`` line to the last line of the body (decorators aside),
blank lines and docstrings included, as the architecture review measured them; methods and nested
functions count on their own (a class's length includes its methods).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("budget", "middleware")
TOP = 10


def definitions(root: Path = ROOT) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(functions, classes) of the packages: ``(lines, "path:line qualified.name")``, longest first."""
    functions: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            _walk(tree, rel, "", functions, classes)
    functions.sort(key=lambda entry: (-entry[0], entry[1]))
    classes.sort(key=lambda entry: (-entry[0], entry[1]))
    return functions, classes


def _walk(
    node: ast.AST, rel: str, prefix: str, functions: list[tuple[int, str]], classes: list[tuple[int, str]]
) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            size = (child.end_lineno or child.lineno) - child.lineno + 1
            target = classes if isinstance(child, ast.ClassDef) else functions
            target.append((size, f"{rel}:{child.lineno} {name}"))
            _walk(child, rel, f"{name}.", functions, classes)
        else:
            _walk(child, rel, prefix, functions, classes)


def test_print_the_ten_longest_functions_and_classes() -> None:
    functions, classes = definitions()
    for title, entries in (("functions", functions), ("classes", classes)):
        print(f"\nthe {TOP} longest {title} in budget/ and middleware/ (lines):")
        for size, where in entries[:TOP]:
            print(f"  {size:5d}  {where}")
    assert functions and classes, "no definitions found: is ROOT the repository?"
