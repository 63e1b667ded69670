"""Intake of one ``POST /v1/responses``: from the raw request to an admitted `RequestContext`.

The checks in DESIGN.md §3 order, each raising a `middleware.errors.Failure` (or
`budget.BudgetExceeded` / `PoolExhausted`) for the guard to answer:

0. the gateway API key (`Unauthenticated`), the caller's identity (``owner``) and the caller whose
   share of the process pool the request counts against (``caller``: the owner, or the client
   address on an open gateway);
1. the effective `Limits`: server settings and the client's lowering headers
   ``loopwarden-max-retained-bytes`` / ``loopwarden-max-infer-iters`` (`InvalidHeader`); the
   smallest wins;
2. the drain (`ShuttingDown`) and admission control: a reservation from the process pool
   (`ProcessBudgetExceeded`, `CallerShareTooLarge`, `Overloaded`, then `CallerShareFull`) before a
   byte of the body is read; a body still being read when the drain timeout passes is
   `ShuttingDown` too (refused: 503 with ``Connection: close``);
3. the raw body clamp (`budget.ChargeModel.body_clamp` of the most permissive configured charge
   model) from ``Content-Length`` and while reading
   (`BodyTooLarge`), within ``client_body_timeout`` seconds (`BodyTimeout`), counting JSON nodes in
   the same pass (depth over `budget.DEFAULT_MAX_DEPTH`: 400 ``json_too_deep`` at once);
4. ``Ledger.admit_input`` (413), then the strict parse, a WebSocket turn's own rules
   (`middleware.asgi.wsturn`) and the field checks (`InvalidRequest`);
5. the model route (`ModelNotFound`), its charge model (the body is re-charged at its price) and
   its lower limit (413 if what is charged no longer fits).

Between 3 and 4, once the whole body is read, and again once it is parsed, the retry shield
(`middleware.ops.shield`): a request identical to one that failed deterministically (same
caller, limits and body) within the window raises `ShieldHit` with the remembered answer. Both
keys — the SHA-256 of the body's bytes (the key until the body parses) and the canonical digest of
the parsed request (key order does not count) — are computed only for a caller the shield holds a
failure of, or when the guard remembers a failure (`Intake.shield_key`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from starlette.types import Receive, Scope

from budget import (
    DEFAULT_MAX_DEPTH,
    ChargeModel,
    JsonFeatures,
    JsonInvalid,
    JsonNodeCounter,
    JsonTooDeep,
    Ledger,
    Limits,
    PoolExhausted,
    loads_strict,
    locate_invalid,
)
from middleware.asgi.auth import Authenticator
from middleware.asgi.client_stream import ClientStream
from middleware.asgi.models import ModelRoute, ModelRouter
from middleware.asgi.validate import validate_request
from middleware.asgi.wsturn import turn_of
from middleware.errors import (
    BodyTimeout,
    BodyTooLarge,
    CallerShareExhausted,
    InvalidHeader,
    InvalidRequest,
    ModelNotFound,
    ShieldHit,
    ShuttingDown,
)
from middleware.loop.context import RequestContext
from middleware.ops.admission import DrainState, ProcessPool, RequestReservation
from middleware.ops.shield import RetryShield, canonical_digest, request_key

LIMIT_HEADERS = {
    b"loopwarden-max-retained-bytes": "max_retained_bytes",
    b"loopwarden-max-infer-iters": "max_infer_iters",
}


class ClientGone(Exception):
    """The client disconnected before the body was complete."""


def _mib(n: int) -> str:
    return f"{n / 1048576:.2f} MiB" if n >= 1048576 else f"{n} bytes"


@dataclasses.dataclass(frozen=True, slots=True)
class IntakeConfig:
    """What every intake of one gateway shares, built once by `BudgetMiddleware`: the server-wide
    ``limits``, the ``authenticator``, the model ``router``, the admission ``pool``, the ``drain``
    state, ``client_body_timeout`` (seconds to receive a whole body), ``retry_after`` (seconds
    in a 503) and ``charge_model`` (the server's; models may name their own). ``validate`` checks
    the parsed body's fields (`validate_request`: a create body); ``create``: the body is a create
    request, so its ``stream`` and ``store`` fields count (False for ``/v1/responses/compact``,
    which neither streams nor stores). ``shield``: the worker's retry shield (None: off)."""

    limits: Limits
    authenticator: Authenticator
    router: ModelRouter
    pool: ProcessPool
    drain: DrainState
    client_body_timeout: float
    retry_after: float
    charge_model: ChargeModel = dataclasses.field(default_factory=ChargeModel.measured)
    validate: Callable[[dict[str, Any]], None] = validate_request
    create: bool = True
    shield: RetryShield | None = None
    _permissive: ChargeModel = dataclasses.field(init=False, repr=False, compare=False)

    def model_for(self, name: str | None) -> ChargeModel:
        """The charge model of a route naming ``name`` (None: the server's)."""
        if name is None or name == self.charge_model.name:
            return self.charge_model
        return ChargeModel.named(name)

    @property
    def permissive_model(self) -> ChargeModel:
        """The configured model that admits the most before routing (the measured one when any
        route or the server uses it): it sets the raw clamp and the admission reservation."""
        return self._permissive

    def __post_init__(self) -> None:
        # once per config: the routes do not change
        names = {self.charge_model.name} | {r.charge_model for r in self.router.routes if r.charge_model}
        permissive = self.model_for("measured" if "measured" in names else "reference")
        object.__setattr__(self, "_permissive", permissive)


class Intake:
    """The admission of one request (see the module docstring); `admit` returns its context.

    What it acquired stays on the object for the guard to settle whatever happens:
    ``reservation`` (the pool's), ``ledger`` (the request's), ``model_label`` (the metric label),
    ``owner`` (the caller's hash), ``caller`` (whose pool share it counts against), ``lowered``
    (the limits this request lowered with its own headers); `shield_key` is the request's
    retry-shield key.
    """

    def __init__(self, scope: Scope, receive: Receive, config: IntakeConfig) -> None:
        self.scope = scope
        self.receive = receive
        self.config = config
        self.owner = ""
        self.caller = ""
        self.shield_identity = ""
        self.reservation: RequestReservation | None = None
        self.ledger: Ledger | None = None
        self.model_label = "other"
        self.lowered: set[str] = set()
        self._raw: bytes | None = None  # the whole body, once read (shield on): its key's source
        self._raw_key: bytes | None = None
        self._parsed: dict[str, Any] | None = None
        self._parsed_key: bytes | None = None
        self._limits: tuple[int, int] = (0, 0)

    async def admit(self, client: ClientStream) -> RequestContext:
        """Run the checks; the admitted request, its ledger charged with the body.

        Raises the `Failure` of the first check that refuses it (401, 413, 429/503, 408, 400, 404)."""
        self._identify()
        limits = self.effective_limits()
        permissive = self.config.permissive_model
        clamp = permissive.body_clamp(limits.max_retained_bytes)
        declared = self._content_length()
        if declared is not None and declared > clamp:
            raise _too_large(declared, clamp, limits, permissive, declared=True)
        self.reservation = self._reserve(limits, declared, permissive)
        counter = JsonNodeCounter(max_depth=DEFAULT_MAX_DEPTH, features=permissive.parse is not None)
        raw = await self._receive_body(clamp, limits, permissive, counter)
        self._shield_read(raw, limits)
        # The body's own charge (what parsing it retains) is admitted before it is parsed; whether
        # the store doubles it (the persisted projection) is known only after parsing, so the
        # doubled charge replaces the single one then — exact for both, and sound throughout.
        try:
            features = counter.features() if permissive.parse is not None else None  # flushes it
        except JsonTooDeep as exc:
            raise InvalidRequest(str(exc), code="json_too_deep") from None
        nodes = counter.nodes
        ledger = self._admit_body(limits, raw, nodes, features, permissive, store=False)
        request = self._parse(raw, features)
        turn = turn_of(self.scope)
        if turn is not None:  # a WebSocket response.create message (middleware.asgi.wsturn)
            request = turn.prepare(request)
        self._shield_parsed(request)
        self.config.validate(request)
        route = self._route(request)
        store = self.config.create and request.get("store") is not False
        model = self.config.model_for(route.charge_model if route is not None else None)
        if store or model is not permissive:  # re-charge at the route's price, with the store's copies
            ledger.release_all()
            ledger = self._admit_body(limits, raw, nodes, features, model, store=store)
        if route is not None:
            limits = route.limits(limits)
            ledger.lower_limit(limits.max_retained_bytes)
        return RequestContext(
            ledger=ledger,
            limits=limits,
            raw=raw,
            request=request,
            stream=self.config.create and request.get("stream") is True,
            store=store,
            model_label=self.model_label,
            owner=self.owner,
            route=route,
            client=client,
            memory=turn.memory if turn is not None else None,
        )

    def _identify(self) -> None:
        """Set the request's store ``owner`` (401 without a valid key), admission ``caller`` and
        retry-shield identity."""
        self.owner = self.config.authenticator.owner(self.scope)
        self.caller = self.config.authenticator.caller(self.scope, self.owner)
        # the shield's identity is the store's owner as well as the admission caller: on an open
        # gateway the caller is the client address, which callers with different keys share
        self.shield_identity = self.caller if self.caller == self.owner else f"{self.caller} {self.owner}"

    async def _receive_body(
        self, clamp: int, limits: Limits, model: ChargeModel, counter: JsonNodeCounter
    ) -> bytes:
        """The whole body (at most ``clamp`` bytes, counted by ``counter``) within
        ``client_body_timeout`` seconds; raises `BodyTimeout` (408), or `ShuttingDown` when the
        drain timeout passes first."""
        try:
            async with asyncio.timeout(self.config.client_body_timeout) as bound:
                with self.config.drain.bounding(bound) as read:
                    return await self._read_body(clamp, limits, model, counter)
        except TimeoutError:
            if read.cut:  # the drain timeout passed first (DrainState.bounding)
                raise ShuttingDown(
                    "the gateway is shutting down and the drain timeout (--drain-timeout) passed while "
                    "this request's body was still being received; retry it on another instance",
                    refused=True,
                ) from None
            raise BodyTimeout(
                f"the request body was not received within {self.config.client_body_timeout:g} s "
                "(--client-body-timeout); send the whole body promptly",
                seconds=self.config.client_body_timeout,
            ) from None

    @staticmethod
    def _parse(raw: bytes, features: JsonFeatures | None) -> dict[str, Any]:
        """The body as a JSON object (`loads_strict`: its depth was capped by the intake's counter,
        its ``:`` outside strings counted in `features` when the charge model counts them);
        raises `InvalidRequest` (400) naming where it is invalid, or when it is not an object."""
        try:
            request = loads_strict(
                raw, members=features.members if features is not None else None, depth_checked=True
            )
        except JsonInvalid as exc:
            raise InvalidRequest(
                exc.message, code=exc.code, param=exc.param or locate_invalid(raw, exc.code)
            ) from None
        if not isinstance(request, dict):
            raise InvalidRequest(f"request body must be a JSON object, got {type(request).__name__}")
        return request

    def _route(self, request: dict[str, Any]) -> ModelRoute | None:
        """The model route of ``request["model"]`` (None: the default upstream) and its metric
        label; raises `ModelNotFound` (404) when routes are configured and none matches."""
        route = self.config.router.match(request["model"])
        if route is None and self.config.router.configured:
            raise ModelNotFound(
                f"the model {request['model'][:200]!r} does not exist on this gateway; "
                f"configured models: {', '.join(sorted(self.config.router.labels))[:500]}",
                param="model",
            )
        self.model_label = route.name if route is not None else "other"
        return route

    def effective_limits(self) -> Limits:
        """The server's limits, lowered by the request's ``loopwarden-max-*`` headers."""
        limits, self.lowered = effective_limits(self.config.limits, self.scope.get("headers", []))
        return limits

    def shield_key(self) -> bytes | None:
        """The retry-shield key of this request (`middleware.ops.shield.request_key`): of the
        parsed request (`canonical_digest`, computed once, here if not yet) when it parsed, else of
        the body's bytes (their SHA-256, computed once, here if not yet); None before the whole
        body was read or with the shield off."""
        if self._parsed is not None and self._parsed_key is None:
            self._parsed_key = request_key(self.shield_identity, self._limits, canonical_digest(self._parsed))
        return self._parsed_key or self._raw_body_key()

    def _raw_body_key(self) -> bytes | None:
        if self._raw_key is None and self._raw is not None:
            digest = hashlib.sha256(self._raw).digest()
            self._raw_key = request_key(self.shield_identity, self._limits, digest)
        return self._raw_key

    def _shield_read(self, raw: bytes, limits: Limits) -> None:
        """The whole body is read: `ShieldHit` when the shield has it under its bytes' key — looked
        up (and the key computed) only for a caller the shield holds a failure of: no other
        caller's key can be there (a key includes its caller)."""
        shield = self.config.shield
        if shield is None or not shield.enabled or turn_of(self.scope) is not None:
            return  # a WebSocket turn's failure is an envelope on its connection, not a replayable answer
        self._limits = (limits.max_retained_bytes, limits.max_infer_iters)
        self._raw = raw
        if shield.knows(self.shield_identity):
            key = self._raw_body_key()
            assert key is not None
            self._raise_hit(shield, key)

    def _shield_parsed(self, request: dict[str, Any]) -> None:
        """The body parsed: `ShieldHit` when the shield has the parsed request, looked up only for
        a caller the shield holds a failure of (the digest walks the whole request)."""
        shield = self.config.shield
        if shield is None or self._raw is None:
            return
        self._parsed = request
        if shield.knows(self.shield_identity):
            key = self.shield_key()
            assert key is not None
            self._raise_hit(shield, key)

    @staticmethod
    def _raise_hit(shield: RetryShield, key: bytes) -> None:
        hit = shield.lookup(key)
        if hit is not None:
            raise ShieldHit(hit, age=shield.clock() - hit.at)

    def _content_length(self) -> int | None:
        for name, value in self.scope.get("headers", []):
            if name.lower() == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    raise InvalidRequest("Content-Length is not an integer") from None
        return None

    def _reserve(self, limits: Limits, declared: int | None, model: ChargeModel) -> RequestReservation:
        """Admission control before the body is read: refusals, else a reservation."""
        pool = self.config.pool
        if self.config.drain.draining:
            raise ShuttingDown("the gateway is shutting down; retry on another instance", refused=True)
        initial = (
            limits.max_retained_bytes
            if declared is None
            else min(limits.max_retained_bytes, declared * model.reserve_per_byte())
        )
        return pool.reserve_request(
            initial, caller=self.caller, retry_after=self.config.retry_after, declared=declared is not None
        )

    def explain(self, exc: Exception) -> Exception:
        """`exc`, or — for a `budget.PoolExhausted` that the caller's share refused (the
        reservation's last refusal) — the `CallerShareExhausted` saying so, with the same phase
        and the numbers (budget bytes) for the message and the log line."""
        reservation = self.reservation
        if not isinstance(exc, PoolExhausted) or reservation is None or reservation.refusal is None:
            return exc
        refusal = reservation.refusal
        if refusal.limit != "caller_share":
            return exc
        pool = self.config.pool
        return CallerShareExhausted(
            f"this caller's share of the worker's process budget is full: its requests in flight hold "
            f"{refusal.held} of the {pool.caller_cap} budget bytes one caller may hold "
            f"(--max-inflight-share-per-caller={pool.share:g} of --max-inflight-retained-bytes={pool.budget}), "
            f"and this request needs {refusal.needed} more ({exc.phase}); retry once fewer of its requests are "
            "in flight",
            phase=exc.phase,
            requested=refusal.needed,
            held=refusal.held,
            share=pool.caller_cap,
        )

    def _admit_body(
        self,
        limits: Limits,
        raw: bytes,
        nodes: int,
        features: JsonFeatures | None,
        model: ChargeModel,
        *,
        store: bool,
    ) -> Ledger:
        """A new ledger for the request, priced by ``model``, with the body admitted
        (``admit_input``; the features are counted again only if the read did not count them)."""
        ledger = Ledger(limits.max_retained_bytes, model, store=store, pool=self.reservation)
        self.ledger = ledger
        ledger.admit_input(raw, nodes=nodes, features=features)
        return ledger

    async def _read_body(
        self, clamp: int, limits: Limits, model: ChargeModel, counter: JsonNodeCounter
    ) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > clamp:
                    raise _too_large(size, clamp, limits, model, declared=False)
                try:
                    counter.feed(chunk)
                except JsonTooDeep as exc:
                    raise InvalidRequest(str(exc), code="json_too_deep") from None
                parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def effective_limits(base: Limits, headers: Iterable[tuple[bytes, bytes]]) -> tuple[Limits, set[str]]:
    """``base`` lowered by the ``loopwarden-max-*`` headers among ``headers`` (ASGI header pairs),
    and the names of the fields a header lowered. The smallest value wins; a header never
    raises a limit. Raises `InvalidHeader` (``param`` the header) for a value that is not an
    integer in its limit's range."""
    lowered: dict[str, int] = {}
    lowered_fields: set[str] = set()
    for name, value in headers:
        field = LIMIT_HEADERS.get(name.lower())
        if field is None:
            continue
        header = name.decode("latin-1").lower()
        try:
            number = int(value)
            Limits(**{**_fields(base), field: number})
        except ValueError:
            low, high = (4096, 268435456) if field == "max_retained_bytes" else (1, 100)
            raise InvalidHeader(
                f"header {header} must be an integer in {low}..={high}, got {value.decode('latin-1')!r}",
                param=header,
            ) from None
        lowered[field] = number
        if number < getattr(base, field):
            lowered_fields.add(field)
    if not lowered:
        return base, lowered_fields
    return Limits.smallest(base, Limits(**{**_fields(base), **lowered})), lowered_fields


def _fields(limits: Limits) -> dict[str, int]:
    return {"max_infer_iters": limits.max_infer_iters, "max_retained_bytes": limits.max_retained_bytes}


def _too_large(size: int, clamp: int, limits: Limits, model: ChargeModel, *, declared: bool) -> BodyTooLarge:
    how = "declares" if declared else "is at least"
    return BodyTooLarge(
        f"request body {how} {_mib(size)}, over the {_mib(clamp)} clamp (the largest body the {model.name} "
        f"charge model can admit with max_retained_bytes={limits.max_retained_bytes}); send less, or raise "
        "max_retained_bytes",
        size=size,
        clamp=clamp,
    )
