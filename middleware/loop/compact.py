"""``POST /v1/responses/compact`` behind the guard: `CompactApp` (issue 24, DESIGN.md §7).

The body (Open Responses ``CompactResponseMethodPublicBody``, checked by
`middleware.asgi.validate.validate_compact_request`) is admitted like a create body — the raw
clamp, the admission pool, the ledger, the model's limits — by the `BudgetMiddleware` around this
app. Then `Compaction.run`:

1. restores ``previous_response_id`` for its owner (`restore_history`: the size is admitted before
   a row is decoded, 413 when it does not fit) and appends the new ``input``: the *window*;
   an empty window (no item with content) is a 400;
2. applies the compaction input rule to it (`lower_compaction_window`: tampered items are 400);
3. compacts it, by the model's ``upstream_compact`` (else ``--upstream-compact``):
   ``upstream`` forwards the window to the upstream's own ``/responses/compact``; ``gateway``
   makes one summarising inference call (``/responses``, `COMPACT_PROMPT` as the last user
   message, ``max_output_tokens`` the ``compact_max_output_tokens`` cap, ``store: false``, no
   tools); ``auto`` tries the upstream until it answers once (then remembers, per upstream, for
   the process) and falls back to ``gateway`` — for good — on a 404 or 405; on a Chat
   Completions upstream (``upstream_api: chat``) it is always ``gateway``, with no probe;
4. answers the spec's ``CompactResource``: ``{"id", "object": "response.compaction",
   "created_at", "output": [every user message of the window (fresh ids, completed) …, one
   compaction item], "usage"}``, its compaction item sealed (`CompactionSeal`). Nothing is
   stored: the answer is an input window, not a response id (Open Responses "WebSocket
   Compaction").

Every failure is raised for the guard (`middleware.outcomes`): a summary that is cut by the cap,
failed or empty is 502 ``upstream_error`` (`CompactionFailed`). Counted in
``loopwarden_compactions_total{mode,outcome}`` and ``loopwarden_inference_rounds``: a compaction
is one inference call (the gateway's summarising call, or the upstream's compaction; a 404/405
probe is none), which every ``max_infer_iters`` (1..=100) allows.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Receive, Scope, Send

from middleware.asgi.models import ModelRoute
from middleware.errors import InvalidRequest
from middleware.ids import new_id
from middleware.loop.compaction import Lowering, is_compaction, lower_compaction_window, upstream_id
from middleware.loop.context import RequestContext, context_of
from middleware.loop.items import as_input_items
from middleware.ops import metrics
from middleware.state import GatewayState
from middleware.store.history import restore_history
from middleware.upstream.chat.client import bind_ledger
from middleware.upstream.errors import UpstreamError, UpstreamInvalid, read_limited, status_failure
from middleware.upstream.reader import dumps_checked, read_response_object

#: The gateway's summarising prompt, sent as the last user message after the window (README).
COMPACT_PROMPT = (
    "You are performing a CONTEXT CHECKPOINT COMPACTION. Write a concise handoff summary of the "
    "conversation above for an assistant that will continue it without seeing it: the user's goals "
    "and constraints, the decisions made, the facts and tool results learned, the work done so far, "
    "and the open tasks and questions. Return only the summary."
)
#: Bytes one output token of a summary may take before the answer counts as ignoring the cap.
BYTES_PER_TOKEN_CAP = 32
#: Upstream statuses that mean "no compact route here" (``auto`` falls back to the gateway).
NO_ROUTE_STATUSES = frozenset({404, 405})
#: Client fields forwarded to the upstream's own ``/responses/compact``.
FORWARDED = ("model", "instructions", "prompt_cache_key", "prompt_cache_retention", "service_tier")


def compact_mode(state: GatewayState, route: ModelRoute | None) -> str:
    """``auto``, ``upstream`` or ``gateway``: the route's ``upstream_compact``, else the server's;
    always ``gateway`` when that upstream speaks Chat Completions (``upstream_api: chat`` has no
    ``/responses/compact``: ``auto`` never probes it, ``upstream`` is refused at start-up)."""
    settings = state.settings
    api = route.api(settings.upstream.api) if route is not None else settings.upstream.api
    if api == "chat":
        return "gateway"
    return (route.upstream_compact if route is not None else None) or settings.compaction.mode


def lowering_for(state: GatewayState, route: ModelRoute | None) -> Lowering:
    """How compaction items in a ``POST /v1/responses`` input are lowered for its upstream: that
    upstream reads compaction items natively when it is configured ``upstream`` or ``auto`` has
    seen its own compact route answer (foreign, unsealed items are passed to it then only)."""
    url = state.upstream_url(route)
    mode = compact_mode(state, route)
    native = mode == "upstream" or (mode == "auto" and state.compact_support.get(url) is True)
    assert state.seal is not None, "create_app makes the compaction seal"
    return Lowering(state.seal, upstream_id(url), native=native)


class CompactionFailed(UpstreamError):
    """The summarising call did not give a usable summary (cut by the cap, failed, empty): 502
    ``upstream_error`` (the upstream 5xx row of DESIGN.md §5)."""

    kind = "protocol"
    row = "upstream_5xx"
    code = "upstream_error"


class CompactApp:
    """Pure ASGI app for ``POST /v1/responses/compact`` (needs `BudgetMiddleware` around it,
    built with ``validate=validate_compact_request, create=False``)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await Compaction(self.state, context_of(scope)).run()


