"""`testbed plan`: plan deployments for a trace with the analytical model, write ready-to-run
scenario files for the best few of each kind, and a report (plan.md, plan.json).

The search is `testbed.model.planner` (pure, vectorised). Here: choosing each kind's base
scenario, the budget syntax, the files, and the hook that verifies the written plans by
simulation: `verify(entries, trace, simulate)` with `simulate(scenario_path, trace_path) ->
figures`; `sim_simulator` supplies one from the runner's `sim` backend when the runner has it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from testbed.config.cli_args import StoreOnce, out_dir
from testbed.config.profiles import load_profile
from testbed.config.scenarios import ScenarioError, load_scenario, resolve_path
from testbed.core.kvsize import KVModel
from testbed.core.scenario import Scenario
from testbed.model.optimise import resolve_threshold
from testbed.model.planner import (
    KINDS,
    OBJECTIVES,
    Candidate,
    Family,
    FamilyPlan,
    Kind,
    Objective,
    PlanError,
    PlanSettings,
    family_for,
    kilo,
    plan_family,
    rank_all,
    scenario_patch,
)
from testbed.model.workload import TraceWorkload
from testbed.traces.csvutil import Window
from testbed.traces.types import Trace

# A verifier: (scenario file, trace file) -> figures of one simulated replay (keys of SIM_FIGURES).
Simulate = Callable[[Path, Path], dict[str, Any]]
SIM_FIGURES = ("ttft_mean_s", "ttft_p90_s", "offload_share", "egress_gbps", "completed_rps", "slo_attainment")
DEFAULT_SCENARIOS = ("paper-prfaas", "paper-homogeneous", "paper-naive")


@dataclass(frozen=True)
class Base:
    name: str
    path: Path
    spec: Scenario


# ---------------------------------------------------------------------------------------------
# Inputs


def parse_budget(texts: Sequence[str]) -> dict[str | None, dict[str, int]]:
    """`[KIND:]HW=N[,HW=N...]` (repeatable) -> {kind or None (every kind): {hardware: instances}}."""
    out: dict[str | None, dict[str, int]] = {}
    for text in texts:
        kind: str | None = None
        body = text
        head, sep, rest = text.partition(":")
        if sep:
            if head not in KINDS:
                raise PlanError(f"--budget {text!r}: {head!r} is not a kind ({', '.join(KINDS)})")
            kind, body = head, rest
        for part in body.split(","):
            hw, eq, n = part.strip().partition("=")
            if not eq or not hw or not n.strip().isdigit() or int(n) < 1:
                raise PlanError(f"--budget {text!r}: expected HW=N with N >= 1, e.g. h200=4,h20=8")
            out.setdefault(kind, {})[hw.strip()] = int(n)
    return out


def _kind_of(sc: Scenario) -> Kind:
    name = sc.policy.name
    assert name in KINDS
    return name


def pick_bases(given: Sequence[Base], kinds: Sequence[Kind]) -> tuple[dict[Kind, Base], list[str]]:
    """Each kind's base: a given scenario of that policy; else prfaas and naive share hardware
    (one derives from the other); else the paper's scenario of that kind if it serves the same
    model. Returns the bases and notes on what was derived or left out."""
    notes: list[str] = []
    out: dict[Kind, Base] = {}
    for kind in kinds:
        own = next((b for b in given if _kind_of(b.spec) == kind), None)
        if own is None and kind in ("prfaas", "naive"):
            other = "naive" if kind == "prfaas" else "prfaas"
            own = next((b for b in given if _kind_of(b.spec) == other), None)
            if own is not None:
                notes.append(f"{kind}: on the hardware of {own.name} (a {other} scenario)")
        if own is None:
            paper = f"paper-{kind}"
            spec = load_scenario(paper)
            if given and spec.model != given[0].spec.model:
                notes.append(f"{kind}: left out (no {kind} scenario given for model {given[0].spec.model.name!r})")
                continue
            own = Base(paper, resolve_path(paper), spec)
            if given:
                notes.append(f"{kind}: no {kind} scenario given, using {paper}")
        out[kind] = own
    return out, notes


def _link(bases: dict[Kind, Base], gbps: float | None) -> tuple[float, float, str]:
    """(rate bit/s, one-way delay s, description): --link-gbps, else the PrfaaS base's inter-DC profile."""
    b = bases.get("prfaas") or bases.get("naive")
    prof = load_profile(b.spec.links.inter_dc) if b is not None else None
    delay = prof.delay if prof is not None else 0.0
    if gbps is not None:
        if not gbps > 0:
            raise PlanError("--link-gbps must be > 0")
        return gbps * 1e9, delay, f"{gbps:g} Gbit/s (--link-gbps), {delay * 1e3:g} ms one way"
    if prof is None:
        return 100e9, 0.0, "100 Gbit/s (no PrfaaS deployment)"
    return prof.rate, delay, f"{prof.name}: {prof.rate / 1e9:g} Gbit/s, {delay * 1e3:g} ms one way"


