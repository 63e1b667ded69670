"""Gateway configuration: one frozen `Settings` object, composed of small groups by concern.

Each group (`UpstreamSettings`, `LoopSettings`, `ToolSettings`, …) is a frozen, keyword-only
dataclass validated in its own ``__post_init__`` from its fields' metadata (help, unit, range,
choices; `setting`), like httpx's ``Limits`` / ``Timeout``. The same metadata generates the
``loopwarden serve`` flags (`middleware.cli`), the ``LOOPWARDEN_*`` variables (`read_env`) and the
README configuration table (`middleware.settings_table`), so a setting added as one field appears
in all of them.

Every setting also has one *flat name* — the flag without its dashes, the environment variable
without ``LOOPWARDEN_``, the config-file key (``upstream_read_timeout`` is
``settings.upstream.read_timeout``). ``Settings(**flat)`` and `Settings.replace` take flat names.

Precedence (DESIGN.md §3): command-line flags > ``LOOPWARDEN_*`` environment variables >
the config file (YAML or TOML, ``--config FILE``) > the defaults. Every value is validated once,
at start-up; an invalid value raises `SettingsError` with a message naming the field, the allowed
range and the value given (the ``budget.Limits`` wording).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from budget import Limits
from budget.limits import MAX_INFER_ITERS_RANGE, MAX_RETAINED_BYTES_RANGE
from middleware.asgi.models import (
    COMPACT_NEEDS_RESPONSES,
    ModelConfigError,
    ModelRoute,
    parse_models,
    route_keys,
)
from middleware.errors import choices_text
from middleware.upstream.chat.dialect import (
    DEVELOPER_ROLES,
    DIALECT_CHOICES,
    MAX_TOKENS_FIELDS,
    REASONING_DIALECTS,
    REASONING_REPLAYS,
    TOOL_CALL_PROFILES,
)

ENV_PREFIX = "LOOPWARDEN_"
#: ``upstream_compact`` values: who answers ``POST /v1/responses/compact`` (README "Compaction").
COMPACT_MODES = ("auto", "upstream", "gateway")
_URL_SCHEMES = ("http://", "https://")


class SettingsError(ValueError):
    """An invalid `Settings` value or config file; the message names the field and the fix.

    ``field``: the flat name of the setting at fault when one is (``"max_retained_bytes"``,
    ``"models"``), so that `load_settings` can name where its value came from. A
    `budget.ConfigError` raised by `budget.Limits` is re-raised as this, with its message."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
    """The metadata of one setting (a group field), from which checks, flags and docs are made.

    ``help``: the one-line meaning (``--help``); ``doc``: the README meaning when longer.
    ``unit``: ``"s"`` (seconds) or ``""``. ``low``/``high``: the inclusive range (``open_low``:
    ``low`` itself excluded); ``choices``: the allowed strings, in message order. ``zero``: what 0
    means (``"no cap"``). ``default_doc``: the default as the README shows it, when not the
    value. ``name``: the flat name (filled in by `setting_specs`; ``flat`` overrides it when it is
    not the field's own name). ``flag``: whether ``loopwarden serve`` has a flag for it (else only
    the environment and the file). ``rule``: an extra check returning what is wrong or None.
    """

    help: str
    doc: str = ""
    unit: str = ""
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    choices: tuple[str, ...] = ()
    zero: str = ""
    default_doc: str = ""
    flat: str = ""
    flag: bool = True
    rule: Callable[[Any], str | None] | None = None


def setting(default: Any, help: str, *, secret: bool = False, **spec: Any) -> Any:
    """A group field with default `default` and `Spec` metadata (``help`` plus `spec` keywords).

    ``secret``: left out of ``repr``. A `dict` default becomes a factory."""
    meta = {"spec": Spec(help=help, **spec)}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=dict, repr=not secret, metadata=meta)
    return dataclasses.field(default=default, repr=not secret, metadata=meta)


def spec_of(field: dataclasses.Field[Any]) -> Spec:
    """The `Spec` of a group field (KeyError: a field made without `setting`)."""
    spec = field.metadata["spec"]
    assert isinstance(spec, Spec)
    return spec


def _range_text(spec: Spec) -> str:
    """The rule a numeric value breaks, in the `budget.Limits` wording."""
    low, high = _num(spec.low), _num(spec.high)
    if high is not None:
        return f"in ({low}, {high}]" if spec.open_low else f"in {low}..={high}"
    if spec.unit == "s":
        return "a positive number of seconds" if spec.open_low else f"a number of seconds >= {low}"
    return f"> {low}" if spec.open_low else f">= {low}"


