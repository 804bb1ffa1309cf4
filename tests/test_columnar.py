"""records.parquet and decisions.parquet: a simulated run above `SimOptions.text_requests`
requests writes them (and the text files only up to it); they hold what the text files read back,
the summary and `testbed export` get from them what they get from the text, and a bad file is one
clear error."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from testbed.cli import main
from testbed.core.record import TIME_NAMES, RecordFormatError, RequestRecord, StageTimes
from testbed.metrics import columnar
from testbed.metrics.columnar import FIELD_NAMES, RECORD_SCHEMA, ParquetRecordWriter, iter_parquet_records
from testbed.metrics.records import MAX_FIELD_CHARS, format_line, read_records
from testbed.metrics.run_files import (
    DECISIONS_FILE,
    RECORDS_FILE,
    decisions_file,
    export_text,
    read_records_file,
    read_run_records,
    read_series_file,
    records_file,
)
from testbed.metrics.series_batch import BatchSeriesFile
from testbed.metrics.series_format import read_series
from testbed.metrics.summary import summarize
from testbed.run.load import load
from testbed.run.runner import run_sim
from testbed.sim import SimOptions, simulate
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure


def _trace(n: int) -> Trace:
    reqs = [
        TraceRequest(f"r{i}", 0.4 * i, 1024 * (1 + i % 5) + 37, 24 + i % 7, tuple(range(2 * (1 + i % 5))))
        for i in range(n)
    ]
    return Trace(reqs, "conversations")


def test_the_schema_is_the_record_dataclass() -> None:
    fields = [f.name for f in dataclasses.fields(RequestRecord) if f.name != "times"]
    assert list(FIELD_NAMES) == fields
    assert RECORD_SCHEMA.names == [*fields, *TIME_NAMES]


def test_a_run_above_its_text_limit_holds_in_parquet_what_a_shorter_limit_writes_as_text(tmp_path: Path) -> None:
    rs = load("paper-prfaas-adaptive")
    text, columns = tmp_path / "text", tmp_path / "columns"
    res = run_sim(rs, _trace(60), text, report=False)
    res_pq = run_sim(rs, _trace(60), columns, report=False, text_requests=59)
    assert not (text / RECORDS_FILE).exists() and not (text / DECISIONS_FILE).exists()
    assert not (columns / "records.csv").exists() and not (columns / "decisions.jsonl").exists()
    csv_recs = read_records(text / "records.csv")
    pq_recs = read_records_file(columns / RECORDS_FILE)
    assert len(csv_recs) == len(pq_recs) == 60
    assert [format_line(r) for r in csv_recs] == [format_line(r) for r in pq_recs]
    decisions = read_series(text / "decisions.jsonl", 1.5)
    assert decisions and read_series_file(columns / DECISIONS_FILE, 1.5) == decisions
    for metric in ("decision", "threshold_change", "none such"):
        assert read_series_file(columns / DECISIONS_FILE, 0.0, metric) == read_series(
            text / "decisions.jsonl", 0.0, metric
        )
    # The summary from the records read back by column is the held records' figure for figure.
    assert records_file(columns).name == RECORDS_FILE and decisions_file(columns).name == DECISIONS_FILE
    assert len(read_run_records(columns)) == 60
    assert res_pq.summary.to_json_dict() == res.summary.to_json_dict()
    assert summarize(columns).to_json_dict() == res.summary.to_json_dict()


def test_a_large_run_writes_parquet_only_and_export_gives_the_text_it_would_have_written(tmp_path: Path) -> None:
    rs = load("paper-prfaas")
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir()
    large.mkdir()
    simulate(rs, _trace(40), small, SimOptions(settle_records=True, text_requests=40))
    simulate(rs, _trace(40), large, SimOptions(settle_records=True, text_requests=39))
    assert not (large / "records.csv").exists() and not (large / "decisions.jsonl").exists()
    assert (large / RECORDS_FILE).is_file() and (large / DECISIONS_FILE).is_file()
    # Up to its limit a run writes the text alone.
    assert (small / "records.csv").is_file() and (small / "decisions.jsonl").is_file()
    assert not (small / RECORDS_FILE).exists() and not (small / DECISIONS_FILE).exists()
    assert main(["export", str(large)]) == 0
    for name in ("records.csv", "decisions.jsonl"):
        assert (large / name).read_bytes() == (small / name).read_bytes(), name
    assert export_text(large) == []  # what exists is left as it is


def test_a_run_that_keeps_no_records_writes_the_files_of_one_that_settles_them(tmp_path: Path) -> None:
    """A long run holds none of its records, so it leaves them unsettled: its files are those of a
    run that settles each as it writes it, byte for byte."""
    rs = load("paper-prfaas-adaptive")
    settled, held = tmp_path / "settled", tmp_path / "held"
    settled.mkdir()
    held.mkdir()
    opts = SimOptions(settle_records=True, text_requests=39)
    simulate(rs, _trace(40), settled, opts)
    simulate(rs, _trace(40), held, dataclasses.replace(opts, keep_records=False))
    for name in (RECORDS_FILE, DECISIONS_FILE):
        assert (held / name).read_bytes() == (settled / name).read_bytes(), name
    # Not vacuous: the values as simulated have more than the six places the files keep.
    raw = simulate(rs, _trace(40), None, SimOptions()).records
    assert any(t != round(t, 6) for r in raw for t in (r.times.first_token, r.times.last_token))


def test_an_unsettled_writer_stores_what_the_csv_reads_back_and_leaves_the_records(tmp_path: Path) -> None:
    rec = RequestRecord("a", 0, 10, 2, reason="x" * (MAX_FIELD_CHARS + 5), threshold=1.23456789)
    rec.times = StageTimes(arrival=0.1234567891)
    with ParquetRecordWriter(tmp_path / RECORDS_FILE) as w:
        w.write(rec)
    (back,) = iter_parquet_records(tmp_path / RECORDS_FILE)
    assert back.times.arrival == 0.123457 and back.threshold == 1.234568 and len(back.reason) == MAX_FIELD_CHARS
    assert rec.times.arrival == 0.1234567891 and len(rec.reason) == MAX_FIELD_CHARS + 5


def test_a_file_without_a_newer_column_reads_it_as_its_default(tmp_path: Path) -> None:
    p = tmp_path / RECORDS_FILE
    with ParquetRecordWriter(p) as w:
        w.write(RequestRecord("a", 0, 10, 2, retries=3, retry_node="pd-p0"))
    pq.write_table(pq.read_table(p).drop_columns(["retries", "retry_node"]), p)
    (back,) = iter_parquet_records(p)
    assert back.retries == 0 and back.retry_node == "" and back.request_id == "a"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.append_column("surprise", pa.array([1])), "unknown column 'surprise'"),
        (lambda t: t.drop_columns(["request_id"]), "missing column 'request_id'"),
        (
            lambda t: t.set_column(t.schema.get_field_index("input_tokens"), "input_tokens", pa.array(["10"])),
            "column 'input_tokens': type string, expected int64",
        ),
    ],
)
def test_a_bad_file_is_one_error_naming_it(tmp_path: Path, damage: object, message: str) -> None:
    p = tmp_path / RECORDS_FILE
    with ParquetRecordWriter(p) as w:
        w.write(RequestRecord("a", 0, 10, 2))
    pq.write_table(damage(pq.read_table(p)), p)  # type: ignore[operator]
    with pytest.raises(RecordFormatError, match=message):
        list(iter_parquet_records(p))


def test_a_file_cut_short_is_one_error_naming_it(tmp_path: Path) -> None:
    p = tmp_path / RECORDS_FILE
    with ParquetRecordWriter(p) as w:
        w.write(RequestRecord("a", 0, 10, 2))
    p.write_bytes(p.read_bytes()[:-20])
    with pytest.raises(RecordFormatError, match=f"{p}: not a readable Parquet file"):
        read_records_file(p)


def test_records_go_out_a_row_group_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(columnar, "ROW_GROUP", 10)
    p = tmp_path / RECORDS_FILE
    with ParquetRecordWriter(p) as w:
        for i in range(25):
            w.write(RequestRecord(f"r{i}", i, 10, 2))
        assert w._held and len(w._held) == 5  # two groups of ten are out already
    assert pq.ParquetFile(p).num_row_groups == 3
    assert [r.trace_index for r in iter_parquet_records(p)] == list(range(25))


def test_decisions_read_back_as_their_jsonl_lines(tmp_path: Path) -> None:
    text = BatchSeriesFile(tmp_path / "decisions.jsonl", "router", 4.0, repeated_labels=False)
    cols = columnar.ParquetSeriesFile(tmp_path / DECISIONS_FILE, "router", 4.0)
    for f in (text, cols):
        f.write(1.0, [("decision", 3.0, {"request_id": "a", "reason": 'l="x", t'})])
        f.source_write(2.5, "pd-p0", [("health", math.inf, {}), ("health", math.nan, {"k": "v"})])
        f.write(7.123456789, [("threshold_change", -2.0, {"old": "nan"})])
        f.close()
    a = read_series(tmp_path / "decisions.jsonl", 0.25)
    b = read_series_file(tmp_path / DECISIONS_FILE, 0.25)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert (x.t, x.source, x.metric, x.labels) == (y.t, y.source, y.metric, y.labels)
        assert x.value == y.value or (math.isnan(x.value) and math.isnan(y.value))


def _odd_records() -> list[RequestRecord]:
    """Texts beyond ASCII and the cut, stamps at half microseconds and before the start, NaNs."""
    recs = [
        RequestRecord("é-ü", 1, 2, 3, reason="x" * (MAX_FIELD_CHARS + 3) + "ß", threshold=1.23456789, crossed_wan=True),
        RequestRecord(
            "b", 2, 2, 3, route_reason="日本", times=StageTimes(arrival=5e-7, first_token=1.5e-6, last_token=-0.75)
        ),
        RequestRecord("c", 3, 4, 5, cache_move_src="", prefill_modelled=0.1234565),
    ]
    recs[2].times = StageTimes(*[0.25 * i for i in range(len(TIME_NAMES))])
    return recs


def test_records_read_back_as_given_whatever_their_texts_and_stamps(tmp_path: Path) -> None:
    p = tmp_path / RECORDS_FILE
    with ParquetRecordWriter(p) as w:
        for r in _odd_records():
            w.write(r)
    back = list(iter_parquet_records(p))
    # What records.csv reads back is what the Parquet file reads back.
    assert [format_line(r) for r in back] == [format_line(r) for r in _odd_records()]
    assert back[0].request_id == "é-ü" and back[0].reason.endswith("x") and back[1].route_reason == "日本"
    assert back[1].times.arrival == 0.0 and back[1].times.first_token == 0.000002  # half to even
    assert math.isnan(back[1].times.routed) and back[2].times.last_token == 0.25 * (len(TIME_NAMES) - 1)


def test_a_batch_whose_texts_overflow_32_bit_offsets_goes_out_in_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(columnar, "_MAX_OFFSET", 300)  # a few records' texts, the Python way's limit
    p = tmp_path / RECORDS_FILE
    with ParquetRecordWriter(p, compiled=False) as w:
        for i in range(20):
            w.write(RequestRecord(f"r{i}", i, 10, 2, reason="y" * 40))
    assert [r.trace_index for r in iter_parquet_records(p)] == list(range(20))
    assert pq.ParquetFile(p).metadata.num_row_groups > 1


def test_records_settled_by_the_csv_writer_are_stored_as_when_settled_here(tmp_path: Path) -> None:
    from testbed.metrics.records import RecordWriter

    alone, shared = tmp_path / "alone.parquet", tmp_path / "shared.parquet"
    mine, theirs = _odd_records(), _odd_records()
    with ParquetRecordWriter(alone, settle=True) as w:
        for r in mine:
            w.write(r)
    text = RecordWriter(tmp_path / "records.csv", deferred=True, settle=True)
    with ParquetRecordWriter(shared, settle=True, settled_by=text) as w:
        for r in theirs:
            text.write(r)
            w.write(r)
        w.close()  # before the text writer: its held records are settled first all the same
    text.close()
    assert alone.read_bytes() == shared.read_bytes()
    assert [format_line(r) for r in mine] == [format_line(r) for r in theirs]
    for r in (mine[0], theirs[0]):  # one the compiled writer leaves to Python (a text to cut)
        assert r.threshold == 1.234568 and len(r.reason) == MAX_FIELD_CHARS


def test_writing_records_and_decisions_needs_no_pandas(tmp_path: Path) -> None:
    """pyarrow imports pandas for `pa.array` of a list (0.2 s and 100 MiB a simulated run
    does not need): the writers build their arrays from buffers."""
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from testbed.metrics.columnar import ParquetRecordWriter, ParquetSeriesFile\n"
        "from testbed.core.record import RequestRecord\n"
        f"d = Path({str(tmp_path)!r})\n"
        "with ParquetRecordWriter(d / 'r.parquet') as w:\n    w.write(RequestRecord('a', 0, 1, 2))\n"
        "s = ParquetSeriesFile(d / 'd.parquet', 'router', 1.0)\n"
        "s.write(1.0, [('decision', 2.0, {'k': 'v'})])\ns.close()\n"
        "print(sorted(m for m in ('pandas', 'pyarrow.compute') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
