"""Case B27: request-controlled strings never become label values (bounded series per family)."""

from __future__ import annotations

import uuid
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import gateway, message_item, response_obj
from tests.mock_upstream import MockUpstream, Reply

N = 500


def test_b27_500_requests_with_random_strings_keep_series_bounded() -> None:
    with MockUpstream() as upstream, gateway(upstream) as (url, _):
        before = httpx.get(url + "/metrics").text
        planted: list[str] = []
        with httpx.Client(timeout=30) as client:
            for i in range(N):
                marker = uuid.uuid4().hex
                planted.append(marker)
                if i % 5 == 0:
                    upstream.push(
                        Reply.json(
                            {"error": {"message": f"engine {marker} died", "code": f"c{marker}"}}, status=500
                        )
                    )
                elif i % 5 == 1:
                    upstream.push(Reply.json(response_obj([message_item("ok")])))
                else:
                    upstream.push(
                        Reply.json({"error": {"message": f"model m-{marker} not found"}}, status=404)
                    )
                model = 'bad"\nname' if i == 7 else f"m-{marker}"
                body = {
                    "model": model,
                    "input": "hi",
                    "user": f"user-{marker}",
                    "safety_identifier": f"sid-{marker}",
                    "metadata": {"session": marker},
                    "tools": [
                        {"type": "function", "name": f"tool_{marker}", "parameters": {"type": "object"}}
                    ],
                }
                r = client.post(url + "/v1/responses", json=body)
                assert r.status_code in (200, 404, 502)
        text = httpx.get(url + "/metrics").text
    assert len(upstream.requests) == N
    assert len(text.encode()) < 100_000
    for marker in planted:
        assert marker not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    series = Counter({name: len(f.samples) for name, f in families.items() if name.startswith("loopwarden_")})
    before_series = Counter(
        {
            f.name: len(f.samples)
            for f in text_string_to_metric_families(before)
            if f.name.startswith("loopwarden_")
        }
    )
    # 500 distinct models, users and errors add at most the few status x model="other" series.
    grown = {name: series[name] - before_series.get(name, 0) for name in series}
    assert all(delta <= 3 for delta in grown.values()), grown
    requests = families["loopwarden_requests"]
    # the registry is the process's: models configured by tests that ran earlier stay labelled
    earlier = {
        s.labels["model"]
        for f in text_string_to_metric_families(before)
        if f.name == "loopwarden_requests"
        for s in f.samples
    }
    models = {s.labels["model"] for s in requests.samples}
    assert "other" in models and models - earlier <= {"other"}, models - earlier
    assert {s.labels["status"] for s in requests.samples if s.name.endswith("_total")} >= {
        "200",
        "404",
        "502",
    }
