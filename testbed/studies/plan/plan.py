"""`testbed plan`: plan deployments for a trace with the analytical model, check and rank the best
by simulation, write ready-to-run scenario files for the best few of each kind and a report
(plan.md, plan.json).

The search is `testbed.model.planner` (pure, vectorised): per kind, every split (and with
`--vary-counts` every count) with its best threshold, ranked by a queueing estimate that reads
the trace's burstiness and replays its prefix cache. Here: the bases and the budget, then
- the best `max(--refine, --top)` of each kind are scored again on their own routing and
  replayed on the simulator (`plan_sim`), as are the base scenarios as they stand and, with
  `--vary-counts`, the smallest deployment meeting the SLOs; a simulated row's SLO verdict is
  the simulator's, and simulated rows rank by their simulated TTFT (`plan_sim.refined_key`);
- the files and plan.md (`plan_report`); the flags and the printed summary are `plan_command`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from testbed.config import run_lock
from testbed.config.profiles import load_profile
from testbed.config.scenarios import load_scenario, resolve_path
from testbed.core.engine.kvsize import KVModel
from testbed.core.finite_json import dumps as finite_dumps
from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.scenario import Scenario
from testbed.core.sessions import ROOT, ArrivalMode
from testbed.model.analytical import Workload
from testbed.model.batching import scheduler_text
from testbed.model.optimise import resolve_threshold
from testbed.model.planner import (
    KINDS,
    Candidate,
    Family,
    FamilyPlan,
    Kind,
    PlanError,
    PlanSettings,
    family_for,
    family_workload,
    kind_pools,
    objective_key,
    plan_family,
    score_config,
)
from testbed.model.workload import TraceWorkload
from testbed.studies.plan.plan_figure import write_plan_figure
from testbed.studies.plan.plan_progress import PlanProgress
from testbed.studies.plan.plan_report import ReportContext, Rows, key, report_md, scenario_file, slug, write_plan_file
from testbed.studies.plan.plan_result import KindPlan, PlanOptions, PlanResult
from testbed.studies.plan.plan_sim import (
    NOT_VERIFIED,
    SIM_FIGURES,
    Simulate,
    SimUnavailable,
    figures,
    refined_key,
    sim_simulator,
    simulate_rows,
)
from testbed.traces.files import open_trace
from testbed.traces.sessions import run_sessions
from testbed.traces.types import Trace

__all__ = [
    "SIM_FIGURES",
    "SimUnavailable",
    "figures",
    "sim_simulator",
    "run_plan",
    "parse_budget",
    "pick_bases",
    "Base",
    "PlanOptions",
    "PlanResult",
]

DEFAULT_SCENARIOS = ("paper-prfaas", "paper-homogeneous", "paper-naive")
# With --vary-counts: smallest deployments meeting the SLOs by the model tried per kind until
# one meets them by simulation (and at most four times as many scored on their own routing).
FEWEST_TRIES = 3


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


def _same_hardware(kind: Kind) -> Kind | None:
    """The kind whose base scenario can stand in for `kind`'s: PrfaaS and naive use the same
    clusters, homogeneous has no PrfaaS cluster."""
    match kind:
        case "prfaas":
            return "naive"
        case "naive":
            return "prfaas"
        case "homogeneous":
            return None
        case _:
            unknown_kind("policy", kind)


def pick_bases(given: Sequence[Base], kinds: Sequence[Kind]) -> tuple[dict[Kind, Base], list[str]]:
    """Each kind's base: a given scenario of that policy; else prfaas and naive share hardware
    (one derives from the other); else the paper's scenario of that kind if it serves the same
    model. Returns the bases and notes on what was derived or left out."""
    notes: list[str] = []
    out: dict[Kind, Base] = {}
    for kind in kinds:
        own = next((b for b in given if _kind_of(b.spec) == kind), None)
        other = _same_hardware(kind)
        if own is None and other is not None:
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


def _kinds(text: str) -> list[Kind]:
    out: list[Kind] = []
    for k in (x.strip() for x in text.split(",") if x.strip()):
        if k not in KINDS:
            raise PlanError(f"--kinds: {k!r} is not one of {', '.join(KINDS)}")
        out.append(k)
    if not out:
        raise PlanError("--kinds: give at least one kind")
    return out


def _instances(kind: Kind, base: Scenario) -> dict[str, int]:
    """Instances per hardware name that `kind` deploys on `base`."""
    have: dict[str, int] = {}
    for c in base.clusters:
        if c.kind == "pd" or (c.kind == "prfaas" and kind_pools(kind).prfaas):
            have[c.hardware] = have.get(c.hardware, 0) + c.prefill + c.decode
    return have


def check_budget(budgets: dict[str | None, dict[str, int]], bases: Mapping[Kind, Scenario]) -> None:
    """A budget naming hardware that no planned kind deploys would be ignored: refuse it instead."""
    for kind, budget in budgets.items():
        if kind is not None and kind not in bases:
            raise PlanError(f"--budget {kind}:...: kind {kind!r} is not planned (--kinds {','.join(bases)})")
        scope = {k: b for k, b in bases.items() if kind is None or k == kind}
        known = {hw for k, b in scope.items() for hw in _instances(k, b)}
        where = "the bases" if kind is None else f"{kind}'s base"
        for hw, n in budget.items():
            if hw not in known:
                raise PlanError(
                    f"--budget {kind + ':' if kind else ''}{hw}={n}: no hardware {hw!r} in {where} "
                    f"(it deploys {', '.join(sorted(known)) or 'none'})"
                )


def budget_for(
    kind: Kind, base: Scenario, budgets: dict[str | None, dict[str, int]]
) -> tuple[dict[str, int], str, str | None]:
    """The budget a kind plans within, how to read it, and a note when a budget given for every
    kind caps this one below its base's own instances of that hardware."""
    shared, own = budgets.get(None, {}), budgets.get(kind, {})
    budget = {**shared, **own}
    have = _instances(kind, base)
    parts = []
    for hw in have:
        src = f"{kind}:" if hw in own else "every kind" if hw in shared else None
        n = budget.get(hw, have[hw])
        parts.append(f"{hw}={n} ({'--budget ' + src if src else 'base'})")
    note = None
    capped = [hw for hw in have if hw in shared and hw not in own and shared[hw] < have[hw]]
    if capped:
        what = ",".join(f"{hw}={shared[hw]}" for hw in capped)
        note = (
            f"{kind}: --budget {what} (given without a kind) caps it below its base's "
            f"{', '.join(f'{have[hw]} {hw}' for hw in capped)}; prefix a kind (e.g. prfaas:{what}) to cap one kind"
        )
    return budget, ", ".join(parts), note


