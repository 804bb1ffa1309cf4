"""One replay run, start to finish: run directory, services, replay, summary and report.

The run directory is written as the run goes; an interrupted run (Ctrl-C) still stops every
service it started and keeps the records gathered so far, then summarises them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import platform
import signal
import sys
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

from testbed.config.cli_args import check_out_dir
from testbed.config.resolved import ResolvedScenario
from testbed.deploy.base import Backend
from testbed.deploy.loopback import LoopbackBackend
from testbed.live.clock import now
from testbed.live.hostload import sample_host
from testbed.metrics.series_format import SeriesWriter
from testbed.live.replayer import ReplayStats, replay
from testbed.metrics.records import RecordWriter
from testbed.config.scenarios import dump_scenario
from testbed.core.scenario import Scenario
from testbed.traces.types import Trace, TraceRequest
from testbed.core.errors import UserError


log = logging.getLogger("testbed.runner")


@dataclass
class RunResult:
    run_dir: Path
    stats: ReplayStats
    interrupted: bool
    summary: dict[str, Any]


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for pkg in ("prfaas-testbed", "aiohttp", "numpy", "pydantic"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


# What a run writes into its directory. Series and decisions are appended as they come, so a
# rerun into the same directory must start from none of the previous run's, or the two mix.
RUN_ARTEFACTS = ("timeseries", "logs", "decisions.jsonl", "faults.jsonl", "records.csv", "summary.json", "report.md", "run.json",
                 "deployment.json", "topology.json", "delayline.json", "wan.json", "wan-ready", "compose.yaml",
                 "stack.yaml", "fidelity.json", "ttft_cdf.png", "queues.png", "links.png", "wan.png", "control.png",
                 "roles.png")


def clear_previous_run(run_dir: Path) -> list[str]:
    """Remove a previous run's artefacts from `run_dir` (only those: anything else stays), and
    only when `run.json` says a run was there: a directory that never held a run keeps all."""
    import shutil

    try:
        held_run = "scenario" in json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError, TypeError):
        held_run = False
    if not held_run:
        return []
    removed = []
    for name in RUN_ARTEFACTS:
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        else:
            continue
        removed.append(name)
    return removed


def client_timeout(sc: Scenario) -> Callable[[TraceRequest], float]:
    """The replayer's own limit per request (wire seconds): past the router's deadline, so the
    router's verdict is what the records keep unless the router itself is gone."""
    def limit(tr: TraceRequest) -> float:
        return 1.25 * max(sc.deadline_s(tr.output_tokens) / sc.scale.speedup, sc.serving.deadline_floor_wire_s) + 5.0
    return limit


def pick_backend(requested: str) -> tuple[str, str | None]:
    """`auto` is netns (real shaped links) when this process may create namespaces, else the
    local backend with a warning that says what is not emulated."""
    if requested != "auto":
        return requested, None
    import os
    if os.geteuid() != 0:
        return "local", ("not root: using the local backend (loopback). WAN delay, rate limits, loss and "
                         "link schedules are NOT emulated; run as root for the netns backend")
    if not Path("/var/run/netns").exists() and not os.access("/var/run", os.W_OK):
        return "local", "cannot create network namespaces: using the local backend; WAN links are NOT emulated"
    return "netns", None


def _start_run_dir(rs: ResolvedScenario, run_dir: Path) -> None:
    check_out_dir(run_dir, "run directory")      # never the root (its artefacts cleared there) nor a file
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_previous_run(run_dir)
    (run_dir / "timeseries").mkdir(exist_ok=True)
    (run_dir / "scenario.yaml").write_text(dump_scenario(rs.spec))


def _run_meta(rs: ResolvedScenario, trace: Trace, name: str | None, backend: str,
              shaping: dict[str, Any]) -> dict[str, Any]:
    sc = rs.spec
    return {
        "name": name or sc.name, "scenario": sc.name, "policy": sc.policy.name, "backend": backend,
        "t0": None, "t_end": None,
        "scale": {"speedup": sc.scale.speedup, "byte_scale": sc.scale.byte_scale},
        "shaping": shaping, "slo": {"ttft_s": sc.slo.ttft_s, "tpot_s": sc.slo.tpot_s},
        "offered_rate": trace.rate if len(trace) > 1 else 0.0,
        "trace": {"source": trace.source, "requests": len(trace)},
        "threshold": rs.threshold, "versions": _versions(), "interrupted": False,
    }


