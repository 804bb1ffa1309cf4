"""How faithfully the emulator kept the scenario's time, measured from the run itself, and
whether the run is valid: a figure the testbed could not time faithfully is flagged, never
passed off as a measurement.

Measures (errors are against the service model, so they are the testbed's own, not the
deployment's):
- prefill: measured prefill duration against the modelled one (median relative error);
- decode step: the time decode steps fell behind their modelled schedule and never caught up,
  summed over every decode node, as a share of modelled step time (the nodes' own
  `decode_step_*` counters; this is what stretches TPOT);
- token delivery lag: from the decode node emitting the last token to the client receiving it
  (P90, paper seconds), through the router;
- router overhead: from the router receiving a request to routing it (P90, paper seconds);
- host CPU: share of all cores busy over the run (`cpu_busy` samples of the host sampler);
- fault steps (`faults.jsonl`, when the scenario has faults): the latest any step took effect
  after its schedule (paper seconds), and the steps that failed;
- the WAN delay line (fallback shaping): how late it wrote packets on average, against the
  one-way delay configured, and the share it wrote more than `LINE_LATE_S` late. Reported, not judged:
  a late packet lengthens a window-limited transfer more than a bulk one, and no bound is
  established yet that separates a faithful link from one that is not.

A run is invalid when a timing measure exceeds its bound, or when a fault step failed (the run
did not carry out its scenario); CPU saturation is reported as the likely cause, not judged on
its own (a busy host that keeps time is fine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from testbed.core.record import RequestRecord
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.stats import percentile
from testbed.metrics.timeseries import counter_total, group_series, select

PREFILL_REL_BOUND = 0.03
DECODE_LATE_BOUND = 0.03
TOKEN_LAG_SHARE_OF_TPOT_SLO = 1.0  # P90 lag bound: one decode step at the TPOT SLO
ROUTER_OVERHEAD_SHARE_OF_TTFT_SLO = 0.01  # P90 bound: 1% of the TTFT SLO (100 ms of 10 s)
CPU_SATURATED = 0.95  # busy share counted as saturated
# What the delay line counts as a late packet (`testbed.net.delayline.LATE_S`, a layer above this
# one; a test holds the two equal).
LINE_LATE_S = 1e-3
FAULT_LATE_BOUND_S_PAPER = 1.0  # a fault step's effect after its schedule, paper s
# Link faults take effect when the call that applies them returns (delay line, then kernel).
_LINK_FAULTS = frozenset({"outage", "rate_drop", "partition"})


# The C function itself, not a wrapper: called once or twice per record.
_finite: Callable[[float], bool] = math.isfinite


def _counter_sum(samples: Sequence[SeriesPoint], metric: str) -> float:
    return sum(counter_total(g) for g in group_series(select(samples, metric)).values())


@dataclass(frozen=True)
class TimingErrors:
    """What `fidelity` reads from the records: how many prefills were timed against the model,
    the median of their |measured - modelled| (wire s) and of that over the model (where it is
    above 0), and the P90 of the completed requests' token delivery lag and of the requests'
    router overhead (paper s)."""

    n: int
    abs_err_median: float | None
    rel_err_median: float | None
    lag_p90: float | None
    overhead_p90: float | None


def median(values: Sequence[float] | npt.NDArray[np.float64], mine: bool = False) -> float | None:
    """The median, None of nothing; `mine`: an array the caller gives up (sorted in place, not copied)."""
    if not len(values):
        return None
    return float(np.median(values, overwrite_input=mine and isinstance(values, np.ndarray)))


def timing_errors(records: Sequence[RequestRecord], speedup: float) -> TimingErrors:
    abs_err: list[float] = []
    rel_err: list[float] = []
    lag: list[float] = []  # the completed requests'
    overhead: list[float] = []
    # One pass for the four: each record's stamps are read once.
    for r in records:
        t = r.times
        measured = t.prefill_end - t.prefill_start
        modelled = r.prefill_modelled
        if _finite(measured) and _finite(modelled):
            err = abs(measured - modelled)
            abs_err.append(err)
            if modelled > 0:
                rel_err.append(err / modelled)
        if r.outcome == "completed" and _finite(d := t.last_token - t.decode_last_token):
            lag.append(d * speedup)
        if _finite(d := t.routed - t.router_arrival):
            overhead.append(d * speedup)
    return TimingErrors(len(abs_err), median(abs_err), median(rel_err), percentile(lag, 90), percentile(overhead, 90))


@dataclass(frozen=True)
class FaultTiming:
    """What `fault_timing` reads from a run's fault steps."""

    late_max_s_paper: float | None  # None: no step executed on a schedule
    failed: tuple[str, ...]  # "fault #i (kind phase) failed: ...", one per failed step


