"""records.csv: one row per trace request (`testbed.core.record.RequestRecord`), written as the run goes.

Times are wire seconds relative to the run's start (`t0`), empty where a stage never happened.
Paper-unit figures are derived in the summary (times x speedup, bytes x byte_scale). The columns
are the file's external format and keep their names and order; each names a record field or a
stamp of its `times`. What a record holds beyond them (the router-side stamps such as
`router_arrival`, `decode_cluster`, `route_reason`, `cache_move_src`) is not stored.

Schema versions (the file carries no number, its header names the columns):
- 1: before `failure_kind`, `failure_node`, `retry_kind` and `retry_node`: what failed a request
  was only in the `reason` and `retry_reason` texts. Such a file reads with those four empty: its
  summary counts its failures' kinds as `unknown`, and its report's Faults section counts a
  retried request by the instances it ran on only (the texts are for people, never parsed).
- 2: `failure_kind` and `retry_kind` (a `testbed.core.failures.FailureKind`), `failure_node` and
  `retry_node` (the instance it happened at): what failed, as data.
- 3: `session_id`, `turn` and `parent_index` (the trace index of the turn it follows, -1 for none):
  the trace's sessions (`testbed.core.sessions`). A version 2 file reads as a trace without them.
  And records.parquet (`testbed.metrics.columnar`): every field of the record and every stamp, the
  stamps as microsecond durations; a simulated `replay` of more than 20,000 requests writes it
  beside records.csv (the file a run killed outright keeps), which it removes when it ends (a
  shorter one writes records.csv alone); `testbed export` writes records.csv from it.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cache
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import IO, Any, Protocol

from testbed.core import native
from testbed.core.failures import failure_kind
from testbed.core.record import FIELD_TYPES, NAN, TIME_NAMES, RecordFormatError, RequestRecord, StageTimes

COLUMNS: tuple[str, ...] = (
    "request_id",
    "trace_index",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "arrival",
    "routed",
    "prefill_cluster",
    "prefill_node",
    "decode_node",
    "crossed_wan",
    "threshold",
    "prefill_queued",
    "prefill_start",
    "prefill_end",
    "prefill_modelled",
    "transfer_start",
    "transfer_end",
    "decode_admitted",
    "first_token",
    "last_token",
    "tokens_received",
    "kv_bytes_paper",
    "kv_bytes_wire",
    "outcome",
    "reason",
    "decode_cached_tokens",
    "cache_move_tokens",
    "cache_move_start",
    "cache_move_end",
    "cache_move_bytes_paper",
    "cache_move_bytes_wire",
    "retries",
    "retry_reason",
    "router_arrival",
    "decode_first_token",
    "decode_last_token",
    "failure_kind",
    "failure_node",
    "retry_kind",
    "retry_node",
    "session_id",
    "turn",
    "parent_index",
)
RECORDS_VERSION = 3
# Columns added after the first release: a file without them reads as their default.
OPTIONAL: dict[str, str] = {
    "retries": "0",
    "retry_reason": "",
    "router_arrival": "",
    "decode_first_token": "",
    "decode_last_token": "",
    "failure_kind": "",
    "failure_node": "",
    "retry_kind": "",
    "retry_node": "",
    "session_id": "",
    "turn": "0",
    "parent_index": "-1",
}
_KIND_COLUMNS = frozenset({"failure_kind", "retry_kind"})
# The longest value a records.csv field holds, in characters, for the writer and the reader alike:
# the writer cuts a longer text (a failure's reason quoting a huge body, say) to this many, and the
# reader lets the csv module read fields this long. Before, the writer wrote any length and the
# reader stopped at the csv module's default 131072 ("field larger than field limit"), so a single
# long value made a whole run's records unreadable.
MAX_FIELD_CHARS = 64 * 1024
_TIMES = frozenset(TIME_NAMES)
# Column -> type name; every column is a record field or a stamp (a KeyError here is a typo above).
_KINDS: dict[str, str] = {c: "float" if c in _TIMES else FIELD_TYPES[c] for c in COLUMNS}


def _value(rec: RequestRecord, col: str) -> Any:
    return getattr(rec.times, col) if col in _TIMES else getattr(rec, col)


def _fmt_float(v: float) -> str:
    return "" if v != v else f"{v:.6f}"  # NaN: empty


def _fmt_bool(v: bool) -> str:
    return "1" if v else "0"


def _fmt_str(v: str) -> str:
    return v if len(v) <= MAX_FIELD_CHARS else v[:MAX_FIELD_CHARS]


# Each column's formatter by its declared type: a run writes a row per request, and the generic
# `_fmt` (a chain of isinstance tests per value) was most of the cost of a simulated run's records.
_FORMAT: dict[str, Callable[[Any], str]] = {"float": _fmt_float, "int": str, "bool": _fmt_bool, "str": _fmt_str}
_ROW_FIELDS = tuple((c in _TIMES, c, _FORMAT[_KINDS[c]]) for c in COLUMNS)


def format_row(rec: RequestRecord) -> list[str]:
    t = rec.times
    return [fmt(getattr(t if timed else rec, c)) for timed, c, fmt in _ROW_FIELDS]


def _attr(timed: bool, c: str) -> str:
    return "times." + c if timed else c


# A whole row as two `%` formats, not a call per field: the floats (and the one bool) first,
# leaving `%s` for the rest, whose NaNs then read as empty (only the floats can print "nan");
# then the ints and texts, as `str` would write them. The csv module would write the same line
# unless a text needs quoting or cutting: `format_line` hands such a row to it instead.
_FIRST_ATTRS = [_attr(timed, c) for timed, c, fmt in _ROW_FIELDS if fmt is _fmt_float or fmt is _fmt_bool]
_FIRST = attrgetter(*_FIRST_ATTRS)
_SECOND = attrgetter(
    *[_attr(timed, c) for timed, c, fmt in _ROW_FIELDS if fmt is not _fmt_float and fmt is not _fmt_bool]
)
_LINE = (
    ",".join("%.6f" if fmt is _fmt_float else "%d" if fmt is _fmt_bool else "%%s" for _, _, fmt in _ROW_FIELDS) + "\r\n"
)
_COMMAS = len(COLUMNS) - 1
_BOOL_COLUMNS = tuple(c for _, c, fmt in _ROW_FIELDS if fmt is _fmt_bool)
assert _BOOL_COLUMNS == ("crossed_wan",)  # `format_line` checks this one's type


def _plain(line: str) -> bool:
    """No field of the line holds a comma, quote or line break (the csv module would quote it),
    nor is any longer than the cut."""
    return (
        line.count(",") == _COMMAS
        and line.count("\n") == 1
        and line.count("\r") == 1
        and '"' not in line
        and len(line) <= MAX_FIELD_CHARS
    )


def format_line(rec: RequestRecord) -> str:
    """The row's line as the csv module writes `format_row(rec)`."""
    if rec.crossed_wan.__class__ is bool:  # "%d" writes a bool as _fmt_bool does, not any value
        line = (_LINE % _FIRST(rec)).replace("nan", "") % _SECOND(rec)
        if _plain(line):
            return line
    buf = io.StringIO(newline="")
    csv.writer(buf).writerow(format_row(rec))
    return buf.getvalue()


