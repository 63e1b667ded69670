"""Validate what the gateway emits against the Open Responses spec's own JSON Schemas.

The schemas are the published ``openapi.json`` (``$LOOPWARDEN_SPECS``, or ``../shared/specs``
next to the repository; tests skip with a reason when it is absent; it is never copied here),
resolved with a `referencing` registry and checked with jsonschema's Draft 2020-12 validator
(OpenAPI 3.1 schemas are 2020-12).

Documented deviation: OpenAI's ``mcp`` tool and its ``mcp_list_tools`` / ``mcp_call`` /
``mcp_approval_request`` / ``mcp_approval_response`` items (and the ``response.mcp_*`` events)
are not in the spec; loopwarden keeps OpenAI's names because clients rely on them. The helper
adds those variants to the spec's unions (``ItemField``, ``Tool``) as schemas that defer, through
the ``x-openai-sdk`` keyword, to the installed ``openai`` SDK's pydantic types; every other
value is checked against the spec alone.

One erratum is patched (see `_document`): ``JsonSchemaResponseFormat.schema`` admits a schema object.

HTTP error bodies have no schema in the spec's paths: the spec's text (Errors) gives the envelope
``{"error": {"message", "type", "param", "code"}}``, checked here as ``{"error": ErrorPayload}``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from jsonschema import Draft202012Validator
from pydantic import TypeAdapter, ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_URI = "urn:open-responses:openapi"
SPECS_DIR = Path(__file__).resolve().parents[2] / "shared" / "specs"


def spec_path() -> Path | None:
    """``openapi.json`` under ``$LOOPWARDEN_SPECS`` or ``../shared/specs``, or None when absent."""
    env = os.environ.get("LOOPWARDEN_SPECS")
    root = Path(env) if env else SPECS_DIR
    path = root / "open-responses" / "openapi.json"
    return path if path.is_file() else None


def require_spec() -> None:
    """Skip the calling test when the spec is not available."""
    if spec_path() is None:
        pytest.skip(
            "the Open Responses spec is absent: set $LOOPWARDEN_SPECS or check out ../shared/specs"
            " (open-responses/openapi.json)"
        )


@functools.cache
def _sdk_adapters() -> dict[str, TypeAdapter[Any]]:
    from openai.types.responses import (
        ResponseMcpCallArgumentsDeltaEvent,
        ResponseMcpCallArgumentsDoneEvent,
        ResponseMcpCallCompletedEvent,
        ResponseMcpCallFailedEvent,
        ResponseMcpCallInProgressEvent,
        ResponseMcpListToolsCompletedEvent,
        ResponseMcpListToolsFailedEvent,
        ResponseMcpListToolsInProgressEvent,
    )
    from openai.types.responses.response_input_item import McpApprovalResponse
    from openai.types.responses.response_output_item import McpApprovalRequest, McpCall, McpListTools
    from openai.types.responses.tool import Mcp

    types: dict[str, Any] = {
        "mcp": Mcp,
        "mcp_list_tools": McpListTools,
        "mcp_call": McpCall,
        "mcp_approval_request": McpApprovalRequest,
        "mcp_approval_response": McpApprovalResponse,
        "response.mcp_call.in_progress": ResponseMcpCallInProgressEvent,
        "response.mcp_call.completed": ResponseMcpCallCompletedEvent,
        "response.mcp_call.failed": ResponseMcpCallFailedEvent,
        "response.mcp_call_arguments.delta": ResponseMcpCallArgumentsDeltaEvent,
        "response.mcp_call_arguments.done": ResponseMcpCallArgumentsDoneEvent,
        "response.mcp_list_tools.in_progress": ResponseMcpListToolsInProgressEvent,
        "response.mcp_list_tools.completed": ResponseMcpListToolsCompletedEvent,
        "response.mcp_list_tools.failed": ResponseMcpListToolsFailedEvent,
    }
    return {name: TypeAdapter(kind) for name, kind in types.items()}


SDK_ITEMS = ("mcp_list_tools", "mcp_call", "mcp_approval_request", "mcp_approval_response")


def _sdk_keyword(
    validator: Any, name: str, instance: Any, schema: Any
) -> Iterator[jsonschema.ValidationError]:
    """``x-openai-sdk: NAME``: the instance must validate as the SDK type registered under NAME."""
    try:
        _sdk_adapters()[name].validate_python(instance, strict=False)
    except ValidationError as exc:
        yield jsonschema.ValidationError(f"not a valid openai SDK {name}: {exc}")


_Validator = jsonschema.validators.extend(Draft202012Validator, {"x-openai-sdk": _sdk_keyword})


def _sdk_variant(kinds: Iterable[str]) -> dict[str, Any]:
    """A schema matching objects whose ``type`` is one of `kinds`, each checked by the SDK."""
    kinds = list(kinds)
    return {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": kinds}},
        "allOf": [
            {"if": {"properties": {"type": {"const": kind}}}, "then": {"x-openai-sdk": kind}}
            for kind in kinds
        ],
    }


@functools.cache
def _document() -> dict[str, Any]:
    path = spec_path()
    assert path is not None, "call require_spec() first"
    doc: dict[str, Any] = copy.deepcopy(json.loads(path.read_text()))
    schemas = doc["components"]["schemas"]
    schemas["OpenAISdkMcpItem"] = _sdk_variant(SDK_ITEMS)
    schemas["OpenAISdkMcpTool"] = _sdk_variant(["mcp"])
    schemas["ItemField"]["oneOf"].append({"$ref": "#/components/schemas/OpenAISdkMcpItem"})
    schemas["Tool"]["oneOf"].append({"$ref": "#/components/schemas/OpenAISdkMcpTool"})
    # Erratum: the published JsonSchemaResponseFormat allows only null as "schema" (its anyOf lost
    # the object branch), so no echoed json_schema format could validate; accept a JSON Schema.
    schemas["JsonSchemaResponseFormat"]["properties"]["schema"] = {
        "anyOf": [{"type": "object"}, {"type": "null"}]
    }
    schemas["HttpErrorEnvelope"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"$ref": "#/components/schemas/ErrorPayload"}},
    }
    return doc


@functools.cache
def _registry() -> Registry[Any]:
    resource = Resource.from_contents(_document(), default_specification=DRAFT202012)
    return Registry().with_resource(SPEC_URI, resource)


@functools.cache
def _validator(name: str) -> Any:
    return _Validator({"$ref": f"{SPEC_URI}#/components/schemas/{name}"}, registry=_registry())


@functools.cache
def event_schemas() -> dict[str, str]:
    """Streaming event ``type`` -> the name of its schema in the spec."""
    out = {}
    for name, schema in _document()["components"]["schemas"].items():
        kind = schema.get("properties", {}).get("type", {})
        if name.endswith("StreamingEvent") and kind.get("enum"):
            out[kind["enum"][0]] = name
    return out


def known_event(kind: str) -> bool:
    """Whether `kind` is a streaming event type of the spec or an OpenAI MCP event."""
    return kind in event_schemas() or kind in _sdk_adapters()


def errors(name: str, instance: Any) -> list[str]:
    """Every violation of schema `name` (a ``components.schemas`` key) by `instance`, as text."""
    found = sorted(_validator(name).iter_errors(instance), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {_best(e)}" for e in found]


def _best(error: jsonschema.ValidationError) -> str:
    deepest = jsonschema.exceptions.best_match([error, *(error.context or ())])
    where = "/".join(map(str, deepest.absolute_path))
    return f"{deepest.message[:300]} (at {where})"


def assert_valid(name: str, instance: Any) -> None:
    """Raise AssertionError listing every violation of schema `name` by `instance`."""
    problems = errors(name, instance)
    assert not problems, f"{name} violations:\n  " + "\n  ".join(problems)


def assert_response(response: Any) -> None:
    """A response object (``ResponseResource``)."""
    assert_valid("ResponseResource", response)


def assert_error_envelope(body: Any) -> None:
    """An HTTP 4xx/5xx body: ``{"error": ErrorPayload}`` (type, code, message, param)."""
    assert_valid("HttpErrorEnvelope", body)


def assert_event(event: dict[str, Any]) -> None:
    """One streaming event against its spec schema chosen by ``type`` (the SDK's for ``response.mcp_*``)."""
    kind = event.get("type")
    name = event_schemas().get(str(kind))
    if name is not None:
        assert_valid(name, event)
        return
    assert kind in _sdk_adapters(), f"event type {kind!r} is neither in the spec nor an OpenAI MCP event"
    try:
        _sdk_adapters()[str(kind)].validate_python(event)
    except ValidationError as exc:
        raise AssertionError(f"{kind} is not a valid openai SDK event: {exc}") from None


def assert_stream(events: list[tuple[str, Any]]) -> None:
    """A whole stream (``(event name, data)`` as `tests.helpers.sse_events` returns): every event
    valid, the ``event:`` name equal to ``type``, ``sequence_number`` 0..N-1 in order, one
    ``response.created`` first and one terminal event (``response.failed`` after an ``error``)."""
    assert events, "an empty stream"
    for index, (name, data) in enumerate(events):
        assert name == data.get("type"), (index, name, data.get("type"))
        assert data.get("sequence_number") == index, (index, data.get("sequence_number"), name)
        assert_event(data)
    names = [name for name, _ in events]
    assert names[0] == "response.created", names[:3]
    terminals = [n for n in names if n in ("response.completed", "response.incomplete", "response.failed")]
    assert len(terminals) == 1 and names[-1] == terminals[0], names[-4:]
