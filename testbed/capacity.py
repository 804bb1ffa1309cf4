"""`testbed capacity`: Lambda_max by emulation.

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

import argparse
import asyncio
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from testbed.core.record import RequestRecord
from testbed.core.scenario import Scenario
from testbed.metrics.records import read_records
from testbed.metrics.stats import percentile
from testbed.scenarios import load_scenario, parse_overrides

SLO_SLACK = 1.01        # the testbed's own timing error (see metrics.summary.SLO_TIMING_TOLERANCE)
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
    lambda_max: float | None           # largest stable rate probed (paper req/s)
    lowest_unstable: float | None
    model_lambda_max: float | None
    ttft_slo_s: float
    tpot_slo_s: float
    probes: list[Probe] = field(default_factory=list)


def judge(records: list[RequestRecord], speedup: float, ttft_slo: float, tpot_slo: float,
          growth_limit: float, growth_s: float | None = None) -> tuple[bool, list[str], dict[str, float | None]]:
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
    figures = {"ttft_mean_s": statistics.fmean(ttft) if ttft else None, "ttft_p90_s": p90_ttft,
               "tpot_p90_s": p90_tpot, "wait_first_s": first, "wait_last_s": last}
    return not reasons, reasons, figures


async def _probe(sc: Scenario, rate: float, out: Path, backend: str, growth_limit: float,
                 ttft_slo: float, growth_s: float | None = None) -> Probe:
    from testbed.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    sc_r = sc.model_copy(update={"workload": sc.workload.model_copy(update={"rate": rate})})
    run_dir = out / f"rate-{rate:.3f}"
    res = await run_replay_async(sc_r, trace_from_workload(sc_r.workload), run_dir, backend,
                                 name=f"{sc.name} @ {rate:.3f} req/s")
    recs = read_records(run_dir / "records.csv")
    ok, reasons, fig = judge(recs, sc.scale.speedup, ttft_slo, sc.slo.tpot_s, growth_limit, growth_s)
    if res.interrupted:
        ok, reasons = False, reasons + ["interrupted"]
    thr = res.summary.get("throughput", {}).get("completed_rps_paper")
    return Probe(rate, str(run_dir), ok, reasons, sum(r.outcome == "completed" for r in recs), len(recs),
                 fig["ttft_mean_s"], fig["ttft_p90_s"], fig["tpot_p90_s"], fig["wait_first_s"],
                 fig["wait_last_s"], thr)


def model_lambda(sc: Scenario, link_bps: float = 100e9) -> float | None:
    from testbed.model.analytical import evaluate
    from testbed.model.command import resolve_threshold

    try:
        t = resolve_threshold(sc, link_bps) if sc.policy.name == "prfaas" else None
        return float(evaluate(sc, link_bps=link_bps, threshold=t).lambda_max)
    except (ValueError, ZeroDivisionError):
        return None


async def search(sc: Scenario, out: Path, backend: str, lo: float, hi: float, probes: int,
                 growth_limit: float, ttft_slo: float, verbose: bool = True,
                 growth_s: float | None = None) -> CapacityResult:
    """Bisection: `lo` should be stable and `hi` unstable; each is checked, and widened (halved or
    doubled) if it is not, before the interval is halved `probes` times in all."""
    res = CapacityResult(sc.name, None, None, model_lambda(sc), ttft_slo, sc.slo.tpot_s)

    async def run(rate: float) -> bool:
        p = await _probe(sc, rate, out, backend, growth_limit, ttft_slo, growth_s)
        res.probes.append(p)
        if verbose:
            print(f"  {rate:.3f} req/s: {'stable' if p.stable else 'UNSTABLE'}"
                  + (f" ({'; '.join(p.reasons)})" if p.reasons else ""), file=sys.stderr, flush=True)
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
    lines = [f"# Capacity of {res.scenario}", "",
             f"Measured Lambda_max: **{_f(res.lambda_max)} req/s** (largest stable probe; lowest unstable "
             f"{_f(res.lowest_unstable)}). Analytical model: {_f(res.model_lambda_max)} req/s.", "",
             f"Stable means: every request completed, P90 TPOT <= {res.tpot_slo_s * 1e3:.1f} ms, P90 TTFT <= "
             f"{res.ttft_slo_s:g} s, and waiting did not grow from the first to the last third of arrivals.", "",
             "| rate (req/s) | verdict | completed | TTFT mean / P90 (s) | TPOT P90 (ms) | wait first -> last third (s) | why |",
             "|---|---|---|---|---|---|---|"]
    for p in sorted(res.probes, key=lambda p: p.rate):
        lines.append(f"| {p.rate:.3f} | {'stable' if p.stable else 'unstable'} | {p.completed}/{p.total} | "
                     f"{_f(p.ttft_mean_s)} / {_f(p.ttft_p90_s)} | {_f(None if p.tpot_p90_s is None else p.tpot_p90_s * 1e3)} | "
                     f"{_f(p.wait_first_s)} -> {_f(p.wait_last_s)} | {'; '.join(p.reasons)} |")
    (out / "capacity.md").write_text("\n".join(lines) + "\n")


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("capacity", help="measure Lambda_max by emulation (bisection over offered rates); with "
                                        "several scenarios, the paper's Table 6 by emulation")
    p.add_argument("--scenario", action="append", required=True,
                   help="scenario (repeatable: several give table6.md with the model beside the measurements)")
    p.add_argument("--backend", choices=["auto", "netns", "local", "inproc"], default="auto")
    p.add_argument("--requests", type=int, default=240, help="requests per probe (default 240)")
    p.add_argument("--lo", type=float, help="a rate expected to be stable (default 0.6 x the model's Lambda_max)")
    p.add_argument("--hi", type=float, help="a rate expected to be unstable (default 1.3 x the model's Lambda_max)")
    p.add_argument("--probes", type=int, default=6, help="replays in all (default 6)")
    p.add_argument("--ttft-slo", type=float, help="P90 TTFT SLO in paper seconds (default: the scenario's slo.ttft_s)")
    p.add_argument("--growth-limit", type=float, default=0.25,
                   help="unstable when mean wait grows by more than this fraction of the TTFT SLO (default 0.25)")
    p.add_argument("--wait-growth", type=float, metavar="S",
                   help="unstable when mean wait grows by more than S paper seconds (overrides --growth-limit; "
                        f"default with several scenarios: {2.5:g})")
    p.add_argument("--common-rate", type=float, metavar="R",
                   help="several scenarios: offered load of the TTFT comparison (default 0.75 x the lowest measured "
                        "Lambda_max)")
    p.add_argument("--table-only", action="store_true",
                   help="several scenarios: rewrite table6.md from the run directories already under --out")
    p.add_argument("--spread", type=float, default=0.25,
                   help="several scenarios: bisection between (1 - spread) and (1 + spread) x the model's Lambda_max")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--out", type=Path)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_capacity)


def cmd_capacity(args: argparse.Namespace) -> int:
    from testbed.runner import pick_backend

    ov = parse_overrides(args.set)
    ov.setdefault("workload", {})["requests"] = args.requests
    scenarios = [load_scenario(name, ov) for name in args.scenario]
    backend, warning = pick_backend(args.backend)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if len(scenarios) > 1:
        return _cmd_table(args, scenarios, backend)
    sc = scenarios[0]
    model = model_lambda(sc)
    lo = args.lo or (0.6 * model if model else 1.0)
    hi = args.hi or (1.3 * model if model else 4.0)
    out: Path = args.out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-capacity-{sc.name}"
    out.mkdir(parents=True, exist_ok=True)
    ttft_slo = args.ttft_slo or sc.slo.ttft_s
    print(f"capacity of {sc.name}: bisection in [{lo:.3f}, {hi:.3f}] req/s, {args.probes} probes of "
          f"{args.requests} requests, backend {backend} -> {out}", file=sys.stderr)
    try:
        res = asyncio.run(search(sc, out, backend, lo, hi, args.probes, args.growth_limit, ttft_slo,
                                 growth_s=args.wait_growth))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    write_outputs(res, out)
    if args.json:
        print(json.dumps(asdict(res), indent=1))
    else:
        print((out / "capacity.md").read_text())
    return 0


def _cmd_table(args: argparse.Namespace, scenarios: list[Scenario], backend: str) -> int:
    from testbed.linkprofiles import load_profile
    from testbed.paper_table import DEFAULT_GROWTH_S, rebuild_table, run_table

    out: Path = args.out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-table6"
    out.mkdir(parents=True, exist_ok=True)
    ttft_slo = args.ttft_slo or max(sc.slo.ttft_s for sc in scenarios)
    growth = args.wait_growth if args.wait_growth is not None else DEFAULT_GROWTH_S
    print(f"Table 6 by emulation: {', '.join(sc.name for sc in scenarios)}; {args.probes} probes of {args.requests} "
          f"requests each, backend {backend} -> {out}", file=sys.stderr)
    link_of = lambda sc: load_profile(sc.links.inter_dc).rate  # noqa: E731
    if args.table_only:
        try:
            deps = rebuild_table(scenarios, out, ttft_slo, growth, link_of)
        except FileNotFoundError as e:
            print(f"capacity --table-only: {e.filename}: missing; run without --table-only first", file=sys.stderr)
            return 2
        print((out / "table6.md").read_text())
        return 0
    try:
        deps = asyncio.run(run_table(scenarios, out, backend, args.probes, ttft_slo, growth, args.common_rate,
                                     link_of, args.spread))
    except KeyboardInterrupt:
        print(f"interrupted: probes so far kept under {out}", file=sys.stderr)
        return 130
    if args.json:
        print((out / "table6.json").read_text())
    else:
        print((out / "table6.md").read_text())
    return 0 if all(d.capacity.lambda_max is not None for d in deps) else 1
