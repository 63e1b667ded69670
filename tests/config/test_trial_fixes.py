"""What the new-user trial found on the configuration side: ``models:`` keys with dashes, the
generated ``models:`` row, the start-up line and the ignored-dialect warning, where a range
error's value came from, one wording for choices, and ``--help`` text."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from middleware import cli
from middleware.asgi.models import ROUTE_FIELDS, ModelConfigError, parse_models
from middleware.config import (
    FIELDS,
    Settings,
    SettingsError,
    ignored_dialect_settings,
    load_settings,
    readme_table,
)
from tests.servers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


# -- 2. models: keys take dashes; the README row lists every per-model key --------------------------
def test_models_keys_take_dashes_like_top_level_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "lw.yaml"
    cfg.write_text(
        "max-infer-iters: 4\n"
        "models:\n"
        "  qwen:\n"
        "    upstream-api: chat\n"
        "    max-infer-iters: 3\n"
        "    tool-call-profile: tolerant\n"
        "    upstream_read_timeout: 9\n"
    )
    (route,) = load_settings({"config": str(cfg)}, {}).model_routes
    assert (route.upstream_api, route.max_infer_iters, route.tool_call_profile) == ("chat", 3, "tolerant")
    assert route.upstream_read_timeout == 9
    with pytest.raises(ModelConfigError, match=r"models\.m: unknown setting\(s\) \['upstream_apis'\]"):
        parse_models({"m": {"upstream-apis": "chat"}})


def test_the_models_row_lists_every_per_model_key() -> None:
    (row,) = [line for line in readme_table().splitlines() if line.startswith("| `models:`")]
    listed = re.findall(r"`([a-z][a-z_]+)`", row.split(" | ")[2])
    assert set(listed) - {"fnmatch"} == set(ROUTE_FIELDS)
    for key in ("upstream_api", "reasoning_dialect", "reasoning_replay", "max_tokens_field"):
        assert f"`{key}`" in row
    assert "`tool_call_profile`, `developer_role`" in row and "`charge_model`" in row


# -- 3. the start-up line and the ignored-dialect warning ----------------------------------------------
def test_dialect_settings_on_a_responses_upstream_are_reported_as_ignored() -> None:
    assert ignored_dialect_settings(Settings()) == []
    assert ignored_dialect_settings(Settings(upstream_api="chat", reasoning_dialect="reasoning")) == []
    server = Settings(
        reasoning_dialect="reasoning", developer_role="system", max_tokens_field="max_completion_tokens"
    )
    assert ignored_dialect_settings(server) == ["reasoning_dialect=reasoning", "developer_role=system"]
    # a chat model inherits the server-wide dialect: not ignored; a responses model's own is
    mixed = Settings(
        reasoning_dialect="reasoning",
        models={
            "c": {"upstream_api": "chat"},
            "r": {"tool_call_profile": "tolerant", "developer_role": "developer"},
        },
    )
    assert ignored_dialect_settings(mixed) == ["models.r.tool_call_profile=tolerant"]
    chat = Settings(
        upstream_api="chat", models={"r": {"upstream_api": "responses", "reasoning_replay": "reasoning"}}
    )
    assert ignored_dialect_settings(chat) == ["models.r.reasoning_replay=reasoning"]


def _start_up_stderr(*args: str) -> list[str]:
    """The stderr lines of a real ``loopwarden serve`` up to its first healthy answer."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWARDEN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "middleware.cli", "serve", "--port", str(port), "--store", "memory", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=30, what="loopwarden serve")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    return err.splitlines()


def test_start_up_names_the_upstream_api_and_warns_once_about_ignored_dialect_settings() -> None:
    lines = _start_up_stderr(
        "--upstream",
        "http://127.0.0.1:9/v1",
        "--reasoning-dialect",
        "reasoning",
        "--developer-role",
        "system",
    )
    (start,) = [line for line in lines if "starting on" in line]
    assert "(upstream: http://127.0.0.1:9/v1, upstream_api=responses, max_infer_iters=10," in start
    warnings = [line for line in lines if "ignored" in line]
    assert warnings == [
        "loopwarden: WARNING: ignored, the upstream speaks responses: reasoning_dialect=reasoning, "
        "developer_role=system; these settings apply only with upstream_api chat (server-wide or that "
        "model's)"
    ]
    chat = _start_up_stderr(
        "--upstream", "http://127.0.0.1:9/v1", "--upstream-api", "chat", "--developer-role", "system"
    )
    assert any("upstream_api=chat," in line for line in chat if "starting on" in line)
    assert not any("ignored" in line for line in chat)


