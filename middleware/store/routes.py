"""HTTP routes over the `Store`: stored responses and conversations, shaped as OpenAI's API.

``store_routes(get_store, owner_of, reads=...)`` returns Starlette routes for

==========================================  ==================================================
``GET    /v1/responses/{id}``               the stored response object
``DELETE /v1/responses/{id}``               ``{"id", "object": "response", "deleted": true}``
``GET    /v1/responses/{id}?stream=true``   a streamed background response's events after
                                            ``starting_after`` (`middleware.loop.resume`)
``POST   /v1/responses/{id}/cancel``        a background response: cancel it, answer the stored
                                            response; 400 for a foreground one, 404 unknown
``GET    /v1/responses/{id}/input_items``   the response's input items, a cursor list
``POST   /v1/conversations``                create (``{"items": [...], "metadata": {...}}``)
``GET    /v1/conversations/{id}``           the conversation object
``POST   /v1/conversations/{id}``           update: ``{"metadata": {...} | null}`` replaces the
                                            metadata (null clears it); the conversation object
``DELETE /v1/conversations/{id}``           ``{"id", "object": "conversation.deleted", "deleted": true}``
``GET    /v1/conversations/{id}/items``     the conversation's items, a cursor list
``POST   /v1/conversations/{id}/items``     append (``{"items": [...]}``), the appended items as a list
``GET    /v1/conversations/{id}/items/{i}`` one item, as the list shows it
``DELETE /v1/conversations/{id}/items/{i}`` delete it (`Store.delete_conversation_item`); the
                                            conversation object, as OpenAI answers
==========================================  ==================================================

One route per path: a wrong method is 405 ``method_not_allowed`` with ``Allow`` naming every
method of the path.

Cursor lists take ``after`` (an item id), ``limit`` (1..=100, default 20) and ``order``
(``asc``/``desc``, default ``desc``) and answer ``{"object": "list", "data", "first_id",
"last_id", "has_more"}`` (``first_id``/``last_id`` null when empty), as the official SDKs page them.

Reads are admitted (`middleware.store.reads`, issue 15): the four ``GET`` routes that return
stored items or a stored response reserve from the worker's admission pool and charge a
per-request ledger from the sizes measured at write time before a row is fetched or decoded (one
item is charged as a page of one);
cursor pages are bounded by bytes as well as by count (``has_more`` when a page stops at the byte
bound; a page always holds at least one item). ``GET /v1/conversations/{id}`` (metadata of at most
16 short pairs), ``cancel`` (a status) and the ``DELETE`` routes read nothing unbounded and are
not admitted. The three POST routes' bodies are admitted like a create body
(`middleware.store.bodies`): body clamp, reservation, node counting and depth cap, ledger charge
before parsing, held until the answer is sent.

Ownership: ``owner_of(request)`` names the caller (a hash of its API key; authentication is done
before these routes run); another owner's objects answer 404 exactly like unknown ids.

Errors: handlers raise failures (`middleware.errors`) and pick no status; every exception of a
route is answered by `middleware.outcomes` (resolved, counted and logged, rendered as the OpenAI
envelope), the one renderer:

* `InvalidRequest` — 400 ``invalid_value`` / ``invalid_type`` / ``integer_*`` /
  ``unknown_parameter`` / ``empty_array`` / ``array_above_max_length`` / the JSON codes of
  `budget.loads_strict`, with ``param`` naming the field (``after`` for an unknown cursor);
* `NotFound` — 404 ``not_found`` (unknown, or another owner's);
* a read's refusals (`middleware.store.reads`): `Overloaded` — 503 ``server_overloaded`` with
  ``Retry-After``; `ProcessBudgetExceeded` — 413; `StoredReadTooLarge` — 413
  ``max_retained_bytes_exceeded``; `ShuttingDown` — 503; `InvalidHeader` — 400 ``invalid_header``;
* `BodyTooLarge` — 413 ``request_too_large`` with ``Connection: close``, for POST bodies over
  ``max_body_bytes`` (1 MiB) or the charge model's body clamp, whichever is smaller: refused from
  ``Content-Length`` without reading, or as soon as the streamed body passes the limit;
  `BodyTimeout` — 408; `budget.BudgetExceeded` / `PoolExhausted` of a body — 413;
* the store's `StoreUnavailable` — 503 ``store_unavailable`` when the database fails;
* anything else is a bug: 500 ``internal_error``.

Client errors (4xx) carry ``x-should-retry: false``; each message ends with the request id when
one is set.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from middleware import outcomes
from middleware.asgi.validate import validate_metadata
from middleware.errors import InvalidRequest, NotFound
from middleware.store.bodies import read_json_body
from middleware.store.reads import StoreRead, StoreReads
from middleware.store.store import MAX_LIMIT, MIN_LIMIT, Order, Page, Store, UnknownCursor, encode_json

__all__ = ["MAX_BODY_BYTES", "MAX_ITEMS_PER_CALL", "BackgroundRoutes", "store_routes"]


class BackgroundRoutes(Protocol):
    """What the routes need of the background tasks (`middleware.loop.background.BackgroundTasks`):
    ``cancel`` answers the stored response after a cancel (None: not a background response of
    ``owner``); ``resume`` the streaming answer of ``GET ...?stream=true`` (raises its refusals)."""

    async def cancel(self, response_id: str, owner: str) -> bytes | None: ...

    async def resume(self, request: Request, owner: str) -> Response: ...


#: Largest POST body accepted by the conversation routes (bytes).
MAX_BODY_BYTES = 1 << 20
#: Items one create / add call may carry (OpenAI's limit).
MAX_ITEMS_PER_CALL = 20


#: OpenAI's metadata limits: pairs, key length, value length (characters).
def _answer(exc: BaseException, owner: str, retry_after: float) -> Response:
    """`exc` as the outcome table answers it (DESIGN.md §5): counted and logged, then rendered
    (``retry_after``: seconds, on the rows that send ``Retry-After``)."""
    outcome = outcomes.resolve(exc)
    outcomes.record(outcome, owner=owner)
    status, headers, body = outcomes.render_json(outcome, retry_after=retry_after)
    return Response(
        body,
        status_code=status,
        headers={name.decode("latin-1"): value.decode("latin-1") for name, value in headers},
    )


def _bad(message: str, param: str | None, code: str = "invalid_value") -> NoReturn:
    raise InvalidRequest(message, code=code, param=param)


def _not_found(kind: str, object_id: str) -> NoReturn:
    raise NotFound(f"{kind} with id '{object_id}' not found.")


def _page_args(request: Request) -> tuple[str | None, int, Order]:
    query = request.query_params
    after = query.get("after") or None
    raw_limit = query.get("limit")
    limit = 20
    if raw_limit is not None:
        try:
            limit = int(raw_limit)
        except ValueError:
            _bad(f"Invalid 'limit': expected an integer, got '{raw_limit}'.", "limit", "invalid_type")
        if limit < MIN_LIMIT:
            _bad(
                f"Invalid 'limit': must be at least {MIN_LIMIT}, got {limit}.",
                "limit",
                "integer_below_min_value",
            )
        if limit > MAX_LIMIT:
            _bad(
                f"Invalid 'limit': must be at most {MAX_LIMIT}, got {limit}.",
                "limit",
                "integer_above_max_value",
            )
    order = query.get("order", "desc")
    if order == "asc":
        return after, limit, "asc"
    if order == "desc":
        return after, limit, "desc"
    _bad(f"Invalid 'order': expected 'asc' or 'desc', got '{order}'.", "order")


def _page_body(page: Page) -> bytes:
    """A page as its JSON answer: compact UTF-8, as Starlette's `JSONResponse` renders it."""
    return _json(page.to_json())


