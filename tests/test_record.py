"""The request record: one schema from the prefill node's report through the final SSE chunk to records.csv."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

from testbed.core.lifecycle import Event, Lifecycle, State
from testbed.core.record import (
    NAN,
    TIME_NAMES,
    PrefillReport,
    RecordFormatError,
    RequestRecord,
    StageTimes,
    record_from_wire,
    record_to_wire,
    report_from_wire,
    report_to_wire,
)
from testbed.metrics.records import (
    COLUMNS,
    MAX_FIELD_CHARS,
    RecordWriter,
    as_written,
    format_line,
    format_row,
    parse_row,
    read_records,
    write_records,
    written_line,
)

pytestmark = pytest.mark.pure

T0 = 1_700_000_000.0


def _same(a: Any, b: Any) -> bool:
    """Field-by-field equality where NaN equals NaN."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def full_record() -> RequestRecord:
    """Every field and every stamp set (times relative to t0, as in a run)."""
    times = StageTimes(*(1.0 + 0.125 * i for i in range(len(TIME_NAMES))))
    return RequestRecord(
        "r1",
        3,
        30000,
        16,
        cached_tokens=512,
        prefill_cluster="prfaas",
        prefill_node="prfaas-p0",
        decode_cluster="pd",
        decode_node="pd-d0",
        crossed_wan=True,
        threshold=19400.0,
        route_reason="long",
        prefill_modelled=0.65,
        tokens_received=16,
        kv_bytes_paper=123456789,
        kv_bytes_wire=482253,
        outcome="completed",
        reason="",
        decode_cached_tokens=256,
        cache_move_tokens=1024,
        cache_move_src="pd-p1",
        cache_move_bytes_paper=4096000,
        cache_move_bytes_wire=16000,
        times=times,
    )


def column_record() -> RequestRecord:
    """What records.csv keeps: the router-side stamps and fields beyond its columns left unset."""
    r = full_record()
    r.decode_cluster = r.route_reason = r.cache_move_src = ""
    for n in TIME_NAMES:
        if n not in COLUMNS:
            setattr(r.times, n, NAN)
    return r


# ---------------------------------------------------------------- the wire (SSE chunk)


def test_record_survives_the_final_chunk_through_json() -> None:
    rec = full_record()
    wire = json.loads(json.dumps(record_to_wire(rec, T0)))
    assert wire["transfer_start"] == pytest.approx(T0 + rec.times.transfer_start)  # unix seconds on the wire
    back = record_from_wire(wire, rec.trace_index, T0)
    for n in TIME_NAMES:
        assert getattr(back.times, n) == pytest.approx(getattr(rec.times, n), abs=1e-6), n
    back.times = rec.times
    assert _same(back, rec)


def test_exact_round_trip_without_a_time_shift_and_nan_as_null() -> None:
    rec = RequestRecord(
        "r2", 0, 100, 2, outcome="failed", reason="decode node gone", times=StageTimes(routed=5.0, prefill_sent=5.5)
    )
    wire = record_to_wire(rec)
    assert wire["threshold"] is None and wire["prefill_start"] is None and wire["routed"] == 5.0
    assert "trace_index" not in wire  # the serving side never knows it
    assert _same(record_from_wire(json.loads(json.dumps(wire)), 0), rec)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda w: w.pop("transfer_start"), "transfer_start"),
        (lambda w: w.pop("kv_bytes_wire"), "kv_bytes_wire"),
        (lambda w: w.update(prefill_transfer_start=1.0), "prefill_transfer_start"),
        (lambda w: w.update(trace_index=3), "trace_index"),
        (lambda w: w.update(kv_bytes_wire="12"), "kv_bytes_wire"),
        (lambda w: w.update(crossed_wan=1), "crossed_wan"),
        (lambda w: w.update(routed=True), "routed"),
        (lambda w: w.update(outcome=None), "outcome"),
    ],
)
def test_a_bad_final_chunk_names_the_field(change: Any, field: str) -> None:
    wire = record_to_wire(full_record(), T0)
    change(wire)
    with pytest.raises(RecordFormatError, match=f"'{field}'"):
        record_from_wire(wire)


