"""Spec-complete response objects: the echo fields an upstream left out, filled from the request.

Open Responses' ``ResponseResource`` (``openapi.json`` 2026-04-24) requires every request
parameter it echoes (``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``,
``top_logprobs``, ``truncation``, ``text``, ``tool_choice``, ``safety_identifier``,
``prompt_cache_key``, …), several of them non-null. Upstreams differ: vLLM sends
``"top_logprobs": null``, older servers omit ``presence_penalty``, the embedded dev model used to
omit seven fields. `normalise_response` fills, in place, each echo field that is missing — or null
where the spec forbids null — with the value the client sent, else the spec's default; fields that
are present and allowed are left as the upstream sent them. `echo_tool` gives a function tool the
spec's required keys the client omitted (``description`` and ``parameters`` null, ``strict`` true,
the spec's documented default).

Nothing here copies a large value: filled values are the request's own objects or small constants,
so the normalised object costs what the upstream's did plus a few scalars (DESIGN.md §4).
"""

from __future__ import annotations

import time
from typing import Any, Final

__all__ = ["ECHO_DEFAULTS", "echo_tool", "normalise_response"]

_NULL: Final = object()  # "no default: null is allowed and is the default"

#: Echo field -> the spec's default when the client did not send it (`_NULL`: nullable, null).
#: Where the spec states no default, OpenAI's documented one (temperature and top_p 1, penalties
#: 0, top_logprobs 0, truncation "disabled", service_tier "default").
ECHO_DEFAULTS: Final[dict[str, object]] = {
    "instructions": _NULL,
    "previous_response_id": _NULL,
    "max_output_tokens": _NULL,
    "max_tool_calls": _NULL,
    "safety_identifier": _NULL,
    "prompt_cache_key": _NULL,
    "reasoning": _NULL,
    "metadata": {},
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_logprobs": 0,
    "truncation": "disabled",
    "store": True,
    "background": False,
    "service_tier": "default",
    "tool_choice": "auto",
    "text": {"format": {"type": "text"}},
}
_NULL_ALLOWED: Final = frozenset({"metadata"})  # no type in the spec: null is kept, absence filled
_ECHO_FIELDS: Final = frozenset(ECHO_DEFAULTS)
#: The echo fields whose null is replaced by the default (the spec types them non-null).
_NOT_NULL: Final = tuple(f for f, v in ECHO_DEFAULTS.items() if v is not _NULL and f not in _NULL_ALLOWED)
_VERBOSITY: Final = ("low", "medium", "high")
_FUNCTION_TOOL_DEFAULTS: Final = (("description", None), ("parameters", None), ("strict", True))