def search(
    fam: Family, trace: Trace, settings: PlanSettings, step: Callable[[str], None] = lambda _: None
) -> tuple[FamilyPlan, Workload]:
    """The family's ranked candidates on its workload; a threshold kind searches twice, the second
    time with the prefix cache replayed under the first search's best threshold."""
    step(f"replaying the {fam.kind} prefix cache over the trace")
    wl = family_workload(fam, trace).model_workload()
    step(f"searching the {fam.kind} deployments")
    fp = plan_family(fam, wl, settings)
    if kind_pools(fam.kind).threshold and fp.candidates:
        step(f"replaying the {fam.kind} prefix cache under threshold {fp.candidates[0].threshold:,.0f}")
        wl = family_workload(fam, trace, fp.candidates[0].threshold).model_workload()
        step(f"searching the {fam.kind} deployments again")
        fp = plan_family(fam, wl, settings)
    return fp, wl


def rescored(
    fam: Family,
    wl: Workload,
    trace: Trace,
    settings: PlanSettings,
    cands: Sequence[Candidate],
    cache_aware: bool,
    step: Callable[[str], None] = lambda _: None,
) -> list[Candidate]:
    """Candidates scored on their own routing (`planner.score_config`), ranked by the model."""
    out = []
    for i, c in enumerate(cands, 1):
        step(f"scoring {fam.kind} deployment {i} of {len(cands)} on its own routing")
        out.append(score_config(fam, wl, trace, settings, c.n_prfaas, c.n_p, c.n_d, c.threshold, cache_aware))
    return sorted(out, key=lambda c: objective_key(c, settings.objective))


