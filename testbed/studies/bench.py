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

from testbed.config.cli_args import StoreOnce, out_dir
from testbed.core.record import RequestRecord
from testbed.core.scenario import Scenario
from testbed.metrics.records import read_records
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
    free = [r for r in done if r.times.prefill_start - r.times.prefill_queued < 0.005]
    pre_err = [abs((r.times.prefill_end - r.times.prefill_start) - r.prefill_modelled) for r in free]
    pre_rel = [e / r.prefill_modelled for e, r in zip(pre_err, free)]
    ttft_model = [r.prefill_modelled + step for r in free]
    ttft_meas = [r.ttft for r in free]
    ratio = [m / p for m, p in zip(ttft_meas, ttft_model)]
    tails = [r.times.transfer_end - r.times.prefill_end for r in free]
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


async def kv_loopback_once(nbytes: int, connections: int, chunk_bytes: int, layers: int = 60) -> tuple[float, float]:
    """One transfer of nbytes over loopback, sender and receiver in this process, connections
    warmed up first: (wall bytes/s, process CPU seconds per GB)."""
    import time

    from testbed.live.kv_transport import KVReceiver, KVSender

    rx = KVReceiver()
    port = await rx.start("127.0.0.1", 0)
    tx = KVSender(connections=connections, chunk_bytes=chunk_bytes)
    try:
        warm = tx.start(("127.0.0.1", port), 1, connections * chunk_bytes, 1)
        warm.send_layer(0, connections * chunk_bytes)
        await warm.finish()
        wall, cpu = time.perf_counter(), time.process_time()
        t = tx.start(("127.0.0.1", port), 2, nbytes, layers)
        done = rx.expect(2)
        per = nbytes // layers
        for i in range(layers):
            t.send_layer(i, per if i < layers - 1 else nbytes - per * (layers - 1))
        await t.finish()
        r = await done
        if not r.ok:
            raise RuntimeError(f"loopback transfer failed: {r.reason}")
        return nbytes / (time.perf_counter() - wall), (time.process_time() - cpu) / (nbytes / 1e9)
    finally:
        await tx.close()
        await rx.close()


def kv(args: argparse.Namespace) -> int:
    runs = [asyncio.run(kv_loopback_once(args.bytes, args.connections, args.chunk_bytes)) for _ in range(args.runs)]
    rate, cpu = _median([r for r, _ in runs]), _median([c for _, c in runs])
    fig = {"bytes": args.bytes, "connections": args.connections, "chunk_bytes": args.chunk_bytes,
           "runs": [{"GBps": r / 1e9, "cpu_s_per_GB": c} for r, c in runs],
           "GBps_median": rate / 1e9, "cpu_s_per_GB_median": cpu}
    if args.json:
        print(json.dumps(fig, indent=1))
    else:
        print(f"KV loopback: {args.bytes / 1e9:g} GB over {args.connections} connections in "
              f"{args.chunk_bytes // 1024} KiB chunks, {args.runs} runs: median {rate / 1e9:.3f} GB/s, "
              f"{cpu:.3f} CPU s per GB (sender and receiver together)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.which == "sim":
        from testbed.studies.sim_bench import bench_sim
        return bench_sim(args)
    if args.which == "kv":
        return kv(args)
    return fidelity(args)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("bench", help="benchmarks that print figures (fidelity: the emulator's timing; kv: loopback "
                                     "KV transport throughput; sim: the simulator's speed and scale)")
    b.add_argument("which", choices=["fidelity", "kv", "sim"])
    b.add_argument("--scenario", action=StoreOnce, default="paper-prfaas", help="fidelity: the scenario")
    b.add_argument("--requests", type=int, default=40, help="fidelity: requests to replay")
    b.add_argument("--seed", type=int, default=1, help="sim: seed of the generated traces")
    b.add_argument("--out", action=StoreOnce, type=out_dir, help="run directory")
    b.add_argument("--json", action="store_true")
    b.add_argument("--bytes", type=int, default=10**9, help="kv: bytes of the transfer")
    b.add_argument("--connections", type=int, default=4, help="kv: connections")
    b.add_argument("--chunk-bytes", type=int, default=256 * 1024, help="kv: chunk size")
    b.add_argument("--runs", type=int, default=5, help="kv: transfers to take the median of")
    b.set_defaults(func=_bench)
