"""Mooncake (FAST'25) JSONL traces.

One JSON object per line: `timestamp` (ms, int or float), `input_length`, `output_length`
(tokens) and `hash_ids` (one id per 512-token block of the prompt; equal id = equal prefix
block). Blank lines are skipped; other keys are ignored so newer releases still load. Values
must be replayable: token counts and timestamps within `testbed.core.schema.limits`.

Sessions, optional, as the Alibaba Bailian traces state them: `chat_id` (this request's id, an
integer or a string), `parent_chat_id` (the `chat_id` of the turn it follows, -1 or absent for a
first turn; one no earlier line holds, as in an excerpt, makes a first turn) and `think_time`
(seconds between the parent's answer and this turn, where known). Without them the sessions
may be inferred from `hash_ids` (`testbed.traces.sessions`).
"""

from __future__ import annotations

import io
import json
import json.scanner
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any

from testbed.config.input_files import json_kind
from testbed.core import native
from testbed.core.schema.limits import MAX_HASH_ID, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, MAX_TIMESTAMP_MS, MIN_TOKENS
from testbed.traces.files import open_trace, plain_name
from testbed.traces.types import Trace, TraceError, TraceRequest

MOONCAKE_BLOCK_TOKENS = 512
_NONNEG_INT = "expected a non-negative integer"
_TOKENS = f"expected a token count from {MIN_TOKENS} to {{:,}}"
_SMALL = (1 << 30) - 1  # the largest int CPython compares on its fast path
_MAX_SECONDS = sys.float_info.max  # a larger int is one float() overflows on, a float infinite


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


_BOM = b"\xef\xbb\xbf"
_DECODER = json.JSONDecoder()
_loads_text = _DECODER.decode  # json.loads of text with default options
# The decoder's own scanner (C where built): `decode` without its whitespace matching and checks,
# a tenth of the parse. A line it does not take whole as one object goes the full way, which gives
# the same value or the same error.
# (typeshed has the scanner take a scanner; it takes the decoder whose settings it follows)
_scan_once: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(_DECODER)  # type: ignore[arg-type]
_JSON_SPACE = " \t\n\r"


def _loads_line(text: str) -> Any:
    if text[:1] == "{":
        try:
            obj, end = _scan_once(text, 0)
        except (StopIteration, ValueError, RecursionError):
            pass
        else:
            if end == len(text) or not text[end:].strip(_JSON_SPACE):
                return obj
    return _loads_text(text)


def _json_error(e: ValueError | RecursionError) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON ({e.msg} at column {e.colno})"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text ({e.reason} at byte {e.start})"
    if isinstance(e, RecursionError):
        return "invalid JSON (nested too deeply)"
    return "invalid JSON (a number too long to read)"  # beyond int()'s digit limit


def _hash_error(ids: list[Any], h: Any) -> TraceError:
    k = next(i for i, x in enumerate(ids) if x is h)
    if type(h) is int and h > MAX_HASH_ID:
        return TraceError(f"element {k}: {_show(h)} does not fit in 63 bits", field="hash_ids")
    return TraceError(f"element {k}: {_NONNEG_INT}, got {_show(h)}", field="hash_ids")


# A line's values as the compiled reader gives them: (timestamp, input_length, output_length, hash_ids).
_Row = tuple[int | float, int, int, tuple[int, ...]]
# A line with `chat_id`, as a list (told apart from a _Row by type): the same values, then chat_id
# (int | str), parent_chat_id (int | str | None, -1 where absent) and think_time (float | None).
_ChatRow = list[Any]
_Rows = Callable[[bytes], list[_Row | _ChatRow | bytes]]
# The lines handed to the compiled reader at a time: enough to spare the calls, and a block
# malloc reuses (one of 1 MB is mapped and zeroed afresh each time, a tenth of the time).
_BLOCK_BYTES = 1 << 16


# What the compiled readers check a row against: the module's own limits.
_LIMITS = {
    "max_timestamp": MAX_TIMESTAMP_MS,
    "min_tokens": MIN_TOKENS,
    "max_input": MAX_INPUT_TOKENS,
    "max_output": MAX_OUTPUT_TOKENS,
    "max_hash": MAX_HASH_ID,
}


