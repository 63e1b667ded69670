"""Gateway configuration: one frozen `Settings` object resolved from four sources.

Precedence (DESIGN.md §3): command-line flags > ``LOOPWARDEN_*`` environment variables >
the config file (YAML or TOML, ``--config FILE``) > the defaults below. Every value is
validated once, at start-up; an invalid value raises `SettingsError` with a message naming the
field, the allowed range and the value given (the ``budget.Limits`` wording).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from budget import Limits
from middleware.asgi.models import ModelConfigError, ModelRoute, parse_models
from middleware.upstream.chat.dialect import DIALECT_CHOICES

ENV_PREFIX = "LOOPWARDEN_"
#: ``upstream_compact`` values: who answers ``POST /v1/responses/compact`` (README "Compaction").
COMPACT_MODES = ("auto", "upstream", "gateway")


class SettingsError(ValueError):
    """An invalid `Settings` value or config file; the message names the field and the fix.

    A `budget.ConfigError` raised by `budget.Limits` is re-raised as this, with its message."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything `loopwarden serve` needs, validated.

    Units: timeouts and intervals in seconds, sizes in bytes. ``upstream`` is the base URL of a
    Responses-compatible server including its ``/v1`` (``None``: start the embedded development
    model). ``limits`` holds ``max_infer_iters`` and ``max_retained_bytes`` (DESIGN.md §3).
    ``http`` is uvicorn's HTTP/1.1 stack (``httptools``, the default, or ``h11``) and ``loop``
    its event loop (``uvloop``, the default, or ``asyncio``): uvicorn's own names, as
    ``uvicorn[standard]`` runs; ``header_timeout``,
    ``keepalive_timeout``, ``max_connections`` and ``backlog`` (0: derived from the
    file-descriptor limit) and ``max_header_bytes`` are the connection bounds (`middleware.ops.connections`).
    ``websocket_max_lifetime`` (seconds; the spec's 60 minutes) and ``websocket_idle_timeout``
    (seconds without a message between turns) bound a WebSocket connection (`middleware.asgi.websocket`).
    ``retry_shield_seconds`` (0: off), ``retry_shield_max_entries`` and ``retry_shield_max_bytes``
    configure the per-worker retry shield (`middleware.ops.shield`).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    upstream: str | None = None
    upstream_api_key: str | None = dataclasses.field(default=None, repr=False)
    upstream_connect_timeout: float = 10.0
    upstream_read_timeout: float = 600.0
    upstream_deadline: float = 1800.0
    upstream_max_connections: int = 100
    upstream_client: str = "aiohttp"
    max_infer_iters: int = 10
    max_retained_bytes: int = 67_108_864
    charge_model: str = "measured"
    client_body_timeout: float = 30.0
    client_write_timeout: float = 30.0
    keepalive_interval: float = 15.0
    workers: int = 1
    log_level: str = "info"
    log_format: str = "text"
    mcp_server: tuple[str, ...] = ()
    mcp_allow: tuple[str, ...] = ()
    mcp_list_ttl: float = 300.0
    mcp_list_cache_bytes: int = 16_777_216
    mcp_session_idle_timeout: float = 60.0
    mcp_idle_sessions_per_server: int = 4
    tool_timeout: float = 60.0
    tool_concurrency: int = 5
    tool_max_result_bytes: int = 262_144
    max_inflight_retained_bytes: int = 0
    max_concurrent_requests: int = 0
    max_inflight_share_per_caller: float = 0.5
    retry_after: float = 1.0
    retry_shield_seconds: float = 30.0
    retry_shield_max_entries: int = 4096
    retry_shield_max_bytes: int = 16_777_216
    memory_pressure_threshold: float = 0.9
    request_deadline: float = 1800.0
    drain_timeout: float = 30.0
    background_lease_seconds: float = 30.0
    background_event_log_bytes: int = 8_388_608
    background_event_log_retention: float = 600.0
    http: str = "httptools"
    loop: str = "uvloop"
    header_timeout: float = 10.0
    keepalive_timeout: float = 5.0
    max_connections: int = 0
    max_header_bytes: int = 65_536
    backlog: int = 0
    websocket_max_lifetime: float = 3600.0
    websocket_idle_timeout: float = 300.0
    models: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    store: str = "sqlite:///./.loopwarden/loopwarden.db"
    upstream_compact: str = "auto"
    compact_max_output_tokens: int = 4096
    compact_secret: str | None = dataclasses.field(default=None, repr=False)
    compact_secret_file: str | None = None
    api_key: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    api_key_file: str | None = None
    # chat: new settings (issue 25: Chat Completions upstreams; per model under ``models:`` too)
    upstream_api: str = "responses"
    reasoning_dialect: str = "reasoning_content"
    reasoning_replay: str = "omit"
    max_tokens_field: str = "max_completion_tokens"
    tool_call_profile: str = "strict"
    developer_role: str = "developer"
    # chat: end of new settings
    config: str | None = None

    def __post_init__(self) -> None:
        for name in ("mcp_server", "mcp_allow", "api_key"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        try:
            parse_models(self.models)
        except ModelConfigError as exc:
            raise SettingsError(str(exc)) from None
        for entry in self.mcp_server:
            label, sep, url = entry.partition("=")
            if not sep or not label or not url.startswith(("http://", "https://")):
                raise SettingsError(
                    f"mcp_server entries must look like LABEL=http(s)://HOST/PATH, got {entry!r}"
                )
        if self.store != "memory" and not self.store.startswith(
            ("sqlite:///", "postgresql://", "postgres://")
        ):
            raise SettingsError(
                f"store must be memory, sqlite:///PATH or postgresql://..., got {self.store.split('://')[0]!r}"
            )
        if self.max_inflight_retained_bytes < 0:
            raise SettingsError(
                f"max_inflight_retained_bytes must be >= 0 (0: a quarter of memory / workers), got {self.max_inflight_retained_bytes}"
            )
        if self.max_concurrent_requests < 0:
            raise SettingsError(
                f"max_concurrent_requests must be >= 0 (0: no cap), got {self.max_concurrent_requests}"
            )
        if not 0 < self.max_inflight_share_per_caller <= 1:
            raise SettingsError(
                f"max_inflight_share_per_caller must be in (0, 1], got {self.max_inflight_share_per_caller}"
            )
        if not 0 < self.memory_pressure_threshold <= 1:
            raise SettingsError(
                f"memory_pressure_threshold must be in (0, 1], got {self.memory_pressure_threshold}"
            )
        if not 0 <= self.mcp_idle_sessions_per_server <= 64:
            raise SettingsError(
                f"mcp_idle_sessions_per_server must be in 0..=64, got {self.mcp_idle_sessions_per_server}"
            )
        if not self.mcp_list_ttl >= 0:
            raise SettingsError(
                f"mcp_list_ttl must be a number of seconds >= 0 (0: never cache), got {self.mcp_list_ttl}"
            )
        if not 0 <= self.mcp_list_cache_bytes <= 1_073_741_824:
            raise SettingsError(
                f"mcp_list_cache_bytes must be in 0..=1073741824 (0: never cache), got {self.mcp_list_cache_bytes}"
            )
        if not 0 <= self.background_event_log_bytes <= 268_435_456:
            raise SettingsError(
                f"background_event_log_bytes must be in 0..=268435456 (0: no resume), got {self.background_event_log_bytes}"
            )
        if not 1 <= self.tool_concurrency <= 100:
            raise SettingsError(f"tool_concurrency must be in 1..=100, got {self.tool_concurrency}")
        if not 0 <= self.retry_shield_seconds <= 3600:
            raise SettingsError(
                f"retry_shield_seconds must be in 0..=3600 (0: no retry shield), got {self.retry_shield_seconds}"
            )
        if not 0 <= self.retry_shield_max_entries <= 1_000_000:
            raise SettingsError(
                f"retry_shield_max_entries must be in 0..=1000000, got {self.retry_shield_max_entries}"
            )
        if not 0 <= self.retry_shield_max_bytes <= 1_073_741_824:
            raise SettingsError(
                f"retry_shield_max_bytes must be in 0..=1073741824, got {self.retry_shield_max_bytes}"
            )
        if not 1 <= self.tool_max_result_bytes <= 268_435_456:
            raise SettingsError(
                f"tool_max_result_bytes must be in 1..=268435456, got {self.tool_max_result_bytes}"
            )
        try:
            Limits(max_infer_iters=self.max_infer_iters, max_retained_bytes=self.max_retained_bytes)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        for name in (
            "upstream_connect_timeout",
            "upstream_read_timeout",
            "upstream_deadline",
            "client_body_timeout",
            "client_write_timeout",
            "keepalive_interval",
            "mcp_session_idle_timeout",
            "tool_timeout",
            "retry_after",
            "request_deadline",
            "drain_timeout",
            "background_lease_seconds",
            "background_event_log_retention",
            "header_timeout",
            "keepalive_timeout",
            "websocket_max_lifetime",
            "websocket_idle_timeout",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise SettingsError(f"{name} must be a positive number of seconds, got {value}")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be in 0..=65535, got {self.port}")
        if not 1 <= self.workers <= 256:
            raise SettingsError(f"workers must be in 1..=256, got {self.workers}")
        if not 1 <= self.upstream_max_connections <= 10_000:
            raise SettingsError(
                f"upstream_max_connections must be in 1..=10000, got {self.upstream_max_connections}"
            )
        if self.http not in ("h11", "httptools"):
            raise SettingsError(f"http must be h11 or httptools, got {self.http!r}")
        if self.loop not in ("asyncio", "uvloop"):
            raise SettingsError(f"loop must be asyncio or uvloop, got {self.loop!r}")
        if not 0 <= self.max_connections <= 1_000_000:
            raise SettingsError(
                f"max_connections must be in 0..=1000000 (0: the file-descriptor limit minus head-room), got {self.max_connections}"
            )
        if not 0 <= self.backlog <= 65_535:
            raise SettingsError(
                f"backlog must be in 0..=65535 (0: min(2048, the file-descriptor limit // 8)), got {self.backlog}"
            )
        if not 1024 <= self.max_header_bytes <= 1_048_576:
            raise SettingsError(f"max_header_bytes must be in 1024..=1048576, got {self.max_header_bytes}")
        if self.upstream is not None and not self.upstream.startswith(("http://", "https://")):
            raise SettingsError(f"upstream must be an http:// or https:// URL, got {self.upstream!r}")
        if self.upstream_compact not in COMPACT_MODES:
            raise SettingsError(
                f"upstream_compact must be auto, upstream or gateway, got {self.upstream_compact!r}"
            )
        if not 1 <= self.compact_max_output_tokens <= 131_072:
            raise SettingsError(
                f"compact_max_output_tokens must be in 1..=131072, got {self.compact_max_output_tokens}"
            )
        if self.compact_secret is not None and len(self.compact_secret.encode()) < 16:
            raise SettingsError(
                "compact_secret must be at least 16 bytes (use e.g. `openssl rand -hex 32`), "
                f"got {len(self.compact_secret.encode())}"
            )
        if self.charge_model not in ("measured", "reference"):
            raise SettingsError(f"charge_model must be measured or reference, got {self.charge_model!r}")
        if self.upstream_client not in ("aiohttp", "httpx"):
            raise SettingsError(f"upstream_client must be aiohttp or httpx, got {self.upstream_client!r}")
        for name, choices in {"upstream_api": ("responses", "chat"), **DIALECT_CHOICES}.items():
            if getattr(self, name) not in choices:  # chat: new settings
                raise SettingsError(
                    f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"log_format must be text or json, got {self.log_format!r}")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise SettingsError(
                f"log_level must be one of critical, error, warning, info, debug, got {self.log_level!r}"
            )

    def api_keys(self) -> list[str]:
        """The gateway API keys: ``api_key`` entries plus the lines of ``api_key_file``.

        Raises SettingsError when the file cannot be read.
        """
        keys = list(self.api_key)
        if self.api_key_file:
            try:
                text = Path(self.api_key_file).read_text()
            except OSError as exc:
                raise SettingsError(f"cannot read api_key_file {self.api_key_file}: {exc.strerror}") from None
            keys += [
                line.strip()
                for line in text.splitlines()
                if line.strip() and not line.strip().startswith("#")
            ]
        return keys

    def compact_key(self) -> bytes | None:
        """The key that seals compaction items: ``compact_secret``, else the first line of
        ``compact_secret_file``, else None (a random key per process). Raises SettingsError when
        the file cannot be read or holds fewer than 16 bytes."""
        if self.compact_secret is not None:
            return self.compact_secret.encode()
        if not self.compact_secret_file:
            return None
        try:
            text = Path(self.compact_secret_file).read_text()
        except OSError as exc:
            raise SettingsError(
                f"cannot read compact_secret_file {self.compact_secret_file}: {exc.strerror}"
            ) from None
        key = (text.strip().splitlines() or [""])[0].strip().encode()
        if len(key) < 16:
            raise SettingsError(
                f"compact_secret_file {self.compact_secret_file} must hold a secret of at least 16 bytes"
            )
        return key

    @property
    def model_routes(self) -> tuple[ModelRoute, ...]:
        """The configured ``models:`` as routes (validated in ``__post_init__``)."""
        return parse_models(self.models)

    @property
    def limits(self) -> Limits:
        """The server-wide request limits (a `budget.Limits`)."""
        return Limits(max_infer_iters=self.max_infer_iters, max_retained_bytes=self.max_retained_bytes)

    def to_env(self) -> dict[str, str]:
        """These settings as one environment variable, to hand to worker processes."""
        return {ENV_PREFIX + "SETTINGS_JSON": json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env_json(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """Rebuild the settings `to_env` exported (used by worker processes)."""
        raw = environ.get(ENV_PREFIX + "SETTINGS_JSON")
        if raw is None:
            return load_settings({}, environ)
        return cls(**json.loads(raw))


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Settings)}


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert `value` (from `source`) to the type of field `name`; SettingsError if it cannot."""
    kind = FIELDS[name].type
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
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise SettingsError(
            f"{name} from {source} must be {kind.replace('|', 'or')}, got {value!r}"
        ) from None


def read_config_file(path: str) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) config file into a dict.

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
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SettingsError(
            f"config file {path} is not valid {p.suffix.lstrip('.') or 'YAML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of settings, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS or name == "config":
            known = ", ".join(sorted(n for n in FIELDS if n != "config"))
            raise SettingsError(f"unknown setting {key!r} in config file {path}; known settings: {known}")
        out[name] = _coerce(name, value, f"config file {path}")
    return out


def load_settings(flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> Settings:
    """Resolve `Settings` from flags (only those given, i.e. not None), env and the config file.

    Raises SettingsError naming the field, range and value for anything invalid.
    """
    given = {k: v for k, v in flags.items() if v is not None and k in FIELDS}
    env: dict[str, Any] = {}
    for name in FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in environ and environ[key] != "":
            env[name] = _coerce(name, environ[key], f"${key}")
    config_path = given.get("config") or env.get("config")
    from_file = read_config_file(config_path) if config_path else {}
    merged: dict[str, Any] = {**from_file, **env, **{k: _coerce(k, v, "--flag") for k, v in given.items()}}
    try:
        return Settings(**merged)
    except TypeError as exc:  # pragma: no cover - guarded by FIELDS
        raise SettingsError(str(exc)) from None
