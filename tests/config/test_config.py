"""Configuration precedence (flags > env > file > defaults) and start-up validation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from middleware.config import Settings, SettingsError, load_settings
from tests.servers import wait_healthy


def test_defaults() -> None:
    s = load_settings({}, {})
    assert (s.transport.host, s.transport.port, s.upstream.url) == ("127.0.0.1", 8080, None)
    assert (s.loop.max_infer_iters, s.loop.max_retained_bytes) == (10, 67_108_864)
    assert (s.upstream.connect_timeout, s.upstream.read_timeout, s.upstream.deadline) == (10.0, 600.0, 1800.0)


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    cfg = tmp_path / "lw.yaml"
    cfg.write_text("port: 9001\nmax-infer-iters: 4\nmax_retained_bytes: 100000\nupstream: http://file/v1\n")
    env = {"LOOPWARDEN_PORT": "9002", "LOOPWARDEN_MAX_INFER_ITERS": "5"}
    s = load_settings({"config": str(cfg), "port": 9003}, env)
    assert s.transport.port == 9003  # flag
    assert s.loop.max_infer_iters == 5  # env over file
    assert s.loop.max_retained_bytes == 100_000  # file over default
    assert s.upstream.url == "http://file/v1"


def test_toml_config(tmp_path: Path) -> None:
    cfg = tmp_path / "lw.toml"
    cfg.write_text('upstream = "http://127.0.0.1:8000/v1"\nmax_retained_bytes = 4096\n')
    s = load_settings({"config": str(cfg)}, {})
    assert (s.upstream.url, s.loop.max_retained_bytes) == ("http://127.0.0.1:8000/v1", 4096)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"max_retained_bytes": 4095}, "max_retained_bytes must be in 4096..=268435456, got 4095"),
        (
            {"max_retained_bytes": 268_435_457},
            "max_retained_bytes must be in 4096..=268435456, got 268435457",
        ),
        ({"max_infer_iters": 0}, "max_infer_iters must be in 1..=100, got 0"),
        ({"max_infer_iters": 101}, "max_infer_iters must be in 1..=100, got 101"),
        ({"upstream_read_timeout": 0}, "upstream_read_timeout must be a positive number of seconds, got 0.0"),
        ({"upstream": "ftp://x"}, "upstream must be an http:// or https:// URL, got 'ftp://x'"),
    ],
)
def test_invalid_values_name_field_range_and_value(flags: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(flags, {})
    assert str(info.value) == message


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(SettingsError, match=r"max_infer_iters from \$LOOPWARDEN_MAX_INFER_ITERS must be int"):
        load_settings({}, {"LOOPWARDEN_MAX_INFER_ITERS": "lots"})


def test_unknown_config_key_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "lw.yaml"
    cfg.write_text("max_retained_byte: 5\n")
    with pytest.raises(SettingsError, match="unknown setting 'max_retained_byte'"):
        load_settings({"config": str(cfg)}, {})


def test_settings_round_trip_for_workers() -> None:
    s = Settings(upstream="http://127.0.0.1:1/v1", max_infer_iters=3)
    assert Settings.from_env_json(s.to_env()) == s


def _cli() -> list[str]:
    return [str(Path(sys.executable).parent / "loopwarden")]


def test_cli_refuses_invalid_limit_with_exit_2() -> None:
    proc = subprocess.run(
        [*_cli(), "serve", "--max-retained-bytes", "4095"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "max_retained_bytes must be in 4096..=268435456, got 4095" in proc.stderr


def test_cli_serve_answers_with_the_embedded_dev_model() -> None:
    """What `make run` does: `loopwarden serve` with no upstream serves the dev model."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWARDEN_")}
    proc = subprocess.Popen(
        [*_cli(), "serve", "--port", str(port), "--log-level", "warning", "--store", "memory"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=20, what="loopwarden serve")
        with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as client:
            response = client.responses.create(model="dev", input="hello")
        assert response.status == "completed"
        assert response.output_text == "You said: hello"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert b"embedded development model" in err
