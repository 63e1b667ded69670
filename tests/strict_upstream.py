"""A strict Responses server's view of an inference call's ``input`` (issue 18 item 2).

`input_problems(body)` lists why a strict server would refuse the body the gateway sent upstream:
each input item must validate against the Open Responses ``ItemParam`` schema
(``../shared/specs/open-responses/openapi.json``) minus ``item_reference`` (the upstream is sent
``store: false`` and holds nothing to resolve, case B37); every ``function_call_output`` answers
an earlier ``function_call``, every ``function_call`` has exactly one output; ``call_id``s are
unique; a ``reasoning`` item is followed by an output item (OpenAI's "provided without its
required following item"); function tool names match ``^[a-zA-Z0-9_-]{1,64}$`` (B29); a
``tool_choice`` of type ``function`` names a sent function tool, and no ``mcp`` choice is sent
(B39). A missing spec file skips the schema part only (`SPEC` is None).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import referencing.jsonschema

SPEC_PATH = Path(__file__).resolve().parents[2] / "shared" / "specs" / "open-responses" / "openapi.json"
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FOLLOWERS = {"function_call", "message"}


def _validator() -> jsonschema.protocols.Validator | None:
    if not SPEC_PATH.is_file():
        return None
    spec = json.loads(SPEC_PATH.read_text())
    schemas = spec["components"]["schemas"]
    variants = [v for v in schemas["ItemParam"]["oneOf"] if not v["$ref"].endswith("/ItemReferenceParam")]
    root = {"components": spec["components"], "oneOf": variants}
    resource = referencing.Resource.from_contents(
        root, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry: referencing.Registry[Any] = referencing.Registry().with_resource("urn:spec", resource)
    return jsonschema.Draft202012Validator({"$ref": "urn:spec"}, registry=registry)


SPEC = _validator()


def input_problems(body: dict[str, Any]) -> list[str]:
    """Every reason a strict Responses server refuses `body`'s ``input`` / ``tools`` /
    ``tool_choice``; empty when it accepts them."""
    problems: list[str] = []
    items = body.get("input")
    if isinstance(items, str):
        items = []
    if not isinstance(items, list):
        return [f"input is {type(items).__name__}"]
    calls: dict[str, int] = {}
    outputs: dict[str, int] = {}
    for index, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if SPEC is not None and isinstance(item, dict):
            error = jsonschema.exceptions.best_match(SPEC.iter_errors(item))
            if error is not None:
                problems.append(f"input[{index}] ({kind}): {error.message[:200]}")
        if kind == "function_call":
            call_id = item.get("call_id")
            if call_id in calls:
                problems.append(f"input[{index}]: duplicate call_id {call_id!r}")
            calls[call_id] = index
            if not NAME.fullmatch(str(item.get("name"))):
                problems.append(f"input[{index}]: function name {item.get('name')!r}")
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls:
                problems.append(f"input[{index}]: output for unknown call {call_id!r}")
            if call_id in outputs:
                problems.append(f"input[{index}]: second output for {call_id!r}")
            outputs[call_id] = index
        elif kind == "reasoning":
            after = items[index + 1] if index + 1 < len(items) else None
            ok = isinstance(after, dict) and (
                after.get("type") == "function_call"
                or (after.get("type", "message") == "message" and after.get("role") == "assistant")
            )
            if not ok:
                problems.append(f"input[{index}]: reasoning without its following item")
    problems += [f"function_call {c!r} has no output" for c in calls if c not in outputs]
    names = set()
    for index, tool in enumerate(body.get("tools") or []):
        if tool.get("type") == "mcp":
            problems.append(f"tools[{index}] is an mcp tool")
        if tool.get("type") == "function":
            names.add(tool.get("name"))
            if not NAME.fullmatch(str(tool.get("name"))):
                problems.append(f"tools[{index}].name {tool.get('name')!r} does not match the pattern")
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") == "mcp":
            problems.append("tool_choice of type mcp")
        if choice.get("type") == "function" and choice.get("name") not in names:
            problems.append(f"tool_choice names {choice.get('name')!r}, not in tools")
        for entry in choice.get("tools") or []:
            if entry.get("type") == "mcp" or (
                entry.get("type") == "function" and entry.get("name") not in names
            ):
                problems.append(f"allowed_tools entry {entry!r} not in tools")
    return problems