def test_a_chunk_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(RecordFormatError, match="expected an object"):
        record_from_wire([1, 2])


# ---------------------------------------------------------------- the prefill node's report


def test_prefill_report_round_trip_carries_only_prefill_stamps() -> None:
    times = StageTimes(
        prefill_queued=T0 + 1,
        cache_wait_start=T0 + 1.1,
        cache_move_end=T0 + 1.2,
        prefill_start=T0 + 1.3,
        transfer_start=T0 + 1.4,
        transfer_first_sent=T0 + 1.41,
        prefill_end=T0 + 2,
        transfer_sent=T0 + 2.1,
    )
    rep = PrefillReport(times, 0.7, 4096)
    wire = json.loads(json.dumps(report_to_wire(rep)))
    assert wire["transfer_start"] == T0 + 1.4 and wire["error"] == ""
    assert _same(report_from_wire(wire), rep)
    # A failure keeps what it saw and says why.
    failed = PrefillReport(StageTimes(prefill_queued=T0), error="kv transfer failed: reset")
    assert _same(report_from_wire(report_to_wire(failed)), failed)
    # Stamps the prefill node does not own are not its to report.
    assert "routed" not in report_to_wire(PrefillReport(StageTimes(routed=T0)))


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda w: w.pop("prefill_end"), "prefill_end"),
        (lambda w: w.update(end=1.0), "end"),
        (lambda w: w.update(cache_move_bytes_wire=1.5), "cache_move_bytes_wire"),
        (lambda w: w.update(error=None), "error"),
    ],
)
def test_a_bad_prefill_report_names_the_field(change: Any, field: str) -> None:
    wire = report_to_wire(PrefillReport(StageTimes(prefill_start=T0), 0.5))
    change(wire)
    with pytest.raises(RecordFormatError, match=f"'{field}'"):
        report_from_wire(wire)


# ---------------------------------------------------------------- client and serving side


def test_client_keeps_its_own_observations_and_takes_the_rest() -> None:
    served = full_record()
    served.outcome, served.reason, served.tokens_received = "failed", "router's view", 3
    mine = RequestRecord(
        "r1",
        7,
        30000,
        16,
        tokens_received=16,
        outcome="completed",
        times=StageTimes(arrival=0.5, first_token=2.0, last_token=2.5),
    )
    mine.take_served(served)
    assert (mine.trace_index, mine.tokens_received, mine.outcome, mine.reason) == (7, 16, "completed", "")
    assert (mine.times.arrival, mine.times.first_token, mine.times.last_token) == (0.5, 2.0, 2.5)
    assert mine.times.transfer_start == served.times.transfer_start and mine.kv_bytes_wire == served.kv_bytes_wire
    assert mine.prefill_node == "prfaas-p0" and mine.cache_move_src == "pd-p1"
    assert mine.ttft == 1.5 and mine.tpot == pytest.approx(0.5 / 15)


def test_stamps_replay_through_the_lifecycle_in_time_order() -> None:
    # Layer-wise: the transfer starts before the prefill ends; a tie keeps the lifecycle's order.
    t = StageTimes(
        routed=1.0,
        prefill_sent=1.1,
        prefill_start=1.2,
        transfer_start=1.3,
        prefill_end=1.5,
        transfer_end=1.6,
        decode_admitted=1.6,
        decode_first_token=1.7,
        decode_last_token=2.0,
        first_token=9.0,
    )
    events = t.lifecycle_events()
    assert [ev for _, ev in events] == [
        Event.ROUTE,
        Event.ENQUEUE_PREFILL,
        Event.START_PREFILL,
        Event.TRANSFER_START,
        Event.END_PREFILL,
        Event.KV_COMPLETE,
        Event.ADMIT,
        Event.FIRST_TOKEN,
        Event.FINISH,
    ]
    life = Lifecycle("r")
    for ts, ev in events:
        life.apply(ev, ts)
    assert life.state is State.COMPLETED
    # Stages that never happened are no events.
    assert StageTimes(routed=1.0).lifecycle_events() == [(1.0, Event.ROUTE)]