def _has_content(item: dict[str, Any]) -> bool:
    """False for a message whose text is all whitespace (nothing to summarise)."""
    if item.get("type", "message") != "message":
        return True
    content = item.get("content")
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):
        return any(
            not isinstance(part, dict) or not isinstance(part.get("text"), str) or bool(part["text"].strip())
            for part in content
        )
    return False


def retained_user_message(item: dict[str, Any]) -> dict[str, Any]:
    """A user message of the window as the compacted output keeps it: a fresh ``msg_`` id,
    ``status: completed``, content as a list of parts (a string becomes one ``input_text``)."""
    content = item.get("content")
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
    return {"type": "message", "id": new_id("msg"), "role": "user", "status": "completed", "content": parts}


def compaction_usage(usage: Any) -> dict[str, Any]:
    """An upstream ``usage`` as the spec's complete ``Usage`` (missing counts are 0, the
    total their sum, the details objects present)."""
    u = usage if isinstance(usage, dict) else {}

    def count(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    inp, out = count(u.get("input_tokens")), count(u.get("output_tokens"))
    in_details, out_details = u.get("input_tokens_details"), u.get("output_tokens_details")
    in_details = in_details if isinstance(in_details, dict) else {}
    out_details = out_details if isinstance(out_details, dict) else {}
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": count(in_details.get("cached_tokens"))},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": count(out_details.get("reasoning_tokens"))},
        "total_tokens": count(u.get("total_tokens")) or inp + out,
    }


def summary_text(response: dict[str, Any]) -> str:
    """The text of the assistant messages of a response object (``output_text`` parts, joined)."""
    texts = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message" and isinstance(item.get("content"), list):
            texts += [
                p["text"]
                for p in item["content"]
                if isinstance(p, dict) and p.get("type") == "output_text" and isinstance(p.get("text"), str)
            ]
    return "".join(texts).strip()


