"""`testbed up --hold`: bring a deployment up and keep it open for outside clients (aiperf,
`vllm bench serve`, guidellm, the `openai` package), then write the run directory of what they
sent.

Every backend gives the host a base URL: the router itself on loopback (local), a loopback port
whose connections are made from the client namespace (netns; swarm, from the client
container's namespace on the home datacenter's network), or the router's port published on
127.0.0.1 (compose). The router writes a record of every request it answers
(`testbed.live.held`); the hold posts its t0 once every service is up, so record times, time
series and link counters share one base. The hold ends on Ctrl-C or SIGTERM, or when the
deployment disappears (`testbed down`); then services stop and the summary and report are
written, as for a replay.

A held deployment runs at speedup 1 unless the scenario is overridden (`--set scale.speedup=S`):
an outside client measures wire time, which is paper time only then. It streams one token per
chunk unless the user sets `serving.stream_interval`: a client's inter-chunk figures are then
per-token ones, as against a serving engine (the paper scenarios batch 8 tokens a chunk to keep
fast replays cheap; at speedup 1 a chunk a token costs the decode node a few events per step).
The banner and the router's `/testbed/info` say the chunking in force.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import aiohttp

from testbed.config.resolved import ResolvedScenario
from testbed.config.scenarios import dump_scenario
from testbed.deploy.base import Backend
from testbed.deploy.prometheus import PrometheusProcess, find_binary, unavailable
from testbed.live.clock import now
from testbed.live.credentials import API_KEY_FILE
from testbed.live.edge import EDGE_LOG, Edge
from testbed.live.held import HOLD_KEY, HOLD_PATH, write_stage_records
from testbed.metrics.artefacts import Summary, run_info
from testbed.metrics.artefacts.run_file import HoldInfo as HoldFacts
from testbed.metrics.artefacts.run_file import RunState, Shaping, this_process
from testbed.run.runner import (
    _versions,
    clear_previous_run,
    make_backend,
    owning_run_dir,
    scrape_router_metrics,
    write_run_json,
)
from testbed.run.stoppable import default_in_forked_child

HOLD_SPEEDUP = 1.0
HOLD_STREAM_INTERVAL = 1  # tokens per streamed chunk, unless the user sets serving.stream_interval
POLL_S = 1.0  # between health checks of the router
POLL_TIMEOUT_S = 5.0
GONE_AFTER = 3  # consecutive failed checks: the deployment is gone


@dataclass(frozen=True)
class HoldInfo:
    """What a client needs, once the deployment is ready."""

    url: str  # server root: aiperf --url, vllm bench serve --base-url, guidellm --target
    run_dir: Path
    backend: str
    prefix: str  # what `testbed down --prefix` takes ("" where it does not apply)
    speedup: float
    prometheus: str = ""  # Prometheus scraping the deployment (--prometheus), else ""
    api_key: str = ""  # what clients send as `Authorization: Bearer KEY` (also in run_dir/api-key)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (the `openai` package's base_url)."""
        return f"{self.url}/v1"

    def to_json(self) -> dict[str, str | float]:
        out: dict[str, str | float] = {
            "base_url": self.base_url,
            "url": self.url,
            "run_dir": str(self.run_dir),
            "backend": self.backend,
            "prefix": self.prefix,
            "speedup": self.speedup,
            "records": str(self.run_dir / "records.csv"),
            "api_key": self.api_key,
            "api_key_file": str(self.run_dir / API_KEY_FILE),
        }
        if self.prometheus:
            out["prometheus"] = self.prometheus
        return out


@dataclass(frozen=True)
class HoldResult:
    run_dir: Path
    ended: str  # why: stopped, or the deployment went away
    summary: Summary


def _prefix(be: Backend) -> str:
    for attr in ("prefix", "project"):
        v = getattr(be, attr, "")
        if isinstance(v, str) and v:
            return v
    return ""


async def _post_t0(router: str, t0: float, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=headers) as s:
        async with s.post(router + HOLD_PATH, json={"t0": t0}) as r:
            if r.status != 200:
                raise RuntimeError(f"the router refused the hold's t0: {r.status} {await r.text()}")


