"""Limits and ChargeModel: ranges with exact messages, field-wise minimum, the §4 defaults."""

from __future__ import annotations

import dataclasses

import pytest

from budget import ChargeModel, ConfigError, Limits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_retained_bytes": 4095}, "max_retained_bytes must be in 4096..=268435456, got 4095"),
        (
            {"max_retained_bytes": 268_435_457},
            "max_retained_bytes must be in 4096..=268435456, got 268435457",
        ),
        ({"max_infer_iters": 0}, "max_infer_iters must be in 1..=100, got 0"),
        ({"max_infer_iters": 101}, "max_infer_iters must be in 1..=100, got 101"),
        ({"max_infer_iters": True}, "max_infer_iters must be an int in 1..=100, got True"),
        (
            {"max_retained_bytes": "64MiB"},
            "max_retained_bytes must be an int in 4096..=268435456, got '64MiB'",
        ),
    ],
)
def test_out_of_range_values_are_refused_with_exact_messages(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Limits(**kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert isinstance(info.value, ConfigError)
    field = next(iter(kwargs))
    assert (info.value.field, info.value.value) == (field, kwargs[field])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_retained_bytes": 4096},
        {"max_retained_bytes": 268_435_456},
        {"max_infer_iters": 1},
        {"max_infer_iters": 100},
    ],
)
def test_bounds_are_inclusive(kwargs: dict[str, int]) -> None:
    limits = Limits(**kwargs)
    field = next(iter(kwargs))
    assert getattr(limits, field) == kwargs[field]


def test_defaults_clamps_and_frozen() -> None:
    limits = Limits()
    assert (limits.max_infer_iters, limits.max_retained_bytes) == (10, 67_108_864)
    assert (limits.request_body_clamp, limits.upstream_body_clamp) == (2 * 1024 * 1024, 8 * 1024 * 1024)
    assert repr(limits) == "Limits(max_infer_iters=10, max_retained_bytes=67108864)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_infer_iters = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Limits(10)  # type: ignore[misc]  # keyword-only


def test_smallest_is_field_wise() -> None:
    a = Limits(max_infer_iters=3, max_retained_bytes=100_000_000)
    b = Limits(max_infer_iters=50, max_retained_bytes=5_000)
    assert Limits.smallest(a, b) == Limits(max_infer_iters=3, max_retained_bytes=5_000)
    assert Limits.smallest(b) == b
    with pytest.raises(ValueError, match="at least one"):
        Limits.smallest()
    with pytest.raises(TypeError):
        Limits.smallest(a, 3)  # type: ignore[arg-type]


def test_default_model_is_design_section_4() -> None:
    m = ChargeModel()
    assert ChargeModel.reference() == m
    assert m.parse is None and m.name == "reference"
    assert dataclasses.asdict(m) == {
        "input_per_byte": 32,
        "input_per_node": 256,
        "output_per_byte": 64,
        "output_per_node": 8192,
        "stream_retained_per_byte": 32,
        "stream_transient_per_byte": 16,
        "frame_per_node": 512,
        "frame_store_extra_per_node": 256,
        "accumulated_per_byte": 32,
        "accumulated_per_node": 256,
        "terminal_per_byte": 4,
        "terminal_store_extra_per_byte": 2,
        "tool_per_byte": 32,
        "tool_per_node": 256,
        "history_per_byte": 32,
        "history_per_node": 8192,
        "store_multiplier": 2,
        "parse": None,
    }
    assert m.input_charge(10, 2, store=True) == 2 * (320 + 512)
    assert m.history_charge(10, 2) == 320 + 16384
    assert m.terminal_charge(10, store=True) == 60
    assert m.frame_charge(3, store=True) == 3 * 768


def test_cpython_model_is_cheaper_except_for_encoding_and_never_zero() -> None:
    d = dataclasses.asdict(ChargeModel())
    c = dataclasses.asdict(dataclasses.replace(ChargeModel.measured(), parse=None))
    for name, value in c.items():
        if name == "parse":
            continue
        assert value > 0, name
        if not name.startswith("terminal_"):
            assert value <= d[name], name
    # Encoding text that needs 4 bytes per character (one emoji in a str makes all of it UCS-4)
    # holds the str and its UTF-8 bytes at once: 5 bytes per byte, more than the reference 4.
    assert c["terminal_per_byte"] >= 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_per_byte": -1}, "input_per_byte must be in 0..=1048576, got -1"),
        ({"store_multiplier": 0}, "store_multiplier must be in 1..=1048576, got 0"),
        ({"output_per_node": 1.5}, "output_per_node must be an int in 0..=1048576, got 1.5"),
        ({"history_per_node": 1 << 21}, "history_per_node must be in 0..=1048576, got 2097152"),
    ],
)
def test_model_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ChargeModel(**kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message
