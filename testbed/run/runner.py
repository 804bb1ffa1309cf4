"""One replay run, start to finish: run directory, services, replay, summary and report.

The run directory is written as the run goes; an interrupted run (Ctrl-C) still stops every
service it started and keeps the records gathered so far, then summarises them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import platform
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed import compiled
from testbed.config import run_lock
from testbed.config.cli_args import check_out_dir, unwritable_out
from testbed.config.resolved import ResolvedScenario
from testbed.config.scenarios import dump_scenario
from testbed.core import native
from testbed.core.engine.prefill_batch import PassStats, merged
from testbed.core.errors import UserError
from testbed.core.schema.scenario import Scenario
from testbed.deploy import registry
from testbed.live.replay_stats import ReplayStats
from testbed.metrics.artefacts import RunInfo, Summary, run_info, write_artefact
from testbed.metrics.artefacts.run_file import PrefillPasses, Shaping, SimInfo, this_process
from testbed.run.router_check import RouterLost, router_lost
from testbed.traces.types import Trace, TraceRequest

# The emulating backends' machinery (aiohttp, asyncio, the replayer, Prometheus) is imported
# where a live run starts: a simulated run does without it, and its process starts faster.
if TYPE_CHECKING:
    from testbed.deploy.base import Backend
    from testbed.deploy.prometheus import PrometheusProcess
    from testbed.traces.stream import TraceFile


log = logging.getLogger("testbed.runner")


@dataclass
class RunResult:
    run_dir: Path
    stats: ReplayStats
    interrupted: bool
    summary: Summary


def _platform() -> str:
    """`platform.platform()`'s words but the processor's (system, release, machine, C library),
    which Linux reads by running `uname -p`: a process spawned per run for what `machine` says."""
    u = platform.uname()
    lib, version = platform.libc_ver()
    return "-".join(x for x in (u.system, u.release, u.machine, "with" if lib else "", lib + version) if x)


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": _platform()}
    for pkg in ("prfaas-testbed", "aiohttp", "numpy", "pydantic"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


# What a run writes into its directory. Series and decisions are appended as they come, so a
# rerun into the same directory must start from none of the previous run's, or the two mix.
RUN_ARTEFACTS = (
    "timeseries",
    "stages",
    "edge.jsonl",
    "router-metrics-url",
    "router-metrics.prom",
    "logs",
    "decisions.jsonl",
    "decisions.parquet",
    "faults.jsonl",
    "records.csv",
    "records.parquet",
    "summary.json",
    "report.md",
    "run.json",
    "deployment.json",
    "topology.json",
    "delayline.json",
    "wan.json",
    "wan-ready",
    "compose.yaml",
    "stack.yaml",
    "fidelity.json",
    "ttft_cdf.png",
    "queues.png",
    "links.png",
    "wan.png",
    "control.png",
    "roles.png",
    "api-key",
)


# ...and the run's own copy of its scenario, overwritten rather than cleared.
RUN_WRITES = (*RUN_ARTEFACTS, "scenario.yaml")


def holds_run(run_dir: Path) -> bool:
    """`run.json` says a run was in `run_dir`."""
    try:
        return "scenario" in json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_run_dir(run_dir: Path) -> None:
    """Never the root (its artefacts cleared there) nor a file, and never a directory of the
    user's own files by the names a run writes (they would be overwritten): UserError."""
    check_out_dir(run_dir, "run directory", writes=RUN_WRITES, ours=holds_run)


def clear_previous_run(run_dir: Path) -> list[str]:
    """Remove a previous run's artefacts from `run_dir` (only those: anything else stays), and
    only when `run.json` says a run was there: a directory that never held a run keeps all."""
    import shutil

    if not holds_run(run_dir):
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


@contextlib.contextmanager
def owning_run_dir(run_dir: Path) -> Iterator[None]:
    """The run directory for this process while the block runs (`testbed.config.run_lock`):
    refused while another live command holds it, and when it holds a previous command's output
    unless this command was given --overwrite for it (or a folder above it). A folder of the
    user's own files is refused first, before a lock file is made in it."""
    check_run_dir(run_dir)
    with run_lock.holding(run_dir, flag="run directory"):
        yield


