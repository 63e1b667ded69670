"""Hostile values in the environment, the config file and ``models:`` are refused with a
SettingsError (the CLI's exit 2 and a message naming the setting), never a traceback or a
silently wrong value (attacker trial at stop 28: exit 1 on a 5000-digit integer, ``true``
taken as 1 second, ``inf`` seconds, Arabic-Indic digits taken as a port)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from middleware.config import Settings, SettingsError, load_settings, read_config_file, read_env


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("LOOPWARDEN_PORT", "٣٣٣٣"),  # Arabic-Indic digits: int() takes them
        ("LOOPWARDEN_PORT", "３３３３"),  # full-width digits
        ("LOOPWARDEN_TOOL_TIMEOUT", "inf"),
        ("LOOPWARDEN_TOOL_TIMEOUT", "nan"),
        ("LOOPWARDEN_RETRY_AFTER", "1e309"),
        ("LOOPWARDEN_MAX_RETAINED_BYTES", "9" * 5000),  # over Python's int-string limit
    ],
)
def test_environment_values_that_are_not_plain_finite_numbers_are_refused(name: str, text: str) -> None:
    with pytest.raises(SettingsError, match=rf"\${name}"):
        load_settings({}, {name: text})


@pytest.mark.parametrize(
    ("suffix", "text", "key"),
    [
        (".yaml", "max_retained_bytes: " + "9" * 5000 + "\n", "max_retained_bytes"),
        (".toml", "max_retained_bytes = " + "9" * 5000 + "\n", "max_retained_bytes"),
        (".yaml", "upstream_read_timeout: true\n", "upstream_read_timeout"),
        (".yaml", "compact_max_output_tokens: true\n", "compact_max_output_tokens"),
        (".yaml", "tool_timeout: .inf\n", "tool_timeout"),
        (".toml", "retry_after = inf\n", "retry_after"),
    ],
)
def test_config_file_values_that_are_not_plain_finite_numbers_are_refused(
    tmp_path: Path, suffix: str, text: str, key: str
) -> None:
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(SettingsError) as info:
        Settings(**read_config_file(str(path)))
    message = str(info.value)
    assert key in message or "not valid" in message  # names the setting, or the file it could not read


@pytest.mark.parametrize(
    "entry",
    [
        {"upstream_read_timeout": True},
        {"upstream_deadline": math.inf},
        {"compact_max_output_tokens": True},
        {1: "x", "foo": "y"},  # a non-string key among string ones: no TypeError from sorting
    ],
)
def test_model_entries_that_are_not_plain_values_are_refused(entry: dict[object, object]) -> None:
    with pytest.raises(SettingsError, match=r"models\.m"):
        Settings(models={"m": entry})


def test_plain_values_still_pass() -> None:
    s = load_settings({}, {"LOOPWARDEN_PORT": "8081", "LOOPWARDEN_TOOL_TIMEOUT": "2.5"})
    assert (s.transport.port, s.tools.timeout) == (8081, 2.5)
    assert read_env({"LOOPWARDEN_PORT": " 8082 "})["port"] == 8082