def test_since_and_merge() -> None:
    t = StageTimes(routed=T0 + 1, prefill_start=T0 + 2)
    rel = t.since(T0)
    assert (rel.routed, rel.prefill_start) == (1.0, 2.0) and math.isnan(rel.arrival)
    rel.merge(StageTimes(prefill_start=5.0, prefill_end=6.0))
    assert (rel.routed, rel.prefill_start, rel.prefill_end) == (1.0, 5.0, 6.0)


# ---------------------------------------------------------------- records.csv

GOLDEN = (
    "request_id,trace_index,input_tokens,output_tokens,cached_tokens,arrival,routed,prefill_cluster,prefill_node,"
    "decode_node,crossed_wan,threshold,prefill_queued,prefill_start,prefill_end,prefill_modelled,transfer_start,"
    "transfer_end,decode_admitted,first_token,last_token,tokens_received,kv_bytes_paper,kv_bytes_wire,outcome,"
    "reason,decode_cached_tokens,cache_move_tokens,cache_move_start,cache_move_end,cache_move_bytes_paper,"
    "cache_move_bytes_wire,retries,retry_reason,router_arrival,decode_first_token,decode_last_token,failure_kind,"
    "failure_node,retry_kind,retry_node,session_id,turn,parent_index\n"
    "r1,3,30000,16,512,1.500000,1.501000,prfaas,prfaas-p0,pd-d0,1,19400.000000,1.502000,1.600000,2.250000,"
    "0.650000,1.610000,2.400000,2.410000,2.450000,3.200000,16,123456789,482253,completed,,0,1024,1.510000,"
    "1.580000,4096000,16000,1,prefill node prfaas-p1 unreachable,1.500500,,,,,prefill_node_down,prfaas-p1,,0,-1\n"
    'r2,4,100,2,0,2.000000,,,,,0,,,,,,,,,,,0,0,0,failed,"decode node ""x"", gone",0,0,,,0,0,0,,,,,'
    "decode_node_down,x,,,,0,-1\n"
)


def test_csv_bytes_are_the_external_format(tmp_path: Path) -> None:
    """The file written before the record moved to core, byte for byte (plus the retry columns,
    the failure columns and the session columns, added later, which a file without them reads as
    0, empty and -1)."""
    times = StageTimes(
        arrival=1.5,
        routed=1.501,
        prefill_queued=1.502,
        prefill_start=1.6,
        prefill_end=2.25,
        transfer_start=1.61,
        transfer_end=2.4,
        decode_admitted=2.41,
        first_token=2.45,
        last_token=3.2,
        cache_move_start=1.51,
        cache_move_end=1.58,
        router_arrival=1.5005,
    )
    r1 = RequestRecord(
        "r1",
        3,
        30000,
        16,
        cached_tokens=512,
        prefill_cluster="prfaas",
        prefill_node="prfaas-p0",
        decode_node="pd-d0",
        crossed_wan=True,
        threshold=19400.0,
        prefill_modelled=0.65,
        tokens_received=16,
        kv_bytes_paper=123456789,
        kv_bytes_wire=482253,
        outcome="completed",
        cache_move_tokens=1024,
        cache_move_bytes_paper=4096000,
        cache_move_bytes_wire=16000,
        route_reason="not a column",
        retries=1,
        retry_reason="prefill node prfaas-p1 unreachable",
        retry_kind="prefill_node_down",
        retry_node="prfaas-p1",
        times=times,
    )
    r2 = RequestRecord(
        "r2",
        4,
        100,
        2,
        outcome="failed",
        reason='decode node "x", gone',
        failure_kind="decode_node_down",
        failure_node="x",
        times=StageTimes(arrival=2.0),
    )
    write_records(tmp_path / "records.csv", [r1, r2])
    assert (tmp_path / "records.csv").read_text() == GOLDEN


