"""The flags of every command that replays a workload (replay, up, capacity, sweep, crosscheck):
one group, so that --trace, --speedup, --seed, --requests ... mean the same and default the same
everywhere, and one place that applies them to a scenario and a trace."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from testbed.config.cli_args import StoreOnce
from testbed.config.overrides import overrides_for, set_path
from testbed.core.schema.scenario import Scenario
from testbed.traces.csvutil import Window
from testbed.traces.types import Trace, TraceError

if TYPE_CHECKING:
    from testbed.traces.stream import TraceFile


@dataclass(frozen=True)
class RunArgs:
    """The workload flags of `add_run_args` (and `--set` where the command has it), one field each."""

    trace: str | None = None
    format: str = "auto"
    window: Window | None = None
    sample: int | None = None
    seed: int | None = None
    keep_failed: bool = False
    trace_models: tuple[str, ...] = ()
    rate: float | None = None
    speedup: str | None = None  # a number, or "auto" where the command allows it
    requests: int | None = None
    force_capacity: bool = False
    set: tuple[str, ...] = ()
    arrivals: str | None = None  # open | closed (`testbed.core.sessions`)
    router: str | None = None  # where the command has --router
    router_policy: str | None = None

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> RunArgs:
        return cls(
            trace=ns.trace,
            format=ns.format,
            window=ns.window,
            sample=ns.sample,
            seed=ns.seed,
            keep_failed=ns.keep_failed,
            trace_models=tuple(ns.trace_models or ()),
            rate=ns.rate,
            speedup=ns.speedup,
            requests=ns.requests,
            force_capacity=ns.force_capacity,
            set=tuple(getattr(ns, "set", None) or ()),
            arrivals=getattr(ns, "arrivals", None),
            router=getattr(ns, "router", None),
            router_policy=getattr(ns, "router_policy", None),
        )


def add_run_args(
    p: argparse.ArgumentParser,
    *,
    speedup_auto: bool = False,
    rate: bool = True,
    requests_default: int | None = None,
    requests_help: str = "replay only the first N requests (after --window and --sample)",
) -> None:
    """The workload flags, each single-valued one refused when given twice (StoreOnce).
    `speedup_auto`: --speedup also takes `auto` (a probe picks it; only where one run follows).
    `rate=False` where the command chooses the offered rates itself."""
    from testbed.traces.loader import SUPPORTED_FORMATS
    from testbed.traces.trace_command import WINDOW_HELP, window_arg

    p.add_argument(
        "--trace", action=StoreOnce, help="trace file to replay instead of the scenario's synthetic workload"
    )
    p.add_argument(
        "--router",
        action=StoreOnce,
        choices=("testbed", "vllm-router", "sglang-router"),
        help="what stands in the router's place (router.kind): the testbed's router, or a real PD router "
        "from the routers extra, driving the nodes in its engine's protocol",
    )
    p.add_argument(
        "--router-policy",
        action=StoreOnce,
        metavar="POLICY",
        help="a foreign router's policy (router.policy; default its own, cache_aware)",
    )
    p.add_argument(
        "--format",
        action=StoreOnce,
        default="auto",
        choices=("auto", *SUPPORTED_FORMATS),
        help="trace format (default: from the suffix, and a .csv's header)",
    )
    p.add_argument(
        "--window",
        action=StoreOnce,
        type=window_arg,
        metavar="START:END",
        help=f"replay only the trace's arrivals in this window, read from the file alone: {WINDOW_HELP}",
    )
    p.add_argument(
        "--sample",
        action=StoreOnce,
        type=int,
        metavar="N",
        help="keep N requests of the trace drawn at random (after --window)",
    )
    p.add_argument(
        "--seed",
        action=StoreOnce,
        type=int,
        metavar="S",
        help="seed of --sample (default 1); without --trace, the synthetic workload's seed",
    )
    p.add_argument(
        "--keep-failed",
        action="store_true",
        help="BurstGPT: replay failed requests (0 response tokens) with 1 output token instead of skipping",
    )
    p.add_argument(
        "--trace-model",
        dest="trace_models",
        action="append",
        metavar="NAME",
        help="BurstGPT: replay only this model's requests, e.g. GPT-4 (repeatable)",
    )
    if rate:
        p.add_argument(
            "--rate", action=StoreOnce, type=float, help="offered rate in paper req/s (rescales the trace's arrivals)"
        )
    else:
        p.set_defaults(rate=None)
    if speedup_auto:
        p.add_argument(
            "--speedup",
            action=StoreOnce,
            type=speedup_arg,
            metavar="S|auto",
            help="time scale (as --set scale.speedup=S); auto: the largest of 8, 4, 2, 1, 0.5, 0.25 at "
            "which a short probe of this workload on this backend keeps time faithfully (probes "
            "kept under the run directory's speedup-probes/)",
        )
    else:
        p.add_argument(
            "--speedup",
            action=StoreOnce,
            type=positive_speedup,
            metavar="S",
            help="time scale (as --set scale.speedup=S)",
        )
    p.add_argument("--requests", action=StoreOnce, type=int, default=requests_default, help=requests_help)
    p.add_argument(
        "--arrivals",
        action=StoreOnce,
        choices=("open", "closed"),
        help="open: every request at its timestamp (default); closed: each turn of a session once its "
        "parent's answer arrived plus its think time, never before (as --set workload.arrivals=...)",
    )
    p.add_argument(
        "--force-capacity",
        action="store_true",
        help="start the deployment even where the host check finds it too large for this host's free "
        "memory, CPUs, process or open-file limits (by default refused, with the figures, before "
        "anything starts)",
    )


def speedup_arg(v: str) -> str:
    """argparse `type` of --speedup where `auto` is allowed."""
    if v == "auto" or _positive(v):
        return v
    raise argparse.ArgumentTypeError(f"--speedup must be a positive number or 'auto', got {v!r}")


def positive_speedup(v: str) -> str:
    """argparse `type` of --speedup where each run takes the one given."""
    if _positive(v):
        return v
    if v == "auto":
        # auto probes one workload on one backend for the speedup one run keeps time at; a search or
        # a sweep runs many workloads and rates, which one probe cannot answer for.
        raise argparse.ArgumentTypeError(
            "--speedup auto picks the speedup of one run (replay, up); here every probe "
            "or point runs at the number given: pass one (e.g. 4)"
        )
    raise argparse.ArgumentTypeError(f"--speedup must be a positive number, got {v!r}")


def _positive(v: str) -> bool:
    try:
        return float(v) > 0
    except ValueError:  # not a number: the caller names the flag
        return False


def run_assignments(args: RunArgs) -> list[tuple[str, Any]]:
    """The workload flags as scenario fields (`--speedup` -> scale.speedup; without --trace,
    --rate/--requests/--seed -> workload.*), after checking the flags that need --trace have it.
    TraceError (a UserError) names the flag."""
    out: list[tuple[str, Any]] = []
    if args.router is not None:
        out.append(("router.kind", args.router))
    if args.router_policy is not None:
        out.append(("router.policy", args.router_policy))
    if args.speedup is not None and args.speedup != "auto":
        out.append(("scale.speedup", float(args.speedup)))
    if args.arrivals is not None:
        out.append(("workload.arrivals", args.arrivals))
    if args.trace is None:
        only = [
            f
            for f, v in (
                ("--window", args.window),
                ("--sample", args.sample),
                ("--format", args.format != "auto"),
                ("--keep-failed", args.keep_failed),
                ("--trace-model", args.trace_models),
            )
            if v
        ]
        if only:
            raise TraceError(f"{', '.join(only)}: only with --trace FILE")
        out += [
            (f"workload.{k}", v)
            for k, v in (("rate", args.rate), ("requests", args.requests), ("seed", args.seed))
            if v is not None
        ]
    else:
        for flag, n in (("--requests", args.requests), ("--sample", args.sample)):
            if n is not None and n <= 0:
                raise TraceError(f"{flag} must be a positive count, got {n}")
        if args.seed is not None and args.sample is None:
            raise TraceError("--seed with --trace seeds --sample; give --sample N too")
    return out


def run_overrides(args: RunArgs, name: str | None = None) -> dict[str, Any]:
    """Scenario overrides of `--set` (when the command has it) and the workload flags; the flags win."""
    ov = overrides_for(name, list(args.set)) if name is not None else {}
    for path, value in run_assignments(args):
        set_path(ov, {}, path, value)
    return ov


def warn_if_planned(sc: Scenario) -> None:
    """A plan file run without --trace replays the base's synthetic workload, not what it was sized for: say so."""
    if sc.workload.planned_for:
        print(
            f"warning: {sc.name} was planned for {sc.workload.planned_for}; without --trace this run replays "
            f"the scenario's synthetic workload instead",
            file=sys.stderr,
        )


