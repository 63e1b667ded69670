"""`ChatDialect`: what one Chat Completions upstream speaks, and the translator's fail-closed caps.

The five dialect settings are the issue's (`--upstream-api chat` and its companions, per upstream
and per model under ``models:``); the caps follow Praxis' ``StreamLimits``
(../shared/specs/chat-completions-translation.md §1.4 rule 8) and fail closed.
"""

from __future__ import annotations

import dataclasses

from middleware.errors import choices_text

REASONING_DIALECTS = ("reasoning_content", "reasoning", "none")
REASONING_REPLAYS = ("omit", "reasoning_content", "reasoning")
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens")
TOOL_CALL_PROFILES = ("strict", "tolerant")
DEVELOPER_ROLES = ("developer", "system")

#: (setting, allowed values): what `ChatDialect` validates, and config.py / models.py check too.
DIALECT_CHOICES: dict[str, tuple[str, ...]] = {
    "reasoning_dialect": REASONING_DIALECTS,
    "reasoning_replay": REASONING_REPLAYS,
    "max_tokens_field": MAX_TOKENS_FIELDS,
    "tool_call_profile": TOOL_CALL_PROFILES,
    "developer_role": DEVELOPER_ROLES,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatDialect:
    """One Chat upstream's dialect and the translator's caps.

    ``reasoning_dialect``: the delta/message field reasoning text arrives in (``reasoning_content``,
    vLLM < 0.11, DeepSeek, llama.cpp; ``reasoning``, newer vLLM and Ollama; ``none``: ignored).
    ``reasoning_replay``: where a replayed ``reasoning`` input item goes on the next assistant
    message (``omit``: dropped, Groq rejects it; ``reasoning_content`` / ``reasoning``: DeepSeek
    thinking mode requires it). ``max_tokens_field``: what ``max_output_tokens`` becomes.
    ``tool_call_profile``: ``strict`` fails closed on every tool-call stream quirk; ``tolerant``
    accepts calls that all reuse ``index: 0`` with distinct ids, fragments without ``index``, and a
    first fragment without ``id`` (a call id is made). ``developer_role``: the role a
    ``developer`` message is sent with. Caps: ``max_tool_calls`` (calls per round),
    ``max_tool_call_argument_bytes`` (UTF-8 bytes of one call's arguments), ``max_stream_events``
    (Responses events produced from one round). Raises ValueError naming the field.
    """

    reasoning_dialect: str = "reasoning_content"
    reasoning_replay: str = "omit"
    max_tokens_field: str = "max_completion_tokens"
    tool_call_profile: str = "strict"
    developer_role: str = "developer"
    max_tool_calls: int = 128
    max_tool_call_argument_bytes: int = 1_048_576
    max_stream_events: int = 200_000

    def __post_init__(self) -> None:
        for field, choices in DIALECT_CHOICES.items():
            value = getattr(self, field)
            if value not in choices:
                raise ValueError(f"{field} must be {choices_text(choices)}, got {value!r}")
        for field in ("max_tool_calls", "max_tool_call_argument_bytes", "max_stream_events"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")

    @property
    def tolerant(self) -> bool:
        """The ``tolerant`` tool-call profile."""
        return self.tool_call_profile == "tolerant"
