"""The time-series line format: one owner for encoding and parsing, byte-compatible lines."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from testbed.metrics.series_format import (
    Sample,
    SeriesPoint,
    SeriesWriter,
    TimeseriesError,
    encode_line,
    parse_line,
    read_series,
)

pytestmark = pytest.mark.pure
PKG = Path(__file__).resolve().parent.parent / "testbed"


def test_line_is_the_format_every_writer_wrote() -> None:
    s = Sample("tcp_rtt_us", 40000.0, {"dest": "10.0.0.2:9000", "conn": "0"})
    line = encode_line(1712345678.1234567, "prfaas-p0", s)
    assert line == (
        '{"ts": 1712345678.123457, "source": "prfaas-p0", "metric": "tcp_rtt_us", "value": 40000.0, '
        '"labels": {"dest": "10.0.0.2:9000", "conn": "0"}}'
    )
    # Integer counters (the delay line's) stay integers.
    assert '"value": 17,' in encode_line(1.0, "delayline", Sample("packets_in", 17, {"direction": "a->b"}))


def test_encode_parse_round_trip() -> None:
    s = Sample("link_bytes", 123456.0, {"link": "dc-a->dc-b", "ifname": "veth0"})
    p = parse_line(encode_line(1000.25, "wan", s), t0=1000.0)
    assert p == SeriesPoint(0.25, "wan", "link_bytes", 123456.0, {"link": "dc-a->dc-b", "ifname": "veth0"})
    plain = encode_line(5.0, "router", Sample("inflight", 2.0, {}))
    assert parse_line(plain) == SeriesPoint(5.0, "router", "inflight", 2.0)
    # A null value reads as NaN (a gauge with nothing to report).
    assert math.isnan(parse_line('{"ts": 1, "source": "n", "metric": "m", "value": null}').value)


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"ts": 1, "source": "n", "metric": "m", "value": 1', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"ts": true, "source": "n", "metric": "m", "value": 1}', "'ts' must be a number"),
        ('{"ts": 1, "source": "", "metric": "m", "value": 1}', "'source'"),
        ('{"ts": 1, "source": "n", "metric": "m", "value": "x"}', "'value' must be a number"),
        ('{"ts": 1, "source": "n", "metric": "m", "value": 1, "labels": [1]}', "'labels' must be an object"),
    ],
)
def test_malformed_line_says_what_is_wrong(line: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_line(line)


def test_malformed_line_in_a_file_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "n.jsonl"
    good = encode_line(1.0, "n", Sample("m", 1.0, {}))
    p.write_text("\n".join([good, '{"ts": 2, "source": "n"', good]) + "\n")
    with pytest.raises(TimeseriesError, match=r"n\.jsonl:2: invalid JSON"):
        read_series(p)
    # The same damage on the last line is an interrupted writer: dropped, the rest kept.
    p.write_text("\n".join([good, good, '{"ts": 2, "source": "n"']))
    assert [x.t for x in read_series(p, t0=0.5)] == [0.5, 0.5]


def test_writer_appends_stamped_lines_and_discards_without_a_path(tmp_path: Path) -> None:
    p = tmp_path / "timeseries" / "router.jsonl"
    w = SeriesWriter(p, "router")
    w.write([Sample("inflight", 3.0, {}), Sample("threshold", 19400.0, {})], ts=100.0)
    w.write([], ts=101.0)
    w.close()
    w.write([Sample("late", 1.0, {})], ts=102.0)  # after close: nothing
    lines = p.read_text().splitlines()
    assert [json.loads(x)["metric"] for x in lines] == ["inflight", "threshold"]
    assert lines[0] == encode_line(100.0, "router", Sample("inflight", 3.0, {}))
    assert [s.metric for s in read_series(p, t0=100.0)] == ["inflight", "threshold"]
    SeriesWriter(None, "x").write([Sample("m", 1.0, {})])


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_one_owner_of_the_format() -> None:
    # net/ writes and reads series through metrics, never through live/.
    for path in sorted((PKG / "net").glob("*.py")):
        assert "testbed.live.series" not in _imports(path), path.name
    own = _imports(PKG / "metrics" / "series_format.py")
    assert not any(m.startswith(("testbed.live", "testbed.net")) for m in own)


@pytest.mark.parametrize("deferred", [False, True])
def test_the_batch_writer_writes_every_point_and_holds_all_but_the_unheld(tmp_path: Path, deferred: bool) -> None:
    """Points of an unheld metric (`testbed.metrics.plot_only`) are written and counted, not held:
    what is held is what the file reads back, less those."""
    from testbed.metrics.series_batch import BatchSeriesFile

    path = tmp_path / "nodes.jsonl"
    f = BatchSeriesFile(path, "nodes", 2.0, keep=True, deferred=deferred, unheld=frozenset({"queue_depth"}))
    for i in range(5):
        f.source_write(
            2.0 * i,
            "p0",
            [("queue_depth", float(i), {}), ("kv_bytes_sent", 10.0 * i, {}), ("queue_depth", 1.0, {"q": "x"})],
        )
    f.close()
    back = read_series(path, 0.0)
    assert len(back) == 15
    assert f.points == [p for p in back if p.metric != "queue_depth"]
    assert f.unheld_counts == {"queue_depth": 10}