@contextlib.contextmanager
def teardown_shielded() -> Iterator[None]:
    """Ctrl-C ignored until the teardown ends: a second one (or the SIGTERM the CLI turns into
    one) used to abort it and leave namespaces, qdiscs and services behind. SIGKILL still works."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def refuse_faults_in_sim(*scenarios: ResolvedScenario) -> None:
    """UserError when a scenario has faults: the simulator has no fault model yet, and a clean result
    for a fault scenario would mislead. Commands call it before running anything, so that a
    comparison or a sweep does not stop (or record an error per point) halfway through."""
    for rs in scenarios:
        if rs.spec.faults:
            raise UserError(f"scenario {rs.spec.name!r}: field 'faults' ({len(rs.spec.faults)} fault(s)) is not "
                            "simulated; use a backend that injects faults (local, inproc, netns, compose)")


def run_sim(rs: ResolvedScenario, trace: Trace, run_dir: Path, name: str | None = None,
            on_progress: Callable[[ReplayStats], None] | None = None, report: bool = True) -> RunResult:
    """The same run directory as a live replay, from the discrete-event simulator (`testbed.sim`):
    virtual time starts at t0 = 0, so records and series are wire seconds since the start."""
    from testbed.metrics.report import write_report
    from testbed.metrics.summary import write_summary
    from testbed.sim import shaping, simulate

    refuse_faults_in_sim(rs)
    _start_run_dir(rs, run_dir)
    meta = _run_meta(rs, trace, name, "sim", shaping(rs))
    meta["t0"] = 0.0
    meta_path = run_dir / "run.json"
    meta_path.write_text(json.dumps(meta, indent=1))
    try:
        st = simulate(rs, trace, run_dir)
    except KeyboardInterrupt:
        # The records written so far stay; say so, and summarise them, as a live run does.
        meta.update({"t_end": None, "interrupted": True})
        meta_path.write_text(json.dumps(meta, indent=1))
        write_summary(run_dir)
        raise
    meta["t_end"] = rs.scale.wire_seconds(st.t_end)
    meta["sim"] = {"events": st.events, "rebalances": st.rebalances, "wall_s": st.wall_s,
                   "simulated_s_paper": st.t_end}
    meta_path.write_text(json.dumps(meta, indent=1))
    stats = ReplayStats(sent=len(trace), completed=st.completed, failed=st.failed, total=len(trace))
    if on_progress:
        on_progress(stats)
    summary = write_summary(run_dir)
    if report:
        write_report(run_dir, summary)
    return RunResult(run_dir, stats, False, summary)


def make_backend(kind: str, rs: ResolvedScenario, run_dir: Path, extra: dict[str, Any] | None = None,
                 host_port: int | None = None) -> Backend:
    """`extra` goes into the deployment every service reads; `host_port` (0: any) is where
    `host_url()` will lead to the router from this host."""
    port = host_port or 0
    if kind in ("local", "inproc"):
        return LoopbackBackend(kind, rs, run_dir, extra, port)
    if kind == "netns":
        from testbed.deploy.netns import NetnsBackend
        return NetnsBackend(rs, run_dir, extra=extra, host_port=port)
    if kind == "compose":
        from testbed.deploy.compose import ComposeBackend
        return ComposeBackend(rs, run_dir, extra=extra, host_port=host_port)
    if kind == "swarm":
        from testbed.deploy.swarm import SwarmBackend
        return SwarmBackend(rs, run_dir, extra=extra, host_port=port)
    raise ValueError(f"unknown backend {kind!r} (local, inproc, netns, compose, swarm; sim runs without one)")


async def run_replay_async(rs: ResolvedScenario, trace: Trace, run_dir: Path, backend: str = "local",
                           name: str | None = None,
                           on_progress: Callable[[ReplayStats], None] | None = None,
                           report: bool = True) -> RunResult:
    """Replay `trace` on `backend` into `run_dir`; `report` False leaves out report.md and its
    plots (summary.json is always written; `testbed report RUN` renders them later)."""
    if backend == "sim":
        return run_sim(rs, trace, run_dir, name, on_progress, report)
    from testbed.metrics.report import write_report
    from testbed.metrics.summary import write_summary

    sc = rs.spec
    _start_run_dir(rs, run_dir)
    be = make_backend(backend, rs, run_dir)
    meta = _run_meta(rs, trace, name, backend, be.shaping())
    meta_path = run_dir / "run.json"
    meta_path.write_text(json.dumps(meta, indent=1))
    stats = ReplayStats(total=len(trace))
    interrupted = False
    writer = RecordWriter(run_dir / "records.csv")
    host = SeriesWriter(run_dir / "timeseries" / "host.jsonl", "host")
    host_task = asyncio.create_task(sample_host(host))
    try:
        await be.start()
        meta["shaping"] = be.shaping()     # backends learn some facts (e.g. method) only at start
        meta["t0"] = t0 = now()
        meta_path.write_text(json.dumps(meta, indent=1))
        await be.on_t0(t0)
        if sc.faults and not (run_dir / "faults.jsonl").exists():
            log.warning("the %s backend does not execute the scenario's %d fault(s)", backend, len(sc.faults))
        url = be.deployment.router.url
        try:
            stats = await be.run_client(lambda: replay(trace, url, writer, sc.scale.speedup, sc.model.name,
                                                       on_progress, client_timeout(sc), t0=t0))
        except asyncio.CancelledError:
            interrupted = True
            raise
        finally:
            # The run ends with the last record, not after teardown (compose down takes seconds).
            meta["t_end"] = now()
    finally:
        # Every step runs even when an earlier one raised (a full disk must not leave the
        # services running), services first; a second Ctrl-C cannot cut the teardown short.
        with teardown_shielded():
            failures: list[BaseException] = []

            async def step(fn: Callable[[], Any]) -> None:
                try:
                    r = fn()
                    if asyncio.iscoroutine(r):
                        await asyncio.shield(r)
                except Exception as e:     # noqa: BLE001 - kept, re-raised after the other steps
                    failures.append(e)

            host_task.cancel()
            await asyncio.gather(host_task, return_exceptions=True)
            await step(be.stop)
            await step(host.close)
            await step(writer.close)
            if meta["t0"] is None:     # stopped before the services came up: nothing was sent
                meta["t0"] = now()
            meta.update({"t_end": meta["t_end"] or now(), "interrupted": interrupted})
            await step(lambda: meta_path.write_text(json.dumps(meta, indent=1)))
            if not failures:
                summary = write_summary(run_dir)
                if report:
                    write_report(run_dir, summary)
            elif all(isinstance(e, OSError) for e in failures):
                raise UserError(f"{run_dir}: the run's files could not be written ({failures[0]}); "
                                "the services were stopped") from failures[0]
            else:
                raise failures[0]
    return RunResult(run_dir, stats, interrupted, summary)