# -- 4. where a range error's value came from; one wording for choices --------------------------------
def test_a_range_error_names_the_variable_or_the_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings({}, {"LOOPWARDEN_MAX_RETAINED_BYTES": "4095"})
    assert str(info.value) == (
        "max_retained_bytes must be in 4096..=268435456, got 4095 (from $LOOPWARDEN_MAX_RETAINED_BYTES)"
    )
    cfg = tmp_path / "lw.yaml"
    cfg.write_text("tool_concurrency: 101\n")
    with pytest.raises(SettingsError) as info:
        load_settings({"config": str(cfg)}, {})
    assert str(info.value) == f"tool_concurrency must be in 1..=100, got 101 (from config file {cfg})"
    cfg.write_text("models:\n  m: {max_infer_iters: 0}\n")
    with pytest.raises(SettingsError) as info:
        load_settings({"config": str(cfg)}, {})
    assert str(info.value) == f"models.m: max_infer_iters must be in 1..=100, got 0 (from config file {cfg})"
    # the environment wins over the file, so its variable is named; a flag needs no source
    cfg.write_text("log_level: info\n")
    with pytest.raises(SettingsError) as info:
        load_settings({"config": str(cfg)}, {"LOOPWARDEN_LOG_LEVEL": "loud"})
    assert str(info.value) == (
        "log_level must be critical, error, warning, info or debug, got 'loud' (from $LOOPWARDEN_LOG_LEVEL)"
    )
    with pytest.raises(SettingsError) as info:
        load_settings({"max_infer_iters": 0}, {"LOOPWARDEN_MAX_INFER_ITERS": "5"})
    assert str(info.value) == "max_infer_iters must be in 1..=100, got 0"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"upstream_api": "grpc"}, "upstream_api must be responses or chat, got 'grpc'"),
        (
            {"reasoning_dialect": "x"},
            "reasoning_dialect must be reasoning_content, reasoning or none, got 'x'",
        ),
        (
            {"models": {"m": {"upstream_api": "grpc"}}},
            "models.m.upstream_api must be responses or chat, got 'grpc'",
        ),
        (
            {"models": {"m": {"upstream-compact": "never"}}},
            "models.m.upstream_compact must be auto, upstream or gateway, got 'never'",
        ),
        (
            {"models": {"m": {"charge_model": "x"}}},
            "models.m.charge_model must be measured or reference, got 'x'",
        ),
    ],
)
def test_choices_are_worded_one_way(values: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings(**values)
    assert str(info.value) == message
    assert "one of" not in message


# -- 5. help text -----------------------------------------------------------------------------------
def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_serve_help_has_no_oddities(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(["serve", "--help"], capsys)
    assert (
        "--upstream UPSTREAM base URL of the model server, e.g. http://127.0.0.1:8000/v1: a Responses API"
        in out
    )
    assert (
        "or a Chat Completions one with --upstream-api chat (default: embedded dev model; $LOOPWARDEN_UPSTREAM)"
        in out
    )
    assert out.count("$LOOPWARDEN_UPSTREAM_API_KEY") == 1
    assert out.count("$LOOPWARDEN_API_KEY)") == 1 and "$LOOPWARDEN_API_KEY or" not in out
    assert "(default: none — open; $LOOPWARDEN_API_KEY)" in out
    assert "(default: none; $LOOPWARDEN_MCP_ALLOW)" in out
    assert "(default 10, range 1..=100; $LOOPWARDEN_MAX_INFER_ITERS)" in out
    assert "(default 0: no cap; $LOOPWARDEN_MAX_CONCURRENT_REQUESTS)" in out
    for odd in ("— (", "default —", "default (", "((", "``", "`", "*("):
        assert odd not in out, odd
    for entry in FIELDS.values():  # every flag names its variable exactly once
        if entry.spec.flag:
            assert out.count(f"${entry.env})") + out.count(f"${entry.env};") == 1, entry.env


def test_top_level_and_devmodel_help_are_plain_and_described(capsys: pytest.CaptureFixture[str]) -> None:
    top = _help(["--help"], capsys)
    assert "``" not in top
    assert "loopwarden: a gateway for the OpenAI Responses API" in top
    dev = _help(["devmodel", "--help"], capsys)
    assert "Serve the embedded development model alone" in dev
    assert "--host HOST address to listen on (default 127.0.0.1)" in dev
    assert "--port PORT port to listen on (default 8000)" in dev
