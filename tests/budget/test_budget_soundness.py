"""Soundness: the input charge is at least what parsing the payload really retains.

Measured with tracemalloc for json.loads and msgspec (what the gateway uses, via loads_strict
and decode_first) and orjson.loads, for the pathological shapes of budget.calibrate and for generated documents,
under the default model and the measured CPython model."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget import ChargeModel, count_json_nodes, loads_strict
from budget.calibrate import SHAPES, measure, parsers

MODELS = {"reference": ChargeModel.reference(), "measured (size-only bounds)": ChargeModel.measured()}
PARSERS = {**parsers(), "loads_strict": loads_strict}
SIZE = 48 * 1024


def test_orjson_and_msgspec_are_measured_too() -> None:
    assert set(PARSERS) == {"json.loads", "msgspec", "orjson.loads", "loads_strict"}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_input_charge_covers_retained_memory(shape: str, parser: str) -> None:
    payload = SHAPES[shape](SIZE)
    nodes = count_json_nodes(payload)
    retained, _peak = measure(PARSERS[parser], payload)
    assert retained > 0
    for name, model in MODELS.items():
        charge = model.input_charge(len(payload), nodes, store=False)
        assert charge >= retained, (name, shape, parser, charge, retained)


def test_measured_size_only_bounds_also_covers_the_json_loads_parse_peak() -> None:
    for shape, make in SHAPES.items():
        payload = make(SIZE)
        charge = ChargeModel.measured().input_charge(len(payload), count_json_nodes(payload), store=False)
        _retained, peak = measure(json.loads, payload)
        assert charge >= peak, (shape, charge, peak)


documents = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
    lambda children: (
        st.lists(children, max_size=8)
        | st.dictionaries(st.text(alphabet=st.characters(codec="utf-8"), max_size=8), children, max_size=8)
    ),
    max_leaves=60,
)


@given(documents, st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_generated_documents(value: object, ascii_only: bool) -> None:
    payload = json.dumps(value, ensure_ascii=ascii_only).encode()
    nodes = count_json_nodes(payload)
    for parse in PARSERS.values():
        retained, _ = measure(parse, payload)
        for model in MODELS.values():
            assert model.input_charge(len(payload), nodes, store=False) >= retained