def _start_run_dir(rs: ResolvedScenario, run_dir: Path) -> None:
    with unwritable_out(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        clear_previous_run(run_dir)
        (run_dir / "timeseries").mkdir(exist_ok=True)
        (run_dir / "scenario.yaml").write_text(dump_scenario(rs.spec))


def _run_meta(
    rs: ResolvedScenario, trace: Trace | TraceFile, name: str | None, backend: str, shaping: dict[str, Any]
) -> RunInfo:
    sc = rs.spec
    return run_info(
        name=name or sc.name,
        scenario=sc.name,
        policy=sc.policy.name,
        backend=backend,
        t0=None,
        t_end=None,
        scale={"speedup": sc.scale.speedup, "byte_scale": sc.scale.byte_scale},
        shaping=shaping,
        slo={"ttft_s": sc.slo.ttft_s, "tpot_s": sc.slo.tpot_s},
        offered_rate=trace.offered_rate,
        trace={"source": trace.source, "requests": len(trace), "arrivals": sc.workload.arrivals},
        threshold=rs.threshold,
        versions=_versions(),
        interrupted=False,
        state="running",
        **this_process(),
    )


def write_run_json(path: Path, meta: RunInfo) -> None:
    """run.json as it always was written (indent 1, in place), now with `schema_version`."""
    write_artefact(path, meta, indent=1, atomic=False)


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


def run_sim(
    rs: ResolvedScenario,
    trace: Trace | TraceFile,
    run_dir: Path,
    name: str | None = None,
    on_progress: Callable[[ReplayStats], None] | None = None,
    report: bool = True,
    text_requests: int | None = None,
) -> RunResult:
    """The same run directory as a live replay, from the discrete-event simulator (`testbed.sim`):
    virtual time starts at t0 = 0, so records and series are wire seconds since the start.
    `text_requests`: the most requests a run keeps as records.csv and decisions.jsonl alone
    (default `TEXT_REQUESTS`); a longer one keeps records.parquet and decisions.parquet alone."""
    from testbed.core.gc_pause import keep_heap_to_exit, paused_gc

    keep_heap_to_exit()
    cap = TEXT_REQUESTS if text_requests is None else text_requests
    # The summary and report walk what the simulation left: no collections meanwhile.
    with owning_run_dir(run_dir), paused_gc():
        return _run_sim(rs, trace, run_dir, name, on_progress, report, cap)


def _run_sim(
    rs: ResolvedScenario,
    trace: Trace | TraceFile,
    run_dir: Path,
    name: str | None,
    on_progress: Callable[[ReplayStats], None] | None,
    report: bool,
    text_requests: int,
) -> RunResult:
    from testbed.metrics.summary import write_summary
    from testbed.sim import SimOptions, shaping, simulate

    registry.refuse_unhonoured("sim", [rs])
    _start_run_dir(rs, run_dir)
    meta = _run_meta(rs, trace, name, "sim", shaping(rs))
    meta.t0 = 0.0
    meta_path = run_dir / "run.json"
    write_run_json(meta_path, meta)
    try:
        # The records go to the files as they settle; a long run holds none of them (the summary
        # reads records.parquet back by column), a short one (which writes no Parquet) keeps its
        # few for the summary, which is cheaper than reading them back.
        keep = len(trace) <= text_requests
        opts = SimOptions(
            settle_records=True,
            keep_records=keep,
            text_requests=text_requests,
            arrivals=rs.spec.workload.arrivals,
        )
        st = simulate(rs, trace, run_dir, opts)
        # What the simulation built (its pools, its loop and the callbacks that reach it) is
        # cyclic garbage now, which the paused collector would keep through the summary: a few
        # hundred MB of a long run for a tenth of a second (a short run's few MB are not worth it).
        if not keep:
            gc.collect()
    except KeyboardInterrupt:
        # The records written so far stay, and run.json says the run was interrupted. Their
        # summary is left to `testbed report`: over a long trace it takes far longer than the
        # stop should (132K records of a 1M-request trace: 12 s of CPU), and a simulation has
        # nothing else to tear down.
        meta.t_end, meta.interrupted, meta.state = None, True, "interrupted"
        write_run_json(meta_path, meta)
        raise
    meta.t_end = rs.scale.wire_seconds(st.t_end)
    meta.sim = SimInfo(
        events=st.events,
        rebalances=st.rebalances,
        wall_s=st.wall_s,
        write_s=st.write_s,
        simulated_s_paper=st.t_end,
        retries=st.retries,
        live_path=rs.live_path.to_dict(),
        mechanisms=_mechanisms(rs),
        modules=compiled.implementation(),
        prefill_passes=prefill_passes(st.prefill_passes),
        preemptions=len(st.preemptions) if st.preemptions else None,
    )
    meta.state = "finished"
    write_run_json(meta_path, meta)
    stats = ReplayStats(sent=len(trace), completed=st.completed, failed=st.failed, total=len(trace))
    if on_progress:
        on_progress(stats)
    # What the simulation wrote: its series as it holds them, its records as it kept them or, for
    # a long run, read back column by column (`RecordTable`: a few arrays, where records.csv read
    # back is an object per request).
    if keep:
        summary = write_summary(run_dir, st.records, st.series, st.series_unheld)
    else:
        from testbed.metrics.record_table import RecordTable
        from testbed.metrics.run_files import RECORDS_FILE

        summary = write_summary(run_dir, RecordTable(run_dir / RECORDS_FILE), st.series, st.series_unheld)
    if report:
        from testbed.metrics.report import write_report  # here: most runs are not reported

        write_report(run_dir, summary)
    return RunResult(run_dir, stats, False, summary)


# A simulated run of more requests keeps records.parquet and decisions.parquet alone once it ends
# (records.csv and decisions.jsonl, written as it goes, are what a run killed outright keeps); one
# of at most this many writes the text files alone (`testbed.sim.SimOptions.text_requests`).
TEXT_REQUESTS = 20_000


def _mechanisms(rs: ResolvedScenario) -> str:
    """What the run's mechanisms ran as; the compiled decode batch steps aside for the vLLM-like
    scheduler's block-granular one (`testbed.core.engine.decode_blocks`), which is pure Python."""
    mech = native.implementation()
    if mech == "native" and any(h.scheduler.kind != "fcfs" for h in rs.spec.hardware.values()):
        return "native; python for the vllm scheduler's decode batches (no compiled twin)"
    return mech


def prefill_passes(stats: list[PassStats]) -> PrefillPasses | None:
    """run.json's account of the batching prefill instances' passes (None: none batches)."""
    if not stats:
        return None
    m = merged(stats)
    return PrefillPasses(
        instances=len(stats),
        passes=m.passes,
        prompts=m.prompts,
        tokens_per_pass=m.tokens / m.passes if m.passes else 0.0,
        prompts_per_pass=m.chunks / m.passes if m.passes else 0.0,
        chunks_per_prompt=m.chunks / m.prompts if m.prompts else 0.0,
        busy_s_paper=m.busy_s,
        max_tokens=m.max_tokens,
        max_prompts=m.max_prompts,
    )


async def scrape_router_metrics(run_dir: Path) -> None:
    """Keep a foreign router's own Prometheus metrics (its counters and latency histograms) in the
    run directory, as they stand at the end of the replay; a missing endpoint is noted, not fatal."""
    import aiohttp

    from testbed.deploy.foreign_router import ROUTER_METRICS, ROUTER_METRICS_URL

    url_file = run_dir / ROUTER_METRICS_URL
    if not url_file.exists():
        return
    url = url_file.read_text().strip()
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s,
            s.get(url) as r,
        ):
            text = await r.text() if r.status == 200 else f"# {url} answered {r.status}\n"
    except (TimeoutError, aiohttp.ClientError) as e:
        text = f"# {url} could not be scraped: {e}\n"
    (run_dir / ROUTER_METRICS).write_text(text)


