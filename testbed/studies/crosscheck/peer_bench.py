"""`testbed bench peers`: the testbed's `replay --backend sim` against Dynamo's mocker, whole job.

Both replay the same Mooncake trace on the same worker counts, the mocker with the testbed's timing
tables and its own scheduler defaults (`peer_dynamo`; `--peer-config matched` makes its prefill
workers the testbed's, `defaults` gives it nothing but the worker roles, its own timing model
included): 8 prefill / 4 decode instances at the
trace's own rate, and 80 / 40 at ten times it (the trace's arrivals compressed tenfold, one file
both read). Each run is its own process pinned to one CPU (`taskset`), testbed and mocker
alternating, `--repeats` times; the figures are medians:

- whole process: from spawning the command to its exit -- for the testbed the CLI as a user runs
  it, run directory included (records, time series, summary; no report unless asked); for the
  mocker a Python process that imports it and calls its offline replay (it writes nothing);
- simulation: what each measures of its own engine: for the testbed `run.json`'s `sim.wall_s` less
  `sim.write_s` (the batches of records and series it wrote while the loop ran; the records and
  samples themselves are still made), for the mocker its `wall_time_ms` (it writes nothing);
- peak RSS of the process (`wait4`).

The bar (issue: faster than the peer on the whole job): whole process at least 2x faster than the
mocker at 8P/4D and 3x at 80P/40D, simulation at least 3x, and no more memory.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from testbed.core.errors import UserError
from testbed.studies.crosscheck import peer_dynamo
from testbed.traces.types import Trace, TraceRequest

HOUR_REQUESTS = 12000  # `make replay-load-aware`'s one-hour conversation surrogate
HOUR_RATE = 3.3333
SCENARIO = "paper-homogeneous"


@dataclass(frozen=True)
class Scale:
    prefill: int
    decode: int
    speed: float  # arrivals this many times faster than the trace's
    whole_bar: float  # mocker whole-process time / testbed's at least this
    sim_bar: float  # the same of the simulation engines alone

    @property
    def label(self) -> str:
        return f"{self.prefill}P/{self.decode}D" + (f" at {self.speed:g}x rate" if self.speed != 1 else "")


# The bars of the streaming-and-scale work (the million-request run's): a whole job in a quarter of the
# mocker's time at 8P/4D and a sixth at 80P/40D, the engines alone a sixth and a ninth.
SCALES = (Scale(8, 4, 1.0, 4.0, 6.0), Scale(80, 40, 10.0, 6.0, 9.0))
_CONFIGS = {
    "native": "the mocker with the testbed's timing tables and its own scheduler",
    "matched": "the mocker with the testbed's timing tables, one whole prompt per prefill pass",
    "defaults": "the mocker with its own defaults (timing model included)",
}

# The mocker's side: a bare process that imports it and replays (the project's own few lines).
MOCKER_RUN = """
import json, sys, time
t0 = time.perf_counter()
from dynamo import _core
t1 = time.perf_counter()
r = _core.run_mocker_trace_replay(**json.loads(sys.argv[1]))
t2 = time.perf_counter()
s = r.summary
print(json.dumps({"import_s": t1 - t0, "call_s": t2 - t1, "sim_s": s["wall_time_ms"] / 1e3,
                  "completed": s["completed_requests"], "mean_ttft_ms": s["mean_ttft_ms"],
                  "mean_itl_ms": s["mean_itl_ms"]}))
"""


@dataclass
class Sample:
    whole_s: float
    sim_s: float
    rss_mib: float
    extra: dict[str, Any] = field(default_factory=dict)


# A small process between this one and each run: a child's peak RSS counts the memory it started
# with before exec (a forked or vforked copy of its parent), so a run spawned from this process
# would never read below this process's own. The launcher is a bare interpreter; it times the
# run from spawn to exit and writes the figures to the file it is given.
LAUNCH = """
import json, os, sys, time
t = time.perf_counter()
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t
with open(sys.argv[1], "w") as f:
    json.dump({"wall_s": wall, "maxrss_kib": ru.ru_maxrss, "rc": os.waitstatus_to_exitcode(status)}, f)
