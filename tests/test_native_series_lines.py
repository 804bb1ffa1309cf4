"""The compiled lines of a held batch of samples (`testbed_native.series_lines`) against the
Python ones of `BatchSeriesFile` they twin: the same bytes for generated batches (floats of
every kind, ints, texts that need escaping, sources by name), None for what only Python writes,
and whole files the same either way. Skipped where the extension is not built, unless
TESTBED_REQUIRE_NATIVE=1."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_ext import required

from testbed.metrics.series_batch import BatchSeriesFile
from testbed.metrics.series_format import read_series

EXT = required()
pytestmark = pytest.mark.pure

TEXTS = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
VALUES = st.one_of(
    st.floats(),  # NaN and the infinities write null
    st.floats(min_value=-1e20, max_value=1e20),
    st.sampled_from([0.0, -0.0, 1e16, 9999999999999998.0, 1e-4, 9.99e-5, 1e-5, 5e-324, 1.7976931348623157e308]),
    # dyadic values, whose short exact decimals make ties between the shortest candidates
    # (10339373503.8203125: Python writes ...820312, the nearer with ties to even)
    st.builds(lambda m, e: m / 2**e, st.integers(0, 2**53), st.integers(0, 60)),
    st.just(10339373503.8203125),
    st.integers(-(2**63), 2**63 - 1),
)
SAMPLES = st.lists(
    st.tuples(
        st.sampled_from(["queue_depth", "kv_bytes_sent", "decision"]), VALUES, st.dictionaries(TEXTS, TEXTS, max_size=3)
    ),
    max_size=4,
)
BATCH = st.lists(
    st.tuples(st.floats(0, 1e7), st.one_of(st.none(), TEXTS), SAMPLES.map(tuple) | SAMPLES),
    max_size=6,
)


def _python(batch: list[Any], speedup: float, tmp: Path) -> tuple[str, int, str]:
    f = BatchSeriesFile(tmp / "x.jsonl", "nodes", speedup)
    out: list[str] = []
    for t, source, samples in batch:
        f._emit(out, t, source, samples)
    f.close()
    return "".join(out), len(out), f._head


@settings(max_examples=400, deadline=None)
@given(batch=BATCH, speedup=st.sampled_from([1.0, 4.0, 3.7]))
def test_a_batch_is_written_as_the_python_writes_it(batch: list[Any], speedup: float, tmp_path_factory: Any) -> None:
    text, n, head = _python(batch, speedup, tmp_path_factory.mktemp("b"))
    assert EXT.series_lines(batch, speedup, head) == (text, n)


@settings(max_examples=500, deadline=None)
@given(
    x=st.floats(allow_nan=False, allow_infinity=False)
    | st.builds(lambda m, e: m / 2**e, st.integers(0, 2**60), st.integers(0, 70))
)
def test_a_value_is_its_float_repr(x: float) -> None:
    text, n = EXT.series_lines([(1.0, "a", [("m", x, {})])], 1.0, "")
    assert n == 1 and f'"value": {x!r},' in text


@pytest.mark.parametrize(
    "batch",
    [
        [(1.0, None, [("m", 1.0, {"k": 1})])],  # a label that is not text: json.dumps's
        [(1.0, None, [("m", True, {})])],  # float(True)
        [(1.0, None, [("m", 2**70, {})])],  # an int past 64 bits
        [(1.0, None, [("m", 1.0, {"k": "\ud800"})])],  # a lone surrogate
        [(1.0, None, (s for s in [("m", 1.0, {})]))],  # samples that are not a list or a tuple
        [(1, None, [("m", 1.0, {})])],  # an int time
        [(1.0, None, [("m", 1.0)])],  # not a triple
    ],
)
def test_what_only_python_writes_is_left_to_it(batch: list[Any]) -> None:
    assert EXT.series_lines(batch, 1.0, ', "source": "nodes", "metric": ') is None


def test_a_held_file_reads_back_as_its_points(tmp_path: Path) -> None:
    """The compiled lines and the points kept beside them say the same."""
    path = tmp_path / "nodes.jsonl"
    f = BatchSeriesFile(path, "nodes", 4.0, keep=True, deferred=True, unheld=frozenset({"running"}))
    for i in range(5000):  # past a batch
        f.source_write(
            0.37 * i,
            f"p{i % 3}",
            [("running", float(i % 4), {}), ("kv_bytes_sent", 1e6 * i, {"link": "a->b"}), ("lag", math.inf, {})],
        )
    f.close()
    back = read_series(path, 0.0)
    assert len(back) == f.lines == 15000
    kept = [p for p in back if p.metric != "running"]
    assert len(f.points or []) == len(kept)
    for a, b in zip(f.points or [], kept):
        assert (a.t, a.source, a.metric, a.labels) == (b.t, b.source, b.metric, b.labels)
        assert a.value == b.value or (math.isinf(a.value) and math.isnan(b.value))
    assert f.unheld_counts == {"running": 5000}
