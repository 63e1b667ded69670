"""Store reads are admitted (issue 15): ``GET /v1/responses/{id}``, ``…/input_items`` and
``GET /v1/conversations/{id}/items`` reserve from the admission pool and charge a read ledger from
the sizes stored at write time before a row is fetched or decoded; pages are bounded by bytes.

The routes run on a real uvicorn against SQLite (a file) and a real PostgreSQL (tests/pg.py; a
missing server is a failure), except the six concurrent 1 MB reads, which run the whole gateway
(`create_app`, SQLite) and watch its ``/metrics``. Expected page lengths and charges are computed
from the charge model the gateway uses (the measured default), so they stay exact when its prices
change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

import middleware.store.store as store_module
from budget import BudgetExceeded, ChargeModel, Ledger, Limits, count_json_nodes
from middleware.app import create_app
from middleware.config import Settings
from middleware.ids import new_id
from middleware.ops.admission import ProcessPool
from middleware.store.reads import (
    ITEM_EXTRA_BYTES,
    ITEM_EXTRA_NODES,
    PAGE_EXTRA_BYTES,
    PAGE_EXTRA_NODES,
    StoreReads,
    read_ledger_limit,
    stored_byte_floor,
)
from middleware.store.store import StoredResponse, encode_json, present_item
from tests.pg import PgServer
from tests.servers import serve_asgi
from tests.store.test_store_routes import Harness, assert_envelope, http, response_object

MiB = 1 << 20
#: The model the gateway charges with (a `Ledger` given none): reads and creates alike.
MODEL = ChargeModel.measured()  # the default (`--charge-model measured`), what create_app passes
OWNER = "alice-key"


# --- the charges, recomputed from the rule ------------------------------------------------------


def stored(item: dict[str, Any]) -> tuple[int, int]:
    """(bytes, nodes) of an item as the store measures it."""
    data = encode_json(item).encode("utf-8")
    return len(data), count_json_nodes(data)


def item_charge(item: dict[str, Any], item_id: str) -> int:
    nbytes, nodes = stored(item)
    return MODEL.history_charge(
        nbytes + ITEM_EXTRA_BYTES + 2 * len(item_id.encode()), nodes + ITEM_EXTRA_NODES
    )


PAGE = MODEL.history_charge(PAGE_EXTRA_BYTES, PAGE_EXTRA_NODES)


def first_item_limit(item_id: str, max_retained_bytes: int) -> int:
    """The read ledger's limit for a page whose first item has the id ``item_id`` (what the page
    adds to the stored item is charged on top of the create-path bound)."""
    return read_ledger_limit(
        max_retained_bytes,
        MODEL,
        extra_bytes=PAGE_EXTRA_BYTES + ITEM_EXTRA_BYTES + 2 * len(item_id.encode()),
        extra_nodes=PAGE_EXTRA_NODES + ITEM_EXTRA_NODES,
    )


def msg(k: int, text: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{k:03d}", "role": "user", "content": text}


def text_of_charge(k: int, at_least: int) -> dict[str, Any]:
    """The smallest `msg` ``k`` whose page charge (alone, with the envelope) is over ``at_least``."""
    low, high = 0, 1
    while PAGE + item_charge(msg(k, "x" * high), f"msg_{k:03d}") <= at_least:
        low, high = high, high * 2
    while low + 1 < high:  # invariant: low fits, high does not
        mid = (low + high) // 2
        if PAGE + item_charge(msg(k, "x" * mid), f"msg_{k:03d}") <= at_least:
            low = mid
        else:
            high = mid
    return msg(k, "x" * high)


# --- servers ------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.db"
    server: PgServer = request.getfixturevalue("pg_server")
    return server.create_schema(f"t_{uuid.uuid4().hex[:16]}")


@contextlib.contextmanager
def serve(
    store_url: str, *, max_retained_bytes: int, pool_bytes: int = 1 << 40, retry_after: float = 1.0
) -> Iterator[tuple[str, Harness, ProcessPool]]:
    """The store routes with their reads admitted at ``max_retained_bytes`` from a pool of
    ``pool_bytes``; yields (base URL, harness, pool). On exit every read has left the pool."""
    pool = ProcessPool(pool_bytes)
    reads = StoreReads(
        limits=Limits(max_retained_bytes=max_retained_bytes), pool=pool, retry_after=retry_after, model=MODEL
    )
    harness = Harness(store_url, store_reads=reads)
    with serve_asgi(harness) as url:
        yield url, harness, pool
        assert settled(lambda: (pool.reserved, pool.charged, pool.requests) == (0, 0, 0))


def settled(check: Callable[[], bool]) -> bool:
    """Whether ``check()`` holds within a second (a read closes once its body is sent, a moment
    after the client has it)."""
    deadline = time.monotonic() + 1.0
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def conversation(harness: Harness, items: list[dict[str, Any]]) -> str:
    created = harness.call(harness.store.create_conversation(OWNER, items=items, metadata=None))
    return str(created["id"])


def pages(url: str, path: str, **params: Any) -> list[dict[str, Any]]:
    """Every page of a cursor list, following ``last_id``."""
    out: list[dict[str, Any]] = []
    after = None
    while True:
        query = {**params, **({"after": after} if after else {})}
        resp = http(url, "GET", path, params=query)
        assert resp.status_code == 200, resp.text
        out.append(resp.json())
        if not out[-1]["has_more"]:
            return out
        after = out[-1]["last_id"]


def ids(page: dict[str, Any]) -> list[str]:
    return [item["id"] for item in page["data"]]


# --- pages bounded by bytes ---------------------------------------------------------------------


def test_a_page_stops_at_the_byte_bound_and_the_next_page_continues(store_url: str) -> None:
    items = [msg(k, f"{k}" * 3000) for k in range(10)]
    charge = item_charge(items[0], "msg_000")
    assert all(item_charge(item, item["id"]) == charge for item in items)
    bound = PAGE + 3 * charge + charge // 2  # three items fit, a fourth does not
    every = [item["id"] for item in items]
    with serve(store_url, max_retained_bytes=bound) as (url, harness, _):
        cid = conversation(harness, items)
        rid = "resp_bound"
        record = StoredResponse(
            rid, OWNER, 1_700_000_000, "completed", "m", None, None, response_object(rid), {}
        )
        harness.call(harness.store.save_response(record, input_items=items, output_items=[], replay_items=[]))
        for path, order, expected in (
            (f"/v1/conversations/{cid}/items", "asc", every),
            (f"/v1/conversations/{cid}/items", "desc", every[::-1]),
            (f"/v1/responses/{rid}/input_items", "desc", every[::-1]),
        ):
            got = pages(url, path, order=order, limit=100)
            assert [ids(p) for p in got] == [expected[0:3], expected[3:6], expected[6:9], expected[9:]]
            assert [p["has_more"] for p in got] == [True, True, True, False]
            assert [(p["first_id"], p["last_id"]) for p in got] == [(i[0], i[-1]) for i in map(ids, got)]
            assert got[0]["data"][0] == present_item(items[0] if order == "asc" else items[-1], expected[0])
        # The count bound still holds under the byte bound.
        by_two = pages(url, f"/v1/conversations/{cid}/items", order="asc", limit=2)
        assert [ids(p) for p in by_two] == [every[k : k + 2] for k in range(0, 10, 2)]


def test_a_single_item_bigger_than_the_page_bound_comes_back_alone(store_url: str) -> None:
    small = [msg(k, "s" * 100) for k in range(4)]
    charge = item_charge(small[0], "msg_000")
    bound = PAGE + 2 * charge + charge // 2  # two small items per page
    big = text_of_charge(9, bound)  # alone, over the page bound
    assert bound < PAGE + item_charge(big, "msg_009") <= first_item_limit("msg_009", bound)
    items = [small[0], small[1], big, small[2], small[3]]
    with serve(store_url, max_retained_bytes=bound) as (url, harness, _):
        cid = conversation(harness, items)
        got = pages(url, f"/v1/conversations/{cid}/items", order="asc", limit=100)
        assert [ids(p) for p in got] == [["msg_000", "msg_001"], ["msg_009"], ["msg_002", "msg_003"]]
        assert [p["has_more"] for p in got] == [True, True, False]
        assert got[1]["data"] == [present_item(big, "msg_009")]
        desc = pages(url, f"/v1/conversations/{cid}/items", limit=100)
        assert [ids(p) for p in desc] == [["msg_003", "msg_002"], ["msg_009"], ["msg_001", "msg_000"]]


def test_an_item_too_large_for_the_read_ledger_is_413_naming_the_setting(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 1 * MiB
    huge = text_of_charge(1, first_item_limit("msg_001", bound))
    assert PAGE + item_charge(huge, "msg_001") > first_item_limit("msg_001", bound)
    with serve(store_url, max_retained_bytes=bound) as (url, harness, pool):
        cid = conversation(harness, [msg(0, "small"), huge])
        rid = "resp_huge"  # its bytes alone are over the read ledger's limit
        obj = response_object(
            rid, text="r" * (read_ledger_limit(bound, MODEL) // MODEL.history_charge(1, 0) + 1)
        )
        record = StoredResponse(rid, OWNER, 1_700_000_000, "completed", "m", None, None, obj, {})
        harness.call(harness.store.save_response(record, input_items=[], output_items=[], replay_items=[]))
        first = http(url, "GET", f"/v1/conversations/{cid}/items", params={"order": "asc"}).json()
        assert (ids(first), first["has_more"]) == (["msg_000"], True)

        decoded: list[object] = []
        real = store_module._loads
        monkeypatch.setattr(store_module, "_loads", lambda text: decoded.append(text) or real(text))
        for path, params in (
            (f"/v1/conversations/{cid}/items", {"order": "asc", "after": "msg_000"}),
            (f"/v1/responses/{rid}", {}),
        ):
            resp = http(url, "GET", path, params=params)
            assert_envelope(resp, 413, "max_retained_bytes_exceeded")
            message = resp.json()["error"]["message"]
            assert "raise --max-retained-bytes" in message and "loopwarden-max-retained-bytes" in message
            assert "max_retained_bytes=1,048,576" in message
        assert decoded == [], "nothing was decoded"
        assert (pool.reserved, pool.charged) == (0, 0)


def test_lowering_max_retained_bytes_with_the_header_lowers_the_read_bounds(store_url: str) -> None:
    items = [msg(k, "h" * 2000) for k in range(3)]
    with serve(store_url, max_retained_bytes=64 * MiB) as (url, harness, _):
        cid = conversation(harness, items)
        path = f"/v1/conversations/{cid}/items"
        assert ids(http(url, "GET", path).json()) == ["msg_002", "msg_001", "msg_000"]
        lowered = PAGE + item_charge(items[0], "msg_000") + 1  # one item per page
        assert lowered >= 4096  # the header's range
        one = http(url, "GET", path, headers={"loopwarden-max-retained-bytes": str(lowered)}).json()
        assert (ids(one), one["has_more"]) == (["msg_002"], True)
        bad = http(url, "GET", path, headers={"loopwarden-max-retained-bytes": "12"})
        assert_envelope(bad, 400, "invalid_header", "loopwarden-max-retained-bytes")


# --- what the create path admitted is readable ---------------------------------------------------


def largest(build: Callable[[int], bytes], limit: int) -> int:
    """The largest ``n`` whose create body ``build(n)`` the create path admits under ``limit``
    with the store on (its ledger's ``admit_input``); ``build(n + 1)`` is refused."""

    def admitted(n: int) -> bool:
        try:
            Ledger(limit, store=True).admit_input(build(n))
        except BudgetExceeded:
            return False
        return True

    low, high = 0, 1
    while admitted(high):
        low, high = high, high * 2
    while low + 1 < high:
        mid = (low + high) // 2
        low, high = (mid, high) if admitted(mid) else (low, mid)
    assert admitted(low) and not admitted(low + 1)
    return low


def body_of(item: dict[str, Any]) -> bytes:
    return json.dumps({"model": "m", "input": [item]}, separators=(",", ":")).encode()


def text_item(n: int) -> dict[str, Any]:
    return {"type": "message", "id": "msg_big", "role": "user", "content": "t" * n}


def parts_item(n: int) -> dict[str, Any]:  # many small nodes: the history price per node is the high one
    return {
        "type": "message",
        "id": "msg_big",
        "role": "user",
        "content": [{"type": "input_text", "text": ""}] * n,
    }


@pytest.mark.parametrize("shape", [text_item, parts_item], ids=["long_text", "many_nodes"])
def test_the_largest_item_a_create_request_admits_is_readable(
    store_url: str, shape: Callable[[int], dict[str, Any]]
) -> None:
    bound = 1 * MiB
    item = shape(largest(lambda n: body_of(shape(n)), bound))
    with serve(store_url, max_retained_bytes=bound) as (url, harness, _):
        cid = conversation(harness, [msg(0, "before"), item, msg(2, "after")])
        got = pages(url, f"/v1/conversations/{cid}/items", order="asc")
        assert [item["id"] for page in got for item in page["data"]] == ["msg_000", "msg_big", "msg_002"]
        holding = next(p for p in got if "msg_big" in ids(p))
        if PAGE + item_charge(item, "msg_big") > bound:  # over the page bound: alone on its page
            assert ids(holding) == ["msg_big"]
        assert holding["data"][ids(holding).index("msg_big")] == present_item(item, "msg_big")


def test_the_largest_response_a_create_request_admits_is_readable(store_url: str) -> None:
    """The create path charges encoding the response object (``terminal``) within its ledger:
    the largest object that charge admits must come back from ``GET /v1/responses/{id}``."""
    bound = 1 * MiB
    rid = "resp_big"

    def response_bytes(n: int) -> bytes:
        return encode_json(response_object(rid, text="r" * n)).encode()

    n = 0
    step = 1 << 20
    while step:  # the largest text whose response object's terminal charge fits the bound
        if MODEL.terminal_charge(len(response_bytes(n + step)), True) <= bound:
            n += step
        else:
            step //= 2
    obj = response_object(rid, text="r" * n)
    with serve(store_url, max_retained_bytes=bound) as (url, harness, _):
        record = StoredResponse(rid, OWNER, 1_700_000_000, "completed", "m", None, None, obj, {})
        harness.call(harness.store.save_response(record, input_items=[], output_items=[], replay_items=[]))
        resp = http(url, "GET", f"/v1/responses/{rid}")
        assert resp.status_code == 200, resp.text
        assert resp.content == response_bytes(n) and resp.json() == obj


# --- admission: the pool ------------------------------------------------------------------------


def test_a_read_is_503_while_the_pool_is_full_and_413_when_one_item_exceeds_the_pool(store_url: str) -> None:
    items = [msg(k, "p" * 2000) for k in range(3)]
    charge = item_charge(items[0], "msg_000")
    room = PAGE + charge + charge // 2  # the first item, not a second
    with serve(store_url, max_retained_bytes=64 * MiB, pool_bytes=room, retry_after=7) as (
        url,
        harness,
        pool,
    ):
        cid = conversation(harness, items)
        path = f"/v1/conversations/{cid}/items"
        short = http(url, "GET", path, params={"order": "asc"}).json()
        assert (ids(short), short["has_more"]) == (["msg_000"], True)  # the pool is short: a shorter page

        async def fill() -> Any:
            return pool.admit(
                pool.budget - PAGE - charge + 1, caller="other"
            )  # another request holds the rest

        held = harness.call(fill())
        full = http(url, "GET", path)
        assert_envelope(full, 503, "server_overloaded")
        assert full.headers["retry-after"] == "7" and full.headers["connection"] == "close"
        assert "--max-inflight-retained-bytes" in full.json()["error"]["message"]
        assert full.headers.get("x-should-retry") is None  # a retry can help

        async def release() -> None:
            held.close()

        harness.call(release())
        assert ids(http(url, "GET", path, params={"order": "asc"}).json()) == ["msg_000"]

    with serve(store_url, max_retained_bytes=64 * MiB, pool_bytes=PAGE + charge - 1) as (url, harness, _):
        cid = conversation(harness, items)
        too_big = http(url, "GET", f"/v1/conversations/{cid}/items")
        assert_envelope(too_big, 413, "process_budget_exceeded")
        assert "--max-inflight-retained-bytes" in too_big.json()["error"]["message"]


# --- the measurement: six concurrent 100-item reads of 1 MB items -----------------------


class HoldReads:
    """ASGI wrapper: holds the ``http.response.start`` of every ``GET …/items`` until `release` is
    set, so all the reads are in flight at once (answers built, admissions held); `arrived`
    counts them and `statuses` their statuses."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.arrived = 0
        self.statuses: list[int] = []
        self.release = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "GET" and scope["path"].endswith("/items")):
            await self.app(scope, receive, send)
            return

        async def held_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.statuses.append(message["status"])
                self.arrived += 1
                while not self.release.is_set():
                    await asyncio.sleep(0.005)
            await send(message)

        await self.app(scope, receive, held_send)


def gauges(url: str) -> dict[str, float]:
    page = httpx.get(url + "/metrics", timeout=10).text
    wanted = ("loopwarden_inflight_retained_bytes", "loopwarden_admission_reserved_bytes")
    return {
        s.name: s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name in wanted and not s.labels
    }


def test_six_concurrent_100_item_reads_of_1mb_items_are_served_within_the_pool_or_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured before: six concurrent ``?limit=100`` reads of 1 MB items added 0.5 GB of RSS with
    every gauge at 0. Now each read is admitted from the pool for the page it may hold (as many
    1 MB items as fit max_retained_bytes): with a pool of three such pages, three reads are served
    — holding exactly the pool, shown by both gauges while they are in flight — and three get 503
    ``server_overloaded``; the served pages say ``has_more`` and continue."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    item = {"role": "user", "content": "x" * 1_000_000}
    limit = 64 * MiB
    minted = new_id("msg")  # the ids the store mints for items sent without one
    charge = item_charge(item, minted)
    per_page = max(1, (limit - PAGE) // charge)
    page_charge = PAGE + per_page * charge
    assert per_page < 100
    settings = Settings(
        upstream="http://127.0.0.1:9/v1",  # never called
        store=f"sqlite:///{tmp_path}/lw.db",
        max_retained_bytes=limit,
        max_inflight_retained_bytes=3 * page_charge,
        max_inflight_share_per_caller=1.0,  # the pool bound, not one caller's share (tests/ops/test_caller_share.py)
        retry_after=2.0,
    )
    gate = HoldReads(create_app(settings))
    with serve_asgi(gate) as url, httpx.Client(base_url=url, timeout=60) as client:
        cid = client.post("/v1/conversations", json={}).json()["id"]
        for _ in range(100):
            added = client.post(f"/v1/conversations/{cid}/items", json={"items": [item]})
            assert added.status_code == 200, added.text
        assert gauges(url) == {
            "loopwarden_inflight_retained_bytes": 0,
            "loopwarden_admission_reserved_bytes": 0,
        }

        answers: list[httpx.Response] = []

        def read() -> None:
            with httpx.Client(base_url=url, timeout=60) as own:
                answers.append(own.get(f"/v1/conversations/{cid}/items", params={"limit": 100}))

        threads = [threading.Thread(target=read) for _ in range(6)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while gate.arrived < 6:
            assert time.monotonic() < deadline, f"only {gate.arrived} reads were answered"
            time.sleep(0.01)
        during = gauges(url)  # every read is answered and still in flight
        gate.release.set()
        for thread in threads:
            thread.join(60)
        assert settled(lambda: gauges(url)["loopwarden_admission_reserved_bytes"] == 0)
        after = gauges(url)

        assert sorted(gate.statuses) == [200, 200, 200, 503, 503, 503]
        assert during == {
            "loopwarden_inflight_retained_bytes": 3 * page_charge,
            "loopwarden_admission_reserved_bytes": 3 * page_charge,
        }
        assert after == {"loopwarden_inflight_retained_bytes": 0, "loopwarden_admission_reserved_bytes": 0}
        served = [a for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code == 503]
        assert [len(a.json()["data"]) for a in served] == [per_page] * 3
        assert all(a.json()["has_more"] for a in served)
        for answer in refused:
            assert answer.json()["error"]["code"] == "server_overloaded"
            assert answer.headers["retry-after"] == "2"
        # The next page continues where the first stopped.
        first = served[0].json()
        following = client.get(
            f"/v1/conversations/{cid}/items", params={"limit": 100, "after": first["last_id"]}
        ).json()
        assert len(following["data"]) == per_page and following["has_more"]
        assert not set(ids(first)) & set(ids(following))


# --- what presentation adds is within the charged extra -----------------------------------------


@pytest.mark.parametrize(
    "item",
    [
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [], "status": "in_progress"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "message", "id": "msg_client_own_id", "role": "user", "content": "x"},
    ],
)
def test_what_a_page_adds_to_a_stored_item_is_within_the_charged_extra(item: dict[str, Any]) -> None:
    item_id = str(item.get("id") or new_id("mcpa"))  # the longest minted prefix
    nbytes, nodes = stored(item)
    shown = present_item(item, item_id)
    page = {"object": "list", "data": [shown], "first_id": item_id, "last_id": item_id, "has_more": True}
    page_bytes, page_nodes = stored(page)
    assert page_bytes - nbytes <= PAGE_EXTRA_BYTES + ITEM_EXTRA_BYTES + 2 * len(item_id.encode())
    assert page_nodes - nodes <= PAGE_EXTRA_NODES + ITEM_EXTRA_NODES
    shown_bytes, shown_nodes = stored(shown)
    assert shown_bytes + 1 - nbytes <= ITEM_EXTRA_BYTES  # + its comma in the list
    assert shown_nodes - nodes <= ITEM_EXTRA_NODES


def test_the_read_ledger_limit_covers_the_cheapest_create_price() -> None:
    """``read_ledger_limit`` scales max_retained_bytes by the largest ratio of a history price to
    the cheapest store-on create price (per byte and per node), never below the limit itself."""
    limit = 1 * MiB
    per_byte = min(
        MODEL.input_charge(1, 0, True),
        MODEL.output_charge(1, 0, True),
        MODEL.accumulated_charge(1, 0, True),
        MODEL.tool_result_charge(1, 0, True),
        MODEL.terminal_charge(1, True),
    )
    per_node = min(
        MODEL.input_charge(0, 1, True),
        MODEL.output_charge(0, 1, True),
        MODEL.accumulated_charge(0, 1, True),
        MODEL.tool_result_charge(0, 1, True),
    )
    # The measured model's feature prices charge every stored byte at least its projection
    # (2 copies × the 9/8 margin = 2.25), below every size-only price (attack report D2).
    assert stored_byte_floor(MODEL) == Fraction(9, 4) < per_byte
    assert stored_byte_floor(ChargeModel()) > ChargeModel().history_charge(1, 0)
    ratio_limit = max(
        limit,
        -(-limit * MODEL.history_charge(1, 0) * 4 // 9),
        -(-limit * MODEL.history_charge(0, 1) // per_node),
    )
    assert read_ledger_limit(limit, MODEL) == ratio_limit
    assert read_ledger_limit(
        limit, MODEL, extra_bytes=10, extra_nodes=2
    ) == ratio_limit + MODEL.history_charge(10, 2)
