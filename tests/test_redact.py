"""`middleware.ops.redact.redact_url`: the one way a URL is shown (MCP server URLs, store DSNs)."""

from __future__ import annotations

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