async def _router_up(router: str) -> str:
    """ "" if the router answers /health, else why not."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)) as s:
            async with s.get(router + "/health") as r:
                return "" if r.status == 200 else f"/health answered {r.status}"
    except (aiohttp.ClientError, TimeoutError) as e:
        return f"{type(e).__name__}: {e}"


async def _until_gone(be: Backend) -> str:
    """Return once the router has stopped answering (the deployment was removed under us)."""
    router = be.deployment.router.url
    misses = 0
    while True:
        await asyncio.sleep(POLL_S)
        why = await be.run_client(lambda: _router_up(router))
        misses = misses + 1 if why else 0
        if misses >= GONE_AFTER:
            return f"the deployment went away (router unreachable: {why})"


async def hold_async(
    rs: ResolvedScenario,
    run_dir: Path,
    backend: str,
    stop: asyncio.Event,
    on_ready: Callable[[HoldInfo], None],
    host_port: int = 0,
    prometheus: str | None = None,
) -> HoldResult:
    """Bring the deployment up, call `on_ready`, keep it until `stop` is set or it disappears,
    then tear it down and write the run directory. `prometheus`: the listen address of a
    Prometheus to run against the deployment (`testbed.deploy.prometheus`)."""
    with owning_run_dir(run_dir):
        return await _hold(rs, run_dir, backend, stop, on_ready, host_port, prometheus)


async def _hold(
    rs: ResolvedScenario,
    run_dir: Path,
    backend: str,
    stop: asyncio.Event,
    on_ready: Callable[[HoldInfo], None],
    host_port: int,
    prometheus: str | None,
) -> HoldResult:
    from testbed.metrics.report import write_report
    from testbed.metrics.summary import write_summary

    sc = rs.spec
    foreign = sc.router.kind != "testbed"
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_previous_run(run_dir)
    (run_dir / "timeseries").mkdir(exist_ok=True)
    (run_dir / "scenario.yaml").write_text(dump_scenario(sc))
    # Behind a foreign router the client's port is the serving edge's (`testbed.live.edge`), which
    # stamps what the router cannot; the router's own way in is on a port of its own.
    be = make_backend(
        backend, rs, run_dir, extra={HOLD_KEY: {"records": "records.csv"}}, host_port=0 if foreign else host_port
    )
    meta = run_info(
        name=sc.name,
        scenario=sc.name,
        policy=sc.policy.name,
        backend=backend,
        t0=None,
        t_end=None,
        scale={"speedup": sc.scale.speedup, "byte_scale": sc.scale.byte_scale},
        shaping=be.shaping(),
        slo={"ttft_s": sc.slo.ttft_s, "tpot_s": sc.slo.tpot_s},
        offered_rate=None,
        trace={"source": "outside clients (testbed up --hold)", "requests": None},
        threshold=rs.threshold,
        versions=_versions(),
        interrupted=False,
        hold={"url": None},
        state="running",
        **this_process(),
    )
    meta_path = run_dir / "run.json"
    write_run_json(meta_path, meta)
    ended = "stopped before the deployment was up"
    state: RunState = "failed"  # until the hold ends as told, or is interrupted
    prom: PrometheusProcess | None = None
    edge: Edge | None = None
    try:
        await be.start()
        if prometheus is not None:
            prom = PrometheusProcess(find_binary() or "prometheus", be.deployment, run_dir / "prometheus", prometheus)
            await prom.start()
        meta.shaping = Shaping.model_validate(be.shaping())
        url = await be.host_url()
        if foreign:
            edge = Edge(url, run_dir / EDGE_LOG, host_port)
            await edge.start()
            url = edge.url
        meta.t0 = t0 = now()
        creds = be.deployment.credentials
        if not foreign:  # a foreign router stamps nothing: the records come from the nodes' logs
            await be.run_client(lambda: _post_t0(be.deployment.router.url, t0, creds.runner_headers()))
        write_api_key(run_dir / API_KEY_FILE, creds.api_key)
        meta.hold = HoldFacts(url=url, base_url=f"{url}/v1", prefix=_prefix(be))
        write_run_json(meta_path, meta)
        await be.on_t0(t0)
        on_ready(
            HoldInfo(url, run_dir, backend, _prefix(be), sc.scale.speedup, prom.url if prom else "", creds.api_key)
        )
        ended = "stopped"
        stopped = asyncio.ensure_future(stop.wait())
        gone = asyncio.ensure_future(_until_gone(be))
        try:
            done, _ = await asyncio.wait({stopped, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                ended = gone.result()
            else:
                state = "finished"  # a hold ends when it is told to: its normal end
        finally:
            for t in (stopped, gone):
                t.cancel()
            await asyncio.gather(stopped, gone, return_exceptions=True)
        meta.t_end = now()
        if foreign:
            await be.run_client(lambda: scrape_router_metrics(run_dir))
    except (asyncio.CancelledError, KeyboardInterrupt):
        state = "interrupted"
        raise
    finally:
        try:
            if edge is not None:
                await asyncio.shield(edge.stop())
            if prom is not None:
                await asyncio.shield(prom.stop())
            await asyncio.shield(be.stop())
        finally:
            if meta.t0 is None:
                meta.t0 = now()
            meta.t_end = meta.t_end or now()
            held = meta.hold or HoldFacts()
            held.ended = ended
            meta.hold = held
            meta.state = state
            write_run_json(meta_path, meta)
            if foreign:
                write_stage_records(run_dir, meta.t0)
            if not (run_dir / "records.csv").exists():
                # The router never wrote (it did not come up): an empty file keeps the directory readable.
                from testbed.metrics.records import RecordWriter

                RecordWriter(run_dir / "records.csv").close()
            summary = write_summary(run_dir)
            write_report(run_dir, summary)
    return HoldResult(run_dir, ended, summary)


def write_api_key(path: Path, key: str) -> None:
    """The key, readable by this user only (created so: never world-readable for a moment)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")


