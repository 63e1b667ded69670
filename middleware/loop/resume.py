"""``GET /v1/responses/{id}?stream=true&starting_after=N``: resume a streamed background response.

As OpenAI's ``client.responses.retrieve(id, stream=True, starting_after=N)``: the events whose
``sequence_number`` is greater than N (all of them without ``starting_after``), then the live
ones until the terminal event, then ``data: [DONE]``. The source is the task's in-memory
`EventLog` when it runs on this worker, else the event log in the store (`StoredFrames`, polled
every heartbeat tick), which another worker or host keeps filling. N at or past the log's last
event of an ended response sends nothing more than ``data: [DONE]``. When the log holds no
terminal event at its end (the task's worker died and another stored it ``failed``), the stored
end is sent as the event after the log's last, unless N is already at or past it: ``error`` + ``response.failed`` (DESIGN.md §5), or the ``response.completed`` /
``response.incomplete`` of an end stored without its frames.

Refusals, answered by the store routes through `middleware.outcomes` before anything streams:
400 ``invalid_value`` (``param`` ``starting_after``: not an integer >= 0, or the events after it
are no longer kept: the window is ``--background-event-log-bytes``, and the whole log is dropped
``--background-event-log-retention`` seconds after the end), 400 ``invalid_request`` (``param``
``stream``: a response created without ``background: true`` and ``stream: true`` has no events),
404 ``not_found``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from middleware.asgi.client_stream import ClientStream
from middleware.errors import InvalidRequest, NotFound
from middleware.loop.eventlog import EventGap, FrameSource, PinnedReader
from middleware.loop.supervise import serve_follower
from middleware.store.background import BackgroundStore

if TYPE_CHECKING:
    from middleware.loop.background import BackgroundTasks

__all__ = ["StoredFrames", "resume_response"]


class StoredFrames:
    """The frames of one response's event log in the store (see the module docstring);
    ``poll``: seconds between reads while nothing new is there."""

    def __init__(self, tables: BackgroundStore, response_id: str, owner: str, poll: float) -> None:
        self.tables = tables
        self.response_id = response_id
        self.owner = owner
        self.poll = poll

    async def _read(self, after: int) -> list[tuple[int, bytes]]:
        rows = await self.tables.read_events(self.response_id, after)
        if rows and rows[0][0] > after + 1:
            raise EventGap(after, rows[0][0])
        return rows

    async def frames_after(self, after: int, wait: float) -> tuple[list[tuple[int, bytes]], bool]:
        """As `EventLog.frames_after`: frames after ``after`` (waiting up to ``wait`` seconds),
        and whether the log is complete (its task ended and every frame was read)."""
        deadline = time.monotonic() + wait
        while True:
            rows = await self._read(after)
            if rows:
                return rows, False
            task = await self.tables.task(self.response_id, self.owner)
            if task is None or task.state == "done":
                rows = await self._read(after)  # the last frames were copied before it was marked done
                return rows, not rows
            if time.monotonic() >= deadline:
                return [], False
            await asyncio.sleep(self.poll)

    async def last_frame(self) -> tuple[int, bytes] | None:
        """As `EventLog.last_frame`: the newest stored ``(seq, frame)`` (None: none stored)."""
        return await self.tables.last_event(self.response_id)


class _Streamed(Response):
    """A Starlette response that streams through a `ClientStream` (``run(client, receive)``)."""

    def __init__(self, run: Callable[[ClientStream, Receive], Awaitable[None]], keepalive: float) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = []
        self.run = run
        self.keepalive = keepalive

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.run(ClientStream(send, keepalive_interval=self.keepalive), receive)


#: ``starting_after``'s accepted text: ASCII digits, at most 19 (2**63-1 has 19)
_DIGITS: Final = re.compile(r"[0-9]{1,19}")


def _starting_after(request: Request) -> int:
    """``starting_after`` as an int (-1 when absent). Only ASCII digits (``int`` also takes
    ``"٣"``, ``"３"``, ``"3_0"``, ``"+3"`` and ``" 3"``, which no sequence_number is written as);
    anything else, or a value outside 0..2**63-1, raises `InvalidRequest` (400 ``invalid_value``)."""
    raw = request.query_params.get("starting_after")
    if raw is None:
        return -1
    value = int(raw) if _DIGITS.fullmatch(raw) else -1  # 19 digits at most: no int() of a huge text
    if not 0 <= value < 2**63:  # a store's INTEGER is 64-bit
        raise InvalidRequest(
            f"starting_after must be an integer in 0..2**63-1 (a sequence_number), got {raw[:40]!r}",
            code="invalid_value",
            param="starting_after",
        )
    return value


def _gone(response_id: str, after: int, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"the events of response '{response_id}' after {after} are no longer kept ({why}); retrieve the "
        "response without stream, or resume from a later starting_after",
        code="invalid_value",
        param="starting_after",
    )


async def resume_response(tasks: BackgroundTasks, request: Request, owner: str) -> Response:
    """The streaming answer of the module docstring; raises its refusals (`InvalidRequest`,
    `NotFound`) before anything is sent."""
    response_id = request.path_params["response_id"]
    after = _starting_after(request)
    tables = tasks.tables
    row = await tables.task(response_id, owner)
    if row is None or not row.stream:
        if await tasks.store.response_status(response_id, owner) is None:
            raise NotFound(f"Response with id '{response_id}' not found.")
        raise InvalidRequest(
            f"the response '{response_id}' was not created with background: true and stream: true, so it has "
            "no events to stream; retrieve it without stream",
            code="invalid_request",
            param="stream",
        )
    local = tasks.tasks.get(response_id)
    source: FrameSource
    if local is not None and local.log is not None:
        if local.log.frames and after + 1 < local.log.first:
            raise _gone(response_id, after, "the window of --background-event-log-bytes moved past them")
        source = local.log.reader()
    else:
        first = await tables.first_event(response_id)
        if first is None and row.state == "done":
            raise _gone(
                response_id, after, "the event log is dropped --background-event-log-retention after the end"
            )
        if first is not None and first > after + 1:
            raise _gone(response_id, after, "the window of --background-event-log-bytes moved past them")
        source = StoredFrames(tables, response_id, owner, tasks.tick)

    async def on_end(terminal: bool, last: int) -> None:
        if not terminal:
            await _send_stored_end(tasks, response_id, owner, client_of[0], last, after)

    client_of: list[ClientStream] = []

    async def run(client: ClientStream, receive: Receive) -> None:
        client_of.append(client)
        try:
            await serve_follower(
                source,
                client,
                receive,
                after=after,
                write_timeout=tasks.settings.transport.client_write_timeout,
                on_end=on_end,
            )
        finally:
            if isinstance(source, PinnedReader):
                source.close()

    return _Streamed(run, tasks.settings.transport.keepalive_interval)


async def _send_stored_end(
    tasks: BackgroundTasks, response_id: str, owner: str, client: ClientStream, last: int, after: int
) -> None:
    """The terminal event(s) of the stored end, numbered from ``last + 1`` (the log holds none),
    those numbered after ``after`` (``starting_after``) only."""
    body = await tasks.store.response_json(response_id, owner)
    if body is None:
        return
    decoded = json.loads(body)
    response: dict[str, Any] = decoded if isinstance(decoded, dict) else {}
    status = response.get("status")
    events: list[tuple[str, dict[str, Any]]] = []
    if status == "failed":
        error = response.get("error") if isinstance(response.get("error"), dict) else {}
        assert isinstance(error, dict)
        code, message = error.get("code"), error.get("message")
        flat = {"code": code, "message": message, "param": None}
        events.append(("error", {"type": "error", **flat, "error": {"type": "server_error", **flat}}))
        events.append(("response.failed", {"type": "response.failed", "response": response}))
    elif status in ("completed", "incomplete"):
        kind = f"response.{status}"
        events.append((kind, {"type": kind, "response": response}))
    for seq, (kind, obj) in enumerate(events, start=last + 1):
        if seq > after:
            client.next_sequence = seq
            await client.event(kind, obj)
