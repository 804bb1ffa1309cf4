"""Where a run directory holds its records and decisions: records.csv and decisions.jsonl (text),
or records.parquet and decisions.parquet (`testbed.metrics.columnar`). Readers ask here, not for
a name, so they read either; pyarrow is imported only to read or write a Parquet file."""

from __future__ import annotations

import json
import math
from pathlib import Path

from testbed.core.record import RequestRecord
from testbed.metrics.artefacts import RunDirError
from testbed.metrics.records import RecordWriter, read_records
from testbed.metrics.series_format import SeriesPoint, encode_labels, read_series

RECORDS_CSV = "records.csv"
RECORDS_FILE = "records.parquet"
DECISIONS_JSONL = "decisions.jsonl"
DECISIONS_FILE = "decisions.parquet"


def run_file(run_dir: Path, text_name: str, parquet_name: str) -> Path:
    """The file a run directory holds its records or decisions in: the text file where there is
    one (what a user edits is what is read), else the Parquet file (that path, whether it exists
    or not)."""
    text = Path(run_dir) / text_name
    parquet = Path(run_dir) / parquet_name
    return text if text.is_file() or not parquet.is_file() else parquet


def records_file(run_dir: Path) -> Path:
    """records.csv where there is one, else records.parquet."""
    return run_file(run_dir, RECORDS_CSV, RECORDS_FILE)


def decisions_file(run_dir: Path) -> Path:
    """decisions.jsonl where there is one, else decisions.parquet."""
    return run_file(run_dir, DECISIONS_JSONL, DECISIONS_FILE)


def read_records_file(path: Path) -> list[RequestRecord]:
    """The records of records.csv or (a `.parquet` path) records.parquet."""
    if path.suffix == ".parquet":
        from testbed.metrics.columnar import iter_parquet_records

        return list(iter_parquet_records(path))
    return read_records(path)


def read_run_records(run_dir: Path) -> list[RequestRecord]:
    """A run directory's records: records.csv where there is one, else records.parquet."""
    return read_records_file(records_file(Path(run_dir)))


def read_series_file(path: Path, t0: float = 0.0, metric: str | None = None) -> list[SeriesPoint]:
    """`read_series` of decisions.jsonl or (a `.parquet` path) decisions.parquet."""
    if path.suffix == ".parquet":
        from testbed.metrics.columnar import read_parquet_series

        return read_parquet_series(path, t0, metric)
    return read_series(path, t0, metric)


def _decision_line(ts: float, source: str, metric: str, value: float, labels: dict[str, str]) -> str:
    """The line `BatchSeriesFile` writes for this point (its time already in wire seconds)."""
    vs = repr(value) if -math.inf < value < math.inf else "null"
    return (
        f'{{"ts": {ts:.6f}, "source": {json.dumps(source)}, "metric": {json.dumps(metric)}, '
        f'"value": {vs}, "labels": {encode_labels(labels)}}}\n'
    )


def export_text(run_dir: Path) -> list[Path]:
    """Write records.csv and decisions.jsonl beside a run directory's records.parquet and
    decisions.parquet: the files a run written with them would hold (the same lines). One that
    exists already is left as it is. The paths written."""
    from testbed.metrics.columnar import ROW_GROUP, iter_parquet_records, read_parquet_series

    run_dir = Path(run_dir)
    out: list[Path] = []
    src, dst = run_dir / RECORDS_FILE, run_dir / RECORDS_CSV
    if not src.is_file() and not dst.is_file():
        raise RunDirError(f"{src}: missing; is {run_dir} a run directory?")
    if src.is_file() and not dst.is_file():
        with RecordWriter(dst, deferred=True) as w:
            for rec in iter_parquet_records(src):
                w.write(rec)
        out.append(dst)
    src, dst = run_dir / DECISIONS_FILE, run_dir / DECISIONS_JSONL
    if src.is_file() and not dst.is_file():
        with dst.open("w") as fh:
            batch: list[str] = []
            for p in read_parquet_series(src):
                batch.append(_decision_line(p.t, p.source, p.metric, p.value, p.labels))
                if len(batch) >= ROW_GROUP:
                    fh.write("".join(batch))
                    batch = []
            fh.write("".join(batch))
        out.append(dst)
    return out
