"""What a first-time user meets on a wrong request (the new-user trial): a plain ``GET
/v1/responses`` is 405 whose message says WebSocket mode needs an upgrade, and a 401 says where
the gateway's keys come from. A real uvicorn, the official SDK where a client is involved."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.helpers import gateway
from tests.mock_upstream import MockUpstream

_REQUEST_ID = re.compile(r"(.*) \[request id req_[0-9a-f]{32}\]")


def without_request_id(message: str) -> str:
    """`message` without the ``[request id …]`` every error message ends with (asserted there)."""
    match = _REQUEST_ID.fullmatch(message)
    assert match is not None, message
    return match.group(1)


def test_plain_get_on_responses_is_405_saying_websocket_mode_needs_an_upgrade(upstream: MockUpstream) -> None:
    with gateway(upstream) as (url, _):
        answer = httpx.get(f"{url}/v1/responses", timeout=10)
        other = httpx.put(f"{url}/v1/responses", json={}, timeout=10)
    assert answer.status_code == 405
    assert answer.headers["allow"] == "POST"
    error = answer.json()["error"]
    assert error["code"] == "method_not_allowed"
    assert without_request_id(error["message"]) == (
        "GET is not allowed on /v1/responses; create a response with POST, or open WebSocket mode "
        "with a GET that carries the WebSocket upgrade (Connection: Upgrade, Upgrade: websocket; "
        "e.g. ws://HOST/v1/responses)"
    )
    # other methods keep the short message: WebSocket mode is a GET
    assert other.status_code == 405
    assert without_request_id(other.json()["error"]["message"]) == "PUT is not allowed on /v1/responses"
    assert upstream.requests == []


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["missing", "wrong"])
def test_401_says_where_the_gateway_keys_come_from(upstream: MockUpstream, key: str | None) -> None:
    with gateway(upstream, api_key=("right-key-0123456789",)) as (url, _):
        if key is None:
            answer = httpx.post(f"{url}/v1/responses", json={"model": "m", "input": "hi"}, timeout=10)
            assert answer.status_code == 401
            error = answer.json()["error"]
        else:
            with (
                openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as client,
                pytest.raises(openai.AuthenticationError) as info,
            ):
                client.responses.create(model="m", input="hi")
            error = info.value.body  # type: ignore[assignment]
            assert isinstance(error, dict)
    what = "no API key was presented" if key is None else "the API key is not valid for this gateway"
    assert error["code"] == "invalid_api_key"
    assert without_request_id(error["message"]) == (
        f"{what}; send Authorization: Bearer <key> with one of the gateway's keys (the operator "
        "configures them with --api-key, $LOOPWARDEN_API_KEY or --api-key-file)"
    )
    assert upstream.requests == []