def reference(
    fam: Family, base: Base, wl: Workload, trace: Trace, settings: PlanSettings, link_bps: float
) -> tuple[Candidate, str] | None:
    """The base scenario as it stands, on its own routing; None when it is not of this kind."""
    sc = base.spec
    if sc.policy.name != fam.kind:
        return None
    pd = sc.cluster(fam.pd_cluster)
    n_prf = sc.cluster(fam.prfaas_cluster).prefill if fam.prfaas_cluster else 0
    t = resolve_threshold(sc, link_bps) if kind_pools(fam.kind).threshold else None
    c = score_config(fam, wl, trace, settings, n_prf, pd.prefill, pd.decode, t, sc.policy.cache_aware)
    if kind_pools(fam.kind).threshold:
        how = "cache-aware routing" if sc.policy.cache_aware else "length-only routing"
    else:
        how = "cache-aware" if sc.policy.cache_aware else "not cache-aware: the whole KV ships"
    return c, f"{base.name} ({how})"


def run_plan(
    args: PlanOptions, simulate: Simulate | None | str = "auto", progress: PlanProgress | None = None
) -> PlanResult:
    """The whole command; writes plan.json (the result's `to_json()`). `simulate`: "auto" uses the sim backend
    when it exists (unless --no-sim); None never simulates; a callable is used as is. `progress`
    hears each step (None: silent)."""
    from testbed.traces.loader import load_trace

    step = progress if progress is not None else PlanProgress(quiet=True)

    t0 = time.monotonic()
    if args.top < 1 or args.refine < 0:
        raise PlanError("--top must be >= 1 and --refine >= 0")
    given = [Base(n, resolve_path(n), load_scenario(n)) for n in args.scenario]
    for b in given:
        if b.spec.policy.name not in KINDS:
            raise PlanError(f"scenario {b.name!r}: policy {b.spec.policy.name!r} is not a kind")
    bases, notes = pick_bases(given, _kinds(args.kinds))
    if not bases:
        raise PlanError("no kind left to plan")
    budgets = parse_budget(args.budget)
    check_budget(budgets, {k: b.spec for k, b in bases.items()})
    trace_path = Path(args.trace)
    # A trace that cannot be opened is one line, before any progress line.
    open_trace(trace_path).close()
    step(f"loading the trace {trace_path}")
    trace: Trace = load_trace(trace_path, args.format, window=args.window)
    if len(trace) < 2:
        raise PlanError(
            f"{trace_path}: {len(trace)} request(s){' in the window' if args.window else ''}; "
            "the rate needs at least two"
        )
    link_bps, delay, link_text = _link(bases, args.link_gbps)
    first = next(iter(bases.values())).spec
    arrivals: ArrivalMode = args.arrivals or first.workload.arrivals
    # As the simulator finds them: stated, or (closed loop only) inferred from the hash ids.
    splan = run_sessions(trace, arrivals)
    sessions = 0 if splan is None else len({splan.session[i] for i, p in enumerate(splan.parent) if p != ROOT})
    settings = PlanSettings(
        ttft_slo_s=args.ttft_slo if args.ttft_slo is not None else first.slo.ttft_s,
        tpot_slo_s=args.tpot_slo if args.tpot_slo is not None else first.slo.tpot_s,
        objective=args.objective,
        link_bps=link_bps,
        link_delay_s=delay,
    )
    step(f"measuring the workload of {len(trace):,} requests (prefix reuse, lengths)")
    tw0 = TraceWorkload.from_trace(trace, KVModel.from_spec(first.model))
    cache_aware = tw0.cached_share > 0
    out_dir: Path = args.out or Path("runs") / f"plan-{trace_path.stem}"
    run_lock.acquire(out_dir, args.overwrite)  # this command's until it returns
    for old in (*out_dir.glob("plan-*-*.yaml"), *out_dir.glob("candidates/*.yaml")):
        old.unlink()
    sim: Simulate | None
    if simulate == "auto":
        sim = None if args.no_sim else sim_simulator(out_dir, args.window, args.format, arrivals)
    else:
        sim = simulate if callable(simulate) else None
    pool = max(args.refine, args.top) if sim is not None else 0

    # The model: search, then the shortlist of each kind and the bases scored on their own routing.
    plans: list[FamilyPlan] = []
    workloads: dict[Kind, Workload] = {}
    budget_text: dict[str, str] = {}
    refs: dict[Kind, tuple[Candidate, str]] = {}
    for kind, base in bases.items():
        budget, budget_text[kind], note = budget_for(kind, base.spec, budgets)
        if note:
            notes.append(note)
        fam = family_for(kind, base.spec, budget, args.vary_counts)
        fp, wl = search(fam, trace, settings, step)
        n = max(pool, args.top)
        fp = replace(
            fp,
            candidates=(*rescored(fam, wl, trace, settings, fp.candidates[:n], cache_aware, step), *fp.candidates[n:]),
        )
        plans.append(fp)
        workloads[kind] = wl
        if base.spec.policy.name == fam.kind:
            step(f"scoring {base.name} as it stands")
        if (ref := reference(fam, base, wl, trace, settings, link_bps)) is not None:
            refs[kind] = ref

    # The simulator: the shortlist, the bases, then the smallest deployments meeting the SLOs.
    cand_dir = out_dir / "candidates"
    rows: list[tuple[Candidate, Path, str]] = []
    for fp in plans:
        for c in fp.candidates[:pool]:
            cand_dir.mkdir(exist_ok=True)
            path = cand_dir / f"{slug(c)}.yaml"
            scenario_file(path, fp.family, bases[fp.family.kind].path, c, cache_aware)
            rows.append((c, path, slug(c)))
    if sim is not None:
        rows += [(c, bases[kind].path, bases[kind].name) for kind, (c, _) in refs.items()]
        step(f"simulating {len({name for _, _, name in rows})} deployments")
    done, why = simulate_rows(rows, trace_path, sim, settings) if rows or sim is None else ({}, None)
    fewest: list[Candidate] = []
    if args.vary_counts:
        step("finding the smallest deployments that meet the SLOs")
        for fp in plans:
            c_few = _fewest(
                fp,
                workloads[fp.family.kind],
                trace,
                settings,
                cache_aware,
                sim if why is None else None,
                done,
                trace_path,
                cand_dir,
                bases[fp.family.kind],
            )
            if c_few is not None:
                fewest.append(c_few)
    if why is None and sim is None:
        why = f"{NOT_VERIFIED} (--no-sim)"

    # Final rankings: simulated rows by the simulator, then the rest by the model.
    def final(cands: Sequence[Candidate]) -> list[Candidate]:
        got = [done.get(slug(c), c) for c in cands]
        simd = sorted((c for c in got if c.simulated is not None), key=lambda c: refined_key(c, settings.objective))
        rest = sorted((c for c in got if c.simulated is None), key=lambda c: objective_key(c, settings.objective))
        return simd + rest

    model_first = {fp.family.kind: fp.candidates[0] for fp in plans if fp.candidates}
    plans = [replace(fp, candidates=tuple(final(fp.candidates))) for fp in plans]
    ranked = final([c for fp in plans for c in fp.candidates])
    references = [(done.get(bases[k].name, c), how) for k, (c, how) in refs.items()]
    for i, (r, how) in enumerate(references):
        pos = 1 + sum(
            1
            for c in ranked
            if (
                refined_key(c, settings.objective) < refined_key(r, settings.objective)
                if c.simulated is not None and r.simulated is not None
                else objective_key(c, settings.objective) < objective_key(r, settings.objective)
            )
        )
        references[i] = (r, f"{how}; would rank {pos} of {len(ranked) + 1}")
    fewest = [done.get(slug(c), c) for c in fewest]

    step(f"writing the plan to {out_dir}")
    files: dict[tuple[Any, ...], str] = {}
    for fp in plans:
        kind = fp.family.kind
        for rank, c in enumerate(fp.candidates[: args.top], 1):
            path = out_dir / f"plan-{kind}-{rank}.yaml"
            write_plan_file(
                path,
                fp.family,
                bases[kind].path,
                c,
                rank,
                len(fp.candidates),
                str(trace_path),
                settings.objective,
                cache_aware,
                args.window,
            )
            files[key(c)] = path.name
    for c in fewest:
        if key(c) not in files:
            fam = next(fp.family for fp in plans if fp.family.kind == c.kind)
            path = out_dir / f"plan-{c.kind}-fewest.yaml"
            write_plan_file(
                path,
                fam,
                bases[c.kind].path,
                c,
                ranked.index(c) + 1 if c in ranked else 0,
                len(ranked),
                str(trace_path),
                settings.objective,
                cache_aware,
                args.window,
            )
            files[key(c)] = path.name

    best = sorted((fp.candidates[0] for fp in plans if fp.candidates), key=ranked.index)
    report_rows = Rows(
        best=best,
        references=references,
        ranking=ranked,
        fewest=fewest,
        simulated=pool,
        refined={
            k: (done.get(slug(c), c), next(fp.candidates[0] for fp in plans if fp.family.kind == k))
            for k, c in model_first.items()
        }
        if done
        else {},
    )
    schedulers = {
        hw: scheduler_text(bases[fp.family.kind].spec.hardware[hw].scheduler)
        for fp in plans
        for hw in (fp.family.prfaas_hw, fp.family.pd_hw)
        if hw is not None
    }
    ctx = ReportContext(
        schedulers=schedulers,
        workload=tw0.summary(),
        settings=settings,
        link=link_text,
        notes=notes,
        show=max(10, args.top * len(plans)),
        vary_counts=args.vary_counts,
        budgets=budget_text,
        simulated=done,
        seconds=time.monotonic() - t0,
        arrivals=arrivals,
    )
    (out_dir / "plan.md").write_text(report_md(ctx, report_rows, files, why))
    ref_by_kind = {k: done.get(bases[k].name, c) for k, (c, _) in refs.items()}
    result = PlanResult(
        trace=trace_path,
        window=args.window,
        workload=tw0.summary(),
        settings=settings,
        vary_counts=args.vary_counts,
        cache_aware=cache_aware,
        simulated_per_kind=pool,
        budgets=budget_text,
        bases={k: b.path for k, b in bases.items()},
        notes=notes,
        verification=why,
        kinds={
            fp.family.kind: KindPlan(
                best=fp.candidates[0] if fp.candidates else None,
                model_first=model_first.get(fp.family.kind),
                reference=ref_by_kind.get(fp.family.kind),
                fewest=next((c for c in fewest if c.kind == fp.family.kind), None),
                candidates=len(fp.candidates),
            )
            for fp in plans
        },
        ranking=ranked,
        simulated=done,
        files=files,
        out=out_dir,
        seconds=time.monotonic() - t0,
        schedulers=schedulers,
        arrivals=arrivals,
        sessions=sessions,
    )
    (out_dir / "plan.json").write_text(finite_dumps(result.to_json(), indent=1))
    write_plan_figure(result, out_dir / "plan.png")
    return result


