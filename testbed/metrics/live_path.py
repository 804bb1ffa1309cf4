"""What the live path cost the requests of an emulated run (`testbed.core.schema.live_path`), read from
its records and its decode nodes' time series: the figures `testbed bench live-path` measures
on a host and the simulator adds (`sim.live_path`).

Per completed request (wire seconds), the mean over the run and 21 quantiles of each:
- routing: the client sent it -> the router decided;
- dispatch: the router decided -> the prefill node queued it (asking the decode node first),
  over the requests prefilled in the router's datacenter (a remote one adds the WAN's delay,
  which the simulator models);
- relay: the decode node produced a token -> the client had it (the first and the last token).
Decode loop stalls: each decode node's `decode_step_late_s` counter grows only when its loop
fell a whole step behind and lost that time; every growth between two samples is a stall (one
or a few close together), its size the time lost. Their rate is per wire second the instance
spent decoding (`decode_step_modelled_s`).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import NotRequired, TypedDict

from testbed.core.record import RequestRecord
from testbed.core.schema.live_path import quantiles
from testbed.metrics.run_files import read_run_records
from testbed.metrics.timeseries import group_series, load_timeseries, select


def _ok(xs: list[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x) and x >= 0]


def _stalls(run_dir: Path) -> tuple[int, float, float]:
    """(stalls, wire seconds lost, wire seconds spent decoding) over every decode node."""
    pts = load_timeseries(run_dir)
    late = group_series(select(pts, metric="decode_step_late_s"))
    busy = group_series(select(pts, metric="decode_step_modelled_s"))
    n, lost, decoding = 0, 0.0, 0.0
    for series in late.values():
        for a, b in zip(series, series[1:]):
            d = b.value - a.value
            if d > 0:
                n += 1
                lost += d
    for series in busy.values():
        if len(series) > 1:
            decoding += max(series[-1].value - series[0].value, 0.0)
    return n, lost, decoding


class LivePathRun(TypedDict):
    """One run's part of the figures: what they rest on (wire units)."""

    run: str
    requests: int
    stalls: int
    lost_s: float
    decoding_s: float
    samples: NotRequired[dict[str, list[float]]]  # per cost, every request's; dropped once pooled


class LivePathFigures(TypedDict):
    """`LivePathCosts` fields (mean wire seconds, their quantiles) and the runs they come from."""

    routing_s: float
    dispatch_s: float
    relay_s: float
    relay_last_s: float
    stall_rate_per_s: float
    stall_s: float
    quantiles: dict[str, list[float]]
    runs: list[LivePathRun]


def live_path_figures(run_dir: Path, records: list[RequestRecord] | None = None) -> LivePathFigures:
    """The figures of one run (`LivePathCosts` fields, plus how many requests and stalls they
    rest on)."""
    recs = records if records is not None else read_run_records(run_dir)
    done = [r for r in recs if r.outcome == "completed"]
    t = [r.times for r in done]
    local = [r.times for r in done if not r.crossed_wan] or t
    costs = {
        "routing_s": _ok([x.routed - x.arrival for x in t]),
        "dispatch_s": _ok([x.prefill_queued - x.routed for x in local]),
        "relay_s": _ok([x.first_token - x.decode_first_token for x in t]),
        "relay_last_s": _ok([x.last_token - x.decode_last_token for x in t]),
    }
    n, lost, decoding = _stalls(run_dir)
    mean = {k: statistics.fmean(v) if v else 0.0 for k, v in costs.items()}
    return {
        "routing_s": mean["routing_s"],
        "dispatch_s": mean["dispatch_s"],
        "relay_s": mean["relay_s"],
        "relay_last_s": mean["relay_last_s"],
        "stall_rate_per_s": n / decoding if decoding > 0 else 0.0,
        "stall_s": lost / n if n else 0.0,
        "quantiles": {k: list(quantiles(v)) for k, v in costs.items() if len(v) > 1},  # one run's
        "runs": [
            {
                "run": str(run_dir),
                "requests": len(done),
                "stalls": n,
                "lost_s": lost,
                "decoding_s": decoding,
                "samples": {k: v for k, v in costs.items()},
            }
        ],
    }