# ---------------------------------------------------------------------------------------------
# Verification by simulation


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The SIM_FIGURES of a run summary (`testbed.metrics.summary`)."""
    run, ttft = summary.get("run", {}), summary.get("ttft_s", {})
    by = summary.get("bytes", {})
    dur = run.get("duration_s_paper")
    wan = by.get("wan_total_paper")
    thr = summary.get("throughput", {})
    return {
        "ttft_mean_s": ttft.get("mean"),
        "ttft_p90_s": ttft.get("p90"),
        "offload_share": summary.get("offload", {}).get("ratio"),
        "egress_gbps": None if not dur or wan is None else wan * 8.0 / dur / 1e9,
        "completed_rps": thr.get("completed_rps_paper"),
        "slo_attainment": thr.get("slo_attainment"),
    }


class SimUnavailable(Exception):
    """The runner has no simulator backend: the plans stay unverified."""


NOT_VERIFIED = "not verified by simulation"


def sim_simulator(out_dir: Path, window: Window | None, fmt: str) -> Simulate:
    """A Simulate replaying on `runner.run_replay_async(..., backend="sim")` into
    `out_dir/sim/<plan>`; raises SimUnavailable while the runner knows no `sim` backend."""
    import shutil

    from testbed.studies import runner
    from testbed.studies.load import load
    from testbed.traces.loader import load_trace

    def simulate(scenario_path: Path, trace_path: Path) -> dict[str, Any]:
        rs = load(scenario_path)
        trace = load_trace(trace_path, fmt, window=window)
        run_dir = out_dir / "sim" / rs.name
        try:
            res = asyncio.run(runner.run_replay_async(rs, trace, run_dir, backend="sim"))
        except ValueError as e:
            if "unknown backend" not in str(e):
                raise
            shutil.rmtree(run_dir, ignore_errors=True)     # it holds only the scenario it was given
            if run_dir.parent.is_dir() and not any(run_dir.parent.iterdir()):
                run_dir.parent.rmdir()
            raise SimUnavailable(str(e)) from None
        return _figures(res.summary)

    return simulate


def verify(entries: Sequence[tuple[Candidate, Path]], trace: Path, simulate: Simulate | None = None
           ) -> tuple[list[Candidate], str | None]:
    """Each entry's candidate with `simulated` filled in by `simulate` (figures, or {"error": ...}
    when that simulation failed). Returns the candidates and why they were not verified (None
    when they were): no simulator given, or it raised SimUnavailable."""
    if simulate is None:
        return [c for c, _ in entries], f"{NOT_VERIFIED} (no simulator)"
    out = []
    for c, path in entries:
        try:
            figs = simulate(path, trace)
        except SimUnavailable:
            return [c for c, _ in entries], f"{NOT_VERIFIED} (the runner has no sim backend)"
        except Exception as e:  # a failed simulation is reported, it does not lose the plan
            figs = {"error": f"{type(e).__name__}: {e}"}
        out.append(replace(c, simulated=figs))
    return out, None


# ---------------------------------------------------------------------------------------------
# Outputs


def _g(x: float | None, fmt: str = "{:.2f}") -> str:
    """A figure; None is "-"; an infinite TTFT (None in JSON) is a saturated stage."""
    if x is None:
        return "-"
    return "sat." if not math.isfinite(x) else fmt.format(x)


def _key(c: Candidate) -> tuple[Any, ...]:
    """A candidate's identity within a plan (its figures aside)."""
    return (c.kind, c.n_prfaas, c.n_p, c.n_d, c.threshold)


