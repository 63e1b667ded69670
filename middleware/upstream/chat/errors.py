"""The translator's failures: an untranslatable request (400) and a Chat reply that cannot be
translated (502 / error frame), each counted in ``loopwarden_translation_failures_total{reason}``.

Messages are a static table (../shared/specs/chat-completions-translation.md §1.4 rule 9): never
upstream bytes, so nothing the model server sent is reflected to the client.
"""

from __future__ import annotations

from middleware.errors import InvalidRequest
from middleware.ops import metrics
from middleware.upstream.errors import UpstreamIncomplete, UpstreamInvalid

#: reason label -> the message the client gets (what went wrong; the fix is the operator's).
REPLY_MESSAGES: dict[str, str] = {
    "invalid_chunk": "the Chat Completions upstream sent a stream chunk that is not a valid chat.completion.chunk",
    "invalid_completion": "the Chat Completions upstream answered a body that is not a valid chat.completion",
    "missing_finish_reason": "the Chat Completions upstream stream ended without a finish reason",
    "unknown_finish_reason": "the Chat Completions upstream sent an unknown finish_reason",
    "invalid_tool_stream": (
        "the Chat Completions upstream sent an invalid tool-call stream; if the server puts every call "
        "on index 0 or omits the index, set tool_call_profile: tolerant for it"
    ),
    "legacy_function_call": "the Chat Completions upstream used unsupported legacy function calling",
    "limit_tool_calls": "the Chat Completions upstream stream exceeded the tool-call limit of one round",
    "limit_tool_arguments": "a tool call's arguments from the Chat Completions upstream exceeded their size limit",
    "limit_events": "the Chat Completions upstream stream exceeded the event limit of one round",
    "invalid_reasoning": "the Chat Completions upstream sent reasoning that is not text",
}
#: The bounded ``reason`` label values (README "Chat Completions upstreams"): `metrics.TRANSLATION_REASONS`.
REASONS: tuple[str, ...] = (*REPLY_MESSAGES, "unsupported_request")
assert set(REASONS) == set(metrics.TRANSLATION_REASONS), "the metric contract lists every reason"
#: Reasons that are caps (``loopwarden_cap_hits_total{limit="translation"}`` too).
LIMIT_REASONS = frozenset({"limit_tool_calls", "limit_tool_arguments", "limit_events"})


class ChatReplyInvalid(UpstreamInvalid):
    """A Chat reply that cannot be translated (502 ``upstream_invalid_response`` / error frame).
    ``reason``: one of `REPLY_MESSAGES`; counted when raised through `reply_failure`."""

    def __init__(self, reason: str) -> None:
        super().__init__(REPLY_MESSAGES[reason], reason=reason)
        self.reason = reason


class ChatLimitExceeded(ChatReplyInvalid):
    """A translation cap hit (tool calls, argument bytes, events): deterministic, never retried."""

    row = "translation_limit"


class ChatStreamIncomplete(UpstreamIncomplete):
    """The Chat stream ended (``[DONE]`` or EOF) before a finish reason (502 ``upstream_incomplete``)."""

    def __init__(self) -> None:
        super().__init__(REPLY_MESSAGES["missing_finish_reason"], reason="missing_finish_reason")
        self.reason = "missing_finish_reason"


def reply_failure(reason: str) -> UpstreamInvalid | UpstreamIncomplete:
    """The failure for `reason`, counted once in ``loopwarden_translation_failures_total``."""
    metrics.TRANSLATION_FAILURES.labels(reason=reason).inc()
    if reason == "missing_finish_reason":
        return ChatStreamIncomplete()
    if reason in LIMIT_REASONS:
        return ChatLimitExceeded(reason)
    return ChatReplyInvalid(reason)


def unsupported(message: str, param: str | None = None) -> InvalidRequest:
    """A request the Chat translation cannot express: 400 ``invalid_request_error`` before any
    upstream call (counted as ``unsupported_request``)."""
    metrics.TRANSLATION_FAILURES.labels(reason="unsupported_request").inc()
    return InvalidRequest(message, code="unsupported_parameter", param=param)
