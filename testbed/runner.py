"""One replay run, start to finish: run directory, services, replay, summary and report.

The run directory is written as the run goes; an interrupted run (Ctrl-C) still stops every
service it started and keeps the records gathered so far, then summarises them.
"""

from __future__ import annotations

import asyncio
import json
import platform
import sys
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Literal

from testbed.core.scenario import Scenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.local import LocalBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.clock import now
from testbed.live.deployment import Deployment
from testbed.live.replayer import ReplayStats, replay
from testbed.metrics.records import RecordWriter
from testbed.scenarios import dump_scenario
from testbed.traces.types import Trace

Backend = Literal["local", "inproc"]
LOCAL_SHAPING = {
    "method": "none",
    "detail": "local backend: every service on loopback; no WAN delay, rate limit or loss is emulated",
}


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


def resolve_threshold(sc: Scenario) -> float | None:
    if sc.policy.name != "prfaas":
        return None
    if sc.policy.threshold == "auto":
        from testbed.model.command import resolve_threshold as auto
        return float(auto(sc))
    assert isinstance(sc.policy.threshold, int)
    return float(sc.policy.threshold)


def _backend(kind: Backend, dep: Deployment, run_dir: Path) -> AbstractAsyncContextManager[Deployment]:
    if kind == "local":
        return LocalBackend(dep, run_dir)
    return InProcessBackend(dep)


async def run_replay_async(sc: Scenario, trace: Trace, run_dir: Path, backend: Backend = "local",
                           name: str | None = None,
                           on_progress: Callable[[ReplayStats], None] | None = None) -> RunResult:
    from testbed.metrics.report import write_report
    from testbed.metrics.summary import write_summary

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "timeseries").mkdir(exist_ok=True)
    (run_dir / "scenario.yaml").write_text(dump_scenario(sc))
    threshold = resolve_threshold(sc)
    dep = loopback_deployment(sc, str(run_dir.resolve()), threshold)
    offered = trace.rate if len(trace) > 1 else 0.0
    meta: dict[str, Any] = {
        "name": name or sc.name, "scenario": sc.name, "policy": sc.policy.name, "backend": backend,
        "t0": None, "t_end": None,
        "scale": {"speedup": sc.scale.speedup, "byte_scale": sc.scale.byte_scale},
        "shaping": LOCAL_SHAPING, "slo": {"ttft_s": sc.slo.ttft_s, "tpot_s": sc.slo.tpot_s},
        "offered_rate": offered, "trace": {"source": trace.source, "requests": len(trace)},
        "threshold": threshold, "versions": _versions(), "interrupted": False,
    }
    meta_path = run_dir / "run.json"
    meta_path.write_text(json.dumps(meta, indent=1))
    stats = ReplayStats(total=len(trace))
    interrupted = False
    writer = RecordWriter(run_dir / "records.csv")
    try:
        async with _backend(backend, dep, run_dir) as d:
            meta["t0"] = t0 = now()
            meta_path.write_text(json.dumps(meta, indent=1))
            try:
                stats = await replay(trace, d.router.url, writer, sc.scale.speedup, sc.model.name,
                                     on_progress, t0=t0)
            except asyncio.CancelledError:
                interrupted = True
                raise
    finally:
        writer.close()
        if meta["t0"] is None:     # stopped before the services came up: nothing was sent
            meta["t0"] = now()
        meta.update({"t_end": now(), "interrupted": interrupted})
        meta_path.write_text(json.dumps(meta, indent=1))
        summary = write_summary(run_dir)
        write_report(run_dir, summary)
    return RunResult(run_dir, stats, interrupted, summary)