def stop_on_sigint(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Callable[[], None]:
    """SIGINT (and SIGTERM, which the CLI turns into SIGINT) sets `stop`; teardown then runs to
    the end. A plain handler, not `loop.add_signal_handler`: a child that a library forks without
    exec (pyroute2 does, to open sockets in a namespace, and sends it SIGTERM when done) shares
    the loop's signal wakeup fd, so its signals would reach this loop as the hold's own. In such a
    child the signal takes its default action instead."""
    pid = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if default_in_forked_child(pid, signum):
            return
        loop.call_soon_threadsafe(stop.set)

    previous = signal.signal(signal.SIGINT, handler)

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)

    return restore


def with_hold_speedup(sets: list[str]) -> list[str]:
    """The `--set` list with scale.speedup=1 first, unless the user set the speedup."""
    from testbed.config.overrides import parse_assignments

    given = any(
        k == "scale.speedup" or (k == "scale" and isinstance(v, dict) and "speedup" in v)
        for k, v in parse_assignments(sets)
    )
    return list(sets) if given else [f"scale.speedup={HOLD_SPEEDUP:g}", *sets]


def with_hold_streaming(sets: list[str]) -> list[str]:
    """The `--set` list with serving.stream_interval=1 first, unless the user set it."""
    from testbed.config.overrides import parse_assignments

    given = any(
        k == "serving.stream_interval" or (k == "serving" and isinstance(v, dict) and "stream_interval" in v)
        for k, v in parse_assignments(sets)
    )
    return list(sets) if given else [f"serving.stream_interval={HOLD_STREAM_INTERVAL}", *sets]


def chunking_note(tokens_per_chunk: int) -> str:
    """What the banner says of the streaming granularity."""
    if tokens_per_chunk == 1:
        return "streaming: 1 token per SSE chunk (per-chunk client figures are per-token)"
    return (
        f"streaming: {tokens_per_chunk} tokens per SSE chunk: per-chunk client figures (inter-chunk latency) "
        f"cover {tokens_per_chunk} tokens; --set serving.stream_interval=1 streams per token"
    )