def parse_row(row: Mapping[Any, Any], where: str = "row") -> RequestRecord:
    """The record a row (column -> text) holds; a missing or unknown column or a value that does
    not parse raises `RecordFormatError` naming it."""
    if None in row:  # csv.DictReader: more values than columns
        raise RecordFormatError(f"{where}: more values than columns")
    check_columns(row, where)
    kw: dict[str, Any] = {}
    times = StageTimes()
    for c in COLUMNS:
        raw = row[c] if c in row or c not in OPTIONAL else OPTIONAL[c]
        if raw is None:  # csv.DictReader: the row ended early
            raise RecordFormatError(f"{where}: column {c!r} is missing its value")
        v = _parse(c, _KINDS[c], raw, where)
        if c in _KIND_COLUMNS:
            try:
                failure_kind(v, f"{where}: column {c!r}")
            except ValueError as e:
                raise RecordFormatError(str(e)) from None
        if c in _TIMES:
            setattr(times, c, v)
        else:
            kw[c] = v
    return RequestRecord(times=times, **kw)


def check_columns(names: Iterable[str], where: str) -> None:
    names = list(names)
    missing = [c for c in COLUMNS if c not in names and c not in OPTIONAL]
    if missing:
        raise RecordFormatError(f"{where}: missing column {missing[0]!r}")
    unknown = sorted(str(k) for k in names if k not in _KINDS)
    if unknown:
        raise RecordFormatError(f"{where}: unknown column {unknown[0]!r}")


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6f}"
    return str(v)[:MAX_FIELD_CHARS]


