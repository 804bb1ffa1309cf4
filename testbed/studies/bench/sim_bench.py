"""`testbed bench sim`: how fast and how far the discrete-event simulator goes.

1. Speed: a one-hour Mooncake-format trace (~12,000 requests, mean input ~12K tokens with
   prefix reuse from hash_ids, ~350 output tokens; `synth_with_prefixes`, written and read back
   as Mooncake JSONL) replayed on paper-prfaas: simulated requests per second of wall (and CPU)
   time, records and time series included. (paper-prfaas cannot keep up with that load: its
   queues grow all hour, which a simulator must handle as well as a calm run.)
2. Scale: 10,000 GPUs, i.e. 1,250 eight-GPU instances in paper-prfaas's PrfaaS / PD-P / PD-D
   proportions (4 : 3 : 5), the inter-DC link scaled with them, 15 minutes of the paper's
   workload at 80% of the model's Lambda_max. The clusters keep no prefix caches: the synthetic
   workload has no prefix reuse, so pools would change no decision and only churn.
   Prints wall time, peak RSS, and the PrfaaS egress in the steady state (the senders' bytes
   from one minute after the first arrival to the last arrival) beside the model's B_out at
   the same load.
3. Sessions at scale: the same deployment with its prefix caches, fed 15 minutes of the agent
   surrogate (`trace synth --prefix-reuse agent`: ~10-turn sessions of 30-120K-token contexts,
   sub-second think times) at the same request rate, closed loop (each turn waits for the
   answer it follows): wall and CPU time, peak RSS, the cached-prefix share; bar: under 3 min.
4. Faults at scale (`testbed bench sim-faults`): the same deployment and traffic with a 60 s WAN
   outage at 5 minutes and a rack of 8 decode instances lost at 9 minutes, once with the fixed
   threshold and once with the short-term bandwidth loop on: wall time and peak RSS of each,
   the report's Faults section, and what the loop changes for the requests caught by the
   outage and those after it.
"""

from __future__ import annotations

import json
import math
import resource
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from testbed.config.resolved import ResolvedScenario
from testbed.core.schema.scenario import LengthDist
from testbed.run.load import load, resolve

HOUR_REQUESTS = 12000
HOUR_S = 3600.0
HOUR_OUTPUT = LengthDist(mu=5.76, sigma=0.6, min=50, max=1000)  # mean ~350 tokens
SCALE_INSTANCES = 1250  # 10,000 GPUs of 8-GPU instances
SCALE_LOAD = 0.8
SCALE_MINUTES = 15.0
WARMUP_S = 60.0
AGENT_BAR_S = 180.0  # the closed-loop agent case's wall-time bar


def scaled(rs: ResolvedScenario, instances: int, caches: bool = False) -> tuple[ResolvedScenario, float]:
    """The deployment with `instances` instances in the same proportions (largest remainders),
    its inter-DC link scaled with it, and no prefix caches unless `caches` (each instance then
    keeps the scenario's own). Returns it and the factor."""
    sc = rs.spec
    roles = [(i, role) for i, c in enumerate(sc.clusters) for role in ("prefill", "decode") if getattr(c, role) > 0]
    total = sum(getattr(sc.clusters[i], role) for i, role in roles)
    k = instances / total
    exact = {key: getattr(sc.clusters[key[0]], key[1]) * k for key in roles}
    counts = {key: math.floor(v) for key, v in exact.items()}
    for key in sorted(exact, key=lambda key: exact[key] - counts[key], reverse=True)[
        : instances - sum(counts.values())
    ]:
        counts[key] += 1
    clusters = [
        c.model_copy(
            update={
                "prefill": counts.get((i, "prefill"), 0),
                "decode": counts.get((i, "decode"), 0),
                **({} if caches else {"cache_bytes": 0}),
            }
        )
        for i, c in enumerate(sc.clusters)
    ]
    spec = sc.model_copy(update={"clusters": clusters, "name": f"{sc.name}-x{instances}"})
    out = resolve(type(sc).model_validate(spec.model_dump()), rs.source)
    link = rs.inter_dc.model_copy(update={"rate": rs.inter_dc.rate * k})
    return out.model_copy(update={"inter_dc": link, "threshold": rs.threshold}), k


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def hour_run(out: Path, seed: int) -> dict[str, Any]:
    from testbed.sim import simulate
    from testbed.traces.loader import load_trace
    from testbed.traces.mooncake import write_mooncake
    from testbed.traces.synthetic import synth_with_prefixes

    path = out / "mooncake-1h.jsonl"
    write_mooncake(path, synth_with_prefixes(HOUR_REQUESTS, HOUR_REQUESTS / HOUR_S, seed, output=HOUR_OUTPUT))
    trace = load_trace(path)
    rs = load("paper-prfaas")
    run_dir = out / "hour-paper-prfaas"
    (run_dir / "timeseries").mkdir(parents=True, exist_ok=True)
    cpu = time.process_time()
    st = simulate(rs, trace, run_dir)
    cpu = time.process_time() - cpu
    ins = [r.input_tokens for r in trace]
    return {
        "requests": len(trace),
        "trace_s": trace.duration,
        "mean_input": sum(ins) / len(ins),
        "mean_output": sum(r.output_tokens for r in trace) / len(trace),
        "completed": st.completed,
        "events": st.events,
        "wall_s": st.wall_s,
        "cpu_s": cpu,
        "rps_wall": len(trace) / st.wall_s,
        "rps_cpu": len(trace) / cpu,
        "simulated_s": st.t_end,
        "run_dir": str(run_dir),
    }


