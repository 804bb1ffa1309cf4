"""Benchmarks: they print measured figures and ratios against the bars; they are not tests."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

from testbed.core.scenario import Scenario
from testbed.metrics.records import RequestRecord, read_records
from testbed.studies.load import load

FIDELITY_RATE = 0.3    # paper req/s: low enough that queues stay empty on the paper deployments


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def fidelity_figures(sc: Scenario, records: list[RequestRecord]) -> dict[str, Any]:
    """Measured vs modelled prefill duration and TTFT, over requests that never queued."""
    hw_decode = next(sc.hardware[c.hardware].decode for c in sc.clusters if c.kind == "pd" and c.decode)
    assert hw_decode is not None
    step = hw_decode.base_s / sc.scale.speedup
    done = [r for r in records if r.outcome == "completed"]
    # Queue-free: started within 5 ms of being queued (HTTP hop included).
    free = [r for r in done if r.prefill_start - r.prefill_queued < 0.005]
    pre_err = [abs((r.prefill_end - r.prefill_start) - r.prefill_modelled) for r in free]
    pre_rel = [e / r.prefill_modelled for e, r in zip(pre_err, free)]
    ttft_model = [r.prefill_modelled + step for r in free]
    ttft_meas = [r.ttft for r in free]
    ratio = [m / p for m, p in zip(ttft_meas, ttft_model)]
    tails = [r.transfer_end - r.prefill_end for r in free]
    overhead = [m - p for m, p in zip(ttft_meas, ttft_model)]
    med_pre = _median([r.prefill_modelled for r in free])
    bar_pre = 0.02 * med_pre + 0.002
    return {
        "requests": len(records), "completed": len(done), "queue_free": len(free),
        "wire_step_s": step,
        "prefill_abs_err_median_s": _median(pre_err), "prefill_rel_err_median": _median(pre_rel),
        "prefill_modelled_median_s": med_pre, "prefill_bar_s": bar_pre,
        "prefill_pass": _median(pre_err) < bar_pre,
        "ttft_ratio_median": _median(ratio), "ttft_ratio_mean": statistics.fmean(ratio) if ratio else math.nan,
        "ttft_ratio_p90_abs_dev": sorted(abs(x - 1) for x in ratio)[int(0.9 * (len(ratio) - 1))] if ratio else math.nan,
        "ttft_pass": bool(ratio) and abs(_median(ratio) - 1) < 0.05,
        "transfer_tail_median_s": _median(tails), "ttft_overhead_median_s": _median(overhead),
    }


def fidelity(args: argparse.Namespace) -> int:
    from testbed.studies.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    rs = load(args.scenario, {"workload": {"rate": FIDELITY_RATE, "requests": args.requests}})
    sc = rs.spec
    out = Path(args.out or f"runs/bench-fidelity-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    res = asyncio.run(run_replay_async(rs, trace_from_workload(sc.workload), out, "local"))
    fig = fidelity_figures(sc, read_records(res.run_dir / "records.csv"))
    fig["run_dir"] = str(res.run_dir)
    (res.run_dir / "fidelity.json").write_text(json.dumps(fig, indent=1))
    if args.json:
        print(json.dumps(fig, indent=1))
    else:
        print(f"timing fidelity on {sc.name}, {fig['queue_free']} queue-free of {fig['completed']} completed "
              f"requests (wire units, speedup {sc.scale.speedup:g}):")
        print(f"  prefill |measured - modelled| median {fig['prefill_abs_err_median_s'] * 1e3:.2f} ms "
              f"({fig['prefill_rel_err_median'] * 100:.2f}%), bar 2% + 2 ms = {fig['prefill_bar_s'] * 1e3:.2f} ms "
              f"-> {'PASS' if fig['prefill_pass'] else 'FAIL'}")
        print(f"  TTFT measured / (modelled prefill + tail + first step) median {fig['ttft_ratio_median']:.4f}, "
              f"mean {fig['ttft_ratio_mean']:.4f}, bar within 5% -> {'PASS' if fig['ttft_pass'] else 'FAIL'}")
        print(f"  transfer tail median {fig['transfer_tail_median_s'] * 1e3:.2f} ms; TTFT overhead over the model "
              f"median {fig['ttft_overhead_median_s'] * 1e3:.2f} ms")
        print(f"  run: {res.run_dir}")
    return 0 if fig["prefill_pass"] and fig["ttft_pass"] else 1


def _bench(args: argparse.Namespace) -> int:
    if args.which == "sim":
        from testbed.studies.sim_bench import bench_sim
        return bench_sim(args)
    return fidelity(args)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("bench", help="benchmarks that print figures (fidelity: the emulator's timing; sim: the "
                                     "simulator's speed and scale)")
    b.add_argument("which", choices=["fidelity", "sim"])
    b.add_argument("--scenario", default="paper-prfaas", help="fidelity: the scenario")
    b.add_argument("--requests", type=int, default=40, help="fidelity: requests to replay")
    b.add_argument("--seed", type=int, default=1, help="sim: seed of the generated traces")
    b.add_argument("--out", help="run directory")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_bench)