def _compiled_rows() -> _Rows | None:
    """`testbed_native.mooncake_rows` with this module's limits, where built (`testbed.core.native`):
    for a block of whole lines, each line's values where it is a plain good row, else its bytes."""
    ext = native.module()
    if ext is None:
        return None
    rows: _Rows = partial(ext.mooncake_rows, **_LIMITS)
    return rows


_Scan = Callable[[bytes], tuple[int, int | float, int | float] | None]


def _compiled_scan() -> _Scan | None:
    """`testbed_native.mooncake_scan` with this module's limits, where built."""
    ext = native.module()
    if ext is None:
        return None
    scan: _Scan = partial(ext.mooncake_scan, **_LIMITS)
    return scan


def scan_mooncake(path: str | Path) -> tuple[int, float] | None:
    """What reading a Mooncake file through tells when every line is a plain good row (no session
    keys, no blank line) and the timestamps never go back: how many requests `iter_mooncake`
    yields and the last one's timestamp as it gives it, found without making the requests
    (`testbed_native.mooncake_scan`; their hash ids made into objects are most of a pass's time).
    None where the extension is not built, the file is empty or any line is otherwise:
    `iter_mooncake` then reads it and says what is wrong."""
    scan = _compiled_scan()
    if scan is None:
        return None
    count = 0
    t0: int | float | None = None
    prev: int | float = 0
    with open_trace(Path(path)) as f:
        for block in _blocks(f):
            got = scan(block)
            if got is None:
                return None
            n, first, last = got
            if first < prev:
                return None
            if t0 is None:
                t0 = first
            count += n
            prev = last
    if t0 is None:
        return None
    return count, (prev - t0) * 1.0 / 1000.0  # `iter_mooncake`'s rebasing of a ms timestamp


def _lines(f: io.BufferedReader, rows: _Rows | None) -> Iterator[bytes | _Row | _ChatRow]:
    """Each line of `f` (bytes), or its values where `rows` reads them."""
    if rows is None:
        return f
    return chain.from_iterable(map(rows, _blocks(f)))


def _blocks(f: io.BufferedReader) -> Iterator[bytes]:
    """`f` a block at a time, each with the rest of the line it ends in: whole lines, the same
    lines as iterating `f`, as the compiled readers take them."""
    return iter(lambda: f.read(_BLOCK_BYTES) + f.readline(), b"")


def _row_line(ts: int | float, inp: int, out: int, hids: tuple[int, ...]) -> bytes:
    """A compiled row's line as json reads it the same (its session keys left out: a line that goes
    backwards fails on that before they are read)."""
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": list(hids)}).encode()


