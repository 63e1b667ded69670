"""`Passthrough`: one stateless round with nothing for the gateway to rewrite.

A request without MCP tools, with ``store: false`` and no ``previous_response_id`` /
``conversation``, goes upstream as the client sent it (mirroring its ``stream`` flag). Its answer
is charged under the ledger (`middleware.upstream.reader`) and forwarded: a stream event by event
(renumbered by the `ClientStream` only where the upstream's numbers differ), a buffered body as it
came. A server that answers a streamed call buffered gets its answer replayed as events; an SSE
answer to a buffered call is aggregated. Failures are raised for the guard to settle.
"""

from __future__ import annotations

import functools
import re
from operator import is_not
from typing import Any, Final

from budget import JsonFeatures, json_features
from middleware.loop.context import RequestContext
from middleware.loop.echo import normalise_response
from middleware.loop.items import response_summary, synthesized_events
from middleware.ops import metrics
from middleware.state import GatewayState
from middleware.upstream.chat.client import bind_ledger
from middleware.upstream.errors import read_limited, status_failure
from middleware.upstream.protocol import UpstreamResponse
from middleware.upstream.reader import (
    LIFECYCLE_EVENTS,
    TERMINAL_EVENTS,
    StreamAccumulator,
    UpstreamEvent,
    dumps_checked,
    no_terminal_event,
    read_response_object,
    read_round,
)

#: The events whose response object is normalised: lifecycle and terminal (DESIGN.md §5).
NORMALISED_EVENTS = LIFECYCLE_EVENTS | TERMINAL_EVENTS


def _added_members(parsed: dict[str, Any], before: dict[str, Any]) -> dict[str, Any] | None:
    """The members `normalise_response` added to ``parsed`` (its keys past ``before``'s, the
    object as the upstream sent it, in ``parsed``'s order; {} when none), or None when it
    replaced one the upstream sent (a wrong type, a null the spec forbids) or the upstream's keys
    do not come first, unchanged: then only re-encoding the object answers it."""
    if any(map(is_not, map(parsed.__getitem__, before), before.values())):
        return None
    # normalise_response only adds members (at the end, in order) and replaces values: the keys
    # past the upstream's are the added ones (checked: the upstream's keys come first, unchanged)
    keys = list(parsed)
    if keys[: len(before)] != list(before):
        return None
    return {key: parsed[key] for key in keys[len(before) :]}


def splice_members(
    body: bytes, features: JsonFeatures | None, parsed: dict[str, Any], before: dict[str, Any]
) -> tuple[bytes, JsonFeatures | None] | None:
    """The answer to a buffered pass-through round whose response object `normalise_response`
    only added members to: the upstream's own bytes `body` with the added members (``parsed``'s
    keys not in ``before``, the object as the upstream sent it, in ``parsed``'s order) encoded and
    inserted before the closing brace — the same object as re-encoding ``parsed``, at the cost of
    encoding and counting the few added members instead of the whole response. The features
    (`budget.JsonFeatures` of `body`, None under the reference model) come with it: the body's
    combined with the inserted members' (sound: every byte of the answer is counted in one of
    them). None when a member the upstream sent was replaced (`_added_members`).

    A key missing from ``parsed`` is missing from `body` (its decoded keys are ``parsed``'s), so
    the insertion never repeats one; `body` is a non-empty JSON object (it has ``output``). A body
    in another encoding than UTF-8 is refused before this (`read_response_object`)."""
    members = _added_members(parsed, before)
    if members is None:
        return None
    if not members:
        return body, features
    head = body.rstrip(_WHITESPACE)
    if not head.endswith(b"}") or not before:
        return None
    added = dumps_checked(members)
    spliced = head[:-1] + b"," + added[1:]
    if features is not None:
        features = features.combine(_added_features(added) if len(added) <= _CACHED else json_features(added))
    return spliced, features


#: The features of the members `splice_members` inserts, by their bytes (a pure function of
#: them): the echo defaults a route's upstream leaves out are mostly the same from one request to
#: the next, and counting ~200 bytes costs ~7 µs. Texts up to `_CACHED` bytes, `maxsize` of
#: them: at most ~100 KB held by the process (measured: 97 KB with every entry 1 KB).
_CACHED: Final = 1024
_added_features: Final = functools.lru_cache(maxsize=64)(json_features)


