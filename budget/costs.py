"""What a charge model costs users: the README table, computed from real ledger runs.

``python -m budget.costs`` prints the Markdown table that README.md shows between its
``charge-models`` markers; tests/budget/test_budget_costs.py recomputes it and fails if the README
drifted. Every figure comes from running a `Ledger` through the admissions the gateway makes for
one request (DESIGN.md §3–§4), with the clamps of `Limits`:

* **buffered round** — ``admit_input(body)``; ``admit_output(upstream body)``; the kept output
  items ``admit_accumulated``; ``release`` the body's charge; ``admit_terminal(final)``;
* **streamed round** — the same request; each SSE frame through ``admit_stream_chunk`` /
  ``check_stream_frame`` / ``release_stream_bytes``; delta text, then the item's ``.done``
  snapshot, then the terminal response through ``admit_accumulated``, each snapshot admitted
  before the state it replaces is released; ``admit_terminal(final)``.

Payloads are real JSON built here (`tool_definition`, `history_item`, `create_body`,
`response_body`); their sizes and node counts are exact and linear in the varied quantity, so
searches use sizes instead of rebuilding megabytes of JSON.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from .errors import BudgetExceeded
from .features import JsonFeatures
from .ledger import Ledger
from .limits import MAX_RETAINED_BYTES_RANGE, Limits
from .model import ChargeModel
from .nodes import json_features

__all__ = [
    "Payload",
    "cost_table",
    "create_body",
    "history_item",
    "response_body",
    "tool_definition",
]

DEFAULT_LIMIT: Final = Limits().max_retained_bytes
MAX_LIMIT: Final = MAX_RETAINED_BYTES_RANGE[1]
IMAGE_BYTES: Final = 5_000_000
"""The "5 MB image" of the table: a 5,000,000-byte file, sent base64 in a data URL (6.67 MB)."""
HISTORY_ITEMS: Final = 5000
TOOLS: Final = 500
ANSWER_BYTES: Final = 2_000_000
"""The "2 MB buffered answer": an upstream response object of 2,000,000 bytes or more."""
CODEX_SHARE: Final = 0.02
"""A 40 KB Codex-style request must cost under this share of the budget."""
SHORT_ANSWER: Final = 2000  # characters of answer text in rounds that measure something else


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def tool_definition(i: int) -> dict[str, object]:
    """A typical function tool: 406 bytes, 43 nodes (50 of them ≈ 2,000 nodes)."""
    return {
        "type": "function",
        "name": f"get_weather_{i % 1000:03d}",
        "description": "Get the current weather and a short forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "units"],
            "additionalProperties": False,
        },
        "strict": True,
    }


def history_item(i: int) -> dict[str, object]:
    """One stored conversation item; a cycle of user message, function call, its output and
    assistant message (about 200 bytes and 10 nodes each on average)."""
    kind = i % 4
    if kind == 0:
        return {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What will the weather be like in Paris this week? " * 3}
            ],
        }
    if kind == 1:
        return {
            "type": "function_call",
            "call_id": f"call_{i:08d}",
            "name": "get_weather_000",
            "arguments": '{"city":"Paris","units":"celsius","days":7}',
        }
    if kind == 2:
        return {
            "type": "function_call_output",
            "call_id": f"call_{i - 1:08d}",
            "output": '{"forecast":[12.5,13.1,11.8,14.2,15.0,13.7,12.9],"summary":"mild, some rain"}',
        }
    return {
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "output_text", "text": "Mild all week, 12 to 15 °C, with rain on Wednesday. " * 4}
        ],
    }


def create_body(*, tools: int = 0, image_bytes: int = 0, previous: bool = False) -> dict[str, object]:
    """A create request: one user message, optionally an image (base64 data URL), ``tools``
    tool definitions, and a ``previous_response_id``."""
    content: list[object] = [{"type": "input_text", "text": "What will the weather be like?"}]
    if image_bytes:
        b64 = "A" * (4 * -(-image_bytes // 3))
        content.append({"type": "input_image", "image_url": "data:image/jpeg;base64," + b64})
    body: dict[str, object] = {
        "model": "gpt-4o",
        "input": [{"role": "user", "content": content}],
        "tools": [tool_definition(i) for i in range(tools)],
        "store": True,
    }
    if previous:
        body["previous_response_id"] = "resp_0123456789abcdef"
    return body


#: The function tools a Codex CLI session declares.
CODEX_TOOL_NAMES = (
    "shell",
    "apply_patch",
    "update_plan",
    "view_image",
    "read_file",
    "list_dir",
    "grep_files",
    "web_search",
    "request_user_input",
)


def codex_tool(name: str) -> dict[str, object]:
    """One Codex-style function tool: a ~330-character description and a 4-property JSON schema."""
    return {
        "type": "function",
        "name": name,
        "description": f"{name}: runs in the sandbox and returns its output. " * 6,
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}, "description": "argv"},
                "workdir": {"type": "string", "description": "working directory"},
                "timeout_ms": {"type": "number", "description": "timeout in milliseconds"},
                "justification": {"type": "string", "description": "why it needs approval"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    }


def codex_conversation(calls: int = 6) -> list[object]:
    """A Codex conversation: the user's task, a reasoning item with 12,000 characters of
    ``encrypted_content``, then ``calls`` shell calls, each with a 720-character output."""
    blob = "".join(f"{i:08x}" for i in range(1500))  # 12,000 base64-like characters
    conversation: list[object] = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Fix the failing test. " * 20}],
        },
        {"type": "reasoning", "summary": [], "encrypted_content": blob},
    ]
    for i in range(calls):
        conversation.append(
            {
                "type": "function_call",
                "call_id": f"call_{i:04d}",
                "name": "shell",
                "arguments": json.dumps({"command": ["bash", "-lc", f"pytest -q tests/test_{i}.py"]}),
            }
        )
        conversation.append(
            {"type": "function_call_output", "call_id": f"call_{i:04d}", "output": "....F.. 1 failed\n" * 40}
        )
    return conversation


def codex_body() -> dict[str, object]:
    """A Codex-CLI-style create request of about 40 KB: long instructions, 9 function tools with
    full JSON schemas, a conversation with a reasoning item carrying ``encrypted_content`` and
    shell calls with their outputs (deterministic)."""
    return {
        "model": "gpt-5-codex",
        "instructions": "You are Codex, a coding agent running in a sandbox. " * 280,
        "input": codex_conversation(),
        "tools": [codex_tool(name) for name in CODEX_TOOL_NAMES],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0195e2b4-6f7a-7c1d-9e8f-0123456789ab",
    }


def answer_item(text_chars: int) -> dict[str, object]:
    """The assistant message a round keeps."""
    return {
        "type": "message",
        "id": "msg_0123456789abcdef",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "x" * text_chars, "annotations": []}],
    }


def response_body(*, tools: int = 0, text_chars: int = SHORT_ANSWER) -> dict[str, object]:
    """An upstream response object: one answer message; it echoes the tools and instructions."""
    return {
        "id": "resp_0123456789abcdef",
        "object": "response",
        "created_at": 1_730_000_000,
        "status": "completed",
        "model": "gpt-4o",
        "instructions": "You are a helpful assistant.",
        "output": [answer_item(text_chars)],
        "tools": [tool_definition(i) for i in range(tools)],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "usage": {"input_tokens": 1000, "output_tokens": 500, "total_tokens": 1500},
        "metadata": {},
        "store": True,
    }


_ZERO: Final = json_features(b"")


@dataclass(frozen=True, slots=True)
class Payload:
    """A serialized payload as the ledger prices it: its `JsonFeatures` (bytes, nodes and what the
    measured model counts), linear in repeated parts."""

    features: JsonFeatures

    @property
    def nbytes(self) -> int:
        """Wire bytes."""
        return self.features.nbytes

    @property
    def nodes(self) -> int:
        """Lexical JSON nodes."""
        return self.features.nodes

    @classmethod
    def of(cls, value: object) -> Payload:
        """The payload of ``value`` serialized compactly (UTF-8, as clients send it)."""
        return cls(json_features(_dumps(value)))

    @classmethod
    def text(cls, nbytes: int) -> Payload:
        """``nbytes`` bytes of ASCII inside a string (base64, answer text): bytes, no nodes."""
        return cls(
            _ZERO._replace(nbytes=nbytes, string_bytes=nbytes, chars=nbytes, longest_string=49 + nbytes)
        )

    def __add__(self, other: Payload) -> Payload:
        return Payload(self.features.combine(other.features))

    def minus(self, other: Payload) -> Payload:
        """``self - other`` (differences of real payloads)."""
        return Payload(self.features.combine(other.features, -1))

    def times(self, k: int) -> Payload:
        """``k`` copies."""
        return Payload(_ZERO.combine(self.features, k))


def history_size(items: int) -> Payload:
    """Serialized size of ``items`` stored history items (the `history_item` cycle)."""
    cycle = [Payload.of(history_item(i)) for i in range(4)]
    total = Payload(_ZERO)
    for p in cycle:
        total = total + p
    full, rest = divmod(items, 4)
    out = total.times(full)
    for p in cycle[:rest]:
        out = out + p
    return out


def _blob(n: int) -> bytes:
    return bytes(n)  # stands in for n bytes of JSON; node counts are always passed explicitly


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One client request as the ledger sees it."""

    body: Payload
    upstream: Payload  # the upstream response body (buffered) / the terminal response (streamed)
    kept: Payload  # the round's kept output items
    history: Payload | None = None


