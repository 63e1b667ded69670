"""The ``--mcp-allow`` rule for client-declared ``server_url``s (issue 17 item 4): paths that a
server or a front proxy could read as another path are refused, the rest are compared decoded and
on a segment boundary (`middleware.tools.endpoints.UrlAllowlist`, `path_refusal`)."""

from __future__ import annotations

import asyncio
import re
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.errors import InvalidRequest
from middleware.tools import McpServerConfig, ToolCatalog, UrlAllowlist
from middleware.tools.endpoints import normalize_url, path_refusal

ALLOW = ["http://allowed.example/mcp", "https://api.example.com:8443/v1/mcp/"]
A = "http://allowed.example"


def resolve(url: object) -> InvalidRequest:
    """The refusal `ToolCatalog.resolve` raises for a tool declaring `url` (it must refuse)."""
    catalog = ToolCatalog([], allow_prefixes=ALLOW)
    with pytest.raises(InvalidRequest) as excinfo:
        asyncio.run(catalog.resolve([{"type": "mcp", "server_label": "mine", "server_url": url}]))
    assert excinfo.value.param == "tools"
    return excinfo.value


@pytest.mark.parametrize(
    "url",
    [
        A + "/mcp",
        A + "/mcp/",  # trailing slash
        A + "/mcp?token=x",  # a query string
        A + "/mcp/?a=1&next=/../admin;x",  # the query is not a path: not checked
        A + "/mcp#fragment",
        A + "/mcp/sub/path",
        "http://ALLOWED.example./mcp",  # host case and trailing dot
        A + ":80/mcp",  # the default port
        A + "/%6Dcp",  # an escaped unreserved character ("m")
        A + "/m%63p/x",  # lower-case hex
        A + "/mcp/v%2E1",  # an encoded dot inside a segment is not a dot segment
        A + "/mcp/a%20b",
        A + "/mcp/a%2Cb",  # an escaped reserved character other than / ; ? # % \
        "https://api.example.com:8443/v1/mcp",  # the prefix's trailing slash is ignored
        "https://api.example.com:8443/v1/mcp/x",
    ],
)
def test_legitimate_forms_are_admitted(url: str) -> None:
    allowlist = UrlAllowlist(ALLOW)
    assert path_refusal(url) is None
    assert allowlist.refusal(url) is None
    assert allowlist.allows(url)


@pytest.mark.parametrize(
    "path",
    [
        "/mcp/..%2Fadmin",  # the attack's encoded slash
        "/mcp/..%2fadmin",
        "/mcp%2F..%2Fadmin",
        "/mcp/x%2Fy",  # an encoded slash alone changes the segments
        "/mcp/%2e%2e/admin",  # encoded dots
        "/mcp/%2E%2E/admin",
        "/mcp/.%2e/admin",
        "/mcp/%2e./admin",
        "/mcp/%2e/admin",
        "/mcp/../admin",  # raw dot segments
        "/mcp/../mcp/x",  # even one that resolves back inside the prefix
        "/mcp/./x",
        "/mcp/x/..",
        "/mcp/..;/admin",  # the attack's path parameter
        "/mcp;/admin",
        "/mcp/x;jsessionid=1",
        "/mcp/%3B/admin",
        "/mcp/..%5Cadmin",  # an encoded backslash
        "/mcp/%5c..%5cadmin",
        "/mcp/%252F",  # double encoding
        "/mcp/%252e%252e/admin",
        "/mcp/..%252Fadmin",
        "/mcp/%25",
        "/mcp/%00",  # NUL and control characters once decoded
        "/mcp/%0a",
        "/mcp/%0D%0AHost:evil",
        "/mcp/%7F",
        "/mcp/%C0%AE%C0%AE/admin",  # overlong UTF-8 dots
        "/mcp/%EF%BC%8F..%EF%BC%8Fadmin",  # full-width solidus
        "/mcp/é",  # non-ASCII
        "/mcp/%zz",  # a '%' that is not an escape
        "/mcp/%2",
        "/mcp%3F/x",  # an encoded '?' or '#'
        "/mcp/%23x",
    ],
)
def test_traversal_forms_are_refused_as_not_allowed(path: str) -> None:
    url = A + path
    assert path_refusal(url) is not None
    assert not UrlAllowlist(ALLOW).allows(url)
    error = resolve(url + "?key=s3cret-query")
    assert error.code == "mcp_server_not_allowed"
    assert "--mcp-allow" in error.message and "send the endpoint's plain path" in error.message
    assert "s3cret" not in error.message


