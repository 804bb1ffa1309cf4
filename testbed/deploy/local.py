"""Local backend: one process per service on loopback (`testbed serve`), no link shaping.

One process per node instance mirrors the container deployment (one container per instance):
a node's event loop is never delayed by another node's work, and a crash takes down one node.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import TracebackType

import aiohttp

# BackendError lives with the other backends' base; re-exported for importers of this module.
from testbed.deploy.base import BackendError as BackendError
from testbed.deploy.foreign_router import router_argv
from testbed.deploy.host_capacity import PROCESS_HEALTH_TIMEOUT_S, StartGuard
from testbed.deploy.ports import free_ports
from testbed.live.deployment import Deployment
from testbed.net.procs import JOURNAL_DIR, ProcessGroup
from testbed.net.topology import new_prefix

HEALTH_TIMEOUT_S = PROCESS_HEALTH_TIMEOUT_S  # what the capacity check budgets start-up against


def serve_argv(role: str, dep_file: Path, node_id: str) -> list[str]:
    return [sys.executable, "-m", "testbed", "serve", role, "--deployment", str(dep_file), "--id", node_id]


def service_argv(dep: Deployment, dep_file: Path, node_id: str, prometheus_port: int | None = None) -> list[str]:
    """A service's command: a node, the testbed's router, or the foreign router in its place
    (its Prometheus endpoint on `prometheus_port`, or a free loopback port)."""
    if node_id == "router" and dep.scenario.router.kind != "testbed":
        return router_argv(dep, prometheus_port if prometheus_port is not None else free_ports(1)[0])
    return serve_argv(dep.nodes[node_id].role if node_id != "router" else "router", dep_file, node_id)


async def wait_healthy(urls: dict[str, str], procs: ProcessGroup, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Poll every service's /health; fail fast, with its log, if one exits or never answers."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = dict(urls)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while pending:
            if (dead := procs.dead()) is not None:
                raise BackendError(
                    f"service {dead[0]} exited with code {dead[1]}; last log lines:\n" + procs.log(dead[0])
                )
            for nid, url in list(pending.items()):
                try:
                    async with s.get(f"{url}/health") as r:
                        if r.status == 200:
                            del pending[nid]
                except (TimeoutError, aiohttp.ClientError):
                    pass
            if pending and loop.time() > deadline:
                nid = sorted(pending)[0]
                raise BackendError(f"service {nid} not healthy after {timeout:g} s; last log lines:\n" + procs.log(nid))
            if pending:
                await asyncio.sleep(0.1)


class LocalBackend:
    def __init__(self, dep: Deployment, run_dir: Path, prefix: str | None = None) -> None:
        self.dep = dep
        self.run_dir = run_dir
        # The run's name for `testbed down --prefix`, as a netns or Docker run has one: journaled
        # under it, so that `testbed down` finds the services if this process is killed.
        self.prefix = prefix or new_prefix()
        self.procs = ProcessGroup(run_dir / "logs", journal=JOURNAL_DIR / f"{self.prefix}.json")

    async def __aenter__(self) -> Deployment:
        dep_file = self.run_dir / "deployment.json"
        self.dep.write(dep_file)
        self.procs.env = self.dep.credentials.env()
        guard = StartGuard(len(self.dep.nodes) + 1)
        try:
            for nid in [*self.dep.nodes, "router"]:
                guard.before()
                self.procs.spawn(nid, service_argv(self.dep, dep_file, nid))
                guard.started(self.procs.procs[nid].pid)
                # Between services, Ctrl-C or SIGTERM (a cancellation) can land: thousands of
                # services take minutes to spawn, and the stop must not wait for the last one.
                await asyncio.sleep(0)
            urls = {"router": self.dep.router.url, **{k: v.http.url for k, v in self.dep.nodes.items()}}
            await wait_healthy(urls, self.procs)
        except BaseException:
            self.stop()
            raise
        return self.dep

    def stop(self) -> None:
        self.procs.stop()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
