"""The router's active health probes against a node that is paused mid-run (it keeps accepting
connections but answers nothing): the node is marked down one probe timeout after its failures
begin, and the other nodes go on being probed meanwhile."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from testbed.config.scenarios import load_scenario
from testbed.core.router.health import PROBE_INTERVAL_S, PROBE_TIMEOUT_S
from testbed.core.schema.topology import node_specs
from testbed.live.common import ServiceConfig
from testbed.live.deployment import Deployment, Endpoint, NodeEndpoint
from testbed.live.router.probes import probe_forever
from testbed.live.router.state import RouterState, new_state
from testbed.live.router.vllm_metrics import make_metrics
from testbed.metrics.series_format import SeriesWriter
from testbed.run.load import resolve

pytestmark = pytest.mark.app


class Node:
    """A node's /health that answers until paused, then holds every probe unanswered."""

    def __init__(self) -> None:
        self.paused = False
        self.hits: list[float] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def health(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(time.monotonic())
        if self.paused:
            await asyncio.Event().wait()
        return web.Response(text="ok")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


def _state(session: aiohttp.ClientSession, ports: dict[str, int]) -> tuple[RouterState, list[str]]:
    sc = load_scenario(
        "paper-homogeneous",
        {
            "scale": {"speedup": 40, "byte_scale": 1024},
            "clusters": [
                {"name": "pd", "datacenter": "local", "kind": "pd", "hardware": "h20", "prefill": 1, "decode": 1}
            ],
        },
    )
    rs = resolve(sc)
    specs = list(node_specs(rs.spec))
    names = [s.id for s in specs]
    nodes = {
        s.id: NodeEndpoint(s.id, s.role, s.cluster, s.datacenter, Endpoint("127.0.0.1", port))
        for s, port in zip(specs, ports.values())
    }
    cfg = ServiceConfig(Deployment(rs, Endpoint("127.0.0.1", 9), nodes), "router")
    return new_state(
        cfg,
        session,
        make_metrics(CollectorRegistry(), sc.model.name, sc.model.max_context_tokens),
        SeriesWriter(None, "router"),
    ), names


async def test_a_paused_node_is_down_one_timeout_after_it_stopped_and_the_others_are_still_probed() -> None:
    paused, healthy = Node(), Node()
    await paused.start()
    await healthy.start()
    async with aiohttp.ClientSession() as session:
        st, (p_name, h_name) = _state(session, {"p": paused.port, "h": healthy.port})
        task = asyncio.create_task(probe_forever(st))
        try:
            while not paused.hits:  # both answered once: the startup grace is over for them
                await asyncio.sleep(0.05)
            await asyncio.sleep(PROBE_INTERVAL_S)
            paused.paused = True
            t0 = time.monotonic()
            h_before = len(healthy.hits)
            while st.health.state(p_name) != "down":
                await asyncio.sleep(0.05)
                assert time.monotonic() - t0 < 30, "the paused node was never marked down"
            took = time.monotonic() - t0
            h_probes = len(healthy.hits) - h_before
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await paused.stop()
            await healthy.stop()
    failures = st.health.max_failures
    # Waiting for every probe of a round held each round to a full timeout: the third failure
    # came after `failures` timeouts back to back. Probes that overlap see it after one timeout
    # plus (failures - 1) intervals; the bound between the two leaves the rest to a busy machine.
    assert took < failures * PROBE_TIMEOUT_S, f"paused node marked down after {took:.2f} s"
    # Meanwhile the healthy node was probed about every interval, not once per timeout.
    assert h_probes >= took / PROBE_TIMEOUT_S + 2, (h_probes, took)
    assert st.health.state(h_name) == "up"


def test_probe_constants_leave_room_between_the_two_bounds() -> None:
    # The test above tells the two behaviours apart only if one timeout plus the intervals of the
    # failures is well under `failures` timeouts.
    assert PROBE_TIMEOUT_S + 2 * PROBE_INTERVAL_S < 0.7 * 3 * PROBE_TIMEOUT_S
