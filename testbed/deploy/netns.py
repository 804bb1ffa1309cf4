"""netns backend: one network namespace per service, a bridge per datacenter, and a WAN router
namespace whose interfaces shape every inter-datacenter link (netem where the kernel has it;
otherwise HTB for the rate and the userspace delay line on a TUN device for delay, jitter and
loss). Services run the same code as on loopback, each inside its own namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from testbed.config.privilege import need_root
from testbed.config.resolved import ResolvedScenario
from testbed.core.fault_timeline import FaultEvent, Link, faulted_links
from testbed.core.json_types import JSONObject
from testbed.core.schema.linkprofile import LinkParams, LinkProfile, schedule_wire
from testbed.core.schema.scaling import Scale
from testbed.core.schema.scenario import Scenario
from testbed.core.schema.topology import local_dc, node_specs
from testbed.deploy.base import every_step, in_thread_halting
from testbed.deploy.fault_injection import (
    FaultScheduler,
    FaultTarget,
    InjectorProcess,
    ProcessNodes,
    http_json,
    start_faults,
)
from testbed.deploy.foreign_router import NAMESPACE_PROMETHEUS_PORT
from testbed.deploy.host_capacity import StartGuard
from testbed.deploy.local import serve_argv, service_argv, wait_healthy
from testbed.live.clock import sleep_until
from testbed.live.deployment import Deployment, Endpoint, NodeEndpoint
from testbed.metrics.series_format import Sample, SeriesWriter
from testbed.net import owners
from testbed.net.capabilities import choose_method, probe_shaping
from testbed.net.executor import Executor
from testbed.net.forward import NetnsForwarder
from testbed.net.monitor import LinkMonitor, WatchedLink
from testbed.net.nsexec import nsexec_argv
from testbed.net.nsthread import NetnsLoop, run_in_netns
from testbed.net.plan import plan_up
from testbed.net.procs import ProcessGroup
from testbed.net.teardown import teardown
from testbed.net.topology import Topology, build_topology, new_prefix
from testbed.net.wanrouter import change_links, start_delayline

T = TypeVar("T")
log = logging.getLogger("testbed.netns")
HTTP_PORT = 8000
KV_PORT = 9000
MONITOR_INTERVAL_S = 0.05  # wire seconds: twice the 10 Hz the reports need, for rate-change tracking
ROUTER_HOST = "router"
CLIENT_HOST = "client"


class NetnsError(RuntimeError):
    pass


def wan_links(sc: Scenario, profile: LinkProfile, scale: Scale) -> dict[tuple[str, str], LinkParams]:
    """Every ordered pair of distinct datacenters gets the scenario's inter-DC profile."""
    dcs = list(dict.fromkeys(c.datacenter for c in sc.clusters))
    params = profile.wire(scale)
    return {(a, b): params for a in dcs for b in dcs if a != b}


def build_netns_topology(rs: ResolvedScenario, prefix: str, method: str) -> tuple[Topology, LinkProfile]:
    sc, profile, scale = rs.spec, rs.inter_dc, rs.scale
    home = local_dc(sc)
    hosts = [(n.id, n.datacenter) for n in node_specs(sc)] + [(ROUTER_HOST, home), (CLIENT_HOST, home)]
    topo = build_topology(
        prefix,
        hosts,
        wan_links(sc, profile, scale),
        method,  # type: ignore[arg-type]
        mtu=profile.mtu,
        tcp=profile.tcp,
    )
    return topo, profile


def netns_deployment(rs: ResolvedScenario, topo: Topology, run_dir: str) -> Deployment:
    sc = rs.spec
    if sc.transfer.congestion is None and topo.tcp.congestion is not None:
        # The link profile's congestion control, set per KV socket (see plan.host_sysctls).
        sc = sc.model_copy(update={"transfer": sc.transfer.model_copy(update={"congestion": topo.tcp.congestion})})
        rs = rs.model_copy(update={"spec": sc})
    nodes: dict[str, NodeEndpoint] = {}
    for n in node_specs(sc):
        h = topo.host(n.id)
        kv = Endpoint(h.ip, KV_PORT)
        nodes[n.id] = NodeEndpoint(n.id, n.role, n.cluster, n.datacenter, Endpoint(h.ip, HTTP_PORT), kv)
    router = Endpoint(topo.host(ROUTER_HOST).ip, HTTP_PORT)
    # Each service listens on its own namespace's address only (bind_host None).
    return Deployment(rs, router, nodes, run_dir=run_dir, bind_host=None)


