"""The outcome table (DESIGN.md §5 as data), row by row, and the README copy of it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from budget import BudgetExceeded, PoolExhausted
from middleware import errors, outcomes
from middleware.ops import metrics
from middleware.ops.request_id import REQUEST_ID
from middleware.ops.shield import Remembered
from middleware.store.backends import StoreUnavailable
from middleware.upstream import errors as up
from middleware.upstream.chat.errors import ChatLimitExceeded

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT.parent / "shared" / "DESIGN.md"


def _remembered() -> Remembered:
    """A retry-shield entry: the answer a 502 ledger overflow got."""
    original = outcomes.resolve(BudgetExceeded("tool_result", 10, 0, 5))
    status, headers, body = outcomes.render_json(original)
    return Remembered(status, tuple(headers), body, original.row, original.code, "req_1", 0.0)


# One representative failure per row, with the status and code it must answer.
EXAMPLES: dict[str, tuple[BaseException, int, str]] = {
    "request_too_large": (errors.BodyTooLarge("too big", size=9, clamp=8), 413, "request_too_large"),
    "request_timeout": (errors.BodyTimeout("slow", seconds=30), 408, "request_timeout"),
    "request_head_too_large": (
        errors.HeadTooLarge("head too big", size=70000, limit=65536),
        431,
        "request_header_too_large",
    ),
    "budget_initial": (BudgetExceeded("input", 10, 0, 5), 413, "max_retained_bytes_exceeded"),
    "store_read_too_large": (
        errors.StoredReadTooLarge("too big to read", requested=10, charged=0, limit=5),
        413,
        "max_retained_bytes_exceeded",
    ),
    "budget_later": (BudgetExceeded("tool_result", 10, 0, 5), 502, "max_retained_bytes_exceeded"),
    "upstream_body_too_large": (
        up.UpstreamBodyTooLarge("big", size=9, clamp=8),
        502,
        "upstream_response_too_large",
    ),
    "max_infer_iters": (errors.LoopLimitReached("loop", calls=3, limit=3), 508, "max_infer_iters_exceeded"),
    "upstream_timeout": (up.UpstreamTimeout("slow", phase="read"), 504, "upstream_timeout"),
    "request_deadline": (errors.DeadlineExceeded("late", seconds=1), 504, "request_deadline_exceeded"),
    "upstream_incomplete": (up.UpstreamIncomplete("eof"), 502, "upstream_incomplete"),
    "upstream_invalid": (up.UpstreamInvalid("bad"), 502, "upstream_invalid_response"),
    "translation_limit": (ChatLimitExceeded("limit_tool_calls"), 502, "upstream_invalid_response"),
    "upstream_auth_failed": (
        up.status_failure(401, b'{"error":{"message":"no"}}'),
        502,
        "upstream_auth_failed",
    ),
    "upstream_5xx": (
        up.status_failure(503, b'{"error":{"message":"busy","code":"overloaded"}}'),
        502,
        "overloaded",
    ),
    "upstream_4xx": (
        up.status_failure(429, b'{"error":{"message":"slow down"}}', {"retry-after": "7"}),
        429,
        "upstream_error",
    ),
    "upstream_stream_error": (
        up.stream_error_failure({"type": "error", "code": "boom", "message": "x"}),
        502,
        "boom",
    ),
    "upstream_unavailable": (up.UpstreamConnectError("refused"), 502, "upstream_unavailable"),
    "invalid_request": (
        errors.InvalidRequest("bad", code="invalid_value", param="input"),
        400,
        "invalid_value",
    ),
    "invalid_header": (
        errors.InvalidHeader("bad header", param="loopwarden-max-infer-iters"),
        400,
        "invalid_header",
    ),
    "invalid_api_key": (errors.Unauthenticated("who?"), 401, "invalid_api_key"),
    "server_overloaded": (errors.Overloaded("full"), 503, "server_overloaded"),
    "process_budget_exceeded": (errors.ProcessBudgetExceeded("huge"), 413, "process_budget_exceeded"),
    "pool_initial": (PoolExhausted("input", 10), 413, "process_budget_exceeded"),
    "pool_later": (PoolExhausted("accumulated", 10), 502, "process_budget_exceeded"),
    "caller_share_full": (
        errors.CallerShareFull("share full", requested=9, held=5, share=10),
        503,
        "server_overloaded",
    ),
    "caller_share_too_large": (
        errors.CallerShareTooLarge("over the share", requested=11, limit=10),
        413,
        "process_budget_exceeded",
    ),
    "caller_share_initial": (
        errors.CallerShareExhausted("share full", phase="input", requested=1, held=10, share=10),
        413,
        "process_budget_exceeded",
    ),
    "caller_share_later": (
        errors.CallerShareExhausted("share full", phase="accumulated", requested=1, held=10, share=10),
        502,
        "process_budget_exceeded",
    ),
    "model_not_found": (errors.ModelNotFound("no such model", param="model"), 404, "model_not_found"),
    "server_shutting_down": (errors.ShuttingDown("drain", refused=False), 503, "server_shutting_down"),
    "server_shutting_down_refused": (errors.ShuttingDown("drain", refused=True), 503, "server_shutting_down"),
    "mcp_server_unavailable": (errors.McpServerUnavailable("down"), 502, "mcp_server_unavailable"),
    "not_found": (errors.NotFound("gone", param="previous_response_id"), 404, "not_found"),
    "unknown_url": (errors.UnknownRoute("no route"), 404, "unknown_url"),
    "method_not_allowed": (errors.MethodNotAllowed("no", allow="GET, DELETE"), 405, "method_not_allowed"),
    "store_unavailable": (StoreUnavailable("db down"), 503, "store_unavailable"),
    "background_worker_lost": (errors.WorkerLost("lease passed", seconds=30), 502, "background_worker_lost"),
    "internal": (RuntimeError("a bug"), 500, "internal_error"),
    "previous_response_not_found": (
        errors.PreviousResponseNotFound("not found", param="previous_response_id"),
        400,
        "previous_response_not_found",
    ),
    "websocket_lifetime": (
        errors.WebSocketLifetimeReached("old", seconds=3600),
        400,
        "websocket_connection_limit_reached",
    ),
    "websocket_idle": (errors.WebSocketIdle("idle", seconds=300), 408, "websocket_idle_timeout"),
    "websocket_message_too_large": (
        errors.WebSocketMessageTooLarge("big", size=10, clamp=5),
        413,
        "request_too_large",
    ),
    "retry_shield": (errors.ShieldHit(_remembered(), age=1.5), 502, "max_retained_bytes_exceeded"),
}


def test_every_row_has_an_example() -> None:
    assert set(EXAMPLES) == set(outcomes.OUTCOMES)


@pytest.mark.parametrize("key", sorted(EXAMPLES))
def test_each_row_renders_one_envelope_before_commit(key: str) -> None:
    exc, status, code = EXAMPLES[key]
    row = outcomes.OUTCOMES[key]
    assert outcomes.row_of(exc) == key
    outcome = outcomes.resolve(exc)
    got_status, headers, body = outcomes.render_json(outcome)
    head = dict(headers)
    envelope = json.loads(body)["error"]
    assert (got_status, envelope["code"]) == (status, code)
    assert envelope["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert set(envelope) == {"message", "type", "param", "code"}
    assert head[b"content-type"] == b"application/json" and int(head[b"content-length"]) == len(body)
    assert (head.get(b"x-should-retry") == b"false") == (not outcomes.retryable(outcome))
    assert (b"connection" in head) == row.close
    assert (b"retry-after" in head) == (row.retry_after or key == "upstream_4xx")  # 4xx: the upstream's
    if row.named:
        assert envelope["code"] in row.named
    assert outcome.cap == row.cap
    assert outcomes.stored_status(outcome) == ("failed", {"code": code, "message": outcome.message})
    if isinstance(exc, errors.Failure) and exc.param is not None:
        assert envelope["param"] == exc.param


def test_deterministic_rows_are_the_design_list() -> None:
    """DESIGN.md §5: 400, 408, 413, 508 and budget 502s carry x-should-retry: false."""
    for key, (exc, status, _) in EXAMPLES.items():
        deterministic = not outcomes.retryable(outcomes.resolve(exc))
        if status in (400, 401, 404, 405, 408, 413, 508) or key in (
            "budget_later",
            "upstream_body_too_large",
        ):
            assert deterministic, key
    assert outcomes.retryable(outcomes.resolve(up.status_failure(409, b"{}")))
    assert not outcomes.retryable(outcomes.resolve(up.status_failure(422, b"{}")))


def test_upstream_4xx_passes_its_status_and_rate_limit_headers_only() -> None:
    exc = up.status_failure(
        429,
        b'{"error":{"message":"slow down","code":"rate_limit_exceeded","param":"model"}}',
        {"retry-after": "7", "x-ratelimit-remaining-requests": "0", "set-cookie": "s=1", "server": "x"},
    )
    status, headers, body = outcomes.render_json(outcomes.resolve(exc))
    head = dict(headers)
    assert status == 429 and json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    assert head[b"retry-after"] == b"7" and head[b"x-ratelimit-remaining-requests"] == b"0"
    assert b"set-cookie" not in head and b"server" not in head
    assert b"x-should-retry" not in head  # 429: a retry can help


@pytest.mark.parametrize("key", sorted(k for k, row in outcomes.OUTCOMES.items() if row.after_commit))
def test_each_after_commit_row_is_error_then_failed_then_done(key: str) -> None:
    exc, _, code = EXAMPLES[key]
    outcome = outcomes.resolve(exc, committed=True)
    frames = outcomes.render_stream(
        outcome, 7, {"id": "resp_1", "object": "response", "output": [{"type": "x"}]}
    )
    blocks = frames.split(b"\n\n")
    assert blocks[-1] == b"" and blocks[-2] == b"data: [DONE]" and len(blocks) == 4
    (err_name, err_data), (failed_name, failed_data) = (_frame(blocks[0]), _frame(blocks[1]))
    assert (err_name, failed_name) == ("error", "response.failed")
    assert err_data["type"] == "error" and err_data["sequence_number"] == 7 and err_data["code"] == code
    assert err_data["error"] == {
        "type": outcome.type,
        "code": code,
        "message": outcome.message,
        "param": outcome.param,
    }
    assert failed_data["sequence_number"] == 8
    response = failed_data["response"]
    assert response["status"] == "failed" and response["error"] == {"code": code, "message": outcome.message}
    assert response["id"] == "resp_1" and response["output"] == [{"type": "x"}]
    assert outcome.cap_outcome == "sse_error"


def _frame(block: bytes) -> tuple[str, Any]:
    event, data = block.split(b"\n")
    assert event.startswith(b"event: ") and data.startswith(b"data: ")
    return event[7:].decode(), json.loads(data[6:])


def test_the_response_so_far_may_hold_what_json_cannot_encode_as_utf8() -> None:
    frames = outcomes.render_stream(
        outcomes.resolve(up.UpstreamInvalid("x"), committed=True), 0, {"t": "\ud800"}
    )
    assert frames.endswith(b"data: [DONE]\n\n")


def test_messages_carry_the_request_id_once() -> None:
    token = REQUEST_ID.set("req_abc")
    try:
        outcome = outcomes.resolve(errors.InvalidRequest("bad"))
    finally:
        REQUEST_ID.reset(token)
    assert outcome.message == "bad [request id req_abc]"


def test_client_gone_is_stored_cancelled() -> None:
    assert outcomes.stored_status(None) == ("cancelled", None)


def test_stream_error_codes_are_the_metric_label_values() -> None:
    assert outcomes.stream_error_codes() == frozenset(metrics.STREAM_ERROR_CODES)


def test_every_cap_hit_the_table_can_count_is_pre_initialised() -> None:
    """A cap-hit pair the table can produce but that was never pre-initialised would appear only
    on its first hit (a dashboard shows no series until then)."""
    possible = set()
    for row in outcomes.OUTCOMES.values():
        if row.cap is None:
            continue
        if row.status:
            possible.add((row.cap, str(row.status)))
        if row.after_commit:
            possible.add((row.cap, "sse_error"))
    assert possible <= set(metrics.CAP_HIT_PAIRS), sorted(possible - set(metrics.CAP_HIT_PAIRS))


def test_the_readme_table_is_generated_from_the_table() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- outcomes:begin -->\n")[1].split("<!-- outcomes:end -->")[0]
    assert block == outcomes.markdown_table()


def test_every_design_section_5_code_has_a_row() -> None:
    if not DESIGN.is_file():
        pytest.skip(f"{DESIGN} not found: put ../shared beside the repo")
    section = DESIGN.read_text(encoding="utf-8").split("## 5. Outcomes")[1].split("\n## ")[0]
    design_codes = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and line.startswith("|") and not set(cells[0]) <= {"-"}:
            design_codes.update(c for c in re.findall(r"`(\w+)`", cells[3]) if not c.startswith("upstream's"))
    table_codes = {row.code for row in outcomes.OUTCOMES.values() if row.code}
    table_codes |= {code for row in outcomes.OUTCOMES.values() for code in row.named}
    table_codes.add(outcomes.UPSTREAM_DEFAULT_CODE)
    missing = design_codes - table_codes
    assert not missing, sorted(missing)


def test_only_the_outcome_table_picks_http_statuses() -> None:
    """No module but `middleware/outcomes.py` answers with an HTTP error status: no
    ``status=`` / ``status_code=`` argument of 400..599 and no positional one to a ``Response``
    anywhere else in middleware/. Allowed: the dev model (a stand-in upstream), ``/readyz``'s 503
    (a probe's answer, not a failure) and the MCP transport's answers to the MCP SDK inside
    `middleware/tools/session.py` (never sent to a client). This is how the architecture issue's
    "only outcomes.py maps failures to statuses" is held."""
    import ast

    allowed_files = {"middleware/outcomes.py", "middleware/dev/devmodel.py", "middleware/tools/session.py"}
    found = []
    for path in sorted((ROOT / "middleware").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in allowed_files:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            values = [kw.value for kw in node.keywords if kw.arg in ("status", "status_code")]
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name.endswith("Response") and len(node.args) > 1:
                values.append(node.args[1])
            for value in values:
                if isinstance(value, ast.Constant) and type(value.value) is int and 400 <= value.value <= 599:
                    found.append(f"{rel}:{node.lineno} {value.value}")
    assert found == [f"middleware/app.py:{n} 503" for n in _readyz_lines()], found


def _readyz_lines() -> list[int]:
    source = (ROOT / "middleware/app.py").read_text(encoding="utf-8").splitlines()
    return [i for i, line in enumerate(source, 1) if "status_code=503" in line and '"status":' in line]
