"""Field checks of a parsed create request, before anything goes upstream (DESIGN.md §5 last row).

`validate_request(request)` raises `InvalidRequest` (400) whose ``param`` names the field and
whose message says what to change. It checks only what the gateway relies on or what an upstream
would otherwise answer with a 500: types of the fields it reads, and finite, in-range numbers;
``background: true`` with ``store: false`` (400, as OpenAI answers: a background response is
stored); and ``metadata`` within OpenAI's bounds (`validate_metadata`, shared with conversations).
"""

from __future__ import annotations

import math
from typing import Any

from middleware.errors import InvalidRequest

# field -> (minimum, maximum, integer?) for numeric request fields (OpenAI Responses API ranges).
NUMERIC_FIELDS: dict[str, tuple[float, float, bool]] = {
    "max_output_tokens": (1, 2**31 - 1, True),
    "max_tool_calls": (0, 2**31 - 1, True),
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, False),
    "top_logprobs": (0, 20, True),
}


def _check_number(name: str, value: Any) -> None:
    low, high, integer = NUMERIC_FIELDS[name]
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(
            f"{name} must be a number, got {type(value).__name__}", code="invalid_type", param=name
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(
            f"{name} must be a finite number, got {value}", code="invalid_number", param=name
        )
    if integer and not (isinstance(value, int) or value.is_integer()):
        raise InvalidRequest(f"{name} must be an integer, got {value}", code="invalid_type", param=name)
    if not low <= value <= high:
        raise InvalidRequest(
            f"{name} must be in {low}..={high}, got {value}", code="invalid_value", param=name
        )


#: OpenAI's bounds of ``metadata`` (responses and conversations alike): pairs, key and value characters.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def validate_metadata(value: object) -> dict[str, str]:
    """The ``metadata`` of a create request or a conversation (None: ``{}``), as OpenAI bounds it:
    at most 16 pairs, keys at most 64 characters, string values at most 512 characters.

    Raises `InvalidRequest` (400) with ``param`` ``metadata`` (not an object, too many pairs, a key
    too long) or ``metadata.<key>`` (a value not a string, or too long)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(
            "Invalid 'metadata': expected an object of string values.", code="invalid_type", param="metadata"
        )
    if len(value) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"Invalid 'metadata': at most {MAX_METADATA_PAIRS} pairs, got {len(value)}; send fewer.",
            code="invalid_value",
            param="metadata",
        )
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequest(
                f"Invalid 'metadata': keys are at most {MAX_METADATA_KEY} characters, got {len(key)} "
                f"({key[:20]!r}...); shorten it.",
                code="invalid_value",
                param="metadata",
            )
        if not isinstance(item, str):
            raise InvalidRequest(
                f"Invalid 'metadata.{key}': expected a string, got {type(item).__name__}.",
                code="invalid_type",
                param=f"metadata.{key}",
            )
        if len(item) > MAX_METADATA_VALUE:
            raise InvalidRequest(
                f"Invalid 'metadata.{key}': values are at most {MAX_METADATA_VALUE} characters, got "
                f"{len(item)}; shorten it.",
                code="invalid_value",
                param=f"metadata.{key}",
            )
    return value


def validate_request(request: dict[str, Any]) -> None:
    """Check the fields of a create request; raises `InvalidRequest` naming the first bad field."""
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            "model is required and must be a non-empty string", code="invalid_value", param="model"
        )
    if "input" in request and not isinstance(request["input"], str | list):
        raise InvalidRequest(
            "input must be a string or a list of input items", code="invalid_type", param="input"
        )
    if isinstance(request.get("input"), list):
        for i, item in enumerate(request["input"]):
            if not isinstance(item, dict):
                raise InvalidRequest(
                    f"input[{i}] must be an object (an input item)", code="invalid_type", param=f"input[{i}]"
                )
    for flag in ("stream", "store", "parallel_tool_calls", "background"):
        if flag in request and request[flag] is not None and not isinstance(request[flag], bool):
            raise InvalidRequest(f"{flag} must be true or false", code="invalid_type", param=flag)
    if request.get("background") is True and request.get("store") is False:
        raise InvalidRequest(
            "background: true requires store: true (a background response is stored so that it can be "
            "polled, cancelled and resumed); send store: true or leave store out",
            code="invalid_value",
            param="store",
        )
    if "tools" in request and request["tools"] is not None:
        tools = request["tools"]
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRequest("tools must be a list of tool objects", code="invalid_type", param="tools")
        for i, tool in enumerate(tools):
            for key in ("type", "name", "server_label", "server_url"):
                if key in tool and tool[key] is not None and not isinstance(tool[key], str):
                    raise InvalidRequest(
                        f"tools[{i}].{key} must be a string", code="invalid_type", param="tools"
                    )
    validate_metadata(request.get("metadata"))
    for name in NUMERIC_FIELDS:
        if name in request:
            _check_number(name, request[name])


#: Fields of a create body that ``POST /v1/responses/compact`` does not take (the OpenAI body:
#: model, input, instructions, previous_response_id, prompt_cache_*, service_tier).
COMPACT_REFUSED = ("stream", "store", "background", "conversation", "tools", "tool_choice")


def validate_compact_request(request: dict[str, Any]) -> None:
    """Check the fields of a ``POST /v1/responses/compact`` body (the Open Responses
    ``CompactResponseMethodPublicBody``): ``model``, ``input`` as for create, ``instructions`` and
    ``previous_response_id`` strings or null, one of ``input`` / ``previous_response_id`` given,
    and none of `COMPACT_REFUSED` (400 ``unsupported_parameter``). Raises `InvalidRequest`."""
    for name in COMPACT_REFUSED:
        if request.get(name) not in (None, False):
            raise InvalidRequest(
                f"{name} is not a parameter of /v1/responses/compact (it takes model, input, instructions, "
                "previous_response_id, prompt_cache_key, prompt_cache_retention, service_tier); leave it out",
                code="unsupported_parameter",
                param=name,
            )
    validate_request({k: v for k, v in request.items() if k in ("model", "input")})
    for name in ("instructions", "previous_response_id", "prompt_cache_key"):
        if request.get(name) is not None and not isinstance(request[name], str):
            raise InvalidRequest(f"{name} must be a string or null", code="invalid_type", param=name)
    if request.get("input") in (None, "", []) and request.get("previous_response_id") is None:
        raise InvalidRequest(
            "compaction needs a non-empty input or a previous_response_id: send the conversation to compact",
            code="missing_required_parameter",
            param="input",
        )
