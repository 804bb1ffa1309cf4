"""`testbed plan`'s outputs: the plan files (`plan-<kind>-<rank>.yaml`, each extending its base)
and plan.md."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testbed.metrics.markdown_table import table_lines
from testbed.model.planner import Candidate, Family, PlanSettings, kilo, scenario_patch
from testbed.model.workload import WorkloadSummary
from testbed.traces.csvutil import Window


@dataclass
class Rows:
    """What plan.md shows, each list best first."""

    best: list[Candidate]  # each kind's first choice, the overall first choice first
    references: list[tuple[Candidate, str]]  # the bases as they stand, with their routing
    ranking: list[Candidate]  # every kind
    fewest: list[Candidate] = field(default_factory=list)
    refined: dict[str, tuple[Candidate, Candidate]] = field(default_factory=dict)  # kind: model's first, final first
    simulated: int = 0  # candidates per kind simulated


def key(c: Candidate) -> tuple[Any, ...]:
    """A candidate's identity within a plan (its figures aside)."""
    return (c.kind, c.n_prfaas, c.n_p, c.n_d, c.threshold)


def slug(c: Candidate) -> str:
    """A file-name-safe name of a candidate: prfaas-t1400-4-3-5, homogeneous-0-8-4."""
    t = "" if c.threshold is None else f"-t{c.threshold}"
    return f"{c.kind}{t}-{c.n_prfaas}-{c.n_p}-{c.n_d}"


def _g(x: float | None, fmt: str = "{:.2f}") -> str:
    """A figure; None is "-"; an infinite TTFT (None in JSON) is a saturated stage."""
    if x is None:
        return "-"
    return "sat." if not math.isfinite(x) else fmt.format(x)


def _t(c: Candidate) -> str:
    return "-" if c.threshold is None else kilo(c.threshold)


def _counts(c: Candidate) -> str:
    return "/".join(str(n) if n else "-" for n in (c.n_prfaas, c.n_p, c.n_d))


def label(c: Candidate) -> str:
    """prfaas t=1.75K 4/3/5, homogeneous -/8/4."""
    return f"{c.kind}{'' if c.threshold is None else f' t={kilo(c.threshold)}'} {_counts(c)}"


def verdict(c: Candidate) -> str:
    """ "yes (sim)", "no (model)": the verdict in force and what decided it."""
    by = "model" if c.simulated is None else "sim"
    return f"{'yes' if c.meets_slo else 'no'} ({by})"


def _window_flag(window: Window | None) -> str:
    if window is None:
        return ""
    a, b = window
    return f" --window {a:g}:{'' if math.isinf(b) else f'{b:g}'}"


def scenario_file(
    path: Path,
    fam: Family,
    base_path: Path,
    c: Candidate,
    cache_aware: bool,
    head: Sequence[str] = (),
    planned_for: str | None = None,
) -> None:
    """A scenario file for `c` extending its base (relative inside one tree, else absolute);
    `planned_for` (the `--trace F [--window W]` it was sized for) lets a run without it warn."""
    src, here = base_path.resolve(), path.parent.resolve()
    rel = (
        os.path.relpath(src, here)
        if os.path.commonpath([src, here]) != os.sep and len(Path(os.path.commonpath([src, here])).parts) > 2
        else str(src)
    )
    body = {"extends": rel, **scenario_patch(fam, c, path.stem, cache_aware)}
    if planned_for is not None:
        body["workload"] = {"planned_for": planned_for}
    text = "".join(f"# {h}\n" for h in head)
    path.write_text(text + yaml.safe_dump(body, sort_keys=False, default_flow_style=None))


def write_plan_file(
    path: Path,
    fam: Family,
    base_path: Path,
    c: Candidate,
    rank: int,
    of: int,
    trace: str,
    objective: str,
    cache_aware: bool,
    window: Window | None = None,
) -> None:
    sim = c.simulated
    head = [
        f"testbed plan: {c.kind} rank {rank} of {of} for {trace} (objective {objective}).",
        f"Predicted: Lambda_max {c.lambda_max:.2f} req/s ({c.bottleneck}); at {c.rate:.2f} req/s mean/P90 TTFT "
        f"{_g(c.ttft_mean_s)}/{_g(c.ttft_p90_s)} s; {c.p:.0%} offloaded; egress {c.egress_bps / 1e9:.1f} Gbit/s.",
    ]
    if sim is not None and "error" not in sim:
        head.append(
            f"Simulated: mean/P90 TTFT {_g(sim.get('ttft_mean_s'))}/{_g(sim.get('ttft_p90_s'))} s; "
            f"SLOs {'met' if c.meets_slo else 'missed'}."
        )
    head.append(f"Replay: testbed replay --scenario {path} --trace {trace}{_window_flag(window)}")
    scenario_file(path, fam, base_path, c, cache_aware, head, planned_for=f"--trace {trace}{_window_flag(window)}")


