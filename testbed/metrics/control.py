"""Summary sections, report rows and a plot for the prefix caches and the router's control
loop: what the caches saved, which cache moves crossed the WAN, how the threshold moved and why.

Summary keys (paper units):

- `cache.requests_with_hit`: Completed requests that reused a cached prefix (`cached_tokens` > 0).
- `cache.cached_token_share`: Sum of `cached_tokens` / sum of `input_tokens` over completed requests:
  prefill work the caches saved.
- `cache.decode_cached_token_share`: The same for `decode_cached_tokens`: prompt KV the decode side
  already held, so it was not shipped.
- `cache.moves`, `.move_tokens`, `.move_bytes_paper`: Cross-cluster cache moves of completed requests,
  the tokens and paper bytes they carried.
- `cache.move_wait_s`: Mean wait of a prefill for its moved-in prefix
  (`prefill_start - max(prefill_queued, cache_move_start)` when positive), paper s.
- `control.threshold_changes`: Threshold changes the control loop made (`decisions.jsonl`).
- `control.changes`: The first 50: `t_s` (paper s since t0), `old`, `new`, `reason`.
- `control.threshold_min`, `.threshold_max`, `.threshold_mean`: Over the router's sampled `threshold`
  series; the mean is time-weighted.
- `control.bandwidth_estimate_min_bps`: Lowest estimate of the WAN bandwidth the loop made (paper bit/s).
- `control.abundant_share`: Share of control samples that judged the bandwidth abundant.
- `link_phases`: With a link schedule: one entry per stretch of constant configured rate on the KV
  direction (`start_s`, `end_s` paper s since t0, `rate_bps_paper`) with the requests that arrived in it:
  `requests`, `ttft_mean_s`, `ttft_p90_s`, `tail_mean_s` (offloaded requests), `offload_ratio`. Empty
  without a schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from testbed.core.record import RequestRecord
from testbed.core.schema.scaling import Scale
from testbed.metrics.artefacts import Summary
from testbed.metrics.artefacts.summary_file import LinkPhase
from testbed.metrics.fault_effects import FaultWindow, draw_fault_bands
from testbed.metrics.plot_style import stamp
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.stats import percentile
from testbed.metrics.timeseries import decision_points, select, time_weighted_mean

MAX_CHANGES = 50


def cache_summary(done: Sequence[RequestRecord], scale: Scale) -> dict[str, object]:
    inp = sum(r.input_tokens for r in done)
    moves = [r for r in done if r.cache_move_tokens > 0]
    waits = []
    for t in (r.times for r in moves):
        if math.isfinite(t.prefill_start) and math.isfinite(t.cache_move_start):
            waits.append(max(t.prefill_start - max(t.prefill_queued, t.cache_move_start), 0.0) * scale.speedup)
    return cache_figures(
        CacheSums(
            input_tokens=inp,
            with_hit=sum(1 for r in done if r.cached_tokens > 0),
            cached=sum(r.cached_tokens for r in done),
            decode_cached=sum(r.decode_cached_tokens for r in done),
            moves=len(moves),
            move_tokens=sum(r.cache_move_tokens for r in moves),
            move_bytes_paper=sum(r.cache_move_bytes_paper for r in moves),
        ),
        waits,
    )


@dataclass(frozen=True)
class CacheSums:
    """The completed requests' prompt tokens and prefix-cache counts `cache_summary` reads."""

    input_tokens: int
    with_hit: int
    cached: int
    decode_cached: int
    moves: int
    move_tokens: int
    move_bytes_paper: int


def cache_figures(c: CacheSums, move_waits: Sequence[float] | npt.NDArray[np.float64]) -> dict[str, object]:
    """summary.json's `cache` from the sums and each cache move's wait (paper s)."""
    inp = c.input_tokens
    return {
        "requests_with_hit": c.with_hit,
        "cached_token_share": c.cached / inp if inp else None,
        "decode_cached_token_share": c.decode_cached / inp if inp else None,
        "moves": c.moves,
        "move_tokens": c.move_tokens,
        "move_bytes_paper": float(c.move_bytes_paper),
        "move_wait_s": float(np.mean(move_waits)) if len(move_waits) else None,
    }


def read_changes(run_dir: Path, t0: float | None, speedup: float) -> list[dict[str, object]]:
    """Threshold changes from `decisions.jsonl`, in paper seconds since t0."""
    out = []
    for p in decision_points(run_dir, t0, speedup, "threshold_change"):
        out.append(
            {"t_s": p.t, "old": float(p.labels.get("old", "nan")), "new": p.value, "reason": p.labels.get("reason", "")}
        )
    return out


