"""Ledger: exact boundaries for every admission, atomicity, messages, pool hook."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import budget.ledger
from budget import BudgetExceeded, ChargeModel, Ledger, PoolExhausted, count_json_nodes
from budget.errors import PHASES, BudgetError

PAYLOAD = b'{"model":"m","input":[{"role":"user","content":"hi"}],"n":[1,2.5,true,null]}'
NODES = count_json_nodes(PAYLOAD)
N = len(PAYLOAD)


def test_payload_numbers() -> None:
    # { "model" "m" "input" [ { "role" "user" "content" "hi" "n" [ 1 2.5 true null
    assert (N, NODES) == (76, 16)


# method name -> (call, expected charge added, expected need that must fit) with the DESIGN.md §4
# numbers written out here, independently of ChargeModel's own formulas.
Case = tuple[Callable[[Ledger], int], Callable[[bool], int], Callable[[bool], int]]
CASES: dict[str, Case] = {
    "admit_input": (
        lambda led: led.admit_input(PAYLOAD),
        lambda s: (32 * N + 256 * NODES) * (2 if s else 1),
        lambda s: (32 * N + 256 * NODES) * (2 if s else 1),
    ),
    "admit_output": (
        lambda led: led.admit_output(PAYLOAD),
        lambda s: (64 * N + 8192 * NODES) * (2 if s else 1),
        lambda s: (64 * N + 8192 * NODES) * (2 if s else 1),
    ),
    "admit_stream_chunk": (lambda led: led.admit_stream_chunk(PAYLOAD), lambda s: 32 * N, lambda s: 48 * N),
    "admit_accumulated": (
        lambda led: led.admit_accumulated(PAYLOAD),
        lambda s: (32 * N + 256 * NODES) * (2 if s else 1),
        lambda s: (32 * N + 256 * NODES) * (2 if s else 1),
    ),
    "admit_accumulated_text": (
        lambda led: led.admit_accumulated(PAYLOAD, nodes=0),
        lambda s: 32 * N * (2 if s else 1),
        lambda s: 32 * N * (2 if s else 1),
    ),
    "admit_terminal": (
        lambda led: led.admit_terminal(PAYLOAD),
        lambda s: (6 if s else 4) * N,
        lambda s: (6 if s else 4) * N,
    ),
    "admit_tool_result": (
        lambda led: led.admit_tool_result(PAYLOAD),
        lambda s: (32 * N + 256 * NODES) * (2 if s else 1),
        lambda s: (32 * N + 256 * NODES) * (2 if s else 1),
    ),
    "admit_history": (
        lambda led: led.admit_history(PAYLOAD),
        lambda s: 32 * N + 8192 * NODES,  # never doubled
        lambda s: 32 * N + 8192 * NODES,
    ),
    "admit_history_size": (
        lambda led: led.admit_history_size(1000, 40),
        lambda s: 32 * 1000 + 8192 * 40,
        lambda s: 32 * 1000 + 8192 * 40,
    ),
    "reserve": (lambda led: led.reserve(12345), lambda s: 12345, lambda s: 12345),
}


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("method", sorted(CASES))
@pytest.mark.parametrize("already", [0, 777])
def test_boundary_table(method: str, store: bool, already: int) -> None:
    call, charge, need = CASES[method]
    # limit - 1: refused, nothing changes
    led = Ledger(already + need(store) - 1, store=store)
    led.reserve(already)
    with pytest.raises(BudgetExceeded) as info:
        call(led)
    assert (led.charged, led.peak) == (already, already)
    err = info.value
    assert (err.requested, err.charged, err.limit, err.over) == (need(store), already, led.limit, 1)
    # exactly the limit, and limit + 1: admitted, charged grows by the returned charge
    for slack in (0, 1):
        led = Ledger(already + need(store) + slack, store=store)
        led.reserve(already)
        assert call(led) == charge(store)
        assert led.charged == already + charge(store)
        assert led.peak == led.charged
        assert led.remaining == led.limit - led.charged


@pytest.mark.parametrize("store", [False, True])
def test_check_stream_frame_boundary_is_transient(store: bool) -> None:
    need = (768 if store else 512) * NODES
    for slack, ok in ((-1, False), (0, True), (1, True)):
        led = Ledger(500 + need + slack, store=store)
        led.reserve(500)
        if ok:
            assert led.check_stream_frame(PAYLOAD) == need
        else:
            with pytest.raises(BudgetExceeded) as info:
                led.check_stream_frame(PAYLOAD)
            assert info.value.phase == "stream_frame"
        assert (led.charged, led.peak) == (500, 500)  # keeps nothing either way


@pytest.mark.parametrize("store", [False, True])
def test_stream_bytes_release_and_doubling_rules(store: bool) -> None:
    led = Ledger(10**9, store=store)
    assert led.admit_stream_chunk(b"x" * 100) == 3200  # never doubled
    assert led.release_stream_bytes(60) == 1920
    assert led.charged == 1280
    with pytest.raises(ValueError, match="cannot release 3200 budget bytes: only 1280 are charged"):
        led.release_stream_bytes(100)
    assert led.charged == 1280


def test_fail_fast_does_not_count_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(data: object) -> int:
        raise AssertionError("counted a payload that could never fit")

    monkeypatch.setattr(budget.ledger, "count_json_nodes", boom)
    led = Ledger(32 * N - 1)
    for admit in (led.admit_input, led.admit_accumulated, led.admit_tool_result, led.admit_history):
        with pytest.raises(BudgetExceeded) as info:
            admit(PAYLOAD)
        assert info.value.requested == 32 * N  # the per-byte lower bound
    with pytest.raises(BudgetExceeded):
        led.admit_output(PAYLOAD)
    assert led.charged == 0


def test_explicit_nodes_skip_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget.ledger, "count_json_nodes", lambda data: pytest.fail("counted"))
    led = Ledger(10**9)
    assert led.admit_input(PAYLOAD, nodes=3) == 32 * N + 256 * 3
    assert led.admit_output(PAYLOAD, nodes=0) == 64 * N
    assert led.check_stream_frame(PAYLOAD, nodes=2) == 1024


def test_message_says_what_how_much_and_which_setting() -> None:
    led = Ledger(1_000_000, store=True)
    led.reserve(400_000)
    with pytest.raises(BudgetExceeded) as info:
        led.admit_input(b" " * 10_000, nodes=0)
    assert str(info.value) == (
        "max_retained_bytes exceeded by the request body (input): it needs 640,000 bytes but only "
        "600,000 of 1,000,000 remain (40,000 bytes over); raise max_retained_bytes or send a smaller request body"
    )
    err = info.value
    assert (err.phase, err.requested, err.charged, err.limit, err.over) == (
        "input",
        640_000,
        400_000,
        1_000_000,
        40_000,
    )
    assert isinstance(err, BudgetError)
    again = pickle.loads(pickle.dumps(err))
    assert (str(again), again.phase, again.over) == (str(err), "input", 40_000)


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_message_names_the_setting(phase: str) -> None:
    err = BudgetExceeded(phase, 10, 95, 100)  # type: ignore[arg-type]
    assert "max_retained_bytes" in str(err)
    assert "5 bytes over" in str(err)
    assert "raise " in str(err)


def test_lower_limit() -> None:
    led = Ledger(10_000)
    led.reserve(6_000)
    led.lower_limit(20_000)  # never raises the limit
    assert led.limit == 10_000
    led.lower_limit(6_000)  # exactly what is charged still fits
    assert (led.limit, led.remaining) == (6_000, 0)
    with pytest.raises(BudgetExceeded) as info:
        led.lower_limit(5_999)
    assert (info.value.phase, info.value.over, led.limit) == ("limit", 1, 6_000)
    assert "over the new limit of 5,999" in str(info.value)


def test_peak_tracks_the_highest_charge_and_snapshot_order_shows_in_it() -> None:
    led = Ledger(10**9)
    delta = led.admit_accumulated(b"x" * 1000, nodes=0)
    snapshot = led.admit_accumulated(b"x" * 1000, nodes=0)  # admitted first ...
    led.release(delta)  # ... then the replaced state is released
    assert (led.charged, led.peak) == (snapshot, 2 * snapshot)


def test_release_rules() -> None:
    led = Ledger(100)
    led.reserve(40)
    with pytest.raises(ValueError, match="must be >= 0"):
        led.release(-1)
    with pytest.raises(ValueError, match="cannot release 41"):
        led.release(41)
    assert led.release_all() == 40 and led.charged == 0
    with pytest.raises(TypeError):
        led.reserve(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, True, 2.0, "100"])
def test_limit_validation(bad: object) -> None:
    with pytest.raises(ValueError, match="limit must be an int >= 0"):
        Ledger(bad)  # type: ignore[arg-type]


def test_other_models_are_used() -> None:
    model = ChargeModel(input_per_byte=1, input_per_node=1, store_multiplier=3)
    led = Ledger(10**6, model, store=True)
    assert led.admit_input(PAYLOAD) == (N + NODES) * 3
    assert led.model is model and led.store


class Pool:
    """The simplest process-wide pool: a counter with a capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.taken = 0

    def try_take(self, nbytes: int) -> bool:
        if self.taken + nbytes > self.capacity:
            return False
        self.taken += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        self.taken -= nbytes