def scale_run(out: Path, seed: int) -> dict[str, Any]:
    from testbed.model.analytical import evaluate
    from testbed.sim.simulator import START_LEAD_S, Simulation
    from testbed.traces.loader import trace_from_workload

    base = load("paper-prfaas")
    rs, k = scaled(base, SCALE_INSTANCES)
    sc = rs.spec
    threshold = None if rs.threshold is None else int(rs.threshold)
    model = evaluate(sc, link_bps=rs.inter_dc.rate, threshold=threshold)
    rate = SCALE_LOAD * model.lambda_max
    n = int(rate * SCALE_MINUTES * 60)
    rs = rs.at_rate(rate)
    rs = rs.model_copy(
        update={
            "spec": rs.spec.model_copy(
                update={"workload": rs.spec.workload.model_copy(update={"requests": n, "seed": seed})}
            )
        }
    )
    trace = trace_from_workload(rs.spec.workload)
    run_dir = out / "scale-10k"
    (run_dir / "timeseries").mkdir(parents=True, exist_ok=True)
    sim = Simulation(rs, trace, run_dir)
    lead = START_LEAD_S * sc.scale.speedup
    t_a = lead + trace.requests[0].timestamp + WARMUP_S
    t_b = lead + trace.requests[-1].timestamp
    prfaas = [nid for nid, p in sim.prefill.items() if p.node.kind == "prfaas"]
    snaps: dict[str, float] = {}

    def snap(key: str) -> None:
        snaps[key] = sum(sim.net.sent_at(nid, sim.loop.now) for nid in prfaas)

    sim.loop.at(t_a, 9, lambda _: snap("a"))
    sim.loop.at(t_b, 9, lambda _: snap("b"))
    cpu = time.process_time()
    st = sim.run()
    cpu = time.process_time() - cpu
    egress = (snaps["b"] - snaps["a"]) * 8.0 / (t_b - t_a)
    b_out = model.egress_at(rate)
    counts = {c.name: (c.prefill, c.decode) for c in sc.clusters}
    return {
        "instances": sum(p + d for p, d in counts.values()),
        "gpus": 8 * sum(p + d for p, d in counts.values()),
        "clusters": counts,
        "factor": k,
        "link_bps": rs.inter_dc.rate,
        "model_lambda_max": model.lambda_max,
        "rate": rate,
        "requests": n,
        "completed": st.completed,
        "failed": st.failed,
        "events": st.events,
        "wall_s": st.wall_s,
        "cpu_s": cpu,
        "peak_rss_mib": _rss_mib(),
        "simulated_s": st.t_end,
        "egress_bps": egress,
        "model_b_out_bps": b_out,
        "egress_over_model": egress / b_out,
        "run_dir": str(run_dir),
    }


