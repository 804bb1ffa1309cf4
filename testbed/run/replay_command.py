"""`testbed replay` and `testbed up`: replay a trace (or the scenario's workload) on one or
several scenarios and write each run directory and a comparison."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

# numpy (which the summary needs) first, from here: imported as deep as the trace readers would
# import it, its typing modules' thousands of calls kept crossing a boundary of the interpreter's
# frame stack, each crossing an mmap and a munmap (3,676 of them; 40 ms of the import).
import numpy  # noqa: F401

from testbed import compiled
from testbed.config import run_lock
from testbed.config.cli_args import StoreOnce, add_overwrite, out_dir
from testbed.config.resolved import ResolvedScenario
from testbed.deploy import registry
from testbed.deploy.prometheus import DEFAULT_LISTEN
from testbed.live.credentials import API_KEY_ENV, API_KEY_FILE, check_api_key
from testbed.run.load import load
from testbed.run.run_args import RunArgs, add_run_args, run_overrides, streamed_trace_for, trace_for
from testbed.traces.types import Trace

if TYPE_CHECKING:
    from testbed.run.runner import RunResult
    from testbed.traces.stream import TraceFile


def _add_scenario_args(p: argparse.ArgumentParser, backends: dict[str, Any]) -> None:
    """The flags `replay` and `up` share; `backends` is the `--backend` flag's choices, default and
    help (`testbed.deploy.registry.backend_option`)."""
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a scenario field, e.g. --set scale.speedup=8 (repeatable)",
    )
    add_run_args(p, speedup_auto=True)
    p.add_argument("--backend", action=StoreOnce, **backends)
    p.add_argument(
        "--prometheus",
        nargs="?",
        const=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"run Prometheus (the `prometheus` binary on PATH) against the deployment, listening on "
        f"HOST:PORT (default {DEFAULT_LISTEN}), with a scrape config generated into the run "
        "directory's prometheus/ (local and inproc backends; examples/observability/ has the "
        "dashboards)",
    )
    p.add_argument(
        "--api-key",
        action=StoreOnce,
        metavar="KEY",
        help=f"the API key the router asks of clients (`Authorization: Bearer KEY`); default: "
        f"${API_KEY_ENV} if set, else one made for the run (a held deployment prints it and writes "
        f"it to {API_KEY_FILE} in the run directory, readable by this user only)",
    )
    p.add_argument("--json", action="store_true", help="print figures as JSON")
    p.add_argument(
        "--accept-invalid",
        action="store_true",
        help="exit 0 even when the testbed marks a run invalid (its timing not faithful to the scenario), "
        "for exploration; the verdict still says INVALID. Without it such a run exits 3",
    )
    p.add_argument(
        "--report",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write report.md with its plots (and with --compare, comparison.md) into the run directory; "
        "default: yes for emulated runs, no for simulated ones, whose run directory is then only "
        "records, time series and summary.json (`testbed report RUN` writes the report later)",
    )


@dataclass(frozen=True)
class ReplayOptions:
    """`testbed replay`'s flags (and `up`'s without --hold), one field each (the workload flags
    and --set in `run`)."""

    run: RunArgs
    scenario: str | None = None
    compare: tuple[str, ...] = ()
    out: Path | None = None
    overwrite: bool = False
    backend: str = registry.AUTO
    prometheus: str | None = None
    api_key: str | None = None
    json: bool = False
    accept_invalid: bool = False
    report: bool | None = None  # None: the backend's default (`wants_report`)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> ReplayOptions:
        return cls(
            run=RunArgs.from_args(ns),
            scenario=ns.scenario,
            compare=tuple(ns.compare or ()),
            out=ns.out,
            overwrite=ns.overwrite,
            backend=ns.backend,
            prometheus=ns.prometheus,
            api_key=ns.api_key,
            json=ns.json,
            accept_invalid=ns.accept_invalid,
            report=ns.report,
        )


def wants_report(report: bool | None, backend: str) -> bool:
    """--report as given, else yes unless the backend simulates (plots cost a simulated run more
    than its simulation)."""
    return report if report is not None else not registry.get(backend).caps.simulator


async def _run_one(
    rs: ResolvedScenario,
    trace: Trace,
    out: Path,
    backend: str,
    show: bool,
    prometheus: str | None = None,
    report: bool = True,
) -> RunResult:
    from testbed.run.run_progress import run_progress
    from testbed.run.runner import run_replay_async

    prog = run_progress(rs.name, len(trace), expected_wall_s(trace, rs.spec.scale.speedup), show)
    with prog:
        return await run_replay_async(
            rs, trace, out, backend, on_progress=prog.update, report=report, prometheus=prometheus
        )


def expected_wall_s(trace: Trace | TraceFile, speedup: float) -> float:
    """Wall seconds from the first arrival to the last: the trace's span over the speedup (the
    drain after the last arrival and the deployment's start come on top)."""
    return trace.duration / speedup if len(trace) > 1 else 0.0


