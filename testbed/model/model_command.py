"""`testbed model`: the paper's analytical model (Table 6) for one or more scenarios."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from testbed.config.cli_args import StoreOnce
from testbed.config.scenarios import PROFILE_SOURCES, load_scenario
from testbed.core.engine.kvsize import KVModel
from testbed.core.schema.scenario import Scenario
from testbed.model.analytical import ModelResult, Workload, evaluate
from testbed.model.bandwidth_command import DEFAULT_GPUS, run_bandwidth
from testbed.model.optimise import OptimiseResult, optimise, optimise_threshold, resolve_threshold
from testbed.model.workload import TraceWorkload, WorkloadSummary
from testbed.traces.formats import SUPPORTED_FORMATS
from testbed.traces.loader import load_trace
from testbed.traces.trace_command import WINDOW_HELP, window_arg
from testbed.traces.types import Trace

__all__ = ["register", "run", "resolve_threshold"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "model",
        help="analytical throughput model of the paper (Table 6), or its KV bandwidth figures (--bandwidth)",
        description="Queue-free stage capacities, Lambda_max, TTFT and PrfaaS egress (arXiv 2604.15039, section 3.4). "
        "With --bandwidth: per-instance KV throughput of the model profiles (Table 3) and the cluster "
        "egress claims of section 2.3, side by side with the paper's figures.",
    )
    p.add_argument("--scenario", action="append", metavar="NAME", help="scenario name or path (repeatable)")
    p.add_argument("--link-gbps", type=float, default=100.0, help="PrfaaS egress link B_out in Gbit/s (default 100)")
    p.add_argument("--optimise", action="store_true", help="also run the 2-D grid search over t and the N_p/N_d split")
    t = p.add_argument_group("trace workload (--trace)")
    t.add_argument(
        "--trace",
        action=StoreOnce,
        metavar="FILE",
        help="use a trace's workload instead of the scenario's synthetic one: its empirical incremental "
        "(uncached) input lengths after prefix-cache hits, mean output length and rate",
    )
    t.add_argument("--window", type=window_arg, metavar="START:END", help=f"only this part of the trace: {WINDOW_HELP}")
    t.add_argument("--format", default="auto", choices=("auto", *SUPPORTED_FORMATS), help="trace format")
    b = p.add_argument_group("bandwidth (--bandwidth)")
    b.add_argument(
        "--bandwidth",
        action="store_true",
        help="Phi_kv of the model profiles (scenarios/models) and the section 2.3 claims",
    )
    b.add_argument(
        "--gpus", type=float, help=f"PrfaaS cluster size in H200 GPUs, 8 per instance (default {DEFAULT_GPUS})"
    )
    b.add_argument(
        "--length",
        action="append",
        metavar="TOKENS",
        help="input length, e.g. 32K or 30000 (repeatable; default Table 3's 1K 8K 32K 128K)",
    )
    b.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help="model profile name or path (repeatable; default all of scenarios/models)",
    )
    b.add_argument(
        "--source",
        action="append",
        choices=list(PROFILE_SOURCES),
        help="profile source, side by side in this order (repeatable; default all: the paper-derived "
        "profiles and the measured-kernel ones of scenarios/models/aiconfigurator)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _analyse(
    sc: Scenario, link_bps: float, want_opt: bool, workload: Workload | None = None
) -> tuple[ModelResult, OptimiseResult | None]:
    # "auto" is resolved exactly as the router resolves it (on the scenario's own workload).
    threshold = resolve_threshold(sc, link_bps) if sc.policy.name == "prfaas" else None
    res = evaluate(sc, link_bps, threshold=threshold, workload=workload)
    opt = None
    if want_opt and sc.policy.name == "prfaas":
        pds = [c for c in sc.clusters if c.kind == "pd"]
        # Several PD clusters: no single split to re-role, so optimise t alone.
        if len(pds) == 1:
            opt = optimise(sc, link_bps, workload=workload)
        else:
            opt = optimise_threshold(sc, link_bps, workload=workload)
    return res, opt


class _TraceWorkloads:
    """A trace read once, reduced per cache rule (a model with linear layers needs state snapshots)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._by_rule: dict[bool, TraceWorkload] = {}

    def for_scenario(self, sc: Scenario) -> TraceWorkload:
        kv = KVModel.from_spec(sc.model)
        rule = "linear" in kv.kinds
        if rule not in self._by_rule:
            self._by_rule[rule] = TraceWorkload.from_trace(self.trace, kv)
        return self._by_rule[rule]


def _workload_line(tw: TraceWorkload) -> str:
    s = tw.summary()
    return (
        f"workload: {s['source']}: {s['requests']:,} requests at {s['rate_rps']:.3f} req/s; input mean "
        f"{s['input_tokens']['mean']:,.0f} (P90 {s['input_tokens']['p90']:,.0f}), incremental mean "
        f"{s['uncached_tokens']['mean']:,.0f} (P90 {s['uncached_tokens']['p90']:,.0f}) after "
        f"{s['cached_share']:.1%} cached ({s['cache_rule']}); output mean {s['output_tokens']['mean']:,.0f}"
    )