def _allow_field_size() -> None:
    """Let the csv module read every field the writer writes (its limit is process-wide: only
    ever raised here, never lowered)."""
    if csv.field_size_limit() < MAX_FIELD_CHARS:
        csv.field_size_limit(MAX_FIELD_CHARS)


def _parse(col: str, kind: str, raw: str, where: str) -> Any:
    try:
        if kind == "float":
            return float(raw) if raw != "" else NAN
        if kind == "int":
            return int(raw) if raw != "" else 0
    except ValueError:
        what = "a number" if kind == "float" else "an integer"
        raise RecordFormatError(f"{where}: column {col!r}: {raw!r} is not {what}") from None
    if kind == "bool":
        if raw not in ("1", "0", "true", "false", "True", "False", ""):
            raise RecordFormatError(f"{where}: column {col!r}: {raw!r} is not 1 or 0")
        return raw in ("1", "true", "True")
    return raw


_ALL_TIMES = attrgetter(*TIME_NAMES)
_OTHER_FLOATS = tuple(c for timed, c, fmt in _ROW_FIELDS if fmt is _fmt_float and not timed)
_STR_FIELDS = tuple(c for timed, c, fmt in _ROW_FIELDS if fmt is _fmt_str)
CUT_FIELDS = frozenset(_STR_FIELDS)  # the texts `as_written` cuts: records.csv's columns


def as_written(rec: RequestRecord) -> RequestRecord:
    """`rec` made what its row reads back as (in place): times and other floats to the microsecond,
    texts cut to `MAX_FIELD_CHARS`. A writer that summarises the records it holds gets the figures
    a later reader of the file gets. (A stamp that is not a column is rounded too: no reader of
    the file has it.)"""
    rec.times = StageTimes(*[round(v, 6) for v in _ALL_TIMES(rec.times)])  # round(nan) is nan
    for c in _OTHER_FLOATS:
        setattr(rec, c, round(getattr(rec, c), 6))
    for c in _STR_FIELDS:
        v = getattr(rec, c)
        if len(v) > MAX_FIELD_CHARS:
            setattr(rec, c, v[:MAX_FIELD_CHARS])
    return rec


# `written_line`: the floats of `_LINE` and then the stamps that are not columns, split at commas.
# A float's "%.6f" text reads back as round(v, 6) (both are the same correctly rounded decimal):
# parsing the text once written is cheaper than rounding each float again.
_EXTRA_TIMES = tuple(n for n in TIME_NAMES if n not in COLUMNS)
_HELD_FIRST = attrgetter(*_FIRST_ATTRS, *("times." + n for n in _EXTRA_TIMES))
_HELD_LINE = _LINE + ",".join(["", *["%.6f"] * len(_EXTRA_TIMES)])
_AT = {c: i for i, c in enumerate(COLUMNS)} | {n: len(COLUMNS) + i for i, n in enumerate(_EXTRA_TIMES)}
_TIMES_AT = itemgetter(*[_AT[n] for n in TIME_NAMES])
_OTHER_FLOATS_AT = tuple((c, _AT[c]) for c in _OTHER_FLOATS)


def written_line(rec: RequestRecord) -> str:
    """`format_line(rec)`, and `rec` made `as_written(rec)` in place. For records whose floats
    are floats (an int would become a float here, where `round` keeps it an int)."""
    if rec.crossed_wan.__class__ is bool:
        text = _HELD_LINE % _HELD_FIRST(rec)
        line = text[: text.index("\n") + 1].replace("nan", "") % _SECOND(rec)
        if _plain(line):
            # No text was cut; the last column's "\r\n" is whitespace to float().
            fields = text.split(",")
            rec.times = StageTimes(*map(float, _TIMES_AT(fields)))
            for c, i in _OTHER_FLOATS_AT:
                setattr(rec, c, float(fields[i]))
            return line
    line = format_line(rec)
    as_written(rec)
    return line


