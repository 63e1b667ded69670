"""`middleware.loop.echo`: the echo fields an upstream omitted, filled from the request (units).

The validator's own teeth are tested here too: the objects the gateway used to emit fail the spec.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from middleware.dev.devmodel import build_response
from middleware.loop.echo import ECHO_DEFAULTS, echo_tool, normalise_response
from tests import spec_schema

TOOL: Any = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
MINIMAL: Any = {"id": "resp_1", "object": "response", "status": "completed", "output": []}


def test_missing_fields_take_the_clients_values_then_the_defaults() -> None:
    request = {"model": "m", "temperature": 0.2, "top_logprobs": 5, "safety_identifier": "u"}
    response = copy.deepcopy(MINIMAL)
    assert normalise_response(response, request) is True
    assert (response["temperature"], response["top_logprobs"], response["safety_identifier"]) == (0.2, 5, "u")
    assert (response["top_p"], response["presence_penalty"], response["frequency_penalty"]) == (1.0, 0.0, 0.0)
    assert (response["truncation"], response["tool_choice"], response["prompt_cache_key"]) == (
        "disabled",
        "auto",
        None,
    )
    assert response["text"] == {"format": {"type": "text"}} and response["model"] == "m"
    assert set(ECHO_DEFAULTS) <= set(response)


def test_null_is_replaced_only_where_the_spec_forbids_it() -> None:
    request = {"model": "m", "text": {"verbosity": "low"}}
    response = {
        **MINIMAL,
        "top_logprobs": None,  # vLLM: not nullable -> filled
        "instructions": None,  # nullable -> kept
        "metadata": None,  # the spec gives it no type -> kept
        "text": {"format": {"type": "text"}, "verbosity": None},
        "reasoning": {"effort": "low"},
    }
    normalise_response(response, request)
    assert (response["top_logprobs"], response["instructions"], response["metadata"]) == (0, None, None)
    assert response["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert response["reasoning"] == {"effort": "low", "summary": None}


def test_present_values_win_over_the_request() -> None:
    response = {**MINIMAL, "temperature": 0.7, "top_p": 0.9}
    normalise_response(response, {"model": "m", "temperature": 0.1})
    assert (response["temperature"], response["top_p"]) == (0.7, 0.9)


def test_a_complete_object_is_untouched() -> None:
    complete = build_response({"model": "m", "input": "hi", "tools": [TOOL]})
    before = copy.deepcopy(complete)
    assert normalise_response(complete, {"model": "m", "tools": [TOOL]}) is False
    assert complete == before


def test_function_tools_get_the_spec_defaults_and_share_the_clients_values() -> None:
    echoed = echo_tool(TOOL)
    assert echoed == {**TOOL, "description": None, "strict": True}
    assert echoed["parameters"] is TOOL["parameters"]  # a shallow copy: no copy of the schema
    complete = {**TOOL, "description": "d", "strict": False}
    assert echo_tool(complete) is complete
    mcp = {"type": "mcp", "server_label": "x"}
    assert echo_tool(mcp) is mcp
    response = copy.deepcopy(MINIMAL)
    normalise_response(response, {"model": "m", "tools": [TOOL]})
    assert response["tools"] == [echoed]


@pytest.mark.parametrize(
    ("field", "value"), [("created_at", "yesterday"), ("output", None), ("usage", {"input_tokens": 3})]
)
def test_resource_fields_of_the_wrong_shape_are_repaired(field: str, value: Any) -> None:
    response = {**MINIMAL, field: value}
    normalise_response(response, {"model": "m"})
    spec_schema.require_spec()
    spec_schema.assert_response(response)


def test_the_validator_rejects_what_the_gateway_used_to_emit() -> None:
    spec_schema.require_spec()
    old_dev = build_response({"model": "m", "input": "hi", "tools": [TOOL]})
    for key in ("presence_penalty", "frequency_penalty", "top_logprobs", "safety_identifier"):
        del old_dev[key]
    old_dev["temperature"] = old_dev["top_p"] = None
    del old_dev["tools"][0]["strict"]
    problems = spec_schema.errors("ResponseResource", old_dev)
    assert len(problems) == 7, problems
    assert any("strict" in problem for problem in problems)
    bad_call = {"type": "mcp_call", "id": "mcp_1", "server_label": 5, "name": "x", "arguments": "{}"}
    assert spec_schema.errors("ItemField", bad_call), "the SDK check must reject a non-string server_label"
    good_call = {**bad_call, "server_label": "tools"}
    assert spec_schema.errors("ItemField", good_call) == []
    assert spec_schema.errors("HttpErrorEnvelope", {"error": {"message": "m"}})


def test_filled_defaults_share_no_container_with_the_defaults() -> None:
    """A default filled in is a fresh copy: a later edit of one response's ``text`` or
    ``metadata`` (the stitcher, the store) changes neither the defaults nor another response."""
    pristine = {
        field: copy.deepcopy(value) if isinstance(value, dict | list) else value
        for field, value in ECHO_DEFAULTS.items()
    }
    first, second = copy.deepcopy(MINIMAL), copy.deepcopy(MINIMAL)
    normalise_response(first, {"model": "m"})
    first["text"]["format"]["type"] = "json_object"
    first["text"]["verbosity"] = "low"
    first["metadata"]["k"] = "v"
    normalise_response(second, {"model": "m"})
    assert pristine == ECHO_DEFAULTS
    assert (second["text"], second["metadata"]) == ({"format": {"type": "text"}}, {})
    for field, value in ECHO_DEFAULTS.items():  # every container default, compared by identity
        if isinstance(value, dict | list):
            assert second[field] == value and second[field] is not value, field