#: JSON's insignificant whitespace (RFC 8259 §2).
_WHITESPACE: Final = b" \t\r\n"
#: The end of an event object whose last member is ``"sequence_number"`` (written so, an integer)
#: and whose member before it ends with ``}``: the match starts at that brace (OpenAI writes a
#: lifecycle event as ``{"type":..,"response":{..},"sequence_number":N}``). The ``"`` before
#: ``sequence_number`` follows ``,`` or whitespace, so it opens a string: the last key's token.
_SEQUENCE_LAST: Final = re.compile(
    rb'\}[ \t\r\n]*,[ \t\r\n]*"sequence_number"[ \t\r\n]*:[ \t\r\n]*-?[0-9]+[ \t\r\n]*\}[ \t\r\n]*\Z'
)


def splice_event_response(
    data: bytes, event: dict[str, Any], response: dict[str, Any], before: dict[str, Any]
) -> bytes | None:
    """A lifecycle or terminal event's upstream ``data:`` bytes (`data`, decoded: `event`) with
    the members `normalise_response` added to its ``response`` object (`response`; ``before``: as
    the upstream sent it) inserted before that object's closing brace: the same event as
    re-encoding `event`, at the cost of encoding the added members instead of the response and its
    output (issue 21: vLLM and other upstreams leave echo fields out of every lifecycle event).

    The brace is found where it provably is: ``response`` is the event's last member (the brace
    is the last but one), or the last but one before an integer ``sequence_number``
    (`_SEQUENCE_LAST`); `event`'s keys are in the order of the text (one token each: a repeated
    key was refused). None when it is anywhere else, the object was empty or a member was
    replaced (`_added_members`): the caller re-encodes. `data` is UTF-8 (`loads_upstream`)."""
    members = _added_members(response, before)
    if members is None or not before:
        return None
    if not members:
        return data
    text = data.rstrip(_WHITESPACE)
    keys = list(event)
    if keys[-1] == "response":
        inner = text[:-1].rstrip(_WHITESPACE)
        if not (text.endswith(b"}") and inner.endswith(b"}")):
            return None
        brace = len(inner) - 1
    elif keys[-2:] == ["response", "sequence_number"]:
        last = _SEQUENCE_LAST.search(text)
        if last is None:
            return None
        brace = last.start()
    else:
        return None
    return data[:brace] + b"," + dumps_checked(members)[1:-1] + data[brace:]