class NetnsBackend:
    name = "netns"

    def __init__(
        self,
        rs: ResolvedScenario,
        run_dir: Path,
        method: str = "auto",
        extra: JSONObject | None = None,
        host_port: int = 0,
    ) -> None:
        self.rs = rs
        self.sc = rs.spec
        self.run_dir = run_dir.resolve()
        self.scale = rs.scale
        self.prefix = new_prefix()
        self.want_method = method
        self.method = "unknown"
        self.topo: Topology | None = None
        self.profile: LinkProfile | None = None
        self.deployment = Deployment(rs, Endpoint("0.0.0.0", 0), {}, run_dir=str(self.run_dir))
        self._procs = ProcessGroup(self.run_dir / "logs")
        self._client: NetnsLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._series: list[SeriesWriter] = []
        self._monitor: LinkMonitor | None = None
        self._stopped = False
        self._control: Path | None = None
        self._faults: FaultScheduler | None = None
        # Links without faults (the profile and its schedule), the link faults in force, and one
        # lock so the schedule and the faults never reshape at the same time.
        self._base_links: dict[Link, LinkParams] = {}
        self._link_faults: list[FaultEvent] = []
        self._links_lock = threading.Lock()
        self._wan_series: SeriesWriter | None = None
        self._extra = dict(extra or {})
        self._host_port = host_port
        self._forwarder: NetnsForwarder | None = None
        # Set when the start is interrupted: the threads building the network and spawning the
        # services stop at their next step, so that the teardown does not race them.
        self._halt = threading.Event()

    # -- facts ----------------------------------------------------------------------------
    def shaping(self) -> dict[str, object]:
        out: dict[str, object] = {"method": self.method, "backend": "netns", "prefix": self.prefix}
        if self.topo is not None and self.profile is not None:
            out["profile"] = self.profile.name
            out["mtu"] = self.topo.mtu
            out["links"] = {
                f"{a}->{b}": {
                    "rate_bps_wire": p.rate_bps,
                    "rate_bps_paper": self.scale.paper_rate_bps(p.rate_bps),
                    "delay_s_wire": p.delay_s,
                    "jitter_s_wire": p.jitter_s,
                    "loss": p.loss,
                    "loss_correlation": p.loss_correlation,
                    "queue_bytes": p.queue_bytes,
                    "ifname": f"dc{self.topo.dc(b).index}",
                }
                for (a, b), p in self.topo.links.items()
            }
            out["tcp"] = self.profile.tcp.model_dump()
            out["detail"] = {
                "netem": "netem qdisc (delay, jitter, loss) under an HTB rate class on the WAN router's egress",
                "fallback": "HTB rate class + bfifo queue on the WAN router's egress; delay, jitter and loss by "
                "the userspace delay line on tun0 in the WAN router namespace (no sch_netem here)",
                "none": "no shaping",
            }.get(self.method, "")
            out["schedule"] = [
                {"at_s_wire": t, "rate_bps_wire": p.rate_bps, "loss": p.loss, "delay_s_wire": p.delay_s}
                for t, p in schedule_wire(self.profile, self.scale)
            ]
        return out

    # -- start ----------------------------------------------------------------------------
    async def start(self) -> None:
        need_root("the netns backend (a network namespace per service)", "give --backend local")
        # Before any namespace exists: `testbed down` leaves a live owner's namespaces alone.
        owners.claim(self.prefix, "netns", self.run_dir)
        try:
            await in_thread_halting(self._build, self._halt)
            await in_thread_halting(self._spawn_all, self._halt)
            self._client = NetnsLoop(self.topo.host(CLIENT_HOST).netns)  # type: ignore[union-attr]
            self._client.__enter__()
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise

    def _build(self) -> None:
        caps = probe_shaping()
        self.method = choose_method(caps, self.want_method)
        self.topo, self.profile = build_netns_topology(self.rs, self.prefix, self.method)
        self._base_links = dict(self.topo.links)
        self.deployment = netns_deployment(self.rs, self.topo, str(self.run_dir))
        self.deployment.extra.update(self._extra)
        self.deployment.write(self.run_dir / "deployment.json")
        (self.run_dir / "topology.json").write_text(
            json.dumps(
                {
                    "prefix": self.prefix,
                    "method": self.method,
                    "wan_ns": self.topo.wan_ns,
                    "mtu": self.topo.mtu,
                    "hosts": {h.name: {"netns": h.netns, "ip": h.ip, "dc": h.dc} for h in self.topo.hosts},
                    "dcs": {
                        d.name: {"subnet": d.subnet, "gateway": d.gateway, "index": d.index} for d in self.topo.dcs
                    },
                },
                indent=1,
            )
        )
        with Executor() as ex:
            ex.apply(plan_up(self.topo), self._halt)

    def _spawn(self, key: str, netns: str, argv: list[str]) -> None:
        self._procs.spawn(key, nsexec_argv(netns, argv))

    def _spawn_all(self) -> None:
        assert self.topo is not None
        dep_file = self.run_dir / "deployment.json"
        self._procs.env = self.deployment.credentials.env()
        if self.method == "fallback":
            self._control = start_delayline(
                self._procs, self.topo, self.run_dir, self.run_dir / "timeseries" / "delayline.jsonl"
            )
        guard = StartGuard(len(self.deployment.nodes) + 1)
        for nid, n in [*self.deployment.nodes.items(), ("router", None)]:
            if self._halt.is_set():
                return
            guard.before()
            host = ROUTER_HOST if n is None else nid
            argv = service_argv(self.deployment, dep_file, nid, NAMESPACE_PROMETHEUS_PORT)
            self._spawn(nid, self.topo.host(host).netns, argv)
            guard.started(self._procs.procs[nid].pid)

    async def _wait_healthy(self) -> None:
        urls = {"router": self.deployment.router.url, **{k: v.http.url for k, v in self.deployment.nodes.items()}}
        await self.run_client(lambda: wait_healthy(urls, self._procs))

    # -- during the run -------------------------------------------------------------------
    async def on_t0(self, t0: float) -> None:
        assert self.topo is not None and self.profile is not None
        topo = self.topo
        watched = [WatchedLink(f"dc{topo.dc(b).index}", f"{a}->{b}") for (a, b) in topo.links]
        if watched:
            w = SeriesWriter(self.run_dir / "timeseries" / "wan.jsonl", "wan")
            self._series.append(w)
            self._wan_series = w
            # Configured rate in force, so plots can draw it under the measured curve.
            w.write(
                [Sample("link_rate_bps_wire", p.rate_bps, {"link": f"{a}->{b}"}) for (a, b), p in topo.links.items()],
                ts=t0,
            )
            self._monitor = LinkMonitor(topo.wan_ns, watched, w, MONITOR_INTERVAL_S)
            await asyncio.to_thread(self._monitor.start)
            if self.profile.schedule:
                self._tasks.append(asyncio.create_task(self._run_schedule(t0)))
        if self.sc.faults:
            self._faults = start_faults(self.sc, self._fault_target(), t0, self.run_dir)

    async def _run_schedule(self, t0: float) -> None:
        assert self.topo is not None and self.profile is not None
        for at, params in schedule_wire(self.profile, self.scale):
            await sleep_until(t0 + at)
            await asyncio.to_thread(self.apply_link_change, params)
            log.info("link change at %.2f s (wire): %s", at, params)

    def apply_link_change(self, params: LinkParams) -> None:
        """New parameters for every inter-DC direction (a schedule step): kernel rate (and netem),
        delay line; link faults in force stay applied on top."""
        self._reshape(base=params)

    async def set_link_faults(self, active: list[FaultEvent]) -> JSONObject:
        return await asyncio.to_thread(self._reshape, None, active)

    def _reshape(self, base: LinkParams | None = None, faults: list[FaultEvent] | None = None) -> JSONObject:
        """Shape every direction with its base parameters and the link faults in force; apply
        only what changes, and record configured rates that changed in the WAN series."""
        assert self.topo is not None
        with self._links_lock:
            if base is not None:
                self._base_links = {k: base for k in self._base_links}
            if faults is not None:
                self._link_faults = list(faults)
            want = faulted_links(self._base_links, self._link_faults)
            changes = {k: p for k, p in want.items() if self.topo.links.get(k) != p}
            rates = [k for k, p in changes.items() if self.topo.links[k].rate_bps != p.rate_bps]
            change_links(self.topo, changes, self._control)
        if self._wan_series is not None and (rates or base is not None):
            self._wan_series.write(
                [
                    Sample("link_rate_bps_wire", want[k].rate_bps, {"link": f"{k[0]}->{k[1]}"})
                    for k in (want if base is not None else rates)
                ]
            )
        return {
            "links": {f"{a}->{b}": {"rate_bps_wire": p.rate_bps, "loss": p.loss} for (a, b), p in want.items()},
            "changed": [f"{a}->{b}" for (a, b) in changes],
        }

    def _fault_target(self) -> FaultTarget:
        topo = self.topo
        assert topo is not None
        dep_file = self.run_dir / "deployment.json"

        async def request(node: str, path: str, body: JSONObject | None) -> JSONObject:
            # From the node's own namespace: a remote node stays reachable during a WAN outage.
            url = f"http://127.0.0.1:{HTTP_PORT}{path}"
            return await asyncio.to_thread(
                run_in_netns,
                topo.host(node).netns,
                http_json,
                url,
                body,
                5.0,
                self.deployment.credentials.runner_headers(),
            )

        def argv(node: str) -> list[str]:
            return nsexec_argv(topo.host(node).netns, serve_argv(self.deployment.nodes[node].role, dep_file, node))

        resets = InjectorProcess(
            [d.wan_ifname for d in topo.dcs], KV_PORT, self.run_dir / "logs", wrap=lambda a: nsexec_argv(topo.wan_ns, a)
        )
        return FaultTarget("netns", ProcessNodes(self._procs, argv, request), self, resets)

    def exit_code(self, service: str) -> int | None:
        """How a service's process ended (negative: the signal), None while it runs."""
        p = self._procs.procs.get(service)
        return None if p is None else p.poll()

    async def run_client(self, make: Callable[[], Awaitable[T]]) -> T:
        if self._client is None:
            raise NetnsError("client namespace is not up")
        return await self._client.run_from(make)

    async def host_url(self) -> str:
        """A port on the host's loopback whose connections are made from the client namespace."""
        if self._forwarder is None:
            assert self.topo is not None
            r = self.deployment.router
            fwd = NetnsForwarder(self.topo.host(CLIENT_HOST).netns, (r.host, r.port), ("127.0.0.1", self._host_port))
            await fwd.start()
            self._forwarder = fwd
        host, port = self._forwarder.address
        return f"http://{host}:{port}"

    # -- stop -----------------------------------------------------------------------------
    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for t in self._tasks:
            t.cancel()
        faults, forwarder, monitor, client, control = (
            self._faults,
            self._forwarder,
            self._monitor,
            self._client,
            self._control,
        )
        await every_step(
            # first: a paused node must be resumed to stop
            lambda: faults.stop() if faults is not None else None,
            lambda: forwarder.close() if forwarder is not None else None,
            lambda: asyncio.gather(*self._tasks, return_exceptions=True),
            lambda: asyncio.to_thread(monitor.stop) if monitor is not None else None,
            *[w.close for w in self._series],  # writes: may fail on a full disk
            lambda: client.__exit__(None, None, None) if client is not None else None,
            lambda: asyncio.to_thread(self._procs.stop, ("router",), ("delayline",)),
            lambda: asyncio.to_thread(teardown, self.prefix),
            lambda: control.unlink(missing_ok=True) if control is not None else None,
            lambda: owners.release(self.prefix),
        )
