"""The reports' PNG plots: TTFT CDF, per-turn TTFT, queues and KV egress.

Plots use matplotlib's object API on Agg canvases, so no display and no global pyplot state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from testbed.core.schema.scaling import Scale
from testbed.metrics.artefacts.summary_file import Sessions
from testbed.metrics.fault_effects import FaultWindow, draw_fault_bands
from testbed.metrics.plot_style import line_styles, stamp
from testbed.metrics.report_format import fmt
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.summary import BYTE_COUNTERS
from testbed.metrics.timeseries import counter_rate, group_series, select

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

QUEUE_METRICS: tuple[str, ...] = ("queue_depth", "running_batch")


def _figure(**kw: Any) -> Figure:
    """A figure on an Agg canvas; matplotlib is imported here, when a plot is drawn (the tables of
    this module need none of its 0.5 s of imports)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never pick an interactive backend, even if pyplot is imported later
    from matplotlib.figure import Figure

    return Figure(**kw)


def _save(fig: Figure, path: Path, title: str = "") -> Path:
    stamp(fig, title)
    fig.savefig(path, dpi=110)
    return path


def _no_data(ax: Axes, msg: str) -> None:
    ax.text(0.5, 0.5, msg, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_ttft_cdf(
    curves: Sequence[tuple[str, Sequence[float]]], path: Path, slo_s: float | None = None, title: str = ""
) -> Path:
    """Empirical CDFs of TTFT (paper seconds), one line per (label, values)."""
    fig = _figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for label, values in curves:
        if not values:
            label += " (no completed requests)"
            ax.plot([], [], label=label)
            continue
        x = np.sort(np.asarray(values, dtype=np.float64))
        y = np.arange(1, x.size + 1) / x.size
        ax.step(np.concatenate([[x[0]], x]), np.concatenate([[0.0], y]), where="post", label=label)
        drawn = True
    if slo_s is not None:
        ax.axvline(slo_s, color="gray", linestyle="--", linewidth=1, label=f"TTFT SLO ({fmt(slo_s)} s)")
    if not drawn:
        _no_data(ax, "no completed requests")
    ax.set_xlabel("TTFT (paper seconds)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path, title)


def plot_turns(s: Sessions, path: Path, title: str = "") -> Path:
    """TTFT (mean, P90) and the cached share of the prompt by turn index."""
    fig = _figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    turns = [t.turn for t in s.by_turn]
    nan = float("nan")  # a turn with no completed request: a gap in the line
    ax.plot(turns, [nan if t.ttft_mean_s is None else t.ttft_mean_s for t in s.by_turn], marker="o", label="TTFT mean")
    ax.plot(
        turns, [nan if t.ttft_p90_s is None else t.ttft_p90_s for t in s.by_turn], marker="^", ls="--", label="TTFT P90"
    )
    ax.set_xlabel(f"turn index (the last point: turn {turns[-1]} and later)" if turns else "turn index")
    ax.set_ylabel("TTFT (paper seconds)")
    ax.grid(alpha=0.3)
    hit = ax.twinx()
    shares = [nan if t.cached_token_share is None else 100 * t.cached_token_share for t in s.by_turn]
    hit.plot(turns, shares, color="tab:green", marker="s", label="cached prompt share")
    hit.set_ylabel("prompt tokens from cache (%)")
    hit.set_ylim(0, 100)
    lines = ax.get_legend_handles_labels()
    more = hit.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="center right", fontsize="small")
    if not turns:
        _no_data(ax, "no session turns")
    return _save(fig, path, title)


def _series_panel(ax: Axes, samples: Sequence[SeriesPoint], speedup: float, ylabel: str) -> None:
    groups = group_series(samples)
    for (key, series), (colour, dash) in zip(groups.items(), line_styles(len(groups))):
        ax.plot(
            [p.t * speedup for p in series],
            [p.value for p in series],
            drawstyle="steps-post",
            label=key,
            linewidth=1,
            color=colour,
            linestyle=dash,
        )
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if 0 < len(groups) <= 12:  # beyond a dozen lines a legend hides the plot
        ax.legend(fontsize="x-small", loc="best")


def plot_queues(
    samples: Sequence[SeriesPoint], speedup: float, path: Path, bands: Sequence[FaultWindow] = (), title: str = ""
) -> Path | None:
    """Queue depth and running batch over time per node; None when no such series exist."""
    present = [m for m in QUEUE_METRICS if select(samples, metric=m)]
    if not present:
        return None
    fig = _figure(figsize=(8, 2.6 * len(present) + 0.6), layout="constrained")
    axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    for ax, m in zip(axes, present):
        _series_panel(ax, select(samples, metric=m), speedup, m)
    axes[-1].set_xlabel("time since run start (paper seconds)")
    draw_fault_bands(axes, bands)
    return _save(fig, path, title)


def plot_links(
    samples: Sequence[SeriesPoint],
    scale: Scale,
    path: Path,
    wan_series: frozenset[str] = frozenset(),
    bands: Sequence[FaultWindow] = (),
    title: str = "",
) -> Path | None:
    """KV egress rate of each byte counter (paper Gbit/s), and the routing threshold if recorded.

    Series named in `wan_series` (series keys) are drawn solid and tagged WAN, the rest dashed.
    """
    counters = [s for s in samples if s.metric in BYTE_COUNTERS]
    if not counters:
        return None
    thresholds = select(samples, metric="threshold")
    n = 2 if thresholds else 1
    fig = _figure(figsize=(8, 2.8 * n + 0.6), layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    groups = group_series(counters)
    for (key, series), (colour, _) in zip(groups.items(), line_styles(len(groups))):
        t, r = counter_rate(series)
        if not t.size:
            continue
        # Each rate holds over the interval ending at its stamp: draw it as a step back to the previous one.
        x = np.concatenate([[series[0].t], t]) * scale.speedup
        y = np.concatenate([r[:1], r]) * scale.byte_scale / scale.speedup * 8 / 1e9
        wan = key in wan_series
        axes[0].plot(
            x,
            y,
            drawstyle="steps-pre",
            label=f"{key} (WAN)" if wan else key,
            linewidth=1,
            linestyle="-" if wan else "--",
            color=colour,
        )
    axes[0].set_ylabel("egress (paper Gbit/s)")
    axes[0].grid(alpha=0.3)
    if len(groups) <= 12:
        axes[0].legend(fontsize="x-small", loc="best")
    if thresholds:
        _series_panel(axes[1], thresholds, scale.speedup, "threshold (tokens)")
    axes[-1].set_xlabel("time since run start (paper seconds)")
    draw_fault_bands(axes, bands)
    return _save(fig, path, title)
