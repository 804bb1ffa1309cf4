"""The paper's Table 6 by emulation: `testbed capacity` with several scenarios.

For each deployment: Lambda_max by bisection (`testbed.studies.capacity.search`), then one replay of
every deployment at a common offered load for TTFT. From the run directories it measures what
Table 6 lists (Lambda_max, ratios, mean/P90 TTFT, Theta per stage, offload share, WAN usage),
sets the analytical model's figures beside them, and explains each gap from the records:
- service times and sample: Theta per stage from the prefill times and TPOT the runs measured
  (N / mean measured prefill time; N_d x BS_max / (TPOT x L_out)), and the sample's offload
  share, give a stage bound without queueing;
- queueing: at the lowest unstable probe, which stage's waits grew from the first to the last
  third of arrivals (the fluid model has no queues; bursty Poisson arrivals and skewed lengths
  do, and they grow before a stage reaches 100%);
- transfer tail and batching: the KV transfer tail TTFT paid, and how full decode batches ran.

Writes `table6.md` and `table6.json` into the output directory.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.config.resolved import ResolvedScenario
from testbed.core.record import RequestRecord
from testbed.core.schema.scenario import Scenario
from testbed.deploy.registry import is_simulated
from testbed.metrics.artefacts import Summary
from testbed.metrics.markdown_table import table_lines
from testbed.metrics.run_files import read_run_records
from testbed.metrics.stats import percentile
from testbed.studies.capacity.capacity import (
    CapacityResult,
    Probe,
    model_lambda,
    search,
    trace_workload,
    workload_at,
    write_outputs,
)
from testbed.traces.types import Trace

DEFAULT_GROWTH_S = 2.5  # paper seconds of growth in mean wait that marks a probe unstable


@dataclass
class StageWaits:
    """Mean wait per stage (paper s) in the first and last third of arrivals."""

    stage: str
    first: float
    last: float


@dataclass
class TableRow:
    scenario: str
    policy: str
    threshold: float | None
    instances: str  # N_prfaas / N_p / N_d
    capacity: CapacityResult
    model: dict[str, Any]  # the analytical ModelResult as a dict
    theta_prfaas: float | None = None
    theta_prfaas_compute: float | None = None
    theta_prfaas_link: float | None = None
    theta_pdp: float | None = None
    theta_pdd: float | None = None
    offload_share: float | None = None  # share prefilled in PrfaaS over every probe's requests
    stage_lambda: float | None = None  # min(Theta/p, Theta/(1-p), Theta_pdd) with the measured Thetas
    wan_mean_bps: float | None = None  # counters, arrival window, at the highest stable probe
    wan_records_bps: float | None = None
    common_rate: float | None = None
    ttft_mean_s: float | None = None
    ttft_p90_s: float | None = None
    common_run: str | None = None
    tail_mean_s: float | None = None
    tail_p90_s: float | None = None
    batch_mean: float | None = None
    bs_max: int | None = None
    waits_unstable: list[StageWaits] = field(default_factory=list)
    theta_modelled: dict[str, float | None] = field(default_factory=dict)  # N / mean modelled prefill time
    mean_input: float | None = None
    explanation: str = ""


def _counts(sc: Scenario) -> tuple[int, int, int]:
    n_pf = sum(c.prefill for c in sc.clusters if c.kind == "prfaas")
    n_p = sum(c.prefill for c in sc.clusters if c.kind == "pd")
    n_d = sum(c.decode for c in sc.clusters if c.kind == "pd")
    return n_pf, n_p, n_d


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.fmean(xs) if xs else None


def measured_thetas(sc: Scenario, records: Sequence[RequestRecord], link_bps: float) -> dict[str, float | None]:
    """Stage capacities from measured service times (paper units)."""
    s = sc.scale.speedup
    kinds = {c.name: c.kind for c in sc.clusters}
    done = [r for r in records if r.outcome == "completed"]
    out: dict[str, float | None] = {"prfaas_compute": None, "pdp": None, "prfaas_link": None, "pdd": None}
    for kind, key in (("prfaas", "prfaas_compute"), ("pd", "pdp")):
        total = total_modelled = 0.0
        for c in sc.clusters:
            if c.kind != kind or c.prefill == 0:
                continue
            mine = [r for r in done if r.prefill_cluster == c.name]
            t = _mean([(r.times.prefill_end - r.times.prefill_start) * s for r in mine])
            tm = _mean([r.prefill_modelled * s for r in mine])
            if t:
                total += c.prefill / t
            if tm:
                total_modelled += c.prefill / tm
        out[key] = total or None
        # The same from the modelled durations: separates the testbed's timing from the service model.
        out[f"{key}_modelled"] = total_modelled or None
    crossed = [r.kv_bytes_paper for r in done if r.crossed_wan and kinds.get(r.prefill_cluster) == "prfaas"]
    if crossed:
        out["prfaas_link"] = link_bps / (8.0 * statistics.fmean(crossed))
    tpot = _mean([r.tpot * s for r in done])
    n_seq = 0
    for c in sc.clusters:
        hw = sc.hardware[c.hardware].decode
        if c.kind == "pd" and c.decode and hw is not None:
            n_seq += c.decode * hw.bs_max
    if tpot and n_seq:
        out["pdd"] = n_seq / (tpot * sc.workload.output_tokens)
    return out


def stage_waits(records: Sequence[RequestRecord], speedup: float, kinds: dict[str, str]) -> list[StageWaits]:
    done = sorted((r for r in records if r.outcome == "completed"), key=lambda r: r.times.arrival)
    third = len(done) // 3
    if third < 5:
        return []
    parts = {"first": done[:third], "last": done[-third:]}
    stages: dict[str, Any] = {
        "PrfaaS prefill queue": lambda r: (
            r.times.prefill_start - r.times.prefill_queued if kinds.get(r.prefill_cluster) == "prfaas" else math.nan
        ),
        "PD-P prefill queue": lambda r: (
            r.times.prefill_start - r.times.prefill_queued if kinds.get(r.prefill_cluster) == "pd" else math.nan
        ),
        "KV transfer tail": lambda r: r.times.transfer_end - r.times.prefill_end,
        "decode admission": lambda r: r.times.decode_admitted - r.times.transfer_end,
    }
    out = []
    for name, f in stages.items():
        a, b = (_mean([f(r) * speedup for r in parts[k]]) for k in ("first", "last"))
        if a is not None and b is not None:
            out.append(StageWaits(name, a, b))
    return out


def _batch_mean(run_dir: Path, records: Sequence[RequestRecord]) -> float | None:
    from testbed.metrics.summary import load_run_meta, load_run_timeseries
    from testbed.metrics.timeseries import select

    try:
        samples = load_run_timeseries(run_dir, load_run_meta(run_dir))
    except (OSError, ValueError):
        return None
    arr = [r.times.arrival for r in records if math.isfinite(r.times.arrival)]
    if not arr:
        return None
    lo, hi = min(arr), max(arr)
    by_node: dict[str, list[float]] = {}
    for p in select(samples, metric="running_batch"):
        if lo <= p.t <= hi:
            by_node.setdefault(p.source, []).append(p.value)
    means = [statistics.fmean(v) for v in by_node.values() if v]
    return statistics.fmean(means) if means else None


def _summary(run_dir: Path) -> Summary | None:
    from testbed.metrics.summary import read_summary

    try:
        return read_summary(run_dir / "summary.json")
    except ValueError:  # missing or malformed: the table leaves its cells empty
        return None


def analyse(sc: Scenario, cap: CapacityResult, model: dict[str, Any], link_bps: float) -> TableRow:
    n_pf, n_p, n_d = _counts(sc)
    dep = TableRow(
        sc.name, sc.policy.name, model.get("threshold"), f"{n_pf or '-'} / {n_p or '-'} / {n_d or '-'}", cap, model
    )
    kinds: dict[str, str] = {c.name: c.kind for c in sc.clusters}
    records = [r for p in cap.probes for r in read_run_records(Path(p.run_dir))]
    th = measured_thetas(sc, records, link_bps)
    dep.theta_prfaas_compute, dep.theta_prfaas_link = th["prfaas_compute"], th["prfaas_link"]
    dep.theta_pdp, dep.theta_pdd = th["pdp"], th["pdd"]
    dep.theta_modelled = {"prfaas": th["prfaas_compute_modelled"], "pdp": th["pdp_modelled"]}
    if dep.theta_prfaas_compute is not None:
        dep.theta_prfaas = min(x for x in (dep.theta_prfaas_compute, dep.theta_prfaas_link) if x is not None)
    done = [r for r in records if r.outcome == "completed"]
    if done:
        dep.offload_share = sum(kinds.get(r.prefill_cluster) == "prfaas" for r in done) / len(done)
        dep.mean_input = statistics.fmean(r.input_tokens for r in done)
    p = dep.offload_share
    limits = []
    if dep.theta_prfaas is not None and p:
        limits.append(dep.theta_prfaas / p)
    if dep.theta_pdp is not None and p is not None and p < 1:
        limits.append(dep.theta_pdp / (1 - p))
    if dep.theta_pdd is not None:
        limits.append(dep.theta_pdd)
    dep.stage_lambda = min(limits) if limits else None
    stable = [pr for pr in cap.probes if pr.stable]
    unstable = [pr for pr in cap.probes if not pr.stable]
    best: Probe | None = max(stable, key=lambda pr: pr.rate) if stable else None
    if best is not None:
        run_dir = Path(best.run_dir)
        s = _summary(run_dir)
        if s is not None:
            dep.wan_mean_bps, dep.wan_records_bps = s.wan_link.mean_bps_paper, s.wan_link.records_bps_paper
        recs = read_run_records(run_dir)
        tails = [
            (r.times.transfer_end - r.times.prefill_end) * sc.scale.speedup for r in recs if r.outcome == "completed"
        ]
        dep.tail_mean_s, dep.tail_p90_s = _mean(tails), percentile([x for x in tails if math.isfinite(x)], 90)
        dep.batch_mean = _batch_mean(run_dir, recs)
    hw = [sc.hardware[c.hardware].decode for c in sc.clusters if c.kind == "pd" and c.decode]
    dep.bs_max = hw[0].bs_max if hw and hw[0] is not None else None
    if unstable:
        low = min(unstable, key=lambda pr: pr.rate)
        dep.waits_unstable = stage_waits(read_run_records(Path(low.run_dir)), sc.scale.speedup, kinds)
    dep.explanation = explain(dep, best, min(unstable, key=lambda pr: pr.rate) if unstable else None)
    return dep


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f}%"


def explain(dep: TableRow, best: Probe | None, low: Probe | None) -> str:
    """Why the measured Lambda_max differs from the model's, from this run's own records."""
    m = dep.model
    lam = dep.capacity.lambda_max
    if lam is None:
        return f"No probe was stable (lowest tried {min((p.rate for p in dep.capacity.probes), default=0):.2f} req/s)."
    out = [f"Measured Λ_max {lam:.2f} req/s against the model's {m['lambda_max']:.2f} ({_pct(lam, m['lambda_max'])})."]
    bn = m["bottleneck"]
    meas = {"prfaas": dep.theta_prfaas, "pdp": dep.theta_pdp, "pdd": dep.theta_pdd}[bn]
    model_theta = {"prfaas": m["theta_prfaas"], "pdp": m["theta_pdp"], "pdd": m["theta_pdd"]}[bn]
    if dep.stage_lambda is not None and meas is not None and model_theta:
        out.append(
            f"The model's bottleneck is {bn}; with the service times these runs measured (Θ_{bn} {meas:.2f} vs "
            f"{model_theta:.2f} req/s) and this sample's offload share ({(dep.offload_share or 0):.1%} vs the "
            f"distribution's {m['p']:.1%}), the stage bound is {dep.stage_lambda:.2f} req/s "
            f"({_pct(dep.stage_lambda, m['lambda_max'])})."
        )
        modelled = dep.theta_modelled.get(bn)
        if modelled:
            out.append(
                f"Of Θ_{bn}'s difference, the testbed's own timing is {_pct(meas, modelled)} (N / mean measured vs "
                f"N / mean modelled prefill time, {modelled:.2f}); the rest is the service model: the paper's "
                f"formula evaluates T at the stage's mean length, while requests take T(l) each and T grows faster "
                f"than linearly in l, so N / E[T(L)] < N / T(E[L])"
                + (f", on this sample's lengths (mean input {dep.mean_input / 1000:.1f}K)." if dep.mean_input else ".")
            )
        if lam < dep.stage_lambda:
            out.append(
                f"The remaining {_pct(lam, dep.stage_lambda)} is what queueing costs: bursty Poisson arrivals "
                f"and skewed lengths make waits grow before a stage reaches its fluid limit."
            )
        else:
            out.append(
                "No queueing loss shows at the bisection's resolution: the lowest unstable probe was "
                f"{_f(dep.capacity.lowest_unstable)} req/s."
            )
    if low is not None:
        grown = sorted(dep.waits_unstable, key=lambda w: w.last - w.first, reverse=True)
        if grown and grown[0].last - grown[0].first > 0.05:
            g = grown[0]
            rest = ", ".join(f"{w.stage} {w.first:.2f} -> {w.last:.2f} s" for w in grown[1:])
            out.append(
                f"At {low.rate:.2f} req/s (unstable: {'; '.join(low.reasons)}) the {g.stage} wait grew from "
                f"{g.first:.2f} to {g.last:.2f} s between the first and last third of arrivals ({rest})."
            )
        else:
            out.append(f"At {low.rate:.2f} req/s the probe was unstable: {'; '.join(low.reasons)}.")
    if dep.tail_mean_s is not None and best is not None:
        out.append(
            f"KV transfer tail at {best.rate:.2f} req/s: mean {dep.tail_mean_s * 1e3:.0f} ms, P90 "
            f"{(dep.tail_p90_s or 0) * 1e3:.0f} ms (the model's mean tail: {m['kv_tail_mean_s'] * 1e3:.0f} ms)."
        )
    if dep.batch_mean is not None and dep.bs_max:
        out.append(
            f"Decode batches held {dep.batch_mean:.1f} of BS_max {dep.bs_max} sequences on average "
            f"({dep.batch_mean / dep.bs_max:.0%})."
        )
    return " ".join(out)


async def run_table(
    scenarios: Sequence[ResolvedScenario],
    out: Path,
    backend: str,
    probes: int,
    ttft_slo: float,
    growth_s: float,
    common_rate: float | None,
    spread: float = 0.25,
    trace: Trace | None = None,
) -> list[TableRow]:
    from testbed.model.analytical import evaluate
    from testbed.run.runner import run_replay_async

    deps: list[TableRow] = []
    for rs in scenarios:
        sc, link_bps = rs.spec, rs.inter_dc.rate
        model = evaluate(
            sc, link_bps=link_bps, threshold=_model_threshold(rs), workload=trace_workload(sc, trace)
        ).to_dict()
        lam = model_lambda(sc, link_bps, trace) or 1.0
        d = out / sc.name
        d.mkdir(parents=True, exist_ok=True)
        print(
            f"{sc.name}: model Λ_max {lam:.2f} req/s; bisection in [{(1 - spread) * lam:.2f}, "
            f"{(1 + spread) * lam:.2f}]",
            flush=True,
        )
        cap = await search(
            rs,
            d,
            backend,
            (1 - spread) * lam,
            (1 + spread) * lam,
            probes,
            0.25,
            ttft_slo,
            growth_s=growth_s,
            trace=trace,
        )
        write_outputs(cap, d)
        deps.append(analyse(sc, cap, model, link_bps))
    lams = [x.capacity.lambda_max for x in deps if x.capacity.lambda_max]
    rate = common_rate or (0.75 * min(lams) if lams else None)
    if rate:
        for rs, dep in zip(scenarios, deps):
            rs_r, tr = workload_at(rs, rate, trace)
            run_dir = out / rs.name / f"common-{rate:.3f}"
            print(f"{rs.name}: common load {rate:.3f} req/s", flush=True)
            res = await run_replay_async(rs_r, tr, run_dir, backend, name=f"{rs.name} @ {rate:.3f} req/s")
            dep.common_rate, dep.common_run = rate, str(run_dir)
            dep.ttft_mean_s, dep.ttft_p90_s = res.summary.ttft_s.mean, res.summary.ttft_s.p90
    write_table(deps, out, ttft_slo, growth_s)
    return deps


def _model_threshold(rs: ResolvedScenario) -> int | None:
    return None if rs.threshold is None else int(rs.threshold)


def load_capacity(path: Path) -> CapacityResult:
    d = json.loads(path.read_text())
    probes = [Probe(**p) for p in d.pop("probes")]
    return CapacityResult(**d, probes=probes)


def rebuild_table(scenarios: Sequence[ResolvedScenario], out: Path, ttft_slo: float, growth_s: float) -> list[TableRow]:
    """table6.md again from the run directories a previous `run_table` left (no replays)."""
    from testbed.model.analytical import evaluate

    deps = []
    for rs in scenarios:
        sc, link_bps = rs.spec, rs.inter_dc.rate
        cap = load_capacity(out / sc.name / "capacity.json")
        dep = analyse(sc, cap, evaluate(sc, link_bps=link_bps, threshold=_model_threshold(rs)).to_dict(), link_bps)
        common = sorted((out / sc.name).glob("common-*/summary.json"))
        if common:
            from testbed.metrics.summary import read_summary

            summ = read_summary(common[-1])
            dep.common_rate = float(common[-1].parent.name.split("-", 1)[1])
            dep.common_run = str(common[-1].parent)
            dep.ttft_mean_s, dep.ttft_p90_s = summ.ttft_s.mean, summ.ttft_s.p90
        deps.append(dep)
    write_table(deps, out, ttft_slo, growth_s)
    return deps


def _backend(deps: Sequence[TableRow]) -> str | None:
    """The backend the probes ran on (from a probe's run.json)."""
    for d in deps:
        for p in d.capacity.probes:
            try:
                backend = json.loads((Path(p.run_dir) / "run.json").read_text()).get("backend")
            except (OSError, ValueError):
                continue
            return backend if isinstance(backend, str) else None
    return None


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def write_table(deps: Sequence[TableRow], out: Path, ttft_slo: float, growth_s: float) -> Path:
    base = next((d for d in deps if d.policy == "homogeneous"), deps[0])
    b_meas, b_model = base.capacity.lambda_max, base.model["lambda_max"]

    def rel(d: TableRow) -> str:
        meas = _f(None if d.capacity.lambda_max is None or not b_meas else d.capacity.lambda_max / b_meas, "{:.2f}x")
        return f"{meas} ({d.model['lambda_max'] / b_model:.2f}x)"

    def thetas(d: TableRow) -> str:
        return f"{_f(d.theta_prfaas)} / {_f(d.theta_pdp)} / {_f(d.theta_pdd)}"

    def model_thetas(d: TableRow) -> str:
        m = d.model
        return f"{_f(m['theta_prfaas'])} / {_f(m['theta_pdp'])} / {_f(m['theta_pdd'])}"

    rows: list[tuple[str, list[str]]] = [
        ("threshold t", [_f(None if d.threshold is None else d.threshold / 1000, "{:.1f}K") for d in deps]),
        ("N_prfaas / N_p / N_d", [d.instances for d in deps]),
        (
            "mean / P90 TTFT at the common load, measured (s)",
            [f"{_f(d.ttft_mean_s)} / {_f(d.ttft_p90_s)}" for d in deps],
        ),
        (
            "mean / P90 TTFT, model (queue-free, s)",
            [f"{d.model['ttft_mean_s']:.2f} / {d.model['ttft_p90_s']:.2f}" for d in deps],
        ),
        ("Θ_prfaas / Θ_pdp / Θ_pdd, measured (req/s)", [thetas(d) for d in deps]),
        ("Θ_prfaas / Θ_pdp / Θ_pdd, model (req/s)", [model_thetas(d) for d in deps]),
        ("Λ_max, measured (req/s)", [_f(d.capacity.lambda_max) for d in deps]),
        ("lowest unstable probe (req/s)", [_f(d.capacity.lowest_unstable) for d in deps]),
        ("Λ_max, model (req/s)", [f"{d.model['lambda_max']:.2f}" for d in deps]),
        ("stage bound from measured Θ and sample (req/s)", [_f(d.stage_lambda) for d in deps]),
        (f"relative to {base.scenario}, measured (model)", [rel(d) for d in deps]),
        ("offload share, measured (model)", [f"{_f(d.offload_share, '{:.1%}')} ({d.model['p']:.1%})" for d in deps]),
        (
            "WAN usage at measured Λ_max, counters (Gbit/s)",
            [_f(None if d.wan_mean_bps is None else d.wan_mean_bps / 1e9, "{:.1f}") for d in deps],
        ),
        ("PrfaaS egress at Λ_max, model (Gbit/s)", [f"{d.model['egress_bps'] / 1e9:.1f}" for d in deps]),
    ]
    common = {d.common_rate for d in deps}
    simulated = is_simulated(_backend(deps))
    lines = [
        f"# Table 6 by {'simulation' if simulated else 'emulation'}",
        "",
        "Measured by `testbed capacity` (bisection over offered rates; each probe a full "
        f"{'simulated replay, `--backend sim`' if simulated else 'replay'}) on the "
        "paper's synthetic workload; model figures from `testbed model` beside them.",
        "",
        f"Stable means: every request completed, P90 TPOT within the decode SLO (40 tokens/s, 5% timer "
        f"allowance), P90 TTFT <= {ttft_slo:g} s (stated SLO; the model's queue-free P90 of homogeneous PD "
        f"is already {base.model['ttft_p90_s']:.1f} s), and the mean wait grew by at most {growth_s:g} s from "
        f"the first to the last third of arrivals.",
        "",
    ]
    if len(common) == 1 and None not in common:
        lines += [f"Common load for TTFT: {common.pop():.3f} req/s.", ""]
    lines += table_lines(["metric", *(d.scenario for d in deps)], [[name, *cells] for name, cells in rows])
    lines += ["", "## Where measured and model differ", ""]
    lines += [f"- **{d.scenario}**: {d.explanation}" for d in deps]
    lines += ["", "## Probes", ""]
    for d in deps:
        lines.append(
            f"- {d.scenario}: "
            + ", ".join(
                f"{p.rate:.3f} {'stable' if p.stable else 'unstable'}"
                for p in sorted(d.capacity.probes, key=lambda p: p.rate)
            )
            + f" (`{d.scenario}/capacity.md`)"
        )
    path = out / "table6.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "table6.json").write_text(json.dumps([asdict(d) for d in deps], indent=1, default=str))
    return path