def control_summary(run_dir: Path, t0: float | None, samples: Sequence[SeriesPoint], scale: Scale) -> dict[str, object]:
    changes = read_changes(run_dir, t0, scale.speedup)
    thr = sorted(select(samples, metric="threshold"), key=lambda p: p.t)
    est = select(samples, metric="wan_bandwidth_estimate_bps_paper")
    abundant = select(samples, metric="bandwidth_abundant")
    return {
        "threshold_changes": len(changes),
        "changes": changes[:MAX_CHANGES],
        "threshold_min": min((p.value for p in thr), default=None),
        "threshold_max": max((p.value for p in thr), default=None),
        "threshold_mean": time_weighted_mean(thr),
        "bandwidth_estimate_min_bps": min((p.value for p in est), default=None),
        "abundant_share": float(np.mean([p.value for p in abundant])) if abundant else None,
    }


def _f(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def cache_rows(s: Summary) -> list[tuple[str, str]]:
    c = s.cache
    if c is None or (not c.requests_with_hit and not c.moves and not c.decode_cached_token_share):
        return []
    share = c.cached_token_share
    dshare = c.decode_cached_token_share
    rows = [
        ("Requests reusing a cached prefix", f"{c.requests_with_hit:,} of {s.requests.completed:,}"),
        ("Prompt tokens served from cache (prefill)", _f(None if share is None else share * 100, "{:.1f}%")),
        ("Prompt KV the decode side already held", _f(None if dshare is None else dshare * 100, "{:.1f}%")),
        ("Cross-cluster cache moves", f"{c.moves:,} ({c.move_tokens:,} tokens, {c.move_bytes_paper / 1e9:.3g} GB)"),
    ]
    if c.move_wait_s is not None:
        rows.append(("Mean prefill wait for a moved prefix", f"{c.move_wait_s:.3f} s"))
    per = s.bytes.wan_per_request_paper
    rows.append(("WAN bytes per request (KV + moves)", _f(None if per is None else per / 1e6, "{:,.1f} MB")))
    return rows


def control_rows(s: Summary) -> list[tuple[str, str]]:
    c = s.control
    if c is None or c.threshold_mean is None and not c.abundant_share:
        return []
    est = c.bandwidth_estimate_min_bps
    ab = c.abundant_share
    return [
        ("Threshold changes", f"{c.threshold_changes:,}"),
        (
            "Threshold min / time-weighted mean / max (tokens)",
            f"{_f(c.threshold_min)} / {_f(c.threshold_mean)} / {_f(c.threshold_max)}",
        ),
        ("Lowest WAN bandwidth estimate", _f(None if est is None else est / 1e9, "{:.3g} Gbit/s")),
        ("Control samples judging bandwidth abundant", _f(None if ab is None else ab * 100, "{:.0f}%")),
    ]


def change_rows(s: Summary, limit: int = 20) -> list[tuple[str, str, str, str]]:
    # `old` is null where the decision did not say (NaN before JSON), printed as before.
    return [
        (f"{c.t_s:.1f}", f"{math.nan if c.old is None else c.old:,.0f}", f"{c.new:,.0f}", c.reason)
        for c in (s.control.changes if s.control else [])[:limit]
    ]


def plot_control(
    samples: Sequence[SeriesPoint], scale: Scale, path: Path, bands: Sequence[FaultWindow] = (), title: str = ""
) -> Path | None:
    """Threshold over time; WAN delivered rate and the loop's bandwidth estimate; predicted loads."""
    thr = sorted(select(samples, metric="threshold"), key=lambda p: p.t)
    est = sorted(select(samples, metric="wan_bandwidth_estimate_bps_paper"), key=lambda p: p.t)
    if not est:
        return None
    dlv = sorted(select(samples, metric="wan_delivered_bps_paper"), key=lambda p: p.t)
    loads = select(samples, metric="planned_load")
    from matplotlib.figure import Figure  # here: the summary needs no plotting library

    fig = Figure(figsize=(8, 7.2), layout="constrained")
    ax = fig.subplots(3, 1, sharex=True)
    s = scale.speedup
    if thr:
        ax[0].plot([p.t * s for p in thr], [p.value for p in thr], drawstyle="steps-post", linewidth=1.2)
    ax[0].set_ylabel("threshold t (tokens)")
    ax[1].plot([p.t * s for p in dlv], [p.value / 1e9 for p in dlv], linewidth=0.8, label="delivered (PrfaaS egress)")
    ax[1].plot(
        [p.t * s for p in est],
        [p.value / 1e9 for p in est],
        drawstyle="steps-post",
        linewidth=1.2,
        label="bandwidth estimate",
    )
    cfg = _kv_link_rates(samples)
    if cfg:
        end = max(p.t for p in est)
        ax[1].plot(
            [p.t * s for p in cfg] + [end * s],
            [scale.paper_rate_bps(p.value) / 1e9 for p in cfg] + [scale.paper_rate_bps(cfg[-1].value) / 1e9],
            drawstyle="steps-post",
            linewidth=0.9,
            linestyle="--",
            color="gray",
            label="configured rate (the emulator's, unseen by the router)",
        )
    ax[1].set_ylabel("WAN (paper Gbit/s)")
    ax[1].legend(fontsize="x-small")
    for stage in ("link", "prfaas", "pdp"):
        pts = sorted((p for p in loads if p.labels.get("stage") == stage), key=lambda p: p.t)
        ax[2].plot([p.t * s for p in pts], [p.value for p in pts], linewidth=0.9, label=stage)
    ax[2].set_ylabel("predicted load")
    ax[2].set_ylim(0, 2)
    ax[2].legend(fontsize="x-small")
    ax[2].set_xlabel("time since run start (paper seconds)")
    for a in ax:
        a.grid(alpha=0.3)
    draw_fault_bands(ax, bands)
    stamp(fig, title)
    fig.savefig(path, dpi=110)
    return path


def _kv_link_rates(samples: Sequence[SeriesPoint]) -> list[SeriesPoint]:
    """Configured-rate samples (wire bit/s) of the link whose rate changed most: the KV
    direction (both directions change together in the shipped profiles)."""
    by_link: dict[str, list[SeriesPoint]] = {}
    for p in select(samples, "link_rate_bps_wire", source="wan"):
        if p.t >= -1.0:
            by_link.setdefault(p.labels.get("link", ""), []).append(p)
    longest: list[SeriesPoint] = max(by_link.values(), key=lambda v: len(v), default=[])
    return sorted(longest, key=lambda p: p.t)


def link_phases(
    done: Sequence[RequestRecord], samples: Sequence[SeriesPoint], scale: Scale
) -> list[dict[str, float | None]]:
    """TTFT and transfer tails by stretch of constant configured link rate (a link schedule)."""
    if len(_kv_link_rates(samples)) < 2:
        return []

    def col(get: Callable[[RequestRecord], float]) -> npt.NDArray[np.float64]:
        return np.fromiter(map(get, done), np.float64, len(done))

    crossed = np.fromiter((r.crossed_wan for r in done), np.bool_, len(done))
    tail = col(lambda r: r.times.transfer_end - r.times.prefill_end)
    return link_phases_of(col(lambda r: r.times.arrival), col(lambda r: r.ttft), crossed, tail, samples, scale)


def link_phases_of(
    arrival: npt.NDArray[np.float64],
    ttft: npt.NDArray[np.float64],
    crossed: npt.NDArray[np.bool_],
    tail: npt.NDArray[np.float64],
    samples: Sequence[SeriesPoint],
    scale: Scale,
) -> list[dict[str, float | None]]:
    """`link_phases` from the completed requests' arrivals, TTFTs, offload flags and transfer
    tails (wire s; one entry a request, in record order)."""
    changes = _kv_link_rates(samples)
    if len(changes) < 2:
        return []
    s = scale.speedup
    out: list[dict[str, float | None]] = []
    bounds = [p.t for p in changes[1:]] + [math.inf]
    timed = np.isfinite(ttft)
    for p, end in zip(changes, bounds):
        start = p.t if p is not changes[0] else -math.inf
        inside = (arrival >= start) & (arrival < end) & timed
        n = int(inside.sum())
        ttft_s = ttft[inside] * s
        t = tail[inside & crossed]
        tails = t[np.isfinite(t)] * s
        out.append(
            {
                "start_s": max(p.t, 0.0) * s,
                "end_s": None if math.isinf(end) else end * s,
                "rate_bps_paper": scale.paper_rate_bps(p.value),
                "requests": n,
                "ttft_mean_s": float(ttft_s.mean()) if n else None,
                "ttft_p90_s": percentile(ttft_s, 90),
                "tail_mean_s": float(np.mean(tails)) if tails.size else None,
                "offload_ratio": int((inside & crossed).sum()) / n if n else None,
            }
        )
    return out


def phase_label(ph: LinkPhase) -> str:
    end = "end" if ph.end_s is None else f"{ph.end_s:.0f} s"
    return f"{ph.start_s:.0f} s-{end} at {ph.rate_bps_paper / 1e9:.3g} Gbit/s"


def phase_rows(s: Summary) -> list[tuple[str, str, str, str, str]]:
    return [
        (
            phase_label(ph),
            f"{ph.requests:,}",
            _f(ph.ttft_mean_s, "{:.2f}") + " / " + _f(ph.ttft_p90_s, "{:.2f}"),
            _f(None if ph.tail_mean_s is None else ph.tail_mean_s * 1e3, "{:,.0f}"),
            _f(None if ph.offload_ratio is None else ph.offload_ratio * 100, "{:.1f}%"),
        )
        for ph in s.link_phases
    ]