def agent_run(out: Path, seed: int) -> dict[str, Any]:
    """The 10,000-GPU deployment (prefix caches kept) fed `SCALE_MINUTES` of the agent surrogate
    at the scale run's request rate, closed loop."""
    from testbed.model.analytical import evaluate
    from testbed.sim.simulator import SimOptions, Simulation
    from testbed.traces.synthetic import synth_profile

    base = load("paper-prfaas")
    rs, _ = scaled(base, SCALE_INSTANCES, caches=True)
    threshold = None if rs.threshold is None else int(rs.threshold)
    rate = SCALE_LOAD * evaluate(rs.spec, link_bps=rs.inter_dc.rate, threshold=threshold).lambda_max
    n = int(rate * SCALE_MINUTES * 60)
    trace = synth_profile("agent", n, rate, seed)
    run_dir = out / "agent-10k-closed"
    (run_dir / "timeseries").mkdir(parents=True, exist_ok=True)
    cpu, wall = time.process_time(), time.perf_counter()
    st = Simulation(rs, trace, run_dir, SimOptions(arrivals="closed")).run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    sessions = len({r.session_id for r in trace})
    ins = [r.input_tokens for r in trace]
    return {
        "instances": sum(c.prefill + c.decode for c in rs.spec.clusters),
        "rate": rate,
        "requests": n,
        "sessions": sessions,
        "mean_input": sum(ins) / len(ins),
        "trace_s": trace.duration,
        "completed": st.completed,
        "failed": st.failed,
        "events": st.events,
        "wall_s": wall,  # the simulation built and run, its run directory written
        "cpu_s": cpu,
        "peak_rss_mib": _rss_mib(),
        "simulated_s": st.t_end,
        "run_dir": str(run_dir),
    }


def print_agent(a: dict[str, Any]) -> None:
    print(
        f"agent sessions at scale: {a['requests']:,} requests in {a['sessions']:,} sessions (mean input "
        f"{a['mean_input'] / 1e3:.1f}K tokens) over {a['trace_s'] / 60:.1f} min at {a['rate']:.1f} req/s on "
        f"{a['instances']:,} instances with prefix caches, closed loop; {a['completed']:,} completed, "
        f"{a['failed']:,} failed, {a['events']:,} events, {a['simulated_s'] / 60:.1f} simulated min",
        flush=True,
    )
    print(
        f"  {a['wall_s']:.1f} s wall, {a['cpu_s']:.1f} s CPU (the simulation built and run), peak RSS "
        f"{a['peak_rss_mib']:,.0f} MiB; bar: under {AGENT_BAR_S:g} s wall",
        flush=True,
    )


