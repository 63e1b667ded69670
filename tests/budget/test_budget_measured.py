"""The measured charge model (DESIGN.md §4): sound and tight against the gateway's real pipeline.

*Sound*: for every payload the charge is at least the peak that `tracemalloc` sees while the
gateway's own steps run (`budget.calibrate.pipeline_peak`: the body's copy, the strict parse, the
re-serialised upstream body, with store the projection; for a buffered upstream body its chunks,
the joined body, the parse, the client answer). *Tight*: at most 2 × that peak on the calibration
shapes (none repeats object keys) and on every JSON body in ``../shared/cassettes``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget import ChargeModel, JsonNodeCounter, Ledger, json_features
from budget.calibrate import SHAPES, measured_charge, pipeline_peak
from tests.mock_upstream import cassettes_dir

SIZE = 48 * 1024
OWNERS = ("input", "output")
REPEATED_KEYS = {"small_objects", "responses_body"}
"""Shapes whose objects repeat keys: CPython's parser shares them, which no sound lexical price can
see, so only soundness is asserted for them (their ratio is printed by ``budget.calibrate``)."""


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("owner", OWNERS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sound_and_tight_on_every_calibration_shape(shape: str, owner: str, store: bool) -> None:
    payload = SHAPES[shape](SIZE)
    peak = pipeline_peak(payload, owner, store)
    charge = measured_charge(payload, owner, store)
    assert charge >= peak, (shape, owner, store, charge, peak)
    if shape not in REPEATED_KEYS:
        assert charge <= 2 * peak, (shape, owner, store, charge, peak, charge / peak)


def _cassette_bodies(root: Path) -> Iterator[tuple[str, bytes]]:
    """Every recorded body: SSE ``data:`` payloads, request and response ``body`` mappings (and an
    event recording's ``request``), re-encoded as UTF-8 JSON, and the ``.json`` files."""
    for path in sorted(root.rglob("*")):
        if path.suffix == ".json":
            yield path.name, path.read_bytes()
        elif path.suffix == ".yaml":
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            stack: list[tuple[str, object]] = [("", doc)]
            n = 0
            while stack:
                key, node = stack.pop()
                if isinstance(node, str) and node.startswith("data: {"):
                    n += 1
                    yield f"{path.name}#{n}", node[6:].encode()
                elif isinstance(node, dict):
                    if key in ("body", "request") and "headers" not in node:
                        n += 1
                        yield f"{path.name}#{n}", json.dumps(node, ensure_ascii=False).encode()
                    stack.extend((str(k), v) for k, v in node.items())
                elif isinstance(node, list):
                    stack.extend((key, v) for v in node)


def shared_key_bytes(body: bytes) -> int:
    """Bytes CPython's parser saves on ``body`` by sharing repeated object keys (one `str` per
    distinct key within a parse): what no sound lexical price can see (the issue's caveat)."""
    keys: Counter[str] = Counter()

    def hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys.update(k for k, _ in pairs if len(k) > 1)  # "" and one-character keys are shared anyway
        return dict(pairs)

    json.loads(body, object_pairs_hook=hook)
    return sum((count - 1) * sys.getsizeof(key) for key, count in keys.items())


def _bodies() -> list[tuple[str, bytes]]:
    root = cassettes_dir()
    if root is None:
        return []
    seen: set[bytes] = set()
    out = []
    for name, body in _cassette_bodies(root):
        if body.lstrip()[:1] == b"{" and body not in seen:  # recordings repeat frames verbatim
            seen.add(body)
            out.append((name, body))
    return out


def test_cassette_bodies_are_sound_and_tight() -> None:
    bodies = _bodies()
    if not bodies:
        pytest.skip("no cassettes: set $LOOPWARDEN_CASSETTES or put ../shared/cassettes beside the repo")
    assert len(bodies) > 100  # SSE frames, requests, responses of every recording
    worst = worst_unshared = 0.0
    for name, body in bodies:
        shared = shared_key_bytes(body)
        for owner in OWNERS:
            for store in (False, True):
                peak = pipeline_peak(body, owner, store, repeat=2)
                charge = measured_charge(body, owner, store)
                assert charge >= peak, (name, owner, store, charge, peak)
                # tight against what the parse would hold if it did not share repeated keys
                assert charge <= 2 * (peak + shared), (name, owner, store, charge, peak, shared)
                worst = max(worst, charge / peak)
                worst_unshared = max(worst_unshared, charge / (peak + shared))
    print(f"{len(bodies)} cassette bodies: worst charge / peak {worst:.2f}, {worst_unshared:.2f} unshared")


# Adversarial payloads: each strategy builds the JSON text of one hostile shape, sized at random.
_ASTRAL = "\U0001f600"
_string_units = st.sampled_from(
    ["a", "\xe9", "\u6f22", _ASTRAL, "\\n", "\\u00e9", "\\ud83d\\ude00", "\\\\", '\\"']
)


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    kind = draw(
        st.sampled_from(
            [
                "one_char_strings",
                "empty_objects",
                "empty_arrays",
                "ucs4_strings",
                "astral_in_ascii",
                "escape_runs",
                "big_ints",
                "floats",
                "nesting",
                "keys",
            ]
        )
    )
    n = draw(st.integers(min_value=1, max_value=3000))
    if kind == "one_char_strings":
        unit = draw(_string_units)
        return ("[" + ",".join([f'"{unit}"'] * n) + "]").encode()
    if kind == "empty_objects":
        return ("[" + ",".join(["{}"] * n) + "]").encode()
    if kind == "empty_arrays":
        return ("[" + ",".join(["[]"] * n) + "]").encode()
    if kind == "ucs4_strings":
        return json.dumps([_ASTRAL * draw(st.integers(1, 50))] * n, ensure_ascii=False).encode()
    if kind == "astral_in_ascii":
        length = n * 40
        at = draw(st.integers(0, length))
        escaped = draw(st.booleans())
        char = "\\ud83d\\ude00" if escaped else _ASTRAL
        return ('["' + "a" * at + char + "a" * (length - at) + '"]').encode()
    if kind == "escape_runs":
        unit = draw(_string_units)
        return ('["' + unit * n * 20 + '"]').encode()
    if kind == "big_ints":
        digits = draw(st.integers(1, 4000))
        return ("[" + ",".join(["9" * digits] * max(n // digits, 1)) + "]").encode()
    if kind == "floats":
        return json.dumps([i * 1.000001 + 0.5 for i in range(n)]).encode()
    if kind == "nesting":
        depth = draw(st.integers(1, 127))
        return ("[" + ",".join(["[" * depth + "]" * depth] * max(n // depth, 1)) + "]").encode()
    return json.dumps(
        {f"k{i}": draw(st.sampled_from([0, None, True, "v", [], {}])) for i in range(n)}
    ).encode()


@given(hostile(), st.sampled_from(OWNERS), st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_sound_on_hostile_shapes(payload: bytes, owner: str, store: bool) -> None:
    json.loads(payload)  # every generated payload is valid JSON
    assert measured_charge(payload, owner, store) >= pipeline_peak(payload, owner, store)


documents = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40),
    lambda children: (
        st.lists(children, max_size=8)
        | st.dictionaries(
            st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8),
            children,
            max_size=8,
        )
    ),
    max_leaves=80,
)


@given(documents, st.booleans(), st.sampled_from(OWNERS), st.booleans())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_sound_on_generated_documents(value: object, ascii_only: bool, owner: str, store: bool) -> None:
    payload = json.dumps({"v": value}, ensure_ascii=ascii_only).encode()
    assert measured_charge(payload, owner, store) >= pipeline_peak(payload, owner, store)


@given(hostile(), st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_features_do_not_depend_on_the_chunking(payload: bytes, cuts: list[int]) -> None:
    # the counter cuts pieces at fixed offsets of the whole text, whatever the reads
    counter = JsonNodeCounter(max_depth=None, features=True)
    start = 0
    for cut in cuts:
        counter.feed(payload[start : start + cut])
        start += cut
    counter.feed(payload[start:])
    assert counter.features() == json_features(payload)


def test_features_count_what_cpython_builds() -> None:
    f = json_features('{"a":[1,300,-4,1.5,true,null,"x","",{}],"b":"\\u00e9\\n","c":"été"}'.encode())
    assert (f.objects, f.empty_objects, f.members, f.arrays, f.empty_arrays) == (2, 1, 3, 1, 0)
    assert (f.numbers, f.small_ints, f.literals, f.strings) == (4, 2, 2, 7)  # 1 and -4 are shared
    # "a", "b", "c", "x" and "" are shared singletons; "é\n" and "été" are Latin-1 strs (73 + chars)
    assert f.string_bytes == (73 + 2) + (73 + 3)
    assert f.escaped == 1 and f.text_width == 1 and f.nonascii_bytes == 4


def test_one_astral_character_makes_the_whole_string_four_bytes_wide() -> None:
    text = "a" * 100_000 + _ASTRAL
    raw = json.dumps([text], ensure_ascii=False).encode()
    for chunk in (len(raw), 4096):  # measured exactly, or bounded across reads: at least UCS-4
        counter = JsonNodeCounter(features=True)
        for i in range(0, len(raw), chunk):
            counter.feed(raw[i : i + chunk])
        assert counter.features().string_bytes >= 4 * len(text)


def test_the_default_model_admits_a_five_megabyte_screenshot_with_store_on() -> None:
    image = "data:image/png;base64," + "iVBORw0KGgo" * (6_670_000 // 11)
    body = {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": image}]}],
    }
    raw = json.dumps(body).encode()
    measured = Ledger(64 << 20, ChargeModel.measured(), store=True)
    measured.admit_input(raw)
    assert measured.charged < 64 << 20
    assert len(raw) <= ChargeModel.measured().body_clamp(64 << 20)
    assert len(raw) > ChargeModel.reference().body_clamp(64 << 20)  # the reference clamp refuses it


def test_clamps_follow_the_model() -> None:
    limit = 64 << 20
    assert ChargeModel.reference().body_clamp(limit) == limit // 32
    assert ChargeModel.reference().upstream_clamp(limit) == limit // 8
    m = ChargeModel.measured()
    assert m.body_clamp(limit) == limit * 2 // 3
    assert m.upstream_clamp(limit) == limit * 2 // 5
    # the clamp is the largest body the model could ever admit: its floor at the clamp fits
    assert m.input_floor(m.body_clamp(limit)) <= limit < m.input_floor(m.body_clamp(limit) + 2)


@pytest.mark.parametrize("shape", ["small_ints", "one_char_strings", "wide_object", "empty_objects"])
def test_sound_and_tight_past_the_encoders_fragment_cap(shape: str) -> None:
    # 1 MiB of tokens: more than the 100,000 fragments CPython's encoder holds before joining
    payload = SHAPES[shape](1 << 20)
    assert json_features(payload).nodes > 100_000
    for store in (False, True):
        peak = pipeline_peak(payload, "input", store, repeat=1)
        charge = measured_charge(payload, "input", store)
        assert peak <= charge <= 2 * peak, (shape, store, charge, peak)