_HEAD = [
    "kind",
    "t",
    "instances PrfaaS / PD prefill / PD decode",
    "Λ_max (req/s)",
    "bottleneck",
    "TTFT mean / P90 model (s)",
    "TTFT mean / P90 simulated (s)",
    "offloaded",
    "egress Gbit/s (link)",
    "meets SLO",
    "file",
]


def _row(c: Candidate, file: str = "") -> list[str]:
    sim = c.simulated or {}
    return [
        c.kind,
        _t(c),
        _counts(c),
        f"{c.lambda_max:.2f}",
        c.bottleneck,
        f"{_g(c.ttft_mean_s)} / {_g(c.ttft_p90_s)}",
        f"{_g(sim.get('ttft_mean_s'))} / {_g(sim.get('ttft_p90_s'))}" if c.simulated else "-",
        f"{c.p:.0%}",
        f"{c.egress_bps / 1e9:.1f} ({c.egress_share:.0%})",
        verdict(c),
        file,
    ]


def _md_table(rows: list[list[str]], head: Sequence[str] = _HEAD) -> list[str]:
    return table_lines(head, rows)


def _err(model: float, sim: Any) -> str:
    if sim is None or not math.isfinite(model) or not sim:
        return "-"
    return f"{model / sim - 1:+.0%}"


def _objective_text(s: PlanSettings) -> str:
    return {
        "lambda": "highest Λ_max, ties to lower mean TTFT",
        "ttft": "lowest mean TTFT at the trace's rate",
        "ttft-p90": f"lowest P{s.quantile * 100:.0f} TTFT at the trace's rate",
    }[s.objective]


def _workload_lines(wl: WorkloadSummary) -> list[str]:
    arr = wl.get("arrivals") or {}
    lines = [
        f"- {wl['requests']:,} requests over {wl['duration_s']:,.0f} s: **{wl['rate_rps']:.3f} req/s**, "
        f"the rate every TTFT below is estimated at",
    ]
    if arr:
        disp = [
            f"{arr[f'dispersion_{w}s']:.1f} over {w} s" for w in ("10", "60") if arr.get(f"dispersion_{w}s") is not None
        ]
        lines.append(
            f"- burstiness: inter-arrival CV **{arr['gap_cv']:.2f}** (1 is Poisson); the busiest 10 s ran at "
            f"**{arr['busiest_10s_over_mean']:.1f}x** the mean rate, the busiest minute at "
            f"{arr['busiest_60s_over_mean']:.1f}x, the busiest of the {arr['load_windows']} spans of "
            f"{arr['load_window_s']:g} s the estimate reads at {arr['busiest_load_window_over_mean']:.2f}x"
            + (f"; counts' variance over mean {', '.join(disp)}" if disp else "")
        )
    lines += [
        f"- input tokens: mean {wl['input_tokens']['mean']:,.0f}, P90 {wl['input_tokens']['p90']:,.0f}; "
        f"incremental (uncached, all at once): mean {wl['uncached_tokens']['mean']:,.0f}, "
        f"P90 {wl['uncached_tokens']['p90']:,.0f}",
        f"- cached: {wl['cached_share']:.1%} of prompt tokens if every earlier prompt were in the cache at once "
        f"({wl['cache_rule']}); each deployment's own figure follows its routing and its prefills' end; "
        f"{wl['reuse_share']:.1%} of blocks were seen earlier anywhere",
        f"- output tokens: mean {wl['output_tokens']['mean']:,.0f} (drives Θ_pdd = N_d·BS_max / (T_decode·L_out))",
    ]
    return lines


@dataclass(frozen=True)
class ReportContext:
    """What plan.md says beside the rows."""

    workload: WorkloadSummary  # TraceWorkload.summary()
    settings: PlanSettings
    link: str
    notes: Sequence[str]
    show: int  # ranking rows shown
    vary_counts: bool
    budgets: dict[str, str]
    simulated: dict[str, Candidate]
    seconds: float
    schedulers: dict[str, str] = field(default_factory=dict)  # hardware -> the prefill scheduler assumed
    arrivals: str = "open"  # the arrival mode the plan assumed (`arrivals_text`)


