"""`--speedup auto`: the largest speedup this host emulates the scenario faithfully at.

A short probe of the same workload and backend at each candidate speedup, highest first; the
first whose run is valid (`testbed.metrics.fidelity`: prefill, decode-step, token-lag and
router timing within their bounds) wins. Probes stay in the run directory for inspection.

Below 1 the run is slowed down (time dilation): a deployment too large for this host in real
time, its router's token streams the first to fall behind, gets 2x or 4x the wall time per paper
second, and every measure is still read in paper time.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from testbed.config.resolved import ResolvedScenario
from testbed.run.runner import RunResult, run_replay_async
from testbed.traces import transforms
from testbed.traces.types import Trace

CANDIDATES = (8.0, 4.0, 2.0, 1.0, 0.5, 0.25)
PROBE_PAPER_S = 90.0  # of arrivals: long enough for the decode batches to fill as in the run
MIN_PROBE_REQUESTS = 60


def with_speedup(rs: ResolvedScenario, speedup: float) -> ResolvedScenario:
    sc = rs.spec
    return rs.model_copy(
        update={"spec": sc.model_copy(update={"scale": sc.scale.model_copy(update={"speedup": speedup})})}
    )


def probe_trace(trace: Trace) -> Trace:
    n = max(MIN_PROBE_REQUESTS, round(trace.rate * PROBE_PAPER_S)) if len(trace) > 1 else 1
    return transforms.head(trace, min(n, len(trace)))


Runner = Callable[..., Awaitable[RunResult]]


@dataclass(frozen=True)
class SpeedupProbe:
    """What one probe found at one speedup."""

    speedup: float
    valid: bool
    reasons: list[str]
    tpot_mean_s: float | None


async def pick_speedup(
    rs: ResolvedScenario,
    trace: Trace,
    backend: str,
    probe_dir: Path,
    candidates: tuple[float, ...] = CANDIDATES,
    run: Runner = run_replay_async,
) -> tuple[float, list[SpeedupProbe]]:
    """(speedup, what each probe found). Falls back to the lowest candidate if none is valid."""
    probe = probe_trace(trace)
    tried: list[SpeedupProbe] = []
    for s in sorted(candidates, reverse=True):
        out = probe_dir / f"speedup-{s:g}"
        print(f"--speedup auto: probing {len(probe)} requests at speedup {s:g} -> {out}", file=sys.stderr, flush=True)
        res = await run(with_speedup(rs, s), probe, out, backend, name=f"{rs.name} probe @ {s:g}x")
        # A summary without `validity` (it is always written now) cannot vouch for the speedup.
        valid, reasons = (
            (res.summary.validity.valid, res.summary.validity.reasons)
            if res.summary.validity
            else (False, ["no validity in the summary"])
        )
        tried.append(SpeedupProbe(s, valid, list(reasons), res.summary.tpot_s.mean))
        if valid:
            return s, tried
        print(f"  speedup {s:g}: not faithful: {'; '.join(reasons)}", file=sys.stderr, flush=True)
    return min(candidates), tried
