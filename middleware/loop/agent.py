"""`AgentLoop`: the server-side tool loop of one request (DESIGN.md §6).

`AgentLoop.run()` makes inference calls until `classify_round` (`middleware.loop.decision`) says
stop: it sends each round upstream with the MCP tools exposed as function tools, runs the
gateway-owned calls through `middleware.tools.run_tool_calls` (timeouts, bounded fan-out, result
cap, ledger charge), feeds their outputs back, and answers once:

* buffered: one response object whose ``output`` holds the ``mcp_list_tools`` items, each round's
  visible items and an ``mcp_call`` item per executed gateway call (usage summed over rounds);
* streamed: one logical SSE stream (`middleware.loop.stitcher.StreamStitcher`).

Every request that uses the store or declares MCP tools runs here (the rest take
`middleware.loop.passthrough`). Within a round, the visible items keep their order and the
round's ``mcp_call`` items follow them. Failures are raised for the guard to settle
(`LoopLimitReached` is 508 ``max_infer_iters_exceeded``, or the error frames after commit).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from middleware.errors import InvalidRequest, LoopLimitReached
from middleware.ids import new_id
from middleware.loop.approvals import approval_id, check_approvals, check_call_pairs, pending_approvals
from middleware.loop.choice import translate_tool_choice
from middleware.loop.compact import lowering_for
from middleware.loop.compaction import lower_compaction_window
from middleware.loop.context import RequestContext
from middleware.loop.decision import (
    Continue,
    Done,
    Incomplete,
    LoopDetected,
    RequiresClientAction,
    RoundState,
    classify_round,
    split_calls,
)
from middleware.loop.items import (
    CLIENT_CHOICE,
    TERMINAL_STATUS,
    approval_request_item,
    as_input_items,
    final_response,
    mcp_call_item,
    sum_usage,
    upstream_body,
)
from middleware.loop.lowering import Lowered, drop_orphans, lower_input
from middleware.loop.memory import continuation_items, restore_turn_history
from middleware.loop.persist import ResponseRecorder
from middleware.loop.stitcher import StreamStitcher
from middleware.ops import metrics
from middleware.state import GatewayState
from middleware.store.history import resolve_references, restore_history
from middleware.tools import ResolvedTools, ToolOutcome, refuse_tool_call, run_tool_calls
from middleware.upstream.chat.client import bind_ledger
from middleware.upstream.errors import read_limited, status_failure
from middleware.upstream.protocol import UpstreamResponse
from middleware.upstream.reader import (
    StreamAccumulator,
    dumps_checked,
    no_terminal_event,
    read_response_object,
    read_round,
)

T = TypeVar("T")
#: `ItemLog.add_call` without an approval (no ``approval_request_id`` field).
_NO_APPROVAL: Any = object()
log = logging.getLogger("loopwarden")


class UpstreamRounds:
    """The inference calls of one request: each round's body is posted to the request's upstream
    (under keep-alives) and its answer read under the ledger, buffered or streamed (the stream's
    events forwarded by the `StreamStitcher`, None when the client is not streamed). What held a
    round's answer is released by `release` once its items are kept.

    Raises the upstream's failures (`middleware.upstream.errors`, its ``param`` and message
    re-indexed to the client's tools) and the ledger's."""

    def __init__(
        self,
        state: GatewayState,
        ctx: RequestContext,
        resolved: ResolvedTools,
        stitcher: StreamStitcher | None,
    ) -> None:
        self.state = state
        self.ctx = ctx
        self.client = ctx.client
        self.resolved = resolved
        self.stitcher = stitcher
        self._acc: StreamAccumulator | None = None
        self.live: StreamAccumulator | None = None  # the streamed round being read
        self._charge = 0

    def seen(self) -> list[dict[str, Any]]:
        """What the client saw of a streamed round that has not ended (`StreamStitcher.seen_items`):
        stored after the items so far when the response is stored before the round ends."""
        acc, stitcher = self.live, self.stitcher
        if acc is None or stitcher is None:
            return []
        return stitcher.seen_items(acc.delta_text, acc.items)

    async def with_keepalive(self, work: Awaitable[T]) -> T:
        """Await `work` (cancelled if this is), sending the client a keep-alive every
        ``keepalive_interval`` seconds meanwhile; what is buffered is flushed first."""
        await self.client.flush()  # what is buffered reaches the client before the wait
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.client.keepalive_interval)
                if done:
                    return task.result()
                await self.client.keepalive()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def call(self, body: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One round: the terminal response object (its ``status`` the terminal event's) and the
        output items."""
        upstream = self.state.upstream_for(self.ctx.route)
        with bind_ledger(self.ctx.ledger):  # a Chat upstream's translation is charged to this request
            response = await self.with_keepalive(upstream.post("/responses", body, stream=self.ctx.stream))
            return await self._answer(response)

    async def _answer(self, response: UpstreamResponse) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Read one round's upstream answer (error status, SSE or buffered), then close it."""
        try:
            if response.status_code >= 400:
                failure = status_failure(response.status_code, await read_limited(response), response.headers)
                # the client's tools[j], not the expanded list's tools[i] (B29)
                failure.message = self.resolved.client_text(failure.message)
                failure.args = (failure.message,)
                failure.param = None if failure.param is None else self.resolved.client_text(failure.param)
                raise failure
            if response.headers.get("content-type", "").lower().startswith("text/event-stream"):
                return await self._stream(response)
            return await self._buffered(response)
        finally:
            await response.aclose()

    async def _buffered(self, response: UpstreamResponse) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A buffered answer (replayed as events to a streamed client)."""
        answer = await read_response_object(response, self.ctx.ledger)
        parsed, items = answer.parsed, answer.items
        self._charge = answer.charge  # released once the round's kept items are recorded
        if self.stitcher is not None:  # a buffered answer to a streamed round: replay it as events
            await self.stitcher.synthesize(parsed, items)
        return parsed, items

    async def _stream(self, response: UpstreamResponse) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A streamed answer, accumulated (and forwarded to a streamed client)."""
        acc = StreamAccumulator(self.ctx.ledger)
        stitcher = self.stitcher
        self.live = acc  # the round so far, for a response stored before it ends (`seen`)
        await read_round(
            response,
            self.ctx.ledger,
            client=self.client,
            acc=acc,
            on_event=None if stitcher is None else stitcher.forward,
            on_run=None if stitcher is None else self.client.forward_run,  # the fast path
            accept=None if stitcher is None else stitcher.fast_count,
        )
        self.live = None
        if acc.terminal is None:  # a terminal event without a response object
            raise no_terminal_event()
        # The terminal event's type is the round's status: a response.failed / .incomplete never
        # runs tools, whatever its "status" field says (DESIGN.md §6).
        status = TERMINAL_STATUS[acc.terminal_type or "response.completed"]
        terminal, output = {**acc.terminal, "status": status}, acc.output()
        self._acc = acc  # released once the round's kept items are recorded
        return terminal, output

    def release(self) -> None:
        """Release what held the round's answer (its items are charged as kept state now)."""
        if self._acc is not None:
            self._acc.release_all()
            self._acc = None
        if self._charge:
            self.ctx.ledger.release(self._charge)
            self._charge = 0


