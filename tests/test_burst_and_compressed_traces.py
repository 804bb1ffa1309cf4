"""A trace whose selected rows share one timestamp (Mooncake's conversation trace starts with a
batch stamped 0) replays: its offered rate is null, not an infinity that broke run.json half-way.
Compressed traces (gzip, zstd) are read directly, whatever their name."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import zstandard

from testbed.cli import main
from testbed.traces.formats import FORMATS, WriteOptions
from testbed.traces.loader import load_trace
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure


def _burst_first(n_burst: int = 8, n: int = 12) -> Trace:
    """`n_burst` requests at t=0, then one a second: the first rows share a timestamp."""
    reqs = [
        TraceRequest(
            f"r{i}", 0.0 if i < n_burst else float(i - n_burst + 1), 1000 + 97 * i, 20 + i, tuple(range(i, i + 2))
        )
        for i in range(n)
    ]
    return Trace(reqs, source="burst")


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("compress", ["", ".gz"])
def test_first_rows_sharing_a_timestamp_replay(
    fmt: str, compress: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = FORMATS[fmt]
    path = tmp_path / f"burst{f.suffix}"
    f.write(path, _burst_first(), WriteOptions())
    if compress:
        gz = path.with_name(path.name + compress)
        gz.write_bytes(gzip.compress(path.read_bytes()))
        path.unlink()
        path = gz
    out = tmp_path / "run"
    rc = main(
        [
            "replay",
            "--scenario",
            "paper-prfaas",
            "--backend",
            "sim",
            "--trace",
            str(path),
            "--requests",
            "5",
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "all arrive at one instant" in err
    records = (out / "records.csv").read_text().splitlines()
    assert len(records) == 1 + 5
    run = json.loads((out / "run.json").read_text())
    assert run["offered_rate"] is None and run["state"] == "finished"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["offered_rate_rps"] is None


def test_a_burst_then_gaps_keeps_its_rate_and_a_burst_alone_has_none() -> None:
    tr = _burst_first()
    assert math.isinf(tr.rate) is False and tr.offered_rate == pytest.approx(tr.rate)
    burst = Trace(_burst_first().requests[:5], source="b")
    assert burst.is_burst and burst.offered_rate is None and math.isinf(burst.rate)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gzip_and_zstd_traces_load_as_the_plain_one(fmt: str, tmp_path: Path) -> None:
    f = FORMATS[fmt]
    plain = tmp_path / f"t{f.suffix}"
    f.write(plain, _burst_first(n=40), WriteOptions())
    data = plain.read_bytes()
    want = load_trace(plain)
    gz = tmp_path / f"t{f.suffix}.gz"
    gz.write_bytes(gzip.compress(data))
    zst = tmp_path / f"t{f.suffix}.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(data))
    misnamed = tmp_path / f"u{f.suffix}"  # gzip content, plain name: told by its magic
    misnamed.write_bytes(gzip.compress(data))
    for p in (gz, zst, misnamed):
        got = load_trace(p, window=(0.0, 20.0))
        assert [(r.timestamp, r.input_tokens, r.output_tokens) for r in got] == [
            (r.timestamp, r.input_tokens, r.output_tokens) for r in want if r.timestamp < 20.0
        ]
    assert load_trace(gz).requests[0].request_id == want.requests[0].request_id


def test_a_corrupt_gzip_trace_is_one_line(tmp_path: Path) -> None:
    from testbed.traces.types import TraceError

    p = tmp_path / "t.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"timestamp": 0}\n' * 100)[:30])
    with pytest.raises(TraceError) as e:
        load_trace(p)
    assert str(e.value).startswith(f"{p}: gzip-compressed, and it does not decompress") and "\n" not in str(e.value)


def test_a_compressed_trace_whose_name_says_no_format_says_it_is_compressed(tmp_path: Path) -> None:
    from testbed.traces.types import TraceError

    p = tmp_path / "conversation.gz"
    FORMATS["mooncake"].write(tmp_path / "c.jsonl", _burst_first(), WriteOptions())
    p.write_bytes(gzip.compress((tmp_path / "c.jsonl").read_bytes()))
    with pytest.raises(TraceError) as e:
        load_trace(p)
    assert str(e.value).startswith(f"{p}: gzip-compressed; unsupported format") and "give --format" in str(e.value)
    assert len(load_trace(p, "mooncake")) == 12
