"""A trace file read as a simulated replay needs it (`testbed.traces.stream`): the same requests,
source, notes and rates as the trace loaded whole, in every format; the same run directory; a
bad line refused before any run begins; memory that does not hold the records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from summaries import alike

from testbed.cli import main
from testbed.metrics.columnar import iter_parquet_records
from testbed.metrics.record_table import RecordTable
from testbed.metrics.run_files import RECORDS_FILE
from testbed.run.load import load
from testbed.run.runner import run_sim
from testbed.sim import SimOptions, simulate
from testbed.traces.formats import FORMATS, WriteOptions
from testbed.traces.loader import load_trace
from testbed.traces.stream import HOLD_REQUESTS, open_trace_file
from testbed.traces.types import Trace, TraceError, TraceRequest

pytestmark = pytest.mark.pure


def _trace(n: int, sessions: bool = False) -> Trace:
    reqs = [
        TraceRequest(
            f"r{i}",
            0.37 * i + (i % 3) * 0.05,
            1024 * (1 + i % 5) + 37,
            24 + i % 7,
            tuple(range(2 * (1 + i % 5))),
            parent_id=f"r{i - 1}" if sessions and i % 4 else "",
        )
        for i in range(n)
    ]
    return Trace(reqs, "written", block_tokens=512)


def _write(tmp_path: Path, fmt: str, trace: Trace, **opts: object) -> Path:
    path = tmp_path / f"t-{fmt}{FORMATS[fmt].suffix}"  # type: ignore[index]
    FORMATS[fmt].write(path, trace, WriteOptions(**opts))  # type: ignore[index, arg-type]
    return path


@pytest.mark.parametrize(
    "fmt, read",
    [
        ("mooncake", {}),
        ("mooncake", {"window": (3.0, 20.0), "limit": 30}),
        ("azure", {}),
        ("azure", {"window": (2.0, 1e9)}),
        ("burstgpt", {}),
        ("burstgpt", {"keep_failed": True, "limit": 12}),
    ],
)
def test_a_streamed_file_is_the_trace_loaded_whole(tmp_path: Path, fmt: str, read: dict[str, object]) -> None:
    opts: dict[str, object] = {"failed_share": 0.2, "seed": 3} if fmt == "burstgpt" else {}
    path = _write(tmp_path, fmt, _trace(80), **opts)
    whole = load_trace(path, **read)  # type: ignore[arg-type]
    tf = open_trace_file(path, **read)  # type: ignore[arg-type]
    assert list(tf) == whole.requests
    assert list(tf) == whole.requests  # each pass reads the file again
    assert (len(tf), tf.source, tf.notes, tf.block_tokens) == (
        len(whole),
        whole.source,
        whole.notes,
        whole.block_tokens,
    )
    assert (tf.duration, tf.rate, tf.offered_rate, tf.is_burst, tf.last_timestamp) == (
        whole.duration,
        whole.rate,
        whole.offered_rate,
        whole.is_burst,
        whole.last_timestamp,
    )
    assert not tf.stated_sessions and tf.load() == whole


def test_stated_sessions_are_seen_and_a_bad_line_is_refused_up_front(tmp_path: Path) -> None:
    path = _write(tmp_path, "mooncake", _trace(12, sessions=True))
    assert open_trace_file(path).stated_sessions
    lines = path.read_text().splitlines()
    lines[9] = json.dumps({"timestamp": 99999, "input_length": "many", "output_length": 3, "hash_ids": []})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r":10: field 'input_length'"):
        open_trace_file(path)


def test_a_long_plain_trace_is_counted_as_reading_it_would(tmp_path: Path) -> None:
    """Past `HOLD_REQUESTS`, a plain Mooncake file is counted without making its requests
    (`scan_mooncake`, where the extension is built): what a run records at its start is what
    reading it through gives; and a bad line near its end is still refused up front."""
    n = HOLD_REQUESTS + 500
    path = _write(tmp_path, "mooncake", _trace(n))
    tf = open_trace_file(path)
    whole = load_trace(path)
    assert tf.held is None and not tf.stated_sessions
    assert (len(tf), tf.last_timestamp, tf.duration, tf.rate, tf.source, tf.notes) == (
        len(whole),
        whole.last_timestamp,
        whole.duration,
        whole.rate,
        whole.source,
        whole.notes,
    )
    assert list(tf) == whole.requests
    lines = path.read_text().splitlines()
    lines[n - 3] = json.dumps({"timestamp": 1, "input_length": 5, "output_length": 3, "hash_ids": []})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=rf":{n - 2}: field .timestamp.: goes backwards"):
        open_trace_file(path)


def test_a_run_from_the_file_writes_what_the_held_trace_writes(tmp_path: Path) -> None:
    rs = load("paper-prfaas")
    path = _write(tmp_path, "mooncake", _trace(60))
    held, streamed = tmp_path / "held", tmp_path / "streamed"
    held.mkdir()
    streamed.mkdir()
    a = simulate(rs, load_trace(path), held, SimOptions(settle_records=True))
    b = simulate(rs, open_trace_file(path), streamed, SimOptions(settle_records=True, keep_records=False))
    assert len(a.records) == 60 and b.records == []  # written, then not held
    assert (a.events, a.t_end, a.completed) == (b.events, b.t_end, b.completed)
    for name in ("records.csv", "decisions.jsonl", "timeseries/nodes.jsonl", "timeseries/router.jsonl"):
        assert (held / name).read_bytes() == (streamed / name).read_bytes(), name
    # The summary's read-back: every field, stamp and property as the records read back.
    rows = RecordTable(streamed / RECORDS_FILE)
    assert len(rows) == 60 and rows[-1].request_id == a.records[-1].request_id
    for r, x in zip(iter_parquet_records(streamed / RECORDS_FILE), rows, strict=True):
        for v, w in [(r.ttft, x.ttft), (r.tpot, x.tpot), (r.times.first_token, x.times.first_token)]:
            assert v == w or (math.isnan(v) and math.isnan(w))
        assert (r.outcome, r.prefill_node, r.crossed_wan, r.kv_bytes_wire) == (
            x.outcome,
            x.prefill_node,
            x.crossed_wan,
            x.kv_bytes_wire,
        )


def test_a_sessions_trace_is_held_and_runs_its_sessions(tmp_path: Path) -> None:
    rs = load("paper-prfaas")
    path = _write(tmp_path, "mooncake", _trace(30, sessions=True))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    simulate(rs, load_trace(path), a, SimOptions(settle_records=True, arrivals="closed"))
    simulate(rs, open_trace_file(path), b, SimOptions(settle_records=True, arrivals="closed"))
    assert (a / "records.csv").read_bytes() == (b / "records.csv").read_bytes()
    assert b"turn" in (b / "records.csv").read_bytes()


def test_the_runner_summarises_a_streamed_run_as_a_held_one(tmp_path: Path) -> None:
    rs = load("paper-prfaas")
    path = _write(tmp_path, "mooncake", _trace(50))
    held = run_sim(rs, load_trace(path), tmp_path / "held", report=False)
    streamed = run_sim(rs, open_trace_file(path), tmp_path / "streamed", report=False)
    assert held.summary.to_json_dict() == streamed.summary.to_json_dict()
    assert (tmp_path / "streamed" / "records.csv").read_bytes() == (tmp_path / "held" / "records.csv").read_bytes()


def test_report_reads_a_parquet_only_run_as_it_reads_the_text(tmp_path: Path) -> None:
    rs = load("paper-prfaas")
    path = _write(tmp_path, "mooncake", _trace(40))
    text, columns = tmp_path / "text", tmp_path / "columns"
    run_sim(rs, open_trace_file(path), text, report=False)
    run_sim(rs, open_trace_file(path), columns, report=False, text_requests=39)
    assert not (text / "records.parquet").exists() and not (columns / "records.csv").exists()
    assert not (columns / "decisions.jsonl").exists()
    for d in (text, columns):
        assert main(["report", str(d)]) == 0
    # The same figures (a long run's are taken a column at a time: only the order of sums differs).
    a, b = (json.loads((d / "summary.json").read_text()) for d in (text, columns))
    assert not alike(a, b), alike(a, b)
    assert (text / "report.md").read_text() == (columns / "report.md").read_text()