def iter_mooncake(
    path: str | Path,
    *,
    on_error: Callable[[TraceError], None] | None = None,
    seconds: bool = False,
    compiled: bool = True,
) -> Iterator[TraceRequest]:
    """Stream requests from a Mooncake JSONL file, validating each line as it is read.

    Timestamps are rebased so the first request is at 0 s; `seconds`: they are in seconds, not
    ms (the Bailian traces, `testbed.traces.bailian`). Request ids are
    `"{file stem}-{line number}"` (1-based physical line, blank lines counted). A bad line
    raises TraceError, or with `on_error` is passed to it and left out; the next lines are then
    checked against the last good one. `compiled`: where the extension is built, plain rows (with
    or without sessions) are read by `testbed_native.mooncake_rows` (the same requests, the same
    errors); other lines, and all of a `seconds` trace, are read here.
    """
    p = Path(path)
    stem = plain_name(p).stem
    # Seconds are checked against the same span as ms (the limit / 1000) and scaled to ms.
    scale, most, unit = (1000.0, MAX_TIMESTAMP_MS / 1000, "s") if seconds else (1.0, MAX_TIMESTAMP_MS, "ms")
    small = -1 if seconds else _SMALL  # seconds take the full check (they are floats anyway)
    bad_ts = f"expected a number of {'seconds' if seconds else 'milliseconds'} from 0 to {most:,}"
    rows = _compiled_rows() if compiled and not seconds else None
    nan = math.nan
    with open_trace(p) as f:
        t0: int | float | None = None
        prev_ts: int | float = 0
        prev_line = 0
        max_hash = MAX_HASH_ID
        chats: dict[object, str] = {}  # chat_id -> request id
        for lineno, raw in enumerate(_lines(f, rows), 1):
            if isinstance(raw, tuple):
                # Read compiled: a valid row as it stands, its timestamp >= 0 (so never before the
                # first). Going backwards, it goes through the checks below as a line json reads
                # the same, and they word the error.
                ts, inp, out, hids = raw
                if ts >= prev_ts:
                    if t0 is None:
                        t0 = ts
                    prev_ts, prev_line = ts, lineno
                    yield TraceRequest(f"{stem}-{lineno}", (ts - t0) * scale / 1000.0, inp, out, hids, "", "", nan)
                    continue
                raw = _row_line(ts, inp, out, hids)
            elif isinstance(raw, list):
                # The same with sessions, their values of the types and in the ranges the checks
                # below pass (a chat id an int or a str; the think time a finite float >= 0):
                # what they do from there.
                ts, inp, out, hids, chat, pchat, th = raw
                if ts >= prev_ts:
                    if t0 is None:
                        t0 = ts
                    prev_ts, prev_line = ts, lineno
                    parent = chats.get(pchat, "") if pchat != -1 and pchat is not None else ""
                    chats[chat] = rid = f"{stem}-{lineno}"
                    think = nan if th is None else th
                    yield TraceRequest(rid, (ts - t0) * scale / 1000.0, inp, out, hids, "", parent, think)
                    continue
                raw = _row_line(ts, inp, out, hids)
            if not raw.strip():
                continue
            try:
                try:
                    # bytes in: json detects the encoding, and a bad byte fails on this line only.
                    # A plain UTF-8 line (no BOM, no NUL: what detection would call UTF-8) is
                    # decoded here, sparing the detection; anything that fails goes the bytes way.
                    try:
                        if raw[:3] == _BOM or b"\0" in raw:
                            raise ValueError
                        obj = _loads_line(raw.decode("utf-8", "surrogatepass"))
                    except (ValueError, RecursionError):
                        obj = json.loads(raw)
                except (ValueError, RecursionError) as e:
                    raise TraceError(_json_error(e)) from None
                if type(obj) is not dict:
                    # Its type only: a line that is no trace row may be anyone's text.
                    raise TraceError(f"expected a JSON object, got {json_kind(obj)}")
                try:
                    ts = obj["timestamp"]
                    inp = obj["input_length"]
                    out = obj["output_length"]
                    ids = obj["hash_ids"]
                except KeyError as e:
                    raise TraceError("missing", field=str(e.args[0])) from None

                # `type(x) is int` rather than isinstance: JSON true/false must not pass as 1/0.
                # The bound also refuses NaN and the infinities, and keeps `ts - t0` a float;
                # below 2^30 the comparisons take CPython's fast int path, the rest the full check.
                tt = type(ts)
                if tt is not int or ts < 0 or ts > small:
                    if not ((tt is int or tt is float) and 0 <= ts <= most):
                        raise TraceError(f"{bad_ts}, got {_show(ts)}", field="timestamp")
                if t0 is not None and ts < prev_ts:
                    raise TraceError(
                        f"goes backwards: {_show(ts)} {unit} after {_show(prev_ts)} {unit} on line {prev_line}",
                        field="timestamp",
                    )
                if type(inp) is not int:
                    raise TraceError(f"{_NONNEG_INT}, got {_show(inp)}", field="input_length")
                if not MIN_TOKENS <= inp <= MAX_INPUT_TOKENS:
                    raise TraceError(f"{_TOKENS.format(MAX_INPUT_TOKENS)}, got {_show(inp)}", field="input_length")
                if type(out) is not int:
                    raise TraceError(f"{_NONNEG_INT}, got {_show(out)}", field="output_length")
                if not MIN_TOKENS <= out <= MAX_OUTPUT_TOKENS:
                    raise TraceError(f"{_TOKENS.format(MAX_OUTPUT_TOKENS)}, got {_show(out)}", field="output_length")
                if type(ids) is not list:
                    raise TraceError(f"expected a list of non-negative integers, got {_show(ids)}", field="hash_ids")
                for h in ids:
                    if type(h) is not int or h < 0 or h > _SMALL:
                        if not (type(h) is int and 0 <= h <= max_hash):
                            raise _hash_error(ids, h)
                parent = rid = ""
                think = math.nan
                if "chat_id" in obj:
                    chat, pchat = obj["chat_id"], obj.get("parent_chat_id", -1)
                    if type(chat) not in (int, str):
                        raise TraceError(f"expected an integer or a string, got {_show(chat)}", field="chat_id")
                    if pchat != -1 and pchat is not None:
                        if type(pchat) not in (int, str):
                            raise TraceError(
                                f"expected an integer or a string, got {_show(pchat)}", field="parent_chat_id"
                            )
                        # A parent the file does not hold (an excerpt of a longer trace): a first turn.
                        parent = chats.get(pchat, "")
                    th = obj.get("think_time")
                    if th is not None:
                        if type(th) not in (int, float) or not 0 <= th <= _MAX_SECONDS:
                            raise TraceError(f"expected seconds >= 0, got {_show(th)}", field="think_time")
                        think = float(th)
                    chats[chat] = rid = f"{stem}-{lineno}"
            except TraceError as e:
                located = TraceError(e.detail, path=p, line=lineno, field=e.field)
                if on_error is None:
                    raise located from None
                on_error(located)
                continue
            if t0 is None:
                t0 = ts
            prev_ts, prev_line = ts, lineno
            rid = rid or f"{stem}-{lineno}"
            yield TraceRequest(rid, (ts - t0) * scale / 1000.0, inp, out, tuple(ids), "", parent, think)