"""


def _run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Run `cmd` to its end through the launcher: (wall s, its peak RSS MiB, its stdout)."""
    with tempfile.TemporaryDirectory() as d:
        fig, so, se = Path(d) / "fig.json", Path(d) / "out", Path(d) / "err"
        with so.open("wb") as fo, se.open("wb") as fe, open(os.devnull, "rb") as nul:
            rc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", LAUNCH, str(fig), *cmd], stdin=nul, stdout=fo, stderr=fe, env=env
            ).returncode
        out, err = so.read_text(errors="replace"), se.read_text(errors="replace")
        got = json.loads(fig.read_text()) if fig.is_file() else {"rc": rc}
    if rc != 0 or got["rc"] != 0:
        tail = err.strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"bench peers: `{' '.join(cmd[:6])} ...` exited {got['rc']}: {tail[0]}")
    return float(got["wall_s"]), got["maxrss_kib"] / 1024.0, out


def surrogate(path: Path, requests: int, seed: int) -> Trace:
    """The one-hour Mooncake-format conversation surrogate (`testbed trace synth --format mooncake
    --prefix-reuse chat --requests 12000 --rate 3.3333 --seed 1`), or its first `requests`."""
    from testbed.traces.mooncake import write_mooncake
    from testbed.traces.synthetic import synth_profile

    trace = synth_profile("chat", requests, HOUR_RATE, seed)
    write_mooncake(path, trace)
    return trace


def compressed(trace: Trace, speed: float, path: Path) -> Path:
    """The trace with its arrivals `speed` times closer together, written where both read it."""
    from testbed.traces.mooncake import write_mooncake

    reqs = [
        TraceRequest(r.request_id, r.timestamp / speed, r.input_tokens, r.output_tokens, r.hash_ids)
        for r in trace.requests
    ]
    write_mooncake(path, Trace(reqs, f"{trace.source} at {speed:g}x", trace.block_tokens))
    return path


def _sets(sc: Scale) -> list[str]:
    return [f"clusters.0.prefill={sc.prefill}", f"clusters.0.decode={sc.decode}"]


def _testbed_cmd(trace: Path, sc: Scale, out: Path, scheduler: str = "fcfs") -> list[str]:
    sched = [] if scheduler == "fcfs" else [f"hardware.h20.scheduler.kind={scheduler}"]
    sets = [x for s in (*_sets(sc), *sched) for x in ("--set", s)]
    return [
        sys.executable,
        "-m",
        "testbed",
        "replay",
        "--scenario",
        SCENARIO,
        *sets,
        "--backend",
        "sim",
        "--trace",
        str(trace),
        "--out",
        str(out),
        # each interleaved run replaces the previous one's directory
        "--overwrite",
    ]


