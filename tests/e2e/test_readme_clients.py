"""The README's "Clients" recipes, run as they are written (issue 18 item 9, for the openai SDK,
the Agents SDK and LangChain) against a real gateway in `make run`'s mode: the embedded dev model
and the in-process ``demo`` MCP server. Each ``print(...)  # expected`` line of a recipe must print
a line that starts with the comment's text."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from middleware.app import create_app
from middleware.config import Settings
from tests.servers import serve_asgi

README = Path(__file__).resolve().parents[2] / "README.md"
PLACEHOLDER = "http://127.0.0.1:8080"


def recipes() -> list[str]:
    """The python code blocks of the README's "Clients" section, in order."""
    text = README.read_text()
    section = text[text.index("\n## Clients\n") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def expected(code: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#\s*(.+)$", code, re.M)]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_asgi(create_app(Settings(store="memory"))) as base:
        yield base


def test_the_section_has_the_three_clients() -> None:
    found = recipes()
    assert len(found) == 3
    assert "from openai import OpenAI" in found[0]
    assert "HostedMCPTool" in found[1] and "run_streamed" in found[1] and "state.approve" in found[1]
    assert "use_responses_api=True" in found[2]
    assert all(PLACEHOLDER in code and expected(code) for code in found)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["openai", "agents", "langchain"])
def test_recipe_runs_and_prints_what_it_says(url: str, index: int) -> None:
    code = recipes()[index]
    if index == 1:
        pytest.importorskip("agents")
    if index == 2:
        pytest.importorskip("langchain_openai")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(
            compile(code.replace(PLACEHOLDER, url), f"README recipe {index}", "exec"), {"__name__": "recipe"}
        )
    lines = out.getvalue().splitlines()
    wanted = expected(code)
    assert len(lines) == len(wanted), lines
    for line, want in zip(lines, wanted, strict=True):
        assert line.startswith(want), (line, want)
