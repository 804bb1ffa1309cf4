"""`testbed plan` by simulation: replay candidate deployments on the trace with the simulator
backend, judge the SLOs on what it measured, and rank by it.

The hook is `Simulate(scenario_path, trace_path, run_name) -> figures` (keys of SIM_FIGURES);
`sim_simulator` makes one from the runner's `sim` backend. `simulate_rows` fills a candidate's
`simulated` and puts the simulator's verdict on the SLOs in force (`meets_slo`), the model's
staying in `meets_slo_model`; `refined_key` ranks simulated candidates by their simulated TTFT.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from testbed.core.sessions import ArrivalMode
from testbed.metrics.artefacts.summary_file import Summary
from testbed.model.planner import Candidate, Objective, PlanSettings
from testbed.traces.csvutil import Window

# A replay's figures by SIM_FIGURES name (None: undefined), or {"error": why} when it failed.
SimFigures = dict[str, float | str | None]
Simulate = Callable[[Path, Path, str], SimFigures]
SIM_FIGURES = (
    "ttft_mean_s",
    "ttft_p90_s",
    "tpot_p90_s",
    "offload_share",
    "egress_gbps",
    "completed_rps",
    "slo_attainment",
    "requests",
    "failed",
)
# As the run summary's SLO attainment (`testbed.metrics.summary.SLO_TIMING_TOLERANCE`): a decode
# step sized to the TPOT SLO sits exactly on it.
SLO_SLACK = 1.01
NOT_VERIFIED = "not verified by simulation"


class SimUnavailable(Exception):
    """The runner has no simulator backend: the plans stay unverified."""


def figures(summary: Summary) -> SimFigures:
    """The SIM_FIGURES of a run summary (`testbed.metrics.summary`)."""
    dur = summary.run.duration_s_paper
    wan = summary.bytes.wan_total_paper
    return {
        "ttft_mean_s": summary.ttft_s.mean,
        "ttft_p90_s": summary.ttft_s.p90,
        "tpot_p90_s": summary.tpot_s.p90,
        "offload_share": summary.offload.ratio,
        "egress_gbps": None if not dur else wan * 8.0 / dur / 1e9,
        "completed_rps": summary.throughput.completed_rps_paper,
        "slo_attainment": summary.throughput.slo_attainment,
        "requests": summary.requests.total,
        "failed": summary.requests.failed + summary.requests.pending,
    }


def sim_simulator(out_dir: Path, window: Window | None, fmt: str, arrivals: ArrivalMode | None = None) -> Simulate:
    """A Simulate replaying on `runner.run_replay_async(..., backend="sim", report=False)` into
    `out_dir/sim/<run_name>` (`testbed report RUN` renders a report later), in `arrivals` mode
    (None: each scenario's own `workload.arrivals`); the trace is read once. Raises
    SimUnavailable while the runner knows no `sim` backend."""
    import shutil

    from testbed.run import runner
    from testbed.run.load import load
    from testbed.traces.loader import load_trace
    from testbed.traces.types import Trace

    traces: dict[Path, Trace] = {}

    def simulate(scenario_path: Path, trace_path: Path, run_name: str) -> SimFigures:
        rs = load(scenario_path)
        if arrivals is not None and rs.spec.workload.arrivals != arrivals:
            wl = rs.spec.workload.model_copy(update={"arrivals": arrivals})
            rs = rs.model_copy(update={"spec": rs.spec.model_copy(update={"workload": wl})})
        if trace_path not in traces:
            traces[trace_path] = load_trace(trace_path, fmt, window=window)
        run_dir = out_dir / "sim" / run_name
        try:
            res = asyncio.run(runner.run_replay_async(rs, traces[trace_path], run_dir, backend="sim", report=False))
        except ValueError as e:
            if "unknown backend" not in str(e):
                raise
            shutil.rmtree(run_dir, ignore_errors=True)  # it holds only the scenario it was given
            if run_dir.parent.is_dir() and not any(run_dir.parent.iterdir()):
                run_dir.parent.rmdir()
            raise SimUnavailable(str(e)) from None
        return figures(res.summary)

    return simulate


def _ok(x: float | str | None, limit: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x <= limit * SLO_SLACK


def sim_verdict(figs: SimFigures, s: PlanSettings) -> tuple[bool, str | None]:
    """Whether a simulated replay meets the SLOs (every request completed, P90 TTFT and P90 TPOT
    within them), and why not."""
    if "error" in figs:
        return False, f"simulation failed: {figs['error']}"
    if figs.get("failed"):
        return False, f"{figs['failed']} of {figs.get('requests')} requests failed or never finished in simulation"
    p90 = figs.get("ttft_p90_s")
    if not _ok(p90, s.ttft_slo_s):
        got = "none" if p90 is None else f"{p90:.2f} s"
        return False, f"simulated P{s.quantile * 100:.0f} TTFT {got} over the SLO {s.ttft_slo_s:g} s"
    tpot = figs.get("tpot_p90_s")
    if isinstance(tpot, (int, float)) and not _ok(tpot, s.tpot_slo_s):
        return False, f"simulated P90 TPOT {tpot * 1e3:.1f} ms over the SLO {s.tpot_slo_s * 1e3:g} ms"
    return True, None


def with_simulation(c: Candidate, figs: SimFigures, s: PlanSettings) -> Candidate:
    """`c` with its simulated figures, the simulator's verdict in force and why it fails."""
    ok, why = sim_verdict(figs, s)
    notes = c.notes if why is None else (*c.notes, why)
    return replace(c, simulated=figs, meets_slo=ok, notes=notes)


def simulate_rows(
    rows: Sequence[tuple[Candidate, Path, str]], trace: Path, simulate: Simulate | None, s: PlanSettings
) -> tuple[dict[str, Candidate], str | None]:
    """Simulate each (candidate, scenario file, run name); returns the candidates by run name with
    their figures (a failed simulation is {"error": ...}: reported, not fatal) and why nothing
    was simulated (None when it was): no simulator, or it raised SimUnavailable."""
    if simulate is None:
        return {}, f"{NOT_VERIFIED} (--no-sim)"
    out: dict[str, Candidate] = {}
    for c, path, name in rows:
        if name in out:
            continue
        try:
            figs = simulate(path, trace, name)
        except SimUnavailable:
            return {}, f"{NOT_VERIFIED} (the runner has no sim backend)"
        except Exception as e:  # a failed simulation is reported, it does not lose the plan
            figs = {"error": f"{type(e).__name__}: {e}"}
        out[name] = with_simulation(c, figs, s)
    return out, None


def refined_key(c: Candidate, objective: Objective) -> tuple[float, ...]:
    """Sort key of a simulated candidate, best first: meeting the SLOs by simulation, then the
    objective with the simulated TTFT in place of the estimate (Lambda_max stays the model's:
    one replay at the trace's rate does not measure it), then fewer instances."""
    sim = c.simulated or {}
    mean = sim.get("ttft_mean_s")
    p90 = sim.get("ttft_p90_s")
    mean = math.inf if mean is None or "error" in sim else mean
    p90 = math.inf if p90 is None or "error" in sim else p90
    lam = -round(c.lambda_max, 9)
    if objective == "lambda":
        body: tuple[float, ...] = (lam, mean)
    elif objective == "ttft":
        body = (mean, lam)
    else:
        body = (p90, lam)
    return (0.0 if c.meets_slo else 1.0, *body, float(c.instances))
