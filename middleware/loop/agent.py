"""The agentic loop for a request that declares gateway-owned (MCP) tools (DESIGN.md §6).

`AgentLoop.run()` makes inference calls until `classify_round` says stop: it sends each round
upstream with the MCP tools exposed as function tools, runs the gateway-owned calls through
`middleware.tools.catalog.run_tool_calls` (timeouts, bounded fan-out, result cap, ledger charge), feeds
their outputs back, and answers once:

* buffered: one response object whose ``output`` holds the ``mcp_list_tools`` items, each round's
  visible items and an ``mcp_call`` item per executed gateway call (usage summed over rounds);
* streamed: one logical SSE stream (`StreamStitcher`) — one ``response.created`` and
  ``response.in_progress``, a stable gateway response id, ``sequence_number`` from 0,
  ``output_index`` offset by earlier rounds, gateway ``function_call`` events hidden and replaced by
  ``mcp_call`` lifecycle events, exactly one terminal event.

Within a round, the visible items keep their order and the round's ``mcp_call`` items follow them.
Failures are raised for the middleware to answer: `LoopDetected` becomes 508
``max_infer_iters_exceeded`` (or one SSE error frame after commit).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from budget import BudgetExceeded, ChargeModel, count_json_nodes
from middleware.asgi.client_stream import Outbox
from middleware.errors import GatewayError, InvalidRequest, redact
from middleware.loop.context import RequestContext
from middleware.loop.decision import (
    Continue,
    Done,
    Incomplete,
    LoopDetected,
    RequiresClientAction,
    RoundState,
    classify_round,
)
from middleware.ops import metrics
from middleware.state import GatewayState
from middleware.store.history import (
    Restored,
    approval_id,
    check_call_pairs,
    pending_approvals,
    restore_history,
)
from middleware.store.store import RESPONSE_STATUSES, StoredResponse
from middleware.tools.catalog import ResolvedTools, ToolOutcome, run_tool_calls
from middleware.upstream.httpx_client import UpstreamError, UpstreamResponse, upstream_status_error
from middleware.upstream.reader import (
    TERMINAL_EVENTS,
    StreamAccumulator,
    UpstreamEvent,
    invalid,
    read_response_object,
    read_stream_events,
)
from middleware.upstream.sse import encode_event

T = TypeVar("T")
LISTING_MODEL = ChargeModel.cpython()  # charges the MCP tool listings a request holds
log = logging.getLogger("loopwarden")
TERMINAL_STATUS = {
    "response.completed": "completed",
    "response.incomplete": "incomplete",
    "response.failed": "failed",
}
LIFECYCLE = frozenset({"response.created", "response.in_progress", "response.queued"})
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
ERROR_BODY_LIMIT = 64 * 1024


def new_id(prefix: str) -> str:
    """A fresh opaque id such as ``resp_<32 hex>``."""
    return f"{prefix}_{secrets.token_hex(16)}"


def upstream_error_event(obj: dict[str, Any]) -> GatewayError:
    """An in-band upstream ``error`` event as the §5 outcome (502, its code and message kept).

    Accepts the flat ``ResponseErrorEvent`` shape and the nested ``{"error": {...}}`` one; counts
    ``loopwarden_upstream_errors_total{kind="stream_error"}``.
    """
    metrics.UPSTREAM_ERRORS.labels(kind="stream_error").inc()
    raw_nested = obj.get("error")
    nested: dict[str, Any] = raw_nested if isinstance(raw_nested, dict) else {}
    message = obj.get("message") or nested.get("message") or "upstream reported an error"
    code = obj.get("code") or nested.get("code") or nested.get("type") or "upstream_error"
    return GatewayError(redact(str(message))[:4000], status=502, code=str(code)[:200])


async def read_limited(response: UpstreamResponse, limit: int = ERROR_BODY_LIMIT) -> bytes:
    """At most `limit` bytes of an upstream body (for error envelopes)."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.chunks():
        parts.append(chunk[: limit - size])
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)


