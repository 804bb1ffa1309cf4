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
from typing import IO, NamedTuple, TextIO

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


_NO_LABELS: dict[str, str] = {}


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


class BatchSeriesFile:
    """A writer for hot loops that emit many samples at known times (the simulator): the same
    lines as `encode_line`, label sets encoded once, one write per batch; times in paper
    seconds, written as wire seconds since the run's start. With `keep`, the points are also
    kept in `points` as `read_series` would read them back (times since the start), for a
    summary of the run that need not read its own files again. With `deferred`, samples are
    held as given and the lines written (and points kept) in batches of `BATCH` and at `close`:
    the loop pays only for holding them, and a run killed outright loses only its last batch."""

    BATCH = 2048

    __slots__ = ("source", "_fh", "_head", "speedup", "lines", "_labels", "points", "_sources", "_later", "write_s")

    def __init__(
        self,
        path: Path,
        source: str,
        speedup: float,
        repeated_labels: bool = True,
        keep: bool = False,
        deferred: bool = False,
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.source = source
        self._fh: IO[str] = path.open("w")
        self._head = f', "source": {json.dumps(source)}, "metric": '
        self.speedup = speedup
        self.lines = 0
        # Samples repeat the same few label sets: encode each once (not for one-off labels).
        self._labels: dict[tuple[tuple[str, str], ...], tuple[str, dict[str, str]]] | None = (
            {} if repeated_labels else None
        )
        self.points: list[SeriesPoint] | None = [] if keep else None
        self._sources: dict[str, str] = {}  # each source's name, JSON-encoded once
        self._later: list[tuple[float, str | None, Iterable[RawSample]]] | None = [] if deferred else None
        self.write_s = 0.0  # seconds spent writing held batches (the simulator tells its engine's time apart)

    def write(self, t_paper: float, samples: Iterable[RawSample]) -> None:
        self._take(t_paper, None, samples)

    def source_write(self, t_paper: float, source: str, samples: Iterable[RawSample]) -> None:
        """Samples of another source into this file (a file may hold many sources)."""
        self._take(t_paper, source, samples)

    def _take(self, t_paper: float, source: str | None, samples: Iterable[RawSample]) -> None:
        if self._later is None:
            out: list[str] = []
            self._emit(out, t_paper, source, samples)
            self._fh.write("".join(out))
            self.lines += len(out)
            return
        self._later.append((t_paper, source, samples))
        if len(self._later) >= self.BATCH:
            self._drain()

    def _emit(self, out: list[str], t_paper: float, source: str | None, samples: Iterable[RawSample]) -> None:
        t = t_paper / self.speedup
        if source is None:
            self._write(out, f'{{"ts": {t:.6f}{self._head}', samples, t, self.source)
            return
        name = self._sources.get(source)
        if name is None:
            name = self._sources[source] = json.dumps(source)
        self._write(out, f'{{"ts": {t:.6f}, "source": {name}, "metric": ', samples, t, source)

    def _write(self, out: list[str], ts: str, samples: Iterable[RawSample], t: float, source: str) -> None:
        """Appends the samples' lines to `out` (and keeps their points)."""
        line = out.append
        cache = self._labels
        keep = self.points
        point = keep.append if keep is not None else None
        t6 = round(t, 6)  # what the line's "ts" reads back as
        for metric, value, labels in samples:
            v = float(value)
            vs = repr(v) if -_INF < v < _INF else "null"  # JSON has no inf/nan: null reads back as nan
            if not labels:
                line(f'{ts}"{metric}", "value": {vs}, "labels": {{}}}}\n')
                if point is not None:
                    # Points without labels share one empty mapping (nothing writes to a point's labels).
                    point(SeriesPoint(t6, source, metric, v, _NO_LABELS))
                continue
            if cache is None:
                line(f'{ts}"{metric}", "value": {vs}, "labels": {encode_labels(labels)}}}\n')
                if point is not None:
                    point(SeriesPoint(t6, source, metric, v, {str(k): str(x) for k, x in labels.items()}))
                continue
            key = tuple(labels.items())
            known = cache.get(key)
            if known is None:
                # The points of a label set share its mapping, as they share the empty one.
                known = cache[key] = (encode_labels(labels), {str(k): str(x) for k, x in labels.items()})
            line(f'{ts}"{metric}", "value": {vs}, "labels": {known[0]}}}\n')
            if point is not None:
                point(SeriesPoint(t6, source, metric, v, known[1]))

    def _drain(self) -> None:
        t = time.perf_counter()
        if self._later:
            # One write per batch: the samples of an instant are often a line or two.
            out: list[str] = []
            for t_paper, source, samples in self._later:
                self._emit(out, t_paper, source, samples)
            self._fh.write("".join(out))
            self.lines += len(out)
        self._fh.flush()
        if self._later is not None:
            self._later = []
        self.write_s += time.perf_counter() - t

    def close(self) -> None:
        if self._fh.closed:
            return
        self._drain()
        self._fh.close()
