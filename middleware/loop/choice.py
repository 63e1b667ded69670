"""``tool_choice`` for an upstream that sees MCP tools as function tools (case B39).

The client names tools as it declared them (openai-python ``ToolChoiceMcpParam``
``{"type": "mcp", "server_label", "name"}``, ``ToolChoiceAllowed`` whose ``tools`` may hold
``{"type": "mcp", "server_label"}``); the upstream only knows the function tools the gateway sent
(`middleware.tools.resolved.ResolvedTools.upstream_tools`). `translate_tool_choice` maps one onto
the other, following ogx-ai/ogx (llama-stack) PR #4106 ``_process_tool_choice``:

=========================================================  ======================================
client ``tool_choice``                                     first inference call
=========================================================  ======================================
``{"type": "mcp", "server_label": L, "name": N}``          ``{"type": "function", "name": F}``
``{"type": "mcp", "server_label": L}``                     ``allowed_tools``, ``required``, L's
``{"type": "allowed_tools", "tools": [{"type": "mcp",…}]}``  each mcp entry as its functions
``{"type": "function", "name": N}``, N renamed upstream    ``{"type": "function", "name": F}``
anything else                                              unchanged
=========================================================  ======================================

Later inference calls of the same request get ``"auto"`` (a forced tool would be forced again
forever), except an ``allowed_tools`` choice, which keeps its tool set with ``mode: "auto"``. An
``mcp`` choice or entry naming a label or tool the request does not expose is `InvalidRequest`
(400, ``param: "tool_choice"``). The response echoes the client's own choice (`final_response`).
"""

from __future__ import annotations

from typing import Any

from middleware.errors import InvalidRequest
from middleware.tools.resolved import ResolvedTools

__all__ = ["translate_tool_choice"]


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="invalid_value", param="tool_choice")


def _mcp_functions(entry: dict[str, Any], resolved: ResolvedTools) -> list[str]:
    label, name = entry.get("server_label"), entry.get("name")
    if not isinstance(label, str) or not resolved.server_functions(label):
        raise _refuse(
            f"tool_choice names MCP server {str(label)[:100]!r}, which this request's tools do not declare "
            "(or whose allowed_tools expose nothing); declare it in tools or choose another tool"
        )
    if name is None:
        return resolved.server_functions(label)
    function = resolved.function_name(label, name) if isinstance(name, str) else None
    if function is None:
        raise _refuse(
            f"tool_choice names tool {str(name)[:100]!r} of MCP server {label!r}, which that server does not "
            "expose to this request; check the name and the server's allowed_tools"
        )
    return [function]


def translate_tool_choice(choice: Any, resolved: ResolvedTools) -> tuple[Any, Any]:
    """(the first inference call's ``tool_choice``, the later calls') for the client's `choice`
    (None: the field was not sent; it stays unsent on the first call). Raises `InvalidRequest`
    (``param: "tool_choice"``) for an ``mcp`` choice the request does not expose. Pure."""
    if not isinstance(choice, dict):
        return choice, "auto"
    kind = choice.get("type")
    if kind == "mcp":
        functions = _mcp_functions(choice, resolved)
        if choice.get("name") is not None:
            return {"type": "function", "name": functions[0]}, "auto"
        named = [{"type": "function", "name": f} for f in functions]
        return {"type": "allowed_tools", "mode": "required", "tools": named}, "auto"
    if kind == "function" and isinstance(choice.get("name"), str):
        if resolved.gateway_tool(choice["name"]) is None:
            renamed = [t for t in resolved.gateway_tools.values() if t.name == choice["name"]]
            if len(renamed) == 1:
                return {**choice, "name": renamed[0].function_name}, "auto"
        return choice, "auto"
    if kind == "allowed_tools" and isinstance(choice.get("tools"), list):
        tools: list[Any] = []
        for entry in choice["tools"]:
            if isinstance(entry, dict) and entry.get("type") == "mcp":
                tools.extend({"type": "function", "name": f} for f in _mcp_functions(entry, resolved))
            else:
                tools.append(entry)
        first = {**choice, "tools": tools}
        return first, {**first, "mode": "auto"}
    return choice, "auto"