def _check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in body:
        if key not in allowed:
            _bad(f"Unknown parameter: '{key}'.", key, "unknown_parameter")


def _items(value: object, *, required: bool) -> list[dict[str, Any]]:
    if value is None and not required:
        return []
    if not isinstance(value, list):
        _bad("Invalid 'items': expected an array of items.", "items", "invalid_type")
    if required and not value:
        _bad("Invalid 'items': expected at least 1 item.", "items", "empty_array")
    if len(value) > MAX_ITEMS_PER_CALL:
        _bad(
            f"Invalid 'items': at most {MAX_ITEMS_PER_CALL} items can be added at a time, got {len(value)}.",
            "items",
            "array_above_max_length",
        )
    for index, item in enumerate(value):
        param = f"items[{index}]"
        if not isinstance(item, dict):
            _bad(f"Invalid '{param}': expected an object.", param, "invalid_type")
        item_type = item.get("type", "message" if "role" in item else None)
        if not isinstance(item_type, str):
            _bad(f"Invalid '{param}': an item needs a 'type' (or a 'role', for a message).", param)
        if item_type == "message":
            if not isinstance(item.get("role"), str):
                _bad(f"Invalid '{param}.role': a message needs a string 'role'.", f"{param}.role")
            if not isinstance(item.get("content"), str | list):
                _bad(f"Invalid '{param}.content': expected a string or an array.", f"{param}.content")
    return value


