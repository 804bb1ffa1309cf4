"""records.parquet's batches from the compiled twin's buffers (`testbed_native.record_columns`)
against the Python way (`testbed.metrics.columnar`): the same Arrow batch for generated settled
records, awkward values included, and the Python way's refusal where it refuses. Skipped where the
extension is not built, unless TESTBED_REQUIRE_NATIVE=1."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_ext import required
from test_native_record_rows import records

from testbed.core.record import TIME_NAMES, RequestRecord, StageTimes
from testbed.metrics import columnar
from testbed.metrics.records import MAX_FIELD_CHARS, as_written

ext = required()


def _settled(rec: RequestRecord) -> RequestRecord | None:
    """The record as records.csv reads it back (what the writers hand the Parquet writer), or None
    where that cannot be written."""
    r = dataclasses.replace(rec, times=dataclasses.replace(rec.times))
    try:
        as_written(r)
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError):
        return None
    return r


def _batch(recs: list[RequestRecord], compiled: bool) -> pa.RecordBatch | type[BaseException]:
    try:
        return columnar._record_batch(recs, True, compiled=compiled)
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError, pa.ArrowException) as e:
        return type(e)


def arrow_bytes(batch: pa.RecordBatch) -> bytes:
    """The batch as Arrow's stream format writes it: schema and every buffer, bit for bit (NaN
    included, which `equals` takes as unequal to itself)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return bytes(sink.getvalue())


taken: list[bool] = []


@pytest.mark.pure
@settings(max_examples=300, deadline=None)
@given(raw=st.lists(records(), min_size=1, max_size=6), odd=st.sampled_from([None, 1, True, "x", 2**70]))
def test_both_ways_build_the_same_batch(raw: list[RequestRecord], odd: Any) -> None:
    """Settled records (NaN stamps as null, -0.0, subnormals, texts of any width), and now and then
    a value the settling left of another type than its column's: the same batch, or the same
    refusal."""
    recs = [r for r in map(_settled, raw) if r is not None]
    if not recs:
        return
    if odd is not None:  # a field the Python way converts (or refuses) and the compiled one leaves
        recs[0].input_tokens = odd
    if odd is None or odd == 1 and odd is not True:  # the batches left as settled (an int is an int column's)
        taken.append(ext.record_columns(recs, columnar._NATIVE_FIELDS, list(columnar.TIME_COLUMNS)) is not None)
    want, got = _batch(recs, False), _batch(recs, True)
    if isinstance(want, type):
        assert got is want
        return
    assert isinstance(got, pa.RecordBatch)
    assert arrow_bytes(got) == arrow_bytes(want), (got.to_pylist(), want.to_pylist())


@pytest.mark.pure
def test_the_generated_batches_mostly_took_the_compiled_way() -> None:
    """The comparison above is not vacuous."""
    if not taken:
        pytest.skip("runs after test_both_ways_build_the_same_batch")
    assert sum(taken) / len(taken) > 0.3


def _unsettled_batch(recs: list[RequestRecord], compiled: bool) -> pa.RecordBatch | type[BaseException]:
    try:
        return columnar._record_batch(recs, False, compiled=compiled)
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError, pa.ArrowException) as e:
        return type(e)


taken_unsettled: list[bool] = []


@pytest.mark.pure
@settings(max_examples=300, deadline=None)
@given(raw=st.lists(records(), min_size=1, max_size=6))
def test_records_not_settled_build_the_batch_of_the_settled(raw: list[RequestRecord]) -> None:
    """A batch of records not settled (a long run's, which it does not keep), built either way, is
    the batch of the same records settled, and leaves them as they were."""
    pairs = [(r, s) for r in raw if (s := _settled(r)) is not None]
    if not pairs:
        return
    recs = [r for r, _ in pairs]
    before = repr(recs)
    want = _batch([s for _, s in pairs], True)
    taken_unsettled.append(
        ext.record_columns(recs, columnar._NATIVE_FIELDS, list(columnar.TIME_COLUMNS), True, MAX_FIELD_CHARS)
        is not None
    )
    for compiled in (True, False):
        got = _unsettled_batch(recs, compiled)
        if isinstance(want, type):
            assert got is want
            continue
        assert isinstance(got, pa.RecordBatch)
        assert arrow_bytes(got) == arrow_bytes(want), (compiled, got.to_pylist(), want.to_pylist())
    assert repr(recs) == before


@pytest.mark.pure
def test_the_unsettled_batches_mostly_took_the_compiled_way() -> None:
    """The comparison above is not vacuous."""
    if not taken_unsettled:
        pytest.skip("runs after test_records_not_settled_build_the_batch_of_the_settled")
    assert sum(taken_unsettled) / len(taken_unsettled) > 0.3


@pytest.mark.pure
def test_a_simulated_runs_records_take_the_compiled_way() -> None:
    rec = RequestRecord(
        "r1",
        3,
        300,
        16,
        prefill_node="pd-p0",
        decode_node="pd-d0",
        crossed_wan=True,
        threshold=math.nan,
        outcome="completed",
        times=StageTimes(*(0.1 * i if i % 3 else math.nan for i in range(len(TIME_NAMES)))),
    )
    as_written(rec)
    cols = ext.record_columns([rec, rec], columnar._NATIVE_FIELDS, list(columnar.TIME_COLUMNS))
    assert cols is not None and len(cols) == len(columnar.RECORD_SCHEMA)
    assert arrow_bytes(columnar._record_batch([rec, rec], True)) == arrow_bytes(
        columnar._record_batch([rec, rec], True, compiled=False)
    )