def _fewest(
    fp: FamilyPlan,
    wl: Workload,
    trace: Trace,
    settings: PlanSettings,
    cache_aware: bool,
    sim: Simulate | None,
    done: dict[str, Candidate],
    trace_path: Path,
    cand_dir: Path,
    base: Base,
) -> Candidate | None:
    """The smallest deployment of the family meeting the SLOs: by the model, scored on its own
    routing, then by simulation (the next smallest tried when one misses them there, up to
    FEWEST_TRIES); None when none of those does."""
    order = sorted(
        (c for c in fp.candidates if c.meets_slo_model),
        key=lambda c: (c.instances, objective_key(c, settings.objective)),
    )
    tried = 0
    for c in order[: 4 * FEWEST_TRIES]:
        if tried >= FEWEST_TRIES:
            break
        c = score_config(fp.family, wl, trace, settings, c.n_prfaas, c.n_p, c.n_d, c.threshold, cache_aware)
        if not c.meets_slo_model:
            continue
        if sim is None:
            return c
        tried += 1
        name = slug(c)
        if name not in done:
            cand_dir.mkdir(exist_ok=True)
            path = cand_dir / f"{name}.yaml"
            scenario_file(path, fp.family, base.path, c, cache_aware)
            got, _ = simulate_rows([(c, path, name)], trace_path, sim, settings)
            done.update(got)
        if name in done and done[name].meets_slo:
            return done[name]
    return None