def arrivals_text(mode: str) -> str:
    """What an arrival mode means for a plan's two judges (README "Sessions: open and closed loop")."""
    if mode == "closed":
        return (
            "The simulated replays send each follow-up turn only after the answer it follows (plus its "
            "think time), never before; the model reads the trace's arrival times as they stand."
        )
    return "Every request leaves at its trace timestamp, in the model and in the simulated replays."


def report_md(ctx: ReportContext, rows: Rows, files: dict[tuple[Any, ...], str], verified_note: str | None) -> str:
    wl = ctx.workload
    s = ctx.settings
    lines = [
        f"# Deployment plan for {wl['source']}",
        "",
        f"Objective: **{s.objective}** ({_objective_text(s)}); TTFT SLO {s.ttft_slo_s:g} s on the "
        f"P{s.quantile * 100:.0f}, TPOT SLO {s.tpot_slo_s * 1e3:g} ms. Link: {ctx.link}.",
        "",
        "Instances in force per kind: " + "; ".join(f"{k}: {v}" for k, v in ctx.budgets.items()) + ".",
        "",
        "Prefill scheduler assumed (the capacities follow it, `testbed.model.batching`): "
        + "; ".join(f"{hw}: {text}" for hw, text in ctx.schedulers.items())
        + ".",
        "",
        f"Arrivals assumed: **{ctx.arrivals}**. {arrivals_text(ctx.arrivals)}",
        "",
        "## Workload (as the model reads the trace)",
        "",
        *_workload_lines(wl),
        "",
        "## Best of each kind (the first choice first)",
        "",
    ]
    lines += _md_table([_row(c, files.get(key(c), "")) for c in rows.best])
    if rows.refined:
        lines += ["", "## Chosen by simulation", ""]
        lines.append(
            f"The best {rows.simulated} of each kind by the model were replayed on the simulator and "
            "ranked by it (SLOs met by simulation first, then the objective with the simulated TTFT):"
        )
        lines.append("")
        for kind, (was, now) in rows.refined.items():
            if (key(was), was.simulated is not None) == (key(now), True):
                lines.append(
                    f"- {kind}: the model's first choice {label(was)} is also the simulator's "
                    f"({_g((now.simulated or {}).get('ttft_mean_s'))} s mean TTFT)"
                )
            else:
                lines.append(
                    f"- {kind}: the model's first choice was {label(was)} "
                    f"(simulated {_g((was.simulated or {}).get('ttft_mean_s'))} s mean TTFT, "
                    f"SLOs {'met' if was.meets_slo else 'missed'}); the simulator's best is {label(now)} "
                    f"({_g((now.simulated or {}).get('ttft_mean_s'))} s, "
                    f"SLOs {'met' if now.meets_slo else 'missed'})"
                )
    if rows.references:
        lines += [
            "",
            "## The base scenarios as they stand",
            "",
            "Modelled with their own routing (a length-only PrfaaS scenario judges the whole prompt, each "
            "cluster reusing only its own cache, and ships the whole KV) and simulated as they are:",
            "",
        ]
        lines += _md_table([_row(r, how) for r, how in rows.references])
        for r, _ in rows.references:
            for n in r.notes:
                lines.append(f"- {label(r)}: {n}")
    lines += ["", "## Ranking (every kind)", ""]
    shown = rows.ranking[: ctx.show]
    lines += _md_table([_row(c, files.get(key(c), "")) for c in shown])
    if any(c.simulated is None for c in shown) and any(c.simulated is not None for c in shown):
        lines.append(
            "\nRows without simulated figures were not simulated: their SLO verdict is the model's, and "
            "they rank after every simulated row."
        )
    if len(rows.ranking) > ctx.show:
        lines.append(f"\n({len(rows.ranking) - ctx.show} more in plan.json)")
    if ctx.vary_counts:
        lines += ["", "## Fewest instances meeting the SLOs at the trace's rate, per kind", ""]
        lines += (
            _md_table([_row(c, files.get(key(c), "")) for c in rows.fewest]) if rows.fewest else ["none meets the SLOs"]
        )
    lines += ["", "## Simulation", ""]
    if verified_note:
        lines.append(f"The plans are **{verified_note}**: every figure above is the model's.")
    else:
        lines.append(
            "Each row above with simulated figures was replayed on the simulator (`--backend sim`) with the "
            "trace (run directories in `sim/`; `testbed report sim/NAME` draws a report); predicted "
            "against simulated:"
        )
        lines.append("")
        lines += _md_table(
            _sim_rows(ctx.simulated),
            [
                "run",
                "Λ_max model",
                "TTFT mean model / sim (s)",
                "error",
                "TTFT P90 model / sim (s)",
                "error",
                "offloaded model / sim",
                "egress Gbit/s model / sim",
                "completed req/s sim",
                "SLO attainment sim",
                "meets SLO model / sim",
            ],
        )
    lines += ["", "## How the figures are made", ""]
    lines += [f"- {a}" for a in ASSUMPTIONS]
    lines += [f"- {n}" for n in ctx.notes]
    lines.append(f"- planning took {ctx.seconds:.1f} s")
    return "\n".join(lines) + "\n"


