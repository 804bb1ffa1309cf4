"""`testbed crosscheck`: the analytical model, the simulator and an emulation on one workload.

For each scenario: the simulator (`--backend sim`) and an emulation (`--backend`, default auto)
replay the same seeded trace into `DIR/sim/` and `DIR/emulation/` (normal run directories), or
`--emulated RUN` reuses an emulation recorded before; then `crosscheck.md` and `crosscheck.json`
set the model's figures, the simulation's and the emulation's side by side with the
simulation's difference and a verdict against the tolerances of `crosscheck_table`, and explain
every difference that matters from the records. A fault scenario adds each fault's effects in
both runs (`crosscheck_faults`), with the differences in failed and retried requests explained. A report,
not a gate: exit 0 once compared; with `--check`, 1 when a judged metric is outside its tolerance.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from testbed.config import run_lock
from testbed.config.cli_args import StoreOnce, add_overwrite, out_dir
from testbed.config.resolved import ResolvedScenario
from testbed.core.errors import UserError
from testbed.deploy import registry
from testbed.metrics.artefacts import Summary
from testbed.model.errors import ModelError
from testbed.run.run_args import RunArgs, add_run_args, run_overrides, trace_for
from testbed.run.stoppable import run_stoppable
from testbed.studies.crosscheck.crosscheck_explain import Side
from testbed.studies.crosscheck.crosscheck_table import Crosscheck, compare
from testbed.traces.types import Trace


class CrosscheckError(UserError, ValueError):
    """Unusable input: the message names the run directory or file."""


@dataclass(frozen=True)
class CrosscheckOptions:
    """`testbed crosscheck`'s flags, one field each (the workload flags and --set in `run`)."""

    scenario: tuple[str, ...]
    run: RunArgs
    backend: str = registry.AUTO
    out: Path | None = None
    overwrite: bool = False
    skip_emulation: bool = False
    emulated: Path | None = None
    check: bool = False
    peer: str | None = None
    peer_scheduler: str = "matched"
    peer_router: str = "kv"
    peer_deployment: str = "scenario"
    json: bool = False

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> CrosscheckOptions:
        return cls(
            scenario=tuple(ns.scenario),
            run=RunArgs.from_args(ns),
            backend=ns.backend,
            out=ns.out,
            overwrite=ns.overwrite,
            skip_emulation=ns.skip_emulation,
            emulated=ns.emulated,
            check=ns.check,
            peer=ns.peer,
            peer_scheduler=ns.peer_scheduler,
            peer_router=ns.peer_router,
            peer_deployment=ns.peer_deployment,
            json=ns.json,
        )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "crosscheck",
        help="model, simulation and emulation of one workload side by side, each "
        "difference against a tolerance and explained from the records",
    )
    p.add_argument(
        "--scenario",
        action="append",
        required=True,
        metavar="NAME",
        help="scenario name or path (repeatable: one crosscheck each, DIR/<scenario>/)",
    )
    add_run_args(p)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a scenario field, e.g. --set scale.speedup=8 (repeatable)",
    )
    p.add_argument(
        "--backend", action=StoreOnce, **registry.backend_option(registry.emulates, lead="the emulation's backend")
    )
    p.add_argument(
        "--out", action=StoreOnce, type=out_dir, help="output directory (default runs/crosscheck-<scenario>)"
    )
    add_overwrite(p)
    p.add_argument("--skip-emulation", action="store_true", help="compare model and simulation only")
    p.add_argument(
        "--emulated",
        type=Path,
        metavar="RUN",
        help="reuse a recorded emulation instead of running one: its run directory, or with several "
        "scenarios the directory holding RUN/<scenario>/ (as `replay --compare` writes)",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when a judged metric is outside its tolerance")
    p.add_argument(
        "--peer",
        action=StoreOnce,
        choices=("dynamo",),
        help="instead of an emulation, replay the same trace in a peer simulator with the same worker "
        "counts and timing tables and set both side by side (dynamo: NVIDIA Dynamo's mocker, the "
        "optional `peer` extra); writes DIR/sim/, DIR/dynamo/ and peer-crosscheck.md",
    )
    p.add_argument(
        "--peer-scheduler",
        action=StoreOnce,
        choices=("matched", "native"),
        default="matched",
        help="with --peer dynamo: matched (default) makes its prefill workers compute one whole prompt "
        "at a time as the testbed's do; native keeps its vLLM scheduler defaults (chunked prefill, "
        "batched prompts)",
    )
    p.add_argument(
        "--peer-router",
        action=StoreOnce,
        choices=("kv", "load"),
        default="kv",
        help="with --peer dynamo: kv (default) is its KV router as shipped, which sends a request where its "
        "prefix is cached; load gives cached blocks no credit, placing by load alone",
    )
    p.add_argument(
        "--peer-deployment",
        action=StoreOnce,
        choices=("scenario", "peer"),
        default="scenario",
        help="with --peer dynamo: the testbed side's prefix caches and placement: scenario (default) keeps the "
        "scenario's; peer deploys them as the mocker does (a cache per prefill instance, kv_overlap placement "
        "with its router's weight)",
    )
    p.add_argument("--json", action="store_true", help="print crosscheck.json instead of tables")
    p.set_defaults(func=cmd_crosscheck)


def model_figures(rs: ResolvedScenario, trace: Trace, from_trace: bool) -> tuple[dict[str, float | None], str]:
    """What the analytical model predicts of the crosscheck's metrics, and a note saying how."""
    from testbed.core.engine.kvsize import KVModel
    from testbed.model.analytical import evaluate
    from testbed.model.workload import TraceWorkload

    sc = rs.spec
    wl = TraceWorkload.from_trace(trace, KVModel.from_spec(sc.model)).model_workload() if from_trace else None
    try:
        r = evaluate(sc, rs.inter_dc.rate, threshold=None if rs.threshold is None else int(rs.threshold), workload=wl)
    except ModelError as e:
        return {}, f"Model: not evaluated ({e})."
    rate = trace.rate
    per_request = r.p * r.kv_long_bytes
    figures: dict[str, float | None] = {
        "throughput": min(rate, r.lambda_max) if 0 < rate < math.inf else None,
        "ttft_mean": r.ttft_mean_s,
        "ttft_p90": r.ttft_p90_s,
        "offload_ratio": r.p,
        "wan_bytes_total": per_request * len(trace),
        "wan_bytes_per_request": per_request,
        "transfer_tail": r.kv_tail_mean_s,
    }
    note = (
        f"Model: the analytical model (`testbed model`) on {'the trace' if from_trace else 'the scenario'}'s length "
        f"distribution, not this sample: queue-free, so its TTFT is the prefill time alone and its throughput "
        f"min(offered rate, Λ_max = {r.lambda_max:.2f} req/s); it predicts no TPOT, queue wait or transfer "
        "duration."
    )
    return figures, note


def emulated_dir(given: Path, scenario: str, several: bool) -> Path:
    if not several and (given / "run.json").is_file():
        return given
    d = given / scenario
    if not (d / "run.json").is_file():
        raise CrosscheckError(
            f"--emulated {given}: no run directory "
            + (f"{given} or " if not several else "")
            + f"{d} (run.json missing)"
        )
    return d


def check_same_workload(run_dir: Path, rs: ResolvedScenario, trace: Trace, side: Side) -> None:
    """A reused emulation must have replayed this scenario's trace at this scale."""
    from testbed.metrics.summary import read_run_info

    meta = read_run_info(run_dir)
    where = run_dir / "run.json"
    if registry.is_simulated(meta.backend):
        print(f"warning: {where}: this run was simulated (backend sim), not emulated", file=sys.stderr)
    if meta.scenario != rs.name:
        raise CrosscheckError(f"{where}: field 'scenario': {meta.scenario!r}, not {rs.name!r}")
    for k in ("speedup", "byte_scale"):
        want, got = getattr(rs.scale, k), getattr(meta.scale, k)
        if got != want:
            raise CrosscheckError(
                f"{where}: field 'scale.{k}': {got!r}, the simulation's is {want:g}; give "
                f"--set scale.{k}={got:g} to simulate the same"
            )
    recs = {r.trace_index: r for r in side.records}
    if len(side.records) != len(trace):
        raise CrosscheckError(
            f"{run_dir / 'records.csv'}: {len(side.records)} requests, this workload has "
            f"{len(trace)}: give the options the emulated run was made with (--requests, --rate, "
            "--trace, --set workload.*)"
        )
    for i, tr in enumerate(trace):
        r = recs.get(i)
        if r is None or (r.input_tokens, r.output_tokens) != (tr.input_tokens, tr.output_tokens):
            got = "none" if r is None else f"{r.input_tokens}/{r.output_tokens}"
            raise CrosscheckError(
                f"{run_dir / 'records.csv'}: request {i} ({tr.request_id}) has input/output tokens "
                f"{got}, this workload's {tr.input_tokens}/{tr.output_tokens}: not the same workload"
            )
    offered = meta.offered_rate
    if offered is not None and trace.rate < math.inf and not math.isclose(offered, trace.rate, rel_tol=1e-6):
        raise CrosscheckError(f"{where}: field 'offered_rate': {offered:g} req/s, this workload's {trace.rate:g}")


def _side(label: str, run_dir: Path, summary: Summary | None = None) -> Side:
    from testbed.metrics.summary import load_records, summarize

    return Side(label, str(run_dir), summary if summary is not None else summarize(run_dir), load_records(run_dir))


def crosscheck_one(
    rs: ResolvedScenario, trace: Trace, out: Path, args: CrosscheckOptions, several: bool, backend: str
) -> Crosscheck:
    from testbed.run.replay_command import _run_one
    from testbed.run.runner import run_sim
    from testbed.studies.crosscheck.crosscheck_report import write

    show = not args.json  # a bar on a terminal, plain lines in a log (testbed.run.run_progress)
    emu: Side | None = None
    if args.emulated is not None:
        d = emulated_dir(args.emulated, rs.name, several)
        emu = _side("emulation", d)
        check_same_workload(d, rs, trace, emu)
    sc = rs.spec
    print(f"simulating {len(trace)} requests of {trace.source} on {sc.name} -> {out / 'sim'}", file=sys.stderr)
    res = run_sim(rs, trace, out / "sim")
    sim = _side("sim", out / "sim", res.summary)
    if emu is None and not args.skip_emulation:
        print(
            f"emulating the same on the {backend} backend (speedup {sc.scale.speedup:g}, byte_scale "
            f"{sc.scale.byte_scale:g}) -> {out / 'emulation'}",
            file=sys.stderr,
        )
        r = run_stoppable(_run_one(rs, trace, out / "emulation", backend, show))
        emu = _side("emulation", out / "emulation", r.summary)
    model, note = model_figures(rs, trace, args.run.trace is not None)
    c = compare(sc.name, sim, emu, model, note)
    write([c], out)
    return c


def cmd_crosscheck(ns: argparse.Namespace) -> int:
    args = CrosscheckOptions.from_args(ns)
    if args.peer is not None:
        return peer_crosscheck(args)
    return crosscheck(args)


def crosscheck(args: CrosscheckOptions) -> int:
    """The command on its options: model, simulation and emulation of each scenario."""
    from testbed.run.load import load
    from testbed.studies.crosscheck.crosscheck_report import print_table, write

    if args.skip_emulation and (args.emulated is not None or args.check):
        print(
            "crosscheck: --skip-emulation compares model and simulation only; it takes neither --emulated nor --check",
            file=sys.stderr,
        )
        return 2
    emulate = args.emulated is None and not args.skip_emulation
    warning = None
    backend = args.backend
    if emulate:
        backend, warning = registry.pick_backend(args.backend)
    names: list[str] = list(dict.fromkeys(args.scenario))
    several = len(names) > 1
    scenarios = [load(n, run_overrides(args.run, n)) for n in names]
    for b in ("sim", backend) if emulate else ("sim",):  # crosscheck always simulates
        registry.refuse_unhonoured(b, scenarios)
    if emulate:
        registry.check_host(backend)
        registry.check_capacity(backend, scenarios, args.run.force_capacity)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    base: Path = args.out or Path("runs") / f"crosscheck-{'-'.join(rs.name for rs in scenarios)}"
    run_lock.acquire(base, args.overwrite)  # this command's until it returns
    checks: list[Crosscheck] = []
    try:
        for rs in scenarios:
            out = base / rs.name if several else base
            checks.append(crosscheck_one(rs, trace_for(rs.spec, args.run), out, args, several, backend))
    except KeyboardInterrupt:
        print(f"interrupted: what ran is kept under {base}", file=sys.stderr)
        return 130
    path = write(checks, base) if several else base / "crosscheck.md"
    if args.json:
        print((base / "crosscheck.json").read_text(), end="")
    else:
        for c in checks:
            print_table(c)
        print(f"report: {path}")
    failed = [f"{c.scenario}: {label}" for c in checks for label in c.failed_labels()]
    if args.check and failed:
        print(f"crosscheck --check: {len(failed)} outside tolerance: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


def peer_crosscheck(args: CrosscheckOptions) -> int:
    """`crosscheck --peer`: the testbed's simulator beside a peer simulator (`peer_check`)."""
    assert args.peer is not None, "cmd_crosscheck sends only --peer here"
    from testbed.run.load import load
    from testbed.studies.crosscheck.peer_check import check_peer, print_table, run_peer_check

    if args.emulated is not None or args.skip_emulation or args.backend not in (None, registry.AUTO):
        print(
            "crosscheck: --peer runs no emulation; it takes none of --emulated, --skip-emulation, --backend",
            file=sys.stderr,
        )
        return 2
    names: list[str] = list(dict.fromkeys(args.scenario))
    if len(names) > 1:
        print("crosscheck: --peer compares one scenario at a time", file=sys.stderr)
        return 2
    rs = load(names[0], run_overrides(args.run, names[0]))
    registry.refuse_unhonoured("sim", [rs])
    check_peer(args.peer, rs)
    out: Path = args.out or Path("runs") / f"crosscheck-{rs.name}-{args.peer}"
    run_lock.acquire(out, args.overwrite)
    try:
        c = run_peer_check(
            rs, trace_for(rs.spec, args.run), out, args.peer_scheduler, args.peer_router, args.peer_deployment
        )
    except KeyboardInterrupt:
        print(f"interrupted: what ran is kept under {out}", file=sys.stderr)
        return 130
    if args.json:
        print((out / "peer-crosscheck.json").read_text(), end="")
    else:
        print_table(c)
        print(f"report: {out / 'peer-crosscheck.md'}")
    if args.check and c.outside:
        print(
            "crosscheck --check: outside ±10%: " + "; ".join(f"{r.label} {r.cells['diff']}" for r in c.outside),
            file=sys.stderr,
        )
        return 1
    return 0