def test_pool_draws_and_returns_the_same_amounts() -> None:
    pool = Pool(capacity=10_000)
    a = Ledger(8_000, pool=pool)
    b = Ledger(8_000, pool=pool)
    assert isinstance(pool, budget.ChargePool)
    a.reserve(6_000)
    with pytest.raises(PoolExhausted) as info:
        b.reserve(5_000)  # fits b's own limit, not the pool
    assert (info.value.phase, info.value.requested, b.charged, pool.taken) == ("reserve", 5_000, 0, 6_000)
    assert "retry later" in str(info.value)
    with pytest.raises(BudgetExceeded):  # the ledger's own limit is checked first; the pool is untouched
        b.reserve(9_000)
    assert pool.taken == 6_000
    b.reserve(4_000)
    assert pool.taken == 10_000
    a.release(1_000)
    b.release_all()
    assert pool.taken == 5_000 == a.charged + b.charged
    assert a.check_stream_frame(PAYLOAD, nodes=1) == 512  # transient checks do not draw
    assert pool.taken == 5_000


payload_strategy = st.sampled_from(
    [b"", b"{}", b'"text"', PAYLOAD, b"x" * 300, b'[{"a":[1,2,3]},{"b":null}]' * 10]
)


class LedgerMachine(RuleBasedStateMachine):
    """Random admissions and releases: a refused charge changes nothing, an admitted one adds
    exactly what it returned, charged never passes the limit, peak is the running maximum, and a
    pool always holds exactly what the ledger charged."""

    @initialize(limit=st.integers(min_value=0, max_value=400_000), store=st.booleans(), pooled=st.booleans())
    def setup(self, limit: int, store: bool, pooled: bool) -> None:
        self.pool = Pool(capacity=300_000) if pooled else None
        self.ledger = Ledger(limit, store=store, pool=self.pool)
        self.charges: list[int] = []
        self.stream_bytes = 0
        self.peak = 0

    def _try(self, call: Callable[[], int]) -> None:
        before = self.ledger.charged
        try:
            added = call()
        except (BudgetExceeded, PoolExhausted):
            assert self.ledger.charged == before
            return
        assert self.ledger.charged == before + added
        self.charges.append(added)
        self.peak = max(self.peak, self.ledger.charged)

    @rule(
        data=payload_strategy,
        method=st.sampled_from(
            [
                "admit_input",
                "admit_output",
                "admit_accumulated",
                "admit_tool_result",
                "admit_history",
                "admit_terminal",
            ]
        ),
    )
    def admit(self, data: bytes, method: str) -> None:
        self._try(lambda: getattr(self.ledger, method)(data))

    @rule(nbytes=st.integers(min_value=0, max_value=50_000), nodes=st.integers(min_value=0, max_value=30))
    def history_size(self, nbytes: int, nodes: int) -> None:
        self._try(lambda: self.ledger.admit_history_size(nbytes, nodes))

    @rule(data=payload_strategy)
    def stream_chunk(self, data: bytes) -> None:
        before = self.ledger.charged
        self._try(lambda: self.ledger.admit_stream_chunk(data))
        if self.ledger.charged != before or not data:
            self.charges.pop()
            self.stream_bytes += len(data)

    @rule(data=payload_strategy)
    def frame(self, data: bytes) -> None:
        before = self.ledger.charged
        with contextlib.suppress(BudgetExceeded):
            self.ledger.check_stream_frame(data)
        assert self.ledger.charged == before

    @rule(nbytes=st.integers(min_value=0, max_value=100_000))
    def reserve(self, nbytes: int) -> None:
        self._try(lambda: self.ledger.reserve(nbytes))

    @rule(index=st.integers(min_value=0))
    def release(self, index: int) -> None:
        if self.charges:
            self.ledger.release(self.charges.pop(index % len(self.charges)))

    @rule()
    def frame_done(self) -> None:
        if self.stream_bytes:
            self.ledger.release_stream_bytes(self.stream_bytes)
            self.stream_bytes = 0

    @invariant()
    def consistent(self) -> None:
        led = self.ledger
        assert 0 <= led.charged <= led.limit
        assert led.charged == sum(self.charges) + 32 * self.stream_bytes
        assert led.peak == self.peak
        if self.pool is not None:
            assert self.pool.taken == led.charged


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_read_bound_that_fits_takes_nothing_and_notes_the_peak() -> None:
    """`Ledger.stream_read_admits` (the stream fast path's one check per read): the bound of the
    whole read and the widest frame's own charge, asked of the pool, committed nowhere."""
    model = budget.ChargeModel()
    pool = Pool(capacity=1 << 20)
    ledger = Ledger(1 << 20, pool=pool)
    ledger.reserve(1_000)
    assert ledger.stream_read_admits(1_000, 200)
    assert (ledger.charged, pool.taken) == (1_000, 1_000)  # nothing kept, nothing drawn
    assert ledger.peak == 1_000 + model.stream_retained_charge(200)  # as admitting it would show
    need = model.stream_chunk_need(1_000) + model.frame_charge(200, False)
    short, exact = Ledger(1_000 + need - 1), Ledger(1_000 + need)
    short.reserve(1_000)
    exact.reserve(1_000)
    assert not short.stream_read_admits(1_000, 200)  # the bound, exactly
    assert exact.stream_read_admits(1_000, 200)


def test_a_read_bound_is_refused_when_the_pool_has_no_room_for_the_widest_frame() -> None:
    frame = budget.ChargeModel().stream_retained_charge(200)
    pool = Pool(capacity=1_000 + frame - 1)
    ledger = Ledger(1 << 20, pool=pool)
    ledger.reserve(1_000)
    assert not ledger.stream_read_admits(1_000, 200)  # a take of the frame's charge would fail
    assert (ledger.charged, pool.taken) == (1_000, 1_000)
    pool.capacity += 1
    assert ledger.stream_read_admits(1_000, 200)
    assert pool.taken == 1_000  # a pool without can_take: taken and given straight back
