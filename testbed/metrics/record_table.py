"""records.parquet read back as columns, with a light row view per record, for a summary of a run
too long to hold its records as objects.

A `RequestRecord` with its stamps costs about a kilobyte of Python objects; a million of them did
not fit the memory a simulation of a million requests needs otherwise. `RecordTable` reads a
column only when a row's field is first asked for, and holds it as a flat array (8 bytes a
number; a text or a flag, a reference to one shared object), so a summary holds only the
columns it reads. Its rows answer every field, stamp and property of `RequestRecord` that
reading code uses (`ttft`, `tpot`) with the values `iter_parquet_records` would give: the same
records as records.csv reads back.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from testbed.core.record import RequestRecord
from testbed.metrics.columnar import _DEFAULTS, FIELD_NAMES, RECORD_SCHEMA, STAMP, TIME_COLUMNS, _check_schema, _open

Column = Sequence[Any]


class _Columns(dict[str, Column]):
    """Column name -> values, each read from the file when first asked for."""

    def __init__(self, path: Path, rows: int, names: set[str]) -> None:
        super().__init__()
        self.path = path
        self.rows = rows
        self._names = names
        # Opened when a column is first read: an open file holds its footer (every row group's
        # column chunks: ~60 MB for ten million records), which a summary by columns never needs.
        self._file: pq.ParquetFile | None = None

    def __missing__(self, name: str) -> Column:
        col = self._read(name)
        self[name] = col
        return col

    def _read(self, name: str) -> Column:
        if name not in self._names:
            default = _default(name)
            return _Repeat(default, self.rows)
        if self._file is None:
            self._file = pq.ParquetFile(self.path)
        data = self._file.read([name]).column(name)
        t = data.type
        if t == STAMP:
            # As `columnar._column`: microseconds / 1e6, the double records.csv's text reads as.
            return _flat("d", data.cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6)
        if t == pa.float64():
            return _flat("d", data.to_numpy(zero_copy_only=False))
        if t == pa.int64():
            return _flat("q", data.to_numpy(zero_copy_only=False))
        if t == pa.string():
            # A few distinct texts (nodes, outcomes, reasons): one object each, shared by the rows.
            enc = pc.dictionary_encode(data).combine_chunks()
            distinct = enc.dictionary.to_pylist()
            return [distinct[c] for c in enc.indices.to_numpy(zero_copy_only=False).tolist()]
        values: list[Any] = data.to_pylist()  # booleans: the shared True and False
        return values


def _flat(code: str, values: Any) -> array[Any]:
    """`values` (a numpy array of the type `code` names) as an array."""
    out = array(code)
    out.frombytes(np.ascontiguousarray(values, dtype=out.typecode).tobytes())
    return out


def _default(name: str) -> Any:
    return _DEFAULTS[name]


class _Repeat(Sequence[Any]):
    """One value for every row (a column the file predates)."""

    def __init__(self, value: Any, n: int) -> None:
        self.value, self.n = value, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        return self.value


def _row_class(cols: _Columns) -> Any:
    """A class per table whose instances hold a row number alone, its fields read from `cols`."""

    def prop(name: str) -> property:
        def get(row: Any) -> Any:
            return cols[name][row._i]

        return property(get)

    times_ns: dict[str, Any] = {"__slots__": ("_i",)}
    for n in TIME_COLUMNS:
        times_ns[n] = prop(n)
    times_cls: Any = type("RecordTimes", (), times_ns)

    def times(row: Any) -> Any:
        t = times_cls.__new__(times_cls)
        t._i = row._i
        return t

    row_ns: dict[str, Any] = {
        "__slots__": ("_i",),
        "times": property(times),
        "ttft": RequestRecord.ttft,
        "tpot": RequestRecord.tpot,
    }
    for n in FIELD_NAMES:
        row_ns[n] = prop(n)
    return type("RecordRow", (), row_ns)


class RecordTable(Sequence[RequestRecord]):
    """A records.parquet's records in file order, as read-only rows (see the module)."""

    def __init__(self, path: Path) -> None:
        pf = _open(path)  # the errors `iter_parquet_records` gives, naming the file
        _check_schema(path, pf.schema_arrow, RECORD_SCHEMA)
        self.path = path
        self._n = int(pf.metadata.num_rows)
        self._cols = _Columns(path, self._n, set(pf.schema_arrow.names))
        self._row = _row_class(self._cols)
        self._made: list[RequestRecord] | None = None

    def __len__(self) -> int:
        return self._n

    @property
    def _rows(self) -> list[RequestRecord]:
        # One view per record, made once: a summary filters the records into several lists
        # (completed, failed, offloaded...), which then share the views instead of each making
        # its own (a view is ~80 bytes with its index; a list entry 8).
        rows = self._made
        if rows is None:
            cls = self._row
            new = cls.__new__
            rows = []
            for i in range(self._n):
                row = new(cls)
                row._i = i
                rows.append(row)
            self._made = rows
        return rows

    @overload
    def __getitem__(self, i: int) -> RequestRecord: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RequestRecord]: ...
    def __getitem__(self, i: int | slice) -> RequestRecord | Sequence[RequestRecord]:
        return self._rows[i]

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(self._rows)
