"""WAN link usage from the interface counters the link monitor sampled (source `wan`).

Utilisation is measured bytes over the configured rate in force (schedules change it), in
windows of 100 ms of wire time; the mean is over the whole run. The records give the same
traffic from the other side (offloaded requests x their KV bytes), which the summary sets
beside the counters as a check of both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from testbed.core.record import RequestRecord
from testbed.core.schema.scaling import Scale
from testbed.metrics.artefacts.summary_file import WanLink
from testbed.metrics.fault_effects import FaultWindow, draw_fault_bands
from testbed.metrics.plot_style import stamp
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.timeseries import counter_total, group_series, select

WINDOW_S = 0.1


def _rate_in_force(changes: Sequence[SeriesPoint], t: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Configured rate (bit/s) at each time t, from the `link_rate_bps_wire` change samples."""
    ts = np.array([c.t for c in changes])
    vs = np.array([c.value for c in changes])
    idx = np.clip(np.searchsorted(ts, t, side="right") - 1, 0, len(vs) - 1)
    return vs[idx]


def window_rates(
    series: Sequence[SeriesPoint], window: float = WINDOW_S
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Rates (bit/s) of a cumulative byte counter over consecutive windows of at least `window`
    seconds, each from the samples' own timestamps (a late sample widens its window instead of
    folding two windows' bytes into one). Returns (window end times, rates)."""
    ts = np.array([x.t for x in series])
    vs = np.array([x.value for x in series])
    ends, rates = [], []
    i = 0
    while True:
        j = int(np.searchsorted(ts, ts[i] + window - 1e-9, side="left"))
        if j >= len(ts):
            break
        ends.append(ts[j])
        rates.append(max(vs[j] - vs[i], 0.0) * 8 / (ts[j] - ts[i]))
        i = j
    return np.array(ends), np.array(rates)


def _counter_at(series: Sequence[SeriesPoint], t: float) -> float:
    """A cumulative counter's value at time t (held from the last sample at or before t)."""
    ts = np.array([x.t for x in series])
    i = int(np.searchsorted(ts, t, side="right")) - 1
    return series[max(i, 0)].value


def link_usage(
    samples: Sequence[SeriesPoint], records: Sequence[RequestRecord], scale: Scale, duration_wire: float | None
) -> dict[str, object]:
    """Per-link usage. `mean_*` is over the arrival window (first to last request sent): the
    run's steady state, which is what a deployment sizing compares with; `run_mean_*` also
    counts the ramp-up and the drain after the last arrival."""
    arrivals = [a for r in records if math.isfinite(a := r.times.arrival)]
    window = (min(arrivals), max(arrivals)) if len(arrivals) > 1 else None
    offloaded = [r for r in records if r.outcome == "completed" and r.crossed_wan]
    rec_bytes = float(sum(r.kv_bytes_wire for r in offloaded))
    return link_usage_of(samples, window, len(offloaded), rec_bytes, scale, duration_wire)


def link_usage_of(
    samples: Sequence[SeriesPoint],
    window: tuple[float, float] | None,
    offloaded: int,
    rec_bytes: float,
    scale: Scale,
    duration_wire: float | None,
) -> dict[str, object]:
    """`link_usage` from what it reads of the records: the arrival window (first and last finite
    arrival, None with fewer than two), the completed offloaded requests and their KV bytes (wire)."""
    wan = select(samples, source="wan")
    rates = {k: v for k, v in group_series(x for x in wan if x.metric == "link_rate_bps_wire").items()}
    by_link: dict[str, dict[str, float | None]] = {}
    for series in group_series(x for x in wan if x.metric == "link_bytes").values():
        link = series[0].labels.get("link", "?")
        total = counter_total(series)
        changes = next((v for k, v in rates.items() if v and v[0].labels.get("link") == link), [])
        entry: dict[str, float | None] = {"bytes_wire": total, "bytes_paper": scale.paper_bytes(total)}
        run_Bps = total / duration_wire if duration_wire else None
        entry["run_mean_bps_wire"] = None if run_Bps is None else run_Bps * 8
        entry["run_mean_bps_paper"] = None if run_Bps is None else scale.paper_rate_bps(run_Bps * 8)
        mean_Bps = run_Bps
        if window is not None and window[1] > window[0]:
            mean_Bps = (_counter_at(series, window[1]) - _counter_at(series, window[0])) / (window[1] - window[0])
        entry["mean_bps_wire"] = None if mean_Bps is None else mean_Bps * 8
        entry["mean_bps_paper"] = None if mean_Bps is None else scale.paper_rate_bps(mean_Bps * 8)
        if len(series) > 1:
            t_end, win_bps = window_rates(series)
            peak = float(win_bps.max()) if win_bps.size else None
            entry["peak_bps_wire"] = peak
            entry["peak_bps_paper"] = None if peak is None else scale.paper_rate_bps(peak)
            if changes and win_bps.size:
                cfg = _rate_in_force(changes, t_end)
                util = win_bps / cfg
                inside = (t_end > window[0]) & (t_end <= window[1]) if window else np.ones_like(util, bool)
                entry["configured_bps_wire"] = float(changes[0].value)
                entry["configured_bps_paper"] = scale.paper_rate_bps(float(changes[0].value))
                entry["mean_utilisation"] = float(util[inside].mean()) if inside.any() else float(util.mean())
                entry["run_mean_utilisation"] = float(util.mean())
                entry["peak_utilisation"] = float(util.max())
        by_link[link] = entry
    if not by_link:
        return {"links": {}}
    # The KV direction carries the most bytes; report it as the headline.
    main = max(by_link, key=lambda k: by_link[k]["bytes_wire"] or 0.0)
    m = by_link[main]
    m_bytes = m["bytes_wire"] or 0.0
    # The same traffic from the records: offloaded requests per second x mean KV bytes per
    # offloaded request, over the arrival window the mean usage above covers.
    rec_bps: float | None = None
    if window is not None and window[1] > window[0] and offloaded:
        per_s = offloaded / (window[1] - window[0])
        rec_bps = scale.paper_rate_bps(per_s * rec_bytes / offloaded * 8)
    return {
        "link": main,
        "records_bps_paper": rec_bps,
        "mean_bps_paper": m.get("mean_bps_paper"),
        "peak_bps_paper": m.get("peak_bps_paper"),
        "mean_bps_wire": m.get("mean_bps_wire"),
        "run_mean_bps_paper": m.get("run_mean_bps_paper"),
        "window_s_paper": None if window is None else (window[1] - window[0]) * scale.speedup,
        "configured_bps_paper": m.get("configured_bps_paper"),
        "mean_utilisation": m.get("mean_utilisation"),
        "peak_utilisation": m.get("peak_utilisation"),
        "bytes_per_offloaded_request_paper": scale.paper_bytes(m_bytes) / offloaded if offloaded else None,
        "records_kv_bytes_wire": rec_bytes,
        "counters_over_records": m_bytes / rec_bytes if rec_bytes else None,
        "links": by_link,
    }


def plot_wan(
    samples: Sequence[SeriesPoint], scale: Scale, path: Path, bands: Sequence[FaultWindow] = (), title: str = ""
) -> Path | None:
    """Each WAN link's measured rate (100 ms windows, paper Gbit/s) with the configured rate in
    force drawn under it."""
    from matplotlib.figure import Figure

    wan = select(samples, source="wan")
    byte_series = group_series(x for x in wan if x.metric == "link_bytes")
    if not byte_series:
        return None
    rates = group_series(x for x in wan if x.metric == "link_rate_bps_wire")
    fig = Figure(figsize=(8, 3.4), layout="constrained")
    ax = fig.subplots()
    for series in byte_series.values():
        link = series[0].labels.get("link", "?")
        if len(series) < 2:
            continue
        t_end, bps = window_rates(series)
        if not t_end.size:
            continue
        line = ax.plot(
            t_end * scale.speedup,
            [scale.paper_rate_bps(b) / 1e9 for b in bps],
            drawstyle="steps-pre",
            linewidth=0.9,
            label=f"{link} measured",
        )[0]
        changes = next((v for v in rates.values() if v and v[0].labels.get("link") == link), [])
        if changes:
            xs = [c.t * scale.speedup for c in changes] + [t_end[-1] * scale.speedup]
            ys = [scale.paper_rate_bps(c.value) / 1e9 for c in changes]
            ax.step(xs, ys + ys[-1:], where="post", linestyle="--", color=line.get_color(), label=f"{link} configured")
    ax.set_xlabel("time since run start (paper seconds)")
    ax.set_ylabel("WAN rate (paper Gbit/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="best")
    draw_fault_bands([ax], bands)
    stamp(fig, title)
    fig.savefig(path, dpi=110)
    return path


def wan_rows(w: WanLink) -> list[tuple[str, str]]:
    """Report rows for the headline WAN link (empty when no link was shaped)."""
    if not w.link:
        return []

    def gbps(x: float | None) -> str:
        return "n/a" if x is None else f"{x / 1e9:.3g} Gbit/s"

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    per_req = w.bytes_per_offloaded_request_paper
    ratio = w.counters_over_records
    return [
        ("Link (KV direction)", w.link),
        ("Configured rate", gbps(w.configured_bps_paper)),
        ("Mean usage, arrival window (interface counters)", gbps(w.mean_bps_paper)),
        ("Mean usage, whole run incl. drain", gbps(w.run_mean_bps_paper)),
        ("Peak usage (100 ms windows)", gbps(w.peak_bps_paper)),
        ("Mean / peak utilisation", f"{pct(w.mean_utilisation)} / {pct(w.peak_utilisation)}"),
        ("Bytes per offloaded request (counters)", "n/a" if per_req is None else f"{per_req / 1e6:.4g} MB"),
        ("Offloaded req/s x KV per offloaded request (records)", gbps(w.records_bps_paper)),
        ("Counters / KV bytes in records", "n/a" if ratio is None else f"{ratio:.4f}"),
    ]
