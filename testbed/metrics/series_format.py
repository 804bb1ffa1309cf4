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
from json.encoder import encode_basestring_ascii as _text  # what json.dumps quotes text with
from operator import attrgetter
from pathlib import Path
from typing import NamedTuple, TextIO

from testbed.core.errors import UserError
from testbed.core.finite_json import dumps as finite_dumps
from testbed.core.json_types import JSONObject

log = logging.getLogger("testbed.metrics")


class Sample(NamedTuple):
    metric: str
    value: float
    labels: dict[str, str]


@dataclass(slots=True)
class SeriesPoint:
    """One line read back: seconds since the chosen origin, the source (node or link), metric name, value."""

    t: float
    source: str
    metric: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


# A point's time, the sort key of every series (a C getter: a run's points are sorted by it whole).
by_time = attrgetter("t")


_INF = math.inf


class TimeseriesError(UserError, ValueError):
    """A malformed time-series line (other than an interrupted run's truncated last line) or file."""


def encode_line(ts: float, source: str, s: Sample) -> str:
    """One line, without its newline; `ts` in unix seconds (kept to the microsecond)."""
    return finite_dumps(
        {"ts": round(ts, 6), "source": source, "metric": s.metric, "value": s.value, "labels": s.labels}
    )


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


def _number(obj: JSONObject, key: str) -> float:
    v = obj.get(key)
    # bool is an int subclass; a boolean timestamp or value is a writer bug, not a number.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key!r} must be a number, got {v!r}")
    return float(v)


def read_series(path: Path, t0: float = 0.0, metric: str | None = None) -> list[SeriesPoint]:
    """Every point of one file (with `metric`, only that metric's), in file order. A last line
    that does not parse is dropped with a warning (a writer killed mid-line); any other malformed
    line raises `TimeseriesError` naming file:line."""
    # errors="replace": truncation can split a multi-byte character of the last line.
    text = path.read_text(encoding="utf-8", errors="replace")
    # A line of the metric holds its name as a JSON string: the others are skipped unparsed
    # (a run's decisions.jsonl is mostly one routing decision per request), all of them at once
    # when no line names it (a run without threshold changes, say).
    token = None if metric is None else json.dumps(metric)
    if token is not None and token not in text:
        return []
    lines = text.splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    out: list[SeriesPoint] = []
    for i, line in enumerate(lines):
        if not line.strip() or (token is not None and token not in line):
            continue
        try:
            point = parse_line(line, t0)
            if metric is None or point.metric == metric:
                out.append(point)
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


def encode_labels(labels: dict[str, str]) -> str:
    """`json.dumps(labels)`, at half its cost for the usual all-text labels (a decision line per
    request carries a fresh set)."""
    parts = []
    for k, v in labels.items():
        if type(k) is not str or type(v) is not str:
            return json.dumps(labels)
        parts.append(_text(k) + ": " + _text(v))
    return "{" + ", ".join(parts) + "}"


RawSample = tuple[str, float, dict[str, str]]  # a Sample as a plain tuple, as hot loops build them