def streamed_trace_for(sc: Scenario, args: RunArgs) -> Trace | TraceFile:
    """`trace_for`, read from the file as the run needs it (`testbed.traces.stream`) where that
    gives the same run: a trace file taken as it is (no --sample, no --rate) replayed open loop
    without stated sessions. Otherwise the trace `trace_for` loads."""
    from testbed.traces.stream import open_trace_file

    if args.trace is None or args.sample is not None or args.rate is not None or sc.workload.arrivals != "open":
        return trace_for(sc, args)
    tf = open_trace_file(
        args.trace,
        args.format,
        window=args.window,
        limit=args.requests,
        keep_failed=args.keep_failed,
        models=list(args.trace_models) or None,
    )
    _notes(args, tf)
    _check_selected(args, tf)
    return tf.load() if tf.stated_sessions or tf.held is not None else tf


def _notes(args: RunArgs, tr: Trace | TraceFile) -> None:
    for note in tr.notes:
        print(f"note: {args.trace}: {note}", file=sys.stderr)


def _check_selected(args: RunArgs, tr: Trace | TraceFile) -> None:
    """No request selected is an error; all at one instant, a burst (said)."""
    if len(tr) == 0:
        raise TraceError(
            "no requests to replay" + (" in the window" if args.window is not None else ""), path=args.trace
        )
    if tr.is_burst and args.rate is None:
        print(
            f"note: {args.trace}: the {len(tr)} requests selected all arrive at one instant: they are "
            "sent as one burst, and run.json's offered_rate is null (a burst has no rate)",
            file=sys.stderr,
        )


