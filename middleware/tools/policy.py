"""Which MCP tools a request exposes, and which need approval: ``allowed_tools`` and ``require_approval``.

Both follow OpenAI's Responses API. A *tool filter* ``F`` is ``{"tool_names": [...], "read_only":
bool}``; it matches a tool when every key it has matches (``read_only`` compares the tool's
``readOnlyHint`` annotation, absent = false); an empty ``F`` matches nothing.

* ``allowed_tools`` — a list of names or an ``F`` object; absent = every tool (`parse_allowed_tools`).
* ``require_approval`` — ``"always"`` (the default), ``"never"``, or ``{"always": F, "never": F}``: a
  tool matched by ``always`` needs approval, else one matched by ``never`` does not, else it does
  (`parse_approval`).

Pure: the parsers raise ValueError naming the field and what is allowed (the catalog prefixes the
request's ``tools[i]`` and answers 400 ``invalid_value``). The gateway only *records* the approval
decision (`middleware.tools.resolved.GatewayTool.require_approval`); the loop controller acts on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ApprovalPolicy", "ListedTool", "ToolFilter", "parse_allowed_tools", "parse_approval"]


class ListedTool(Protocol):
    """What a filter looks at in one ``tools/list`` entry."""

    @property
    def name(self) -> str:
        """The tool's MCP name."""
        ...

    @property
    def read_only(self) -> bool:
        """Its ``readOnlyHint`` annotation (absent = false)."""
        ...


@dataclass(frozen=True)
class ToolFilter:
    """OpenAI's tool filter ``{"tool_names": [...], "read_only": bool}``; None fields match all."""

    names: frozenset[str] | None = None
    read_only: bool | None = None

    @property
    def empty(self) -> bool:
        """Whether the filter has no key (as ``require_approval`` filter it then matches nothing)."""
        return self.names is None and self.read_only is None

    def matches(self, tool: ListedTool) -> bool:
        """Whether every key the filter has matches `tool` (an empty filter matches every tool)."""
        return (self.names is None or tool.name in self.names) and (
            self.read_only is None or tool.read_only == self.read_only
        )


@dataclass(frozen=True)
class ApprovalPolicy:
    """A parsed ``require_approval``: a constant, or ``always`` / ``never`` filters."""

    constant: bool | None
    always: ToolFilter | None = None
    never: ToolFilter | None = None

    def required(self, tool: ListedTool) -> bool:
        """Whether a call of `tool` must be approved by the client before it runs."""
        if self.constant is not None:
            return self.constant
        if self.always is not None and not self.always.empty and self.always.matches(tool):
            return True
        return not (self.never is not None and not self.never.empty and self.never.matches(tool))


def parse_filter(field: str, value: object) -> ToolFilter:
    """A ``tool_names`` list or ``{"tool_names", "read_only"}`` object as a `ToolFilter`.

    `field` names the request field in the ValueError raised for anything else.
    """
    if isinstance(value, list):
        value = {"tool_names": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"{field} must be a list of tool names or an object with tool_names / read_only")
    names = value.get("tool_names")
    read_only = value.get("read_only")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise ValueError(f"{field}.tool_names must be a list of strings")
    if read_only is not None and not isinstance(read_only, bool):
        raise ValueError(f"{field}.read_only must be true or false")
    return ToolFilter(names=None if names is None else frozenset(names), read_only=read_only)


def parse_allowed_tools(value: object) -> ToolFilter:
    """An ``allowed_tools`` value (None: every tool) as a `ToolFilter`; ValueError if malformed."""
    return ToolFilter() if value is None else parse_filter("allowed_tools", value)


def parse_approval(value: object) -> ApprovalPolicy:
    """A ``require_approval`` value (None: ``"always"``) as an `ApprovalPolicy`; ValueError if malformed."""
    if value is None or value == "always":
        return ApprovalPolicy(constant=True)
    if value == "never":
        return ApprovalPolicy(constant=False)
    if isinstance(value, Mapping) and set(value) <= {"always", "never"}:
        always = value.get("always")
        never = value.get("never")
        return ApprovalPolicy(
            constant=None,
            always=None if always is None else parse_filter("require_approval.always", always),
            never=None if never is None else parse_filter("require_approval.never", never),
        )
    raise ValueError(
        'require_approval must be "always", "never" or an object with "always" / "never" tool filters'
    )
