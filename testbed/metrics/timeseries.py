"""Time series of a run: `timeseries/*.jsonl`, written by nodes, router and link monitors in the
format of `testbed.metrics.series_format`. Loaded points carry `t` in wire seconds since the
run's `t0` (from `run.json`), like the records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from testbed.metrics.run_files import decisions_file, read_series_file
from testbed.metrics.series_format import SeriesPoint, TimeseriesError, by_time, read_series

FloatArray = npt.NDArray[np.float64]


def load_timeseries(run_dir: Path, t0: float | None = None) -> list[SeriesPoint]:
    """All points of a run, sorted by time. No `timeseries/` directory means no points.

    `t0` defaults to `run.json`'s `t0`. A last line that does not parse is dropped with a warning
    (a writer killed mid-line); any other malformed line raises `TimeseriesError` naming file:line.
    """
    d = Path(run_dir) / "timeseries"
    if not d.is_dir():
        return []
    if t0 is None:
        t0 = _run_t0(Path(run_dir))
    out: list[SeriesPoint] = []
    for path in sorted(d.glob("*.jsonl")):
        out.extend(read_series(path, t0))
    out.sort(key=by_time)
    return out


def _run_t0(run_dir: Path) -> float:
    p = run_dir / "run.json"
    try:
        meta = json.loads(p.read_text())
    except FileNotFoundError:
        raise TimeseriesError(f"{p}: missing; needed for t0 (or pass t0=)") from None
    except json.JSONDecodeError as e:
        raise TimeseriesError(f"{p}:{e.lineno}: invalid JSON ({e.msg})") from None
    t0 = meta.get("t0") if isinstance(meta, dict) else None
    if isinstance(t0, bool) or not isinstance(t0, (int, float)):
        raise TimeseriesError(f"{p}: 't0' must be a number, got {t0!r}")
    return float(t0)


class IndexedPoints(list[SeriesPoint]):
    """A run's points with, made at the first question, each metric's and each source's points in
    their order: `select` by metric or source and `metrics_of` then read only those. A summary asks
    a score of questions of a run's points, each otherwise a pass over all of them (a third of
    it). The list must not change once asked."""

    __slots__ = ("_metrics", "_sources")

    def __init__(self, points: Iterable[SeriesPoint] = ()) -> None:
        super().__init__(points)
        self._metrics: dict[str, list[SeriesPoint]] | None = None
        self._sources: dict[str, list[SeriesPoint]] | None = None

    def metrics(self) -> dict[str, list[SeriesPoint]]:
        if self._metrics is None:
            self._index()
        assert self._metrics is not None
        return self._metrics

    def sources(self) -> dict[str, list[SeriesPoint]]:
        if self._sources is None:
            self._index()
        assert self._sources is not None
        return self._sources

    def _index(self) -> None:
        metrics: dict[str, list[SeriesPoint]] = {}
        sources: dict[str, list[SeriesPoint]] = {}
        by_metric, by_source = metrics.get, sources.get
        for s in self:
            m = by_metric(s.metric)
            if m is None:
                metrics[s.metric] = [s]
            else:
                m.append(s)
            o = by_source(s.source)
            if o is None:
                sources[s.source] = [s]
            else:
                o.append(s)
        self._metrics, self._sources = metrics, sources


def select(
    samples: Iterable[SeriesPoint],
    metric: str | None = None,
    source: str | None = None,
    labels: dict[str, str] | None = None,
) -> list[SeriesPoint]:
    """Points matching `metric`, `source` and every given label (None matches anything), in
    their order."""
    if isinstance(samples, IndexedPoints):
        if metric is not None:
            samples = samples.metrics().get(metric, [])
            metric = None
        elif source is not None:
            samples = samples.sources().get(source, [])
            source = None
        if metric is None and source is None and labels is None:
            return list(samples)
    if source is None and labels is None and metric is not None:
        # The usual question (one metric of a whole run's points): one comparison per point.
        return [s for s in samples if s.metric == metric]
    return [
        s
        for s in samples
        if (metric is None or s.metric == metric)
        and (source is None or s.source == source)
        and (labels is None or all(s.labels.get(k) == v for k, v in labels.items()))
    ]


def series_key(s: SeriesPoint) -> str:
    """`source` or `source{k=v,...}`: one line per key in a plot (e.g. one TCP connection)."""
    if not s.labels:
        return s.source
    return s.source + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"


def group_series(samples: Iterable[SeriesPoint]) -> dict[str, list[SeriesPoint]]:
    """Points split by `series_key`, keys sorted, each list in time order."""
    groups: dict[str, list[SeriesPoint]] = {}
    for s in samples:
        groups.setdefault(series_key(s), []).append(s)
    return {k: sorted(groups[k], key=by_time) for k in sorted(groups)}


def metrics_of(samples: Iterable[SeriesPoint]) -> list[str]:
    if isinstance(samples, IndexedPoints):
        return sorted(samples.metrics())
    return sorted({s.metric for s in samples})


def resample(
    samples: Sequence[SeriesPoint],
    step: float,
    *,
    start: float | None = None,
    end: float | None = None,
    how: Literal["last", "mean", "max"] = "last",
) -> tuple[FloatArray, FloatArray]:
    """One series on a regular grid `start, start+step, ... <= end` (defaults: its first/last sample).

    "last" holds the latest value at or before each grid time (gauges); "mean"/"max" aggregate the
    samples in [t, t+step). Grid points without data are NaN.
    """
    if step <= 0:
        raise ValueError(f"step must be > 0, got {step}")
    ordered = sorted(samples, key=by_time)
    if not ordered:
        return np.empty(0), np.empty(0)
    ts = np.array([s.t for s in ordered], dtype=np.float64)
    vs = np.array([s.value for s in ordered], dtype=np.float64)
    lo = ts[0] if start is None else start
    hi = ts[-1] if end is None else end
    if hi < lo:
        return np.empty(0), np.empty(0)
    # The small epsilon keeps `end` on the grid despite float division.
    grid = lo + step * np.arange(int(math.floor((hi - lo) / step + 1e-9)) + 1, dtype=np.float64)
    out = np.full(grid.shape, np.nan)
    if how == "last":
        idx = np.searchsorted(ts, grid, side="right") - 1
        ok = idx >= 0
        out[ok] = vs[idx[ok]]
        return grid, out
    left = np.searchsorted(ts, grid, side="left")
    right = np.searchsorted(ts, grid + step, side="left")
    for i, (a, b) in enumerate(zip(left, right)):
        if b > a:
            out[i] = vs[a:b].mean() if how == "mean" else vs[a:b].max()
    return grid, out


def counter_rate(samples: Sequence[SeriesPoint]) -> tuple[FloatArray, FloatArray]:
    """Per-interval rate of a cumulative counter, stamped at each interval's end.

    Intervals where the counter went down (the writer restarted) are skipped, not negative.
    """
    ordered = sorted(samples, key=by_time)
    ts: list[float] = []
    rates: list[float] = []
    for a, b in zip(ordered, ordered[1:]):
        dt, dv = b.t - a.t, b.value - a.value
        if dt > 0 and dv >= 0:
            ts.append(b.t)
            rates.append(dv / dt)
    return np.array(ts, dtype=np.float64), np.array(rates, dtype=np.float64)


def counter_total(samples: Sequence[SeriesPoint]) -> float:
    """Amount a cumulative counter grew over the samples (restarts skipped, like `counter_rate`)."""
    ordered = sorted(samples, key=by_time)
    # The growths summed in order (a fall or a NaN adds nothing): a generator of max() took a
    # tenth of a short run's summary.
    total = 0.0
    prev = ordered[0].value if ordered else 0.0
    for p in ordered[1:]:
        v = p.value
        if (d := v - prev) > 0:
            total += d
        prev = v
    return total


def time_weighted_mean(series: Sequence[SeriesPoint]) -> float | None:
    """Mean of a step series (each value holds until the next sample), by time held."""
    if len(series) < 2:
        return series[0].value if series else None
    t = np.array([p.t for p in series])
    v = np.array([p.value for p in series])
    dt = np.diff(t)
    return float(np.dot(v[:-1], dt) / dt.sum()) if dt.sum() > 0 else float(v.mean())


def decision_points(run_dir: Path, t0: float | None, speedup: float, metric: str) -> list[SeriesPoint]:
    """The router's `decisions.jsonl` (or decisions.parquet) points of one metric, `t` in paper
    seconds since t0."""
    p = decisions_file(Path(run_dir))
    if not p.is_file() or t0 is None:
        return []
    return [
        SeriesPoint(pt.t * speedup, pt.source, pt.metric, pt.value, pt.labels) for pt in read_series_file(p, t0, metric)
    ]
