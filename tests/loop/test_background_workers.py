"""Background responses across gateway processes (issue 23): two workers of one host on one SQLite
file, and two gateways sharing one PostgreSQL.

Each gateway is a real ``loopwarden serve`` process (this worktree's code, on its own loopback
port), the client is the official ``openai`` SDK, the model server is the scripted `MockUpstream`
of this test process. A request made to one gateway is cancelled, resumed or reaped through the
other: nothing but the store connects them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import DONE, PRE, message_item, response_obj, sse_events, text_delta
from tests.loop.test_background import AUTH, close_clients, held, poll, sdk
from tests.mock_upstream import MockUpstream, Reply
from tests.pg import PgServer
from tests.servers import free_port as _free_port
from tests.servers import wait_healthy

__all__ = ["close_clients"]  # the autouse fixture closes the SDK clients of these tests too

ROOT = Path(__file__).resolve().parents[2]
LEASE = 2.0  # --background-lease-seconds of the gateways here


@contextlib.contextmanager
def serving(store: str, upstream: MockUpstream, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``loopwarden serve`` process on ``store``; yields (base URL, process); stopped (SIGTERM) after."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWARDEN_")}
    env["PYTHONPATH"] = str(ROOT)
    argv = [
        sys.executable, "-m", "middleware.cli", "serve", "--port", str(port), "--store", store,
        "--upstream", upstream.base_url, "--upstream-read-timeout", "30", "--log-level", "warning",
        "--background-lease-seconds", str(LEASE), "--drain-timeout", "2", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=40)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def _cancel_through_the_other_gateway(store: str, upstream: MockUpstream) -> None:
    release = threading.Event()
    upstream.push(held(release, response_obj([message_item("never")])))
    try:
        with serving(store, upstream) as (url_a, _), serving(store, upstream) as (url_b, _):
            a, b = sdk(url_a), sdk(url_b)
            created = a.responses.create(model="m", input="hi", background=True)
            assert created.status == "queued"
            assert poll(b, created.id, until=("in_progress",)).background is True  # B sees A's row
            started = time.monotonic()
            cancelled = b.responses.cancel(created.id)
            took = time.monotonic() - started
            assert (cancelled.status, cancelled.output) == ("cancelled", [])
            assert took < 5, f"the cancel took {took:.2f} s"
            assert a.responses.retrieve(created.id).status == "cancelled"
            assert b.responses.cancel(created.id).status == "cancelled"  # unchanged
    finally:
        release.set()
    assert len(upstream.requests) == 1


def test_cancel_from_a_second_worker_process_on_one_sqlite_file(
    upstream: MockUpstream, tmp_path: Path
) -> None:
    _cancel_through_the_other_gateway(f"sqlite:///{tmp_path}/store.db", upstream)


def test_cancel_from_a_second_gateway_sharing_postgresql(upstream: MockUpstream, pg_server: PgServer) -> None:
    _cancel_through_the_other_gateway(pg_server.create_schema(f"bg_{uuid.uuid4().hex[:12]}"), upstream)


def _streamed(words: list[str], gap: float) -> Reply:
    parts: list[Any] = [*PRE()]
    for i, word in enumerate(words):
        parts += [gap, text_delta(2 + i, word)]
    parts.append(DONE(2 + len(words), [message_item("".join(words))]))
    return Reply.sse(parts)


def test_a_stream_started_on_one_gateway_resumes_on_another(
    upstream: MockUpstream, pg_server: PgServer
) -> None:
    words = [f"w{i} " for i in range(8)]
    upstream.push(_streamed(words, 0.25))
    store = pg_server.create_schema(f"bg_{uuid.uuid4().hex[:12]}")
    with serving(store, upstream) as (url_a, _), serving(store, upstream) as (url_b, _):
        seen: list[Any] = []
        with sdk(url_a).responses.create(model="m", input="hi", background=True, stream=True) as stream:
            for event in stream:
                seen.append(event)
                if event.type == "response.output_text.delta":
                    break
        response_id, last = seen[0].response.id, seen[-1].sequence_number
        rest = list(sdk(url_b).responses.retrieve(response_id, stream=True, starting_after=last))
        assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
        assert rest[-1].type == "response.completed"
        text = "".join(e.delta for e in (*seen, *rest) if e.type == "response.output_text.delta")
        assert text == "".join(words)


def test_a_killed_workers_task_is_marked_failed_after_its_lease(
    upstream: MockUpstream, tmp_path: Path
) -> None:
    release = threading.Event()
    upstream.push(Reply.sse([*PRE(), text_delta(2, "partial "), release, DONE(3, [message_item("x")])]))
    store = f"sqlite:///{tmp_path}/store.db"
    try:
        with serving(store, upstream) as (url_b, _):
            with serving(store, upstream) as (url_a, proc_a):
                seen = []
                with sdk(url_a).responses.create(
                    model="m", input="hi", background=True, stream=True
                ) as stream:
                    for event in stream:
                        seen.append(event)
                        if event.type == "response.output_text.delta":
                            break
                response_id = seen[0].response.id
                time.sleep(0.6)  # a heartbeat copies the events so far to the store
                proc_a.send_signal(signal.SIGKILL)
                proc_a.wait(10)
                killed = time.monotonic()
            final = poll(sdk(url_b), response_id, timeout=LEASE + 15)
            waited = time.monotonic() - killed
            assert final.status == "failed"
            assert final.error is not None and final.error.code == "background_worker_lost"
            assert waited < LEASE + 10, f"marked failed {waited:.1f} s after the kill"
            raw = httpx.get(
                f"{url_b}/v1/responses/{response_id}", params={"stream": "true"}, headers=AUTH, timeout=10
            )
            events = sse_events(raw.content)
            names = [name for name, _ in events]
            assert names[:3] == ["response.created", "response.queued", "response.in_progress"]
            assert names[-2:] == ["error", "response.failed"]
            assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
            assert events[-2][1]["code"] == "background_worker_lost"
            assert json.dumps(events[-1][1]["response"]["error"]["code"]) == '"background_worker_lost"'
            # the stored end stands in for the two events after the log's last: resumed past
            # one of them, only the rest; past both, nothing more
            end = len(events) - 2
            for after, wanted in (
                (end - 1, ["error", "response.failed"]),
                (end, ["response.failed"]),
                (end + 1, []),
            ):
                raw = httpx.get(
                    f"{url_b}/v1/responses/{response_id}",
                    params={"stream": "true", "starting_after": str(after)},
                    headers=AUTH,
                    timeout=10,
                )
                tail = sse_events(raw.content)
                assert [name for name, _ in tail] == wanted, (after, raw.content[-300:])
                assert [data["sequence_number"] for _, data in tail] == list(range(after + 1, len(events)))
    finally:
        release.set()


def test_sigterm_drains_a_running_task_then_stores_it_failed_server_shutting_down(
    upstream: MockUpstream, tmp_path: Path
) -> None:
    release = threading.Event()
    upstream.push(held(release, response_obj([message_item("too late")])))
    upstream.push(Reply.json(response_obj([message_item("in time")])))
    store = f"sqlite:///{tmp_path}/store.db"
    try:
        with serving(store, upstream) as (url_b, _):
            with serving(store, upstream) as (url_a, proc_a):
                a = sdk(url_a)
                slow = a.responses.create(model="m", input="hi", background=True)
                poll(a, slow.id, until=("in_progress",))
                proc_a.send_signal(signal.SIGTERM)  # --drain-timeout 2
                signalled = time.monotonic()
                assert proc_a.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
                took = time.monotonic() - signalled
            final = sdk(url_b).responses.retrieve(slow.id)
            assert final.status == "failed"
            assert final.error is not None and final.error.code == "server_shutting_down"
            assert 1.5 <= took < 15, f"the worker exited {took:.1f} s after SIGTERM"
            fast = sdk(url_b).responses.create(model="m", input="hi", background=True)
            assert poll(sdk(url_b), fast.id).output_text == "in time"  # the other worker serves on
    finally:
        release.set()