def cmd_hold(args: argparse.Namespace) -> int:
    from datetime import datetime

    from testbed.config.overrides import overrides_for
    from testbed.deploy.registry import check_capacity, check_host, pick_backend, refuse_unhonoured
    from testbed.run.load import load

    if not args.scenario:
        print("up --hold: give --scenario NAME", file=sys.stderr)
        return 2
    if args.compare or args.trace or args.rate is not None or args.requests is not None or args.seed is not None:
        print(
            "up --hold: the clients bring the load; --compare, --trace, --rate, --requests and --seed do not apply",
            file=sys.stderr,
        )
        return 2
    if args.speedup == "auto":
        print("up --hold: --speedup auto probes a workload, and the clients bring it: give a number", file=sys.stderr)
        return 2
    # --speedup means what it means in every run (scale.speedup); without it a hold keeps paper time.
    sets = with_hold_speedup(args.set) if args.speedup is None else [*args.set, f"scale.speedup={args.speedup}"]
    if getattr(args, "router", None) is not None:
        sets = [*sets, f"router.kind={args.router}"]
    if getattr(args, "router_policy", None) is not None:
        sets = [*sets, f"router.policy={args.router_policy}"]
    rs = load(args.scenario, overrides_for(args.scenario, with_hold_streaming(sets)))
    backend, warning = pick_backend(args.backend)
    refuse_unhonoured(backend, [rs])
    check_host(backend)
    check_capacity(backend, [rs], args.force_capacity)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if args.prometheus is not None and (why := unavailable(backend, find_binary())):
        print(f"up --hold: {why}", file=sys.stderr)
        return 2
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("runs") / f"{stamp}-{rs.name}-hold"
    sc = rs.spec

    def ready(info: HoldInfo) -> None:
        if args.json:
            print(json.dumps(info.to_json()), flush=True)
        down = f", or `testbed down --force {info.prefix}`" if info.prefix else ""
        paper = (
            "clients measure paper time"
            if sc.scale.speedup == 1
            else f"clients measure wire time: multiply their latencies by {sc.scale.speedup:g} for paper time"
        )
        print(
            f"held: {sc.name} on {backend}, speedup {sc.scale.speedup:g} ({paper}), "
            f"byte_scale {sc.scale.byte_scale:g}\n"
            f"{chunking_note(sc.serving.stream_interval)} (also at {info.url}/testbed/info)\n"
            f"OpenAI base URL: {info.base_url}\n"
            f"API key: {info.api_key} (also in {info.run_dir / API_KEY_FILE}; send `Authorization: Bearer KEY`)\n"
            f"  export OPENAI_API_KEY=$(cat {info.run_dir / API_KEY_FILE})\n"
            f"  aiperf --url {info.url} --api-key $OPENAI_API_KEY | vllm bench serve --base-url {info.url} "
            f"| guidellm --target {info.url}\n"
            + (
                f"Prometheus: {info.prometheus} (examples/observability/ has the dashboards)\n"
                if info.prometheus
                else ""
            )
            + f"every request is recorded in {info.run_dir / 'records.csv'}; Ctrl-C or SIGTERM{down} ends the hold",
            file=sys.stderr,
            flush=True,
        )

    async def main() -> HoldResult:
        stop = asyncio.Event()
        restore = stop_on_sigint(asyncio.get_running_loop(), stop)
        try:
            return await hold_async(rs, out, backend, stop, ready, args.port, args.prometheus)
        finally:
            restore()

    from testbed.config import run_lock

    with run_lock.holding(out, args.overwrite):
        res = asyncio.run(main())
    n = res.summary.requests.total
    if args.json:
        print(
            json.dumps(
                {
                    "ended": res.ended,
                    "run_dir": str(res.run_dir),
                    "requests": n,
                    "report": str(res.run_dir / "report.md"),
                }
            ),
            flush=True,
        )
    else:
        from testbed.metrics.report_command import print_summary_table

        print(f"hold ended: {res.ended}; {n} requests recorded", file=sys.stderr)
        if n:
            print_summary_table(res.summary, title=res.run_dir.name)
        print(f"report: {res.run_dir / 'report.md'}")
    return 0
