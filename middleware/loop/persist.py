"""`ResponseRecorder`: storing one request's response object, completed or failed (DESIGN.md §7).

The loop hands it the final response (`finished`); the guard, through ``ctx.hooks``, hands it a
failure's stored status (`failed`: ``failed`` with the error, or ``cancelled``), with what the
client saw of a round still streaming (``seen``: its finished items, and the items in progress
with their text so far, ``incomplete``). Whichever comes first is stored, once, in one transaction with the request's input, output and replay items. A
response the store cannot encode, or whose conversation was deleted while the request ran, is
logged and not stored: the client still gets the answer it was given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from middleware.loop.echo import normalise_response
from middleware.loop.items import epoch_seconds, public_tools
from middleware.store.history import Restored
from middleware.store.store import RESPONSE_STATUSES, ConversationNotFound, Store, StoredResponse

log = logging.getLogger("loopwarden")


class ResponseRecorder:
    """Stores the response of one request (see the module docstring).

    ``store``: the store, or None when the request has ``store`` off (then nothing is stored).
    ``items``, ``replay``: the loop's lists (read when storing). ``restored``: set by the loop
    once the history is restored (its ``previous_response_id`` / ``conversation_id``).
    ``background``: the response is already stored ``queued`` / ``in_progress``
    (`middleware.loop.background`): its end is stored over that row — unless a cancel, a lease
    expiry or a shutdown stored its end first.
    """

    def __init__(
        self,
        store: Store | None,
        *,
        response_id: str,
        owner: str,
        request: dict[str, Any],
        input_items: list[dict[str, Any]],
        items: list[dict[str, Any]],
        replay: list[dict[str, Any]],
        background: bool = False,
    ) -> None:
        self.store = store
        self.response_id = response_id
        self.owner = owner
        self.request = request
        self.input_items = input_items
        self.items = items
        self.replay = replay
        self.restored = Restored([])
        self.background = background
        self.done = False
        #: the items of a round still streaming that the client saw (set by the loop)
        self.seen: Callable[[], list[dict[str, Any]]] = list

    async def finished(self, response: dict[str, Any]) -> None:
        """Store the final response object (its status is the loop's)."""
        if not self.done:
            self.done = True
            await self._save(response)

    async def failed(self, status: str, error: dict[str, Any] | None) -> None:
        """Store the true status of a request that failed (``failed``, with `error`) or whose
        client went away (``cancelled``), with the items so far; nothing if already stored."""
        if self.done:
            return
        self.done = True
        seen = self.seen()
        if seen:
            self.items = [*self.items, *seen]  # this recorder stores nothing after this one
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
        normalise_response(response, self.request)  # spec-complete, like every object served
        await self._save(response)

    async def _save(self, response: dict[str, Any]) -> None:
        if self.store is None:
            return
        status = str(response.get("status") or "completed")
        params = {k: v for k, v in self.request.items() if k not in ("input", "stream")}
        stored = StoredResponse(
            id=self.response_id,
            owner=self.owner,
            created_at=epoch_seconds(response.get("created_at")),
            status=status if status in RESPONSE_STATUSES else "completed",
            model=str(self.request.get("model")),
            previous_response_id=self.restored.previous_response_id,
            conversation_id=self.restored.conversation_id,
            response=response,
            request=params,
        )
        try:
            saved = await self.store.save_response(
                stored,
                input_items=self.input_items,
                output_items=self.items,
                replay_items=self.replay,
                replace_pending=self.background,
            )
            if not saved:
                log.info("background response %s had already ended (%s not stored)", self.response_id, status)
        except (ValueError, OverflowError, ConversationNotFound) as exc:
            log.warning("response %s was not stored: %s", self.response_id, exc)
