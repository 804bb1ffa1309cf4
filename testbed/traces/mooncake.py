"""Mooncake (FAST'25) JSONL traces.

One JSON object per line: `timestamp` (ms, int or float), `input_length`, `output_length`
(tokens) and `hash_ids` (one id per 512-token block of the prompt; equal id = equal prefix
block). Blank lines are skipped; other keys are ignored so newer releases still load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from testbed.traces.types import Trace, TraceError, TraceRequest

MOONCAKE_BLOCK_TOKENS = 512
_NONNEG_INT = "expected a non-negative integer"


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def iter_mooncake(path: str | Path) -> Iterator[TraceRequest]:
    """Stream requests from a Mooncake JSONL file, validating each line as it is read.

    Timestamps are rebased so the first request is at 0 s. Request ids are
    `"{file stem}-{line number}"` (1-based physical line, blank lines counted).
    """
    p = Path(path)
    stem = p.stem
    try:
        f = p.open("rb")
    except OSError as e:
        raise TraceError(f"cannot open: {e.strerror or e}", path=p) from None
    with f:
        t0: int | float | None = None
        prev_ts: int | float = 0
        prev_line = 0
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                # bytes in: json detects the encoding, and a bad byte fails on this line only.
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise TraceError(f"invalid JSON ({e.msg} at column {e.colno})", path=p, line=lineno) from None
            except UnicodeDecodeError as e:
                raise TraceError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=p, line=lineno) from None
            if type(obj) is not dict:
                raise TraceError(f"expected a JSON object, got {_show(obj)}", path=p, line=lineno)
            try:
                ts = obj["timestamp"]
                inp = obj["input_length"]
                out = obj["output_length"]
                ids = obj["hash_ids"]
            except KeyError as e:
                raise TraceError("missing", path=p, line=lineno, field=str(e.args[0])) from None

            # `type(x) is int` rather than isinstance: JSON true/false must not pass as 1/0.
            tt = type(ts)
            if not ((tt is int or (tt is float and math.isfinite(ts))) and ts >= 0):
                raise TraceError(
                    f"expected a non-negative number of milliseconds, got {_show(ts)}",
                    path=p, line=lineno, field="timestamp",
                )
            if t0 is None:
                t0 = ts
            elif ts < prev_ts:
                raise TraceError(
                    f"goes backwards: {_show(ts)} ms after {_show(prev_ts)} ms on line {prev_line}",
                    path=p, line=lineno, field="timestamp",
                )
            prev_ts, prev_line = ts, lineno
            if type(inp) is not int or inp < 0:
                raise TraceError(f"{_NONNEG_INT}, got {_show(inp)}", path=p, line=lineno, field="input_length")
            if type(out) is not int or out < 0:
                raise TraceError(f"{_NONNEG_INT}, got {_show(out)}", path=p, line=lineno, field="output_length")
            if type(ids) is not list:
                raise TraceError(
                    f"expected a list of non-negative integers, got {_show(ids)}",
                    path=p, line=lineno, field="hash_ids",
                )
            for k, h in enumerate(ids):
                if type(h) is not int or h < 0:
                    raise TraceError(
                        f"element {k}: {_NONNEG_INT}, got {_show(h)}", path=p, line=lineno, field="hash_ids"
                    )
            yield TraceRequest(f"{stem}-{lineno}", (ts - t0) / 1000.0, inp, out, tuple(ids))


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
    than written with hash ids that would be misread.
    """
    if trace.block_tokens != MOONCAKE_BLOCK_TOKENS:
        raise ValueError(
            f"Mooncake traces use {MOONCAKE_BLOCK_TOKENS}-token blocks; this trace has {trace.block_tokens}"
        )
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8", newline="\n") as f:
        for r in trace.requests:
            rec = {
                "timestamp": _ms(r.timestamp),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(rec))
            f.write("\n")