def _sim_rows(simulated: dict[str, Candidate]) -> list[list[str]]:
    out = []
    for name, c in simulated.items():
        sm = c.simulated or {}
        if "error" in sm:
            out.append([name, f"{c.lambda_max:.2f}", f"failed: {sm['error']}", *[""] * 8])
            continue
        out.append(
            [
                name,
                f"{c.lambda_max:.2f}",
                f"{_g(c.ttft_mean_s)} / {_g(sm.get('ttft_mean_s'))}",
                _err(c.ttft_mean_s, sm.get("ttft_mean_s")),
                f"{_g(c.ttft_p90_s)} / {_g(sm.get('ttft_p90_s'))}",
                _err(c.ttft_p90_s, sm.get("ttft_p90_s")),
                f"{c.p:.0%} / {_g(sm.get('offload_share'), '{:.0%}')}",
                f"{c.egress_bps / 1e9:.1f} / {_g(sm.get('egress_gbps'), '{:.1f}')}",
                _g(sm.get("completed_rps")),
                _g(sm.get("slo_attainment"), "{:.0%}"),
                f"{'yes' if c.meets_slo_model else 'no'} / {'yes' if c.meets_slo else 'no'}",
            ]
        )
    return out


ASSUMPTIONS = (
    "Λ_max and the Θs are the paper's formulas (section 3.4) on the trace's empirical incremental-length "
    "distribution: Θ = N / T_prefill(E[L | routed]); `testbed model --scenario FILE --trace TRACE` gives the same "
    "on the same lengths.",
    "The threshold is on the incremental length, as the paper defines it; the plan files therefore turn on "
    "cache-aware routing (`policy.cache_aware`) when the trace has prefix reuse.",
    "Cached prefixes: the trace is replayed through unbounded pools under each deployment's own routing, each "
    "prompt entering them when its prefill would end (prefill time plus the stage's estimated wait), as the "
    "testbed's pools fill; a follow-up that arrives before the turn it extends is prefilled finds less.",
    "TTFT at the trace's rate: each prefill stage and the decode slots a G/G/c queue by its GI/M/c skeleton on "
    "the trace's measured inter-arrival law (sigma = A*(cμ(1 − sigma)); E[W | W > 0] = 1 / (cμ(1 − sigma)) times "
    "(ca² + cs²)/(ca² + 1); P(W > 0) Erlang C at load c·sigma; Allen-Cunneen's M/G/c for Poisson arrivals): in the "
    "search on the whole trace's law thinned to the stage's share, for the rows scored on their own routing on "
    "each stage's own arrivals, span by span (5 minutes), with the backlog a span over capacity leaves. "
    "Offloaded requests add the last layer's KV over the link and its one-way delay; decode adds one step and half "
    "a step's wait for the running batch's boundary.",
    "Egress is the KV of offloaded requests at the trace's rate; prefix moves toward PrfaaS and link "
    "contention are not modelled.",
    "Decode per-sequence terms are not modelled, as in `testbed model`; the prefill time of cached tokens "
    "(`cached_token_s`) is, for the rows scored on their own routing.",
    "Each (counts, split) gets its best threshold among the trace's distinct incremental lengths; the best few "
    "then move to the roundest nearby threshold costing at most 0.5% of the objective's figures.",
    "Simulated rows: the SLOs are met when every request completed and the simulated P90 TTFT and P90 TPOT are "
    "within them (1% timing slack, as the run summary's SLO attainment); that verdict replaces the model's.",
)