def _t(c: Candidate) -> str:
    return "-" if c.threshold is None else kilo(c.threshold)


def _counts(c: Candidate) -> str:
    return "/".join(str(n) if n else "-" for n in (c.n_prfaas, c.n_p, c.n_d))


def write_plan_file(path: Path, fam: Family, base: Base, c: Candidate, rank: int, of: int, trace: str,
                    objective: str, cache_aware: bool, window: Window | None = None) -> None:
    name = path.stem
    src, here = base.path.resolve(), path.parent.resolve()
    # Relative inside one tree (the repository's runs/ and scenarios/), else absolute.
    rel = os.path.relpath(src, here) if os.path.commonpath([src, here]) != os.sep and \
        len(Path(os.path.commonpath([src, here])).parts) > 2 else str(src)
    body = {"extends": rel, **scenario_patch(fam, c, name, cache_aware)}
    head = [
        f"# testbed plan: {c.kind} rank {rank} of {of} for {trace} (objective {objective}).",
        f"# Predicted: Lambda_max {c.lambda_max:.2f} req/s ({c.bottleneck}); at {c.rate:.2f} req/s mean/P90 TTFT "
        f"{_g(c.ttft_mean_s)}/{_g(c.ttft_p90_s)} s; {c.p:.0%} offloaded; egress {c.egress_bps / 1e9:.1f} Gbit/s.",
        f"# Replay: testbed replay --scenario {path} --trace {trace}{_window_flag(window)}",
    ]
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False, default_flow_style=None))


def _window_flag(window: Window | None) -> str:
    if window is None:
        return ""
    a, b = window
    return f" --window {a:g}:{'' if math.isinf(b) else f'{b:g}'}"


def _row(c: Candidate, file: str = "") -> list[str]:
    sim = c.simulated or {}
    return [
        c.kind, _t(c), _counts(c), f"{c.lambda_max:.2f}", c.bottleneck,
        f"{_g(c.ttft_mean_s)} / {_g(c.ttft_p90_s)}",
        f"{_g(sim.get('ttft_mean_s'))} / {_g(sim.get('ttft_p90_s'))}" if c.simulated else "-",
        f"{c.p:.0%}", f"{c.egress_bps / 1e9:.1f} ({c.egress_share:.0%})",
        "yes" if c.meets_slo else "no", file,
    ]


_HEAD = ["kind", "t", "N_prfaas/N_p/N_d", "Λ_max (req/s)", "bottleneck", "TTFT mean / P90 (s)",
         "simulated TTFT mean / P90 (s)", "offloaded", "egress Gbit/s (link)", "meets SLO", "file"]