def run_one(
    rs: ResolvedScenario,
    trace: Trace | TraceFile,
    out: Path,
    backend: str,
    show: bool,
    prometheus: str | None = None,
    report: bool = True,
) -> RunResult:
    """One run on `backend`; a simulated one directly (no event loop, no progress bar: it takes
    seconds, and its progress comes at its end)."""
    if registry.get(backend).caps.simulator:
        from testbed.run.runner import run_sim

        return run_sim(rs, trace, out, report=report)
    from testbed.run.stoppable import run_stoppable

    assert isinstance(trace, Trace), "a live run holds its trace"
    return run_stoppable(_run_one(rs, trace, out, backend, show, prometheus, report))


def use_api_key(api_key: str | None) -> None:
    """--api-key is $TESTBED_API_KEY for this run: every deployment it builds takes the key from there
    (`testbed.live.credentials.Credentials.new`)."""
    if api_key is not None:
        check_api_key(api_key)
        os.environ[API_KEY_ENV] = api_key


def cmd_replay(args: argparse.Namespace) -> int:
    return replay(ReplayOptions.from_args(args))


def replay(args: ReplayOptions) -> int:
    """The command on its options: each scenario replayed into its run directory."""
    names = list(args.compare) or ([args.scenario] if args.scenario else [])
    if not names:
        print("replay: give --scenario NAME or --compare NAME...", file=sys.stderr)
        return 2
    use_api_key(args.api_key)
    scenarios = [load(n, run_overrides(args.run, n)) for n in names]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(args.out) if args.out else Path("runs") / f"{stamp}-{'-vs-'.join(s.name for s in scenarios)}"
    show = not args.json
    from testbed.deploy.registry import pick_backend, refuse_unhonoured

    backend, warning = pick_backend(args.backend)
    report = wants_report(args.report, backend)
    refuse_unhonoured(backend, scenarios)
    registry.check_host(backend)
    registry.check_capacity(backend, scenarios, args.run.force_capacity)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if args.prometheus is not None:
        from testbed.deploy.prometheus import find_binary, unavailable

        if why := unavailable(backend, find_binary()):
            print(f"replay: {why}", file=sys.stderr)
            return 2
    if len(scenarios) == 1:
        from testbed.run.runner import check_run_dir

        check_run_dir(base)  # a folder of the user's own files: refused before a lock file is made in it
    with run_lock.holding(base, args.overwrite):
        return _replay_into(args, scenarios, base, backend, report, show)


def _replay_into(
    args: ReplayOptions, scenarios: list[ResolvedScenario], base: Path, backend: str, report: bool, show: bool
) -> int:
    """The runs of `replay`/`up` into `base`, which this command holds."""
    results = []
    began = False
    try:
        if not args.json and registry.get(backend).caps.simulator and compiled.implementation() == compiled.STALE:
            print(compiled.STALE_NOTE, file=sys.stderr)  # once, not per scenario
        for rs in scenarios:
            sc = rs.spec
            # A simulated run reads a trace file as it goes (`testbed.traces.stream`).
            simulated = registry.get(backend).caps.simulator and args.run.speedup != "auto"
            trace = streamed_trace_for(sc, args.run) if simulated else trace_for(sc, args.run)
            began = True
            out = base / sc.name if len(scenarios) > 1 else base
            if args.run.speedup == "auto":
                from testbed.run.speedup import pick_speedup, with_speedup
                from testbed.run.stoppable import run_stoppable

                assert isinstance(trace, Trace), "an automatic speedup probes a held trace"

                s, tried = run_stoppable(pick_speedup(rs, trace, backend, out / "speedup-probes"))
                print(
                    f"--speedup auto: {s:g} ("
                    + ", ".join(f"{t.speedup:g}: {'valid' if t.valid else 'invalid'}" for t in tried)
                    + ")",
                    file=sys.stderr,
                )
                rs = with_speedup(rs, s)
                sc = rs.spec
            if not args.json:
                from testbed.run.run_progress import fmt_duration

                wall = (
                    "simulated"
                    if registry.get(backend).caps.simulator
                    else f"about {fmt_duration(expected_wall_s(trace, sc.scale.speedup))} of arrivals at this speedup, "
                    "plus start-up and drain"
                )
                print(
                    f"replaying {len(trace)} requests of {trace.source} on {sc.name} "
                    f"(speedup {sc.scale.speedup:g}, byte_scale {sc.scale.byte_scale:g}; {wall}) -> {out}",
                    file=sys.stderr,
                    flush=True,
                )
            results.append(run_one(rs, trace, out, backend, show, args.prometheus, report))
    except KeyboardInterrupt:
        if not began and not results:  # stopped while the trace was read: no run had begun
            print("interrupted before any run began: nothing recorded", file=sys.stderr)
        elif registry.get(backend).caps.simulator:
            print(
                f"interrupted: records so far kept under {base}; `testbed report RUN` summarises a run", file=sys.stderr
            )
        else:
            print(f"interrupted: services stopped, records so far kept under {base}", file=sys.stderr)
        return 130
    return _finish(args.json, args.accept_invalid, results, base, report)