def test_csv_row_round_trip(tmp_path: Path) -> None:
    rec = column_record()
    row = dict(zip(COLUMNS, format_row(rec)))
    assert _same(parse_row(row), rec)
    write_records(tmp_path / "records.csv", [rec, RequestRecord("r9", 9, 1, 1)])
    back = read_records(tmp_path / "records.csv")
    assert _same(back[0], rec) and _same(back[1], RequestRecord("r9", 9, 1, 1))


def test_a_very_long_field_is_cut_by_the_writer_and_read_back(tmp_path: Path) -> None:
    # A 300 kB reason was written whole and the reader (the csv module's 131072-character field
    # limit) then failed on the whole file; the writer and the reader share one limit now.
    long = RequestRecord("r1", 1, 10, 2, outcome="failed", reason="x" * 300_000)
    write_records(tmp_path / "records.csv", [long, RequestRecord("r2", 2, 10, 2)])
    old = csv.field_size_limit(1000)  # a process that lowered the csv module's limit
    try:
        back = read_records(tmp_path / "records.csv")
    finally:
        csv.field_size_limit(old)
    assert back[0].reason == "x" * MAX_FIELD_CHARS and [r.request_id for r in back] == ["r1", "r2"]
    exact = RequestRecord("r3", 3, 10, 2, outcome="failed", reason="y" * MAX_FIELD_CHARS)
    write_records(tmp_path / "exact.csv", [exact])
    assert read_records(tmp_path / "exact.csv")[0].reason == exact.reason


def _csv_line(rec: RequestRecord) -> str:
    buf = io.StringIO(newline="")
    csv.writer(buf).writerow(format_row(rec))
    return buf.getvalue()


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"reason": 'a "quoted", comma'},
        {"reason": "two\nlines"},
        {"reason": "cr\r"},
        {"request_id": "nan"},
        {"reason": "%s %d %%"},
        {"reason": "z" * (MAX_FIELD_CHARS + 5)},
        {"reason": "z" * MAX_FIELD_CHARS},
        {"crossed_wan": 2},
        {"threshold": NAN},
        {"threshold": -1e-9},
        {"threshold": math.inf},
        {"prefill_modelled": 2.0000005},
        {"kv_bytes_paper": 2**70},
    ],
)
def test_a_line_is_what_the_csv_module_writes_and_settling_rounds_as_written(change: dict[str, Any]) -> None:
    rec = full_record()
    rec.times.arrival, rec.times.prefill_sent, rec.times.first_token = 1.0000004999, -0.0, 7.1234565
    for k, v in change.items():
        setattr(rec, k, v)
    assert format_line(rec) == _csv_line(rec)
    settled, expected = dataclasses.replace(rec, times=dataclasses.replace(rec.times)), as_written(rec)
    line = written_line(settled)
    assert line == _csv_line(expected)
    assert repr(settled) == repr(expected)  # repr: -0.0 and NaN compared too


def test_a_settling_writer_writes_the_same_bytes(tmp_path: Path) -> None:
    recs = [full_record(), RequestRecord("r2", 4, 100, 2, outcome="failed", reason='x, "y"')]
    write_records(tmp_path / "plain.csv", recs)
    with RecordWriter(tmp_path / "settled.csv", deferred=True, settle=True) as w:
        for r in recs:
            w.write(r)
    assert (tmp_path / "settled.csv").read_bytes() == (tmp_path / "plain.csv").read_bytes()


def test_every_column_is_a_record_field_or_a_stamp() -> None:
    fields = {f.name for f in dataclasses.fields(RequestRecord)} | set(TIME_NAMES)
    assert set(COLUMNS) <= fields and len(set(COLUMNS)) == len(COLUMNS)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda r: r.pop("transfer_start"), "missing column 'transfer_start'"),
        (lambda r: r.update(prefill_transfer_start="1.0"), "unknown column 'prefill_transfer_start'"),
        (lambda r: r.update(kv_bytes_wire="1.5"), "column 'kv_bytes_wire': '1.5' is not an integer"),
        (lambda r: r.update(routed="soon"), "column 'routed': 'soon' is not a number"),
        (lambda r: r.update(crossed_wan="yes"), "column 'crossed_wan'"),
    ],
)
def test_a_bad_csv_row_names_the_column(change: Any, match: str) -> None:
    row = dict(zip(COLUMNS, format_row(column_record())))
    change(row)
    with pytest.raises(RecordFormatError, match=match):
        parse_row(row, "records.csv:2")


