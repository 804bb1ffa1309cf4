"""records.parquet and decisions.parquet: a run's records and decisions as Parquet, written in row
groups as the run goes.

A simulated run of a million requests wrote 560 MB of records.csv and decisions.jsonl; the same
values as Parquet (zstd, dictionary-encoded texts) take a tenth of that and read column by column.
The records' columns are `RequestRecord`'s fields and then its `StageTimes` stamps, in declaration
order, derived from the dataclasses: a field added there is a column here without an edit (a file
written before it reads as the field's default). Unlike records.csv, every field and stamp is
stored (records.csv keeps its fixed columns). Values are what records.csv reads back: floats to the
microsecond (NaN where a stage never happened), texts cut to `MAX_FIELD_CHARS`.

decisions.parquet holds the lines of decisions.jsonl (`testbed.metrics.series_format`) as the
columns `ts`, `source`, `metric`, `value` and `labels` (a map of text to text).

A Parquet file is readable once closed (its footer lists the row groups): a run stopped by Ctrl-C
closes it, one killed outright leaves it unreadable (records.csv keeps all but its last batch).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from testbed.core import native
from testbed.core.record import RecordFormatError, RequestRecord, StageTimes
from testbed.metrics.decision_columns import decision_columns
from testbed.metrics.records import (
    CUT_FIELDS,
    MAX_FIELD_CHARS,
    RECORDS_VERSION,
    RecordWriter,
    as_written,
    native_rows,
)
from testbed.metrics.series_format import RawSample, SeriesPoint, TimeseriesError

# Rows per row group: a run holds at most this many records or decisions before writing them.
# 8,192 records and decision lines held take ~10 MB (65,536 took ~150 MB, a quarter of a
# simulated run's peak memory); the files grow by a few percent.
ROW_GROUP = 8_192
_COMPRESSION = "zstd"

_ARROW: dict[str, pa.DataType] = {"float": pa.float64(), "int": pa.int64(), "bool": pa.bool_(), "str": pa.string()}


def _arrow_type(owner: str, f: dataclasses.Field[Any]) -> pa.DataType:
    name = str(f.type)
    t = _ARROW.get(name)
    if t is None:
        raise TypeError(f"{owner}.{f.name}: type {name!r} has no Parquet column type (add it to _ARROW)")
    return t


_RECORD_FIELDS = tuple(f for f in dataclasses.fields(RequestRecord) if f.name != "times")
_TIME_FIELDS = dataclasses.fields(StageTimes)
assert dataclasses.fields(RequestRecord)[-1].name == "times", "records are built with their times last"
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in _RECORD_FIELDS)
TIME_COLUMNS: tuple[str, ...] = tuple(f.name for f in _TIME_FIELDS)
assert not set(FIELD_NAMES) & set(TIME_COLUMNS), "a record field and a stamp share a column name"
# Stamps as microsecond durations since the run's start (null: the stage never happened): the
# integers of what records.csv holds, delta-encoded, take half the space of the same doubles.
STAMP = pa.duration("us")
VERSION_KEY = b"testbed.records_version"
RECORD_SCHEMA = pa.schema(
    [pa.field(f.name, _arrow_type("RequestRecord", f), nullable=False) for f in _RECORD_FIELDS]
    + [pa.field(f.name, STAMP) for f in _TIME_FIELDS],
    metadata={VERSION_KEY: str(RECORDS_VERSION).encode()},
)
_ENCODING = {f.name: "DELTA_BINARY_PACKED" for f in RECORD_SCHEMA if f.type in (STAMP, pa.int64())} | {
    f.name: "BYTE_STREAM_SPLIT" for f in RECORD_SCHEMA if f.type == pa.float64()
}
_DICTIONARY = [f.name for f in RECORD_SCHEMA if f.type in (pa.string(), pa.bool_())]
_FLOAT_FIELDS = frozenset(f.name for f in _RECORD_FIELDS if str(f.type) == "float")
_INT_NAMES = tuple(f.name for f in _RECORD_FIELDS if str(f.type) == "int")
# Each a tuple, however many names (attrgetter of one name gives the value alone).
_INT_GET = attrgetter(*_INT_NAMES, *(_INT_NAMES[:1] if len(_INT_NAMES) == 1 else ()))
_TIME_GET = attrgetter(*TIME_COLUMNS)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


_DEFAULTS: dict[str, Any] = {f.name: _default(f) for f in (*_RECORD_FIELDS, *_TIME_FIELDS)}


def _settle(records: list[RequestRecord]) -> None:
    """Each record made what records.csv reads back, in place (the compiled writer where built)."""
    rows = native_rows()
    lines = rows.lines(records, True) if rows is not None else [None] * len(records)
    for line, r in zip(lines, records):
        if line is None:  # what the compiled writer leaves (a text to cut, say) or all without it
            as_written(r)


def _matrix(get: Callable[[Any], tuple[Any, ...]], items: list[Any], dtype: type[np.generic]) -> np.ndarray[Any, Any]:
    """The values `get` takes from each item, a row per column (each row contiguous): one pass
    over the items for a whole group of columns."""
    return np.array(list(map(get, items)), dtype=dtype).reshape(len(items), -1).T.copy()


_NATIVE_FIELDS = [(f.name, str(f.type)) for f in _RECORD_FIELDS]


def _text_buffers(n: int, buf: tuple[bytes, bytes]) -> pa.Array:
    """`n` texts from the compiled twins' (UTF-8 data, 32-bit offsets) buffers."""
    data, offsets = buf
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _native_batch(records: list[RequestRecord], settled: bool = True) -> pa.RecordBatch | None:
    """A batch from the compiled twin's buffers (`testbed_native.record_columns`), where built, of
    settled records or (not `settled`) of the values settling would give them; None: the Python way
    (no twin, a value of another type than its column's, a text to cut)."""
    ext = native.module()
    bufs = (
        None
        if ext is None
        else ext.record_columns(records, _NATIVE_FIELDS, list(TIME_COLUMNS), not settled, MAX_FIELD_CHARS)
    )
    if bufs is None:
        return None
    n = len(records)
    arrays: list[pa.Array] = []
    for f, buf in zip(RECORD_SCHEMA, bufs):
        if isinstance(buf, tuple):
            arrays.append(_text_buffers(n, buf))
        elif f.type == STAMP:
            arrays.append(_stamps(np.frombuffer(buf, dtype=np.float64)))
        else:
            arrays.append(pa.Array.from_buffers(f.type, n, [None, pa.py_buffer(buf)]))
    return pa.RecordBatch.from_arrays(arrays, schema=RECORD_SCHEMA)