def _num(value: float | None) -> Any:
    """`value` as written in messages: ``1024``, not ``1024.0``."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _problem(spec: Spec, value: Any) -> str | None:
    """What is wrong with `value` under `spec` (``"must be …"``), or None when it is valid."""
    if spec.choices and value not in spec.choices:
        return f"must be {choices_text(spec.choices)}, got {value!r}"
    if spec.low is not None and value is not None:
        below = not value > spec.low if spec.open_low else not value >= spec.low
        if below or (spec.high is not None and not value <= spec.high):
            zero = f" (0: {spec.zero})" if spec.zero else ""
            return f"must be {_range_text(spec)}{zero}, got {value}"
    if isinstance(value, float) and not math.isfinite(value):  # inf passes an open range
        return f"must be a finite number, got {value}"
    return spec.rule(value) if spec.rule is not None else None


def _http_url(value: str | None) -> str | None:
    if value is not None and not value.startswith(_URL_SCHEMES):
        return f"must be an http:// or https:// URL, got {value!r}"
    return None


def _store_url(value: str) -> str | None:
    if value != "memory" and not value.startswith(("sqlite:///", "postgresql://", "postgres://")):
        return f"must be memory, sqlite:///PATH or postgresql://..., got {value.split('://')[0]!r}"
    return None


def _mcp_entries(entries: tuple[str, ...]) -> str | None:
    for entry in entries:
        label, sep, url = entry.partition("=")
        if not sep or not label or not url.startswith(_URL_SCHEMES):
            return f"entries must look like LABEL=http(s)://HOST/PATH, got {entry!r}"
    return None


def _secret_length(value: str | None) -> str | None:
    if value is not None and len(value.encode()) < 16:
        return f"must be at least 16 bytes (use e.g. `openssl rand -hex 32`), got {len(value.encode())}"
    return None


def _read_lines(path: str, name: str) -> list[str]:
    """The lines of file `path` (setting `name`); SettingsError when it cannot be read."""
    try:
        return Path(path).read_text().splitlines()
    except OSError as exc:
        raise SettingsError(f"cannot read {name} {path}: {exc.strerror}") from None


def _validate(group: Any) -> None:
    """Check every field of `group` against its `Spec` (lists of strings become tuples).

    Raises SettingsError naming the flat name, the rule and the value."""
    for field in dataclasses.fields(group):
        value = getattr(group, field.name)
        if field.type == "tuple[str, ...]" and not isinstance(value, tuple):
            value = tuple(value)
            object.__setattr__(group, field.name, value)
        spec = spec_of(field)
        if (problem := _problem(spec, value)) is not None:
            name = spec.flat or field.name
            raise SettingsError(f"{name} {problem}", field=name)


_S = "s"
_group = dataclasses.dataclass(frozen=True, kw_only=True)


@_group
class UpstreamSettings:
    """The model server and how it is called (`middleware.upstream`). Seconds; a URL with ``/v1``."""

    url: str | None = setting(
        None,
        "base URL of the model server, e.g. http://127.0.0.1:8000/v1: a Responses API server, or a "
        "Chat Completions one with --upstream-api chat",
        doc="base URL of the model server, e.g. `http://127.0.0.1:8000/v1`: a Responses API server, or a "
        "Chat Completions one with `--upstream-api chat`",
        default_doc="*(embedded dev model)*",
        flat="upstream",
        rule=_http_url,
    )
    api_key: str | None = setting(
        None,
        "bearer token sent upstream; prefer the environment variable, which ps does not show",
        doc="bearer token sent upstream (prefer `$LOOPWARDEN_UPSTREAM_API_KEY`: `ps` shows flags)",
        flat="upstream_api_key",
        secret=True,
    )
    connect_timeout: float = setting(
        10.0,
        "seconds to connect upstream",
        doc="time to open an upstream connection",
        unit=_S,
        low=0,
        open_low=True,
        flat="upstream_connect_timeout",
    )
    read_timeout: float = setting(
        600.0,
        "seconds allowed for the first byte and between any two reads",
        doc="time allowed for the first byte and between any two reads",
        unit=_S,
        low=0,
        open_low=True,
        flat="upstream_read_timeout",
    )
    deadline: float = setting(
        1800.0,
        "seconds for a whole upstream call",
        doc="time for a whole upstream call",
        unit=_S,
        low=0,
        open_low=True,
        flat="upstream_deadline",
    )
    max_connections: int = setting(
        100,
        "pooled upstream connections per worker",
        low=1,
        high=10_000,
        flat="upstream_max_connections",
    )
    client: str = setting(
        "aiohttp",
        "upstream HTTP client: aiohttp or httpx",
        doc="upstream HTTP client, `aiohttp` or `httpx` (see [Performance](#performance))",
        choices=("aiohttp", "httpx"),
        flat="upstream_client",
    )
    api: str = setting(
        "responses",
        "what the upstream speaks: responses (/v1/responses) or chat (/v1/chat/completions, translated)",
        doc="what the upstream speaks: `responses` (`/v1/responses`) or `chat` (`/v1/chat/completions`, "
        "translated; see [Chat Completions upstreams](#chat-completions-upstreams))",
        choices=("responses", "chat"),
        flat="upstream_api",
    )
    reasoning_dialect: str = setting(
        "reasoning_content",
        "chat upstreams: the message field reasoning arrives in",
        choices=REASONING_DIALECTS,
    )
    reasoning_replay: str = setting(
        "omit",
        "chat upstreams: replayed reasoning goes on the next assistant message as this field, or is dropped (omit)",
        choices=REASONING_REPLAYS,
    )
    max_tokens_field: str = setting(
        "max_completion_tokens",
        "chat upstreams: the request field max_output_tokens becomes",
        choices=MAX_TOKENS_FIELDS,
    )
    tool_call_profile: str = setting(
        "strict",
        "chat upstreams: strict (tool-call stream quirks fail) or tolerant (every call on index 0, "
        "fragments without index, calls without id)",
        choices=TOOL_CALL_PROFILES,
    )
    developer_role: str = setting(
        "developer",
        "chat upstreams: the role developer messages are sent as",
        choices=DEVELOPER_ROLES,
    )

    __post_init__ = _validate


@_group
class LoopSettings:
    """The per-request limits of the agentic loop (DESIGN.md §3, §4): calls, bytes, time."""

    max_infer_iters: int = setting(
        10,
        "inference calls per client request",
        low=MAX_INFER_ITERS_RANGE[0],
        high=MAX_INFER_ITERS_RANGE[1],
    )
    max_retained_bytes: int = setting(
        67_108_864,
        "retained-bytes budget per request",
        low=MAX_RETAINED_BYTES_RANGE[0],
        high=MAX_RETAINED_BYTES_RANGE[1],
    )
    charge_model: str = setting(
        "measured",
        "ledger prices: measured (what CPython really retains) or reference (DESIGN.md §4 numbers)",
        doc="ledger prices: `measured` (what CPython really holds) or `reference` (DESIGN.md §4 "
        "numbers); also per model under `models:`",
        choices=("measured", "reference"),
    )
    request_deadline: float = setting(
        1800.0,
        "seconds for a whole request, all rounds",
        doc="time for a whole request, every round and tool",
        unit=_S,
        low=0,
        open_low=True,
    )

    def __post_init__(self) -> None:
        _validate(self)
        try:
            Limits(max_infer_iters=self.max_infer_iters, max_retained_bytes=self.max_retained_bytes)
        except ValueError as exc:  # "max_retained_bytes must be in …": the field leads the message
            raise SettingsError(str(exc), field=str(exc).split(" ", 1)[0]) from None

    @property
    def limits(self) -> Limits:
        """The server-wide request limits (a `budget.Limits`)."""
        return Limits(max_infer_iters=self.max_infer_iters, max_retained_bytes=self.max_retained_bytes)


@_group
class ToolSettings:
    """Gateway-run tools: MCP servers, the listing cache, the session pool and per-call caps."""

    mcp_server: tuple[str, ...] = setting(
        (),
        "an operator MCP server, LABEL=URL (streamable HTTP); repeatable. Requests use it with "
        '{"type":"mcp","server_label":"LABEL"}',
        doc="an operator MCP server `LABEL=URL` (streamable HTTP); repeatable",
        rule=_mcp_entries,
    )
    mcp_allow: tuple[str, ...] = setting(
        (),
        "URL prefix a client-declared MCP server_url must match; repeatable",
        doc="URL prefix a client-declared MCP `server_url` must match; repeatable. Same scheme, host "
        "and port, and a percent-decoded path equal to the prefix's (trailing `/` ignored) or "
        "continuing it at a `/` (`/mcp` allows `/mcp/x`, never `/mcpx`); a path with an encoded `/` "
        "(`%2F`), a `.` or `..` segment (raw or `%2e`), `;`, a backslash (raw or `%5C`), an encoded "
        "`?`/`#`, double encoding (`%25…`) or, once decoded, a control or non-ASCII character is "
        "refused before any request (400 `mcp_server_not_allowed`), as are prefixes with one. MCP "
        "redirects are never followed (`--mcp-server` URLs included)",
        default_doc="— (none)",
    )
    mcp_list_ttl: float = setting(
        300.0,
        "seconds a server's tools/list is cached",
        doc="how long a server's `tools/list` is reused; `0`: never cached",
        unit=_S,
        low=0,
        zero="never cache",
    )
    mcp_list_cache_bytes: int = setting(
        16_777_216,
        "bytes all cached tools/list results may keep alive, LRU-evicted",
        doc="bytes all cached `tools/list` results may keep alive (least recently used evicted; per "
        "server, headers and caller); `0`: never cached",
        low=0,
        high=1_073_741_824,
        zero="never cache",
    )
    mcp_session_idle_timeout: float = setting(
        60.0,
        "seconds an unused pooled MCP session stays open",
        doc="how long an unused pooled MCP session stays open",
        unit=_S,
        low=0,
        open_low=True,
    )
    mcp_idle_sessions_per_server: int = setting(
        4,
        "idle MCP sessions kept per server, headers and caller; 0: no reuse",
        doc="idle MCP sessions kept per server, headers and caller; `0`: a session per round, no reuse",
        low=0,
        high=64,
    )
    timeout: float = setting(
        60.0,
        "seconds one gateway tool call may take",
        doc="time one gateway tool call may take",
        unit=_S,
        low=0,
        open_low=True,
        flat="tool_timeout",
    )
    concurrency: int = setting(
        5, "gateway tool calls in flight per request", low=1, high=100, flat="tool_concurrency"
    )
    max_result_bytes: int = setting(
        262_144,
        "per-call tool result cap in bytes (over it: an error output)",
        doc="per-call tool result cap (over it: an error output)",
        low=1,
        high=268_435_456,
        flat="tool_max_result_bytes",
    )

    __post_init__ = _validate


@_group
class AdmissionSettings:
    """Who may enter and how much may be in flight at once, per worker (`middleware.ops.admission`)."""

    api_key: tuple[str, ...] = setting(
        (),
        "a gateway API key clients must present; repeatable (prefer --api-key-file or the "
        "comma-separated environment variable, which ps does not show)",
        doc="a gateway API key; repeatable (prefer `--api-key-file` or `$LOOPWARDEN_API_KEY`, "
        "comma-separated)",
        default_doc="— (open)",
        secret=True,
    )
    api_key_file: str | None = setting(None, "file with gateway API keys, one per line")
    max_inflight_retained_bytes: int = setting(
        0,
        "budget bytes all requests of one worker may hold together",
        low=0,
        zero="a quarter of memory / workers",
        default_doc="`0` (a quarter of the memory limit / workers)",
    )
    max_concurrent_requests: int = setting(
        0, "requests in flight per worker", low=0, zero="no cap", default_doc="`0` (no cap)"
    )
    max_inflight_share_per_caller: float = setting(
        0.5,
        "share of the worker's pool one caller (API key, or client address when open) may hold",
        doc="share of the worker's pool one caller may hold: its API key, or on an open gateway its "
        "client address (`X-Forwarded-For` only from the proxies uvicorn trusts: "
        "`$FORWARDED_ALLOW_IPS`, default `127.0.0.1,::1`)",
        low=0,
        high=1,
        open_low=True,
    )
    retry_after: float = setting(
        1.0,
        "Retry-After seconds on a 503 overload refusal",
        doc="`Retry-After` of a 503 overload refusal",
        unit=_S,
        low=0,
        open_low=True,
    )
    memory_pressure_threshold: float = setting(
        0.9,
        "shed new requests above this used/allowed memory ratio",
        doc="shed new requests above this used / allowed memory (cgroup, else RSS / RAM)",
        low=0,
        high=1,
        open_low=True,
    )

    __post_init__ = _validate

    def api_keys(self) -> list[str]:
        """The gateway API keys: ``api_key`` entries plus the non-comment lines of ``api_key_file``.

        Raises SettingsError when the file cannot be read."""
        keys = list(self.api_key)
        if self.api_key_file:
            lines = (line.strip() for line in _read_lines(self.api_key_file, "api_key_file"))
            keys += [line for line in lines if line and not line.startswith("#")]
        return keys


@_group
class ShieldSettings:
    """The per-worker retry shield (`middleware.ops.shield`): seconds, entries, budget bytes."""

    seconds: float = setting(
        30.0,
        "seconds a deterministic failure is answered again at once to the same caller's identical "
        "request, without an upstream call (per worker)",
        doc="how long a shielded failure is answered again to the same caller's identical request, "
        "without an upstream call (per worker; see [Limits contract and outcomes]"
        "(#limits-contract-and-outcomes)); `0`: off",
        unit=_S,
        low=0,
        high=3600,
        zero="no retry shield",
        flat="retry_shield_seconds",
    )
    max_entries: int = setting(
        4096,
        "failures the retry shield remembers per worker (oldest evicted)",
        low=0,
        high=1_000_000,
        flat="retry_shield_max_entries",
    )
    max_bytes: int = setting(
        16_777_216,
        "budget bytes the retry shield may hold per worker, drawn from its pool",
        doc="budget bytes the retry shield holds per worker, drawn from its admission pool; an answer "
        "over an eighth of it is not remembered",
        low=0,
        high=1_073_741_824,
        flat="retry_shield_max_bytes",
    )

    __post_init__ = _validate


@_group
class BackgroundSettings:
    """Background responses (`middleware.loop.background`): leases and the resumable event log."""

    lease_seconds: float = setting(
        30.0,
        "seconds a background response's worker may go silent before another marks it failed",
        doc="silence after which another worker stores a background response's task `failed` (its "
        "worker died)",
        unit=_S,
        low=0,
        open_low=True,
        flat="background_lease_seconds",
    )
    event_log_bytes: int = setting(
        8_388_608,
        "bytes of SSE events a streamed background response keeps for resuming, oldest dropped "
        "first, charged to its ledger",
        doc="bytes of SSE events a streamed background response keeps for `starting_after` (0: only "
        "what connected clients still need)",
        low=0,
        high=268_435_456,
        zero="no resume",
        flat="background_event_log_bytes",
    )
    event_log_retention: float = setting(
        600.0,
        "seconds a background response's event log is kept after it ends",
        doc="how long an ended background response's events are kept",
        unit=_S,
        low=0,
        open_low=True,
        flat="background_event_log_retention",
    )

    __post_init__ = _validate


@_group
class CompactionSettings:
    """``POST /v1/responses/compact`` (README "Compaction"): who answers, the summary cap, the key."""

    mode: str = setting(
        "auto",
        "who answers POST /v1/responses/compact: auto (the upstream's own /responses/compact, else "
        "the gateway on 404/405; always the gateway on a chat upstream), upstream (needs upstream_api "
        "responses) or gateway",
        doc="who answers `POST /v1/responses/compact`: `auto`, `upstream` or `gateway` (see "
        "[Compaction](#compaction)); also per model. A Chat upstream always gets the gateway's "
        "(`auto` never probes it; `upstream` is refused at start-up)",
        choices=COMPACT_MODES,
        flat="upstream_compact",
    )
    max_output_tokens: int = setting(
        4096,
        "the gateway's compaction summary cap",
        doc="the gateway's compaction summary cap; also per model",
        low=1,
        high=131_072,
        flat="compact_max_output_tokens",
    )
    secret: str | None = setting(
        None,
        "the key that signs compaction items (set the same key on every host)",
        flat="compact_secret",
        flag=False,
        secret=True,
        rule=_secret_length,
    )
    secret_file: str | None = setting(
        None,
        "file whose first line is the key that signs compaction items (shared by every host; or "
        "$LOOPWARDEN_COMPACT_SECRET)",
        doc="file whose first line signs compaction items; or `$LOOPWARDEN_COMPACT_SECRET` / "
        "`compact_secret` (set the same key on every host)",
        default_doc="— (a random key per start, shared by `--workers`)",
        flat="compact_secret_file",
    )

    __post_init__ = _validate

    def key(self) -> bytes | None:
        """The key that seals compaction items: ``secret``, else the first line of
        ``secret_file``, else None (a random key per process). Raises SettingsError when the file
        cannot be read or holds fewer than 16 bytes."""
        if self.secret is not None:
            return self.secret.encode()
        if not self.secret_file:
            return None
        key = (_read_lines(self.secret_file, "compact_secret_file") or [""])[0].strip().encode()
        if len(key) < 16:
            raise SettingsError(
                f"compact_secret_file {self.secret_file} must hold a secret of at least 16 bytes"
            )
        return key


@_group
class StoreSettings:
    """Where responses and conversations are stored (`middleware.store`)."""

    url: str = setting(
        "sqlite:///./.loopwarden/loopwarden.db",
        "where responses are stored: sqlite:///PATH, postgresql://USER@HOST/DB, or memory",
        doc="`sqlite:///PATH`, `postgresql://…` or `memory`",
        flat="store",
        rule=_store_url,
    )

    __post_init__ = _validate


@_group
class LogSettings:
    """The gateway's log (`middleware.ops.request_id`): level and line format."""

    level: str = setting(
        "info",
        "critical, error, warning, info or debug",
        doc="`critical`, `error`, `warning`, `info`, `debug`",
        choices=("critical", "error", "warning", "info", "debug"),
        flat="log_level",
    )
    format: str = setting(
        "text",
        "text or json (one JSON object per line); every line has the request id",
        doc="`text` or `json` (one object per line); every line carries the request id",
        choices=("text", "json"),
        flat="log_format",
    )

    __post_init__ = _validate