@pytest.mark.parametrize(
    "url",
    [
        A + "/mcpx",  # a segment boundary, not a string prefix
        A + "/mcp-admin",
        A + "/MCP",  # paths are case-sensitive
        A + "/",
        A + "/admin",
        "http://allowed.example.evil/mcp",  # a host prefix is not the host
        "http://evil.example/allowed.example/mcp",
        "http://evil.example#@allowed.example/mcp",  # the host is evil.example
        "https://allowed.example/mcp",  # another scheme
        A + ":8080/mcp",  # another port
        A + ":443/mcp",
        "https://api.example.com/v1/mcp",  # the prefix's port is 8443
    ],
)
def test_other_origins_and_prefix_tricks_are_refused_as_not_allowed(url: str) -> None:
    assert not UrlAllowlist(ALLOW).allows(url)
    error = resolve(url)
    assert error.code == "mcp_server_not_allowed"
    assert "--mcp-allow" in error.message


@pytest.mark.parametrize(
    "url",
    [
        "http://allowed.example@evil.example/mcp",  # userinfo: the host is evil.example
        "http://allowed.example:80@evil.example/mcp",
        "http://user:pw@allowed.example/mcp",
        "http://allowed.example\\@evil.example/mcp",  # raw backslashes
        A + "/mcp\\..\\admin",
        A + "/mcp/\x00",  # a raw control character
        "http://allowed.example%2eevil.example/mcp",  # an escape in the host
        "ftp://allowed.example/mcp",
    ],
)
def test_unusable_urls_are_refused_as_invalid(url: str) -> None:
    """What `normalize_url` already refuses stays the ``invalid_value`` row (a malformed value)."""
    assert not UrlAllowlist(ALLOW).allows(url)
    error = resolve(url)
    assert error.code == "invalid_value"
    assert "pw" not in error.message


@pytest.mark.parametrize("prefix", [A + "/mcp/..%2F", A + "/a;b", A + "/%2e%2e/mcp", A + "/x%252F"])
def test_prefixes_are_held_to_the_same_rule(prefix: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(prefix)) + " is invalid: its path"):
        UrlAllowlist([prefix])


def test_operator_servers_are_trusted_with_their_paths() -> None:
    """``--mcp-server`` URLs are the operator's own: not held to the client path rule (an encoded
    slash is a legitimate path for some servers); redirects are still never followed."""
    assert McpServerConfig(label="ops", url=A + "/servers/a%2Fb/mcp").url == A + "/servers/a%2Fb/mcp"


# A front proxy at its worst: it decodes escapes until none is left, reads backslashes as slashes,
# strips ";" path parameters and resolves dot segments. Whatever it does to an allowed URL, the
# path it routes must stay inside the prefix.
_TOKENS = ["mcp", "admin", "x", "/", ".", "..", "%2F", "%2f", "%2e", "%2E", "%25", "%5C", "\\", ";", "%3B"]
_TOKENS += ["%", "%41", "%7e", "%3F", "%00"]


def _hostile_proxy(path: str) -> str:
    for _ in range(5):
        path = unquote(path)
    path = re.sub(r";[^/]*", "", path.replace("\\", "/"))
    out: list[str] = []
    for segment in path.split("/")[1:]:
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
    return "/" + "/".join(out)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_TOKENS), max_size=12))
def test_an_allowed_path_stays_inside_the_prefix_whatever_a_proxy_does(tokens: list[str]) -> None:
    url = A + "/mcp/" + "".join(tokens)
    allowlist = UrlAllowlist(ALLOW)
    if not allowlist.allows(url):
        return
    for seen in (url, normalize_url(url)):  # as checked, and as sent
        routed = _hostile_proxy(seen.removeprefix(A).partition("?")[0])
        assert routed == "/mcp" or routed.startswith("/mcp/"), (url, routed)