def test_a_bad_csv_file_names_file_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "records.csv"
    write_records(p, [column_record(), column_record()])
    lines = p.read_text().splitlines()
    p.write_text("\n".join([lines[0], lines[1], lines[2].replace(",completed,", ",completed,extra,")]) + "\n")
    with pytest.raises(RecordFormatError, match=r"records.csv:3: more values than columns"):
        read_records(p)
    p.write_text(lines[0].replace("cache_move_bytes_wire", "cache_in_bytes") + "\n")
    with pytest.raises(RecordFormatError, match=r"records.csv:1: missing column 'cache_move_bytes_wire'"):
        read_records(p)


def test_a_file_written_before_the_retry_columns_still_reads(tmp_path: Path) -> None:
    head, *rows = GOLDEN.splitlines()
    old = [head.split(",retries,")[0]] + [r.rsplit(",", 12)[0] for r in rows]
    (tmp_path / "records.csv").write_text("\n".join(old) + "\n")
    recs = read_records(tmp_path / "records.csv")
    assert [(r.request_id, r.retries, r.retry_reason) for r in recs] == [("r1", 0, ""), ("r2", 0, "")]


def test_a_file_written_before_the_failure_columns_reads_them_empty(tmp_path: Path) -> None:
    head, *rows = GOLDEN.splitlines()
    old = [head.split(",failure_kind,")[0]] + [r.rsplit(",", 7)[0] for r in rows]
    (tmp_path / "records.csv").write_text("\n".join(old) + "\n")
    recs = read_records(tmp_path / "records.csv")
    assert [(r.request_id, r.retries, r.failure_kind, r.failure_node, r.retry_kind, r.retry_node) for r in recs] == [
        ("r1", 1, "", "", "", ""),
        ("r2", 0, "", "", "", ""),
    ]


def test_a_version_2_file_reads_as_a_trace_without_sessions(tmp_path: Path) -> None:
    head, *rows = GOLDEN.splitlines()
    old = [head.split(",session_id,")[0]] + [r.rsplit(",", 3)[0] for r in rows]
    (tmp_path / "records.csv").write_text("\n".join(old) + "\n")
    recs = read_records(tmp_path / "records.csv")
    assert [(r.request_id, r.failure_kind, r.session_id, r.turn, r.parent_index) for r in recs] == [
        ("r1", "", "", 0, -1),
        ("r2", "decode_node_down", "", 0, -1),
    ]


def test_an_unknown_failure_kind_is_an_error_naming_the_line_and_column(tmp_path: Path) -> None:
    (tmp_path / "records.csv").write_text(GOLDEN.replace("decode_node_down", "decode_node_gone"))
    with pytest.raises(
        RecordFormatError,
        match=r"records.csv:3: column 'failure_kind': unknown failure kind "
        r"'decode_node_gone' \(known: prefill_node_down, ",
    ):
        read_records(tmp_path / "records.csv")


def test_a_last_row_cut_off_mid_write_is_left_out_and_the_rest_read(tmp_path: Path) -> None:
    """A full disk (or kill -9) can cut the row being written: the records before it stay
    readable; a bad row that is not the cut-off last one is still an error naming its line."""
    path = tmp_path / "records.csv"
    write_records(path, [RequestRecord("r1", 1, 10, 2), RequestRecord("r2", 2, 10, 2)])
    whole = path.read_text()
    last = whole.splitlines()[-1]
    path.write_text(whole + last[: len(last) // 2])  # the third row, half written
    assert [r.request_id for r in read_records(path)] == ["r1", "r2"]
    path.write_text(whole.replace(last, last[: len(last) // 2] + "\n"))  # a short row, then its newline
    with pytest.raises(ValueError, match=r"records\.csv:3"):
        read_records(path)
    path.write_text(whole)
    assert [r.request_id for r in read_records(path)] == ["r1", "r2"]