@cache
def native_rows() -> RecordRows | None:
    """The compiled twin of `format_line` and `written_line` for a batch
    (`testbed_native.RecordRows`), where built (`testbed.core.native`)."""
    ext = native.module()
    if ext is None:
        return None
    rows: RecordRows = ext.RecordRows(
        [(c, _KINDS[c], c in _TIMES) for c in COLUMNS], list(TIME_NAMES), StageTimes, MAX_FIELD_CHARS
    )
    return rows


class RecordRows(Protocol):
    def lines(self, records: list[RequestRecord], settle: bool = False) -> list[str | None]: ...


class RecordWriter:
    """Appends records to CSV and flushes each row, so an interrupted run keeps what it has.
    `deferred` writes them in batches of `BATCH` rows (a simulator: a flush per row costs a tenth
    of its run), so a run killed outright still leaves all but its last batch on disk.
    `settle` makes each record `as_written` as its row is written (`written_line`), for a writer
    that summarises the records it holds. Deferred batches go through the compiled writer where
    it is built (`native_rows`: the same bytes) unless `compiled` is False."""

    BATCH = 4096

    def __init__(self, path: Path, deferred: bool = False, settle: bool = False, compiled: bool = True) -> None:
        self.path = path
        self._fh: IO[str] = path.open("w", newline="")
        csv.writer(self._fh).writerow(COLUMNS)
        self._fh.flush()
        self._settle = settle
        self._compiled = compiled  # deferred batches by the compiled writer, where built
        self._line = written_line if settle else format_line
        self._later: list[RequestRecord] | None = [] if deferred else None
        self.count = 0
        self.write_s = 0.0  # seconds spent writing deferred batches

    def write(self, rec: RequestRecord) -> None:
        self.count += 1
        if self._later is not None:
            self._later.append(rec)
            if len(self._later) >= self.BATCH:
                self._write_later()
            return
        self._fh.write(self._line(rec))
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self.drain()
            self._fh.close()

    @property
    def settles(self) -> bool:
        return self._settle

    def drain(self) -> None:
        """Write the records held back (each then `as_written`, if this writer settles them)."""
        if self._later and not self._fh.closed:
            self._write_later()

    def _write_later(self) -> None:
        assert self._later is not None
        t = time.perf_counter()
        rows = native_rows() if self._compiled else None
        if rows is None:
            self._fh.write("".join(map(self._line, self._later)))
        else:
            # The compiled writer's lines; a record it leaves (None) is written the Python way.
            lines = rows.lines(self._later, self._settle)
            self._fh.write("".join([ln if ln is not None else self._line(r) for ln, r in zip(lines, self._later)]))
        self._fh.flush()
        self._later = []
        self.write_s += time.perf_counter() - t

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(path: Path) -> list[RequestRecord]:
    return list(iter_records(path))


def _cut_off(path: Path) -> bool:
    """Whether the file's last line lacks its newline: a row the writer began and could not
    finish (a full disk, a killed process). RecordWriter ends every row it writes with one."""
    with path.open("rb") as fh:
        if fh.seek(0, 2) == 0:
            return False
        fh.seek(-1, 2)
        return fh.read(1) != b"\n"


def iter_records(path: Path) -> Iterator[RequestRecord]:
    """Every record of the file; a last row cut off mid-write is left out (its request then
    has no record, as one lost in flight), so such a run stays readable."""
    _allow_field_size()
    cut = _cut_off(path)
    with path.open(newline="") as fh:
        r = csv.DictReader(fh)
        check_columns(r.fieldnames or (), f"{path}:1")
        held: tuple[dict[str, str], int] | None = None
        for row in r:
            if held is not None:
                yield parse_row(held[0], f"{path}:{held[1]}")
            held = (row, r.line_num)
        if held is not None and not cut:
            yield parse_row(held[0], f"{path}:{held[1]}")


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    with RecordWriter(path) as w:
        for rec in records:
            w.write(rec)
