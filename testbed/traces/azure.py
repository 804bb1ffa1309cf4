"""Azure LLM inference traces (AzurePublicDataset, 2023 and 2024), CSV.

Header `TIMESTAMP,ContextTokens,GeneratedTokens` (columns found by name; others, such as the 2025
multimodal `NumImages`, are ignored). TIMESTAMP is a datetime: the 2023 files write .NET's seven
fractional digits and no zone (`2023-11-16 18:15:46.6805900`), the 2024 week-long files six digits
and a UTC offset (`2024-05-10 00:00:00.009930+00:00`). Any of 0-9 fractional digits, a `T` or a
space, and `Z`, `+HH:MM` or `+HHMM` are accepted; an offset is applied (times are compared in UTC);
times without an offset are taken as UTC, and a file must not mix the two.

The 2024 files hold millions of rows (16.8M code, 27.3M conversation), so timestamps are parsed by
hand: the "YYYY-MM-DD HH:MM" prefix changes once a minute and is converted once, the seconds are one
float(). Python 3.11's datetime.fromisoformat would also refuse the seven-digit 2023 form.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from testbed.core.schema.limits import MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS
from testbed.traces import csvutil
from testbed.traces.csvutil import LoadStats, RowError, TokenCounts, Window, show
from testbed.traces.types import Trace, TraceError, TraceRequest

TIMESTAMP, CONTEXT, GENERATED = "TIMESTAMP", "ContextTokens", "GeneratedTokens"
COLUMNS = (TIMESTAMP, CONTEXT, GENERATED)
# No prefix hashes in this format; the size only matters to code that reads hash_ids.
BLOCK_TOKENS = 512

_TIMESTAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d(?:\.\d+)?)(Z|[+-]\d\d:?\d\d)?", re.ASCII)
_EXAMPLE = "2023-11-16 18:15:46.6805900 or 2024-05-10 00:00:00.009930+00:00"


def azure_clock() -> Callable[[str], float]:
    """A parser of TIMESTAMP text to seconds (UTC) since the minute of the first timestamp it
    parsed; raises RowError.

    Rows of one file share a layout, so the general path (a regex) records the last layout
    (length, where the seconds end, the zone text) and later rows of that layout take a path
    of a few string operations, the minute looked up in a dict. Anything that path does not
    accept goes to the general one, which alone raises.
    """
    minutes: dict[str, int] = {}
    zones: dict[str, int] = {}
    base: int | None = None
    aware: bool | None = None
    length, sec_end, zone_text, zone_offset = -1, 0, "", 0

    def minute_of(s: str, m: re.Match[str]) -> int:
        nonlocal base
        try:
            dt = datetime(int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]))
        except ValueError as e:
            raise RowError(TIMESTAMP, f"{e} in {show(s)}") from None
        epoch = calendar.timegm(dt.timetuple())
        if base is None:
            base = epoch
        minutes[s[:16]] = epoch - base
        return epoch - base

    def zone_of(s: str, text: str) -> int:
        nonlocal aware
        offset = 0
        if len(text) > 1:
            hours, mins = int(text[1:3]), int(text[-2:])
            if hours > 23 or mins > 59:
                raise RowError(TIMESTAMP, f"UTC offset out of range in {show(s)}")
            offset = (1 if text[0] == "+" else -1) * (hours * 3600 + mins * 60)
        has = text != ""
        if aware is None:
            aware = has
        elif has != aware:
            raise RowError(
                TIMESTAMP,
                f"{show(s)} {'has' if has else 'lacks'} a UTC offset and the rows before "
                f"{'do not' if has else 'do'}: a file must not mix the two",
            )
        zones[text] = offset
        return offset

    def general(s: str) -> float:
        nonlocal length, sec_end, zone_text, zone_offset
        m = _TIMESTAMP.fullmatch(s)
        if m is None:
            raise RowError(TIMESTAMP, f"expected a datetime like {_EXAMPLE}, got {show(s)}")
        v = float(m[6])
        if v >= 60.0:
            raise RowError(TIMESTAMP, f"seconds out of range in {show(s)}")
        minute = minutes.get(s[:16])
        if minute is None:
            minute = minute_of(s, m)
        text = m[7] or ""
        offset = zones.get(text)
        if offset is None:
            offset = zone_of(s, text)
        length, sec_end, zone_text, zone_offset = len(s), m.end(6), text, offset
        return (minute - offset) + v

    def clock(s: str) -> float:
        if len(s) == length and s.endswith(zone_text) and s[16] == ":":
            sec = s[17:sec_end]
            if sec.replace(".", "", 1).isdigit():
                minute = minutes.get(s[:16])
                if minute is not None:
                    try:
                        v = float(sec)
                    except ValueError:  # digits float() refuses (isdigit takes "²"): the regex decides
                        return general(s)
                    if v < 60.0:
                        return (minute - zone_offset) + v
        return general(s)

    return clock


def iter_azure(
    path: str | Path,
    *,
    window: Window | None = None,
    limit: int | None = None,
    stats: LoadStats | None = None,
    on_error: Callable[[TraceError], None] | None = None,
) -> Iterator[TraceRequest]:
    """Stream requests from an Azure LLM inference CSV, validating each row read.

    See `csvutil.scan` for trace time, `window`, `limit`, ordering, ids and `on_error`. Zero
    ContextTokens or GeneratedTokens are raised to 1 (the router's minimum) and counted in
    `stats`; counts above `testbed.core.schema.limits` are errors.
    """
    header = csvutil.read_header(path)
    cols = header.index(COLUMNS)
    ti, ci, gi = cols[TIMESTAMP], cols[CONTEXT], cols[GENERATED]
    st = stats if stats is not None else LoadStats()
    clock = azure_clock()
    inputs, outputs = TokenCounts(MAX_INPUT_TOKENS), TokenCounts(MAX_OUTPUT_TOKENS)
    cached_input, count_input = inputs.cache.get, inputs.parse
    cached_output, count_output = outputs.cache.get, outputs.parse

    def parse(row: list[str]) -> tuple[float, int, int]:
        t = clock(row[ti])
        inp = cached_input(row[ci])
        if inp is None:
            inp = count_input(row[ci], CONTEXT)
        out = cached_output(row[gi])
        if out is None:
            out = count_output(row[gi], GENERATED)
        return t, inp, out

    def admit(row: list[str], inp: int, out: int) -> tuple[int, int]:
        if inp == 0:
            inp = 1
            st.raised_input += 1
        if out == 0:
            out = 1
            st.raised_output += 1
        return inp, out

    return csvutil.scan(
        header,
        parse,
        admit,
        time_index=ti,
        time_field=TIMESTAMP,
        window=window,
        limit=limit,
        stats=st,
        on_error=on_error,
    )


def _stamp(ticks: int, style: str, start: datetime) -> str:
    """`start` + ticks of 100 ns, in the 2023 (7 digits, no zone) or 2024 (6 digits, +00:00) form."""
    sec, frac = divmod(ticks, 10_000_000)
    base = calendar.timegm(start.timetuple()) + sec
    day = datetime.fromtimestamp(base, UTC).strftime("%Y-%m-%d %H:%M:%S")
    if style == "2023":
        return f"{day}.{frac:07d}"
    return f"{day}.{frac // 10:06d}+00:00"


AZURE_STYLES = ("2023", "2024")
_STARTS = {"2023": datetime(2023, 11, 16, 18, 15, 46), "2024": datetime(2024, 5, 10, 0, 0, 0)}


def write_azure(path: str | Path, trace: Trace, style: str = "2024") -> None:
    """Write `trace` in the Azure CSV layout of `style` ("2023" or "2024"), starting at the
    matching release's first day. Hash ids are dropped (the format has none)."""
    if style not in AZURE_STYLES:
        raise ValueError(f"style must be one of {AZURE_STYLES}, got {style!r}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    start = _STARTS[style]
    with p.open("w", encoding="utf-8", newline="") as f:
        f.write(f"{TIMESTAMP},{CONTEXT},{GENERATED}\n")
        for r in trace.requests:
            ticks = round(r.timestamp * 10_000_000)
            f.write(f"{_stamp(ticks, style, start)},{r.input_tokens},{r.output_tokens}\n")


def is_azure_header(columns: list[str]) -> bool:
    return csvutil.has_columns(columns, COLUMNS)