def _record_batch(records: list[RequestRecord], settled: bool, compiled: bool = True) -> pa.RecordBatch:
    """`compiled`: the batch from the compiled twin's buffers where it is built."""
    if compiled and (batch := _native_batch(records, settled)) is not None:
        return batch
    ints = dict(zip(_INT_NAMES, _matrix(_INT_GET, records, np.int64)))
    stamps = _matrix(_TIME_GET, [r.times for r in records], np.float64)
    if not settled:  # as `as_written` rounds them, before `_stamps` takes them to microseconds
        stamps = np.array([[round(v, 6) for v in row] for row in stamps.tolist()], dtype=np.float64)
    arrays: list[pa.Array] = []
    for f in _RECORD_FIELDS:
        n = f.name
        held = ints.get(n)
        if held is not None:
            arrays.append(_plain(pa.int64(), held))
            continue
        col = [getattr(r, n) for r in records]
        if not settled:
            if n in _FLOAT_FIELDS:
                col = [round(v, 6) for v in col]
            elif n in CUT_FIELDS:  # as settling cuts them: records.csv's own texts
                col = [v[:MAX_FIELD_CHARS] for v in col]
        arrays.append(_BUILD[str(f.type)](col))
    arrays += [_stamps(t) for t in stamps]
    return pa.RecordBatch.from_arrays(arrays, schema=RECORD_SCHEMA)


