"""`middleware.ops.redact`: `redact_url`, the one way a URL is shown (MCP server URLs, store DSNs), and
the `RedactUrls` log filter that `log_config` installs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from middleware.ops.redact import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # store DSNs: the user name stays, the password goes
        ("postgresql://u:hunter2@db:5432/lw", "postgresql://u:***@db:5432/lw"),
        ("postgresql://u:hunter2@db/lw?sslmode=require", "postgresql://u:***@db/lw?***"),
        ("postgresql://u@db/lw?sslmode=require&password=hunter2", "postgresql://***@db/lw?***"),
        ("postgresql://u:hun@ter2@db/lw", "postgresql://u:***@db/lw"),
        ("postgresql://u:hun?ter#2@db/lw", "postgresql://u:***@db/lw"),
        ("sqlite:///relative.db", "sqlite:///relative.db"),
        ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
        ("memory", "memory"),
        # MCP server URLs: the query (a token) goes, the fragment is dropped
        ("http://a.example/mcp?token=qqq", "http://a.example/mcp?***"),
        ("https://mcp.example:8443/v1/", "https://mcp.example:8443/v1/"),
        ("https://TOKEN@mcp.example/v1", "https://***@mcp.example/v1"),
        ("http://a.example/p#frag?x", "http://a.example/p"),
        ("http://[::1]:8080/mcp?k=v", "http://[::1]:8080/mcp?***"),
        ("http://a.example?k=v", "http://a.example?***"),
        # not URLs: never raises, still hides what looks like a credential
        ("u:hunter2@db/lw", "u:***@db/lw"),
        ("", ""),
        ("http://[::1", "http://[::1"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://user:s3cret@db/lw",
        "postgresql://user@db/lw?password=s3cret",
        "https://s3cret@mcp.example/",
        "https://mcp.example/mcp?key=s3cret",
        "https://mcp.example/mcp?a=1&token=s3cret#s3cret",
        "https://u:s3cret@mcp.example/mcp?key=s3cret",
    ],
)
def test_no_password_or_query_token_survives(url: str) -> None:
    assert "s3cret" not in redact_url(url)


def test_log_config_hides_url_credentials_the_mcp_http_stack_logs() -> None:
    """`log_config` installs `RedactUrls` on the loggers that print MCP server URLs; importing
    the tool layer installs nothing (no side effect at import)."""
    code = (
        "import logging, logging.config\n"
        "import middleware.tools, middleware.tools.catalog\n"
        "names = ('httpx2', 'mcp.client.streamable_http')\n"
        "print('before', [len(logging.getLogger(n).filters) for n in names])\n"
        "from middleware.ops.request_id import log_config\n"
        "logging.config.dictConfig(log_config('debug', json_lines=False))\n"
        "logging.getLogger('httpx2').warning('HTTP Request: POST %s \"HTTP/1.1 200 OK\"',"
        " 'http://u:pw-s3cret@mcp.example/mcp?token=q-s3cret')\n"
        "logging.getLogger('mcp.client.streamable_http').info("
        "'GET stream not opened: https://mcp.example/sse?key=k-s3cret#f')\n"
        "logging.getLogger('loopwarden.tools').info('no url here: %s', 'kept?as=is')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[0] == "before [0, 0]"
    assert "s3cret" not in out.stderr
    assert "POST http://u:***@mcp.example/mcp?*** " in out.stderr
    assert "GET stream not opened: https://mcp.example/sse?***" in out.stderr
    assert "no url here: kept?as=is" in out.stderr