def sum_usage(total: dict[str, Any] | None, usage: Any) -> dict[str, Any] | None:
    """Add one round's ``usage`` object into `total` (integers summed, nested details too)."""
    if not isinstance(usage, dict):
        return total
    out: dict[str, Any] = dict(total or {})
    for key, value in usage.items():
        if isinstance(value, int) and not isinstance(value, bool):
            prior = out.get(key)
            out[key] = (prior if isinstance(prior, int) else 0) + value
        elif isinstance(value, dict):
            prior_dict = out.get(key)
            out[key] = sum_usage(prior_dict if isinstance(prior_dict, dict) else None, value)
        elif key not in out:
            out[key] = value
    return out


def _epoch(value: Any) -> int:
    """An upstream ``created_at`` as epoch seconds (now when it is missing or not a sane number)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e11:
        return int(value)
    return int(time.time())


def as_input_items(value: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as a list of items (a string becomes one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, dict)]
    return []


SECRET_TOOL_FIELDS = ("headers", "authorization")


def public_tools(tools: Any) -> list[Any]:
    """The request's ``tools`` as echoed in a response: MCP ``headers`` / ``authorization`` are
    secrets sent to that server only, so they are shown as null (DESIGN.md §6)."""
    if not isinstance(tools, list):
        return []
    out: list[Any] = []
    for tool in tools:
        if (
            isinstance(tool, dict)
            and tool.get("type") == "mcp"
            and any(k in tool for k in SECRET_TOOL_FIELDS)
        ):
            tool = {k: (None if k in SECRET_TOOL_FIELDS else v) for k, v in tool.items()}
        out.append(tool)
    return out


def call_arguments(call: dict[str, Any]) -> str:
    """A call's ``arguments`` as re-emitted to the client: valid JSON text (``"{}"`` for a
    parameterless call whose upstream sent ``""`` or null, case B07)."""
    arguments = call.get("arguments")
    return arguments if isinstance(arguments, str) and arguments.strip() else "{}"


def mcp_call_item(
    call: dict[str, Any], outcome: ToolOutcome, server_label: str, name: str, item_id: str
) -> dict[str, Any]:
    """The client-visible ``mcp_call`` item of an executed gateway call."""
    item: dict[str, Any] = {
        "type": "mcp_call",
        "id": item_id,
        "server_label": server_label,
        "name": name,
        "arguments": call_arguments(call),
        "output": outcome.output if outcome.error is None else None,
        "error": None,
        "status": "completed" if outcome.error is None else "failed",
    }
    if outcome.error is not None:
        item["error"] = {
            "type": "mcp_tool_execution_error",
            "content": [{"type": "text", "text": outcome.output}],
        }
    return item


class AgentLoop:
    """The rounds of one request whose tools include gateway-owned MCP tools.

    ``state``: process state (settings, upstream client); ``ctx``: the admitted request;
    ``send``: the ASGI send (wrapped by the middleware) behind an `Outbox` that coalesces SSE
    frames; ``resolved``: the request's tools.
    """

    def __init__(
        self, state: GatewayState, ctx: RequestContext, send: Outbox, resolved: ResolvedTools
    ) -> None:
        self.state = state
        self.ctx = ctx
        self.send = send
        self.resolved = resolved
        self.response_id = new_id("resp")
        self.request = ctx.request
        self.input_items = as_input_items(self.request.get("input"))  # as the client sent them
        self.new_input = [i for i in self.input_items if i.get("type") != "mcp_approval_response"]
        self.history: list[dict[str, Any]] = []  # restored from the store, sent before the new input
        self.restored = Restored([])
        self.replay: list[dict[str, Any]] = []  # this request's items, appended to the input upstream
        self.items: list[dict[str, Any]] = list(resolved.list_items)  # what the client sees
        self.usage: dict[str, Any] | None = None
        self.tool_calls_used = 0
        max_tool_calls = self.request.get("max_tool_calls")
        # validate_request allows integral floats (2.0): honour them as the integer they are
        self.max_tool_calls: int | None = (
            int(max_tool_calls) if isinstance(max_tool_calls, int | float) else None
        )
        self.stitcher = StreamStitcher(self) if ctx.stream else None
        self.persisted = False
        self.rounds_observed = False
        self._round_acc: StreamAccumulator | None = None
        self._round_charge = 0

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the request: prepare (history, approvals), loop the rounds, answer once.

        Raises `GatewayError` (508 loop detected, 400/404/413 history problems, 502 upstream
        problems), `budget.BudgetExceeded` / `PoolExhausted`, or `UpstreamError` for the
        middleware to answer; the response's true status is stored first when the store is on.
        """
        try:
            await self._prepare()
            await self._loop()
        except asyncio.CancelledError:
            reason = self.ctx.cancel_reason
            if isinstance(reason, GatewayError):  # ended by the gateway (deadline, drain), not the client
                await self._persist_failure("failed", {"code": reason.code, "message": reason.message})
            else:
                await self._persist_failure("cancelled", None)
            raise
        except GatewayError as error:
            await self._persist_failure("failed", {"code": error.code, "message": error.message})
            raise
        except BudgetExceeded as exc:
            await self._persist_failure(
                "failed", {"code": "max_retained_bytes_exceeded", "message": str(exc)}
            )
            raise
        except UpstreamError as exc:
            await self._persist_failure("failed", {"code": exc.code, "message": exc.message})
            raise
        finally:
            self._observe_rounds()

    def _observe_rounds(self) -> None:
        """``loopwarden_inference_rounds`` once per request (before the final bytes when it can)."""
        if not self.rounds_observed:
            self.rounds_observed = True
            metrics.INFERENCE_ROUNDS.observe(self.ctx.rounds)

    async def _prepare(self) -> None:
        """Charge the tool lists, restore stored history, check call pairing, and settle answered
        approvals (B03, B05)."""
        if self.resolved.list_items:
            # What tools/list brought in is held (as parsed objects) for every round. It is charged
            # at the calibrated CPython rates (sound: budget tests measure them with tracemalloc),
            # not the reference multipliers, which would price an ordinary 8-tool server out of a
            # 1 MiB request; a 3000-tool listing is still refused before any upstream call.
            listed = json.dumps(self.resolved.list_items, separators=(",", ":")).encode()
            charge = LISTING_MODEL.accumulated_charge(len(listed), count_json_nodes(listed), self.ctx.store)
            try:
                self.ctx.ledger.reserve(charge)
            except BudgetExceeded as exc:
                raise BudgetExceeded("accumulated", exc.requested, exc.charged, exc.limit) from None
        store = self.state.store
        if store is not None:
            self.restored = await restore_history(self.request, store, self.ctx.owner, self.ctx.ledger)
            self.history = self.restored.items
        elif (
            self.request.get("previous_response_id") is not None
            or self.request.get("conversation") is not None
        ):
            raise InvalidRequest(
                "this gateway runs without a store: previous_response_id and conversation are unavailable",
                code="invalid_request",
                param="previous_response_id",
            )
        approvals = pending_approvals(self.history, self.input_items)
        check_call_pairs(self.history, self.new_input, {str(call.get("call_id")) for call, _ in approvals})
        for call, _ in approvals:
            if self.resolved.gateway_tool(str(call.get("name"))) is None:
                raise InvalidRequest(
                    f"the approved call {call.get('call_id')!r} is for tool {str(call.get('name'))[:100]!r}, which this "
                    "request's tools do not declare; resend the mcp tool with the approval",
                    code="invalid_value",
                    param="tools",
                )
        approved = [call for call, answer in approvals if answer.get("approve") is True]
        if self.max_tool_calls is not None and len(approved) > self.max_tool_calls:
            raise InvalidRequest(
                f"{len(approved)} approved tool calls exceed this request's max_tool_calls={self.max_tool_calls}; "
                "approve fewer calls or raise max_tool_calls",
                code="invalid_value",
                param="max_tool_calls",
            )
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
                item_id = self.stitcher.call_ids.get(id(call)) if self.stitcher is not None else None
                item = mcp_call_item(call, outcome, label, name, item_id or new_id("mcp"))
                item["approval_request_id"] = answer.get("approval_request_id")
                self.items.append(item)
                if self.stitcher is not None:
                    await self.stitcher.finish_call(call, item)
                text = outcome.output
            else:
                reason = answer.get("reason")
                text = (
                    "<the user denied this tool call"
                    + (f": {reason}" if isinstance(reason, str) and reason else "")
                    + ">"
                )
            self.replay.append(
                {"type": "function_call_output", "call_id": call.get("call_id"), "output": text}
            )

    async def _loop(self) -> None:
        while True:
            self.ctx.rounds += 1
            terminal, output = await self._round(self._upstream_body())
            self.usage = sum_usage(self.usage, terminal.get("usage"))
            gateway_calls, client_calls, approvals = self._split_calls(output)
            left = None if self.max_tool_calls is None else max(0, self.max_tool_calls - self.tool_calls_used)
            details = terminal.get("incomplete_details")
            decision = classify_round(
                RoundState(
                    status=str(terminal.get("status") or "completed"),
                    incomplete_reason=details.get("reason") if isinstance(details, dict) else None,
                    gateway_calls=gateway_calls,
                    client_calls=client_calls + approvals,
                    tool_calls_left=left,
                    inference_calls=self.ctx.rounds,
                    max_infer_iters=self.ctx.limits.max_infer_iters,
                )
            )
            if isinstance(decision, LoopDetected):
                raise GatewayError(
                    f"the model still called gateway tools after {decision.inference_calls} inference calls "
                    f"(max_infer_iters={self.ctx.limits.max_infer_iters}); raise max_infer_iters or change the "
                    "prompt or tools so that the model can finish",
                    status=508,
                    code="max_infer_iters_exceeded",
                    retryable=False,
                    limit="max_infer_iters",
                )
            run: tuple[dict[str, Any], ...] = () if isinstance(decision, Done) else decision.run
            pending_ids = {id(c) for c in approvals} if isinstance(decision, RequiresClientAction) else set()
            ran_ids = {id(c) for c in run}
            # gateway calls that neither run nor await approval (tool cap, upstream incomplete or
            # failed) are omitted: hidden from the client and never replayed without an output
            omitted = tuple(
                c for c in (*gateway_calls, *approvals) if id(c) not in ran_ids and id(c) not in pending_ids
            )
            outcomes = await self._run_tools(run)
            self.tool_calls_used += len(run)
            pending = approvals if isinstance(decision, RequiresClientAction) else []
            await self._record_round(output, run, outcomes, omitted, pending)
            self._release_round()
            if isinstance(decision, Continue):
                continue
            if isinstance(decision, Incomplete) and decision.reason == "max_tool_calls":
                metrics.CAP_HITS.labels(limit="max_tool_calls", outcome="incomplete").inc()
            await self._finish(terminal, decision)
            return

    def _release_round(self) -> None:
        """Release what held the round's answer (its items are charged as kept state now)."""
        if self._round_acc is not None:
            self._round_acc.release_all()
            self._round_acc = None
        if self._round_charge:
            self.ctx.ledger.release(self._round_charge)
            self._round_charge = 0

    def _split_calls(
        self, output: Sequence[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        """(gateway calls that may run, client-owned calls, gateway calls awaiting approval)."""
        gateway: list[dict[str, Any]] = []
        client: list[dict[str, Any]] = []
        approvals: list[dict[str, Any]] = []
        seen = {
            i.get("call_id")
            for i in (*self.history, *self.new_input, *self.replay)
            if i.get("type") == "function_call"
        }
        for item in output:
            if item.get("type") == "function_call":
                call_id, name = item.get("call_id"), item.get("name")
                if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
                    raise invalid("upstream returned a function_call without a string call_id and name")
                if call_id in seen:
                    raise invalid(f"upstream returned a duplicate call_id {call_id[:100]!r}")
                seen.add(call_id)
            if item.get("type") != "function_call":
                if item.get("type") in (
                    "custom_tool_call",
                    "computer_call",
                    "local_shell_call",
                    "shell_call",
                ):
                    client.append(item)
                continue
            tool = self.resolved.gateway_tool(str(item.get("name")))
            if tool is None:
                client.append(item)
            elif tool.require_approval:
                approvals.append(item)
            else:
                gateway.append(item)
        return gateway, client, approvals

    def _upstream_body(self) -> bytes:
        body = dict(self.request)
        if "tools" in body or self.resolved.upstream_tools:
            body["tools"] = self.resolved.upstream_tools
        raw_input = self.request.get("input")
        if isinstance(raw_input, str) and not self.history and not self.replay:
            body["input"] = raw_input  # nothing to add: keep the client's own form
        else:
            body["input"] = self.history + self.new_input + self.replay
        body["store"] = False  # the gateway owns the history (DESIGN.md §6)
        for field in ("max_tool_calls", "previous_response_id", "conversation"):
            body.pop(field, None)
        include = body.get("include")
        include = list(include) if isinstance(include, list) else []
        if "reasoning.encrypted_content" not in include:
            include.append("reasoning.encrypted_content")
        body["include"] = include
        if self.ctx.rounds > 1:
            body["tool_choice"] = "auto"
        return json.dumps(body, separators=(",", ":")).encode()

    async def _run_tools(self, calls: Sequence[dict[str, Any]]) -> list[ToolOutcome]:
        if not calls:
            return []
        settings = self.state.settings
        if self.stitcher is not None:
            for call in calls:
                await self.stitcher.announce_call(call)
        work = run_tool_calls(
            self.resolved,
            list(calls),
            ledger=self.ctx.ledger,
            timeout=settings.tool_timeout,
            concurrency=settings.tool_concurrency,
            max_result_bytes=settings.tool_max_result_bytes,
        )
        return await self._with_keepalive(work)

    async def _with_keepalive(self, work: Awaitable[T]) -> T:
        await self.send.flush()  # what is buffered reaches the client before the wait
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.state.settings.keepalive_interval)
                if done:
                    return task.result()
                await self.send.keepalive()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _record_round(
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
                outcome = ran[id(item)]
                self.replay.append(item)
                self.replay.append(
                    {"type": "function_call_output", "call_id": item.get("call_id"), "output": outcome.output}
                )
                calls.append(item)
            elif id(item) in pending:
                self.replay.append(item)  # answered by a later request's mcp_approval_response
            elif id(item) in skipped:
                continue
            else:
                self.replay.append(item)
                self.items.append(item)
        self.ctx.ledger.admit_accumulated(json.dumps(self.replay[start:], separators=(",", ":")).encode())
        for call in calls:
            outcome = ran[id(call)]
            tool = self.resolved.gateway_tool(str(call.get("name")))
            assert tool is not None
            item_id = self.stitcher.call_ids.get(id(call)) if self.stitcher is not None else None
            item = mcp_call_item(call, outcome, tool.server_label, tool.name, item_id or new_id("mcp"))
            self.items.append(item)
            if self.stitcher is not None:
                await self.stitcher.finish_call(call, item)
        for call in approvals:
            tool = self.resolved.gateway_tool(str(call.get("name")))
            assert tool is not None
            request = {
                "type": "mcp_approval_request",
                "id": approval_id(str(call.get("call_id"))),
                "server_label": tool.server_label,
                "name": tool.name,
                "arguments": call_arguments(call),
            }
            self.items.append(request)
            if self.stitcher is not None:
                await self.stitcher.add_item(request)

    def _final_response(self, terminal: dict[str, Any], decision: Any) -> dict[str, Any]:
        final = dict(terminal)
        final["id"] = self.response_id
        final["object"] = "response"
        final["output"] = self.items
        final["tools"] = public_tools(self.request.get("tools"))
        final["tool_choice"] = self.request.get("tool_choice", "auto")
        final["store"] = self.ctx.store
        final["previous_response_id"] = self.restored.previous_response_id
        if self.restored.conversation_id is not None:
            final["conversation"] = {"id": self.restored.conversation_id}
        if self.usage is not None:
            final["usage"] = self.usage
        if isinstance(decision, Incomplete):
            final["status"] = "incomplete"
            final["incomplete_details"] = {"reason": decision.reason}
        elif final.get("status") in (None, "in_progress"):
            final["status"] = "completed"
        return final

    async def _persist(self, response: dict[str, Any]) -> None:
        """Store the response (one transaction) when the request has ``store`` on."""
        store = self.state.store
        if store is None or not self.ctx.store:
            return
        status = str(response.get("status") or "completed")
        params = {k: v for k, v in self.request.items() if k not in ("input", "stream")}
        await store.save_response(
            StoredResponse(
                id=self.response_id,
                owner=self.ctx.owner,
                created_at=_epoch(response.get("created_at")),
                status=status if status in RESPONSE_STATUSES else "completed",
                model=str(self.request.get("model")),
                previous_response_id=self.restored.previous_response_id,
                conversation_id=self.restored.conversation_id,
                response=response,
                request=params,
            ),
            input_items=self.input_items,
            output_items=self.items,
            replay_items=self.replay,
        )

    async def _persist_checked(self, response: dict[str, Any]) -> None:
        """`_persist`, but a response the store cannot encode (NaN, huge numbers from an upstream)
        is logged and not stored, rather than failing a request that otherwise succeeded."""
        try:
            await self._persist(response)
        except (ValueError, OverflowError) as exc:
            log.warning("response %s was not stored: %s", self.response_id, exc)

    async def _persist_failure(self, status: str, error: dict[str, Any] | None) -> None:
        """Store the true status of a request that failed or whose client went away (best effort)."""
        if self.persisted:
            return
        self.persisted = True
        response = {
            "id": self.response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "error": error,
            "model": self.request.get("model"),
            "output": self.items,
            "tools": public_tools(self.request.get("tools")),
            "previous_response_id": self.restored.previous_response_id,
        }
        try:
            await asyncio.shield(self._persist_checked(response))
        except Exception:
            log.exception("could not store the %s status of response %s", status, self.response_id)

    async def _finish(self, terminal: dict[str, Any], decision: Any) -> None:
        final = self._final_response(terminal, decision)
        raw = json.dumps(final, separators=(",", ":")).encode()
        self.ctx.ledger.admit_terminal(raw)
        self.persisted = True
        await self.send.flush()  # the last round's events do not wait for the store
        await self._persist_checked(final)
        self._observe_rounds()
        if self.stitcher is not None:
            await self.stitcher.terminal(final)
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.send({"type": "http.response.body", "body": raw})

    # -- one round -------------------------------------------------------------------------
    async def _round(self, body: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        upstream = self.state.upstream_for(self.ctx.route)
        response = await self._with_keepalive(upstream.post("/responses", body, stream=self.ctx.stream))
        try:
            if response.status_code >= 400:
                raise upstream_status_error(response.status_code, await read_limited(response))
            if response.headers.get("content-type", "").lower().startswith("text/event-stream"):
                return await self._round_stream(response)
            return await self._round_buffered(response)
        finally:
            await response.aclose()

    async def _round_buffered(
        self, response: UpstreamResponse
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        answer = await read_response_object(response, self.ctx.ledger)
        parsed, items = answer.parsed, answer.items
        self._round_charge = answer.charge  # released once the round's kept items are recorded
        if self.stitcher is not None:  # a buffered answer to a streamed round: replay it as events
            await self.stitcher.synthesize(parsed, items)
        return parsed, items

    async def _round_stream(self, response: UpstreamResponse) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        acc = StreamAccumulator(self.ctx.ledger)
        events = read_stream_events(
            response,
            self.ctx.ledger,
            keepalive=self.send.keepalive,
            keepalive_interval=self.state.settings.keepalive_interval,
            idle=self.send.flush,
            last_sent=self.send.last_sent,
        )
        async for event in events:
            if event.type == "error":
                raise upstream_error_event(event.obj)
            acc.apply(event)
            if self.stitcher is not None:
                await self.stitcher.forward(event)
            if event.type in TERMINAL_EVENTS:
                break
        if acc.terminal is None:
            raise GatewayError(
                "upstream stream ended without a terminal event", status=502, code="upstream_incomplete"
            )
        # The terminal event's type is the round's status: a response.failed / .incomplete never
        # runs tools, whatever its "status" field says (DESIGN.md §6).
        status = TERMINAL_STATUS[acc.terminal_type or "response.completed"]
        terminal, output = {**acc.terminal, "status": status}, acc.output()
        self._round_acc = acc  # released once the round's kept items are recorded
        return terminal, output


class StreamStitcher:
    """Turns the SSE events of every round into one logical client stream (DESIGN.md §6)."""

    def __init__(self, loop: AgentLoop) -> None:
        self.loop = loop
        self.ctx = loop.ctx
        self.next_index = 0
        self.created = False  # response.created sent
        self.started = False  # the first round's lifecycle events are through; mcp_list_tools sent
        self.listed = False
        self.round_map: dict[int, int | None] = {}  # upstream output_index -> client index (None: hidden)
        self.call_ids: dict[int, str] = {}  # id(function_call item) -> mcp_call item id
        self.call_index: dict[int, int] = {}

    async def _emit(self, event_type: str, obj: dict[str, Any]) -> None:
        if not self.ctx.committed:
            await self.loop.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        obj["sequence_number"] = self.ctx.next_sequence
        self.ctx.next_sequence += 1
        data = json.dumps(obj, separators=(",", ":")).encode()
        await self.loop.send(
            {"type": "http.response.body", "body": encode_event(event_type, data), "more_body": True}
        )

    def _public_response(self, response: dict[str, Any]) -> dict[str, Any]:
        public = dict(response)
        public["id"] = self.loop.response_id
        public["tools"] = public_tools(self.loop.request.get("tools"))
        public["tool_choice"] = self.loop.request.get("tool_choice", "auto")
        return public

    async def _list_tools(self) -> None:
        if self.listed:
            return
        self.listed = True
        for item in self.loop.resolved.list_items:
            index = self.next_index
            self.next_index += 1
            await self._item_event("response.output_item.added", index, item)
            for kind in ("response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed"):
                await self._emit(kind, {"type": kind, "output_index": index, "item_id": item["id"]})
            await self._item_event("response.output_item.done", index, item)

    async def ensure_started(self) -> None:
        """Open the client stream before any upstream event (work done ahead of the first round)."""
        if not self.started:
            response = {
                "id": self.loop.response_id,
                "object": "response",
                "model": self.loop.request.get("model"),
            }
            await self._start(response)
            self.started = True
            await self._emit(
                "response.in_progress",
                {
                    "type": "response.in_progress",
                    "response": {**self._public_response(response), "status": "in_progress", "output": []},
                },
            )
            await self._list_tools()

    async def _start(self, response: dict[str, Any]) -> None:
        if not self.created:
            self.created = True
            created = {**self._public_response(response), "status": "in_progress", "output": []}
            await self._emit("response.created", {"type": "response.created", "response": created})

    async def forward(self, event: UpstreamEvent) -> None:
        """Forward, rewrite or hide one upstream event of the current round (terminal events are held)."""
        obj = event.obj
        raw_response = obj.get("response")
        response: dict[str, Any] = raw_response if isinstance(raw_response, dict) else {}
        if event.type in LIFECYCLE:
            if self.started:
                return  # later rounds: one response.created / in_progress per client request
            if event.type == "response.created":
                await self._start(response)
                return
            await self._start(response)
            obj["response"] = self._public_response(response)
            await self._emit(event.type, obj)
            if event.type == "response.in_progress":
                self.started = True
                await self._list_tools()
            return
        if event.type in TERMINAL_EVENTS:
            self.round_map = {}
            await self.ensure_started()  # an upstream that sent nothing before its terminal event
            return
        if not self.started:
            await self._start(response)
            self.started = True
            await self._list_tools()
        index = obj.get("output_index")
        if event.type == "response.output_item.added" and isinstance(index, int):
            item = obj.get("item")
            hidden = (
                isinstance(item, dict)
                and item.get("type") == "function_call"
                and self.loop.resolved.gateway_tool(str(item.get("name"))) is not None
            )
            if hidden:
                self.round_map[index] = None
                return
            self.round_map[index] = self.next_index
            self.next_index += 1
        changed = event.changed
        if isinstance(index, int):
            if index not in self.round_map:  # an upstream that skipped output_item.added
                self.round_map[index] = self.next_index
                self.next_index += 1
            mapped = self.round_map[index]
            if mapped is None:
                return
            if mapped != index:
                obj["output_index"] = mapped
                changed = True
        if isinstance(obj.get("response"), dict):
            obj["response"] = self._public_response(obj["response"])
            changed = True
        sequence = obj.get("sequence_number")
        if not changed and type(sequence) is int and sequence == self.ctx.next_sequence:
            # nothing to rewrite (most deltas of a first round): the upstream's bytes go out as they are
            if not self.ctx.committed:
                await self.loop.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            self.ctx.next_sequence += 1
            await self.loop.send(
                {
                    "type": "http.response.body",
                    "body": encode_event(event.type, event.data),
                    "more_body": True,
                }
            )
            return
        await self._emit(event.type, obj)

    async def synthesize(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Emit events for a buffered upstream answer (a server that ignored ``stream``)."""
        if not self.started:
            await self._start(response)
            self.started = True
            await self._list_tools()
        for item in items:
            if (
                item.get("type") == "function_call"
                and self.loop.resolved.gateway_tool(str(item.get("name"))) is not None
            ):
                continue
            await self.add_item(item)

    async def _item_event(self, kind: str, index: int, item: dict[str, Any]) -> None:
        """``response.output_item.added`` / ``.done`` for `item` at client `index`."""
        await self._emit(kind, {"type": kind, "output_index": index, "item": item})

    async def add_item(self, item: dict[str, Any]) -> None:
        """A complete item (an approval request, an item of a buffered answer): added and done."""
        index = self.next_index
        self.next_index += 1
        await self._item_event("response.output_item.added", index, item)
        await self._item_event("response.output_item.done", index, item)

    async def announce_call(self, call: dict[str, Any]) -> None:
        """An ``mcp_call`` item is added (in progress) for a gateway call about to run."""
        await self.ensure_started()
        tool = self.loop.resolved.gateway_tool(str(call.get("name")))
        assert tool is not None
        item_id = new_id("mcp")
        index = self.next_index
        self.next_index += 1
        self.call_ids[id(call)] = item_id
        self.call_index[id(call)] = index
        item = {
            "type": "mcp_call",
            "id": item_id,
            "server_label": tool.server_label,
            "name": tool.name,
            "arguments": call_arguments(call),
            "status": "in_progress",
        }
        await self._item_event("response.output_item.added", index, item)
        await self._emit(
            "response.mcp_call.in_progress",
            {"type": "response.mcp_call.in_progress", "output_index": index, "item_id": item_id},
        )

    async def finish_call(self, call: dict[str, Any], item: dict[str, Any]) -> None:
        """The ``mcp_call`` of an executed gateway call completes (or fails)."""
        index = self.call_index[id(call)]
        kind = "response.mcp_call.completed" if item["status"] == "completed" else "response.mcp_call.failed"
        await self._emit(kind, {"type": kind, "output_index": index, "item_id": item["id"]})
        await self._item_event("response.output_item.done", index, item)

    async def terminal(self, final: dict[str, Any]) -> None:
        """The one terminal event, then the end of the stream."""
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
            str(final.get("status")), "response.completed"
        )
        await self._emit(kind, {"type": kind, "response": final})
        await self.loop.send({"type": "http.response.body", "body": b"", "more_body": False})
