"""The two loopback backends behind the Backend protocol: one process per service (`local`)
or every service in this process (`inproc`). Node faults run on `local`'s processes; neither
has a WAN to fault (`testbed.deploy.registry` refuses such a scenario before it starts)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from testbed.config.resolved import ResolvedScenario
from testbed.core.json_types import JSONObject
from testbed.deploy.fault_injection import FaultScheduler, FaultTarget, ProcessNodes, http_json, start_faults
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.local import LocalBackend, serve_argv
from testbed.deploy.plan import loopback_deployment
from testbed.live.deployment import Endpoint

T = TypeVar("T")
NO_SHAPING = {
    "method": "none",
    "detail": "loopback: every service on 127.0.0.1; no WAN delay, rate limit or loss is emulated",
}


class LoopbackBackend:
    def __init__(
        self,
        name: str,
        rs: ResolvedScenario,
        run_dir: Path,
        extra: JSONObject | None = None,
        host_port: int = 0,
        processes: bool = True,
    ) -> None:
        self.name = name
        self.run_dir = run_dir
        self.deployment = loopback_deployment(rs, str(run_dir.resolve()))
        self.deployment.extra.update(extra or {})
        if host_port:  # the router is on the host already: it listens on the port asked for
            self.deployment.router = Endpoint(self.deployment.router.host, host_port)
        self._impl: LocalBackend | InProcessBackend = (
            LocalBackend(self.deployment, run_dir) if processes else InProcessBackend(self.deployment)
        )
        self._faults: FaultScheduler | None = None

    @property
    def prefix(self) -> str:
        """What `testbed down --prefix` takes for a local run ("" in-process: nothing outlives it)."""
        return self._impl.prefix if isinstance(self._impl, LocalBackend) else ""

    def shaping(self) -> dict[str, object]:
        # local: the prefix `testbed down --prefix` takes to stop what a killed run left
        return {**NO_SHAPING, "prefix": self.prefix} if self.prefix else dict(NO_SHAPING)

    async def start(self) -> None:
        await self._impl.__aenter__()

    async def on_t0(self, t0: float) -> None:
        sc = self.deployment.scenario
        if sc.faults:
            self._faults = start_faults(sc, self._fault_target(), t0, self.run_dir)

    def _fault_target(self) -> FaultTarget:
        impl = self._impl
        if not isinstance(impl, LocalBackend):
            return FaultTarget(self.name)
        dep, dep_file = self.deployment, self.run_dir / "deployment.json"

        async def request(node: str, path: str, body: JSONObject | None) -> JSONObject:
            return await asyncio.to_thread(
                http_json, dep.nodes[node].http.url + path, body, 5.0, dep.credentials.runner_headers()
            )

        return FaultTarget(
            self.name, ProcessNodes(impl.procs, lambda n: serve_argv(dep.nodes[n].role, dep_file, n), request)
        )

    async def run_client(self, make: Callable[[], Awaitable[T]]) -> T:
        return await make()

    def exit_code(self, service: str) -> int | None:
        """How a service's process ended (negative: the signal), None while it runs or in-process."""
        impl = self._impl
        p = impl.procs.procs.get(service) if isinstance(impl, LocalBackend) else None
        return None if p is None else p.poll()

    async def host_url(self) -> str:
        return self.deployment.router.url

    async def stop(self) -> None:
        if self._faults is not None:
            await self._faults.stop()
            self._faults = None
        await self._impl.__aexit__(None, None, None)