# Arrays from their buffers: `pa.array` of a list or an ndarray imports pandas (pyarrow's pandas
# shim asks whether the values are a pandas object), 0.2 s of CPU and 100 MiB the run otherwise
# never needs.
def _plain(t: pa.DataType, values: np.ndarray[Any, Any]) -> pa.Array:
    return pa.Array.from_buffers(t, len(values), [None, pa.py_buffer(values)])


def _floats(col: list[Any]) -> pa.Array:
    return _plain(pa.float64(), np.array(col, dtype=np.float64))


def _ints(col: list[Any]) -> pa.Array:
    return _plain(pa.int64(), np.array(col, dtype=np.int64))


def _bools(col: list[Any]) -> pa.Array:
    bits = np.packbits(np.array(col, dtype=np.bool_), bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(col), [None, pa.py_buffer(bits)])


class _TooLong(ValueError):
    """A text column of a batch holds more than a 32-bit offset reaches: a batch of records is
    split (decisions' short texts never come near)."""


_MAX_OFFSET = 2**31 - 1


def _texts(col: list[Any]) -> pa.Array:
    joined = "".join(col)
    data = joined.encode()
    # All ASCII (the usual case): each text's bytes are its characters.
    sizes = map(len, col) if len(data) == len(joined) else (len(v.encode()) for v in col)
    if len(data) > _MAX_OFFSET:
        raise _TooLong(f"{len(data):,} bytes of text in one column, more than a 32-bit offset reaches")
    offsets = np.zeros(len(col) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(sizes, dtype=np.int32, count=len(col)), out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), len(col), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _stamps(t: np.ndarray[Any, Any]) -> pa.Array:
    """Seconds to whole microseconds, rounded half to even; NaN (the stage never happened): null."""
    never = np.isnan(t)
    if np.isinf(t).any():
        raise ValueError("a stage stamp is infinite")
    us = np.rint(t * 1e6)
    us[never] = 0.0
    valid = None if not never.any() else pa.py_buffer(np.packbits(~never, bitorder="little"))
    return pa.Array.from_buffers(STAMP, len(t), [valid, pa.py_buffer(us.astype(np.int64))])


_BUILD: dict[str, Callable[[list[Any]], pa.Array]] = {"float": _floats, "int": _ints, "bool": _bools, "str": _texts}


def _write_records(out: pq.ParquetWriter, records: list[RequestRecord], settled: bool, compiled: bool = True) -> None:
    try:
        batch = _record_batch(records, settled, compiled)
    except _TooLong:
        if len(records) == 1:
            raise ValueError("a record's texts exceed 2 GiB") from None
        half = len(records) // 2
        _write_records(out, records[:half], settled, compiled)
        _write_records(out, records[half:], settled, compiled)
        return
    out.write_batch(batch)


