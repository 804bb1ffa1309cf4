"""Faults on a container deployment (the compose backend).

Node faults go through `ContainerEngine`, four calls on a service's container, so the backend's
way of talking to Docker stays its own (`SdkEngine` drives the engine's API). Slowdowns use the node's
HTTP endpoint, which the host reaches on the container networks. Link faults reshape the WAN router
container from the host: netlink into its namespace (/proc/PID/ns/net) for the rate class, and the delay
line's control socket, bind-mounted on the host, for loss. Resets run the injector on the host inside
that namespace (it needs root, as the netns backend does).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from testbed.core.fault_timeline import FaultEvent, Link, faulted_links
from testbed.core.json_types import JSONObject
from testbed.core.schema.linkprofile import LinkParams
from testbed.deploy.engine import ContainerState, Engine
from testbed.deploy.fault_injection import HEALTH_TIMEOUT_S, FaultTarget, InjectorProcess, http_json
from testbed.live.clock import now
from testbed.live.deployment import Deployment
from testbed.net.topology import Topology


class ContainerEngine(Protocol):
    """What node faults need from the container engine, by compose service name."""

    def kill(self, service: str) -> None:
        """SIGKILL the container's processes; the container stays, exited."""
        ...

    def pause(self, service: str) -> None:
        """Freeze every process of the container (cgroup freezer)."""
        ...

    def unpause(self, service: str) -> None: ...

    def start(self, service: str) -> None:
        """Start an exited container again (same command, fresh processes)."""
        ...


class SdkEngine:
    """`ContainerEngine` on the Docker engine's API (`testbed.deploy.engine`); `containers()`
    maps compose service names to their containers."""

    def __init__(self, engine: Engine, containers: Callable[[], Mapping[str, ContainerState]]) -> None:
        self.engine = engine
        self.containers = containers
        self._ids: dict[str, str] = {}

    def _id(self, service: str) -> str:
        if service not in self._ids:
            self._ids = {k: c.id for k, c in self.containers().items()}
        if service not in self._ids:
            raise KeyError(f"no container for service {service!r}")
        return self._ids[service]

    def kill(self, service: str) -> None:
        self.engine.signal(self._id(service), "kill")

    def pause(self, service: str) -> None:
        self.engine.signal(self._id(service), "pause")

    def unpause(self, service: str) -> None:
        self.engine.signal(self._id(service), "unpause")

    def start(self, service: str) -> None:
        self.engine.signal(self._id(service), "start")


class ContainerNodes:
    """`NodeControl` for one container per node instance (the service is named like the node)."""

    def __init__(
        self,
        engine: ContainerEngine,
        urls: dict[str, str],
        health_timeout: float = HEALTH_TIMEOUT_S,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.urls = urls
        self.headers = headers or {}  # the run secret the nodes' fault route asks for
        self.health_timeout = health_timeout

    async def kill(self, node: str) -> JSONObject:
        await asyncio.to_thread(self.engine.kill, node)
        return {"container": node, "signal": "SIGKILL"}

    async def pause(self, node: str) -> JSONObject:
        await asyncio.to_thread(self.engine.pause, node)
        return {"container": node, "action": "pause"}

    async def resume(self, node: str) -> JSONObject:
        await asyncio.to_thread(self.engine.unpause, node)
        return {"container": node, "action": "unpause"}

    async def start(self, node: str) -> JSONObject:
        t = now()
        await asyncio.to_thread(self.engine.start, node)
        while True:
            try:
                await asyncio.to_thread(http_json, f"{self.urls[node]}/health", None, 2.0)
                return {"container": node, "healthy_after_s_wire": round(now() - t, 4)}
            except (OSError, ValueError):
                if now() - t > self.health_timeout:
                    raise RuntimeError(f"node {node} not healthy {self.health_timeout:g} s after its restart") from None
            await asyncio.sleep(0.1)

    async def slow(self, node: str, factor: float, until: float | None) -> JSONObject:
        reply = await asyncio.to_thread(
            http_json, f"{self.urls[node]}/testbed/fault", {"slow": factor, "until_s": until}, 5.0, self.headers
        )
        return {"slow": reply.get("slow"), "until_s": reply.get("until_s")}


class ContainerWanLinks:
    """`LinkFaults` on the WAN router container, from the host."""

    def __init__(self, topo: Topology, netns: str, control: Path | None) -> None:
        self.topo = topo
        self.netns = netns
        self.control = control
        self.base: dict[Link, LinkParams] = dict(topo.links)

    async def set_link_faults(self, active: list[FaultEvent]) -> JSONObject:
        from testbed.net.wanrouter import change_links

        want = faulted_links(self.base, active)
        changes = {k: p for k, p in want.items() if self.topo.links.get(k) != p}
        await asyncio.to_thread(change_links, self.topo, changes, self.control, self.netns)
        return {
            "links": {f"{a}->{b}": {"rate_bps_wire": p.rate_bps, "loss": p.loss} for (a, b), p in want.items()},
            "changed": [f"{a}->{b}" for (a, b) in changes],
        }


def container_fault_target(
    dep: Deployment,
    engine: ContainerEngine,
    wan_config: Path,
    wan_pid: int,
    control: Path | None,
    kv_port: int,
    log_dir: Path,
) -> FaultTarget:
    """Everything the compose backend can fault: nodes by the engine, the WAN router's links and
    connections through its namespace. `wan_config` is the WAN router's JSON (wan.json)."""
    from testbed.net.container_wan import topology_from_config

    cfg = json.loads(wan_config.read_text())
    topo = topology_from_config(cfg, cfg["method"])
    netns = f"/proc/{wan_pid}/ns/net"
    urls = {k: n.http.url for k, n in dep.nodes.items()}
    resets = InjectorProcess([d.wan_ifname for d in topo.dcs], kv_port, log_dir, netns=netns)
    nodes = ContainerNodes(engine, urls, headers=dep.credentials.runner_headers())
    return FaultTarget("compose", nodes, ContainerWanLinks(topo, netns, control), resets)
