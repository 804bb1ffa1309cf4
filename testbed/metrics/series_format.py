"""The time-series line format: `timeseries/*.jsonl` and `decisions.jsonl`, one JSON object a line,

    {"ts": unix_time, "source": str, "metric": str, "value": number, "labels": {str: str}}

written by the nodes, the router, the link monitors and the delay line, read by the metrics.
A `Sample` is what a source writes (the writer adds the time and its own name); a
`SeriesPoint` is a line read back, its time `t` relative to a chosen origin (a run's `t0`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple, TextIO

log = logging.getLogger("testbed.metrics")


class Sample(NamedTuple):
    metric: str
    value: float
    labels: dict[str, str]


@dataclass
class SeriesPoint:
    """One line read back: seconds since the chosen origin, the source (node or link), metric name, value."""

    t: float
    source: str
    metric: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


class TimeseriesError(ValueError):
    """A malformed time-series line (other than an interrupted run's truncated last line) or file."""


def encode_line(ts: float, source: str, s: Sample) -> str:
    """One line, without its newline; `ts` in unix seconds (kept to the microsecond)."""
    return json.dumps({"ts": round(ts, 6), "source": source, "metric": s.metric, "value": s.value, "labels": s.labels})


def parse_line(line: str, t0: float = 0.0) -> SeriesPoint:
    """The point one line holds, its time relative to `t0`; ValueError saying what is wrong."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    ts = _number(obj, "ts")
    value = math.nan if obj.get("value") is None else _number(obj, "value")
    source, metric = obj.get("source"), obj.get("metric")
    if not isinstance(source, str) or not source:
        raise ValueError("'source' must be a non-empty string")
    if not isinstance(metric, str) or not metric:
        raise ValueError("'metric' must be a non-empty string")
    labels = obj.get("labels") or {}
    if not isinstance(labels, dict):
        raise ValueError("'labels' must be an object")
    return SeriesPoint(ts - t0, source, metric, value, {str(k): str(v) for k, v in labels.items()})


def _number(obj: dict[str, Any], key: str) -> float:
    v = obj.get(key)
    # bool is an int subclass; a boolean timestamp or value is a writer bug, not a number.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key!r} must be a number, got {v!r}")
    return float(v)


def read_series(path: Path, t0: float = 0.0) -> list[SeriesPoint]:
    """Every point of one file, in file order. A last line that does not parse is dropped with a
    warning (a writer killed mid-line); any other malformed line raises `TimeseriesError`
    naming file:line."""
    # errors="replace": truncation can split a multi-byte character of the last line.
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    out: list[SeriesPoint] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(parse_line(line, t0))
        except ValueError as e:
            if i == last:
                log.warning("%s:%d: dropping unparsable last line (interrupted run?): %s", path, i + 1, e)
                continue
            raise TimeseriesError(f"{path}:{i + 1}: {e}") from None
    return out


class SeriesWriter:
    """Appends one source's samples to a file (none: discards them), a flush per batch so an
    interrupted run keeps what it sampled. Thread-safe: link monitors write from a thread of
    their own."""

    def __init__(self, path: Path | None, source: str) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a")

    def write(self, samples: Iterable[Sample], ts: float | None = None) -> None:
        """Write `samples` stamped `ts` (default: now, wall clock like every other stamp)."""
        if self._fh is None:
            return
        t = time.time() if ts is None else ts
        text = "".join(encode_line(t, self.source, s) + "\n" for s in samples)
        with self._lock:
            if self._fh is not None:
                self._fh.write(text)
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


RawSample = tuple[str, float, dict[str, str]]   # a Sample as a plain tuple, as hot loops build them


class BatchSeriesFile:
    """A writer for hot loops that emit many samples at known times (the simulator): the same
    lines as `encode_line`, label sets encoded once, one write per batch; times in paper
    seconds, written as wire seconds since the run's start."""

    __slots__ = ("source", "_fh", "_head", "speedup", "lines", "_labels")

    def __init__(self, path: Path, source: str, speedup: float, repeated_labels: bool = True) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.source = source
        self._fh: IO[str] = path.open("w")
        self._head = f', "source": {json.dumps(source)}, "metric": '
        self.speedup = speedup
        self.lines = 0
        # Samples repeat the same few label sets: encode each once (not for one-off labels).
        self._labels: dict[tuple[tuple[str, str], ...], str] | None = {} if repeated_labels else None

    def write(self, t_paper: float, samples: Iterable[RawSample]) -> None:
        self._write(f'{{"ts": {t_paper / self.speedup:.6f}{self._head}', samples)

    def source_write(self, t_paper: float, source: str, samples: Iterable[RawSample]) -> None:
        """Samples of another source into this file (a file may hold many sources)."""
        self._write(f'{{"ts": {t_paper / self.speedup:.6f}, "source": {json.dumps(source)}, "metric": ', samples)

    def _write(self, ts: str, samples: Iterable[RawSample]) -> None:
        out = []
        cache = self._labels
        for metric, value, labels in samples:
            if not labels:
                lab = "{}"
            elif cache is None:
                lab = json.dumps(labels)
            else:
                key = tuple(labels.items())
                known = cache.get(key)
                if known is None:
                    known = cache[key] = json.dumps(labels)
                lab = known
            out.append(f'{ts}"{metric}", "value": {float(value)!r}, "labels": {lab}}}\n')
        self._fh.write("".join(out))
        self.lines += len(out)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
