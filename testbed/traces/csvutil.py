"""CSV plumbing shared by the Azure and BurstGPT loaders.

Header reading and column mapping by name, token-count parsing, counting what a loader skipped or
changed, and finding where a time window starts in a sorted file without reading what precedes it.
Line numbers are 1-based physical lines with the header on line 1.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from testbed.traces.types import TraceError, TraceRequest

# A window start this far into a file (bytes) is found by bisection instead of a scan.
BISECT_MIN_BYTES = 1 << 20
_BISECT_STOP = 1 << 16
# Distinct token counts are few (thousands); the cap only bounds a pathological file.
_TOKEN_CACHE_MAX = 1 << 17


class RowError(ValueError):
    """A bad field in one row; the loader adds file and line."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def show(text: str) -> str:
    """A field's text for an error message, shortened."""
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")


@dataclass
class LoadStats:
    """What a CSV loader read, and what it skipped or changed so the requests are replayable
    (the router takes input and output counts >= 1)."""

    rows: int = 0
    kept: int = 0
    skipped_failed: int = 0
    skipped_model: int = 0
    kept_failed: int = 0
    raised_input: int = 0
    raised_output: int = 0

    def summary(self, input_col: str, output_col: str) -> list[str]:
        """The counts as sentences for `Trace.notes`, in the format's column names."""
        out: list[str] = []
        if self.skipped_failed:
            out.append(
                f"skipped {_n(self.skipped_failed, 'failed request')} ({output_col} 0; keep them with "
                "keep_failed=True / --keep-failed)"
            )
        if self.kept_failed:
            out.append(f"kept {_n(self.kept_failed, 'failed request')} ({output_col} 0) with 1 output token")
        if self.skipped_model:
            out.append(f"skipped {_n(self.skipped_model, 'request')} of other models")
        if self.raised_input:
            out.append(f"raised {self.raised_input:,} zero {input_col} to 1 token")
        if self.raised_output:
            out.append(f"raised {self.raised_output:,} zero {output_col} to 1 token")
        return out


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


class TokenCounts:
    """Parses token-count fields. The same few thousand values repeat over millions of rows, so a
    dict hit is cheaper than int() and every row shares one int object per value."""

    __slots__ = ("cache",)

    def __init__(self) -> None:
        self.cache: dict[str, int] = {}

    def parse(self, text: str, column: str) -> int:
        """The count in `text` (digits, or an integral float such as "18.0" as pandas writes)."""
        digits = text
        if "." in text:
            digits, _, frac = text.partition(".")
            if frac.strip("0"):
                raise RowError(column, f"expected a non-negative integer, got {show(text)}")
        if not (digits.isascii() and digits.isdigit()):
            raise RowError(column, f"expected a non-negative integer, got {show(text)}")
        value = int(digits)
        if len(self.cache) < _TOKEN_CACHE_MAX:
            self.cache[text] = value
        return value


def parse_seconds(text: str, column: str) -> float:
    """A plain non-negative decimal number of seconds ("5", "19440110.0")."""
    if not (text.isascii() and text.replace(".", "", 1).isdigit()):
        raise RowError(column, f"expected a non-negative number of seconds, got {show(text)}")
    value = float(text)
    if not math.isfinite(value):
        raise RowError(column, f"expected a finite number of seconds, got {show(text)}")
    return value


def _norm(name: str) -> str:
    return " ".join(name.split()).casefold()


@dataclass(frozen=True)
class CsvHeader:
    path: Path
    columns: list[str]
    data_offset: int  # byte offset of line 2
    size: int

    def index(self, required: Sequence[str], optional: Sequence[str] = ()) -> dict[str, int]:
        """Column positions by name (case and repeated spaces ignored); a missing required column
        is a TraceError naming it."""
        names = [_norm(c) for c in self.columns]
        out: dict[str, int] = {}
        for name in (*required, *optional):
            key = _norm(name)
            if names.count(key) > 1:
                raise TraceError("column appears twice in the header", path=self.path, line=1, field=name)
            if key in names:
                out[name] = names.index(key)
            elif name in required:
                raise TraceError(
                    f"missing column (header: {', '.join(self.columns) or '(empty)'})",
                    path=self.path, line=1, field=name,
                )
        return out


def read_header(path: str | Path) -> CsvHeader:
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.readline()
            offset = f.tell()
            size = f.seek(0, io.SEEK_END)
    except OSError as e:
        raise TraceError(f"cannot open: {e.strerror or e}", path=p) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=p, line=1) from None
    rows = list(csv.reader([text]))
    columns = [c.strip() for c in rows[0]] if rows else []
    return CsvHeader(p, columns, offset, size)


def sniff_columns(path: str | Path) -> list[str]:
    """The header's column names, normalised for matching (see CsvHeader.index)."""
    return [_norm(c) for c in read_header(path).columns]


def has_columns(columns: Sequence[str], names: Sequence[str]) -> bool:
    have = set(columns)
    return all(_norm(n) in have for n in names)


def _slot_setters() -> tuple[Callable[[TraceRequest, object], None], ...]:
    """The setters of TraceRequest's slots, in field order. The frozen dataclass's __init__ sets
    each field through object.__setattr__; setting the slots directly builds the same object in
    about half the time, which is a sixth of the cost of a CSV row."""
    names = tuple(f.name for f in dataclasses.fields(TraceRequest))
    if names != ("request_id", "timestamp", "input_tokens", "output_tokens", "hash_ids"):
        raise RuntimeError(f"csvutil builds TraceRequest by its fields; update it for {names}")
    return tuple(cast(Callable[[TraceRequest, object], None], getattr(TraceRequest, n).__set__) for n in names)


