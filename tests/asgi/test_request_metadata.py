"""``metadata`` on ``POST /v1/responses`` is bounded as OpenAI bounds it, by the one validator the
conversation routes use (`middleware.asgi.validate.validate_metadata`): at most 16 pairs, keys at
most 64 characters, string values at most 512 characters; else 400 ``invalid_request_error``
with ``param`` ``metadata`` or ``metadata.<key>``, before anything goes upstream.

A real uvicorn serving the gateway, the official ``openai`` SDK and raw ``httpx`` as clients,
the scripted `MockUpstream` as the model server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import gateway, message_item, response_obj, sdk
from tests.mock_upstream import MockUpstream, Reply
from tests.store.test_store_routes import assert_envelope

FULL = {f"k{n:02d}": "v" for n in range(16)}
AUTH = {"authorization": "Bearer client-key"}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, MockUpstream]]:
    with MockUpstream() as upstream, gateway(upstream) as (url, _):
        yield url, upstream


@pytest.mark.parametrize(
    ("metadata", "code", "param"),
    [
        ({**FULL, "k16": "v"}, "invalid_value", "metadata"),
        ({"k" * 65: "v"}, "invalid_value", "metadata"),
        ({"k": "v" * 513}, "invalid_value", "metadata.k"),
        ({"k": 1}, "invalid_type", "metadata.k"),
        ({"k": None}, "invalid_type", "metadata.k"),
        (["k"], "invalid_type", "metadata"),
        ("k", "invalid_type", "metadata"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_create_refuses_metadata_out_of_openais_bounds(
    served: tuple[str, MockUpstream], metadata: Any, code: str, param: str, stream: bool
) -> None:
    url, upstream = served
    before = len(upstream.requests)
    resp = httpx.post(
        f"{url}/v1/responses",
        json={"model": "m", "input": "hi", "metadata": metadata, "stream": stream},
        headers=AUTH,
        timeout=10,
    )
    assert_envelope(resp, 400, code, param)
    assert len(upstream.requests) == before  # refused before anything went upstream


def test_create_passes_metadata_at_the_bounds(served: tuple[str, MockUpstream]) -> None:
    url, upstream = served
    at_limits = {**FULL, "k15": "v" * 512, "k" * 64: "v"}
    del at_limits["k00"]  # 16 pairs: one key of 64 characters, one value of 512
    upstream.push(Reply.json(response_obj([message_item("ok")])))
    with sdk(url) as client:
        response = client.responses.create(model="m", input="hi", metadata=at_limits)
    assert response.output_text == "ok"
    assert json.loads(upstream.requests[-1].body)["metadata"] == at_limits
