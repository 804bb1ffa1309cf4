"""`testbed replay` and `testbed up`: replay a trace (or the scenario's workload) on one or
several scenarios and write each run directory and a comparison."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from testbed.config.cli_args import StoreOnce, out_dir
from testbed.config.resolved import ResolvedScenario
from testbed.config.overrides import overrides_for
from testbed.core.scenario import Scenario
from testbed.studies.load import load
from testbed.studies.runner import RunResult
from testbed.traces.types import Trace


def _add_scenario_args(p: argparse.ArgumentParser) -> None:
    from testbed.traces.command import WINDOW_HELP, window_arg
    from testbed.traces.loader import SUPPORTED_FORMATS

    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a scenario field, e.g. --set scale.speedup=8 (repeatable)")
    p.add_argument("--trace", action=StoreOnce, help="trace file to replay instead of the scenario's synthetic workload")
    p.add_argument("--format", default="auto", choices=("auto", *SUPPORTED_FORMATS),
                   help="trace format (default: from the suffix, and a .csv's header)")
    p.add_argument("--window", type=window_arg, metavar="START:END",
                   help=f"replay only the trace's arrivals in this window, read from the file alone: {WINDOW_HELP}")
    p.add_argument("--sample", type=int, metavar="N", help="keep N requests of the trace drawn at random (after --window)")
    p.add_argument("--seed", type=int, metavar="S",
                   help="seed of --sample (default 1); without --trace, the synthetic workload's seed")
    p.add_argument("--keep-failed", action="store_true",
                   help="BurstGPT: replay failed requests (0 response tokens) with 1 output token instead of skipping")
    p.add_argument("--trace-model", dest="trace_models", action="append", metavar="NAME",
                   help="BurstGPT: replay only this model's requests, e.g. GPT-4 (repeatable)")
    p.add_argument("--rate", type=float, help="offered rate in paper req/s (rescales the trace's arrivals)")
    p.add_argument("--speedup", type=_speedup_arg, metavar="S|auto",
                   help="time scale (as --set scale.speedup=S); auto: the largest of 8, 4, 2, 1, 0.5, 0.25 at which a short "
                        "probe of this workload on this backend keeps time faithfully (probes kept under the run "
                        "directory's speedup-probes/)")
    p.add_argument("--requests", type=int, help="replay only the first N requests (after --window and --sample)")
    p.add_argument("--backend", action=StoreOnce, choices=["auto", "netns", "compose", "swarm", "local", "inproc", "sim"], default="auto",
                   help="netns: a namespace per service and shaped WAN links (root); compose: one container per "
                        "service, a WAN router container (Docker); swarm: the same as a Docker Swarm stack, each "
                        "datacenter on the nodes labelled for it (root, a swarm manager); local: one process per "
                        "service on loopback; inproc: all in this process; sim: the discrete-event simulator in "
                        "virtual time (no services, a flow-level link model); auto: netns if root, else local")
    p.add_argument("--json", action="store_true", help="print figures as JSON")


def _speedup_arg(v: str) -> str:
    if v == "auto":
        return v
    try:
        if float(v) > 0:
            return v
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--speedup must be a positive number or 'auto', got {v!r}")


def _overrides(args: argparse.Namespace, name: str | None = None) -> dict[str, Any]:
    from testbed.traces.types import TraceError

    ov = overrides_for(name, args.set) if name is not None else {}
    if getattr(args, "speedup", None) not in (None, "auto"):
        ov.setdefault("scale", {})["speedup"] = float(args.speedup)
    if args.trace is None:
        only = [f for f, v in (("--window", args.window), ("--sample", args.sample), ("--format", args.format != "auto"),
                               ("--keep-failed", args.keep_failed), ("--trace-model", args.trace_models)) if v]
        if only:
            raise TraceError(f"{', '.join(only)}: only with --trace FILE")
        wl: dict[str, Any] = {}
        if args.rate is not None:
            wl["rate"] = args.rate
        if args.requests is not None:
            wl["requests"] = args.requests
        if args.seed is not None:
            wl["seed"] = args.seed
        if wl:
            ov.setdefault("workload", {}).update(wl)
    else:
        for flag, n in (("--requests", args.requests), ("--sample", args.sample)):
            if n is not None and n <= 0:
                raise TraceError(f"{flag} must be a positive count, got {n}")
        if args.seed is not None and args.sample is None:
            raise TraceError("--seed with --trace seeds --sample; give --sample N too")
    return ov


def _trace_for(sc: Scenario, args: argparse.Namespace) -> Trace:
    """The scenario's workload, or --trace: --window and (without --sample) --requests are read
    from the file alone; then --sample, --requests, --rate in that order."""
    from testbed.traces import transforms
    from testbed.traces.loader import load_trace, trace_from_workload
    from testbed.traces.types import TraceError

    if args.trace is None:
        return trace_from_workload(sc.workload)
    head_in_loader = args.sample is None
    tr = load_trace(args.trace, args.format, window=args.window,
                    limit=args.requests if head_in_loader else None,
                    keep_failed=args.keep_failed, models=args.trace_models)
    for note in tr.notes:
        print(f"note: {args.trace}: {note}", file=sys.stderr)
    if args.sample is not None:
        if args.sample > len(tr):
            raise TraceError(f"--sample {args.sample}: the trace has {len(tr)} requests"
                             + (" in the window" if args.window is not None else ""))
        tr = transforms.sample(tr, args.sample, 1 if args.seed is None else args.seed)
    if args.requests is not None and not head_in_loader:
        tr = transforms.head(tr, args.requests)
    if len(tr) == 0:
        raise TraceError("no requests to replay" + (" in the window" if args.window is not None else ""),
                         path=args.trace)
    if args.rate is not None:
        try:
            tr = transforms.rescale_rate(tr, args.rate)
        except ValueError as e:
            raise TraceError(f"--rate {args.rate:g}: {e}") from None
    return tr


def _progress_runner(label: str, enabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("sent {task.fields[sent]}  failed {task.fields[failed]}"), TimeElapsedColumn(),
                    disable=not enabled, transient=False)
    return prog


async def _run_one(rs: ResolvedScenario, trace: Trace, out: Path, backend: str, show: bool) -> RunResult:
    from testbed.studies.runner import run_replay_async

    prog = _progress_runner(rs.name, show)
    task = prog.add_task(rs.name, total=len(trace), sent=0, failed=0)

    def cb(s: Any) -> None:
        prog.update(task, completed=s.completed + s.failed, sent=s.sent, failed=s.failed)

    with prog:
        return await run_replay_async(rs, trace, out, backend, on_progress=cb)


def cmd_replay(args: argparse.Namespace) -> int:
    from testbed.metrics.report import write_comparison

    names = args.compare or [args.scenario]
    if not names or names == [None]:
        print("replay: give --scenario NAME or --compare NAME...", file=sys.stderr)
        return 2
    scenarios = [load(n, _overrides(args, n)) for n in names]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(args.out) if args.out else Path("runs") / f"{stamp}-{'-vs-'.join(s.name for s in scenarios)}"
    show = not args.json and sys.stderr.isatty()
    from testbed.studies.runner import pick_backend, refuse_faults_in_sim
    backend, warning = pick_backend(args.backend)
    if backend == "sim":
        refuse_faults_in_sim(*scenarios)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    results = []
    try:
        for rs in scenarios:
            sc = rs.spec
            trace = _trace_for(sc, args)
            out = base / sc.name if len(scenarios) > 1 else base
            if args.speedup == "auto":
                from testbed.studies.speedup import pick_speedup, with_speedup
                s, tried = asyncio.run(pick_speedup(rs, trace, backend, out / "speedup-probes"))
                print(f"--speedup auto: {s:g} (" + ", ".join(
                    f"{t['speedup']:g}: {'valid' if t['valid'] else 'invalid'}" for t in tried) + ")", file=sys.stderr)
                rs = with_speedup(rs, s)
                sc = rs.spec
            if not args.json:
                print(f"replaying {len(trace)} requests of {trace.source} on {sc.name} "
                      f"(speedup {sc.scale.speedup:g}, byte_scale {sc.scale.byte_scale:g}) -> {out}", file=sys.stderr)
            results.append(asyncio.run(_run_one(rs, trace, out, backend, show)))
    except KeyboardInterrupt:
        print(f"interrupted: services stopped, records so far kept under {base}", file=sys.stderr)
        return 130
    if len(results) > 1:
        write_comparison([r.run_dir for r in results], base)
    if args.json:
        print(json.dumps({r.run_dir.name: r.summary for r in results} if len(results) > 1 else results[0].summary,
                         indent=1))
    else:
        from testbed.metrics.command import print_summary_table
        for r in results:
            print_summary_table(r.summary, title=f"{r.run_dir.name}")
        where = base / "comparison.md" if len(results) > 1 else base / "report.md"
        print(f"report: {where}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("replay", help="replay a trace against a scenario and report")
    r.add_argument("--scenario", action=StoreOnce, help="scenario name (scenarios/NAME.yaml) or path")
    r.add_argument("--compare", nargs="+", metavar="SCENARIO",
                   help="run several scenarios on the same workload and write one comparison report")
    r.add_argument("--out", action=StoreOnce, type=out_dir, help="run directory (default runs/<time>-<scenario>)")
    _add_scenario_args(r)
    r.set_defaults(func=cmd_replay)

    u = sub.add_parser("up", help="replay on the compose backend (or --backend swarm): build the image if needed, "
                                  "generate the compose (stack) file into the run directory, run, collect, tear down; "
                                  "with --hold, keep the deployment open for outside clients instead")
    u.add_argument("--scenario", action=StoreOnce, help="scenario name (scenarios/NAME.yaml) or path")
    u.add_argument("--compare", nargs="+", metavar="SCENARIO", help=argparse.SUPPRESS)
    u.add_argument("--out", action=StoreOnce, type=out_dir, help="run directory (default runs/<time>-<scenario>)")
    u.add_argument("--hold", action="store_true",
                   help="bring the deployment up on any --backend, print the OpenAI base URL this host reaches it "
                        "at, and keep it until Ctrl-C, SIGTERM or `testbed down`, recording every request outside "
                        "clients send; then write the records, summary and report. Runs at speedup 1 (paper time) "
                        "unless --set scale.speedup=S. With --json: one line {base_url, url, run_dir, backend, ...} "
                        "once ready")
    u.add_argument("--port", type=int, default=0,
                   help="with --hold: the loopback port of the base URL (default: a free one)")
    _add_scenario_args(u)
    u.set_defaults(func=cmd_up, backend="compose")


def cmd_up(args: argparse.Namespace) -> int:
    if args.hold:
        from testbed.studies.hold import cmd_hold
        return cmd_hold(args)
    if args.port:
        print("up: --port only with --hold", file=sys.stderr)
        return 2
    return cmd_replay(args)