_SETTERS = _slot_setters()
Window = tuple[float, float]
# (row) -> (time in seconds, input tokens, output tokens); raises RowError.
RowParser = Callable[[list[str]], tuple[float, int, int]]
# (row, input, output) -> the (input, output) to replay, or None to skip the row.
RowAdmitter = Callable[[list[str], int, int], "tuple[int, int] | None"]


def _open_rows(header: CsvHeader, offset: int) -> io.TextIOWrapper:
    raw = header.path.open("rb")
    raw.seek(offset)
    return io.TextIOWrapper(raw, encoding="utf-8", newline="")


def count_lines(path: Path, start: int, end: int) -> int:
    """Newlines in bytes [start, end) of the file."""
    n = 0
    with path.open("rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(left, 1 << 23))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def first_time(header: CsvHeader, time_of: Callable[[list[str]], float]) -> float | None:
    """The first data row's time; None for an empty file or an unreadable first row (which a
    scan then reports with its line)."""
    with _open_rows(header, header.data_offset) as text:
        try:
            for row in csv.reader(text):
                if row:
                    return time_of(row)
        except (ValueError, IndexError, csv.Error):
            return None
    return None


def seek_time(header: CsvHeader, time_of: Callable[[list[str]], float], target: float) -> tuple[int, int]:
    """(byte offset, line number) of a row start at or before the first row whose time is
    >= `target`, in a file sorted by time, by bisection over byte offsets.

    Only rows known to be earlier than `target` are passed over, so a scan from the result
    finds every row at or after it. A probe `time_of` cannot read (ValueError/IndexError)
    ends the search there; the scan reports that row with its line.
    """
    lo, hi = header.data_offset, header.size
    with header.path.open("rb") as f:
        while hi - lo > _BISECT_STOP:
            mid = (lo + hi) // 2
            f.seek(mid)
            f.readline()  # the rest of the row `mid` falls in
            start = f.tell()
            raw = f.readline()
            if start >= hi or not raw.strip():
                hi = mid
                continue
            try:
                row = next(csv.reader([raw.decode("utf-8")]))
                t = time_of(row)
            except (ValueError, IndexError, StopIteration, csv.Error):
                break
            if t < target:
                lo = start
            else:
                hi = mid
    return lo, 1 + count_lines(header.path, 0, lo)


def scan(
    header: CsvHeader,
    parse: RowParser,
    admit: RowAdmitter,
    *,
    admit_all: bool = False,
    time_index: int,
    time_field: str,
    window: Window | None,
    limit: int | None,
    stats: LoadStats,
) -> Iterator[TraceRequest]:
    """Requests from a CSV trace. `parse` validates every row read; `admit` says whether and
    how a row inside the window is replayed. It sees the rows with a zero token count, and
    every row if `admit_all`; other rows are replayed as parsed.

    Trace time is seconds since the file's first row, whatever `admit` keeps. `window=(start,
    end)` keeps arrivals in [start, end); the requests are rebased so the first one is at 0.
    Rows must be in time order (equal is fine). When `start` lies far into the file, the rows
    before it are passed over by bisection, unread and so unchecked. Request ids are
    `"{file stem}-{line}"`.
    """
    start, end = window if window is not None else (0.0, math.inf)
    if limit is not None and limit <= 0:
        return
    path = header.path
    offset, first_line = header.data_offset, 2
    t0: float | None = None
    if start > 0 and header.size - header.data_offset > BISECT_MIN_BYTES:
        t0 = first_time(header, lambda row: parse(row)[0])
        if t0 is not None:
            base = t0
            offset, first_line = seek_time(header, lambda row: parse(row)[0] - base, start)
    stem = path.stem
    ncols = len(header.columns)
    new = object.__new__
    set_id, set_time, set_input, set_output, set_hashes = _SETTERS
    no_hashes = ()
    line_base = first_line - 1
    prev = -math.inf
    prev_row: list[str] = []
    w0: float | None = None
    kept = nrows = 0
    text = _open_rows(header, offset)
    reader = csv.reader(text)
    try:
        for row in reader:
            if len(row) != ncols:
                if not row:
                    continue
                raise TraceError(
                    f"expected {ncols} fields (as in the header), got {len(row)}",
                    path=path, line=line_base + reader.line_num,
                )
            try:
                t, inp, out = parse(row)
            except RowError as e:
                raise TraceError(e.message, path=path, line=line_base + reader.line_num, field=e.field) from None
            if t < prev:
                raise TraceError(
                    f"goes backwards: {show(row[time_index])} is earlier than the row before "
                    f"({show(prev_row[time_index])}); rows must be in arrival order",
                    path=path, line=line_base + reader.line_num, field=time_field,
                )
            prev, prev_row = t, row
            nrows += 1
            if t0 is None:
                t0 = t
            rel = t - t0
            if rel < start:
                continue
            if rel >= end:
                break
            if admit_all or not (inp and out):
                got = admit(row, inp, out)
                if got is None:
                    continue
                inp, out = got
            if w0 is None:
                w0 = rel
            r = new(TraceRequest)
            set_id(r, f"{stem}-{line_base + reader.line_num}")
            set_time(r, rel - w0)
            set_input(r, inp)
            set_output(r, out)
            set_hashes(r, no_hashes)
            yield r
            kept += 1
            if kept == limit:
                break
    except UnicodeDecodeError as e:
        raise TraceError(f"not UTF-8 text ({e.reason}) after line {line_base + reader.line_num}", path=path) from None
    except csv.Error as e:
        raise TraceError(f"bad CSV ({e})", path=path, line=line_base + reader.line_num + 1) from None
    finally:
        stats.rows += nrows
        stats.kept += kept
        text.close()