def load_mooncake(path: str | Path) -> Trace:
    """Load a whole Mooncake JSONL trace (see `iter_mooncake`)."""
    return Trace(list(iter_mooncake(path)), source=str(path), block_tokens=MOONCAKE_BLOCK_TOKENS)


def _ms(seconds: float) -> int | float:
    # Microsecond resolution is far below any serving effect; whole ms stay ints like the originals.
    ms = round(seconds * 1000.0, 3)
    return int(ms) if ms.is_integer() else ms


def write_mooncake(path: str | Path, trace: Trace) -> None:
    """Write `trace` as Mooncake JSONL (keys in the original order, ms timestamps).

    The format fixes 512-token blocks, so a trace with another block size is refused rather
    than written with hash ids that would be misread. A trace with sessions writes them as
    `chat_id` (the request id), `parent_chat_id` and `think_time` (see the module).
    """
    if trace.block_tokens != MOONCAKE_BLOCK_TOKENS:
        raise ValueError(
            f"Mooncake traces use {MOONCAKE_BLOCK_TOKENS}-token blocks; this trace has {trace.block_tokens}"
        )
    sessions = any(r.parent_id or r.session_id for r in trace.requests)
    write_mooncake_requests(path, trace.requests, sessions)


def write_mooncake_requests(path: str | Path, requests: Iterable[TraceRequest], sessions: bool = False) -> None:
    """`write_mooncake`'s lines for requests (in arrival order, 512-token blocks) taken as they
    come: a trace too long to hold is written without holding it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8", newline="\n") as f:
        for r in requests:
            rec: dict[str, object] = {
                "timestamp": _ms(r.timestamp),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.hash_ids),
            }
            if sessions:
                rec["chat_id"] = r.request_id
                rec["parent_chat_id"] = r.parent_id or -1
                if math.isfinite(r.think_s):
                    rec["think_time"] = round(r.think_s, 6)
            f.write(json.dumps(rec))
            f.write("\n")
