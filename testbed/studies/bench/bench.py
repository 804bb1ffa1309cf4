"""Benchmarks: they print measured figures and ratios against the bars; they are not tests."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from testbed.config import run_lock
from testbed.config.cli_args import StoreOnce, add_overwrite, out_dir
from testbed.core.finite_json import dumps as finite_dumps
from testbed.core.record import RequestRecord
from testbed.core.schema.scenario import Scenario
from testbed.metrics.run_files import read_run_records
from testbed.run.load import load
from testbed.run.stoppable import run_stoppable
from testbed.studies.crosscheck.peer_bench import PeerBenchOptions
from testbed.traces.csvutil import Window

FIDELITY_RATE = 0.3  # paper req/s: low enough that queues stay empty on the paper deployments


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
        "requests": len(records),
        "completed": len(done),
        "queue_free": len(free),
        "wire_step_s": step,
        "prefill_abs_err_median_s": _median(pre_err),
        "prefill_rel_err_median": _median(pre_rel),
        "prefill_modelled_median_s": med_pre,
        "prefill_bar_s": bar_pre,
        "prefill_pass": _median(pre_err) < bar_pre,
        "ttft_ratio_median": _median(ratio),
        "ttft_ratio_mean": statistics.fmean(ratio) if ratio else math.nan,
        "ttft_ratio_p90_abs_dev": sorted(abs(x - 1) for x in ratio)[int(0.9 * (len(ratio) - 1))] if ratio else math.nan,
        "ttft_pass": bool(ratio) and abs(_median(ratio) - 1) < 0.05,
        "transfer_tail_median_s": _median(tails),
        "ttft_overhead_median_s": _median(overhead),
    }


@dataclass(frozen=True)
class BenchOptions:
    """`testbed bench`'s flags, one field each (each benchmark reads its own)."""

    which: str
    scenario: str = "paper-prfaas"
    requests: int | None = None
    seed: int = 1
    repeats: int = 3
    cpu: int | None = None
    peer_config: str = "native"
    schedulers: tuple[str, ...] = ("fcfs", "vllm")
    out: Path | None = None
    overwrite: bool = False
    json: bool = False
    bytes: int = 10**9
    connections: int = 4
    chunk_bytes: int = 256 * 1024
    runs: int = 5
    backend: str = "auto"
    from_runs: tuple[str, ...] = ()
    no_save: bool = False
    trace: str | None = None
    window: Window | None = None
    set: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> BenchOptions:
        return cls(
            which=ns.which,
            scenario=ns.scenario,
            requests=ns.requests,
            seed=ns.seed,
            repeats=ns.repeats,
            cpu=ns.cpu,
            peer_config=ns.peer_config,
            schedulers=tuple(ns.schedulers),
            out=ns.out,
            overwrite=ns.overwrite,
            json=ns.json,
            bytes=ns.bytes,
            connections=ns.connections,
            chunk_bytes=ns.chunk_bytes,
            runs=ns.runs,
            backend=ns.backend,
            from_runs=tuple(ns.from_runs or ()),
            no_save=ns.no_save,
            trace=ns.trace,
            window=ns.window,
            set=tuple(ns.set),
        )

    def peers(self) -> PeerBenchOptions:
        return PeerBenchOptions(
            self.out, self.cpu, self.trace, self.requests, self.seed, self.peer_config, self.repeats, self.schedulers
        )


def _schedulers(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in names if x not in ("fcfs", "vllm")]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"schedulers {text!r}: give fcfs and/or vllm, comma-separated")
    return names


