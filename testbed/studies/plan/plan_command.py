"""`testbed plan`'s command line: its flags, the run, and the summary it prints (the planning itself is
`testbed.studies.plan.plan`)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from testbed.config.cli_args import StoreOnce, add_overwrite, out_dir
from testbed.config.scenarios import ScenarioError
from testbed.core.sessions import ARRIVAL_MODES
from testbed.model.planner import KINDS, OBJECTIVES, Candidate, PlanError
from testbed.studies.plan.plan import DEFAULT_SCENARIOS, run_plan
from testbed.studies.plan.plan_progress import PlanProgress
from testbed.studies.plan.plan_result import PlanOptions, PlanResult


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from testbed.traces.formats import SUPPORTED_FORMATS
    from testbed.traces.trace_command import WINDOW_HELP, window_arg

    p = sub.add_parser(
        "plan",
        help="plan threshold, P/D split and instance counts for a trace, checked by simulation",
        description="Searches, for each deployment kind on its own hardware, the threshold t, the PD cluster's "
        "N_p/N_d split and optionally the instance counts; ranks them by the model on the trace's "
        "empirical workload and burstiness; replays the best of each kind, the base scenarios as they "
        "stand and the smallest deployment meeting the SLOs on the simulator and ranks those by it; "
        "writes ready-to-run scenario files for the best few of each kind and a report "
        "(plan.md, plan.json).",
    )
    p.add_argument(
        "--trace",
        action=StoreOnce,
        required=True,
        help="trace file (Mooncake JSONL with hash_ids, Azure or BurstGPT CSV)",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=("auto", *SUPPORTED_FORMATS),
        help="trace format (default auto: a .jsonl is aiperf multi-turn or Bailian by its keys, else Mooncake; "
        "a .csv is told by its header)",
    )
    p.add_argument(
        "--window", type=window_arg, metavar="START:END", help=f"plan for this part of the trace: {WINDOW_HELP}"
    )
    p.add_argument(
        "--scenario",
        action="append",
        metavar="NAME",
        help="a base scenario (repeatable); its policy says which kind it is the base of "
        f"(default: {', '.join(DEFAULT_SCENARIOS)})",
    )
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default all)")
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="lambda",
        help="lambda: highest Λ_max; ttft / ttft-p90: lowest mean / P90 TTFT at the trace's rate",
    )
    p.add_argument(
        "--ttft-slo", type=float, metavar="S", help="P90 TTFT SLO, paper seconds (default: the base's slo.ttft_s)"
    )
    p.add_argument(
        "--tpot-slo", type=float, metavar="S", help="TPOT SLO, paper seconds (default: the base's slo.tpot_s)"
    )
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="[KIND:]HW=N,...",
        help="instances per hardware: KIND:HW=N for one kind (e.g. prfaas:h200=4,h20=8 or "
        "homogeneous:h20=12); HW=N without a kind applies to every kind that uses HW, "
        "homogeneous PD included (default: each base's own counts)",
    )
    p.add_argument("--vary-counts", action="store_true", help="also try every smaller instance count within the budget")
    p.add_argument("--link-gbps", type=float, help="PrfaaS egress link (default: the base's inter-DC link profile)")
    p.add_argument("--top", type=int, default=3, metavar="N", help="scenario files written per kind (default 3)")
    p.add_argument(
        "--refine",
        type=int,
        default=0,
        metavar="N",
        help="replay the best N of each kind by the model on the simulator and rank them by it "
        "(default: the --top written; every written or recommended row is simulated)",
    )
    p.add_argument(
        "--no-sim", action="store_true", help="the model alone: nothing simulated, the SLOs judged by the model"
    )
    p.add_argument(
        "--arrivals",
        choices=ARRIVAL_MODES,
        help="how the simulated replays send a session trace: open (each request at its timestamp) or "
        "closed (a turn after its parent's answer plus its think time); default: the first base "
        "scenario's workload.arrivals (open unless it says otherwise). The report says which it assumed",
    )
    p.add_argument("--out", action=StoreOnce, type=out_dir, help="output directory (default runs/plan-<trace name>)")
    add_overwrite(p)
    p.add_argument("--json", action="store_true", help="print plan.json instead of the summary")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    opts = PlanOptions.from_args(args)
    progress = PlanProgress()
    try:
        with progress:
            res = run_plan(opts, progress=progress)
    except (PlanError, ScenarioError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or the SIGTERM the CLI turns into one
        print(progress.interrupted(), file=sys.stderr)
        return 130
    if opts.json:
        print(json.dumps(res.to_json(), indent=1))
        return 0
    _print_summary(res)
    return 0


def _print_summary(res: PlanResult) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from testbed.model.planner import kilo

    wl = res.workload
    arr = wl.get("arrivals") or {}
    con = Console()
    if not con.is_terminal:  # a pipe or a file: no terminal width to fit, keep the table whole
        con = Console(width=120)
    con.print(
        f"trace {res.trace}: {wl['requests']:,} requests, {wl['rate_rps']:.3f} req/s "
        f"(inter-arrival CV {arr.get('gap_cv', 1.0):.2f}, "
        f"busiest 10 s at {arr.get('busiest_10s_over_mean', 1.0):.1f}x), "
        f"input mean {wl['input_tokens']['mean']:,.0f} ({wl['cached_share']:.0%} seen before), "
        f"output mean {wl['output_tokens']['mean']:,.0f}"
    )
    tab = Table(
        title=f"objective {res.settings.objective}; TTFT mean/P90 (s) at {wl['rate_rps']:.2f} req/s",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
    )  # fits 80 columns
    for h in ("", "t", "PrfaaS/P/D", "Λmax", "TTFT model", "TTFT sim", "SLO"):
        tab.add_column(h, justify="left" if not h else "right", no_wrap=True)
    files: list[str] = []

    def ttft(x: float | str | None) -> str:
        return "sat." if not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.2f}"

    def add(tag: str, c: Candidate) -> None:
        t = "-" if c.threshold is None else kilo(c.threshold)
        counts = "/".join(str(n) if n else "-" for n in (c.n_prfaas, c.n_p, c.n_d))
        sim = c.simulated
        simt = (
            "-"
            if not sim
            else "failed"
            if "error" in sim
            else f"{ttft(sim.get('ttft_mean_s'))}/{ttft(sim.get('ttft_p90_s'))}"
        )
        by = "sim" if sim else "model"
        tab.add_row(
            tag,
            t,
            counts,
            f"{c.lambda_max:.2f}",
            f"{ttft(c.ttft_mean_s)}/{ttft(c.ttft_p90_s)}",
            simt,
            f"{'yes' if c.meets_slo else 'no'} ({by})",
        )

    for kind, k in res.kinds.items():
        if k.best:
            add(kind, k.best)
            files.append(f"{kind}: {res.out}/{res.file(k.best)} (bottleneck {k.best.bottleneck})")
        if k.reference:
            add("  as given", k.reference)
        if k.fewest:
            add("  fewest", k.fewest)
    con.print(tab)
    con.print(
        "PrfaaS/P/D: instances of PrfaaS prefill / PD prefill / PD decode; t: the length threshold; "
        "Λmax: the model's capacity (req/s); SLO: met by the simulator's figures (sim) or the model's",
        highlight=False,
    )
    for f in files:
        con.print(f"plan {f}")
    sessions = f", {res.sessions:,} multi-turn sessions in the trace" if res.sessions else ""
    con.print(f"arrivals assumed: {res.arrivals}{sessions}", highlight=False)
    for n in res.notes:
        con.print(f"note: {n}")
    if res.verification is not None:
        con.print(res.verification)
    con.print(f"report: {res.out}/plan.md  ({res.seconds:.1f} s)")