class ItemLog:
    """What one request keeps of its rounds, in order: ``items`` (what the client sees: the
    response's ``output``) and ``replay`` (what is appended to the input upstream next round),
    both lists shared with the loop and its recorder; a streamed client gets each new item
    through the `StreamStitcher` (None: buffered). Replayed items are charged to the ledger as
    accumulated state (`BudgetExceeded` when they do not fit)."""

    def __init__(
        self,
        ctx: RequestContext,
        resolved: ResolvedTools,
        items: list[dict[str, Any]],
        replay: list[dict[str, Any]],
        stitcher: StreamStitcher | None,
    ) -> None:
        self.ctx = ctx
        self.resolved = resolved
        self.items = items
        self.replay = replay
        self.stitcher = stitcher

    def replay_output(self, call_id: Any, text: str) -> None:
        """Replay a ``function_call_output`` answering `call_id` with `text`."""
        self.replay.append({"type": "function_call_output", "call_id": call_id, "output": text})

    async def add_call(
        self,
        call: dict[str, Any],
        outcome: ToolOutcome,
        label: str,
        name: str,
        approval_request_id: Any = _NO_APPROVAL,
    ) -> None:
        """Show an executed gateway call as an ``mcp_call`` item (with its ``approval_request_id``
        when it ran on approval), under the id the stream announced it with."""
        item_id = self.stitcher.call_ids.get(id(call)) if self.stitcher is not None else None
        item = mcp_call_item(call, outcome, label, name, item_id or new_id("mcp"))
        if approval_request_id is not _NO_APPROVAL:
            item["approval_request_id"] = approval_request_id
        self.items.append(item)
        if self.stitcher is not None:
            await self.stitcher.finish_call(call, item)

    async def record_round(
        self,
        output: Sequence[dict[str, Any]],
        run: Sequence[dict[str, Any]],
        outcomes: Sequence[ToolOutcome],
        omitted: Sequence[dict[str, Any]],
        approvals: Sequence[dict[str, Any]] = (),
    ) -> None:
        """Append the round's items: replayed upstream next round, shown to the client now.

        Executed gateway calls become ``mcp_call`` items (after the round's visible items);
        calls awaiting approval become ``mcp_approval_request`` items; omitted calls vanish.
        """
        ran = {id(call): outcome for call, outcome in zip(run, outcomes, strict=True)}
        skipped = {id(call) for call in omitted}
        pending = {id(call) for call in approvals}
        calls: list[dict[str, Any]] = []
        start = len(self.replay)
        for item in output:
            if id(item) in ran:
                self.replay.append(item)
                self.replay_output(item.get("call_id"), ran[id(item)].output)
                calls.append(item)
            elif id(item) in pending:
                self.replay.append(item)  # answered by a later request's mcp_approval_response
            elif id(item) not in skipped:
                self.replay.append(item)
                self.items.append(item)
        self.ctx.ledger.admit_accumulated(json.dumps(self.replay[start:], separators=(",", ":")).encode())
        for call in calls:
            tool = self.resolved.gateway_tool(str(call.get("name")))
            assert tool is not None
            await self.add_call(call, ran[id(call)], tool.server_label, tool.name)
        for call in approvals:
            tool = self.resolved.gateway_tool(str(call.get("name")))
            assert tool is not None
            request = approval_request_item(
                call, approval_id(str(call.get("call_id"))), tool.server_label, tool.name
            )
            self.items.append(request)
            if self.stitcher is not None:
                await self.stitcher.add_item(request)