def echo_tool(tool: Any) -> Any:
    """A tool as echoed in a response: a ``function`` tool missing ``description``,
    ``parameters`` or ``strict`` gets a shallow copy with the spec's defaults (null, null, true);
    any other value is returned as it is (the same object)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    if all(key in tool for key, _ in _FUNCTION_TOOL_DEFAULTS):
        return tool
    return {**tool, **{key: value for key, value in _FUNCTION_TOOL_DEFAULTS if key not in tool}}


def _default(field: str, request: dict[str, Any]) -> object:
    sent = request.get(field)
    if sent is not None:
        return sent
    value = ECHO_DEFAULTS[field]
    return None if value is _NULL else _fresh(value)


def _fresh(value: object) -> object:
    """A copy of a default (JSON scalars, dicts and lists of them) that shares no container with
    `ECHO_DEFAULTS`, so a filled value edited later leaves the default as it is
    (``copy.deepcopy`` costs ~4 × more: its memo and dispatch)."""
    if type(value) is dict:
        return {key: _fresh(item) for key, item in value.items()}
    if type(value) is list:
        return [_fresh(item) for item in value]
    return value


def _fill_text(text: object, request: dict[str, Any]) -> object:
    """``text`` with a non-null ``format`` and a valid ``verbosity`` (the request's, else defaults);
    the same object when nothing was missing."""
    raw = request.get("text")
    sent: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if not isinstance(text, dict):
        text = {}
    out = text
    if not isinstance(text.get("format"), dict):
        fmt = sent.get("format")
        out = {**out, "format": fmt if isinstance(fmt, dict) else {"type": "text"}}
    if "verbosity" in text and text["verbosity"] not in _VERBOSITY:
        verbosity = sent.get("verbosity")
        out = {**out, "verbosity": verbosity if verbosity in _VERBOSITY else "medium"}
    return out


def _fill_reasoning(reasoning: object) -> object:
    if isinstance(reasoning, dict) and not ("effort" in reasoning and "summary" in reasoning):
        return {"effort": None, "summary": None, **reasoning}
    return reasoning


def normalise_response(
    response: dict[str, Any], request: dict[str, Any], *, created_at: int | None = None
) -> bool:
    """Fill `response`'s missing echo fields in place (see the module docstring); return whether
    anything changed. Also fills the non-echo fields the spec requires when they are absent
    (``object``, ``created_at`` now, ``model`` the request's, ``output`` [], ``completed_at``,
    ``incomplete_details``, ``error`` and ``usage`` null; a ``usage`` object gets the token counts
    and details it lacks, as 0) and gives ``tools`` (the request's
    when the upstream sent none) the function-tool defaults of `echo_tool`. ``id`` and
    ``status`` are the caller's. ``created_at``: the epoch seconds a missing ``created_at`` gets
    (the request's `RequestContext.created_at`, so every object of one response says the same; None:
    now). Never raises on odd upstream values: they are replaced."""
    before = len(response)
    changed = False
    # the usual upstream sends every echo field, none null where the spec forbids it: two C-level
    # checks instead of the loop below
    if not response.keys() >= _ECHO_FIELDS or None in map(response.__getitem__, _NOT_NULL):
        for field, value in ECHO_DEFAULTS.items():
            current = response.get(field, _NULL)
            if current is _NULL or (current is None and value is not _NULL and field not in _NULL_ALLOWED):
                response[field] = _default(field, request)
                changed = True
    for field, fill in (
        ("text", _fill_text(response["text"], request)),
        ("reasoning", _fill_reasoning(response["reasoning"])),
    ):
        if fill is not response[field]:
            response[field] = fill
            changed = True
    changed |= _fill_resource(response, request, created_at)
    upstream_tools = response.get("tools")
    replace = not isinstance(upstream_tools, list)
    tools: list[Any] = upstream_tools if isinstance(upstream_tools, list) else []
    if replace:
        sent = request.get("tools")
        tools = sent if isinstance(sent, list) else []
    echoed = [echo_tool(tool) for tool in tools]
    if replace or any(new is not old for new, old in zip(echoed, tools, strict=True)):
        response["tools"] = echoed  # (a list the upstream sent as it is stays the same object)
        changed = True
    return changed or len(response) != before


def _fill_resource(response: dict[str, Any], request: dict[str, Any], created_at: int | None) -> bool:
    """The non-echo required fields of a response object, when absent or of the wrong type."""
    changed = False
    fills: tuple[tuple[str, type | tuple[type, ...], object], ...] = (
        ("object", str, "response"),
        ("created_at", int, None),
        ("model", str, request.get("model") if isinstance(request.get("model"), str) else "unknown"),
        ("output", list, None),
    )
    for field, kind, value in fills:
        current = response.get(field)
        if not isinstance(current, kind) or isinstance(current, bool):
            if field == "created_at":
                now = int(time.time()) if created_at is None else created_at
                value = int(current) if isinstance(current, float) and current >= 0 else now
            elif field == "output":
                value = []
            response[field] = value
            changed = True
    for field in ("completed_at", "incomplete_details", "error", "usage"):
        if field not in response:
            response[field] = None
            changed = True
    usage = response["usage"]
    if isinstance(usage, dict):
        filled = _fill_usage(usage)
        if filled is not usage:
            response["usage"] = filled
            changed = True
    return changed


_USAGE_DETAILS: Final = (
    ("input_tokens_details", "cached_tokens"),
    ("output_tokens_details", "reasoning_tokens"),
)


def _fill_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """``usage`` with the token counts and details the spec requires (0 when absent); the same
    object when nothing was missing."""
    out = usage
    for field in ("input_tokens", "output_tokens"):
        if not isinstance(out.get(field), int):
            out = {**out, field: 0}
    if not isinstance(out.get("total_tokens"), int):
        out = {**out, "total_tokens": out["input_tokens"] + out["output_tokens"]}
    for field, count in _USAGE_DETAILS:
        details = out.get(field)
        if not isinstance(details, dict) or not isinstance(details.get(count), int):
            out = {**out, field: {**(details if isinstance(details, dict) else {}), count: 0}}
    return out
