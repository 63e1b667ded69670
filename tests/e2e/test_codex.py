"""Real clients installed with npm, end to end through loopwarden (opt-in: ``make test-clients``).

The Codex CLI (``npm install -g @openai/codex``) runs ``codex exec`` with the README's
``config.toml`` provider (``wire_api = "responses"``) against the gateway on a real uvicorn, whose
upstream is the scripted model server. Skipped unless ``LOOPWARDEN_CLIENT_TESTS=1`` (``make
test-clients`` sets it), so ``make test`` neither needs npm nor waits for Codex's backoff.

* a streamed answer reaches Codex (its final message on stdout);
* Codex retries a stream that failed after commit (``stream_max_retries``; it ignores
  ``x-should-retry``) and sends its maps in a new key order each time: after one 502
  ``max_retained_bytes_exceeded`` the retry shield answers every retry, and the upstream sees one
  inference call.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DONE, PRE, B, MetricDelta, message_item
from tests.helpers import shielded_gateway as gateway
from tests.mock_upstream import E, MockUpstream, Reply

pytestmark = [
    pytest.mark.clients,
    pytest.mark.skipif(
        os.environ.get("LOOPWARDEN_CLIENT_TESTS") != "1",
        reason="opt-in: make test-clients (needs npm clients)",
    ),
]
CODEX = shutil.which("codex")
STREAM_RETRIES = 5  # Codex's default stream_max_retries, set explicitly


def codex_config(base_url: str) -> str:
    """The README's Codex recipe, pointed at `base_url`."""
    return f"""model = "m"
model_provider = "loopwarden"

[model_providers.loopwarden]
name = "loopwarden"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "LOOPWARDEN_API_KEY"
stream_max_retries = {STREAM_RETRIES}
"""


def run_codex(base_url: str, home: Path, prompt: str) -> subprocess.CompletedProcess[str]:
    if CODEX is None:
        pytest.fail("codex is not on PATH: npm install -g @openai/codex (make test-clients does)")
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(codex_config(base_url))
    env = {**os.environ, "CODEX_HOME": str(home), "LOOPWARDEN_API_KEY": "key-1"}
    return subprocess.run(
        [CODEX, "exec", "--skip-git-repo-check", "-s", "read-only", prompt],
        env=env,
        cwd=home,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )


def text_stream(text: str) -> list[bytes]:
    """A complete streamed message: item added, one delta, item done, completed."""
    item = message_item(text)
    empty: dict[str, Any] = {**item, "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    common = {"item_id": item["id"], "output_index": 0}
    return [
        *PRE(),
        E("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": empty}),
        E("response.content_part.added", {"type": "response.content_part.added", "sequence_number": 3, **common, "content_index": 0, "part": part}),
        E("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 4, **common, "content_index": 0, "delta": text}),
        E("response.output_text.done", {"type": "response.output_text.done", "sequence_number": 5, **common, "content_index": 0, "text": text}),
        E("response.content_part.done", {"type": "response.content_part.done", "sequence_number": 6, **common, "content_index": 0, "part": {**part, "text": text}}),
        E("response.output_item.done", {"type": "response.output_item.done", "sequence_number": 7, "output_index": 0, "item": item}),
        DONE(8, [item]),
    ]  # fmt: skip


def test_codex_gets_a_streamed_answer(upstream: MockUpstream, tmp_path: Path) -> None:
    upstream.push(Reply.sse(text_stream("hello from loopwarden")))
    with gateway(upstream) as (url, app):
        done = run_codex(url, tmp_path / "home", "say hello")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hello from loopwarden" in done.stdout
    assert app.requests == 1 and len(upstream.requests) == 1
    sent = upstream.requests[0].json()
    assert sent["stream"] is True and sent["store"] is False and sent["model"] == "m"
    assert {tool["type"] for tool in sent["tools"]} <= {"function", "custom", "web_search", "namespace"}


def test_codex_retries_after_a_budget_502_cost_one_upstream_call(
    upstream: MockUpstream, tmp_path: Path
) -> None:
    """Issue 18: Codex ignores x-should-retry; with the shield its retries never reach the upstream."""
    big = Reply.sse([*PRE(), DONE(2, [message_item("x" * 200_000)])])  # one frame over the ledger
    upstream.push(*(big for _ in range(STREAM_RETRIES + 1)))
    delta = MetricDelta()
    with gateway(upstream, max_retained_bytes=B) as (url, app):
        done = run_codex(url, tmp_path / "home", "write a lot")
    assert done.returncode != 0
    assert "max_retained_bytes exceeded" in done.stderr, done.stderr[-3000:]
    assert app.requests == STREAM_RETRIES + 1  # Codex sent every retry
    assert len(upstream.requests) == 1  # one inference call
    assert delta.delta("loopwarden_retry_shield_hits_total") == STREAM_RETRIES