def trace_for(sc: Scenario | None, args: RunArgs) -> Trace:
    """The scenario's workload, or --trace: --window and (without --sample) --requests are read
    from the file alone; then --sample, --requests, --rate in that order."""
    from testbed.traces import transforms
    from testbed.traces.loader import load_trace, trace_from_workload

    if args.trace is None:
        assert sc is not None, "the scenario's workload needs the scenario"
        warn_if_planned(sc)
        return trace_from_workload(sc.workload)
    head_in_loader = args.sample is None
    tr = load_trace(
        args.trace,
        args.format,
        window=args.window,
        limit=args.requests if head_in_loader else None,
        keep_failed=args.keep_failed,
        models=list(args.trace_models) or None,
    )
    _notes(args, tr)
    if args.sample is not None:
        if args.sample > len(tr):
            raise TraceError(
                f"--sample {args.sample}: the trace has {len(tr)} requests"
                + (" in the window" if args.window is not None else "")
            )
        tr = transforms.sample(tr, args.sample, 1 if args.seed is None else args.seed)
    if args.requests is not None and not head_in_loader:
        tr = transforms.head(tr, args.requests)
    _check_selected(args, tr)
    if args.rate is not None:
        tr = at_rate(tr, args.rate, "--rate")
    return tr


def at_rate(tr: Trace, rate: float, what: str = "rate") -> Trace:
    """`tr` with its arrivals rescaled to `rate` paper req/s; TraceError naming `what` if it cannot be."""
    from testbed.traces import transforms

    try:
        return transforms.rescale_rate(tr, rate)
    except ValueError as e:
        raise TraceError(f"{what} {rate:g}: {e}") from None