def _md_table(rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def report_md(ctx: dict[str, Any], plans: Sequence[FamilyPlan], ranked: Sequence[Candidate],
              files: dict[tuple[Any, ...], str], verified_note: str | None) -> str:
    wl: dict[str, Any] = ctx["workload"]
    s: PlanSettings = ctx["settings"]
    lines = [
        f"# Deployment plan for {wl['source']}",
        "",
        f"Objective: **{s.objective}** ({_objective_text(s)}); TTFT SLO {s.ttft_slo_s:g} s on the "
        f"P{s.quantile * 100:.0f}, TPOT SLO {s.tpot_slo_s * 1e3:g} ms. Link: {ctx['link']}.",
        "",
        "## Workload (as the model reads the trace)",
        "",
        f"- {wl['requests']:,} requests over {wl['duration_s']:,.0f} s: **{wl['rate_rps']:.3f} req/s**, "
        f"the rate every TTFT below is estimated at",
        f"- input tokens: mean {wl['input_tokens']['mean']:,.0f}, P90 {wl['input_tokens']['p90']:,.0f}; "
        f"incremental (uncached): mean {wl['uncached_tokens']['mean']:,.0f}, P90 {wl['uncached_tokens']['p90']:,.0f}",
        f"- cached: {wl['cached_share']:.1%} of prompt tokens ({wl['cache_rule']}, one unbounded cache filled by "
        f"the earlier requests); {wl['reuse_share']:.1%} of blocks were seen earlier anywhere",
        f"- output tokens: mean {wl['output_tokens']['mean']:,.0f} (drives Θ_pdd = N_d·BS_max / (T_decode·L_out))",
        "",
        "## Best of each kind",
        "",
    ]
    best_rows = []
    for fp in plans:
        if fp.candidates:
            c = fp.candidates[0]
            best_rows.append(_row(c, files.get(_key(c), "")))
    lines += _md_table(best_rows)
    refs = [fp.reference for fp in plans if fp.reference is not None]
    if refs:
        lines += ["", "## The base scenarios as they stand", ""]
        rows = []
        for r in refs:
            pos = 1 + sum(1 for c in ranked if _better(c, r, s.objective))
            rows.append(_row(r, f"would rank {pos} of {len(ranked) + 1}"))
        lines += _md_table(rows)
        for r in refs:
            for n in r.notes:
                lines.append(f"- {r.label}: {n}")
    lines += ["", "## Ranking (every kind)", ""]
    lines += _md_table([_row(c, files.get(_key(c), "")) for c in ranked[: ctx["show"]]])
    if len(ranked) > ctx["show"]:
        lines.append(f"\n({len(ranked) - ctx['show']} more in plan.json)")
    if ctx.get("vary_counts"):
        lines += ["", "## Fewest instances meeting the SLOs at the trace's rate, per kind", ""]
        rows = []
        for fp in plans:
            ok = [c for c in fp.candidates if c.meets_slo]
            if ok:
                c = min(ok, key=lambda x: (x.instances, ranked.index(x)))
                rows.append(_row(c, files.get(_key(c), "")))
        lines += _md_table(rows) if rows else ["none meets the SLOs"]
    lines += ["", "## Simulation", ""]
    if verified_note:
        lines.append(f"The written plans are **{verified_note}**: every figure above is the model's.")
    else:
        lines.append("Each written plan was replayed on the simulator (`--backend sim`) with the trace; "
                     "predicted against simulated:")
        lines.append("")
        lines.append("| file | Λ_max model | TTFT mean model / sim (s) | TTFT P90 model / sim (s) | offloaded model / sim "
                     "| egress Gbit/s model / sim | completed req/s sim | SLO attainment sim |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for c in ranked:
            if c.simulated is None:
                continue
            sm = c.simulated
            if "error" in sm:
                lines.append(f"| {files.get(_key(c), '')} | {c.lambda_max:.2f} | failed: {sm['error']} |||||| ")
                continue
            lines.append(
                f"| {files.get(_key(c), '')} | {c.lambda_max:.2f} | {_g(c.ttft_mean_s)} / {_g(sm.get('ttft_mean_s'))} "
                f"| {_g(c.ttft_p90_s)} / {_g(sm.get('ttft_p90_s'))} | {c.p:.0%} / {_g(sm.get('offload_share'), '{:.0%}')} "
                f"| {c.egress_bps / 1e9:.1f} / {_g(sm.get('egress_gbps'), '{:.1f}')} | {_g(sm.get('completed_rps'))} "
                f"| {_g(sm.get('slo_attainment'), '{:.0%}')} |")
    lines += ["", "## How the figures are made", ""]
    lines += [f"- {a}" for a in ASSUMPTIONS]
    lines += [f"- {n}" for n in ctx["notes"]]
    lines.append(f"- planning took {ctx['seconds']:.1f} s")
    return "\n".join(lines) + "\n"


ASSUMPTIONS = (
    "Λ_max and the Θs are the paper's formulas (section 3.4) on the trace's empirical incremental-length "
    "distribution: Θ = N / T_prefill(E[L | routed]); `testbed model --scenario FILE --trace TRACE` gives the same.",
    "The threshold is on the incremental length, as the paper defines it; the plan files therefore turn on "
    "cache-aware routing (`policy.cache_aware`) when the trace has prefix reuse.",
    "TTFT at the trace's rate: each prefill stage an M/G/c queue (Allen-Cunneen) on the service times of the "
    "lengths routed to it; decode slots an M/G/(N_d·BS_max) queue; offloaded requests add the last layer's KV "
    "over the link and its one-way delay; plus one decode step. Bursts in the trace are not modelled (Poisson).",
    "Egress is the KV of offloaded requests at the trace's rate; prefix moves toward PrfaaS and link "
    "contention are not modelled.",
    "Prefill time of cached tokens (`cached_token_s`) and decode per-sequence terms are not modelled, as in "
    "`testbed model`.",
    "Each (counts, split) gets its best threshold among the trace's distinct incremental lengths; the best few "
    "then move to the roundest nearby threshold costing at most 0.5% of the objective's figures.",
)


def _objective_text(s: PlanSettings) -> str:
    return {"lambda": "highest Λ_max, ties to lower mean TTFT", "ttft": "lowest mean TTFT at the trace's rate",
            "ttft-p90": f"lowest P{s.quantile * 100:.0f} TTFT at the trace's rate"}[s.objective]


def _better(a: Candidate, b: Candidate, objective: Objective) -> bool:
    from testbed.model.planner import objective_key
    return objective_key(a, objective) < objective_key(b, objective)


# ---------------------------------------------------------------------------------------------
# The command


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from testbed.traces.command import WINDOW_HELP, window_arg
    from testbed.traces.loader import SUPPORTED_FORMATS

    p = sub.add_parser(
        "plan", help="plan threshold, P/D split and instance counts for a trace with the analytical model",
        description="Searches, for each deployment kind on its own hardware, the threshold t, the PD cluster's "
                    "N_p/N_d split and optionally the instance counts; ranks them by the model on the trace's "
                    "empirical workload; writes ready-to-run scenario files for the best few of each kind and "
                    "a report (plan.md, plan.json).",
    )
    p.add_argument("--trace", action=StoreOnce, required=True, help="trace file (Mooncake JSONL with hash_ids, Azure or BurstGPT CSV)")
    p.add_argument("--format", default="auto", choices=("auto", *SUPPORTED_FORMATS))
    p.add_argument("--window", type=window_arg, metavar="START:END", help=f"plan for this part of the trace: {WINDOW_HELP}")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help="a base scenario (repeatable); its policy says which kind it is the base of "
                        f"(default: {', '.join(DEFAULT_SCENARIOS)})")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default all)")
    p.add_argument("--objective", choices=OBJECTIVES, default="lambda",
                   help="lambda: highest Λ_max; ttft / ttft-p90: lowest mean / P90 TTFT at the trace's rate")
    p.add_argument("--ttft-slo", type=float, metavar="S", help="P90 TTFT SLO, paper seconds (default: the base's slo.ttft_s)")
    p.add_argument("--tpot-slo", type=float, metavar="S", help="TPOT SLO, paper seconds (default: the base's slo.tpot_s)")
    p.add_argument("--budget", action="append", default=[], metavar="[KIND:]HW=N,...",
                   help="instances per hardware, e.g. h200=4,h20=8 or homogeneous:h20=12 (default: each base's counts)")
    p.add_argument("--vary-counts", action="store_true", help="also try every smaller instance count within the budget")
    p.add_argument("--link-gbps", type=float, help="PrfaaS egress link (default: the base's inter-DC link profile)")
    p.add_argument("--top", type=int, default=3, metavar="N", help="scenario files written per kind (default 3)")
    p.add_argument("--verify", type=int, default=1, metavar="N",
                   help="simulate the best N written plans of each kind when the sim backend exists (default 1; 0 = off)")
    p.add_argument("--out", action=StoreOnce, type=out_dir, help="output directory (default runs/plan-<trace name>)")
    p.add_argument("--json", action="store_true", help="print plan.json instead of the summary")
    p.set_defaults(func=cmd_plan)