def store_routes(
    get_store: Callable[[], Store],
    owner_of: Callable[[Request], str],
    *,
    reads: StoreReads,
    max_body_bytes: int = MAX_BODY_BYTES,
    background: BackgroundRoutes | None = None,
) -> list[Route]:
    """The routes of the module docstring. ``get_store()`` is called per request (so the store
    may be opened in the application's lifespan); ``owner_of(request)`` names the caller (what it
    raises, e.g. a 401, is answered like the routes' own failures); ``reads`` admits the reads
    (the gateway's admission pool and limits); ``background`` serves the cancel and resume of
    background responses (`middleware.loop.background.BackgroundTasks`; None: there are none)."""

    Handler = Callable[[Request, Store, str], Awaitable[Response]]
    ReadHandler = Callable[[Request, Store, str, StoreRead], Awaitable[bytes]]

    def endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            owner = ""
            try:
                store = get_store()
                owner = owner_of(request)
                return await handler(request, store, owner)
            except ClientDisconnect:
                raise  # the client is gone: there is no one to answer
            except UnknownCursor as exc:
                invalid = InvalidRequest(str(exc), code="invalid_value", param="after")
                return _answer(invalid, owner, reads.retry_after)
            except Exception as exc:
                return _answer(exc, owner, reads.retry_after)

        return run

    def reading(handler: ReadHandler) -> Handler:
        """An admitted read: ``handler`` answers the JSON body; the read stays admitted until
        that body is sent, and is closed at once when the handler fails."""

        async def run(request: Request, store: Store, owner: str) -> Response:
            read = reads.start(request.scope, owner)
            try:
                return read.respond(await handler(request, store, owner, read))
            except BaseException:
                read.close()
                raise

        return run

    async def get_response(request: Request, store: Store, owner: str, read: StoreRead) -> bytes:
        response_id = request.path_params["response_id"]
        size = await store.response_size(response_id, owner)
        if size is None:
            _not_found("Response", response_id)
        read.admit_response(response_id, size)
        body = await store.response_json(response_id, owner)  # as stored: never decoded
        if body is None:  # deleted meanwhile
            _not_found("Response", response_id)
        return body

    get_stored = reading(get_response)

    async def get_or_stream_response(request: Request, store: Store, owner: str) -> Response:
        stream = request.query_params.get("stream", "false").lower()
        if stream not in ("true", "false"):  # `stream=yes` must not be a silent non-streaming read
            _bad(f"stream must be true or false, got {stream[:40]!r}", "stream")
        if stream == "false":
            return await get_stored(request, store, owner)
        if background is None:
            _bad("Streaming a stored response is not supported; retrieve it without 'stream'.", "stream")
        return await background.resume(request, owner)

    async def delete_response(request: Request, store: Store, owner: str) -> Response:
        response_id = request.path_params["response_id"]
        if not await store.delete_response(response_id, owner):
            _not_found("Response", response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def list_input_items(request: Request, store: Store, owner: str, read: StoreRead) -> bytes:
        response_id = request.path_params["response_id"]
        after, limit, order = _page_args(request)
        sizes = await store.input_item_sizes(response_id, owner, after=after, limit=limit, order=order)
        if sizes is None:
            _not_found("Response", response_id)
        return _page_body(await store.load_page(sizes, read.admit_page(sizes)))

    async def create_conversation(request: Request, store: Store, owner: str, read: StoreRead) -> bytes:
        body = await read_json_body(request, read, max_body_bytes)
        _check_fields(body, ("items", "metadata"))
        items = _items(body.get("items"), required=False)
        metadata = validate_metadata(body.get("metadata"))
        return _json(await store.create_conversation(owner, items=items, metadata=metadata))

    async def get_conversation(request: Request, store: Store, owner: str) -> Response:
        conversation_id = request.path_params["conversation_id"]
        conversation = await store.get_conversation(conversation_id, owner)
        if conversation is None:
            _not_found("Conversation", conversation_id)
        return JSONResponse(conversation)

    async def delete_conversation(request: Request, store: Store, owner: str) -> Response:
        conversation_id = request.path_params["conversation_id"]
        if not await store.delete_conversation(conversation_id, owner):
            _not_found("Conversation", conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_conversation_items(request: Request, store: Store, owner: str, read: StoreRead) -> bytes:
        conversation_id = request.path_params["conversation_id"]
        after, limit, order = _page_args(request)
        sizes = await store.conversation_item_sizes(
            conversation_id, owner, after=after, limit=limit, order=order
        )
        if sizes is None:
            _not_found("Conversation", conversation_id)
        return _page_body(await store.load_page(sizes, read.admit_page(sizes)))

    async def add_conversation_items(request: Request, store: Store, owner: str, read: StoreRead) -> bytes:
        conversation_id = request.path_params["conversation_id"]
        body = await read_json_body(request, read, max_body_bytes)
        _check_fields(body, ("items",))
        items = _items(body.get("items"), required=True)
        added = await store.add_conversation_items(conversation_id, owner, items)
        if added is None:
            _not_found("Conversation", conversation_id)
        return _json(Page(added, added[0]["id"], added[-1]["id"], has_more=False).to_json())

    async def update_conversation(request: Request, store: Store, owner: str, read: StoreRead) -> bytes:
        conversation_id = request.path_params["conversation_id"]
        body = await read_json_body(request, read, max_body_bytes)
        _check_fields(body, ("metadata",))
        if "metadata" not in body:
            _bad("Missing required parameter: 'metadata'.", "metadata", "missing_required_parameter")
        updated = await store.update_conversation(conversation_id, owner, validate_metadata(body["metadata"]))
        if updated is None:
            _not_found("Conversation", conversation_id)
        return _json(updated)

    async def get_conversation_item(request: Request, store: Store, owner: str, read: StoreRead) -> bytes:
        conversation_id, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
        sizes = await store.conversation_item_size(conversation_id, owner, item_id)
        if sizes is None:
            _not_found("Conversation", conversation_id)
        page = await store.load_page(sizes, read.admit_page(sizes)) if sizes.rows else None
        if page is None or not page.data:  # no such item, or deleted meanwhile
            _not_found("Item", item_id)
        return _json(page.data[0])

    async def delete_conversation_item(request: Request, store: Store, owner: str) -> Response:
        conversation_id, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
        conversation, deleted = await store.delete_conversation_item(conversation_id, owner, item_id)
        if conversation is None:
            _not_found("Conversation", conversation_id)
        if not deleted:
            _not_found("Item", item_id)
        return JSONResponse(conversation)

    async def cancel_response(request: Request, store: Store, owner: str) -> Response:
        response_id = request.path_params["response_id"]
        if background is not None:
            body = await background.cancel(response_id, owner)
            if body is not None:
                return Response(body, media_type="application/json")
        status = await store.response_status(response_id, owner)
        if status is None:
            _not_found("Response", response_id)
        raise InvalidRequest(
            f"Only responses created with background=true can be cancelled; the response '{response_id}' "
            f"ran in the foreground (it is {status}), so there is nothing to cancel. A foreground request "
            "stops when its client closes the connection.",
            code="invalid_request",
        )

    conversation = "/v1/conversations/{conversation_id}"
    return [
        _by_method(
            "/v1/responses/{response_id}",
            GET=endpoint(get_or_stream_response),
            DELETE=endpoint(delete_response),
        ),
        _by_method("/v1/responses/{response_id}/input_items", GET=endpoint(reading(list_input_items))),
        _by_method("/v1/responses/{response_id}/cancel", POST=endpoint(cancel_response)),
        _by_method("/v1/conversations", POST=endpoint(reading(create_conversation))),
        _by_method(
            conversation,
            GET=endpoint(get_conversation),
            POST=endpoint(reading(update_conversation)),
            DELETE=endpoint(delete_conversation),
        ),
        _by_method(
            conversation + "/items",
            GET=endpoint(reading(list_conversation_items)),
            POST=endpoint(reading(add_conversation_items)),
        ),
        _by_method(
            conversation + "/items/{item_id}",
            GET=endpoint(reading(get_conversation_item)),
            DELETE=endpoint(delete_conversation_item),
        ),
    ]


def _json(value: object) -> bytes:
    """``value`` as a JSON answer body: compact UTF-8, as Starlette's `JSONResponse` renders it."""
    return encode_json(value).encode("utf-8")


def _by_method(path: str, **handlers: Callable[[Request], Awaitable[Response]]) -> Route:
    """One route for ``path`` serving each method of ``handlers`` (``GET=...``; ``HEAD`` is
    served by ``GET``): a wrong method is a 405 whose ``Allow`` names every method of the path
    (Starlette's separate routes per method would name only the first route's)."""

    async def dispatch(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await handlers[method](request)

    return Route(path, dispatch, methods=list(handlers))