def _baseline(results: list[ModelResult]) -> ModelResult:
    return next((r for r in results if r.policy == "homogeneous"), results[0])


def _fmt(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _count(n: int) -> str:
    return str(n) if n > 0 else "-"


def _table(rows: list[tuple[ModelResult, OptimiseResult | None]], workload: str = "") -> Table:
    results = [r for r, _ in rows]
    base = _baseline(results)
    tab = Table(title=f"Analytical model{workload} (relative to {base.scenario})")
    tab.add_column("metric", no_wrap=True)
    for r in results:
        tab.add_column(r.scenario, justify="right")

    def line(name: str, cells: list[str]) -> None:
        tab.add_row(name, *cells)

    line("threshold t", [_fmt(r.threshold / 1000, "{:.1f}K") if r.threshold is not None else "-" for r in results])
    line("instances PrfaaS/prefill/decode", [f"{_count(r.n_prfaas)}/{_count(r.n_p)}/{_count(r.n_d)}" for r in results])
    line("share to PrfaaS p", [f"{r.p:.1%}" for r in results])
    line("mean/P90 TTFT (s)", [f"{r.ttft_mean_s:.2f}/{r.ttft_p90_s:.2f}" for r in results])
    line("+ mean KV tail (ms)", [f"{r.kv_tail_mean_s * 1e3:.2f}" for r in results])
    line(
        "Θ prfaas/pdp/pdd (req/s)",
        [f"{_fmt(r.theta_prfaas)}/{_fmt(r.theta_pdp)}/{_fmt(r.theta_pdd)}" for r in results],
    )
    line("Λ_max (req/s)", [f"{r.lambda_max:.2f}" for r in results])
    line("relative", [f"{r.lambda_max / base.lambda_max:.2f}x" for r in results])
    line("egress Gbps (% link)", [f"{r.egress_bps / 1e9:.1f} ({r.egress_fraction:.0%})" for r in results])
    line("bottleneck", [r.bottleneck + (f" ({r.prfaas_bound})" if r.bottleneck == "prfaas" else "") for r in results])
    if any(o is not None for _, o in rows):
        line("optimised t", [_fmt(o.threshold / 1000, "{:.1f}K") if o else "-" for _, o in rows])
        line("optimised N_p/N_d", [f"{o.n_p}/{o.n_d}" if o else "-" for _, o in rows])
        line("optimised Λ_max (req/s)", [f"{o.lambda_max:.2f}" if o else "-" for _, o in rows])
    return tab


def _json(
    rows: list[tuple[ModelResult, OptimiseResult | None]], workloads: list[WorkloadSummary] | None = None
) -> dict[str, object]:
    results = [r for r, _ in rows]
    base = _baseline(results)
    out: list[dict[str, object]] = []
    for r, o in rows:
        d = r.to_dict()
        d["relative"] = r.lambda_max / base.lambda_max
        d["optimised"] = o.to_dict() if o is not None else None
        out.append(d)
    res: dict[str, object] = {"baseline": base.scenario, "scenarios": out}
    if workloads is not None:
        res["workloads"] = workloads
    return res


def run(args: argparse.Namespace) -> int:
    if args.bandwidth:
        if args.scenario or args.optimise:
            print("model: --bandwidth reads model profiles; give it without --scenario/--optimise", file=sys.stderr)
            return 2
        return run_bandwidth(args)
    stray = [
        f
        for f, v in (
            ("--gpus", args.gpus),
            ("--length", args.length),
            ("--model", args.model),
            ("--source", args.source),
        )
        if v is not None
    ]
    if args.trace is None:
        stray += [f for f, v in (("--window", args.window), ("--format", args.format != "auto")) if v]
    if stray:
        print(f"model: {', '.join(stray)} need --bandwidth", file=sys.stderr)
        return 2
    if not args.scenario:
        print("model: give --scenario NAME (repeatable) or --bandwidth", file=sys.stderr)
        return 2
    link_bps = float(args.link_gbps) * 1e9
    if link_bps <= 0:
        print("--link-gbps must be > 0", file=sys.stderr)
        return 2
    rows: list[tuple[ModelResult, OptimiseResult | None]] = []
    summaries: list[TraceWorkload] = []
    traces = None if args.trace is None else _TraceWorkloads(load_trace(args.trace, args.format, window=args.window))
    for name in args.scenario:
        sc = load_scenario(name)
        wl = None
        if traces is not None:
            tw = traces.for_scenario(sc)
            if tw not in summaries:
                summaries.append(tw)
            wl = tw.model_workload()
        rows.append(_analyse(sc, link_bps, bool(args.optimise), wl))
    if args.json:
        print(json.dumps(_json(rows, [tw.summary() for tw in summaries] if summaries else None), indent=2))
    else:
        con = Console()
        for tw in summaries:
            con.print(_workload_line(tw))
        con.print(_table(rows, " on the trace's workload" if summaries else ""))
    return 0