class Passthrough:
    """The pass-through round of one request (see the module docstring)."""

    def __init__(self, state: GatewayState, ctx: RequestContext) -> None:
        self.state = state
        self.ctx = ctx
        self.client = ctx.client
        self._created: dict[str, Any] | None = None  # the upstream's response.created object
        self._opened = False  # response.created was seen

    async def run(self) -> None:
        """Make the one inference call and answer it; raises failures for the guard."""
        upstream = self.state.upstream_for(self.ctx.route)
        metrics.INFERENCE_ROUNDS.observe(1)  # the pass-through path makes exactly one inference call
        with bind_ledger(self.ctx.ledger):  # a Chat upstream's translation is charged to this request
            response = await upstream.post("/responses", self.ctx.raw, stream=self.ctx.stream)
            await self._answer(response)

    async def _answer(self, response: UpstreamResponse) -> None:
        """Answer the client from the upstream's answer, then close it."""
        try:
            if response.status_code >= 400:
                raise status_failure(response.status_code, await read_limited(response), response.headers)
            is_sse = response.headers.get("content-type", "").lower().startswith("text/event-stream")
            if self.ctx.stream and is_sse:
                await self._forward_stream(response)
            elif is_sse:
                final = await self._aggregate_stream(response)
                await self._answer_json(dumps_checked(final))
            else:
                await self._buffered(response)
        finally:
            await response.aclose()

    async def _buffered(self, response: UpstreamResponse) -> None:
        """A buffered upstream answer (its body's charge held to the end: nothing is kept past the
        answer, `read_response_object` with ``keep_items=False``): normalised
        (`normalise_response`), then answered as JSON —
        the upstream's own bytes when nothing was missing, else the re-encoded object, whose
        reference to the upstream's bytes is dropped first so one encoding is alive and charged
        (`admit_terminal`) — or replayed as events to a streamed call."""
        answer = await read_response_object(response, self.ctx.ledger, keep_items=False)
        parsed, items, body, features = answer.parsed, answer.items, answer.body, answer.features
        del answer
        before = dict(parsed)  # the upstream's members (shallow: the values are shared)
        changed = normalise_response(parsed, self.ctx.request, created_at=self.ctx.created_at)
        if self.ctx.stream:  # a server that ignored "stream": the client still gets SSE
            del body, before
            await self._synthesize_stream(parsed, items)
            return
        if changed:
            spliced = splice_members(body, features, parsed, before)
            del body, before
            body, features = spliced if spliced is not None else (dumps_checked(parsed), None)
        await self._answer_json(body, features)  # unchanged: the features counted as it was read

    async def _synthesize_stream(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        for kind, payload in synthesized_events(response, items):
            await self.client.event(kind, {"type": kind, **payload})
        await self.client.end()

    async def _answer_json(self, raw: bytes, features: JsonFeatures | None = None) -> None:
        self.ctx.ledger.admit_terminal(raw, features=features)
        await self.client.answer_json(200, raw)

    async def _aggregate_stream(self, response: UpstreamResponse) -> dict[str, Any]:
        acc = StreamAccumulator(self.ctx.ledger)
        await read_round(response, self.ctx.ledger, client=self.client, acc=acc)
        if acc.terminal is None:  # a terminal event without a response object
            raise no_terminal_event()
        final = dict(acc.terminal)
        final["output"] = acc.output()
        normalise_response(final, self.ctx.request, created_at=self.ctx.created_at)
        return final

    def _snapshot(self) -> dict[str, Any]:
        """The response so far for a failure after commit: the upstream's created object's scalar
        fields (`response_summary`; the items were forwarded and dropped, not kept, on this path)."""
        snapshot = {**(self._created or {}), "output": []}
        normalise_response(snapshot, self.ctx.request, created_at=self.ctx.created_at)
        return snapshot

    async def _forward_stream(self, response: UpstreamResponse) -> None:
        # Forwarded and dropped: nothing of the stream is kept on this path, so nothing is
        # accumulated (the parser's bytes and each frame's parse are still charged).
        # Runs of frames that need no change go out as received (`read_stream_events`' fast path).
        self.client.snapshot = self._snapshot
        await read_round(
            response,
            self.ctx.ledger,
            client=self.client,
            created_first=True,
            on_event=self._forward,
            on_run=self.client.forward_run,
            accept=self._fast_count,
        )
        await self.client.end()

    def _fast_count(self, heads: list[dict[str, Any]]) -> int:
        """The fast path takes regular frames only once ``response.created`` was forwarded (a
        stream that starts otherwise is refused at its first event, `StreamOrder`)."""
        return len(heads) if self._opened else 0

    async def _forward(self, event: UpstreamEvent) -> None:
        """Forward one upstream event (checked in order by `read_round`); only the lifecycle and terminal
        events' response objects are normalised — what was filled is inserted into the upstream's
        bytes where that object's end is provable (`splice_event_response`), else the event is
        re-encoded — the rest go out as received."""
        changed = event.changed
        data = event.data
        response = event.obj.get("response")
        self._opened |= event.type == "response.created"  # in order: `read_round`'s `StreamOrder`
        if event.type in NORMALISED_EVENTS and isinstance(response, dict):
            before = dict(response)  # the upstream's members (shallow: the values are shared)
            if normalise_response(response, self.ctx.request, created_at=self.ctx.created_at):
                spliced = None if changed else splice_event_response(data, event.obj, response, before)
                changed = spliced is None
                data = spliced if spliced is not None else data
            if event.type == "response.created":
                self._created = response_summary(response)
        await self.client.forward(event.type, data, event.obj, changed=changed)