def fault_timing(steps: Iterable[Mapping[str, object]], speedup: float) -> FaultTiming:
    """How late the steps of `faults.jsonl` took effect against their schedule (`at_s`), and
    which failed. A step's lateness is its time less its schedule, plus for a link fault the wire
    time the change took to apply. A restart's end is not judged: its time is when the instance
    answered again, not a schedule. Skipped and unsupported steps are the report's, not timing."""
    late: float | None = None
    failed: list[str] = []
    for x in steps:
        outcome, kind, phase = str(x.get("outcome", "")), x.get("kind"), x.get("phase")
        if outcome.startswith("failed"):
            failed.append(f"fault #{x.get('fault')} ({kind} {phase}) {outcome}")
            continue
        if outcome != "ok" or (kind == "restart" and phase == "end"):
            continue
        t, at = x.get("t"), x.get("at_s")
        if not isinstance(t, (int, float)) or not isinstance(at, (int, float)):
            continue
        lag = float(t) - float(at)
        detail = x.get("detail")
        took = detail.get("took_s_wire") if isinstance(detail, Mapping) else None
        if kind in _LINK_FAULTS and isinstance(took, (int, float)):
            lag += float(took) * speedup
        late = lag if late is None else max(late, lag)
    return FaultTiming(late, tuple(failed))


def with_fault_timing(fid: Mapping[str, object], ft: FaultTiming) -> dict[str, object]:
    """`fid` (from `fidelity`) with the fault steps' measures and bound."""
    bounds = fid.get("bounds")
    return {
        **fid,
        "fault_late_max_s_paper": ft.late_max_s_paper,
        "fault_steps_failed": list(ft.failed),
        "bounds": {
            **(bounds if isinstance(bounds, Mapping) else {}),
            "fault_late_max_s_paper": FAULT_LATE_BOUND_S_PAPER,
        },
    }


def delay_line_timing(samples: Sequence[SeriesPoint], one_way_delay_s_wire: float | None) -> dict[str, object]:
    """The delay line's lateness over the run, from its counters in the run's series (`late_s`,
    `late_packets`, `packets_out`, summed over its directions); None where no line wrote."""
    packets = _counter_sum(samples, "packets_out")
    if packets <= 0:
        return {"wan_line_late_mean_s_wire": None, "wan_line_late_share_of_delay": None, "wan_line_late_packets": None}
    mean = _counter_sum(samples, "late_s") / packets
    return {
        "wan_line_late_mean_s_wire": mean,
        "wan_line_late_share_of_delay": mean / one_way_delay_s_wire if one_way_delay_s_wire else None,
        "wan_line_late_packets": _counter_sum(samples, "late_packets") / packets,
    }


def fidelity(
    records: Sequence[RequestRecord] | TimingErrors,
    samples: Sequence[SeriesPoint],
    speedup: float,
    slo_ttft_s: float | None,
    slo_tpot_s: float | None,
) -> dict[str, object]:
    """The fidelity measures of the records (or of their `TimingErrors`, taken already) and the
    run's samples."""
    e = records if isinstance(records, TimingErrors) else timing_errors(records, speedup)
    rel = e.rel_err_median
    modelled = _counter_sum(samples, "decode_step_modelled_s")
    late = _counter_sum(samples, "decode_step_late_s")
    cpu = [s.value for s in select(samples, "cpu_busy")]
    out: dict[str, object] = {
        "n": e.n,
        "prefill_abs_err_median_s": e.abs_err_median,
        "prefill_rel_err_median": rel,
        "decode_step_late_share": late / modelled if modelled > 0 else None,
        "token_lag_p90_s_paper": e.lag_p90,
        "router_overhead_p90_s_paper": e.overhead_p90,
        "cpu_busy_mean": float(np.mean(cpu)) if cpu else None,
        "cpu_saturated_share": float(np.mean([c >= CPU_SATURATED for c in cpu])) if cpu else None,
    }
    out["bounds"] = {
        "prefill_rel_err_median": PREFILL_REL_BOUND,
        "decode_step_late_share": DECODE_LATE_BOUND,
        "token_lag_p90_s_paper": None if slo_tpot_s is None else TOKEN_LAG_SHARE_OF_TPOT_SLO * slo_tpot_s,
        "router_overhead_p90_s_paper": None if slo_ttft_s is None else ROUTER_OVERHEAD_SHARE_OF_TTFT_SLO * slo_ttft_s,
    }
    return out


def validity(fid: Mapping[str, object]) -> dict[str, object]:
    """{valid, reasons}: every timing measure within its bound (unmeasured ones are not judged)."""
    names = {
        "prefill_rel_err_median": "prefill durations off the model by {v:.1%} (median; bound {b:.0%})",
        "decode_step_late_share": "decode steps {v:.1%} late against the model (bound {b:.0%})",
        "token_lag_p90_s_paper": "token delivery lag P90 {v:.3g} s paper (bound {b:.3g} s)",
        "router_overhead_p90_s_paper": "router overhead P90 {v:.3g} s paper (bound {b:.3g} s)",
        "fault_late_max_s_paper": "a fault step took effect {v:.3g} s paper after its schedule (bound {b:.3g} s)",
    }
    reasons = []
    for key, text in names.items():
        bounds = fid["bounds"]
        v, b = fid.get(key), bounds.get(key) if isinstance(bounds, dict) else None
        if isinstance(v, (int, float)) and isinstance(b, (int, float)) and v > b:
            reasons.append(text.format(v=v, b=b))
    failed = fid.get("fault_steps_failed")
    if isinstance(failed, list):
        reasons += [f"{f} (the run did not carry out its scenario's faults)" for f in failed]
    sat = fid.get("cpu_saturated_share")
    if reasons and isinstance(sat, (int, float)) and sat > 0.2:
        reasons.append(
            f"the host's CPUs were saturated {sat:.0%} of the run: emulate fewer instances or at a "
            "lower speedup (--speedup auto finds one)"
        )
    return {"valid": not reasons, "reasons": reasons}
