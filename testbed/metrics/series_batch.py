"""`BatchSeriesFile`: the time-series writer of the simulator's hot loops, compiled where built
(`testbed.compiled`): the lines of `testbed.metrics.series_format`'s format (`encode_line`'s, each
value written as the float it is taken as). A held batch's lines are made by the compiled twin
(`testbed_native.series_lines`) where built, and its points kept here."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from testbed.core import native
from testbed.metrics.series_format import RawSample, SeriesPoint, encode_labels

_INF = float("inf")
_NO_LABELS: dict[str, str] = {}  # shared by every point without labels (nothing writes to them)


class BatchSeriesFile:
    """A writer for hot loops that emit many samples at known times (the simulator): the same
    lines as `encode_line`, label sets encoded once, one write per batch; times in paper
    seconds, written as wire seconds since the run's start. With `keep`, the points are also
    kept in `points` as `read_series` would read them back (times since the start), for a
    summary of the run that need not read its own files again, but for those of the metrics in
    `unheld`, which are only counted (`unheld_counts`, lines by metric). With `deferred`, samples are
    held as given and the lines written (and points kept) in batches of `BATCH` and at `close`:
    the loop pays only for holding them, and a run killed outright loses only its last batch."""

    BATCH = 2048

    __slots__ = (
        "source",
        "_fh",
        "_head",
        "speedup",
        "lines",
        "_labels",
        "points",
        "_unheld",
        "unheld_counts",
        "_sources",
        "_later",
        "write_s",
    )

    def __init__(
        self,
        path: Path,
        source: str,
        speedup: float,
        repeated_labels: bool = True,
        keep: bool = False,
        deferred: bool = False,
        unheld: frozenset[str] = frozenset(),
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
        self._unheld = unheld
        self.unheld_counts: dict[str, int] = {}
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
        unheld = self._unheld
        counts = self.unheld_counts
        t6 = round(t, 6)  # what the line's "ts" reads back as
        for metric, value, labels in samples:
            v = float(value)
            vs = repr(v) if -_INF < v < _INF else "null"  # JSON has no inf/nan: null reads back as nan
            held = point
            if held is not None and metric in unheld:
                counts[metric] = counts.get(metric, 0) + 1
                held = None
            if not labels:
                line(f'{ts}"{metric}", "value": {vs}, "labels": {{}}}}\n')
                if held is not None:
                    # Points without labels share one empty mapping (nothing writes to a point's labels).
                    held(SeriesPoint(t6, source, metric, v, _NO_LABELS))
                continue
            if cache is None:
                line(f'{ts}"{metric}", "value": {vs}, "labels": {encode_labels(labels)}}}\n')
                if held is not None:
                    held(SeriesPoint(t6, source, metric, v, {str(k): str(x) for k, x in labels.items()}))
                continue
            key = tuple(labels.items())
            known = cache.get(key)
            if known is None:
                # The points of a label set share its mapping, as they share the empty one.
                known = cache[key] = (encode_labels(labels), {str(k): str(x) for k, x in labels.items()})
            line(f'{ts}"{metric}", "value": {vs}, "labels": {known[0]}}}\n')
            if held is not None:
                held(SeriesPoint(t6, source, metric, v, known[1]))

    def _hold(self, t_paper: float, source: str | None, samples: Iterable[RawSample]) -> None:
        """Keeps the points of samples whose lines were made elsewhere (`_write` keeps its own)."""
        keep = self.points
        if keep is None:
            return
        src = self.source if source is None else source
        t6 = round(t_paper / self.speedup, 6)
        unheld = self._unheld
        counts = self.unheld_counts
        for metric, value, labels in samples:
            if metric in unheld:
                counts[metric] = counts.get(metric, 0) + 1
            else:
                keep.append(SeriesPoint(t6, src, metric, float(value), self._mapping(labels)))

    def _mapping(self, labels: dict[str, str]) -> dict[str, str]:
        """A point's labels, shared by the points of the same label set as `_write` shares them."""
        if not labels:
            return _NO_LABELS
        cache = self._labels
        if cache is None:
            return {str(k): str(x) for k, x in labels.items()}
        key = tuple(labels.items())
        known = cache.get(key)
        if known is None:
            known = cache[key] = (encode_labels(labels), {str(k): str(x) for k, x in labels.items()})
        return known[1]

    def _drain(self) -> None:
        t = time.perf_counter()
        if self._later:
            ext = native.module()
            done = None if ext is None else ext.series_lines(self._later, self.speedup, self._head)
            if done is None:
                # One write per batch: the samples of an instant are often a line or two.
                out: list[str] = []
                for t_paper, source, samples in self._later:
                    self._emit(out, t_paper, source, samples)
                self._fh.write("".join(out))
                self.lines += len(out)
            else:
                text, n = done
                self._fh.write(text)
                self.lines += n
                if self.points is not None:
                    for t_paper, source, samples in self._later:
                        self._hold(t_paper, source, samples)
        self._fh.flush()
        if self._later is not None:
            self._later = []
        self.write_s += time.perf_counter() - t

    def close(self) -> None:
        if self._fh.closed:
            return
        self._drain()
        self._fh.close()
