"""`testbed feasibility`: the feasibility map (model x link rate x RTT) by the analytical model,
by simulation, and for --confirm K points by emulation.

A study of its own rather than `testbed model --map`: besides the model it runs capacity
searches on the sim and emulation backends, which the model layer may not import."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from testbed.config import run_lock
from testbed.config.cli_args import StoreOnce, add_overwrite, out_dir
from testbed.config.scenarios import PROFILE_SOURCES
from testbed.core.errors import UserError
from testbed.deploy import registry
from testbed.model.feasibility import (
    DEFAULT_RATES_GBPS,
    DEFAULT_RTTS_MS,
    compare_sources,
    compute_map,
    default_models,
    load_deployments,
)
from testbed.run.stoppable import run_stoppable
from testbed.studies.feasibility.feasibility import (
    CONFIRM_TOLERANCE,
    Confirmation,
    RunSettings,
    SimResults,
    Tally,
    chosen_keys,
    confirm,
    load_confirm,
    pick_confirm,
    simulate_points,
    write_confirm,
)
from testbed.studies.feasibility.feasibility_report import (
    Timing,
    plot_heatmap,
    rows,
    source_rows,
    summary_lines,
    write_csv,
    write_json,
    write_report,
)


class FeasibilityError(UserError, ValueError):
    """A bad flag of `testbed feasibility`."""


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not vals:
        raise argparse.ArgumentTypeError("give at least one number")
    return vals


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "feasibility",
        help="feasibility map: PrfaaS-PD vs homogeneous PD for each model x link rate x RTT (model, simulation, "
        "and --confirm K points by emulation)",
        description="For each model profile (scenarios/models) and inter-DC link (rate x RTT): the PrfaaS-PD "
        "deployment's best threshold, offload share, Lambda_max and P90 TTFT, and its throughput gain over "
        "homogeneous PD on the same hardware; by the analytical model and by simulation. Writes map.csv, "
        "map.json, report.md and map.png.",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help="model profile name or path (repeatable; default every profile of scenarios/models)",
    )
    p.add_argument(
        "--rates",
        type=_floats,
        default=list(DEFAULT_RATES_GBPS),
        metavar="GBPS,...",
        help=f"link rates in Gbit/s (default {','.join(f'{r:g}' for r in DEFAULT_RATES_GBPS)})",
    )
    p.add_argument(
        "--rtts",
        type=_floats,
        default=list(DEFAULT_RTTS_MS),
        metavar="MS,...",
        help=f"round-trip times in ms (default {','.join(f'{r:g}' for r in DEFAULT_RTTS_MS)})",
    )
    p.add_argument(
        "--split",
        choices=("optimise", "fixed"),
        default="optimise",
        help="optimise: the paper's 2-D search over t and N_p/N_d (and homogeneous PD's best N_p/N_d); "
        "fixed: Table 6's 3/5 and 9/3, t alone optimised (default optimise)",
    )
    p.add_argument(
        "--pd-curve",
        choices=("scaled", "parent"),
        default="scaled",
        help="the models' H20 prefill curve: scaled = the model's H200 curve x the case-study model's "
        "H20/H200 ratio; parent = the base scenario's H20 curve unchanged (default scaled)",
    )
    p.add_argument("--no-break-even", action="store_true", help="skip the break-even link rate search")
    p.add_argument(
        "--source",
        choices=list(PROFILE_SOURCES),
        default="paper",
        help="the profiles the map (and its simulation) uses: paper = back-solved from Table 3 "
        "(default), aiconfigurator = measured kernels (scenarios/models/aiconfigurator)",
    )
    p.add_argument(
        "--compare-source",
        action="append",
        choices=[*PROFILE_SOURCES, "none"],
        metavar="SOURCE",
        help="also map the models from this profile source, by the model only, side by side in "
        "report.md and sources.csv (repeatable; default every other source; none: no comparison)",
    )
    s = p.add_argument_group("simulation and emulation")
    s.add_argument(
        "--sim",
        choices=("all", "none", "subset"),
        default="all",
        help="points to simulate: all, none, or subset (the ~100 Gbit/s column and the grid rates around "
        "each model's break-even; default all)",
    )
    s.add_argument("--requests", type=int, default=300, help="requests per probe (default 300)")
    s.add_argument("--probes", type=int, default=6, help="probes per capacity search (default 6)")
    s.add_argument("--seed", type=int, default=45, help="workload seed (default 45, as make replay-paper)")
    s.add_argument(
        "--ttft-slo",
        type=float,
        metavar="S",
        help="P90 TTFT SLO of a stable probe, paper s (default: the scenario's slo.ttft_s, as in every "
        "command; `make models` gives 30, as Table 6 does)",
    )
    s.add_argument(
        "--wait-growth",
        type=float,
        default=2.5,
        help="unstable when the mean wait grows by more than this, paper s (default 2.5)",
    )
    s.add_argument(
        "--spread",
        type=float,
        default=0.25,
        help="bisection between (1 - spread) and (1 + spread) x the model's Lambda_max (default 0.25)",
    )
    s.add_argument(
        "--ttft-load",
        type=float,
        default=0.5,
        help="offered load of the TTFT replay, x the model's Lambda_max (default 0.5)",
    )
    s.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of every simulated or emulated scenario",
    )
    s.add_argument(
        "--fresh",
        action="store_true",
        help="measure every point again (default: reuse a point's measured.json under --out when its "
        "scenario, link, backend and settings are unchanged)",
    )
    s.add_argument(
        "--keep-series",
        action="store_true",
        help="keep simulated probes' time series and decisions (about 2.5 MB a probe)",
    )
    s.add_argument(
        "--confirm",
        type=int,
        default=0,
        metavar="K",
        help="also run K points by emulation (capacity search on --confirm-backend, same settings) and "
        "compare their Lambda_max with the simulation's",
    )
    s.add_argument(
        "--confirm-at",
        action="append",
        default=[],
        metavar="MODEL@RATEg/RTTms",
        help="a point to confirm (repeatable; the rest of the K are picked by rule)",
    )
    s.add_argument(
        "--confirm-backend", **registry.backend_option(registry.emulates, lead="backend of the confirmation runs")
    )
    p.add_argument(
        "--out", action=StoreOnce, type=out_dir, default=Path("runs") / "feasibility", help="output directory"
    )
    add_overwrite(p)
    p.add_argument("--json", action="store_true", help="print map.json instead of the summary")
    p.set_defaults(func=cmd_feasibility)


def cmd_feasibility(args: argparse.Namespace) -> int:
    settings = RunSettings(
        args.requests,
        args.probes,
        args.seed,
        args.ttft_slo,
        args.wait_growth,
        args.spread,
        args.ttft_load,
        tuple(args.set),
        args.keep_series,
    )
    settings.check()
    if args.confirm < 0:
        raise FeasibilityError("--confirm K needs K >= 0")
    if args.confirm or args.confirm_at:
        args.confirm_backend, warning = registry.pick_backend(args.confirm_backend, "--confirm-backend")
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    out: Path = args.out
    run_lock.acquire(out, args.overwrite)  # this command's until it returns
    t_start = time.perf_counter()
    c0 = time.process_time()
    models = args.model or default_models(args.source)
    deps = {d.model: d for d in (load_deployments(m, args.pd_curve, source=args.source) for m in models)}
    mm = compute_map(
        list(deps.values()), args.rates, args.rtts, args.split, args.pd_curve, with_break_even=not args.no_break_even
    )
    compare = [s for s in (args.compare_source or PROFILE_SOURCES) if s != "none"]
    if args.compare_source and "none" in args.compare_source:
        compare = []
    sources = compare_sources(args.source, mm, models, compare, with_break_even=not args.no_break_even)
    model_wall, model_cpu = time.perf_counter() - t_start, time.process_time() - c0
    print(
        f"model map: {len(deps)} models x {len(mm.rates_gbps)} rates x {len(mm.rtts_ms)} RTTs in {model_wall:.1f} s",
        file=sys.stderr,
    )
    keys = chosen_keys(mm, args.sim)
    sim = SimResults()
    emulated = Tally()
    conf: list[Confirmation] = []
    reuse = not args.fresh
    try:
        if keys:
            print(f"simulating {len(keys)} points -> {out / 'sim'}", file=sys.stderr)
            asyncio.run(simulate_points(mm, deps, keys, out, settings, sim, reuse))
        if args.confirm or args.confirm_at:
            picks = pick_confirm(mm, args.confirm, args.confirm_at)
            conf = run_stoppable(confirm(mm, deps, picks, out, settings, sim, args.confirm_backend, reuse, emulated))
            write_confirm(conf, out, CONFIRM_TOLERANCE)
        else:
            # A map redrawn without --confirm keeps the confirmations an earlier run left.
            conf = [c for c in load_confirm(out) if any(p.key == c.key for p in mm.points)]
    except KeyboardInterrupt:
        print(f"interrupted: runs so far kept under {out}", file=sys.stderr)
        return 130
    t = sim.tally
    timing = Timing(
        model_wall,
        model_cpu,
        t.runs,
        t.reused,
        t.wall_s,
        t.cpu_s,
        t.reused_wall_s,
        t.reused_cpu_s,
        emulated.runs,
        emulated.wall_s,
        time.perf_counter() - t_start,
    )
    table = rows(mm, sim)
    write_csv(table, out / "map.csv")
    write_json(mm, sim, settings, conf, timing, out / "map.json")
    colour = plot_heatmap(table, out / "map.png")
    src_table = source_rows(sources)
    if len(sources.sources()) > 1:
        write_csv(src_table, out / "sources.csv")
    write_report(mm, sim, settings, conf, timing, out, colour, sources)
    if args.json:
        print((out / "map.json").read_text())
        return 0
    print("\n".join(summary_lines(mm, sim, timing, sources)))
    if conf:
        for c in conf:
            d = "n/a" if c.diff is None else f"{c.diff:+.1%}"
            print(
                f"confirm {c.key}: emulated {_f(c.emulated.lambda_max)} "
                f"vs simulated {_f(c.simulated.lambda_max)} req/s "
                f"({d}; {'within' if c.within() else 'OUTSIDE'} {CONFIRM_TOLERANCE:.0%})"
            )
    print(f"-> {out / 'report.md'}, {out / 'map.csv'}, {out / 'map.png'}")
    return 0


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