def make_backend(
    kind: str, rs: ResolvedScenario, run_dir: Path, extra: dict[str, Any] | None = None, host_port: int | None = None
) -> Backend:
    """`extra` goes into the deployment every service reads; `host_port` (0: any) is where
    `host_url()` will lead to the router from this host."""
    return registry.get(kind).create(rs, run_dir, extra, host_port)


async def run_replay_async(
    rs: ResolvedScenario,
    trace: Trace,
    run_dir: Path,
    backend: str = "local",
    name: str | None = None,
    on_progress: Callable[[ReplayStats], None] | None = None,
    report: bool = True,
    prometheus: str | None = None,
) -> RunResult:
    """Replay `trace` on `backend` into `run_dir`; `report` False leaves out report.md and its
    plots (summary.json is always written; `testbed report RUN` renders them later).
    `prometheus`: the listen address of a Prometheus scraping the run (`testbed.deploy.prometheus`;
    its data stays in `run_dir/prometheus/data`)."""
    if registry.get(backend).caps.simulator:
        return run_sim(rs, trace, run_dir, name, on_progress, report)
    registry.refuse_unhonoured(backend, [rs])  # before any service starts
    with owning_run_dir(run_dir):
        return await _run_replay_async(rs, trace, run_dir, backend, name, on_progress, report, prometheus)


