"""decisions.parquet's batches from the compiled twin's buffers (`testbed_native.decision_columns`)
against the Python way (`testbed.metrics.decision_columns` and Arrow arrays from its lists): the same
batch, bit for bit, for generated held lines, awkward times, values and labels included, and the
Python way's refusal where it refuses. Skipped where the extension is not built, unless
TESTBED_REQUIRE_NATIVE=1."""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_ext import required
from test_native_record_columns import arrow_bytes

from testbed.metrics import columnar

ext = required()

# Times near a microsecond tie (round(t, 6) rounds half to even on the exact binary value), zeros,
# huge and non-finite ones, and ints.
TIMES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 10**6).map(lambda k: k * 0.0000005),
    st.sampled_from([0.0, -0.0, 2.5e-6, 1.0000005, 1e300, 123456.0000025, 5e-324, math.inf, math.nan]),
    st.integers(-(2**70), 2**70),
)
# Mostly what a run holds, now and then something of another type or shape, which the Python way
# converts or refuses (and the compiled one leaves to it).
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**64), 2**64),
    st.sampled_from([True, "7", None]),
)
PLAIN = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
TEXTS = st.one_of(PLAIN, PLAIN, PLAIN, st.text(max_size=4))  # lone surrogates too: refused
LABELS = st.one_of(
    st.dictionaries(PLAIN, PLAIN, max_size=7),
    st.dictionaries(PLAIN, PLAIN, max_size=7),
    st.dictionaries(TEXTS, TEXTS, max_size=3),
    st.dictionaries(PLAIN, st.integers(0, 9), max_size=2),  # a label that is not text: converted
)
SAMPLE = st.one_of(
    st.tuples(PLAIN, VALUES, LABELS),
    st.tuples(PLAIN, VALUES, LABELS),
    st.tuples(TEXTS, VALUES, LABELS).map(list),
    st.tuples(st.integers(0, 3), VALUES, LABELS),  # a metric that is not text
    st.tuples(PLAIN, VALUES),  # too short: the Python way's IndexError
)
# Half the batches hold only what a run holds (a batch takes the compiled way only if every line
# does), the other half anything above.
ORDINARY = st.tuples(
    PLAIN,
    st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**63), 2**63 - 1)),
    st.dictionaries(PLAIN, PLAIN, max_size=7),
)
HELD = st.one_of(
    st.lists(
        st.tuples(TIMES.filter(lambda t: abs(t) < 2**63), PLAIN, st.lists(ORDINARY, max_size=3)), min_size=1, max_size=6
    ),
    st.lists(
        st.tuples(
            TIMES,
            st.one_of(TEXTS, st.just("router")),
            st.one_of(st.lists(SAMPLE, max_size=3), st.lists(SAMPLE, max_size=3).map(tuple)),
        ),
        min_size=1,
        max_size=6,
    ),
)


def _batch(held: list[Any], speedup: float, compiled: bool) -> bytes | type[BaseException]:
    try:
        return arrow_bytes(columnar.decision_batch(held, speedup, compiled=compiled))
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError, IndexError, pa.ArrowException) as e:
        return type(e)


taken: list[bool] = []


@pytest.mark.pure
@settings(max_examples=400, deadline=None)
@given(held=HELD, speedup=st.sampled_from([1.0, 4.0, 3.0, 0.1]))
def test_both_ways_build_the_same_batch(held: list[Any], speedup: float) -> None:
    taken.append(ext.decision_columns(held, speedup) is not None)
    assert _batch(held, speedup, True) == _batch(held, speedup, False)


@pytest.mark.pure
def test_the_generated_batches_took_the_compiled_way_often() -> None:
    """The comparison above is not vacuous."""
    if not taken:
        pytest.skip("runs after test_both_ways_build_the_same_batch")
    assert sum(taken) / len(taken) > 0.3


@pytest.mark.pure
def test_a_simulated_runs_decisions_take_the_compiled_way() -> None:
    held = [
        (
            t * 0.3,
            "router",
            [("decision", 8175, {"request_id": f"r-{t}", "prefill": "pd-p0", "reason": "l=8175 <= t=19400"})],
        )
        for t in range(50)
    ]
    held.append((20.0, "router", [("threshold", 19400.0, {})]))
    assert ext.decision_columns(held, 4.0) is not None
    assert _batch(held, 4.0, True) == _batch(held, 4.0, False)