class ParquetRecordWriter:
    """Records to records.parquet, a row group per `ROW_GROUP` records. `settle` makes each record
    `as_written` in place (for a writer that summarises the records it holds); without it the
    stored values are rounded and cut the same way and the records left as they are.
    `settled_by`: a records.csv writer that is given the same records and settles them as it
    writes them; its held records are written before each row group, which then need not be
    settled again (a twentieth of a simulated run's writing). `compiled`: batches from the compiled
    twin where it is built."""

    def __init__(
        self, path: Path, settle: bool = False, settled_by: RecordWriter | None = None, compiled: bool = True
    ) -> None:
        self.path = path
        self._out = pq.ParquetWriter(
            path, RECORD_SCHEMA, compression=_COMPRESSION, use_dictionary=_DICTIONARY, column_encoding=_ENCODING
        )
        self._settle = settle
        self._compiled = compiled
        self._settled_by = settled_by if settled_by is not None and settled_by.settles else None
        self._held: list[RequestRecord] = []
        self.count = 0
        self.write_s = 0.0

    def write(self, rec: RequestRecord) -> None:
        self.count += 1
        self._held.append(rec)
        if len(self._held) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self._held:
            return
        if self._settled_by is not None:
            self._settled_by.drain()  # timed as that writer's (`write_s`), not again as this one's
        t = time.perf_counter()
        if self._settled_by is None and self._settle:
            _settle(self._held)
        _write_records(self._out, self._held, self._settle or self._settled_by is not None, self._compiled)
        self._held = []
        self.write_s += time.perf_counter() - t

    def close(self) -> None:
        if self._out.is_open:
            self._flush()
            self._out.close()

    def __enter__(self) -> ParquetRecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise RecordFormatError(f"{path}: not a readable Parquet file (a run killed before closing it?): {e}") from None


def _check_schema(path: Path, schema: pa.Schema, expected: pa.Schema) -> None:
    raw = (schema.metadata or {}).get(VERSION_KEY, b"3")
    version = int(raw) if raw.isdigit() else -1
    if version < 3 or version > RECORDS_VERSION:
        raise RecordFormatError(
            f"{path}: records version {raw.decode(errors='replace')}; this testbed reads 3 to {RECORDS_VERSION}"
        )
    for f in schema:
        want = expected.field(f.name) if f.name in expected.names else None
        if want is None:
            raise RecordFormatError(f"{path}: unknown column {f.name!r}")
        if f.type != want.type:
            raise RecordFormatError(f"{path}: column {f.name!r}: type {f.type}, expected {want.type}")
    missing = [n for n in expected.names if n not in schema.names and _DEFAULTS.get(n) is dataclasses.MISSING]
    if missing:
        raise RecordFormatError(f"{path}: missing column {missing[0]!r}")


def _column(table: pa.Table, have: set[str], name: str) -> list[Any]:
    if name not in have:
        return [_DEFAULTS[name]] * table.num_rows
    col = table.column(name)
    if col.type == STAMP:
        # Microseconds / 1e6 is the double nearest the decimal, as float() of records.csv's text.
        seconds: list[Any] = (col.cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6).tolist()
        return seconds
    values: list[Any] = col.to_pylist()
    return values


def iter_parquet_records(path: Path) -> Iterator[RequestRecord]:
    """Every record of a records.parquet, a row group at a time; a column the file lacks (written
    before its field existed) reads as the field's default."""
    pf = _open(path)
    _check_schema(path, pf.schema_arrow, RECORD_SCHEMA)
    have = set(pf.schema_arrow.names)
    for i in range(pf.num_row_groups):
        table = pf.read_row_group(i)
        fields = [_column(table, have, name) for name in FIELD_NAMES]
        stamps = [_column(table, have, name) for name in TIME_COLUMNS]
        for row, t in zip(zip(*fields), zip(*stamps)):
            # Positional (the fields in order, times last: asserted above): a dict per row costs more.
            yield RequestRecord(*row, StageTimes(*t))  # type: ignore[call-arg]


# -- decisions ------------------------------------------------------------------------------------

