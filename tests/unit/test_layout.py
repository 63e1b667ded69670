"""The README's "Architecture" layout tree lists exactly the modules of `budget/` and `middleware/`.

The tree is the ``text`` code block of that section: one entry per line, two spaces of indent per
level, a directory ending in ``/``, then at least two spaces and what the entry is for. A module
added, moved or deleted without its line fails here, so the map cannot drift from the code.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("budget", "middleware")
ENTRY = re.compile(r"^(?P<indent>(?:  )*)(?P<name>[A-Za-z0-9_]+(?:/|\.py))\s{2,}(?P<job>\S.*)$")


def architecture_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^## Architecture\n(?P<body>.*?)(?=^## )", text, re.S | re.M)
    assert match, 'README.md has no "## Architecture" section followed by another section'
    return match["body"]


def layout_tree() -> list[tuple[str, str]]:
    """(path, job) for every line of the section's ``text`` block, paths built from the indent."""
    block = re.search(r"^```text\n(?P<tree>.*?)^```$", architecture_section(), re.S | re.M)
    assert block, 'the "Architecture" section has no ```text layout block'
    entries: list[tuple[str, str]] = []
    parents: list[str] = []
    for line in block["tree"].splitlines():
        entry = ENTRY.match(line)
        assert entry, f"layout line is not 'NAME  what it is for': {line!r}"
        depth = len(entry["indent"]) // 2
        assert depth <= len(parents), f"layout line indented past its directory: {line!r}"
        del parents[depth:]
        path = "".join(parents) + entry["name"]
        entries.append((path, entry["job"].strip()))
        if entry["name"].endswith("/"):
            parents.append(entry["name"])
    return entries


def modules_on_disk() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_the_tree_lists_exactly_the_modules() -> None:
    listed = [path for path, _ in layout_tree() if path.endswith(".py")]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    on_disk = modules_on_disk()
    missing = sorted(on_disk - set(listed))
    extra = sorted(set(listed) - on_disk)
    assert not missing, f"modules missing from the README layout tree: {missing}"
    assert not extra, f"README layout tree lists modules that do not exist: {extra}"


def test_every_directory_of_the_tree_is_a_package() -> None:
    dirs = [path for path, _ in layout_tree() if path.endswith("/")]
    assert {d.split("/")[0] + "/" for d in dirs} >= {p + "/" for p in PACKAGES}
    for d in dirs:
        assert (ROOT / d / "__init__.py").is_file(), f"{d} in the layout tree is not a package"


def test_every_entry_says_its_job() -> None:
    vague = [(path, job) for path, job in layout_tree() if len(job) < 10]
    assert not vague, f"say what each entry is for: {vague}"


def test_named_paths_exist() -> None:
    """Every `budget/…` or `middleware/…` path the section names (the "where to look" table, the
    request flow) exists."""
    named = set(re.findall(r"`((?:budget|middleware)/[^`\s]*)`", architecture_section()))
    assert named, "the section names no paths"
    for path in sorted(named):
        assert (ROOT / path).exists(), f"README Architecture names {path}, which does not exist"


def test_no_readme_names_a_module_path_that_does_not_exist() -> None:
    """README.md, bench/README.md, dashboards/README.md and docs/ name only real module paths."""
    docs = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "dashboards" / "README.md"]
    docs += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "docs").rglob("*.yaml"))
    stale = []
    for doc in docs:
        for path in re.findall(
            r"(?<![\w/])((?:budget|middleware)/[A-Za-z0-9_/]*\.py)\b", doc.read_text("utf-8")
        ):
            if not (ROOT / path).is_file():
                stale.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not stale, stale
