"""The WAN router as a swarm service: shaping as in compose, plus what the host cannot do itself
when the router may run on another machine.

    python3 -m testbed.deploy.swarm_wan /etc/testbed/wan.json

1. Finds its interface on each DC network by the network's fixed subnet, creates /dev/net/tun
   if the runtime did not pass it in, probes netem in its own namespace (the kernel of the host
   it landed on decides), applies the plan of `testbed.net.container_wan` and starts the delay
   line as a child process.
2. Serves HTTP on port 8000, on every DC network:
   GET /health (200 once shaping and the delay line are up), GET /testbed/info (method, MTU,
   its addresses), the address registry of `testbed.deploy.discovery`,
   POST /testbed/monitor {"t0", "interval"} / POST /testbed/monitor/stop: samples its own
   interface counters into timeseries/wan.jsonl (the host cannot enter a namespace on another
   machine), and the file export of its run directory (that series and the delay line's).
Exits non-zero if the delay line dies, so the task fails visibly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from pyroute2 import IPRoute  # type: ignore[import-untyped]

from testbed.deploy.discovery import Registry, add_file_routes, add_registry_routes
from testbed.live.common import http_server_args
from testbed.metrics.series_format import Sample, SeriesWriter
from testbed.net.container_wan import addresses_by_subnet, apply_shaping, delayline_argv, ensure_tun_device, probe_netem
from testbed.net.monitor import WatchedLink, read_counters
from testbed.net.procs import Child, start_child
from testbed.net.topology import Topology, dc_ifname

log = logging.getLogger("testbed.swarm_wan")
PORT = 8000
INFO = "/testbed/info"
MONITOR = "/testbed/monitor"


class CounterSampler:
    """Interface counters of this namespace into a series, every `interval` s, from a thread of its
    own (the host's LinkMonitor enters a namespace by path, which a container may not: no
    CAP_SYS_ADMIN)."""

    def __init__(self, links: list[WatchedLink], writer: SeriesWriter, interval: float) -> None:
        self.links, self.writer, self.interval = links, writer, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wan-counters", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with IPRoute() as ipr:
            due = time.monotonic()
            while not self._stop.wait(max(due - time.monotonic(), 0.0)):
                stamp = time.time()  # at the read: a late write must not shift the window
                try:
                    self.writer.write(read_counters(ipr, self.links), ts=stamp)
                except Exception:
                    log.exception("reading interface counters failed")
                due += self.interval

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


class Agent:
    def __init__(self, cfg: dict[str, Any], topo: Topology, method: str, child: Child | None) -> None:
        self.cfg = cfg
        self.topo = topo
        self.method = method
        self.child = child
        self.run_dir = Path(cfg["run_dir"])
        self.registry = Registry(
            dict(cfg["members"]),
            {d["name"]: d["subnet"] for d in cfg["dcs"]},
            {d["name"]: d["address"] for d in cfg["dcs"]},
        )
        self.monitor: CounterSampler | None = None
        self.series: SeriesWriter | None = None

    def ready(self) -> bool:
        return self.child is None or (self.child.poll() is None and os.path.exists(self.cfg["control"]))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if self.ready() else "starting"}, status=200 if self.ready() else 503)

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "method": self.method,
                "mtu": self.topo.mtu,
                "addresses": self.registry.gateways,
                "hostname": os.uname().nodename,
            }
        )

    async def start_monitor(self, request: web.Request) -> web.Response:
        body = await request.json()
        t0, interval = float(body["t0"]), float(body.get("interval", 0.05))
        if self.monitor is None:
            w = SeriesWriter(self.run_dir / "timeseries" / "wan.jsonl", "wan")
            # Configured rate in force from t0, as the host-side monitors write it.
            w.write(
                [
                    Sample("link_rate_bps_wire", p.rate_bps, {"link": f"{a}->{b}"})
                    for (a, b), p in self.topo.links.items()
                ],
                ts=t0,
            )
            watched = [WatchedLink(dc_ifname(self.topo.dc(b).index), f"{a}->{b}") for (a, b) in self.topo.links]
            self.series, self.monitor = w, CounterSampler(watched, w, interval)
            self.monitor.start()
        return web.json_response({"ok": True})

    async def stop_monitor(self, request: web.Request | None = None) -> web.Response:
        if self.monitor is not None:
            await asyncio.to_thread(self.monitor.stop)
        if self.series is not None:
            self.series.close()
        return web.json_response({"ok": True})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get(INFO, self.info)
        app.router.add_post(MONITOR, self.start_monitor)
        app.router.add_post(MONITOR + "/stop", self.stop_monitor)
        add_registry_routes(app, self.registry)
        add_file_routes(app, self.run_dir)
        return app


def listen_hosts(dcs: Sequence[Mapping[str, object]]) -> list[str]:
    """Its address on every DC network (found by subnet at start), and loopback for the health
    check: not 0.0.0.0, which would add whatever else the engine attaches (docker_gwbridge)."""
    return list(dict.fromkeys([str(d["address"]) for d in dcs] + ["127.0.0.1"]))


async def serve(agent: Agent) -> int:
    runner = web.AppRunner(agent.app(), access_log=None, **http_server_args())
    await runner.setup()
    for host in listen_hosts(agent.cfg["dcs"]):
        await web.TCPSite(runner, host, PORT).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rc = 0
    while not stop.is_set():
        if agent.child is not None and agent.child.poll() is not None:
            print(f"wan router: the delay line exited with code {agent.child.returncode}", flush=True)
            rc = 1
            break
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass
    await agent.stop_monitor()
    await runner.cleanup()
    if agent.child is not None and agent.child.poll() is None:
        agent.child.terminate()
        await asyncio.to_thread(agent.child.wait, 5)
    return rc


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m testbed.deploy.swarm_wan CONFIG.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s wan %(name)s %(levelname)s %(message)s")
    cfg = json.loads(Path(args[0]).read_text())
    cfg["dcs"] = addresses_by_subnet(cfg["dcs"])
    ensure_tun_device()
    method = cfg.get("method", "auto")
    if method not in ("netem", "fallback"):
        method = "netem" if probe_netem() else "fallback"
    Path(cfg["ready"]).parent.mkdir(parents=True, exist_ok=True)  # the delay line's config goes there
    (Path(cfg["run_dir"]) / "timeseries").mkdir(parents=True, exist_ok=True)
    topo = apply_shaping(cfg, method)
    child = start_child(delayline_argv(cfg, topo)) if method == "fallback" else None
    where = ", ".join(f"{d['name']} {d['address']}" for d in cfg["dcs"])
    print(f"wan router: addresses {where}", flush=True)
    return asyncio.run(serve(Agent(cfg, topo, method, child)))


if __name__ == "__main__":
    sys.exit(main())