DECISION_SCHEMA = pa.schema(
    [
        pa.field("ts", pa.float64(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),
        pa.field("labels", pa.map_(pa.string(), pa.string()), nullable=False),
    ]
)


_LABELS = DECISION_SCHEMA.field("labels").type


def decision_batch(
    held: list[tuple[float, str, Iterable[RawSample]]], speedup: float, compiled: bool = True
) -> pa.RecordBatch:
    """A held batch of decision lines ((paper time, source, samples)) as decisions.parquet's rows:
    from the compiled twin's buffers where built (`testbed_native.decision_columns`, unless not
    `compiled`), else from `decision_columns`' lists; the same batch either way."""
    ext = native.module() if compiled else None
    bufs = None if ext is None else ext.decision_columns(held, speedup)
    if bufs is not None:
        ts, sources, metrics, values, counts, keys, texts = bufs
        n = len(ts) // 8
        labels = pa.MapArray.from_arrays(
            pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(counts)]),
            _text_buffers(len(keys[1]) // 4 - 1, keys),
            _text_buffers(len(texts[1]) // 4 - 1, texts),
            type=_LABELS,
        )
        arrays = [
            pa.Array.from_buffers(pa.float64(), n, [None, pa.py_buffer(ts)]),
            _text_buffers(n, sources),
            _text_buffers(n, metrics),
            pa.Array.from_buffers(pa.float64(), n, [None, pa.py_buffer(values)]),
            labels,
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=DECISION_SCHEMA)
    cols = decision_columns(held, speedup)
    offsets = np.zeros(len(cols.counts) + 1, dtype=np.int32)
    np.cumsum(np.array(cols.counts, dtype=np.int32), out=offsets[1:])
    labels = pa.MapArray.from_arrays(_plain(pa.int32(), offsets), _texts(cols.keys), _texts(cols.texts), type=_LABELS)
    arrays = [_floats(cols.ts), _texts(cols.sources), _texts(cols.metrics), _floats(cols.values), labels]
    return pa.RecordBatch.from_arrays(arrays, schema=DECISION_SCHEMA)


class ParquetSeriesFile:
    """`BatchSeriesFile`'s interface (times in paper seconds, written as wire seconds since the
    run's start) writing decisions.parquet: the values decisions.jsonl's lines read back as."""

    def __init__(self, path: Path, source: str, speedup: float) -> None:
        self.path = path
        self.source = source
        self.speedup = speedup
        self._out = pq.ParquetWriter(path, DECISION_SCHEMA, compression=_COMPRESSION)
        self._held: list[tuple[float, str, Iterable[RawSample]]] = []
        self.lines = 0
        self.points: list[SeriesPoint] | None = None
        self.write_s = 0.0

    def write(self, t_paper: float, samples: Iterable[RawSample]) -> None:
        self.source_write(t_paper, self.source, samples)

    def source_write(self, t_paper: float, source: str, samples: Iterable[RawSample]) -> None:
        self._held.append((t_paper, source, samples))
        if len(self._held) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self._held:
            return
        t0 = time.perf_counter()
        batch = decision_batch(self._held, self.speedup)
        self._out.write_batch(batch)
        self.lines += batch.num_rows
        self._held = []
        self.write_s += time.perf_counter() - t0

    def close(self) -> None:
        if self._out.is_open:
            self._flush()
            self._out.close()


def read_parquet_series(path: Path, t0: float = 0.0, metric: str | None = None) -> list[SeriesPoint]:
    """decisions.parquet's points (with `metric`, only that metric's), in file order, `t`
    relative to `t0`: what `read_series` reads from the same lines as JSONL."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise TimeseriesError(f"{path}: not a readable Parquet file (a run killed before closing it?): {e}") from None
    schema = pf.schema_arrow
    if schema.names != DECISION_SCHEMA.names:
        raise TimeseriesError(f"{path}: columns {schema.names}, expected {DECISION_SCHEMA.names}")
    import pyarrow.compute as pc  # here: the writers, which a simulated run imports, need none of it

    out: list[SeriesPoint] = []
    for i in range(pf.num_row_groups):
        table = pf.read_row_group(i)
        if metric is not None:
            table = table.filter(pc.equal(table.column("metric"), metric))
            if table.num_rows == 0:
                continue
        cols = [table.column(n).to_pylist() for n in DECISION_SCHEMA.names]
        for ts, source, m, value, lab in zip(*cols):
            out.append(SeriesPoint(ts - t0, source, m, value, dict(lab)))
    return out
