"""`testbed capacity`: Lambda_max of one scenario by bisection (`studies.capacity`), or with
several scenarios the paper's Table 6 by emulation (`studies.paper_table`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from testbed.config import run_lock
from testbed.config.cli_args import StoreOnce, add_overwrite, out_dir
from testbed.config.resolved import ResolvedScenario
from testbed.deploy import registry
from testbed.run.load import load
from testbed.run.run_args import RunArgs, add_run_args, run_overrides, trace_for, warn_if_planned
from testbed.run.stoppable import run_stoppable
from testbed.studies.capacity.capacity import model_lambda, search, write_outputs
from testbed.studies.capacity.paper_table import DEFAULT_GROWTH_S, rebuild_table, run_table
from testbed.traces.types import Trace


@dataclass(frozen=True)
class CapacityOptions:
    """`testbed capacity`'s flags, one field each (the workload flags in `run`)."""

    scenario: tuple[str, ...]
    run: RunArgs
    backend: str = "auto"
    lo: float | None = None
    hi: float | None = None
    probes: int = 6
    ttft_slo: float | None = None
    growth_limit: float = 0.25
    wait_growth: float | None = None
    common_rate: float | None = None
    table_only: bool = False
    spread: float = 0.25
    out: Path | None = None
    overwrite: bool = False
    json: bool = False

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> CapacityOptions:
        return cls(
            scenario=tuple(ns.scenario),
            run=RunArgs.from_args(ns),
            backend=ns.backend,
            lo=ns.lo,
            hi=ns.hi,
            probes=ns.probes,
            ttft_slo=ns.ttft_slo,
            growth_limit=ns.growth_limit,
            wait_growth=ns.wait_growth,
            common_rate=ns.common_rate,
            table_only=ns.table_only,
            spread=ns.spread,
            out=ns.out,
            overwrite=ns.overwrite,
            json=ns.json,
        )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "capacity",
        help="measure Lambda_max by emulation, or simulation with --backend sim "
        "(bisection over offered rates); with several scenarios, the paper's "
        "Table 6",
    )
    p.add_argument(
        "--scenario",
        action="append",
        required=True,
        help="scenario (repeatable: several give table6.md with the model beside the measurements)",
    )
    p.add_argument(
        "--backend",
        action=StoreOnce,
        **registry.backend_option(lead="where every probe runs (sim: seconds instead of minutes)"),
    )
    add_run_args(
        p,
        rate=False,
        requests_default=240,
        requests_help="requests per probe (default 240; with --trace, its first N after --window and --sample)",
    )
    p.add_argument("--lo", type=float, help="a rate expected to be stable (default 0.6 x the model's Lambda_max)")
    p.add_argument("--hi", type=float, help="a rate expected to be unstable (default 1.3 x the model's Lambda_max)")
    p.add_argument("--probes", type=int, default=6, help="replays in all (default 6)")
    p.add_argument("--ttft-slo", type=float, help="P90 TTFT SLO in paper seconds (default: the scenario's slo.ttft_s)")
    p.add_argument(
        "--growth-limit",
        type=float,
        default=0.25,
        help="unstable when mean wait grows by more than this fraction of the TTFT SLO (default 0.25)",
    )
    p.add_argument(
        "--wait-growth",
        type=float,
        metavar="S",
        help="unstable when mean wait grows by more than S paper seconds (overrides --growth-limit; "
        f"default with several scenarios: {2.5:g})",
    )
    p.add_argument(
        "--common-rate",
        type=float,
        metavar="R",
        help="several scenarios: offered load of the TTFT comparison (default 0.75 x the lowest measured Lambda_max)",
    )
    p.add_argument(
        "--table-only",
        action="store_true",
        help="several scenarios: rewrite table6.md from the run directories already under --out",
    )
    p.add_argument(
        "--spread",
        type=float,
        default=0.25,
        help="several scenarios: bisection between (1 - spread) and (1 + spread) x the model's Lambda_max",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a scenario field, e.g. --set scale.speedup=2 (repeatable)",
    )
    p.add_argument(
        "--out",
        action=StoreOnce,
        type=out_dir,
        help="output directory (default runs/<time>-capacity-<scenario>, or runs/<time>-table6)",
    )
    add_overwrite(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of Markdown")
    p.set_defaults(func=cmd_capacity)


def cmd_capacity(args: argparse.Namespace) -> int:
    return capacity(CapacityOptions.from_args(args))


def capacity(args: CapacityOptions) -> int:
    """The command on its options: one scenario's Lambda_max, or with several the Table 6 study."""
    from testbed.deploy.registry import pick_backend, refuse_unhonoured

    scenarios = [load(name, run_overrides(args.run, name)) for name in args.scenario]
    trace = trace_for(None, args.run) if args.run.trace is not None else None
    if trace is None:
        for rs in scenarios:
            warn_if_planned(rs.spec)
    n = args.run.requests if trace is None else len(trace)
    backend, warning = pick_backend(args.backend)
    refuse_unhonoured(backend, scenarios)
    registry.check_host(backend)
    registry.check_capacity(backend, scenarios, args.run.force_capacity)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if len(scenarios) > 1:
        return _cmd_table(args, scenarios, backend, trace)
    rs = scenarios[0]
    sc = rs.spec
    model = model_lambda(sc, rs.inter_dc.rate, trace)
    lo = args.lo or (0.6 * model if model else 1.0)
    hi = args.hi or (1.3 * model if model else 4.0)
    out: Path = args.out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-capacity-{sc.name}"
    run_lock.acquire(out, args.overwrite)  # this command's until it returns
    ttft_slo = args.ttft_slo or sc.slo.ttft_s
    print(
        f"capacity of {sc.name}: bisection in [{lo:.3f}, {hi:.3f}] req/s, {args.probes} probes of "
        f"{n} requests{'' if trace is None else ' of ' + trace.source}, backend {backend}, "
        f"{sc.workload.arrivals} arrivals -> {out}",
        file=sys.stderr,
    )
    try:
        res = run_stoppable(
            search(
                rs,
                out,
                backend,
                lo,
                hi,
                args.probes,
                args.growth_limit,
                ttft_slo,
                growth_s=args.wait_growth,
                trace=trace,
            )
        )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    write_outputs(res, out)
    if args.json:
        print(json.dumps(asdict(res), indent=1))
    else:
        _show(out / "capacity.md")
    return 0


def _cmd_table(args: CapacityOptions, scenarios: list[ResolvedScenario], backend: str, trace: Trace | None) -> int:
    out: Path = args.out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-table6"
    run_lock.acquire(out, args.overwrite)
    ttft_slo = args.ttft_slo or max(rs.spec.slo.ttft_s for rs in scenarios)
    growth = args.wait_growth if args.wait_growth is not None else DEFAULT_GROWTH_S
    print(
        f"Table 6 by {'simulation' if registry.is_simulated(backend) else 'emulation'}: "
        f"{', '.join(rs.name for rs in scenarios)}; "
        f"{args.probes} probes of {args.run.requests if trace is None else len(trace)} "
        f"requests each, backend {backend} -> {out}",
        file=sys.stderr,
    )
    if args.table_only:
        try:
            deps = rebuild_table(scenarios, out, ttft_slo, growth)
        except FileNotFoundError as e:
            print(f"capacity --table-only: {e.filename}: missing; run without --table-only first", file=sys.stderr)
            return 2
        _show(out / "table6.md")
        return 0
    try:
        deps = run_stoppable(
            run_table(scenarios, out, backend, args.probes, ttft_slo, growth, args.common_rate, args.spread, trace)
        )
    except KeyboardInterrupt:
        print(f"interrupted: probes so far kept under {out}", file=sys.stderr)
        return 130
    if args.json:
        print((out / "table6.json").read_text())
    else:
        _show(out / "table6.md")
    return 0 if all(d.capacity.lambda_max is not None for d in deps) else 1


def _show(md: Path) -> None:
    """A Markdown result on stdout: rendered on a terminal, as written (Markdown) into a pipe or file."""
    text = md.read_text()
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(text))
        print(f"(written to {md})")
    else:
        print(text)
