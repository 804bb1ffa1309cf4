"""The two loopback backends behind the Backend protocol: one process per service (`local`)
or every service in this process (`inproc`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

from testbed.config.resolved import ResolvedScenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.local import LocalBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.deployment import Endpoint

T = TypeVar("T")
NO_SHAPING = {
    "method": "none",
    "detail": "loopback: every service on 127.0.0.1; no WAN delay, rate limit or loss is emulated",
}


class LoopbackBackend:
    def __init__(self, kind: str, rs: ResolvedScenario, run_dir: Path, extra: dict[str, Any] | None = None,
                 host_port: int = 0) -> None:
        self.name = kind
        self.deployment = loopback_deployment(rs, str(run_dir.resolve()))
        self.deployment.extra.update(extra or {})
        if host_port:       # the router is on the host already: it listens on the port asked for
            self.deployment.router = Endpoint(self.deployment.router.host, host_port)
        self._impl: LocalBackend | InProcessBackend = (
            LocalBackend(self.deployment, run_dir) if kind == "local" else InProcessBackend(self.deployment))

    def shaping(self) -> dict[str, Any]:
        return dict(NO_SHAPING)

    async def start(self) -> None:
        await self._impl.__aenter__()

    async def on_t0(self, t0: float) -> None:
        return None

    async def run_client(self, make: Callable[[], Awaitable[T]]) -> T:
        return await make()

    async def host_url(self) -> str:
        return self.deployment.router.url

    async def stop(self) -> None:
        await self._impl.__aexit__(None, None, None)
