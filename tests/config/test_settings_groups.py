"""Settings by concern (issue 22.1): groups validated from field metadata; the flags, the
``LOOPWARDEN_*`` variables and the README table generated from that metadata; flat names kept."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from middleware import cli
from middleware.config import (
    FIELDS,
    GROUPS,
    README_BEGIN,
    README_END,
    Settings,
    SettingsError,
    ToolSettings,
    UpstreamSettings,
    load_settings,
    read_config_file,
    read_env,
    readme_table,
    readme_with_table,
    setting,
    setting_specs,
)
from middleware.config import main as config_main

ROOT = Path(__file__).resolve().parents[2]

#: every ``loopwarden serve`` flag before the groups (users rely on them)
_OLD_FLAGS = """--api-key --api-key-file --background-event-log-bytes --background-event-log-retention
--background-lease-seconds --backlog --charge-model --client-body-timeout --client-write-timeout
--compact-max-output-tokens --compact-secret-file --config --drain-timeout --header-timeout --host --http
--keepalive-interval --keepalive-timeout --log-format --log-level --loop --max-concurrent-requests
--max-connections --max-header-bytes --max-infer-iters --max-inflight-retained-bytes
--max-inflight-share-per-caller --max-retained-bytes --mcp-allow --mcp-idle-sessions-per-server
--mcp-list-cache-bytes --mcp-list-ttl --mcp-server --mcp-session-idle-timeout --memory-pressure-threshold
--port --request-deadline --retry-after --retry-shield-max-bytes --retry-shield-max-entries
--retry-shield-seconds --store --tool-concurrency --tool-max-result-bytes --tool-timeout --upstream
--upstream-api-key --upstream-client --upstream-compact --upstream-connect-timeout --upstream-deadline
--upstream-max-connections --upstream-read-timeout --websocket-idle-timeout --websocket-max-lifetime
--workers
--upstream-api --reasoning-dialect --reasoning-replay --max-tokens-field --tool-call-profile --developer-role"""
OLD_FLAGS = _OLD_FLAGS.split()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolsWithRetries(ToolSettings):
    """A setting added as one field, at test time."""

    tool_retries: int = setting(3, "retries of a failed gateway tool call", low=0, high=10)


def _serve_parser(specs: dict[str, object] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="serve", argument_default=None)
    cli.add_setting_flags(parser, specs if specs is not None else FIELDS)  # type: ignore[arg-type]
    return parser


def test_a_setting_added_as_one_field_shows_up_in_help_env_and_readme() -> None:
    specs = setting_specs({**GROUPS, "tools": ToolsWithRetries})
    parser = _serve_parser(specs)  # type: ignore[arg-type]
    help_text = " ".join(parser.format_help().split())
    assert (
        "--tool-retries TOOL_RETRIES retries of a failed gateway tool call (default 3, range 0..=10; "
        in help_text
    )
    assert "$LOOPWARDEN_TOOL_RETRIES)" in help_text
    assert parser.parse_args(["--tool-retries", "4"]).tool_retries == 4
    assert parser.parse_args([]).tool_retries is None  # unset: the env, file or default decide
    assert read_env({"LOOPWARDEN_TOOL_RETRIES": "7", "LOOPWARDEN_PORT": ""}, specs) == {"tool_retries": 7}
    with pytest.raises(
        SettingsError, match=r"tool_retries from \$LOOPWARDEN_TOOL_RETRIES must be int, got 'x'"
    ):
        read_env({"LOOPWARDEN_TOOL_RETRIES": "x"}, specs)
    row = "| `--tool-retries` | `3` (0..=10) | retries of a failed gateway tool call | `settings.tools.tool_retries` |"
    assert row in readme_table(specs).splitlines()
    assert row not in readme_table().splitlines()
    # and its range is checked from the same metadata
    assert ToolsWithRetries(tool_retries=10).tool_retries == 10
    with pytest.raises(SettingsError) as info:
        ToolsWithRetries(tool_retries=11)
    assert str(info.value) == "tool_retries must be in 0..=10, got 11"


def test_a_setting_added_as_one_field_is_a_config_file_key(tmp_path: Path) -> None:
    specs = setting_specs({**GROUPS, "tools": ToolsWithRetries})
    cfg = tmp_path / "lw.yaml"
    cfg.write_text("tool-retries: 5\ntool_timeout: 9\n")
    assert read_config_file(str(cfg), specs) == {"tool_retries": 5, "tool_timeout": 9.0}
    with pytest.raises(SettingsError, match="unknown setting 'tool-retries'"):
        read_config_file(str(cfg))  # not a setting of the real groups


def test_every_old_flag_env_name_and_file_key_still_exists() -> None:
    flags = {entry.flag for entry in FIELDS.values() if entry.spec.flag}
    assert flags == set(OLD_FLAGS)
    help_text = _serve_parser().format_help()
    for flag in OLD_FLAGS:
        assert f"{flag} " in help_text
    names = {flag[2:].replace("-", "_") for flag in OLD_FLAGS}
    assert names | {"models", "compact_secret"} == set(FIELDS)
    assert {entry.env for entry in FIELDS.values()} == {"LOOPWARDEN_" + n.upper() for n in FIELDS}


def test_repeatable_and_typed_flags_parse_like_before() -> None:
    args = _serve_parser().parse_args(
        [
            "--mcp-server",
            "a=http://a/mcp",
            "--mcp-server",
            "b=http://b/mcp",
            "--port",
            "9",
            "--retry-after",
            "2",
        ]
    )
    assert (args.mcp_server, args.port, args.retry_after) == (["a=http://a/mcp", "b=http://b/mcp"], 9, 2.0)
    settings = load_settings(vars(args), {})
    assert settings.tools.mcp_server == ("a=http://a/mcp", "b=http://b/mcp")
    assert (settings.transport.port, settings.admission.retry_after) == (9, 2.0)


def test_serve_help_lists_defaults_units_and_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "--upstream-read-timeout UPSTREAM_READ_TIMEOUT seconds allowed for the first byte and between" in out
    )
    assert "(default 600 s; $LOOPWARDEN_UPSTREAM_READ_TIMEOUT)" in out
    assert "--upstream-client {aiohttp,httpx}" in out
    assert (
        "--max-concurrent-requests MAX_CONCURRENT_REQUESTS requests in flight per worker (default 0: no cap;"
        in out
    )
    assert "--compact-secret " not in out  # environment and file only, as before


def test_readme_table_is_generated_from_the_metadata() -> None:
    assert config_main(["--check", str(ROOT / "README.md")]) == 0
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index(README_BEGIN) + len(README_BEGIN) : text.index(README_END)]
    assert table == readme_table()
    assert len(table.splitlines()) == 2 + len(FIELDS)
    assert "| `--max-retained-bytes` | `67108864` (4096..=268435456) |" in table
    assert "| `models:` (config file only) | — |" in table
    assert "| `$LOOPWARDEN_COMPACT_SECRET` or `compact_secret:` in the file | — |" in table


def test_readme_check_fails_on_a_stale_table(tmp_path: Path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(f"# x\n\n{README_BEGIN}| old | table |\n{README_END}\nafter\n", encoding="utf-8")
    assert config_main(["--check", str(stale)]) == 1
    assert config_main(["--write", str(stale)]) == 0
    assert config_main(["--check", str(stale)]) == 0
    assert stale.read_text(encoding="utf-8").endswith(f"{README_END}\nafter\n")
    with pytest.raises(SettingsError, match="no settings-table markers"):
        readme_with_table("# no markers\n")


def test_flat_constructor_composes_groups() -> None:
    s = Settings(upstream="http://127.0.0.1:1/v1", upstream_read_timeout=5, max_infer_iters=3, store="memory")
    assert s.upstream == UpstreamSettings(url="http://127.0.0.1:1/v1", read_timeout=5)
    assert (s.loop.max_infer_iters, s.store.url, s.transport.loop) == (3, "memory", "uvloop")
    assert s.limits.max_infer_iters == 3
    grouped = Settings(upstream=UpstreamSettings(url="http://127.0.0.1:1/v1", read_timeout=5), loop="asyncio")
    assert grouped.upstream == s.upstream and grouped.transport.loop == "asyncio"
    # a group and a flat name of it: the flat name changes that one field of the group
    both = Settings(upstream=UpstreamSettings(read_timeout=5), upstream_deadline=9)
    assert (both.upstream.read_timeout, both.upstream.deadline) == (5, 9)
    with pytest.raises(TypeError, match="unexpected keyword argument 'upstream_read_timeuot'"):
        Settings(upstream_read_timeuot=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.upstream = UpstreamSettings()  # type: ignore[misc]


def test_replace_changes_one_field_and_keeps_the_other_groups() -> None:
    """What a per-model override does (`create_app`): one field of one group, nothing else."""
    base = Settings(upstream="http://127.0.0.1:1/v1", upstream_connect_timeout=2, tool_timeout=7)
    routed = base.replace(upstream_read_timeout=30, upstream_api_key="model-key")
    assert routed.upstream == UpstreamSettings(
        url="http://127.0.0.1:1/v1", connect_timeout=2, read_timeout=30, api_key="model-key"
    )
    assert routed.tools is base.tools and routed.loop is base.loop and routed.transport is base.transport
    assert base.upstream.read_timeout == 600.0  # frozen: the original is unchanged
    assert base.replace(upstream="http://other/v1").upstream.connect_timeout == 2  # the URL only
    with pytest.raises(
        SettingsError, match="upstream_read_timeout must be a positive number of seconds, got 0"
    ):
        base.replace(upstream_read_timeout=0)


def test_groups_validate_themselves_with_the_flat_names() -> None:
    with pytest.raises(SettingsError) as info:
        UpstreamSettings(read_timeout=0)
    assert str(info.value) == "upstream_read_timeout must be a positive number of seconds, got 0"
    with pytest.raises(SettingsError) as info:
        ToolSettings(concurrency=101)
    assert str(info.value) == "tool_concurrency must be in 1..=100, got 101"
    with pytest.raises(SettingsError) as info:
        ToolSettings(mcp_list_ttl=float("nan"))
    assert str(info.value) == "mcp_list_ttl must be a number of seconds >= 0 (0: never cache), got nan"
    with pytest.raises(SettingsError) as info:
        Settings(log_level="loud")
    assert str(info.value) == "log_level must be critical, error, warning, info or debug, got 'loud'"
    with pytest.raises(SettingsError) as info:
        Settings(store="mysql://x")
    assert str(info.value) == "store must be memory, sqlite:///PATH or postgresql://..., got 'mysql'"
    with pytest.raises(SettingsError) as info:
        Settings(mcp_server=["nolabel"])
    assert str(info.value) == "mcp_server entries must look like LABEL=http(s)://HOST/PATH, got 'nolabel'"


def test_every_setting_has_help_and_its_default_passes_its_own_checks() -> None:
    for name, entry in FIELDS.items():
        assert entry.spec.help, name
        if entry.spec.choices:
            assert entry.default in entry.spec.choices, name
    for cls in GROUPS.values():
        cls()  # every default is valid


def test_worker_round_trip_keeps_groups_and_lists() -> None:
    s = Settings(
        upstream="http://127.0.0.1:1/v1", mcp_allow=("http://a/",), api_key=("k1",), retry_shield_seconds=0
    )
    again = Settings.from_env_json(s.to_env())
    assert again == s
    assert again.tools.mcp_allow == ("http://a/",) and again.admission.api_key == ("k1",)
    assert "k1" not in repr(s)  # secrets stay out of repr