def _buffered(ledger: Ledger, limits: Limits, req: Request) -> bool:
    model, limit = ledger.model, limits.max_retained_bytes
    if req.body.nbytes > model.body_clamp(limit) or req.upstream.nbytes > model.upstream_clamp(limit):
        return False
    try:
        ledger.admit_input(_blob(req.body.nbytes), nodes=req.body.nodes, features=req.body.features)
        if req.history is not None:
            ledger.admit_history_size(req.history.nbytes, req.history.nodes)
        held = ledger.admit_output(_blob(req.upstream.nbytes), nodes=req.upstream.nodes)
        held += ledger.admit_output_parse(req.upstream.features)
        ledger.admit_accumulated(_blob(req.kept.nbytes), nodes=req.kept.nodes, features=req.kept.features)
        ledger.release(held)
        ledger.admit_terminal(_blob(req.upstream.nbytes), features=req.upstream.features)
    except BudgetExceeded:
        return False
    return True


def _frame(ledger: Ledger, payload: Payload) -> None:
    wire = payload.nbytes + 40  # "event: ...\ndata: " framing
    ledger.admit_stream_chunk(_blob(wire))
    ledger.check_stream_frame(_blob(payload.nbytes), nodes=payload.nodes)
    ledger.release_stream_bytes(wire)