async def _run_replay_async(
    rs: ResolvedScenario,
    trace: Trace,
    run_dir: Path,
    backend: str,
    name: str | None,
    on_progress: Callable[[ReplayStats], None] | None,
    report: bool,
    prometheus: str | None,
) -> RunResult:
    import asyncio

    from testbed.deploy.prometheus import PrometheusProcess, find_binary
    from testbed.live.clock import now
    from testbed.live.hostload import sample_host
    from testbed.live.replayer import replay
    from testbed.metrics.node_stages import NodeStages
    from testbed.metrics.records import RecordWriter
    from testbed.metrics.report import write_report
    from testbed.metrics.series_format import SeriesWriter
    from testbed.metrics.summary import write_summary

    sc = rs.spec
    _start_run_dir(rs, run_dir)
    be = make_backend(backend, rs, run_dir)
    meta = _run_meta(rs, trace, name, backend, be.shaping())
    meta_path = run_dir / "run.json"
    write_run_json(meta_path, meta)
    stats = ReplayStats(total=len(trace))
    interrupted = False
    writer = RecordWriter(run_dir / "records.csv")
    host = SeriesWriter(run_dir / "timeseries" / "host.jsonl", "host")
    host_task = asyncio.create_task(sample_host(host))
    prom: PrometheusProcess | None = None
    replayed = False  # the replay ran to its end (not stopped, nothing raised)
    try:
        await be.start()
        if prometheus is not None:
            prom = PrometheusProcess(find_binary() or "prometheus", be.deployment, run_dir / "prometheus", prometheus)
            await prom.start()
        meta.shaping = Shaping.model_validate(be.shaping())  # backends learn some facts (e.g. method) only at start
        meta.t0 = t0 = now()
        write_run_json(meta_path, meta)
        await be.on_t0(t0)
        url, key = be.deployment.router.url, be.deployment.credentials.api_key
        try:
            stats = await be.run_client(
                lambda: replay(
                    trace,
                    url,
                    writer,
                    sc.scale.speedup,
                    sc.model.name,
                    on_progress,
                    client_timeout(sc),
                    t0=t0,
                    api_key=key,
                    arrivals=sc.workload.arrivals,
                    foreign=NodeStages(run_dir) if sc.router.kind != "testbed" else None,
                    block_tokens=trace.block_tokens,
                    # The testbed's router over an engine protocol: the stamps are the nodes'.
                    stages=NodeStages(run_dir)
                    if sc.router.kind == "testbed" and sc.node_protocol != "testbed"
                    else None,
                )
            )
        except asyncio.CancelledError:
            interrupted = True
            raise
        finally:
            # The run ends with the last record, not after teardown (compose down takes seconds).
            meta.t_end = now()
        if sc.router.kind != "testbed":
            await be.run_client(lambda: scrape_router_metrics(run_dir))
        exit_code = getattr(be, "exit_code", None)
        lost = await be.run_client(lambda: router_lost(url, exit_code("router") if exit_code else None))
        if lost is not None:  # the run failed, its records kept: run.json says "failed"
            logs = run_dir / "logs"
            raise RouterLost(
                f"{run_dir}: {lost} ({stats.completed}/{stats.total} completed)"
                + (f"; logs in {logs}" if logs.is_dir() else "")
            )
        replayed = True
    except asyncio.CancelledError:  # Ctrl-C or SIGTERM, during the start-up too
        interrupted = True
        raise
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
                except Exception as e:  # noqa: BLE001 - kept, re-raised after the other steps
                    failures.append(e)

            host_task.cancel()
            await asyncio.gather(host_task, return_exceptions=True)
            if prom is not None:
                await step(prom.stop)
            await step(be.stop)
            # What a backend learns at its end too (the swarm: nodes lost mid-run).
            await step(lambda: setattr(meta, "shaping", Shaping.model_validate(be.shaping())))
            await step(host.close)
            await step(writer.close)
            if meta.t0 is None:  # stopped before the services came up: nothing was sent
                meta.t0 = now()
            meta.t_end, meta.interrupted = meta.t_end or now(), interrupted
            meta.state = "interrupted" if interrupted else "finished" if replayed and not failures else "failed"
            await step(lambda: write_run_json(meta_path, meta))
            if not failures:
                try:
                    summary = write_summary(run_dir)
                    if report:
                        write_report(run_dir, summary)
                except OSError as e:  # a full disk: the services are down, say so in one line
                    failures.append(e)
            if failures and all(isinstance(e, OSError) for e in failures):
                raise UserError(
                    f"{run_dir}: the run's files could not be written ({failures[0]}); the services were stopped"
                ) from failures[0]
            if failures:
                raise failures[0]
    return RunResult(run_dir, stats, interrupted, summary)