class AgentLoop:
    """The rounds of one request whose tools include gateway-owned MCP tools.

    ``state``: process state (settings, upstream client); ``ctx``: the admitted request (its
    ``client`` is the one writer to the client); ``resolved``: the request's tools. The rounds'
    upstream calls are an `UpstreamRounds`, what they keep an `ItemLog`.
    """

    def __init__(self, state: GatewayState, ctx: RequestContext, resolved: ResolvedTools) -> None:
        self.state = state
        self.ctx = ctx
        self.client = ctx.client
        self.resolved = resolved
        self.rounds = 0  # inference calls made so far
        self.response_id = ctx.response_id or new_id("resp")
        self.request = ctx.request
        self.input_items = as_input_items(self.request.get("input"))  # as the client sent them
        self.new_input: list[dict[str, Any]] = []  # the input in upstream form (`_prepare`)
        self.tool_choice: Any = CLIENT_CHOICE  # the first round's, then the later rounds'
        self.later_tool_choice: Any = "auto"
        self.history: list[dict[str, Any]] = []  # restored from the store, sent before the new input
        self.replay: list[dict[str, Any]] = []  # this request's items, appended to the input upstream
        self.items: list[dict[str, Any]] = list(resolved.list_items)  # what the client sees
        self.usage: dict[str, Any] | None = None
        self.tool_calls_used = 0
        max_tool_calls = self.request.get("max_tool_calls")
        # validate_request allows integral floats (2.0): honour them as the integer they are
        self.max_tool_calls: int | None = (
            int(max_tool_calls) if isinstance(max_tool_calls, int | float) else None
        )
        self.stitcher = (
            StreamStitcher(
                ctx.client,
                resolved,
                self.response_id,
                self.request,
                self.items,
                created_at=ctx.created_at,
                ledger=ctx.ledger,
            )
            if ctx.stream
            else None
        )
        self.recorder = ResponseRecorder(
            state.store if ctx.store else None,
            response_id=self.response_id,
            owner=ctx.owner,
            request=self.request,
            input_items=self.input_items,
            items=self.items,
            replay=self.replay,
            background=ctx.response_id is not None and self.request.get("background") is True,
        )
        self.upstream = UpstreamRounds(state, ctx, resolved, self.stitcher)
        self.recorder.seen = self.upstream.seen
        self.log = ItemLog(ctx, resolved, self.items, self.replay, self.stitcher)
        self.rounds_observed = False

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the request: prepare (history, approvals), loop the rounds, answer once.

        Raises failures (`middleware.errors`, `middleware.upstream.errors`, `budget`) for the
        guard to settle; before it does, the guard stores the response's true status through
        ``ctx.hooks.persist_failure``, which this sets (DESIGN.md §7).
        """
        self.ctx.hooks.persist_failure = self.recorder.failed
        try:
            await self._prepare()
            await self._loop()
        finally:
            self._observe_rounds()

    def _observe_rounds(self) -> None:
        """``loopwarden_inference_rounds`` once per request (before the final bytes when it can)."""
        if not self.rounds_observed:
            self.rounds_observed = True
            metrics.INFERENCE_ROUNDS.observe(self.rounds)

    async def _prepare(self) -> None:
        """Resolve references, restore stored history, lower the input, check call pairing, and
        settle answered approvals, stored or stateless (B03, B05, B37, B39)."""
        # What tools/list brought in is already charged: `ToolCatalog.resolve` charged each answer
        # while it was read and, once the tools were exposed, what this request keeps of them.
        if "tool_choice" in self.request:
            self.tool_choice, self.later_tool_choice = translate_tool_choice(
                self.request["tool_choice"], self.resolved
            )
        # in place: the recorder stores the resolved items, so a later chain never holds a reference
        self.input_items[:] = await resolve_references(
            self.input_items, self.state.store, self.ctx.owner, self.ctx.ledger
        )
        await self._restore_history()
        lowered = self._lower_input()
        self.history, self.new_input = self._lower_compaction()
        approvals = pending_approvals([*self.history, *lowered.pending], lowered.answers)
        check_call_pairs(self.history, self.new_input, {str(call.get("call_id")) for call, _ in approvals})
        await self._settle_approvals(approvals)

    async def _restore_history(self) -> None:
        """The history before the new input: the WebSocket connection's memory, else the stored
        chain; without a store, ``previous_response_id`` / ``conversation`` is a 400."""
        store = self.state.store
        if self.ctx.memory is not None:  # a WebSocket turn: connection memory first
            self.recorder.restored = await restore_turn_history(
                self.request, store, self.ctx.owner, self.ctx.ledger, self.ctx.memory
            )
            self.history = self.recorder.restored.items
        elif store is not None:
            self.recorder.restored = await restore_history(
                self.request, store, self.ctx.owner, self.ctx.ledger
            )
            self.history = self.recorder.restored.items
        elif (
            self.request.get("previous_response_id") is not None
            or self.request.get("conversation") is not None
        ):
            raise InvalidRequest(
                "this gateway runs without a store: previous_response_id and conversation are unavailable",
                code="invalid_request",
                param="previous_response_id",
            )

    async def _settle_approvals(self, approvals: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """Run the approved calls of `approvals` ((call, mcp_approval_response) pairs; as
        ``mcp_call`` items with their ``approval_request_id``) and replay every call's output:
        its result, or the refusal of a denied one."""
        approved = check_approvals(approvals, self.resolved, self.max_tool_calls)
        if approved and self.stitcher is not None:
            await self.stitcher.ensure_started()
        outcomes = dict(zip((id(c) for c in approved), await self._run_tools(approved), strict=True))
        self.tool_calls_used += len(approved)
        for call, answer in approvals:
            if id(call) in outcomes:
                outcome = outcomes[id(call)]
                tool = self.resolved.gateway_tool(str(call.get("name")))
                label, name = (
                    (tool.server_label, tool.name) if tool is not None else ("", str(call.get("name")))
                )
                await self.log.add_call(call, outcome, label, name, answer.get("approval_request_id"))
                text = outcome.output
            else:
                reason = answer.get("reason")
                text = refuse_tool_call(call, reason if isinstance(reason, str) else None).output
            self.log.replay_output(call.get("call_id"), text)

    def _lower_compaction(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The history and new input with their compaction items lowered for this upstream
        (`middleware.loop.compaction`; a 400 names an item that does not verify)."""
        index = {id(item): i for i, item in enumerate(self.input_items)}
        stored = "conversation" if self.request.get("conversation") is not None else "previous_response_id"
        history, new_input = lower_compaction_window(
            [self.history, self.new_input],
            lowering_for(self.state, self.ctx.route),
            lambda part, i, item: stored if part == 0 else f"input[{index.get(id(item), i)}]",
        )
        return history, new_input

    def _lower_input(self) -> Lowered:
        """The client's input in upstream form (`lower_input`), kept as ``new_input``."""

        def call_ids(kind: str) -> frozenset[str]:
            return frozenset(str(i.get("call_id")) for i in self.history if i.get("type") == kind)

        lowered = lower_input(
            self.input_items,
            self.resolved,
            known_calls=call_ids("function_call"),
            answered=call_ids("function_call_output"),
        )
        self.new_input = lowered.items
        return lowered

    async def _loop(self) -> None:
        """Round after round until `classify_round` says stop; then `_finish`."""
        while True:
            self.rounds += 1
            body = upstream_body(
                self.request,
                self.resolved.upstream_tools,
                drop_orphans(self.history + self.new_input + self.replay),
                self.rounds,
                keep_text=not self.history and not self.replay,
                tool_choice=self.tool_choice,
                later_tool_choice=self.later_tool_choice,
            )
            terminal, output = await self.upstream.call(body)
            self.usage = sum_usage(self.usage, terminal.get("usage"))
            decision, gateway_calls, approvals = self._decide(terminal, output)
            run: tuple[dict[str, Any], ...] = () if isinstance(decision, Done) else decision.run
            pending = approvals if isinstance(decision, RequiresClientAction) else []
            # gateway calls that neither run nor await approval (tool cap, upstream incomplete or
            # failed) are omitted: hidden from the client and never replayed without an output
            kept = {id(c) for c in (*run, *pending)}
            omitted = tuple(c for c in (*gateway_calls, *approvals) if id(c) not in kept)
            outcomes = await self._run_tools(run)
            self.tool_calls_used += len(run)
            await self.log.record_round(output, run, outcomes, omitted, pending)
            self.upstream.release()
            if isinstance(decision, Continue):
                continue
            if isinstance(decision, Incomplete) and decision.reason == "max_tool_calls":
                metrics.cap_hit("max_tool_calls", "incomplete")
            await self._finish(terminal, decision)
            return

    def _decide(
        self, terminal: dict[str, Any], output: list[dict[str, Any]]
    ) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
        """`classify_round` of a round's answer; returns the decision, the round's gateway calls
        and its calls that need approval. Raises `LoopLimitReached` (508) past ``max_infer_iters``."""
        seen = {
            i.get("call_id")
            for i in (*self.history, *self.new_input, *self.replay)
            if i.get("type") == "function_call"
        }
        gateway_calls, client_calls, approvals = split_calls(output, self.resolved, seen)
        left = None if self.max_tool_calls is None else max(0, self.max_tool_calls - self.tool_calls_used)
        details = terminal.get("incomplete_details")
        limit = self.ctx.limits.max_infer_iters
        decision = classify_round(
            RoundState(
                status=str(terminal.get("status") or "completed"),
                incomplete_reason=details.get("reason") if isinstance(details, dict) else None,
                gateway_calls=gateway_calls,
                client_calls=client_calls + approvals,
                tool_calls_left=left,
                inference_calls=self.rounds,
                max_infer_iters=limit,
            )
        )
        if isinstance(decision, LoopDetected):
            raise LoopLimitReached(
                f"the model still called gateway tools after {decision.inference_calls} inference calls "
                f"(max_infer_iters={limit}); raise max_infer_iters or change the "
                "prompt or tools so that the model can finish",
                calls=decision.inference_calls,
                limit=limit,
            )
        return decision, gateway_calls, approvals

    async def _run_tools(self, calls: Sequence[dict[str, Any]]) -> list[ToolOutcome]:
        """Run gateway calls (announced to a streamed client first) under keep-alives; marks the
        request as having run side effects unless every tool is retry-safe."""
        if not calls:
            return []
        if not all(self._retry_safe(call) for call in calls):
            self.ctx.hooks.tools_ran = True  # from now on a retry would run them (side effects) again
        settings = self.state.settings
        if self.stitcher is not None:
            for call in calls:
                await self.stitcher.announce_call(call)
        work = run_tool_calls(
            self.resolved,
            list(calls),
            ledger=self.ctx.ledger,
            timeout=settings.tools.timeout,
            concurrency=settings.tools.concurrency,
            max_result_bytes=settings.tools.max_result_bytes,
        )
        return await self.upstream.with_keepalive(work)

    def _retry_safe(self, call: dict[str, Any]) -> bool:
        """Whether running `call` again on a retry is harmless: its tool is annotated
        ``readOnlyHint`` or ``idempotentHint``."""
        tool = self.resolved.gateway_tool(str(call.get("name")))
        return tool is not None and tool.retry_safe

    async def _finish(self, terminal: dict[str, Any], decision: Any) -> None:
        """Answer once: the final response object charged, persisted, then sent (the terminal
        event, or the JSON body); a WebSocket turn keeps its continuation in connection memory."""
        final = final_response(
            terminal,
            response_id=self.response_id,
            request=self.request,
            items=self.items,
            store=self.ctx.store,
            restored=self.recorder.restored,
            usage=self.usage,
            incomplete=decision.reason if isinstance(decision, Incomplete) else None,
            created_at=self.ctx.created_at,
        )
        raw = dumps_checked(final)
        self.ctx.ledger.admit_terminal(raw)
        await self.client.flush()  # the last round's events do not wait for the store
        await self.recorder.finished(final)
        self._observe_rounds()
        if self.stitcher is not None:
            await self.stitcher.terminal(final)
        else:
            await self.client.answer_json(200, raw)
        if self.ctx.memory is not None and final.get("status") in ("completed", "incomplete"):
            # a WebSocket turn: kept for the next turn, which starts only once this one returns
            # (after its terminal event: the client does not wait for the copy)
            self.ctx.memory.remember(
                self.response_id, continuation_items(self.recorder.restored, self.input_items, self.replay)
            )