class Compaction:
    """One compaction request (see the module docstring)."""

    def __init__(self, state: GatewayState, ctx: RequestContext) -> None:
        self.state = state
        self.ctx = ctx
        self.request = ctx.request
        settings = state.settings
        route = ctx.route
        self.mode = compact_mode(state, route)
        self.cap = (route.compact_max_output_tokens if route is not None else None) or (
            settings.compaction.max_output_tokens
        )
        self.url = state.upstream_url(route)
        self.upstream = state.upstream_for(route)
        assert state.seal is not None, "create_app makes the compaction seal"
        self.seal = state.seal
        self.ran = "gateway" if self.mode == "gateway" else "upstream"

    async def run(self) -> None:
        """Restore, lower, compact, answer once; raises failures for the guard."""
        try:
            history, new_input = await self._window()
            answer = None
            if self.mode != "gateway" and self.state.compact_support.get(self.url) is not False:
                answer = await self._upstream_compact(history, new_input)
            if answer is None:
                self.ran = "gateway"
                answer = await self._gateway_compact(history, new_input)
        except Exception:
            metrics.COMPACTIONS.labels(mode=self.ran, outcome="failed").inc()
            raise
        raw = dumps_checked(answer)
        self.ctx.ledger.admit_terminal(raw)
        metrics.COMPACTIONS.labels(mode=self.ran, outcome="ok").inc()
        await self.ctx.client.answer_json(200, raw)

    async def _window(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The restored history and the new input; a 400 when there is nothing to summarise."""
        history: list[dict[str, Any]] = []
        if self.request.get("previous_response_id") is not None:
            if self.state.store is None:
                raise InvalidRequest(
                    "this gateway runs without a store: previous_response_id is unavailable",
                    code="invalid_request",
                    param="previous_response_id",
                )
            restored = await restore_history(self.request, self.state.store, self.ctx.owner, self.ctx.ledger)
            history = restored.items
        new_input = as_input_items(self.request.get("input"))
        if not any(_has_content(item) for item in (*history, *new_input)):
            raise InvalidRequest(
                "there is nothing to compact: the input holds no message with text (and no previous "
                "response); send the conversation to compact",
                code="invalid_value",
                param="input",
            )
        return history, new_input

    def _lowered(
        self, history: list[dict[str, Any]], new_input: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        native = self.ran == "upstream"
        lowering = Lowering(self.seal, upstream_id(self.url), native=native)
        parts = lower_compaction_window(
            [history, new_input],
            lowering,
            lambda part, index, item: "previous_response_id" if part == 0 else f"input[{index}]",
        )
        return parts[0] + parts[1]

    def _retained(
        self, history: list[dict[str, Any]], new_input: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        return [
            retained_user_message(item)
            for item in (*history, *new_input)
            if item.get("role") == "user" and item.get("type", "message") == "message"
        ]

    def _answer(self, output: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        return {
            "id": new_id("resp"),
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": output,
            "usage": compaction_usage(usage),
        }

    async def _upstream_compact(
        self, history: list[dict[str, Any]], new_input: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """The upstream's own compaction of the window, its compaction items sealed; None when
        ``auto`` finds no compact route there (404/405: remembered for the process)."""
        body = {k: self.request[k] for k in FORWARDED if self.request.get(k) is not None}
        body["input"] = self._lowered(history, new_input)
        response = await self.upstream.post("/responses/compact", dumps_checked(body), stream=False)
        try:
            if response.status_code in NO_ROUTE_STATUSES and self.mode == "auto":
                self.state.compact_support[self.url] = False
                metrics.COMPACTIONS.labels(mode="upstream", outcome="fallback").inc()
                return None
            if response.status_code >= 400:
                raise status_failure(response.status_code, await read_limited(response), response.headers)
            answer = await read_response_object(response, self.ctx.ledger)
        finally:
            await response.aclose()
        if self.mode == "auto":
            self.state.compact_support[self.url] = True
        metrics.INFERENCE_ROUNDS.observe(1)  # the upstream's compaction is its one inference call
        output = []
        for index, item in enumerate(answer.items):
            if is_compaction(item):
                content = item.get("encrypted_content")
                if not isinstance(content, str) or not content:
                    raise UpstreamInvalid(
                        f"upstream compaction output[{index}] has no encrypted_content string"
                    )
                sealed = self.seal.seal("upstream", upstream_id(self.url), content)
                item = {
                    "type": "compaction",
                    "id": item.get("id") or new_id("cmp"),
                    "encrypted_content": sealed,
                }
            output.append(item)
        if not any(is_compaction(item) for item in output):
            raise UpstreamInvalid("the upstream's /responses/compact answer holds no compaction item")
        return self._answer(output, answer.parsed.get("usage"))

    async def _gateway_compact(
        self, history: list[dict[str, Any]], new_input: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """One summarising inference call; the window of retained user messages + its summary."""
        body: dict[str, Any] = {
            "model": self.request["model"],
            "input": [
                *self._lowered(history, new_input),
                {"type": "message", "role": "user", "content": COMPACT_PROMPT},
            ],
            "store": False,
            "stream": False,
            "max_output_tokens": self.cap,
        }
        for field in ("instructions", "prompt_cache_key"):
            if self.request.get(field) is not None:
                body[field] = self.request[field]
        metrics.INFERENCE_ROUNDS.observe(1)  # the one inference call of a gateway compaction
        with bind_ledger(self.ctx.ledger):  # a Chat upstream's translation is charged to this request
            response = await self.upstream.post("/responses", dumps_checked(body), stream=False)
        try:
            if response.status_code >= 400:
                raise status_failure(response.status_code, await read_limited(response), response.headers)
            answer = await read_response_object(response, self.ctx.ledger)
        finally:
            await response.aclose()
        summary = self._summary(answer.parsed)
        item = {
            "type": "compaction",
            "id": new_id("cmp"),
            "encrypted_content": self.seal.seal("gateway", upstream_id(self.url), summary),
        }
        return self._answer([*self._retained(history, new_input), item], answer.parsed.get("usage"))

    def _summary(self, parsed: dict[str, Any]) -> str:
        """The summary of a summarising call's answer; `CompactionFailed` when there is none."""
        status = parsed.get("status") or "completed"
        if status == "incomplete":
            raise CompactionFailed(
                f"the compaction summary was cut off (incomplete: the model hit compact_max_output_tokens="
                f"{self.cap}); raise compact_max_output_tokens (--compact-max-output-tokens or the model's "
                "setting), or compact a shorter conversation"
            )
        if status != "completed":
            error = parsed.get("error")
            said = f": {str(error.get('message'))[:200]}" if isinstance(error, dict) else ""
            raise CompactionFailed(f"the summarising inference call ended {str(status)[:40]}{said}; retry")
        summary = summary_text(parsed)
        if not summary:
            raise CompactionFailed("the summarising inference call answered no summary text; retry")
        size = len(summary.encode())
        if size > self.cap * BYTES_PER_TOKEN_CAP:
            raise CompactionFailed(
                f"the compaction summary is {size} bytes, over {self.cap * BYTES_PER_TOKEN_CAP} "
                f"(compact_max_output_tokens={self.cap} x {BYTES_PER_TOKEN_CAP}): the upstream ignored "
                "max_output_tokens; lower the cap or use another model"
            )
        return summary


__all__ = ["COMPACT_PROMPT", "CompactApp", "Compaction", "CompactionFailed", "compact_mode", "lowering_for"]