def fidelity(args: BenchOptions) -> int:
    from testbed.run.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    rs = load(args.scenario, {"workload": {"rate": FIDELITY_RATE, "requests": args.requests or 40}})
    sc = rs.spec
    out = Path(args.out or f"runs/bench-fidelity-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    res = run_stoppable(run_replay_async(rs, trace_from_workload(sc.workload), out, "local"))
    fig = fidelity_figures(sc, read_run_records(res.run_dir))
    fig["run_dir"] = str(res.run_dir)
    (res.run_dir / "fidelity.json").write_text(finite_dumps(fig, indent=1))
    if args.json:
        print(json.dumps(fig, indent=1))
    else:
        print(
            f"timing fidelity on {sc.name}, {fig['queue_free']} queue-free of {fig['completed']} completed "
            f"requests (wire units, speedup {sc.scale.speedup:g}):"
        )
        print(
            f"  prefill |measured - modelled| median {fig['prefill_abs_err_median_s'] * 1e3:.2f} ms "
            f"({fig['prefill_rel_err_median'] * 100:.2f}%), bar 2% + 2 ms = {fig['prefill_bar_s'] * 1e3:.2f} ms "
            f"-> {'PASS' if fig['prefill_pass'] else 'FAIL'}"
        )
        print(
            f"  TTFT measured / (modelled prefill + tail + first step) median {fig['ttft_ratio_median']:.4f}, "
            f"mean {fig['ttft_ratio_mean']:.4f}, bar within 5% -> {'PASS' if fig['ttft_pass'] else 'FAIL'}"
        )
        print(
            f"  transfer tail median {fig['transfer_tail_median_s'] * 1e3:.2f} ms; TTFT overhead over the model "
            f"median {fig['ttft_overhead_median_s'] * 1e3:.2f} ms"
        )
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


def kv(args: BenchOptions) -> int:
    runs = [asyncio.run(kv_loopback_once(args.bytes, args.connections, args.chunk_bytes)) for _ in range(args.runs)]
    rate, cpu = _median([r for r, _ in runs]), _median([c for _, c in runs])
    fig = {
        "bytes": args.bytes,
        "connections": args.connections,
        "chunk_bytes": args.chunk_bytes,
        "runs": [{"GBps": r / 1e9, "cpu_s_per_GB": c} for r, c in runs],
        "GBps_median": rate / 1e9,
        "cpu_s_per_GB_median": cpu,
    }
    if args.json:
        print(json.dumps(fig, indent=1))
    else:
        print(
            f"KV loopback: {args.bytes / 1e9:g} GB over {args.connections} connections in "
            f"{args.chunk_bytes // 1024} KiB chunks, {args.runs} runs: median {rate / 1e9:.3f} GB/s, "
            f"{cpu:.3f} CPU s per GB (sender and receiver together)"
        )
    return 0


LIVE_PATH_PROBE = {"workload": {"rate": 1.2, "output_tokens": 256, "seed": 5}}


def live_path(args: BenchOptions) -> int:
    """What the live path costs on this host (`testbed.metrics.live_path`): a short replay of the
    paper's PrfaaS-PD deployment on the backend, or runs recorded before (`--from`); the figures
    go to the run directory and, unless --no-save, to this host's file the simulator reads with
    `sim.live_path: host`."""
    import socket
    from datetime import datetime as dt

    from testbed.config.live_path import save_host_costs
    from testbed.config.overrides import overrides_for, set_path
    from testbed.core.schema.live_path import DRAWN, quantiles
    from testbed.deploy import registry
    from testbed.metrics.live_path import LivePathRun, live_path_figures
    from testbed.run.runner import run_replay_async
    from testbed.traces.loader import load_trace, trace_from_workload

    if args.from_runs:
        dirs = [Path(r) for r in args.from_runs]
        backend = "recorded"
        parts = [live_path_figures(d) for d in dirs]
        out = Path(args.out) if args.out else dirs[0]  # written beside the first run unless told
        out.mkdir(parents=True, exist_ok=True)
    else:
        backend, warning = registry.pick_backend(args.backend)
        if registry.get(backend).caps.simulator:
            print(
                "bench live-path: the simulator has no live path to measure; give an emulating --backend",
                file=sys.stderr,
            )
            return 2
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        over = overrides_for(args.scenario, list(args.set))
        if args.trace is None:
            set_path(over, {}, "workload", {**LIVE_PATH_PROBE["workload"], "requests": args.requests or 120})
        rs = load(args.scenario, over)
        trace = (
            trace_from_workload(rs.spec.workload)
            if args.trace is None
            else load_trace(args.trace, window=args.window, limit=args.requests)
        )
        out = Path(args.out or f"runs/bench-live-path-{dt.now():%Y%m%d-%H%M%S}")
        res = run_stoppable(run_replay_async(rs, trace, out, backend, report=False))
        parts = [live_path_figures(res.run_dir)]
    runs: list[LivePathRun] = [r for p in parts for r in p["runs"]]
    stalls = sum(r["stalls"] for r in runs)
    decoding = sum(r["decoding_s"] for r in runs)
    fig: dict[str, Any] = {}
    for k in DRAWN:  # every run's requests together
        xs = [x for r in runs for x in r["samples"][k]]
        fig[k] = statistics.fmean(xs) if xs else 0.0
    qs = {k: list(quantiles([x for r in runs for x in r["samples"][k]])) for k in DRAWN}
    fig["quantiles"] = {k: q for k, q in qs.items() if len(q) > 1}
    for r in runs:
        r.pop("samples")
    fig["stall_rate_per_s"] = stalls / decoding if decoding > 0 else 0.0
    fig["stall_s"] = sum(r["lost_s"] for r in runs) / stalls if stalls else 0.0
    fig.update(
        {
            "host": socket.gethostname(),
            "measured": dt.now().isoformat(timespec="seconds"),
            "backend": backend,
            "scenario": args.scenario,
            "runs": runs,
        }
    )
    (out / "live-path.json").write_text(json.dumps(fig, indent=1) + "\n")
    saved = None if args.no_save else save_host_costs(fig)
    if args.json:
        print(json.dumps(fig, indent=1))
    else:
        print(f"live path on {fig['host']} ({backend}, {sum(r['requests'] for r in runs)} requests; wire units):")
        q = fig["quantiles"]
        print(
            "  "
            + ", ".join(
                f"{k[:-2]} mean {fig[k] * 1e3:.2f} ms (P50 {q[k][10] * 1e3:.2f}, P90 {q[k][18] * 1e3:.2f})"
                for k in DRAWN
                if q.get(k)
            )
        )
        print(
            f"  decode loop stalls {fig['stall_rate_per_s']:.3f} per decoding second, {fig['stall_s'] * 1e3:.2f} ms "
            f"lost each ({stalls} over {decoding:.1f} s)"
        )
        print(
            f"  figures: {out / 'live-path.json'}"
            + (f"; this host's, for sim.live_path: host: {saved}" if saved else "")
        )
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    args = BenchOptions.from_args(ns)
    if args.out is not None and not (args.which == "live-path" and args.from_runs):
        run_lock.acquire(args.out, args.overwrite)  # this command's until it returns
    if args.which == "live-path":
        return live_path(args)
    if args.which == "sim":
        from testbed.studies.bench.sim_bench import bench_sim

        return bench_sim(args.out, args.seed)
    if args.which == "sim-faults":
        from testbed.studies.bench.sim_bench import bench_sim_faults

        return bench_sim_faults(args.out, args.seed)
    if args.which == "peers":
        from testbed.studies.crosscheck.peer_bench import bench_peers

        return bench_peers(args.peers())
    if args.which == "kv":
        return kv(args)
    return fidelity(args)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser(
        "bench",
        help="benchmarks that print figures (fidelity: the emulator's timing; kv: loopback "
        "KV transport throughput; sim: the simulator's speed and scale; live-path: what "
        "the emulator's live path costs on this host, for the simulator; sim-faults: faults at 10,000 GPUs, "
        "with and without the control loop; peers: replay --backend sim against Dynamo's mocker, whole job)",
    )
    b.add_argument(
        "which", choices=["fidelity", "kv", "sim", "sim-faults", "live-path", "peers"], help="which benchmark"
    )
    b.add_argument("--scenario", action=StoreOnce, default="paper-prfaas", help="fidelity, live-path: the scenario")
    b.add_argument(
        "--requests",
        type=int,
        help="fidelity: requests to replay (default 40); live-path: of the "
        "probe workload (default 120) or the first of --trace; peers: only "
        "the trace's first N (default: all; the surrogate has 12,000)",
    )
    b.add_argument("--seed", type=int, default=1, help="sim, peers: seed of the generated traces")
    b.add_argument("--repeats", type=int, default=3, help="peers: interleaved runs of each (medians)")
    b.add_argument("--cpu", type=int, help="peers: the CPU every run is pinned to (default: the last one)")
    b.add_argument(
        "--peer-config",
        choices=("native", "matched", "defaults"),
        default="native",
        help="peers: what the mocker is given. native (default): the testbed's timing tables, its own "
        "vLLM scheduler defaults (as crosscheck --peer-scheduler native); matched: the same tables, "
        "prefill workers one whole prompt at a time (crosscheck's default); defaults: nothing but the "
        "worker roles (its own timing model, as `run_mocker_trace_replay` runs by default)",
    )
    b.add_argument(
        "--schedulers",
        type=_schedulers,
        default=("fcfs", "vllm"),
        help="peers: the testbed's schedulers to time, comma-separated (default fcfs,vllm): the first is "
        "judged against the bars, the others reported beside it",
    )
    b.add_argument("--out", action=StoreOnce, type=out_dir, help="run directory")
    add_overwrite(b)
    b.add_argument("--json", action="store_true", help="print the figures as JSON")
    b.add_argument("--bytes", type=int, default=10**9, help="kv: bytes of the transfer")
    b.add_argument("--connections", type=int, default=4, help="kv: connections")
    b.add_argument("--chunk-bytes", type=int, default=256 * 1024, help="kv: chunk size")
    b.add_argument("--runs", type=int, default=5, help="kv: transfers to take the median of")
    from testbed.deploy import registry

    b.add_argument(
        "--backend", action=StoreOnce, **registry.backend_option(registry.emulates, lead="live-path: the backend")
    )
    b.add_argument(
        "--from",
        dest="from_runs",
        action="append",
        metavar="RUN",
        help="live-path: take the figures from these emulated runs instead of a new one (repeatable)",
    )
    b.add_argument("--no-save", action="store_true", help="live-path: do not keep the figures as this host's")
    from testbed.traces.trace_command import WINDOW_HELP, window_arg

    b.add_argument(
        "--trace",
        action=StoreOnce,
        help="live-path: replay this trace (best: a part of the one the "
        "simulator is to predict, at its load) instead of the probe workload; "
        "peers: a Mooncake trace to replay instead of the one-hour "
        "conversation surrogate",
    )
    b.add_argument(
        "--window",
        action=StoreOnce,
        type=window_arg,
        metavar="START:END",
        help=f"live-path: the part of --trace to replay: {WINDOW_HELP}",
    )
    b.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="live-path: override a scenario field (repeatable)",
    )
    b.set_defaults(func=cmd_bench)
