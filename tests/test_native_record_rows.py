"""The compiled records.csv line writer (`testbed_native.RecordRows`) against the Python one it
twins (`testbed.metrics.records.format_line`, `written_line`): the same bytes, and the same
settled records, for generated records with awkward floats, texts and types; and a writer's
file with either. Skipped where the extension is not built, unless TESTBED_REQUIRE_NATIVE=1."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_ext import required

from testbed.core.record import TIME_NAMES, RequestRecord, StageTimes
from testbed.metrics.records import COLUMNS, MAX_FIELD_CHARS, RecordWriter, format_line, native_rows, written_line

required()

ROWS = native_rows()
# Each field draws its column's ordinary values, and now and then an awkward one: mostly
# ordinary, so that most records take the compiled way and are compared.
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
ODD_FLOATS = st.sampled_from(
    [0.0078125, 0.0234375, 2.0000005, 1.0000004999, -1e-9, -0.0, 5e-324, 1e300, 123456.0000005, math.nan, math.inf]
)
TEXTS = st.text(st.characters(blacklist_characters=',"\r\n', blacklist_categories=("Cs",)), max_size=12)
ODD_TEXTS = st.sampled_from(
    [
        'a "q", c',
        'say "hi"',
        "a,b",
        "x\ny",
        "cr\r",
        "nan",
        "%s %d",
        "é✓",
        "\ud800",
        "z" * (MAX_FIELD_CHARS + 1),
        "z" * MAX_FIELD_CHARS,
    ]
)
INTS = st.integers(-(2**63), 2**63 - 1)
ODD_INTS = st.sampled_from([2**70, -(2**64), 0])
ODD = st.sampled_from([True, 2, 3.5, "7", None])  # a value of another type than its column's
KINDS = {
    "float": (FLOATS, ODD_FLOATS),
    "int": (INTS, ODD_INTS),
    "bool": (st.booleans(), ODD),
    "str": (TEXTS, ODD_TEXTS),
}


@st.composite
def records(draw: Any) -> RequestRecord:
    rec = RequestRecord("r", 0, 1, 1)
    # Half the records are ordinary in every field: with a field's odd value drawn a few times in a
    # hundred, a record of some forty fields alone would almost never be (the share the compiled
    # writer takes then hangs on how many fields the record has).
    plain = draw(st.booleans())
    for f in dataclasses.fields(RequestRecord):
        if f.name == "times":
            continue
        usual, odd = KINDS[str(f.type)]
        roll = 99 if plain else draw(st.integers(0, 99))
        setattr(rec, f.name, draw(ODD if roll == 0 else odd if roll < 4 else usual))
    rec.times = StageTimes(
        *(
            draw(st.just(1) if roll == 0 else ODD_FLOATS if roll < 5 else FLOATS)
            for roll in [99 if plain else draw(st.integers(0, 99)) for _ in TIME_NAMES]
        )
    )
    return rec


def _copy(rec: RequestRecord) -> RequestRecord:
    return dataclasses.replace(rec, times=dataclasses.replace(rec.times))


def _python(recs: list[RequestRecord], settle: bool) -> list[str]:
    return [written_line(r) if settle else format_line(r) for r in recs]


def _compiled(recs: list[RequestRecord], settle: bool) -> list[str]:
    assert ROWS is not None
    line = written_line if settle else format_line
    return [ln if ln is not None else line(r) for ln, r in zip(ROWS.lines(recs, settle), recs)]


taken: list[float] = []  # the share of each example's records the compiled writer wrote


@pytest.mark.pure
@settings(max_examples=300, deadline=None)
@given(recs=st.lists(records(), min_size=1, max_size=6), settle=st.booleans())
def test_both_writers_write_and_settle_alike(recs: list[RequestRecord], settle: bool) -> None:
    """NaN, infinities, -0.0, subnormals, exact decimal ties, texts needing quotes or a cut, lone
    surrogates, integers beyond 64 bits, and values of another type than their column's: the same
    lines, and (settling) the same records after, -0.0 and NaN included (compared by repr)."""
    a, b = [_copy(r) for r in recs], [_copy(r) for r in recs]
    assert ROWS is not None
    taken.append(sum(ln is not None for ln in ROWS.lines([_copy(r) for r in recs], settle)) / len(recs))
    try:
        want = _python(a, settle)
    except (UnicodeEncodeError, TypeError, ValueError) as e:  # the Python writer refuses it
        with pytest.raises(type(e)):
            _compiled(b, settle)
        return
    assert _compiled(b, settle) == want
    assert repr(b) == repr(a)


@pytest.mark.pure
def test_the_generated_records_mostly_took_the_compiled_way() -> None:
    """The comparison above is not vacuous: most generated records were written compiled."""
    if not taken:
        pytest.skip("runs after test_both_writers_write_and_settle_alike")
    assert sum(taken) / len(taken) > 0.3


@pytest.mark.pure
def test_ordinary_records_take_the_compiled_way() -> None:
    """A simulated run's records need no fallback (else the compiled writer buys nothing)."""
    assert ROWS is not None
    rec = RequestRecord(
        "r1",
        3,
        300,
        16,
        prefill_node="pd-p0",
        decode_node="pd-d0",
        crossed_wan=False,
        threshold=math.nan,
        outcome="completed",
        kv_bytes_paper=123,
        retry_reason="",
        times=StageTimes(*(0.1 * i for i in range(len(TIME_NAMES)))),
    )
    assert None not in ROWS.lines([rec, _copy(rec)], True)
    assert len(COLUMNS) == format_line(rec).count(",") + 1


@pytest.mark.pure
def test_a_settling_writer_writes_the_same_file_either_way(tmp_path: Path) -> None:
    recs = [
        RequestRecord(
            f"r{i}",
            i,
            100 + i,
            2,
            threshold=i / 3,
            reason='x, "y"' if i % 3 == 0 else "",
            times=StageTimes(*(i / 7 + k for k in range(len(TIME_NAMES)))),
        )
        for i in range(10)
    ]
    out = []
    for name, compiled in (("native", True), ("python", False)):
        held = [_copy(r) for r in recs]
        with RecordWriter(tmp_path / f"{name}.csv", deferred=True, settle=True, compiled=compiled) as w:
            for r in held:
                w.write(r)
        out.append(((tmp_path / f"{name}.csv").read_bytes(), repr(held)))
    assert out[0] == out[1]


@pytest.mark.pure
@settings(max_examples=200, deadline=None)
@given(
    micros=st.integers(0, 10**15),
    nudge=st.sampled_from([0.0, 0.5, 0.4999999, 0.5000001, 0.49999999999, 0.50000000001]),
    sign=st.sampled_from([1.0, -1.0]),
)
def test_stamps_near_a_rounding_tie_are_written_and_settled_as_python_does(
    micros: int, nudge: float, sign: float
) -> None:
    """The compiled writer rounds a float to the microsecond from its product with 10^6 where
    that settles it, and formats it exactly near a tie and past 10^9 s: either way "%.6f"."""
    x = sign * (micros + nudge) / 1e6
    rec = RequestRecord("r", 0, 1, 1)
    rec.times = StageTimes(*([x] * len(TIME_NAMES)))
    assert ROWS is not None and ROWS.lines([_copy(rec)], False)[0] is not None  # the compiled way
    for settle in (False, True):
        assert _compiled([_copy(rec)], settle) == _python([_copy(rec)], settle)