@_group
class WebSocketSettings:
    """WebSocket connections at ``/v1/responses`` (`middleware.asgi.websocket`), in seconds."""

    max_lifetime: float = setting(
        3600.0,
        "seconds a WebSocket connection at /v1/responses may live (the spec's 60 minutes; then "
        "websocket_connection_limit_reached and close 1001)",
        doc="lifetime of a WebSocket connection at `/v1/responses` (the spec's 60 minutes); then "
        "`websocket_connection_limit_reached` and close 1001",
        unit=_S,
        low=0,
        open_low=True,
        flat="websocket_max_lifetime",
    )
    idle_timeout: float = setting(
        300.0,
        "seconds a WebSocket connection may wait for its next message between turns (then close 1001)",
        doc="time a WebSocket connection may wait for its next `response.create` between turns; then "
        "`websocket_idle_timeout` and close 1001",
        unit=_S,
        low=0,
        open_low=True,
        flat="websocket_idle_timeout",
    )

    __post_init__ = _validate


def _seconds(default: float, help: str, doc: str = "") -> Any:
    """A positive number of seconds (`setting` with the unit and range filled in)."""
    return setting(default, help, doc=doc, unit=_S, low=0, open_low=True)


@_group
class TransportSettings:
    """The client side of the gateway: listening, uvicorn's stack, connection bounds and client
    timeouts (`middleware.ops.connections`), workers and the drain. Seconds, bytes."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8080, "port to listen on", low=0, high=65535)
    workers: int = setting(1, "worker processes", low=1, high=256)
    http: str = setting(
        "httptools",
        "uvicorn's HTTP/1.1 stack: httptools or h11",
        doc="uvicorn's HTTP/1.1 stack, `httptools` or `h11`; the connection bounds below hold on both",
        choices=("h11", "httptools"),
    )
    loop: str = setting(
        "uvloop",
        "uvicorn's event loop: uvloop or asyncio",
        doc="uvicorn's event loop, `uvloop` or `asyncio` (with `httptools`: what `uvicorn[standard]` runs)",
        choices=("asyncio", "uvloop"),
    )
    header_timeout: float = _seconds(
        10.0,
        "seconds a connection has to send a complete request head, else it is closed",
        "time a connection has to send a complete request head (from accept, or on a kept-alive "
        "connection from the first byte of its next head); then it is closed, nothing answered (cap "
        "hit `header_timeout`)",
    )
    keepalive_timeout: float = _seconds(
        5.0,
        "seconds an idle keep-alive connection stays open after a response (uvicorn's "
        "timeout_keep_alive); not --keepalive-interval, the SSE comment interval",
        "how long an idle keep-alive connection stays open after a response (uvicorn's "
        "`timeout_keep_alive`; not `--keepalive-interval`)",
    )
    max_connections: int = setting(
        0,
        "open client connections per worker; more are closed at accept",
        doc="open client connections per worker; one more is closed at accept, unread (cap hit "
        "`max_connections`). Head-room: `--upstream-max-connections` × (1 + configured models), "
        "twice with the embedded dev model, + 64 for MCP sessions, the store, logs and metric files; "
        "start-up fails if under 16 are left",
        low=0,
        high=1_000_000,
        zero="the file-descriptor limit minus head-room",
        default_doc="`0` (the soft `ulimit -n` − `--backlog` − head-room)",
    )
    max_header_bytes: int = setting(
        65_536,
        "bytes of one request head; over it: 431",
        doc="bytes of one request head (request line and headers); over it: 431 `request_header_too_large`",
        low=1024,
        high=1_048_576,
    )
    backlog: int = setting(
        0,
        "listen queue, and sockets accepted per wake-up (uvicorn's backlog)",
        doc="uvicorn's listen queue; asyncio also accepts up to this many sockets at once before "
        "refusing any, so it is part of the descriptor budget",
        low=0,
        high=65_535,
        zero="min(2048, the file-descriptor limit // 8)",
        default_doc="`0` (min(2048, soft `ulimit -n` // 8))",
    )
    client_body_timeout: float = _seconds(
        30.0, "seconds to receive a request body", "time to receive a request body"
    )
    client_write_timeout: float = _seconds(
        30.0,
        "seconds one write to the client may make no progress before the request ends as a disconnect",
        "time one write to the client may make no progress (the client stopped reading): the request "
        "then ends as a client disconnect, stored `cancelled`, its reservation released; also bounds "
        "the error frame of a request whose deadline or drain fired",
    )
    keepalive_interval: float = _seconds(
        15.0,
        "seconds between SSE keep-alive comments",
        "SSE `: keep-alive` comment interval while a committed stream waits",
    )
    drain_timeout: float = _seconds(
        30.0,
        "seconds in-flight requests get after SIGTERM",
        "time in-flight requests (and background responses) get after SIGTERM",
    )

    __post_init__ = _validate


#: the groups of `Settings`, by attribute, in README order
GROUPS: dict[str, type[Any]] = {
    "transport": TransportSettings,
    "upstream": UpstreamSettings,
    "loop": LoopSettings,
    "tools": ToolSettings,
    "admission": AdmissionSettings,
    "shield": ShieldSettings,
    "background": BackgroundSettings,
    "websocket": WebSocketSettings,
    "compaction": CompactionSettings,
    "store": StoreSettings,
    "logging": LogSettings,
}


@dataclasses.dataclass(frozen=True)
class FlatSetting:
    """One setting under its flat name: ``group`` (None: a top-level field of `Settings`),
    ``field`` (its attribute in the group), its annotated ``type`` (a string) and `Spec`."""

    name: str
    group: str | None
    field: str
    type: str
    default: Any
    spec: Spec

    @property
    def flag(self) -> str:
        """The ``loopwarden serve`` flag, ``--upstream-read-timeout``."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """The environment variable, ``LOOPWARDEN_UPSTREAM_READ_TIMEOUT``."""
        return ENV_PREFIX + self.name.upper()


_TOP_SPECS = {
    "models": Spec(
        help="model names or fnmatch patterns mapped to their own upstream settings",
        doc="model names or `fnmatch` patterns → their own "
        + ", ".join(f"`{key}`" for key in route_keys())
        + " (keys with `-` or `_`)",
        flag=False,
    ),
    "config": Spec(
        help="YAML or TOML file with settings (flags override it)",
        doc="YAML or TOML file holding any of the settings above",
    ),
}


def setting_specs(groups: Mapping[str, type[Any]] | None = None) -> dict[str, FlatSetting]:
    """Every setting of `groups` (default `GROUPS`) plus ``models`` and ``config``, by flat name,
    in group order: what the flags, the environment, the file and the README table are made from.
    """
    out: dict[str, FlatSetting] = {}
    for group, cls in (GROUPS if groups is None else groups).items():
        for field in dataclasses.fields(cls):
            spec = spec_of(field)
            name = spec.flat or field.name
            default = field.default if field.default is not dataclasses.MISSING else {}
            out[name] = FlatSetting(name, group, field.name, str(field.type), default, spec)
    out["models"] = FlatSetting("models", None, "models", "dict[str, Any]", {}, _TOP_SPECS["models"])
    out["config"] = FlatSetting("config", None, "config", "str | None", None, _TOP_SPECS["config"])
    return out


FIELDS: dict[str, FlatSetting] = setting_specs()


def _compose(base: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """`base` (group attribute → group, plus ``models``/``config``) with `values` applied: a group
    instance replaces its group, a flat name replaces that one field (the rest of its group kept).

    ``upstream``, ``loop`` and ``store`` are both a group and a flat name: a group instance is
    the group, anything else the flat value (the URL, uvicorn's loop, the store URL). Raises
    TypeError for an unknown name, SettingsError for an invalid value."""
    out = dict(base)
    per_group: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        cls = GROUPS.get(key)
        if cls is not None and isinstance(value, cls):
            out[key] = value
        elif key in FIELDS:
            entry = FIELDS[key]
            if entry.group is None:
                out[key] = value
            else:
                per_group.setdefault(entry.group, {})[entry.field] = value
        else:
            raise TypeError(f"Settings got an unexpected keyword argument {key!r}")
    for group, changes in per_group.items():
        current = out.get(group)
        out[group] = GROUPS[group](**changes) if current is None else dataclasses.replace(current, **changes)
    for group, cls in GROUPS.items():
        if out.get(group) is None:
            out[group] = cls()
    return out


@dataclasses.dataclass(frozen=True, init=False)
class Settings:
    """Everything `loopwarden serve` needs, validated, as groups by concern.

    ``Settings(**values)`` takes groups (``upstream=UpstreamSettings(...)``) and/or flat names
    (``upstream="http://…/v1", max_infer_iters=3``; the flag names without dashes); a flat name
    changes one field and keeps the rest of its group. ``models`` is the config file's
    ``models:`` mapping (validated here; `model_routes`), ``config`` the file it came from.
    Raises SettingsError for an invalid value (naming the flat name, the range and the value) and
    TypeError for an unknown name. Use `replace` rather than ``dataclasses.replace`` (which
    cannot tell the ``upstream``/``loop``/``store`` groups from their flat values).
    """

    transport: TransportSettings
    upstream: UpstreamSettings
    loop: LoopSettings
    tools: ToolSettings
    admission: AdmissionSettings
    shield: ShieldSettings
    background: BackgroundSettings
    websocket: WebSocketSettings
    compaction: CompactionSettings
    store: StoreSettings
    logging: LogSettings
    models: dict[str, Any] = dataclasses.field(repr=False)
    config: str | None

    def __init__(self, **values: Any) -> None:
        composed = _compose({"models": {}, "config": None}, values)
        for name, value in composed.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "models", dict(self.models))
        try:
            routes = parse_models(self.models)
        except ModelConfigError as exc:
            raise SettingsError(str(exc), field="models") from None
        _check_compact_api(self.upstream.api, self.compaction.mode, routes)

    def replace(self, **values: Any) -> Settings:
        """These settings with `values` applied (groups or flat names, as ``Settings(...)``):
        a per-model override of ``upstream_read_timeout`` replaces that field of the upstream
        group and nothing else. Raises like ``Settings(...)``."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Settings(**_compose(current, values))

    def flat(self) -> dict[str, Any]:
        """Every setting by flat name (``{"upstream_read_timeout": 600.0, …}``); JSON-ready."""
        out: dict[str, Any] = {}
        for name, entry in FIELDS.items():
            owner = self if entry.group is None else getattr(self, entry.group)
            value = getattr(owner, entry.field)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def api_keys(self) -> list[str]:
        """The gateway API keys (`AdmissionSettings.api_keys`). Raises SettingsError."""
        return self.admission.api_keys()

    def compact_key(self) -> bytes | None:
        """The compaction key (`CompactionSettings.key`). Raises SettingsError."""
        return self.compaction.key()

    @property
    def model_routes(self) -> tuple[ModelRoute, ...]:
        """The configured ``models:`` as routes (validated in ``__init__``)."""
        return parse_models(self.models)

    @property
    def limits(self) -> Limits:
        """The server-wide request limits (a `budget.Limits`)."""
        return self.loop.limits

    def to_env(self) -> dict[str, str]:
        """These settings as one environment variable, to hand to worker processes."""
        return {ENV_PREFIX + "SETTINGS_JSON": json.dumps(self.flat())}

    @classmethod
    def from_env_json(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """Rebuild the settings `to_env` exported (used by worker processes)."""
        raw = environ.get(ENV_PREFIX + "SETTINGS_JSON")
        if raw is None:
            return load_settings({}, environ)
        return cls(**json.loads(raw))


def _check_compact_api(api: str, mode: str, routes: tuple[ModelRoute, ...]) -> None:
    """Refuse ``upstream_compact upstream`` wherever the upstream speaks Chat Completions (the
    server-wide pair, or a model's own or inherited values): a Chat upstream has no
    ``/responses/compact``, compaction there is always the gateway's (README "Compaction").
    Raises SettingsError (field ``upstream_compact``, or ``models`` for a model's)."""
    if api == "chat" and mode == "upstream":
        raise SettingsError(COMPACT_NEEDS_RESPONSES, field="upstream_compact")
    for route in routes:
        if route.api(api) == "chat" and (route.upstream_compact or mode) == "upstream":
            raise SettingsError(f"models.{route.name}: {COMPACT_NEEDS_RESPONSES}", field="models")


#: The dialect settings only a Chat Completions upstream reads (`middleware.upstream.chat.dialect`).
DIALECT_SETTINGS = tuple(DIALECT_CHOICES)


def ignored_dialect_settings(settings: Settings) -> list[str]:
    """The dialect settings set to a non-default value where no upstream reads them, as
    ``name=value`` (server-wide: while neither the server nor any model speaks ``chat``) and
    ``models.NAME.name=value`` (a model whose upstream speaks ``responses``); empty when none.
    ``loopwarden serve`` warns about them once at start-up."""
    defaults = {name: FIELDS[name].default for name in DIALECT_SETTINGS}
    server_api = settings.upstream.api
    routes = settings.model_routes
    out = []
    if server_api != "chat" and not any(route.upstream_api == "chat" for route in routes):
        for name, default in defaults.items():
            if (value := getattr(settings.upstream, name)) != default:
                out.append(f"{name}={value}")
    for route in routes:
        if route.api(server_api) == "chat":
            continue
        for name, default in defaults.items():
            if (value := getattr(route, name)) not in (None, default):
                out.append(f"models.{route.name}.{name}={value}")
    return out


def _coerce(entry: FlatSetting, value: Any, source: str) -> Any:
    """Convert `value` (from `source`) to the type of setting `entry`; SettingsError if it cannot."""
    name, kind = entry.name, entry.type
    if value is None:
        return None
    if kind == "dict[str, Any]":
        if isinstance(value, Mapping):
            return dict(value)
        raise SettingsError(
            f"{name} from {source} must be a mapping (set it in the config file), got {value!r}"
        )
    if kind == "tuple[str, ...]":
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise SettingsError(f"{name} from {source} must be a list of strings, got {value!r}")
    try:
        if kind in ("int", "float") and (
            isinstance(value, bool) or (isinstance(value, str) and not value.strip().isascii())
        ):
            raise ValueError  # true is not 1 second; "٣٣" is not 33
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)  # a string over 4300 digits is a ValueError too
        if kind == "float":
            number = float(value)
            if not math.isfinite(number):
                raise ValueError
            return number
        return str(value)
    except (TypeError, ValueError, OverflowError):
        raise SettingsError(
            f"{name} from {source} must be {kind.replace('|', 'or')}, got {value!r}"
        ) from None


def read_config_file(path: str, specs: Mapping[str, FlatSetting] = FIELDS) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) config file into a dict by flat name.

    Keys may use dashes or underscores. Raises SettingsError for a missing or malformed file or an
    unknown key (the message lists the known keys).
    """
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if p.suffix == ".toml":
            data: Any = tomllib.loads(text.decode("utf-8"))
        else:
            data = yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: an integer literal over Python's 4300-digit limit
        raise SettingsError(
            f"config file {path} is not valid {p.suffix.lstrip('.') or 'YAML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of settings, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in specs or name == "config":
            known = ", ".join(sorted(n for n in specs if n != "config"))
            raise SettingsError(f"unknown setting {key!r} in config file {path}; known settings: {known}")
        out[name] = _coerce(specs[name], value, f"config file {path}")
    return out


def read_env(environ: Mapping[str, str], specs: Mapping[str, FlatSetting] = FIELDS) -> dict[str, Any]:
    """The settings given as ``LOOPWARDEN_<NAME>`` variables (empty ones ignored), by flat name,
    converted to their types. Raises SettingsError naming the variable for a value of the wrong type."""
    out: dict[str, Any] = {}
    for name, entry in specs.items():
        key = entry.env
        if environ.get(key, "") != "":
            out[name] = _coerce(entry, environ[key], f"${key}")
    return out


def load_settings(flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> Settings:
    """Resolve `Settings` from flags (only those given, i.e. not None), env and the config file.

    Raises SettingsError naming the field, range and value for anything invalid.
    """
    given = {k: v for k, v in flags.items() if v is not None and k in FIELDS}
    env = read_env(environ)
    config_path = given.get("config") or env.get("config")
    from_file = read_config_file(config_path) if config_path else {}
    flagged = {k: _coerce(FIELDS[k], v, "--flag") for k, v in given.items()}
    try:
        return Settings(**{**from_file, **env, **flagged})
    except SettingsError as exc:
        # name where the faulty value came from, as the type errors of `_coerce` do
        field = exc.field
        if field is None or field in flagged:
            raise
        if field in env:
            raise SettingsError(f"{exc} (from ${FIELDS[field].env})", field=field) from None
        if field in from_file:
            raise SettingsError(f"{exc} (from config file {config_path})", field=field) from None
        raise


def default_text(entry: FlatSetting, *, markdown: bool = True) -> str:
    """The default of `entry` as documented: ``"`600` s"``, ``"`10` (1..=100)"``, ``"—"``
    (none), or its ``default_doc``. Without `markdown`, as ``--help`` shows it inside its
    parentheses: ``"default 600 s"``, ``"default 10, range 1..=100"``, ``"default 0: no cap"``,
    ``"default: none"``, ``"default: none — open"``, ``"default: embedded dev model"``, or ``""``
    when there is none to show."""
    spec, value = entry.spec, entry.default
    if not markdown:
        return _plain_default(entry)
    if spec.default_doc:
        return spec.default_doc
    if value in (None, (), {}):
        return "—"
    text = f"`{_num(value)}`" + (" s" if spec.unit == _S else "")
    if spec.high is not None:
        text += f" ({_range_text(spec).removeprefix('in ')})"
    return text


def _plain_default(entry: FlatSetting) -> str:
    """`default_text` for ``--help``: no Markdown, no nested parentheses."""
    spec, value = entry.spec, entry.default
    if spec.default_doc:
        text = spec.default_doc.replace("`", "").replace("*", "")
        if text.startswith("— (") and text.endswith(")"):  # "— (open)": no value, and its meaning
            meaning = text[3:-1]
            return "default: none" if meaning == "none" else f"default: none — {meaning}"
        if text.startswith("(") and text.endswith(")"):  # "*(embedded dev model)*"
            return f"default: {text[1:-1]}"
        value_text, sep, meaning = text.partition(" (")
        if sep and meaning.endswith(")"):  # "`0` (no cap)"
            return f"default {value_text}: {meaning[:-1]}"
        return f"default {text}"
    if value in (None, (), {}):
        return ""
    text = f"default {_num(value)}" + (" s" if spec.unit == _S else "")
    if spec.high is not None:
        text += f", range {_range_text(spec).removeprefix('in ')}"
    return text


def readme_table(specs: Mapping[str, FlatSetting] = FIELDS) -> str:
    """The README configuration table (Markdown) made from `specs`: one row per setting, in
    group order, naming the flag (or, without one, the variable and file key), the default,
    the meaning and where the value lives in code."""
    rows = ["| setting | default | meaning | in code |", "|---|---|---|---|"]
    for entry in specs.values():
        if entry.spec.flag:
            where = f"`{entry.flag}`"
        elif entry.type == "dict[str, Any]":
            where = f"`{entry.name}:` (config file only)"
        else:
            where = f"`${entry.env}` or `{entry.name}:` in the file"
        path = f"settings.{entry.group}.{entry.field}" if entry.group else f"settings.{entry.field}"
        meaning = entry.spec.doc or entry.spec.help
        rows.append(f"| {where} | {default_text(entry)} | {meaning} | `{path}` |")
    return "\n".join(rows) + "\n"


README_BEGIN = "<!-- settings-table: generated by `python -m middleware.config --write`; do not edit -->\n"
README_END = "<!-- settings-table: end -->\n"


def readme_with_table(readme: str, specs: Mapping[str, FlatSetting] = FIELDS) -> str:
    """`readme` with the text between `README_BEGIN` and `README_END` replaced by `readme_table`.

    Raises SettingsError when the markers are missing."""
    start, end = readme.find(README_BEGIN), readme.find(README_END)
    if start < 0 or end < start:
        raise SettingsError("README.md has no settings-table markers")
    return readme[: start + len(README_BEGIN)] + readme_table(specs) + readme[end:]


def main(argv: list[str] | None = None) -> int:
    """``python -m middleware.config --write | --check [README]``: regenerate the README table,
    or exit 1 when it differs from the field metadata (like ``dashboards.generate --check``)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the table in README")
    mode.add_argument("--check", action="store_true", help="exit 1 when the table is stale")
    parser.add_argument(
        "readme", nargs="?", default=str(Path(__file__).resolve().parent.parent / "README.md")
    )
    args = parser.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text(encoding="utf-8")
    wanted = readme_with_table(text)
    if args.write:
        path.write_text(wanted, encoding="utf-8")
        return 0
    if wanted != text:
        print(f"{path}: the configuration table is stale; run python -m middleware.config --write")
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