def _kinds(text: str) -> list[Kind]:
    out: list[Kind] = []
    for k in (x.strip() for x in text.split(",") if x.strip()):
        if k not in KINDS:
            raise PlanError(f"--kinds: {k!r} is not one of {', '.join(KINDS)}")
        out.append(k)
    if not out:
        raise PlanError("--kinds: give at least one kind")
    return out


def run_plan(args: argparse.Namespace, simulate: Simulate | None | str = "auto") -> dict[str, Any]:
    """The whole command without printing: returns plan.json's content. `simulate`: "auto" uses
    the sim backend when it exists; None never simulates; a callable is used as is."""
    from testbed.traces.loader import load_trace

    t0 = time.monotonic()
    if args.top < 1 or args.verify < 0:
        raise PlanError("--top must be >= 1 and --verify >= 0")
    given = [Base(n, resolve_path(n), load_scenario(n)) for n in (args.scenario or [])]
    for b in given:
        if not (b.spec.policy.name in KINDS):
            raise PlanError(f"scenario {b.name!r}: policy {b.spec.policy.name!r} is not a kind")
    bases, notes = pick_bases(given, _kinds(args.kinds))
    if not bases:
        raise PlanError("no kind left to plan")
    budgets = parse_budget(args.budget)
    trace_path = Path(args.trace)
    trace: Trace = load_trace(trace_path, args.format, window=args.window)
    if len(trace) < 2:
        raise PlanError(f"{trace_path}: {len(trace)} request(s){' in the window' if args.window else ''}; "
                        "the rate needs at least two")
    link_bps, delay, link_text = _link(bases, args.link_gbps)
    first = next(iter(bases.values())).spec
    settings = PlanSettings(
        ttft_slo_s=args.ttft_slo if args.ttft_slo is not None else first.slo.ttft_s,
        tpot_slo_s=args.tpot_slo if args.tpot_slo is not None else first.slo.tpot_s,
        objective=args.objective, link_bps=link_bps, link_delay_s=delay,
    )
    workloads: dict[bool, TraceWorkload] = {}
    plans: list[FamilyPlan] = []
    for kind, base in bases.items():
        kv = KVModel.from_spec(base.spec.model)
        linear = "linear" in kv.kinds
        if linear not in workloads:
            workloads[linear] = TraceWorkload.from_trace(trace, kv)
        tw = workloads[linear]
        budget = {**budgets.get(None, {}), **budgets.get(kind, {})}
        fam = family_for(kind, base.spec, budget, args.vary_counts)
        ref_t = None
        if kind == "prfaas" and base.spec.policy.name == "prfaas":
            ref_t = float(resolve_threshold(base.spec, link_bps))
        plans.append(plan_family(fam, tw.model_workload(), settings, ref_t))
    tw0 = next(iter(workloads.values()))
    out_dir: Path = args.out or Path("runs") / f"plan-{trace_path.stem}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("plan-*-*.yaml"):
        old.unlink()
    cache_aware = tw0.cached_share > 0
    files: dict[tuple[Any, ...], str] = {}
    entries: list[tuple[Candidate, Path]] = []
    for fp in plans:
        kind = fp.family.kind
        for rank, c in enumerate(fp.candidates[: args.top], 1):
            path = out_dir / f"plan-{kind}-{rank}.yaml"
            write_plan_file(path, fp.family, bases[kind], c, rank, len(fp.candidates), str(trace_path),
                            settings.objective, cache_aware, args.window)
            files[_key(c)] = path.name
            if rank <= args.verify:
                entries.append((c, path))
    sim: Simulate | None
    if simulate == "auto":
        sim = sim_simulator(out_dir, args.window, args.format)
    else:
        sim = simulate if callable(simulate) else None
    verified: list[Candidate] = []
    why: str | None = f"{NOT_VERIFIED} (--verify 0)"
    if entries:
        verified, why = verify(entries, trace_path, sim)
    sims = {_key(v): v.simulated for v in verified if v.simulated is not None}
    plans = [replace(fp, candidates=tuple(replace(c, simulated=sims.get(_key(c))) for c in fp.candidates))
             for fp in plans]
    ranked = rank_all(plans, settings.objective)
    ctx = {"workload": tw0.summary(), "settings": settings, "link": link_text, "notes": notes,
           "show": max(10, args.top * len(plans)), "vary_counts": args.vary_counts,
           "seconds": time.monotonic() - t0}
    (out_dir / "plan.md").write_text(report_md(ctx, plans, ranked, files, why))
    result = {
        "trace": str(trace_path), "window": list(args.window) if args.window else None,
        "workload": tw0.summary(),
        "settings": {"objective": settings.objective, "ttft_slo_s": settings.ttft_slo_s,
                     "tpot_slo_s": settings.tpot_slo_s, "link_bps": link_bps, "link_delay_s": delay,
                     "vary_counts": args.vary_counts, "cache_aware": cache_aware},
        "bases": {k: str(b.path) for k, b in bases.items()},
        "notes": notes, "verified": why is None, "verification": why or "simulated",
        "kinds": {fp.family.kind: {"best": ({**fp.candidates[0].to_dict(), "file": files.get(_key(fp.candidates[0]))}
                                            if fp.candidates else None),
                                   "reference": fp.reference.to_dict() if fp.reference else None,
                                   "candidates": len(fp.candidates)} for fp in plans},
        "ranking": [{**c.to_dict(), "file": files.get(_key(c))} for c in ranked],
        "out": str(out_dir), "seconds": time.monotonic() - t0,
    }
    (out_dir / "plan.json").write_text(json.dumps(result, indent=1))
    return result


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        res = run_plan(args)
    except (PlanError, ScenarioError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    _print_summary(res)
    return 0


def _print_summary(res: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    wl = res["workload"]
    con = Console()
    con.print(f"trace {res['trace']}: {wl['requests']:,} requests, {wl['rate_rps']:.3f} req/s, input mean "
              f"{wl['input_tokens']['mean']:,.0f} (uncached {wl['uncached_tokens']['mean']:,.0f}, "
              f"{wl['cached_share']:.0%} cached), output mean {wl['output_tokens']['mean']:,.0f}")
    tab = Table(title=f"objective {res['settings']['objective']}; TTFT (s) at {wl['rate_rps']:.2f} req/s",
                box=box.SIMPLE_HEAD)
    for h in ("", "t", "Nf/Np/Nd", "Λmax", "TTFT mean/P90", "off.", "egress", "SLO"):
        tab.add_column(h, justify="left" if not h else "right", no_wrap=True)
    files: list[str] = []

    def ttft(x: float | None) -> str:
        return "sat." if x is None else f"{x:.2f}"     # JSON keeps an infinite TTFT as null

    def add(tag: str, c: dict[str, Any]) -> None:
        t = "-" if c["threshold"] is None else kilo(c["threshold"])
        counts = "/".join(str(n) if n else "-" for n in (c["n_prfaas"], c["n_p"], c["n_d"]))
        tt = f"{ttft(c['ttft_mean_s'])}/{ttft(c['ttft_p90_s'])}"
        tab.add_row(tag, t, counts, f"{c['lambda_max']:.2f}", tt, f"{c['p']:.0%}",
                    f"{c['egress_bps'] / 1e9:.1f}G", "yes" if c["meets_slo"] else "no")

    for kind, k in res["kinds"].items():
        if k["best"]:
            add(kind, k["best"])
            files.append(f"{kind}: {res['out']}/{k['best']['file']} (bottleneck {k['best']['bottleneck']})")
        if k["reference"]:
            add("  as given", k["reference"])
    con.print(tab)
    for f in files:
        con.print(f"plan {f}")
    for n in res["notes"]:
        con.print(f"note: {n}")
    if not res["verified"]:
        con.print(f"{res['verification']}")
    con.print(f"report: {res['out']}/plan.md  ({res['seconds']:.1f} s)")
