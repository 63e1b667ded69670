"""A minimal loader of the Open Responses schemas for the compaction tests (issue 24).

`compact_validator(name)` validates a value against ``components.schemas[name]`` of
``../shared/specs/open-responses/openapi.json`` (relative to the repo root, or
``$LOOPWARDEN_SPECS``/open-responses), with every ``$ref`` resolved inside that document
(JSON Schema 2020-12, as OpenAPI 3.1 uses; ``discriminator`` is an annotation). Tests skip with
a clear reason when the spec is absent. A shared helper (``tests/spec_schema.py``) is being
built elsewhere; this one is named apart so that both can merge.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _spec_path() -> Path:
    base = os.environ.get("LOOPWARDEN_SPECS")
    specs = Path(base) if base else ROOT.parent / "shared" / "specs"
    return specs / "open-responses" / "openapi.json"


@functools.cache
def _document() -> dict[str, Any] | None:
    path = _spec_path()
    if not path.is_file():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def compact_validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for the spec's schema ``name``; skips the test when the spec is absent."""
    doc = _document()
    if doc is None:
        pytest.skip(f"the Open Responses spec is not at {_spec_path()} (set LOOPWARDEN_SPECS)")
    schemas = doc["components"]["schemas"]
    assert name in schemas, f"the spec has no schema {name!r}"
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


def assert_valid(name: str, value: Any) -> None:
    """Assert that `value` is valid against the spec's schema ``name`` (every error listed)."""
    errors = sorted(compact_validator(name).iter_errors(value), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message[:300]}" for e in errors[:10])