def bench_sim(out_dir: Path | None, seed: int) -> int:
    out = out_dir or Path(f"runs/bench-sim-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    hour = hour_run(out, seed)
    print(
        f"one-hour Mooncake-format trace on paper-prfaas: {hour['requests']} requests over "
        f"{hour['trace_s'] / 60:.0f} min (mean input {hour['mean_input'] / 1e3:.1f}K, output "
        f"{hour['mean_output']:.0f} tokens), {hour['events']} events",
        flush=True,
    )
    print(
        f"  {hour['wall_s']:.2f} s wall ({hour['rps_wall']:,.0f} simulated requests/s), {hour['cpu_s']:.2f} s CPU "
        f"({hour['rps_cpu']:,.0f} requests/s); bar: under 5 s, >= 2,400 requests/s",
        flush=True,
    )
    big = scale_run(out, seed)
    pf, pd = big["clusters"].get("prfaas", (0, 0)), big["clusters"].get("pd", (0, 0))
    print(
        f"10,000-GPU deployment: {big['instances']} instances ({big['gpus']} GPUs: {pf[0]} PrfaaS, {pd[0]} PD-P, "
        f"{pd[1]} PD-D), inter-DC link {big['link_bps'] / 1e12:.2f} Tbit/s; {big['requests']:,} requests in "
        f"{SCALE_MINUTES:g} min at {big['rate']:.1f} req/s ({SCALE_LOAD:.0%} of the model's Lambda_max "
        f"{big['model_lambda_max']:.1f}), {big['events']:,} events"
    )
    print(
        f"  {big['wall_s']:.1f} s wall, {big['cpu_s']:.1f} s CPU, peak RSS {big['peak_rss_mib']:,.0f} MiB; "
        f"bar: under 120 s and 4 GiB"
    )
    print(
        f"  PrfaaS egress {big['egress_bps'] / 1e9:,.1f} Gbit/s vs the model's B_out "
        f"{big['model_b_out_bps'] / 1e9:,.1f} Gbit/s at the same load ({big['egress_over_model'] - 1:+.1%}; "
        f"bar: within 5%)"
    )
    agent = agent_run(out, seed)
    print_agent(agent)
    (out / "bench-sim.json").write_text(json.dumps({"hour": hour, "scale": big, "agent": agent}, indent=1))
    print(f"  figures: {out / 'bench-sim.json'}")
    return 0


# -- faults at scale --------------------------------------------------------------------------

OUTAGE_AT_S, OUTAGE_S = 300.0, 60.0  # paper s after t0: the WAN goes dark for a minute
RACK_AT_S, RACK = 540.0, 8  # then a rack of decode instances (8 x 8 GPUs) is lost


def fault_spec(rs: ResolvedScenario, control: bool) -> ResolvedScenario:
    """The scaled deployment with the WAN outage and the decode rack's loss, the short-term
    bandwidth loop on (`control`) or off."""
    sc = rs.spec
    faults = [{"kind": "outage", "at_s": OUTAGE_AT_S, "duration_s": OUTAGE_S, "note": "the inter-DC link goes dark"}]
    faults += [
        {
            "kind": "kill",
            "at_s": RACK_AT_S,
            "cluster": "pd",
            "role": "decode",
            "index": i,
            "note": "a decode rack is lost",
        }
        for i in range(RACK)
    ]
    data = sc.model_dump()
    data["faults"] = faults
    data["policy"]["bandwidth_aware"] = control
    data["name"] = f"{sc.name}-faults-{'control' if control else 'fixed'}"
    out = resolve(type(sc).model_validate(data), rs.source)
    return out.model_copy(update={"inter_dc": rs.inter_dc, "threshold": rs.threshold})


def _window(recs: list[Any], lo: float, hi: float, speedup: float) -> dict[str, Any]:
    """Requests arriving in [lo, hi) paper s: how many, failed, TTFT mean and P90 of the completed."""
    import numpy as np

    sel = [r for r in recs if lo <= r.times.arrival * speedup < hi]
    ttft = [r.ttft * speedup for r in sel if r.outcome == "completed" and math.isfinite(r.ttft)]
    return {
        "requests": len(sel),
        "failed": sum(r.outcome != "completed" for r in sel),
        "ttft_mean": float(np.mean(ttft)) if ttft else None,
        "ttft_p90": float(np.percentile(ttft, 90)) if ttft else None,
    }


def faults_run(out: Path, seed: int, control: bool) -> dict[str, Any]:
    """One 15-minute run of the 10,000-GPU deployment with the faults, its run directory whole
    (records, series, faults.jsonl, summary, report with its Faults section)."""
    from testbed.metrics.fault_effects import fault_effects
    from testbed.metrics.report import write_report
    from testbed.metrics.run_files import read_run_records
    from testbed.metrics.summary import write_summary
    from testbed.model.analytical import evaluate
    from testbed.run.runner import run_sim
    from testbed.traces.loader import trace_from_workload

    base, k = scaled(load("paper-prfaas"), SCALE_INSTANCES)
    threshold = None if base.threshold is None else int(base.threshold)
    model = evaluate(base.spec, link_bps=base.inter_dc.rate, threshold=threshold)
    rate = SCALE_LOAD * model.lambda_max
    n = int(rate * SCALE_MINUTES * 60)
    rs = fault_spec(base, control).at_rate(rate)
    rs = rs.model_copy(
        update={
            "spec": rs.spec.model_copy(
                update={"workload": rs.spec.workload.model_copy(update={"requests": n, "seed": seed})}
            )
        }
    )
    trace = trace_from_workload(rs.spec.workload)
    run_dir = out / ("faults-control" if control else "faults-fixed")
    cpu = time.process_time()
    res = run_sim(rs, trace, run_dir, report=False)
    cpu = time.process_time() - cpu
    from testbed.metrics.summary import read_run_info

    info = read_run_info(run_dir)
    assert info.sim is not None
    summary = write_summary(run_dir)
    write_report(run_dir, summary)
    s = rs.spec.scale.speedup
    recs = read_run_records(run_dir)
    effects = fault_effects(run_dir, recs, s)
    end = OUTAGE_AT_S + OUTAGE_S
    return {
        "control": control,
        "requests": n,
        "rate": rate,
        "completed": res.stats.completed,
        "failed": res.stats.failed,
        "retries": info.sim.retries,
        "events": info.sim.events,
        "sim_wall_s": info.sim.wall_s,
        "cpu_s": cpu,
        "peak_rss_mib": _rss_mib(),
        "ttft_mean": summary.ttft_s.mean,
        "ttft_p90": summary.ttft_s.p90,
        "slo_attainment": summary.throughput.slo_attainment,
        "before": _window(recs, 0.0, OUTAGE_AT_S, s),
        "outage": _window(recs, OUTAGE_AT_S, end, s),
        "after_outage": _window(recs, end, end + 60.0, s),
        "after_rack": _window(recs, RACK_AT_S, RACK_AT_S + 60.0, s),
        "threshold_changes": summary.control.threshold_changes if summary.control else 0,
        "faults": effects,
        "run_dir": str(run_dir),
    }


def _fmt(v: float | None, f: str = "{:.2f}") -> str:
    return "n/a" if v is None else f.format(v)


def bench_sim_faults(out_dir: Path | None, seed: int) -> int:
    out = out_dir or Path(f"runs/bench-sim-faults-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for control in (False, True):
        r = faults_run(out, seed, control)
        runs.append(r)
        name = "short-term bandwidth loop on" if control else "fixed threshold"
        print(
            f"10,000-GPU deployment, {r['requests']:,} requests in {SCALE_MINUTES:g} min at {r['rate']:.1f} req/s, "
            f"WAN outage {OUTAGE_AT_S:g}-{OUTAGE_AT_S + OUTAGE_S:g} s, {RACK} decode instances lost at "
            f"{RACK_AT_S:g} s; {name}:",
            flush=True,
        )
        print(
            f"  simulated in {r['sim_wall_s']:.1f} s wall ({r['events']:,} events), {r['cpu_s']:.1f} s CPU with "
            f"summary and report, peak RSS {r['peak_rss_mib']:,.0f} MiB; bar: under 180 s and 4 GiB"
        )
        print(
            f"  completed {r['completed']:,}, failed {r['failed']:,}, retried {r['retries']:,}; TTFT mean / P90 "
            f"{_fmt(r['ttft_mean'])} / {_fmt(r['ttft_p90'])} s; SLO attainment {_fmt(r['slo_attainment'], '{:.1%}')}; "
            f"threshold changes {r['threshold_changes']}"
        )
        for key, label in (
            ("before", "before the outage"),
            ("outage", "arriving in the outage"),
            ("after_outage", "the minute after it"),
            ("after_rack", "the minute after the rack loss"),
        ):
            w = r[key]
            print(
                f"    {label}: {w['requests']:,} requests, {w['failed']:,} failed, TTFT mean / P90 "
                f"{_fmt(w['ttft_mean'])} / {_fmt(w['ttft_p90'])} s"
            )
        for e in r["faults"]:
            if e["kind"] == "outage" or e["target"].endswith("-d0"):
                rec = "not recovered" if e["recover_s"] is None else f"{e['recover_s']:.1f} s"
                print(
                    f"    fault #{e['fault']} {e['kind']} {e['target']}: affected {e['affected']:,}, failed "
                    f"{e['failed']:,}, retried {e['retried']:,}, time to recover {rec}"
                )
        print(f"  report: {r['run_dir']}/report.md", flush=True)
    fixed, ctl = runs
    for key, label in (("outage", "arriving in the outage"), ("after_outage", "the minute after it")):
        a, b = fixed[key], ctl[key]
        if a["ttft_mean"] is not None and b["ttft_mean"] is not None:
            print(
                f"what the loop saves, requests {label}: TTFT mean {a['ttft_mean']:.2f} -> {b['ttft_mean']:.2f} s, "
                f"P90 {_fmt(a['ttft_p90'])} -> {_fmt(b['ttft_p90'])} s, failed {a['failed']:,} -> {b['failed']:,}"
            )
    print(
        f"overall: failed {fixed['failed']:,} -> {ctl['failed']:,}, SLO attainment "
        f"{_fmt(fixed['slo_attainment'], '{:.1%}')} -> {_fmt(ctl['slo_attainment'], '{:.1%}')}"
    )
    (out / "bench-sim-faults.json").write_text(json.dumps(runs, indent=1, default=str))
    print(f"  figures: {out / 'bench-sim-faults.json'}")
    return 0
