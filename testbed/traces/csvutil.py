"""CSV plumbing shared by the Azure and BurstGPT loaders.

Header reading and column mapping by name, token-count parsing, counting what a loader skipped or
changed, and finding where a time window starts in a sorted file without reading what precedes it.
Line numbers are 1-based physical lines with the header on line 1.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import io
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from testbed.config.input_files import quotable_header
from testbed.core.schema.limits import MAX_TIMESTAMP_S
from testbed.traces.files import open_trace, plain_name
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
    """Parses one column's token counts, up to `limit`. The same few thousand values repeat over
    millions of rows, so a dict hit is cheaper than int() and every row shares one int object per
    value. Only accepted values are cached, so a hit needs no check."""

    __slots__ = ("cache", "limit")

    def __init__(self, limit: int) -> None:
        self.cache: dict[str, int] = {}
        self.limit = limit

    def parse(self, text: str, column: str) -> int:
        """The count in `text` (digits, or an integral float such as "18.0" as pandas writes)."""
        digits = text
        if "." in text:
            digits, _, frac = text.partition(".")
            if frac.strip("0"):
                raise RowError(column, f"expected a non-negative integer, got {show(text)}")
        if not (digits.isascii() and digits.isdigit()):
            raise RowError(column, f"expected a non-negative integer, got {show(text)}")
        try:
            value = int(digits)
        except ValueError:  # more digits than int() takes (4300)
            value = self.limit + 1
        if value > self.limit:
            raise RowError(column, f"expected at most {self.limit:,} tokens, got {show(text)}")
        if len(self.cache) < _TOKEN_CACHE_MAX:
            self.cache[text] = value
        return value


def parse_seconds(text: str, column: str) -> float:
    """A plain non-negative decimal number of seconds ("5", "19440110.0"), at most MAX_TIMESTAMP_S."""
    if not (text.isascii() and text.replace(".", "", 1).isdigit()):
        raise RowError(column, f"expected a non-negative number of seconds, got {show(text)}")
    value = float(text)
    if not value <= MAX_TIMESTAMP_S:
        raise RowError(column, f"expected at most {MAX_TIMESTAMP_S:,.0f} seconds, got {show(text)}")
    return value


def _norm(name: str) -> str:
    return " ".join(name.split()).casefold()


def describe_header(columns: Sequence[str], expected: Sequence[str]) -> str:
    """The header for an error message: quoted only where it is recognisably a trace's
    (`input_files.quotable_header`)."""
    return quotable_header(columns, expected)


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
                    f"missing column (header: {describe_header(self.columns, required)})",
                    path=self.path,
                    line=1,
                    field=name,
                )
        return out


def read_header(path: str | Path) -> CsvHeader:
    p = Path(path)
    try:
        with open_trace(p) as f:
            raw = f.readline()
            cr = raw.find(b"\r")
            if 0 <= cr < len(raw) - 1 and raw[cr + 1] != 0x0A:
                raw = raw[: cr + 1]  # CR line ends, as the rows' reader takes them
            offset = len(raw)
            size = f.seek(0, io.SEEK_END)
    except OSError as e:
        raise TraceError(f"cannot open: {e.strerror or e}", path=p) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=p, line=1) from None
    try:
        rows = list(csv.reader([text]))
    except csv.Error as e:
        raise TraceError(f"bad CSV ({e})", path=p, line=1) from None
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
    if names != (
        "request_id",
        "timestamp",
        "input_tokens",
        "output_tokens",
        "hash_ids",
        "session_id",
        "parent_id",
        "think_s",
    ):
        raise RuntimeError(f"csvutil builds TraceRequest by its fields; update it for {names}")
    return tuple(cast(Callable[[TraceRequest, object], None], getattr(TraceRequest, n).__set__) for n in names)


_SETTERS = _slot_setters()
Window = tuple[float, float]
# (row) -> (time in seconds, input tokens, output tokens); raises RowError.
RowParser = Callable[[list[str]], tuple[float, int, int]]
# (row, input, output) -> the (input, output) to replay, or None to skip the row.
RowAdmitter = Callable[[list[str], int, int], "tuple[int, int] | None"]


def _open_rows(header: CsvHeader, offset: int) -> io.TextIOWrapper:
    raw = open_trace(header.path)
    raw.seek(offset)
    return io.TextIOWrapper(raw, encoding="utf-8", newline="")


# Starts the one field that stands in for a line that is not UTF-8 (a noncharacter: no text holds it).
NOT_UTF8 = "\ufffe"
_BREAKS = (b"\n", b"\r")


def mark_bad_lines(data: bytes) -> bytes:
    """`data` (whole lines) with each line that is not UTF-8 replaced by NOT_UTF8 and the reason,
    its line breaks kept, so a CSV reader reads it as one field on the same line number."""
    view = memoryview(data)
    parts: list[bytes] = []
    pos = 0
    while True:
        try:
            codecs.utf_8_decode(view[pos:], "strict", True)
            break
        except UnicodeDecodeError as e:
            bad = pos + e.start
            start = max(data.rfind(b, 0, bad) for b in _BREAKS) + 1
            ends = [i for i in (data.find(b, bad) for b in _BREAKS) if i >= 0]
            end = min(ends) if ends else len(data)
            parts.append(data[pos:start])
            parts.append(f"{NOT_UTF8}not UTF-8 text ({e.reason} at byte {bad - start})".encode())
            pos = end
    parts.append(data[pos:])
    return b"".join(parts)


class _Utf8Lines(io.RawIOBase):
    """A binary file read from an offset with its non-UTF-8 lines marked (see mark_bad_lines):
    a decoding error then names its own line, and reading goes on after it. It reads blocks of
    whole lines; ASCII blocks, as the published traces are, pass through untouched."""

    def __init__(self, f: io.BufferedReader, block: int = 1 << 20) -> None:
        super().__init__()
        self._f = f
        self._block = block
        self._pending = b""
        self._out = memoryview(b"")
        self._eof = False

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()
        super().close()

    def _fill(self) -> None:
        data = self._f.read(self._block)
        buf = self._pending + data
        if not data:
            self._eof = True
            out, self._pending = buf, b""
        else:
            # Cut after the last line break; not after a final CR, whose LF may be in the next block.
            cut = max(buf.rfind(b"\n"), buf.rfind(b"\r", 0, len(buf) - 1)) + 1
            out, self._pending = buf[:cut], buf[cut:]
        self._out = memoryview(out if out.isascii() else mark_bad_lines(out))

    def readinto(self, b: Any) -> int:
        while not self._out and not self._eof:
            self._fill()
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def skip_lines(path: Path, start: int, lines: int) -> int:
    """The byte offset `lines` lines after `start`, lines ending as a text reader with
    newline="" ends them (CRLF, CR or LF)."""
    if lines <= 0:
        return start
    with open_trace(path) as f:
        f.seek(start)
        base, buf = start, b""
        while True:
            data = f.read(1 << 20)
            buf += data
            # A final CR may be the first half of a CRLF: leave it for the next read.
            end = len(buf) - 1 if data and buf.endswith(b"\r") else len(buf)
            for m in _LINE_BREAK.finditer(buf, 0, end):
                lines -= 1
                if lines == 0:
                    return base + m.end()
            if not data:
                return base + len(buf)
            base, buf = base + end, buf[end:]


def _open_checked_rows(header: CsvHeader, offset: int) -> io.TextIOWrapper:
    raw = open_trace(header.path)
    raw.seek(offset)
    return io.TextIOWrapper(io.BufferedReader(_Utf8Lines(raw), 1 << 16), encoding="utf-8", newline="")


def count_lines(path: Path, start: int, end: int) -> int:
    """Newlines in bytes [start, end) of the file."""
    n = 0
    with open_trace(path) as f:
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
    with open_trace(header.path) as f:
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
    on_error: Callable[[TraceError], None] | None = None,
) -> Iterator[TraceRequest]:
    """Requests from a CSV trace. `parse` validates every row read; `admit` says whether and
    how a row inside the window is replayed. It sees the rows with a zero token count, and
    every row if `admit_all`; other rows are replayed as parsed.

    Trace time is seconds since the file's first row, whatever `admit` keeps. `window=(start,
    end)` keeps arrivals in [start, end); the requests are rebased so the first one is at 0.
    Rows must be in time order (equal is fine). When `start` lies far into the file, the rows
    before it are passed over by bisection, unread and so unchecked. Request ids are
    `"{file stem}-{line}"`. A bad row raises TraceError, or with `on_error` is passed to it and
    left out; the next rows are then checked against the last good one.
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
    stem = plain_name(path).stem
    ncols = len(header.columns)
    new = object.__new__
    set_id, set_time, set_input, set_output, set_hashes, set_session, set_parent, set_think = _SETTERS
    no_hashes = ()
    line_base = first_line - 1
    prev = -math.inf
    prev_row: list[str] = []
    w0: float | None = None
    kept = nrows = 0
    text = _open_rows(header, offset)
    reader = csv.reader(text)
    checked = False
    try:
        # The reader goes on after a csv.Error, so a scan that reports errors resumes it; a byte
        # that is not UTF-8 breaks the text layer, so the scan goes on with a new reader from the
        # line after the last one read, one that marks such lines (a slower one: only then).
        while True:
            try:
                for row in reader:
                    if len(row) != ncols:
                        if not row:
                            continue
                        error = _shape_error(row, ncols, path, line_base + reader.line_num)
                        if on_error is None:
                            raise error
                        on_error(error)
                        continue
                    try:
                        t, inp, out = parse(row)
                    except RowError as e:
                        error = TraceError(e.message, path=path, line=line_base + reader.line_num, field=e.field)
                        if on_error is None:
                            raise error from None
                        on_error(error)
                        continue
                    if t < prev:
                        error = TraceError(
                            f"goes backwards: {show(row[time_index])} is earlier than the row before "
                            f"({show(prev_row[time_index])}); rows must be in arrival order",
                            path=path,
                            line=line_base + reader.line_num,
                            field=time_field,
                        )
                        if on_error is None:
                            raise error
                        on_error(error)
                        continue
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
                    set_session(r, "")
                    set_parent(r, "")
                    set_think(r, math.nan)
                    yield r
                    kept += 1
                    if kept == limit:
                        break
                break
            except csv.Error as e:
                error = TraceError(f"bad CSV ({e})", path=path, line=line_base + reader.line_num)
                if on_error is None:
                    raise error from None
                on_error(error)
            except UnicodeDecodeError as e:
                if checked:  # cannot happen: every line it passes on decodes
                    raise TraceError(
                        f"not UTF-8 text ({e.reason})", path=path, line=line_base + reader.line_num + 1
                    ) from None
                checked = True
                offset = skip_lines(path, offset, reader.line_num)
                line_base += reader.line_num
                text.close()
                text = _open_checked_rows(header, offset)
                reader = csv.reader(text)
    finally:
        stats.rows += nrows
        stats.kept += kept
        text.close()


def _shape_error(row: list[str], ncols: int, path: Path, line: int) -> TraceError:
    if len(row) == 1 and row[0].startswith(NOT_UTF8):
        return TraceError(row[0][len(NOT_UTF8) :], path=path, line=line)
    return TraceError(f"expected {ncols} fields (as in the header), got {len(row)}", path=path, line=line)