def _finish(as_json: bool, accept_invalid: bool, results: list[RunResult], base: Path, report: bool) -> int:
    """Figures, closing block and exit status: an invalid run says so first (before its figures)
    and last (the verdict line), and exits EXIT_INVALID unless --accept-invalid."""
    from rich.console import Console
    from rich.text import Text

    from testbed.metrics.verdict import RunOutcome, closing_block, exit_code, invalid, invalid_headline

    comparison = None
    if len(results) > 1 and report:
        from testbed.metrics.report import write_comparison
        from testbed.run.run_progress import StepTicker

        with StepTicker(f"writing the comparison of {len(results)} runs into {base}", every_s=5.0):
            comparison = write_comparison([r.run_dir for r in results], base)
    outcomes = [RunOutcome(r.run_dir.name, r.run_dir, r.summary) for r in results]
    # With --json stdout is the JSON alone: the verdict goes to stderr.
    console = Console(stderr=as_json, highlight=False, soft_wrap=True)
    for line in invalid_headline(outcomes):
        console.print(Text(line, style="bold red"))
    if as_json:
        print(
            json.dumps(
                {r.run_dir.name: r.summary.to_json_dict() for r in results}
                if len(results) > 1
                else results[0].summary.to_json_dict(),
                indent=1,
            ),
            flush=True,
        )
    else:
        from testbed.metrics.report_command import print_summary_table

        for r in results:
            print_summary_table(r.summary, title=f"{r.run_dir.name}", console=console, validity=False)
    lines = []
    if len(results) > 1:
        from testbed.metrics.report import verdicts

        lines = verdicts([r.summary for r in results], [o.label for o in outcomes])
    block = closing_block(outcomes, comparison, lines, accept_invalid)
    rc = exit_code(outcomes, accept_invalid)
    for line in block[:-1]:
        console.print(Text(line))
    console.print(Text(block[-1], style="bold red" if invalid(outcomes) else "bold green"))
    return rc


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("replay", help="replay a trace against a scenario and report")
    r.add_argument("--scenario", action=StoreOnce, help="scenario name (scenarios/NAME.yaml) or path")
    r.add_argument(
        "--compare",
        nargs="+",
        metavar="SCENARIO",
        help="run several scenarios on the same workload and write one comparison report",
    )
    r.add_argument("--out", action=StoreOnce, type=out_dir, help="run directory (default runs/<time>-<scenario>)")
    add_overwrite(r, "the run directory")
    _add_scenario_args(r, registry.backend_option())
    r.set_defaults(func=cmd_replay)

    u = sub.add_parser(
        "up",
        help="bring a deployment up on --backend (compose and swarm: build the image if needed, "
        "generate the compose (stack) file into the run directory), replay, collect, tear "
        "down; with --hold, keep the deployment open for outside clients instead",
    )
    u.add_argument("--scenario", action=StoreOnce, help="scenario name (scenarios/NAME.yaml) or path")
    u.add_argument("--compare", nargs="+", metavar="SCENARIO", help=argparse.SUPPRESS)
    u.add_argument("--out", action=StoreOnce, type=out_dir, help="run directory (default runs/<time>-<scenario>)")
    add_overwrite(u, "the run directory")
    u.add_argument(
        "--hold",
        action="store_true",
        help="bring the deployment up on any --backend, print the OpenAI base URL this host reaches it "
        "at, and keep it until Ctrl-C, SIGTERM or `testbed down --force PREFIX`, recording every request outside "
        "clients send; then write the records, summary and report. Runs at speedup 1 (paper time) "
        "unless --set scale.speedup=S. With --json: one line {base_url, url, run_dir, backend, ...} "
        "once ready",
    )
    u.add_argument(
        "--port", type=int, default=0, help="with --hold: the loopback port of the base URL (default: a free one)"
    )
    # Every backend it offers can hold open; the default is every command's (auto), containers by --backend compose.
    _add_scenario_args(u, registry.backend_option(registry.holds_open))
    u.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> int:
    use_api_key(args.api_key)
    if args.hold:
        from testbed.run.hold import cmd_hold

        return cmd_hold(args)
    if args.port:
        print("up: --port only with --hold", file=sys.stderr)
        return 2
    return cmd_replay(args)
