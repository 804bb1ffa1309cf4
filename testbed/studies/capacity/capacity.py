"""`testbed capacity`: Lambda_max by emulation (or by simulation, `--backend sim`).

Replays the scenario's workload at a sequence of offered rates (bisection between a stable and
an unstable rate) and reports the largest rate at which the run is stable and the SLOs hold:
- every request completes;
- decode SLO: P90 TPOT within the scenario's TPOT SLO (40 tokens/s in the paper);
- TTFT SLO: P90 TTFT within the stated TTFT SLO;
- stable: waiting does not grow over the run. A request's wait is its TTFT minus its modelled
  prefill time; if the mean wait of the last third of arrivals exceeds the first third's by more
  than `growth_limit` (a fraction of the TTFT SLO), some stage is past its capacity.
Each probe is a full run directory; the probe table and the analytical figures go to
`capacity.json` and `capacity.md`.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.config.resolved import ResolvedScenario
from testbed.core.record import RequestRecord
from testbed.core.schema.scenario import Scenario
from testbed.core.sessions import ROOT, ArrivalMode
from testbed.deploy.registry import is_simulated
from testbed.metrics.markdown_table import table_lines
from testbed.metrics.run_files import read_run_records
from testbed.metrics.stats import percentile
from testbed.traces.types import Trace

if TYPE_CHECKING:
    from testbed.model.analytical import Workload

SLO_SLACK = 1.01  # the testbed's own timing error (see metrics.summary.SLO_TIMING_TOLERANCE)
# The mock decode step does not slow with load, so TPOT moves only with timer lateness (a few
# percent on a busy 2-core machine); decode saturation shows up as growing waits instead.
TPOT_SLACK = 1.05


@dataclass
class Probe:
    rate: float
    run_dir: str
    stable: bool
    reasons: list[str]
    completed: int
    total: int
    ttft_mean_s: float | None
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    wait_first_s: float | None
    wait_last_s: float | None
    throughput_rps: float | None


@dataclass
class CapacityResult:
    scenario: str
    lambda_max: float | None  # largest stable rate probed (paper req/s)
    lowest_unstable: float | None
    model_lambda_max: float | None
    ttft_slo_s: float
    tpot_slo_s: float
    probes: list[Probe] = field(default_factory=list)
    arrivals: str = "open"  # how the probes sent the workload (the scenario's workload.arrivals)
    sessions: int = 0  # sessions of two or more turns the probes' workload holds (as the replay finds them)


def arrivals_line(arrivals: str, sessions: int) -> str:
    """What capacity.md (and the command's first line) say of the arrival mode assumed."""
    if not sessions:
        return f"Arrivals: **{arrivals}**; the workload has no sessions, so every request leaves at its timestamp."
    if arrivals == "closed":
        return (
            f"Arrivals: **closed**: each follow-up turn of the {sessions:,} sessions leaves only after the answer it "
            "follows (plus its think time), so a slower deployment is offered its turns later."
        )
    return (
        f"Arrivals: **open**: every request at its timestamp, follow-ups of the {sessions:,} sessions "
        "included, whether or not their parent has been answered."
    )


def count_sessions(trace: Trace | None, arrivals: ArrivalMode) -> int:
    """Sessions of two or more turns in `trace` as a replay in `arrivals` mode finds them."""
    from testbed.traces.sessions import run_sessions

    plan = None if trace is None else run_sessions(trace, arrivals)
    return 0 if plan is None else len({plan.session[i] for i, p in enumerate(plan.parent) if p != ROOT})


def judge(
    records: list[RequestRecord],
    speedup: float,
    ttft_slo: float,
    tpot_slo: float,
    growth_limit: float,
    growth_s: float | None = None,
) -> tuple[bool, list[str], dict[str, float | None]]:
    """Stable and within SLOs? Figures in paper seconds. Waiting may grow by `growth_s` paper
    seconds (default `growth_limit` x the TTFT SLO) from the first to the last third."""
    done = [r for r in records if r.outcome == "completed"]
    reasons: list[str] = []
    if len(done) < len(records):
        reasons.append(f"{len(records) - len(done)} of {len(records)} requests failed")
    ttft = [r.ttft * speedup for r in done]
    tpot = [r.tpot * speedup for r in done if not math.isnan(r.tpot)]
    p90_ttft, p90_tpot = percentile(ttft, 90), percentile(tpot, 90)
    if p90_tpot is not None and p90_tpot > tpot_slo * TPOT_SLACK:
        reasons.append(f"P90 TPOT {p90_tpot * 1e3:.1f} ms > SLO {tpot_slo * 1e3:.1f} ms")
    if p90_ttft is not None and p90_ttft > ttft_slo * SLO_SLACK:
        reasons.append(f"P90 TTFT {p90_ttft:.2f} s > SLO {ttft_slo:.2f} s")
    by_arrival = sorted(done, key=lambda r: r.times.arrival)
    third = len(by_arrival) // 3
    first = last = None
    if third >= 5:

        def wait(r: RequestRecord) -> float:
            return (r.ttft - r.prefill_modelled) * speedup

        first = statistics.fmean(wait(r) for r in by_arrival[:third])
        last = statistics.fmean(wait(r) for r in by_arrival[-third:])
        if last - first > (growth_s if growth_s is not None else growth_limit * ttft_slo):
            reasons.append(f"waiting grows: {first:.2f} s -> {last:.2f} s from the first to the last third")
    figures = {
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p90_s": p90_ttft,
        "tpot_p90_s": p90_tpot,
        "wait_first_s": first,
        "wait_last_s": last,
    }
    return not reasons, reasons, figures


def workload_at(rs: ResolvedScenario, rate: float, trace: Trace | None = None) -> tuple[ResolvedScenario, Trace]:
    """The scenario and its workload at `rate` paper req/s: the scenario's synthetic workload, or
    `trace` (testbed capacity --trace) with its arrivals rescaled to that rate."""
    from testbed.run.run_args import at_rate
    from testbed.traces.loader import trace_from_workload

    rs_r = rs.at_rate(rate)
    return rs_r, trace_from_workload(rs_r.spec.workload) if trace is None else at_rate(trace, rate)


INVALID_RERUNS = 2


async def _probe(
    rs: ResolvedScenario,
    rate: float,
    out: Path,
    backend: str,
    growth_limit: float,
    ttft_slo: float,
    growth_s: float | None = None,
    trace: Trace | None = None,
) -> Probe:
    from testbed.run.runner import run_replay_async

    sc = rs.spec
    rs_r, tr = workload_at(rs, rate, trace)
    # A probe whose run the testbed marked invalid (its timing not faithful: a busy host) says
    # nothing about the deployment: it is run again, up to INVALID_RERUNS times, and if it stays
    # invalid it is judged as measured with the reason beside its verdict.
    for attempt in range(INVALID_RERUNS + 1):
        run_dir = out / (f"rate-{rate:.3f}" + (f"-rerun{attempt}" if attempt else ""))
        # A simulated probe takes a fraction of a second; its report's plots would take seconds
        # more (its summary.json is written, and `testbed report` renders the rest on demand).
        res = await run_replay_async(
            rs_r, tr, run_dir, backend, name=f"{sc.name} @ {rate:.3f} req/s", report=not is_simulated(backend)
        )
        if res.interrupted or res.summary.valid:
            break
    recs = read_run_records(run_dir)
    ok, reasons, fig = judge(recs, sc.scale.speedup, ttft_slo, sc.slo.tpot_s, growth_limit, growth_s)
    if not res.summary.valid and res.summary.validity is not None:
        reasons = reasons + [f"run invalid after {attempt + 1} tries: {'; '.join(res.summary.validity.reasons)}"]
    if res.interrupted:
        ok, reasons = False, reasons + ["interrupted"]
    thr = res.summary.throughput.completed_rps_paper
    return Probe(
        rate,
        str(run_dir),
        ok,
        reasons,
        sum(r.outcome == "completed" for r in recs),
        len(recs),
        fig["ttft_mean_s"],
        fig["ttft_p90_s"],
        fig["tpot_p90_s"],
        fig["wait_first_s"],
        fig["wait_last_s"],
        thr,
    )


def trace_workload(sc: Scenario, trace: Trace | None) -> Workload | None:
    """The analytical model's workload for `trace` (its lengths and reuse, as `testbed model --trace`
    and `testbed plan` read it), or None for the scenario's own synthetic one."""
    if trace is None:
        return None
    from testbed.core.engine.kvsize import KVModel
    from testbed.model.workload import TraceWorkload

    return TraceWorkload.from_trace(trace, KVModel.from_spec(sc.model)).model_workload()


def model_lambda(sc: Scenario, link_bps: float = 100e9, trace: Trace | None = None) -> float | None:
    """The model's Lambda_max on the scenario's synthetic workload, or on `trace`'s when given."""
    from testbed.model.analytical import evaluate
    from testbed.model.model_command import resolve_threshold

    try:
        t = resolve_threshold(sc, link_bps) if sc.policy.name == "prfaas" else None
        return float(evaluate(sc, link_bps=link_bps, threshold=t, workload=trace_workload(sc, trace)).lambda_max)
    except (ValueError, ZeroDivisionError):
        return None


async def search(
    rs: ResolvedScenario,
    out: Path,
    backend: str,
    lo: float,
    hi: float,
    probes: int,
    growth_limit: float,
    ttft_slo: float,
    verbose: bool = True,
    growth_s: float | None = None,
    trace: Trace | None = None,
) -> CapacityResult:
    """Bisection: `lo` should be stable and `hi` unstable; each is checked, and widened (halved or
    doubled) if it is not, before the interval is halved `probes` times in all. Each probe
    replays the scenario's workload, or `trace`, at its rate."""
    sc = rs.spec
    res = CapacityResult(sc.name, None, None, model_lambda(sc, rs.inter_dc.rate, trace), ttft_slo, sc.slo.tpot_s)
    res.arrivals = sc.workload.arrivals
    res.sessions = count_sessions(trace, sc.workload.arrivals)

    async def run(rate: float) -> bool:
        if verbose:
            from testbed.run.run_progress import StepTicker

            with StepTicker(f"  probe {len(res.probes) + 1} of {probes}: {sc.name} at {rate:.3f} req/s"):
                p = await _probe(rs, rate, out, backend, growth_limit, ttft_slo, growth_s, trace)
        else:
            p = await _probe(rs, rate, out, backend, growth_limit, ttft_slo, growth_s, trace)
        res.probes.append(p)
        if verbose:
            print(
                f"  {rate:.3f} req/s: {'stable' if p.stable else 'UNSTABLE'}"
                + (f" ({'; '.join(p.reasons)})" if p.reasons else ""),
                file=sys.stderr,
                flush=True,
            )
        return p.stable

    used = 1
    lo_ok = await run(lo)
    while not lo_ok and used < probes:
        hi, lo = lo, lo / 2
        lo_ok = await run(lo)
        used += 1
    hi_ok = True
    if used < probes:
        hi_ok = await run(hi)
        used += 1
    while hi_ok and used < probes:
        lo, hi = hi, hi * 2
        hi_ok = await run(hi)
        used += 1
    while used < probes:
        mid = (lo + hi) / 2
        if await run(mid):
            lo = mid
        else:
            hi = mid
        used += 1
    stable = [p.rate for p in res.probes if p.stable]
    unstable = [p.rate for p in res.probes if not p.stable]
    res.lambda_max = max(stable) if stable else None
    res.lowest_unstable = min(unstable) if unstable else None
    return res


def write_outputs(res: CapacityResult, out: Path) -> None:
    (out / "capacity.json").write_text(json.dumps(asdict(res), indent=1))
    lines = [
        f"# Capacity of {res.scenario}",
        "",
        f"Measured Lambda_max: **{_f(res.lambda_max)} req/s** (largest stable probe; lowest unstable "
        f"{_f(res.lowest_unstable)}). Analytical model: {_f(res.model_lambda_max)} req/s.",
        "",
        f"Stable means: every request completed, P90 TPOT <= {res.tpot_slo_s * 1e3:.1f} ms, P90 TTFT <= "
        f"{res.ttft_slo_s:g} s, and waiting did not grow from the first to the last third of arrivals.",
        "",
        arrivals_line(res.arrivals, res.sessions),
        "",
    ]
    lines += table_lines(
        [
            "rate (req/s)",
            "verdict",
            "completed",
            "TTFT mean / P90 (s)",
            "TPOT P90 (ms)",
            "wait first -> last third (s)",
            "why",
        ],
        [
            [
                f"{p.rate:.3f}",
                "stable" if p.stable else "unstable",
                f"{p.completed}/{p.total}",
                f"{_f(p.ttft_mean_s)} / {_f(p.ttft_p90_s)}",
                _f(None if p.tpot_p90_s is None else p.tpot_p90_s * 1e3),
                f"{_f(p.wait_first_s)} -> {_f(p.wait_last_s)}",
                "; ".join(p.reasons),
            ]
            for p in sorted(res.probes, key=lambda p: p.rate)
        ],
    )
    (out / "capacity.md").write_text("\n".join(lines) + "\n")


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"