def _streamed(ledger: Ledger, limits: Limits, req: Request) -> bool:
    if req.body.nbytes > ledger.model.body_clamp(limits.max_retained_bytes):
        return False
    kept_text = req.kept.nbytes  # the answer text arrives as one delta here
    try:
        ledger.admit_input(_blob(req.body.nbytes), nodes=req.body.nodes, features=req.body.features)
        if req.history is not None:
            ledger.admit_history_size(req.history.nbytes, req.history.nodes)
        envelope = req.upstream.minus(req.kept)
        _frame(ledger, envelope)  # response.created echoes everything but the output
        _frame(ledger, Payload.text(kept_text + 100))  # one output_text.delta
        delta = ledger.admit_accumulated(b"x" * kept_text, nodes=0)
        _frame(ledger, req.kept)  # response.output_item.done
        item = ledger.admit_accumulated(
            _blob(req.kept.nbytes), nodes=req.kept.nodes, features=req.kept.features
        )
        ledger.release(delta)
        _frame(ledger, req.upstream)  # response.completed
        final = ledger.admit_accumulated(
            _blob(req.upstream.nbytes), nodes=req.upstream.nodes, features=req.upstream.features
        )
        ledger.release(item)
        ledger.admit_terminal(_blob(req.upstream.nbytes), features=req.upstream.features)
        ledger.release(final)
    except BudgetExceeded:
        return False
    return True


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One row of the table."""

    model_name: str
    model: ChargeModel
    limit: int
    store: bool

    def ledger(self) -> Ledger:
        return Ledger(self.limit, self.model, self.store)

    @property
    def limits(self) -> Limits:
        return Limits(max_retained_bytes=self.limit)

    def buffered(self, req: Request) -> bool:
        return _buffered(self.ledger(), self.limits, req)

    def streamed(self, req: Request) -> bool:
        return _streamed(self.ledger(), self.limits, req)


def _largest(fits: Callable[[int], bool], high: int) -> int:
    """Largest n in 0..high with fits(n) (fits is monotone: true then false); 0 if none."""
    if not fits(0):
        return 0
    lo, hi = 0, high
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _delta(a: Payload, b: Payload) -> Payload:
    return b.minus(a)


@functools.cache
def _units() -> dict[str, Payload]:
    """Per-unit sizes, from differences of small real payloads: each tool, answer character and
    image byte adds the same bytes and nodes everywhere (tests check this against real JSON)."""
    create0 = Payload.of(create_body())
    response0 = Payload.of(response_body(text_chars=0))
    answer0 = Payload.of(answer_item(0))
    image3 = Payload.of(create_body(image_bytes=3))
    return {
        "create": create0,
        "create_tool1": _delta(create0, Payload.of(create_body(tools=1))),
        "create_tool": _delta(Payload.of(create_body(tools=1)), Payload.of(create_body(tools=2))),
        "create_previous": _delta(create0, Payload.of(create_body(previous=True))),
        "create_image": _delta(create0, image3.minus(Payload.text(4))),
        "response": response0,
        "response_tool1": _delta(response0, Payload.of(response_body(tools=1, text_chars=0))),
        "response_tool": _delta(
            Payload.of(response_body(tools=1, text_chars=0)), Payload.of(response_body(tools=2, text_chars=0))
        ),
        "answer": answer0,
        "char": _delta(answer0, Payload.of(answer_item(1))),
    }


def answer_text(chars: int) -> Payload:
    """What ``chars`` ASCII characters of answer text add to a payload whose text was empty: the
    bytes, and the `str` CPython builds (none for 0 or 1 characters: shared singletons)."""
    text = Payload.text(chars)
    header = 49 if chars >= 2 else -chars
    return Payload(text.features._replace(string_bytes=text.features.string_bytes + header))


def base64_length(nbytes: int) -> int:
    """Length of the base64 text of ``nbytes`` bytes."""
    return 4 * -(-nbytes // 3)


def request(*, tools: int = 0, text: int = SHORT_ANSWER, image_b64: int = 0, history: int = 0) -> Request:
    """Sizes of a one-round request: ``tools`` tool definitions (sent and echoed), an answer of
    ``text`` characters, an image whose base64 text is ``image_b64`` characters long (0: none),
    ``history`` restored items (0: none)."""
    u = _units()
    body = u["create"]
    upstream = u["response"]
    if tools:  # the first tool in a list has no comma before it
        body = body + u["create_tool1"] + u["create_tool"].times(tools - 1)
        upstream = upstream + u["response_tool1"] + u["response_tool"].times(tools - 1)
    if image_b64:
        body = body + u["create_image"] + Payload.text(image_b64)
    if history:
        body = body + u["create_previous"]
    kept = u["answer"] + answer_text(text)
    upstream = upstream + answer_text(text)
    return Request(
        body=body, upstream=upstream, kept=kept, history=history_size(history) if history else None
    )


def _served(setting: Setting, req: Request) -> str:
    buffered, streamed = setting.buffered(req), setting.streamed(req)
    if buffered and streamed:
        return "yes"
    if streamed:
        return "streamed only"
    if buffered:  # pragma: no cover - streaming is never the more expensive path here
        return "buffered only"
    return "no"


def _size(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / 1024:.0f} KiB"


def settings() -> list[Setting]:
    """The rows: both models × default and maximum limit × store on and off."""
    rows: list[Setting] = []
    for name, model in (("measured", ChargeModel.measured()), ("reference", ChargeModel.reference())):
        for limit in (DEFAULT_LIMIT, MAX_LIMIT):
            for store in (True, False):
                rows.append(Setting(model_name=name, model=model, limit=limit, store=store))
    return rows


HEADER: Final = (
    "| model | max_retained_bytes | store | raw body clamp | largest create body | largest buffered answer "
    "| tools echoed per buffered round | restored history (items) | 5 MB image | 2 MB answer | 500 tools "
    "| 5,000-item history | 40 KB Codex request |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def codex_share(setting: Setting) -> float:
    """Share of ``setting``'s budget the `codex_body` request's input charge takes."""
    raw = _dumps(codex_body())
    return setting.ledger().admit_input(raw) / setting.limit


def row(setting: Setting) -> str:
    """One Markdown table row for ``setting``."""
    image_b64 = _largest(lambda n: setting.buffered(request(image_b64=n)), setting.limit)
    create = request(image_b64=image_b64).body.nbytes if image_b64 else 0
    text = _largest(lambda n: setting.buffered(request(text=n)), setting.limit)
    answer = request(text=text).upstream.nbytes if text else 0
    tools = _largest(lambda n: setting.buffered(request(tools=n)), 100_000)
    history = _largest(lambda n: setting.buffered(request(history=n)), 1_000_000)
    image = _served(setting, request(image_b64=base64_length(IMAGE_BYTES)))
    big_answer = _served(setting, request(text=ANSWER_BYTES))
    many_tools = _served(setting, request(tools=TOOLS))
    long_history = _served(setting, request(history=HISTORY_ITEMS))
    share = codex_share(setting)
    codex = f"{'yes' if share < CODEX_SHARE else 'no'} ({100 * share:.2f} %)"
    limit = f"{setting.limit // (1 << 20)} MiB"
    store = "on" if setting.store else "off"
    clamp = _size(setting.model.body_clamp(setting.limit))
    return (
        f"| {setting.model_name} | {limit} | {store} | {clamp} | {_size(create)} | {_size(answer)} "
        f"| {tools} | {history} | {image} | {big_answer} | {many_tools} | {long_history} | {codex} |\n"
    )


def cost_table() -> str:
    """The full Markdown table (header and one row per setting), as the README shows it."""
    return HEADER + "".join(row(s) for s in settings())


def main() -> int:
    """Print the table."""
    print(cost_table(), end="")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