def run_testbed(trace: Path, sc: Scale, out: Path, cpu: int, scheduler: str = "fcfs") -> Sample:
    wall, rss, _ = _run(["taskset", "-c", str(cpu), *_testbed_cmd(trace, sc, out, scheduler)])
    info = json.loads((out / "run.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    sim = info["sim"]
    writes = float(sim.get("write_s") or 0.0)
    return Sample(
        wall,
        float(sim["wall_s"]) - writes,
        rss,
        {
            "mean_ttft_s": summary["ttft_s"]["mean"],
            "mean_itl_s": summary["tpot_s"]["mean"],
            "completed": summary["requests"]["completed"],
            "sim_wall_s": sim["wall_s"],
            "write_s": writes,
            "mechanisms": sim.get("mechanisms") or "python",
        },
    )


def run_mocker(kwargs: peer_dynamo.MockerArgs, cpu: int) -> Sample:
    env = dict(os.environ, DYN_LOG=os.environ.get("DYN_LOG", "warn"))
    wall, rss, out = _run(["taskset", "-c", str(cpu), sys.executable, "-c", MOCKER_RUN, json.dumps(kwargs)], env)
    fig = json.loads(out.strip().splitlines()[-1])
    return Sample(wall, float(fig["sim_s"]), rss, fig)


def outside_s(x: Sample) -> float:
    """A run's seconds outside its engine and the engine's writing: the testbed's start-up (the
    interpreter, imports, the scenario), trace opening, summary, printed table and exit; the
    mocker's import and set-up. The share of the whole process a run of one request pays too."""
    engine = float(x.extra["sim_wall_s"]) if "sim_wall_s" in x.extra else x.sim_s
    return x.whole_s - engine


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


@dataclass(frozen=True)
class PeerBenchOptions:
    """`testbed bench peers`'s flags, one field each."""

    out: Path | None = None
    cpu: int | None = None
    trace: str | None = None
    requests: int | None = None
    seed: int = 1
    peer_config: str = "native"
    repeats: int = 3
    # The testbed's prefill/decode schedulers timed (the first is judged against the bars; the
    # rest are reported beside it): fcfs, the default, and the vLLM-like batching one.
    schedulers: tuple[str, ...] = ("fcfs", "vllm")


def bench_peers(args: PeerBenchOptions) -> int:
    from testbed.config.overrides import overrides_for
    from testbed.run.load import load
    from testbed.traces.loader import load_trace

    why = peer_dynamo.missing()
    if why is not None:
        raise peer_dynamo.PeerError(f"bench peers: {why}")
    if shutil.which("taskset") is None:
        raise UserError("bench peers: pinning each run to one CPU needs `taskset` (util-linux)")
    out = Path(args.out or f"runs/bench-peers-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    if args.trace:
        trace = load_trace(args.trace, limit=args.requests)
        base = out / "trace.jsonl"
        from testbed.traces.mooncake import write_mooncake

        write_mooncake(base, trace)
    else:
        base = out / "mooncake-chat-1h.jsonl"
        trace = surrogate(base, args.requests or HOUR_REQUESTS, args.seed)
    print(
        f"bench peers: {len(trace):,} requests over {trace.duration / 60:.0f} min ({trace.source}), {SCENARIO} "
        f"{_CONFIGS[args.peer_config]}, {args.repeats} interleaved "
        f"runs each pinned to CPU {cpu}; medians",
        flush=True,
    )
    results: dict[str, Any] = {
        "trace": str(base),
        "requests": len(trace),
        "cpu": cpu,
        "repeats": args.repeats,
        "peer_config": args.peer_config,
        "mocker": peer_dynamo.version(),
        "date": datetime.now().isoformat(timespec="seconds"),
        "scales": {},
    }
    plans = []
    for sc in SCALES:
        path = base if sc.speed == 1 else compressed(trace, sc.speed, out / f"trace-{sc.speed:g}x.jsonl")
        t = load_trace(path)
        rs = load(SCENARIO, overrides_for(SCENARIO, _sets(sc)))
        kwargs: peer_dynamo.MockerArgs
        if args.peer_config == "defaults":
            kwargs = {
                "trace_files": [str(path)],
                "prefill_engine_args": {"engine": {"worker_type": "prefill"}},
                "decode_engine_args": {"engine": {"worker_type": "decode"}},
                "num_prefill_workers": sc.prefill,
                "num_decode_workers": sc.decode,
                "replay_mode": "offline",
                "router_mode": "kv_router",
                "trace_block_size": t.block_tokens,
                "trace_format": "mooncake",
            }
        else:
            s = peer_dynamo.setup(rs, t, out / f"mocker-{sc.prefill}x{sc.decode}", args.peer_config)
            kwargs = s.kwargs(path, capture=False)
        plans.append((sc, path, kwargs))
    main, *beside = args.schedulers or ("fcfs",)
    samples: dict[str, dict[str, list[Sample]]] = {
        sc.label: {"testbed": [], "mocker": [], **{f"testbed-{k}": [] for k in beside}} for sc, _, _ in plans
    }
    for i in range(args.repeats):
        for sc, path, kwargs in plans:
            tb = run_testbed(path, sc, out / f"testbed-{sc.prefill}x{sc.decode}", cpu, main)
            mk = run_mocker(kwargs, cpu)
            samples[sc.label]["testbed"].append(tb)
            samples[sc.label]["mocker"].append(mk)
            print(
                f"  run {i + 1} {sc.label}: testbed {main} ({tb.extra['mechanisms']} mechanisms) {tb.whole_s:.2f} s "
                f"whole, {tb.sim_s:.2f} s sim "
                f"(+{tb.extra['write_s']:.2f} s writing), "
                f"{tb.rss_mib:.0f} MiB; mocker {mk.whole_s:.2f} s whole, {mk.sim_s:.2f} s sim, {mk.rss_mib:.0f} MiB",
                flush=True,
            )
            for k in beside:
                other = run_testbed(path, sc, out / f"testbed-{k}-{sc.prefill}x{sc.decode}", cpu, k)
                samples[sc.label][f"testbed-{k}"].append(other)
                print(
                    f"  run {i + 1} {sc.label}: testbed {k} {other.whole_s:.2f} s whole, {other.sim_s:.2f} s sim, "
                    f"{other.rss_mib:.0f} MiB",
                    flush=True,
                )
    missed: list[str] = []
    print(f"{'':24}{'testbed':>10}{'mocker':>10}{'ratio':>9}  bar")
    for sc, _, _ in plans:
        tbs, mks = samples[sc.label]["testbed"], samples[sc.label]["mocker"]
        fig = {
            k: {"testbed": _med([getattr(x, k) for x in tbs]), "mocker": _med([getattr(x, k) for x in mks])}
            for k in ("whole_s", "sim_s", "rss_mib")
        }
        whole = fig["whole_s"]["mocker"] / fig["whole_s"]["testbed"]
        sim = fig["sim_s"]["mocker"] / fig["sim_s"]["testbed"]
        mem = fig["rss_mib"]["testbed"] / fig["rss_mib"]["mocker"]
        ok = {"whole": whole >= sc.whole_bar, "sim": sim >= sc.sim_bar, "memory": mem <= 1.0}
        missed += [f"{sc.label} {k}" for k, v in ok.items() if not v]
        print(sc.label)
        print(
            f"  {'whole process (s)':22}{fig['whole_s']['testbed']:>10.2f}{fig['whole_s']['mocker']:>10.2f}"
            f"{whole:>8.2f}x  >= {sc.whole_bar:g}x faster: {'met' if ok['whole'] else 'NOT met'}"
        )
        print(
            f"  {'simulation engine (s)':22}{fig['sim_s']['testbed']:>10.2f}{fig['sim_s']['mocker']:>10.2f}"
            f"{sim:>8.2f}x  >= {sc.sim_bar:g}x faster: {'met' if ok['sim'] else 'NOT met'}"
        )
        print(
            f"  {'peak RSS (MiB)':22}{fig['rss_mib']['testbed']:>10.0f}{fig['rss_mib']['mocker']:>10.0f}"
            f"{mem:>8.2f}x  testbed/mocker <= 1: {'met' if ok['memory'] else 'NOT met'}"
        )
        fig["outside_s"] = {"testbed": _med([outside_s(x) for x in tbs]), "mocker": _med([outside_s(x) for x in mks])}
        print(
            f"  {'outside the engine (s)':22}{fig['outside_s']['testbed']:>10.2f}{fig['outside_s']['mocker']:>10.2f}"
            "           not judged: start-up, trace, summary, output (the mocker: its import)"
        )
        others: dict[str, dict[str, float]] = {}
        for k in beside:
            xs = samples[sc.label][f"testbed-{k}"]
            w, m = _med([x.whole_s for x in xs]), _med([x.sim_s for x in xs])
            others[k] = {
                "whole_s": w,
                "sim_s": m,
                "rss_mib": _med([x.rss_mib for x in xs]),
                "whole_mocker_over_testbed": fig["whole_s"]["mocker"] / w,
                "sim_mocker_over_testbed": fig["sim_s"]["mocker"] / m,
            }
            print(
                f"  testbed {k} scheduler: whole {w:.2f} s ({others[k]['whole_mocker_over_testbed']:.2f}x), "
                f"simulation {m:.2f} s ({others[k]['sim_mocker_over_testbed']:.2f}x), "
                f"{others[k]['rss_mib']:.0f} MiB (reported beside the {main} scheduler's; not judged)"
            )
        results["scales"][sc.label] = {
            "prefill": sc.prefill,
            "decode": sc.decode,
            "speed": sc.speed,
            "medians": fig,
            "ratios": {
                "whole_mocker_over_testbed": whole,
                "sim_mocker_over_testbed": sim,
                "rss_testbed_over_mocker": mem,
            },
            "bars": {"whole": sc.whole_bar, "sim": sc.sim_bar},
            "met": ok,
            "scheduler": main,
            "beside": others,
            "runs": {k: [vars(x) for x in v] for k, v in samples[sc.label].items()},
        }
    (out / "bench-peers.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    verdict = "every bar met" if not missed else "bars NOT met: " + ", ".join(missed)
    print(f"{verdict}; figures: {out / 'bench-peers.json'}")
    return 0
