"""Background responses in one gateway process (issue 23): create + poll, cancel, resume, limits.

A real uvicorn serving the gateway, the official ``openai`` SDK as client, and the scripted
`MockUpstream` as the model server (its replies hold on a `threading.Event` or sleep, so a task
is still running when the test acts). What several workers and hosts do is in
``test_background_workers.py``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests import helpers, spec_schema
from tests.helpers import (
    DONE,
    PRE,
    MetricDelta,
    gateway,
    message_item,
    response_obj,
    sse_events,
    text_delta,
)
from tests.mock_upstream import MockUpstream, Reply

PENDING = ("queued", "in_progress")
AUTH = {"authorization": "Bearer client-key"}  # the SDK's key: the same owner
_CLIENTS: list[openai.OpenAI] = []


def sdk(url: str) -> openai.OpenAI:
    """`tests.helpers.sdk`, closed when the test ends (`close_clients`)."""
    client = helpers.sdk(url)
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def held(release: threading.Event, obj: dict[str, Any]) -> Reply:
    """A buffered upstream answer that waits for ``release`` first."""
    return Reply(headers=[("content-type", "application/json")], parts=[release, json.dumps(obj).encode()])


def poll(
    client: openai.OpenAI, response_id: str, *, until: tuple[str, ...] | None = None, timeout: float = 20.0
) -> Any:
    """Retrieve until the status leaves ``queued``/``in_progress`` (or is one of ``until``)."""
    deadline = time.monotonic() + timeout
    while True:
        got = client.responses.retrieve(response_id)
        if (got.status in until) if until else got.status not in PENDING:
            return got
        assert time.monotonic() < deadline, f"{response_id} still {got.status} after {timeout} s"
        time.sleep(0.1)


def raw_get(url: str, response_id: str) -> dict[str, Any]:
    body = httpx.get(f"{url}/v1/responses/{response_id}", timeout=10, headers=AUTH).json()
    assert isinstance(body, dict)
    return body


def test_create_answers_queued_then_poll_shows_in_progress_then_completed(upstream: MockUpstream) -> None:
    spec_schema.require_spec()
    release = threading.Event()
    upstream.push(held(release, response_obj([message_item("done in the background")])))
    delta = MetricDelta()
    with gateway(upstream, upstream_read_timeout=20) as (url, _):
        client = sdk(url)
        raw = httpx.post(
            url + "/v1/responses",
            json={"model": "m", "input": "hi", "background": True},
            timeout=10,
            headers=AUTH,
        )
        assert raw.status_code == 200
        queued = raw.json()
        assert (queued["status"], queued["background"], queued["output"]) == ("queued", True, [])
        spec_schema.assert_response(queued)
        in_progress = poll(client, queued["id"], until=("in_progress",))
        spec_schema.assert_response(raw_get(url, queued["id"]))
        assert in_progress.background is True
        release.set()
        final = poll(client, queued["id"])
        assert (final.status, final.output_text, final.background) == (
            "completed",
            "done in the background",
            True,
        )
        spec_schema.assert_response(raw_get(url, queued["id"]))
        deadline = time.monotonic() + 5
        while delta.delta("loopwarden_background_outcomes_total", outcome="completed") != 1:
            assert time.monotonic() < deadline, "the completed outcome was not counted"
            time.sleep(0.05)
        assert delta.delta("loopwarden_background_outcomes_total", outcome="failed") == 0
    sent = upstream.requests[0].json()
    assert "background" not in sent and sent["store"] is False  # the upstream runs it in the foreground


def test_background_requires_store(upstream: MockUpstream) -> None:
    with gateway(upstream) as (url, _), pytest.raises(openai.BadRequestError) as info:
        sdk(url).responses.create(model="m", input="hi", background=True, store=False)
    assert (info.value.code, info.value.param) == ("invalid_value", "store")
    assert "background: true requires store: true" in info.value.message
    assert upstream.requests == []


def test_cancel_stores_cancelled_with_output_so_far_and_a_second_cancel_changes_nothing(
    upstream: MockUpstream,
) -> None:
    release = threading.Event()
    upstream.push(held(release, response_obj([message_item("never seen")])))
    delta = MetricDelta()
    try:
        with gateway(upstream, upstream_read_timeout=30) as (url, _):
            client = sdk(url)
            created = client.responses.create(model="m", input="hi", background=True)
            poll(client, created.id, until=("in_progress",))
            assert delta.delta("loopwarden_background_tasks") == 1
            started = time.monotonic()
            cancelled = client.responses.cancel(created.id)
            assert time.monotonic() - started < 5
            assert (cancelled.status, cancelled.output, cancelled.background) == ("cancelled", [], True)
            assert client.responses.retrieve(created.id).status == "cancelled"
            again = client.responses.cancel(created.id)
            assert again.status == "cancelled" and again.id == created.id
            deadline = time.monotonic() + 5
            while delta.delta("loopwarden_background_tasks") != 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert delta.delta("loopwarden_background_outcomes_total", outcome="cancelled") == 1
    finally:
        release.set()


def test_cancel_of_a_finished_background_response_returns_it_unchanged(upstream: MockUpstream) -> None:
    upstream.push(Reply.json(response_obj([message_item("fast")])))
    upstream.push(Reply.json(response_obj([message_item("foreground")])))
    with gateway(upstream) as (url, _):
        client = sdk(url)
        created = client.responses.create(model="m", input="hi", background=True)
        final = poll(client, created.id)
        again = client.responses.cancel(created.id)
        assert (again.status, again.output_text) == ("completed", "fast") == (final.status, final.output_text)
        foreground = client.responses.create(model="m", input="hi")
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.cancel(foreground.id)
        assert "Only responses created with background=true can be cancelled" in info.value.message


def test_a_stream_resumes_with_starting_after_after_a_dropped_connection(upstream: MockUpstream) -> None:
    spec_schema.require_spec()
    words = ["one ", "two ", "three ", "four "]
    parts: list[Any] = [*PRE()]
    for i, word in enumerate(words):
        parts += [0.3, text_delta(2 + i, word)]
    parts.append(DONE(2 + len(words), [message_item("".join(words))]))
    upstream.push(Reply.sse(parts))
    with gateway(upstream, upstream_read_timeout=20) as (url, _):
        client = sdk(url)
        first: list[Any] = []
        with client.responses.create(model="m", input="hi", background=True, stream=True) as stream:
            for event in stream:
                first.append(event)
                if event.type == "response.output_text.delta":
                    break  # the client goes away mid-stream
        response_id = first[0].response.id
        assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
        assert first[0].response.status == "queued"
        last = first[-1].sequence_number
        rest = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
        assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
        assert rest[-1].type == "response.completed"
        assert rest[-1].response.output_text == "".join(words)
        deltas = [e.delta for e in (*first, *rest) if e.type == "response.output_text.delta"]
        assert "".join(deltas) == "".join(words)
        assert poll(client, response_id).status == "completed"  # the disconnect cancelled nothing
        # the whole log again, from the start, as raw SSE: a valid Open Responses stream
        raw = httpx.get(
            f"{url}/v1/responses/{response_id}", params={"stream": "true"}, timeout=10, headers=AUTH
        )
        events = sse_events(raw.content)
        spec_schema.assert_stream(events)
        assert raw.content.endswith(b"data: [DONE]\n\n")
        with pytest.raises(openai.BadRequestError) as info:
            list(client.responses.retrieve(response_id, stream=True, starting_after=-1))  # type: ignore[arg-type]
        assert info.value.param == "starting_after"
        # past a 64-bit store INTEGER: a 400 naming it, not a 500 from the store
        for huge in (str(2**63), "9" * 30):
            raw = httpx.get(
                f"{url}/v1/responses/{response_id}",
                params={"stream": "true", "starting_after": huge},
                timeout=10,
                headers=AUTH,
            )
            assert raw.status_code == 400 and raw.json()["error"]["param"] == "starting_after", raw.text


def test_starting_after_at_or_past_the_last_event_sends_nothing_more(upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([*PRE(), text_delta(2, "x"), DONE(3, [message_item("x")])]))
    with gateway(upstream) as (url, _):
        client = sdk(url)
        events = list(client.responses.create(model="m", input="hi", background=True, stream=True))
        response_id, last = events[0].response.id, events[-1].sequence_number
        assert events[-1].type == "response.completed"
        poll(client, response_id)
        for after, wanted in ((last - 1, [last]), (last, []), (last + 1, []), (last + 1000, [])):
            raw = httpx.get(
                f"{url}/v1/responses/{response_id}",
                params={"stream": "true", "starting_after": str(after)},
                timeout=10,
                headers=AUTH,
            )
            assert raw.status_code == 200, raw.text
            got = sse_events(raw.content)
            assert [data["sequence_number"] for _, data in got] == wanted, (after, raw.content[-300:])
            assert raw.content.endswith(b"data: [DONE]\n\n")
        assert [name for name, _ in got] == []


def test_resume_query_values_other_than_ascii_digits_and_true_false_are_400(upstream: MockUpstream) -> None:
    upstream.push(Reply.sse([*PRE(), text_delta(2, "x"), DONE(3, [message_item("x")])]))
    with gateway(upstream) as (url, _):
        client = sdk(url)
        events = list(client.responses.create(model="m", input="hi", background=True, stream=True))
        response_id, last = events[0].response.id, events[-1].sequence_number
        poll(client, response_id)

        def get(params: dict[str, str]) -> httpx.Response:
            return httpx.get(f"{url}/v1/responses/{response_id}", params=params, timeout=10, headers=AUTH)

        # int() takes all of these (Arabic-Indic and full-width digits, "_", a sign, spaces) as 3 or 30
        for after in ("\u0663", "\uff13", "3_0", "+3", " 3", "3 ", "-0", "0x3", ""):
            raw = get({"stream": "true", "starting_after": after})
            assert raw.status_code == 400, (after, raw.text)
            assert raw.json()["error"]["param"] == "starting_after", (after, raw.text)
        ok = get({"stream": "true", "starting_after": str(last - 1)})
        assert ok.status_code == 200 and [d["sequence_number"] for _, d in sse_events(ok.content)] == [last]
        for stream in ("yes", "1", "on", "", "truee"):
            raw = get({"stream": stream})
            assert raw.status_code == 400, (stream, raw.text)
            assert raw.json()["error"]["param"] == "stream", (stream, raw.text)
        assert get({"stream": "false"}).json()["status"] == "completed"
        assert get({"stream": "True"}).status_code == 200


def test_a_streamed_background_create_failing_before_its_first_event_streams_sse_frames(
    upstream: MockUpstream,
) -> None:
    """The upstream refuses the task's first round (nothing streamed yet): the create's 200 SSE
    stream (the response exists: stored queued, with its id) is response.created,
    response.queued, error, response.failed and [DONE], as is its resume; the response is stored
    failed with the same error."""
    spec_schema.require_spec()
    refusal = {"error": {"message": "nope", "type": "invalid_request_error", "param": None, "code": "bad"}}
    upstream.push(Reply.json(refusal, status=400))
    with gateway(upstream) as (url, _):
        raw = httpx.post(
            f"{url}/v1/responses",
            json={"model": "m", "input": "hi", "background": True, "stream": True},
            headers=AUTH,
            timeout=20,
        )
        assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
        assert raw.content.endswith(b"data: [DONE]\n\n") and b"\n\n{" not in raw.content, raw.content[:300]
        events = sse_events(raw.content)
        names = [name for name, _ in events]
        assert names == ["response.created", "response.queued", "error", "response.failed"], raw.content[:500]
        assert [data["sequence_number"] for _, data in events] == [0, 1, 2, 3]
        spec_schema.assert_stream(events)
        response_id = events[0][1]["response"]["id"]
        assert events[0][1]["response"]["status"] == "queued"
        assert events[2][1]["code"] == "bad" and events[3][1]["response"]["error"]["code"] == "bad"
        stored = poll(sdk(url), response_id)
        assert stored.status == "failed" and stored.error is not None and stored.error.code == "bad"
        again = httpx.get(
            f"{url}/v1/responses/{response_id}", params={"stream": "true"}, headers=AUTH, timeout=10
        )
        assert [name for name, _ in sse_events(again.content)] == names


def test_a_buffered_or_foreground_response_has_no_events_to_resume(upstream: MockUpstream) -> None:
    upstream.push(
        Reply.json(response_obj([message_item("x")])), Reply.json(response_obj([message_item("y")]))
    )
    with gateway(upstream) as (url, _):
        client = sdk(url)
        background = client.responses.create(model="m", input="hi", background=True)
        poll(client, background.id)
        foreground = client.responses.create(model="m", input="hi")
        for response_id in (background.id, foreground.id):
            raw = httpx.get(
                f"{url}/v1/responses/{response_id}", params={"stream": "true"}, timeout=10, headers=AUTH
            )
            assert raw.status_code == 400 and raw.json()["error"]["param"] == "stream"
        assert (
            httpx.get(
                f"{url}/v1/responses/resp_nope", params={"stream": "true"}, timeout=10, headers=AUTH
            ).status_code
            == 404
        )


def test_event_log_window_drops_the_oldest_events(upstream: MockUpstream) -> None:
    parts: list[Any] = [*PRE()]
    parts += [text_delta(2 + i, "x" * 200) for i in range(20)]
    parts.append(DONE(22, [message_item("x" * 4000)]))
    upstream.push(Reply.sse(parts))
    with gateway(upstream, background_event_log_bytes=2048) as (url, _):
        client = sdk(url)
        events = list(client.responses.create(model="m", input="hi", background=True, stream=True))
        assert events[-1].type == "response.completed"  # the live follower kept up
        raw = httpx.get(
            f"{url}/v1/responses/{events[0].response.id}", params={"stream": "true"}, timeout=10, headers=AUTH
        )
        assert raw.status_code == 400 and raw.json()["error"]["param"] == "starting_after"
        assert "no longer kept" in raw.json()["error"]["message"]
        tail = list(
            client.responses.retrieve(
                events[0].response.id, stream=True, starting_after=events[-2].sequence_number
            )
        )
        assert [e.type for e in tail] == ["response.completed"]


def test_a_background_request_over_budget_is_stored_failed_with_its_502(upstream: MockUpstream) -> None:
    big = "y" * 200_000
    upstream.push(Reply.json(response_obj([message_item(big)])))
    with gateway(upstream, max_retained_bytes=1_048_576) as (url, _):
        client = sdk(url)
        created = client.responses.create(model="m", input="hi", background=True)
        assert created.status == "queued"
        final = poll(client, created.id)
        assert final.status == "failed"
        assert final.error is not None and final.error.code == "max_retained_bytes_exceeded"
        spec_schema.assert_response(raw_get(url, created.id))


def _stored_status(db: Path, response_id: str, wanted: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT status FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row == (wanted,):
            return
        assert time.monotonic() < deadline, f"{response_id} is {row}, not {wanted}"
        time.sleep(0.1)


def test_one_caller_runs_at_most_its_share_of_the_upstream_connections_as_background_tasks(
    upstream: MockUpstream, tmp_path: Path
) -> None:
    """A background task outlives its client: without a per-caller cap one key could hold every
    upstream connection (--upstream-max-connections) with detached tasks and starve the others.
    With 2 connections and the default share 0.5, one task per caller runs at a time."""
    release = threading.Event()
    upstream.push(held(release, response_obj([message_item("a")])))
    upstream.push(Reply.json(response_obj([message_item("b")])))
    db = tmp_path / "store.db"
    try:
        with gateway(
            upstream,
            store=f"sqlite:///{db}",
            upstream_max_connections=2,
            upstream_read_timeout=30,
            api_key=("client-key", "other-key"),  # callers are keys (an open gateway's are addresses)
        ) as (url, _):
            first = sdk(url).responses.create(model="m", input="hi", background=True)
            _stored_status(db, first.id, "in_progress")
            refused = httpx.post(
                f"{url}/v1/responses",
                json={"model": "m", "input": "again", "background": True},
                headers=AUTH,
                timeout=10,
            )
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "server_overloaded"
            assert "background responses" in refused.json()["error"]["message"]
            other = httpx.post(
                f"{url}/v1/responses",
                json={"model": "m", "input": "other", "background": True},
                headers={"authorization": "Bearer other-key"},
                timeout=10,
            )
            assert other.status_code == 200 and other.json()["status"] == "queued", other.text
            release.set()
            _stored_status(db, first.id, "completed")
        assert len(upstream.requests) == 2  # the refused one never went upstream
    finally:
        release.set()


def test_a_full_pool_answers_503_before_anything_is_stored(upstream: MockUpstream, tmp_path: Path) -> None:
    release = threading.Event()
    upstream.push(held(release, response_obj([message_item("first")])))
    upstream.push(Reply.json(response_obj([message_item("second")])))
    db = tmp_path / "store.db"
    try:
        with gateway(
            upstream, store=f"sqlite:///{db}", max_concurrent_requests=1, upstream_read_timeout=30
        ) as (url, _):
            client = sdk(url)
            first = client.responses.create(model="m", input="hi", background=True)
            _stored_status(db, first.id, "in_progress")  # (a GET would need a pool slot too)
            with pytest.raises(openai.InternalServerError) as info:  # 503: the task holds its reservation
                client.responses.create(model="m", input="again", background=True)
            assert info.value.status_code == 503 and info.value.code == "server_overloaded"
            with sqlite3.connect(db) as conn:
                assert conn.execute("SELECT id FROM responses").fetchall() == [(first.id,)]
            release.set()
            _stored_status(db, first.id, "completed")
            time.sleep(0.3)  # the task's reservation closes right after its end is stored
            second = client.responses.create(model="m", input="again", background=True)  # room again
            assert second.status == "queued"
            _stored_status(db, second.id, "completed")
        assert len(upstream.requests) == 2  # the first and the second: the refused one never went upstream
    finally:
        release.set()


def test_shutdown_drains_then_stores_the_rest_failed_server_shutting_down(
    upstream: MockUpstream, tmp_path: Path
) -> None:
    release = threading.Event()
    upstream.push(held(release, response_obj([message_item("too late")])))
    db = tmp_path / "store.db"
    try:
        with gateway(upstream, store=f"sqlite:///{db}", drain_timeout=1.0, upstream_read_timeout=30) as (
            url,
            _,
        ):
            client = sdk(url)
            created = client.responses.create(model="m", input="hi", background=True)
            poll(client, created.id, until=("in_progress",))
            stopping = time.monotonic()
        assert time.monotonic() - stopping < 10
    finally:
        release.set()
    with sqlite3.connect(db) as conn:
        status, error, response = conn.execute(
            "SELECT status, error, response FROM responses WHERE id = ?", (created.id,)
        ).fetchone()
        state = conn.execute(
            "SELECT state FROM background_tasks WHERE response_id = ?", (created.id,)
        ).fetchone()
    assert status == "failed" and json.loads(error)["code"] == "server_shutting_down"
    assert json.loads(response)["status"] == "failed"
    assert state == ("done",)


def test_a_streaming_client_that_stops_reading_is_detached_and_the_task_runs_on(
    upstream: MockUpstream,
) -> None:
    from tests.asgi.test_slow_clients import DELTA, long_answer, non_reading_client

    upstream.push(long_answer(200))  # 3.2 MiB of text: far more than the socket buffers hold
    body = {"model": "m", "input": "x", "stream": True, "background": True}
    with gateway(
        upstream, client_write_timeout=1.0, max_retained_bytes=268_435_456, upstream_read_timeout=30
    ) as (
        url,
        _,
    ):
        m = MetricDelta()
        with non_reading_client(url, body) as response_id:
            started = time.monotonic()
            deadline = started + 20
            while m.delta("loopwarden_cap_hits_total", limit="client_write_timeout", outcome="closed") != 1:
                assert time.monotonic() < deadline, "the stalled follower was not detached"
                time.sleep(0.05)
            detached_after = time.monotonic() - started
            final = httpx.get(f"{url}/v1/responses/{response_id}", timeout=10).json()
            while final["status"] in PENDING:
                assert time.monotonic() < deadline
                time.sleep(0.1)
                final = httpx.get(f"{url}/v1/responses/{response_id}", timeout=10).json()
    assert detached_after >= 1.0  # not before the client had stalled for the whole timeout
    assert final["status"] == "completed"  # a client that goes away cancels nothing
    assert upstream.bytes_written >= 200 * len(DELTA)  # the task read the whole answer
    assert m.delta("loopwarden_background_outcomes_total", outcome="cancelled") == 0


def test_the_request_deadline_ends_a_background_task_stored_failed(upstream: MockUpstream) -> None:
    release = threading.Event()
    upstream.push(held(release, response_obj([message_item("too late")])))
    try:
        with gateway(upstream, request_deadline=1.0, upstream_read_timeout=30) as (url, _):
            client = sdk(url)
            created = client.responses.create(model="m", input="hi", background=True)
            final = poll(client, created.id, timeout=10)
            assert final.status == "failed"
            assert final.error is not None and final.error.code == "request_deadline_exceeded"
    finally:
        release.set()


def test_cancelling_a_streamed_background_response_ends_its_stream(upstream: MockUpstream) -> None:
    release = threading.Event()
    upstream.push(Reply.sse([*PRE(), text_delta(2, "so far "), release, DONE(3, [message_item("x")])]))
    try:
        with gateway(upstream, upstream_read_timeout=30) as (url, _):
            client = sdk(url)
            names: list[str] = []
            response_id = ""
            with client.responses.create(model="m", input="hi", background=True, stream=True) as stream:
                for event in stream:
                    names.append(event.type)
                    if event.type == "response.created":
                        response_id = event.response.id
                    if event.type == "response.output_text.delta":
                        assert sdk(url).responses.cancel(response_id).status == "cancelled"
            assert names[-1] == "response.output_text.delta"  # the stream ended, nothing after it
            assert client.responses.retrieve(response_id).status == "cancelled"
    finally:
        release.set()
