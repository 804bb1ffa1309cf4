"""Compose backend: the scenario as a compose file (one container per node instance, one internal
bridge network per datacenter, a WAN router container joined to every datacenter network that
shapes the links with the same plan as the netns backend), started with the compose CLI and
watched through the engine's API.

The file is written into the run directory, so a user can inspect it and rerun it by hand:
`docker compose -p NAME -f compose.yaml up` (or `docker-compose`). It uses only features both
the plugin and Debian's docker-compose 1.29 understand (format without a `version:` key is read
by both; `sysctls`, `cap_add`, `devices`, `healthcheck`, network `ipam`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import shutil
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import yaml

from testbed.config.resolved import ResolvedScenario
from testbed.core.json_types import JSONObject, JSONValue
from testbed.core.schema.linkprofile import LinkParams, LinkProfile
from testbed.core.schema.scaling import Scale
from testbed.core.schema.scenario import Scenario
from testbed.core.schema.topology import local_dc, node_specs
from testbed.deploy import dockercli
from testbed.deploy.base import BackendError, every_step, in_thread_halting
from testbed.deploy.cleanup import ctl_dir, remove_compose_project
from testbed.deploy.engine import (
    COMPOSE_PROJECT,
    COMPOSE_SERVICE,
    PROJECT_LABEL,
    ContainerState,
    Engine,
    connect,
    try_connect,
)
from testbed.deploy.host_capacity import CONTAINER_HEALTH_TIMEOUT_S
from testbed.deploy.netns import wan_links
from testbed.deploy.subnets import COMPOSE_BASES, POOL_OVERLAP, dc_subnet, host_routes, pick_base, subnets_of
from testbed.live.credentials import API_KEY_ENV, RUN_SECRET_ENV
from testbed.live.deployment import Deployment, Endpoint, NodeEndpoint
from testbed.net import owners
from testbed.net.container_wan import wan_config

if TYPE_CHECKING:
    from testbed.deploy.fault_injection import FaultScheduler

T = TypeVar("T")
CREDENTIAL_ENV = (API_KEY_ENV, RUN_SECRET_ENV)
HTTP_PORT = 8000
KV_PORT = 9000
WAN_HOST = 254  # the WAN router's host number on every datacenter network
FIRST_HOST = 10
IN_CONTAINER = "/run/testbed"  # the run directory, bind-mounted
CTL_DIR = "/ctl"  # short path for the delay line's UNIX socket


def health_cmd(host: str = "127.0.0.1") -> list[JSONValue]:
    """GET /health on the service's HTTP port at `host`. bash's /dev/tcp, not Python: a Python
    health check every second in each of a dozen containers costs more than a core of interpreter
    start-ups and skews the very timings the run measures."""
    return [
        "CMD",
        "bash",
        "-c",
        f"exec 3<>/dev/tcp/{host}/{HTTP_PORT} && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 "
        "&& head -1 <&3 | grep -q ' 200 '",
    ]


# The testbed's services answer on loopback too; a foreign router (one --host) on its address only.
HEALTH_CMD = health_cmd()


def _ip(net: ipaddress.IPv4Network | ipaddress.IPv6Network | str, host: int) -> str:
    return str(ipaddress.ip_network(net).network_address + host)


class Layout(TypedDict):
    """Addresses of every container."""

    dcs: dict[str, tuple[int, str]]  # datacenter -> (its index, its network's CIDR)
    hosts: dict[str, tuple[str, str]]  # service id -> (datacenter, address)
    home: str  # the router's datacenter


def layout(sc: Scenario, base: str = COMPOSE_BASES[0]) -> Layout:
    """Addresses of every container (`Layout`)."""
    dcs = list(dict.fromkeys(c.datacenter for c in sc.clusters))
    home = local_dc(sc)
    counts = {d: 0 for d in dcs}
    hosts: dict[str, tuple[str, str]] = {}
    for name, dc in [(n.id, n.datacenter) for n in node_specs(sc)] + [("router", home)]:
        net = dc_subnet(base, dcs.index(dc))
        hosts[name] = (dc, _ip(net, FIRST_HOST + counts[dc]))
        counts[dc] += 1
    return {"dcs": {d: (i, str(dc_subnet(base, i))) for i, d in enumerate(dcs)}, "hosts": hosts, "home": home}


def dc_subnets(lay: Layout) -> dict[str, str]:
    """Datacenter -> its network's CIDR, from a layout."""
    return {dc: subnet for dc, (_, subnet) in lay["dcs"].items()}


def deployment_for(rs: ResolvedScenario, lay: Layout) -> Deployment:
    nodes = {}
    for n in node_specs(rs.spec):
        dc, ip = lay["hosts"][n.id]
        nodes[n.id] = NodeEndpoint(
            n.id, n.role, n.cluster, n.datacenter, Endpoint(ip, HTTP_PORT), Endpoint(ip, KV_PORT)
        )
    _, rip = lay["hosts"]["router"]
    # Each service listens on its container's address on its DC network (static here; learned by
    # discovery on swarm before the service binds), HTTP also on loopback for HEALTH_CMD.
    return Deployment(rs, Endpoint(rip, HTTP_PORT), nodes, run_dir=IN_CONTAINER, bind_host=None, bind_loopback=True)


def compose_spec(
    sc: Scenario,
    profile: LinkProfile,
    project: str,
    image: str,
    run_dir: Path,
    ctl_dir: Path,
    mtu: int = 65000,
    router_port: int | None = None,
    base: str = COMPOSE_BASES[0],
) -> JSONObject:
    """The compose document (pure: no I/O). `router_port`: publish the router's API on the host's
    loopback at that port (a held deployment, for outside clients); `base`: the block of the
    datacenter networks (deploy/subnets.py)."""
    lay = layout(sc, base)
    tcp = profile.tcp
    sysctls: dict[str, str] = {}
    if tcp.rmem_max:
        sysctls["net.ipv4.tcp_rmem"] = f"4096 131072 {tcp.rmem_max}"
    if tcp.wmem_max:
        sysctls["net.ipv4.tcp_wmem"] = f"4096 16384 {tcp.wmem_max}"
    networks: JSONObject = {}
    for dc, (_, subnet) in lay["dcs"].items():
        # Not `internal`: Docker isolates internal networks with netfilter rules that (bridge
        # netfilter on) drop every frame whose destination lies outside the network's subnet, i.e.
        # all cross-datacenter traffic on its way to the WAN router.
        networks[f"dc-{dc}"] = {
            "driver": "bridge",
            "driver_opts": {"com.docker.network.driver.mtu": str(mtu)},
            "ipam": {"config": [{"subnet": subnet}]},
            "labels": {PROJECT_LABEL: project},
        }
    volumes = [f"{run_dir.resolve()}:{IN_CONTAINER}"]
    labels = {PROJECT_LABEL: project}
    services: JSONObject = {}
    wan_ip = {dc: _ip(subnet, WAN_HOST) for dc, (_, subnet) in lay["dcs"].items()}
    for sid, (dc, ip) in lay["hosts"].items():
        role = "router" if sid == "router" else next(n.role for n in node_specs(sc) if n.id == sid)
        routes = [f"--route={subnet}={wan_ip[dc]}" for other, (_, subnet) in lay["dcs"].items() if other != dc]
        svc: JSONObject = {
            "image": image,
            "command": ["serve", role, "--deployment", f"{IN_CONTAINER}/deployment.json", "--id", sid, *routes],
            "networks": {f"dc-{dc}": {"ipv4_address": ip}},
            "cap_add": ["NET_ADMIN"],
            "sysctls": {**sysctls},
            "volumes": [*volumes],
            # By name only: compose passes the values from its own environment, so the file holds
            # no secret (`testbed.live.credentials`).
            "environment": [*CREDENTIAL_ENV],
            "healthcheck": {
                "test": health_cmd(ip) if sid == "router" and sc.router.kind != "testbed" else HEALTH_CMD,
                "interval": "2s",
                "timeout": "10s",
                "retries": 150,
            },
            "labels": {**labels},
            "depends_on": ["wan"],
        }
        if sid == "router" and router_port is not None:
            svc["ports"] = [f"127.0.0.1:{router_port}:{HTTP_PORT}"]
        services[sid] = svc
    services["wan"] = {
        "image": image,
        "entrypoint": ["python3", "-m", "testbed.net.container_wan", f"{IN_CONTAINER}/wan.json"],
        "networks": {f"dc-{dc}": {"ipv4_address": wan_ip[dc]} for dc in lay["dcs"]},
        "cap_add": ["NET_ADMIN"],
        "devices": ["/dev/net/tun:/dev/net/tun"],
        "sysctls": {
            "net.ipv4.ip_forward": "1",
            "net.ipv4.conf.all.rp_filter": "0",
            "net.ipv4.conf.default.rp_filter": "0",
        },
        "volumes": [*volumes, f"{ctl_dir}:{CTL_DIR}"],
        # A shell test, not Python: interpreter start-up in a busy container can outlast the timeout.
        # ($$ is compose's escape for a literal $.)
        "healthcheck": {
            "test": ["CMD-SHELL", f'r=$$(cat {IN_CONTAINER}/wan-ready) && {{ [ "$$r" = netem ] || test -S "$$r"; }}'],
            "interval": "2s",
            "timeout": "10s",
            "retries": 150,
        },
        "labels": {**labels},
    }
    return {"services": services, "networks": networks}


def _log_image(line: str) -> None:
    # The image module prefixes its own steps ("image: building ..."); the build's lines it passes on do not.
    print(line if line.startswith("image: ") else f"image: {line}", file=sys.stderr, flush=True)


def _log(line: str) -> None:
    print(f"compose: {line}", file=sys.stderr, flush=True)


def link_facts(links: dict[tuple[str, str], LinkParams], scale: Scale) -> dict[str, dict[str, float]]:
    """Parameters of every shaped direction, wire and paper units, for run.json."""
    return {
        f"{a}->{b}": {
            "rate_bps_wire": p.rate_bps,
            "rate_bps_paper": scale.paper_rate_bps(p.rate_bps),
            "delay_s_wire": p.delay_s,
            "jitter_s_wire": p.jitter_s,
            "loss": p.loss,
            "loss_correlation": p.loss_correlation,
            "queue_bytes": p.queue_bytes,
        }
        for (a, b), p in links.items()
    }


class ComposeBackend:
    name = "compose"

    def __init__(
        self,
        rs: ResolvedScenario,
        run_dir: Path,
        rebuild_image: bool = False,
        extra: JSONObject | None = None,
        host_port: int | None = None,
    ) -> None:
        from testbed.deploy.ports import free_ports
        from testbed.net.topology import new_prefix

        sc = self.sc = rs.spec
        self.rs = rs
        self.run_dir = run_dir.resolve()
        self.project = new_prefix()
        self.ctl_dir = ctl_dir(self.project)
        self.profile = rs.inter_dc
        self.scale = rs.scale
        self._extra = dict(extra or {})
        self._lay_out(COMPOSE_BASES[0])  # until _up finds the first free block
        # None: not published; 0: a free port picked now (the compose file needs a number).
        self.host_port = free_ports(1)[0] if host_port == 0 else host_port
        self.rebuild_image = rebuild_image
        self.links = wan_links(sc, self.profile, self.scale)
        self.method = "unknown"
        self._cli: list[str] = []
        self._engine: Engine | None = None
        self._monitor: Any = None
        self._series: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        self._faults: FaultScheduler | None = None
        # Set when the start-up is interrupted: `compose up` is stopped, the health wait ends.
        self._halt = threading.Event()

    def _compose(
        self,
        *args: str,
        timeout: float = dockercli.CLI_TIMEOUT_S,
        check: bool = True,
        halt: threading.Event | None = None,
    ) -> None:
        dockercli.compose(
            self._cli,
            self.project,
            self.run_dir / "compose.yaml",
            *args,
            timeout=timeout,
            check=check,
            env=self.deployment.credentials.env(),
            halt=halt,
        )

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = connect()
        return self._engine

    def shaping(self) -> dict[str, object]:
        return {
            "method": self.method,
            "backend": "compose",
            "project": self.project,
            "profile": self.profile.name,
            "mtu": 65000,
            "subnets": dc_subnets(self.lay),
            "links": link_facts(self.links, self.scale),
            "detail": "WAN router container: HTB rate class + bfifo (or netem) on its interface into each DC network; "
            "delay, jitter and loss by the userspace delay line on tun0 where the kernel lacks netem",
        }

    async def start(self) -> None:
        # Before any container exists: `testbed down` leaves a live owner's project alone.
        owners.claim(self.project, "compose", self.run_dir)
        try:
            await in_thread_halting(self._up, self._halt)
            await in_thread_halting(self._wait_healthy, self._halt)
        except BaseException:
            await self.stop()
            raise

    def _lay_out(self, base: str) -> None:
        self.base = base
        self.lay = layout(self.sc, base)
        self.deployment = deployment_for(self.rs, self.lay)
        self.deployment.extra.update(self._extra)

    def _up(self) -> None:
        from testbed.deploy.image import ensure_image
        from testbed.net.capabilities import choose_method, probe_shaping

        self._cli = dockercli.compose_cli()
        ensure_image(rebuild=self.rebuild_image, log=_log_image, engine=self.engine)
        self.method = choose_method(probe_shaping(), "auto")
        (self.run_dir / "timeseries").mkdir(parents=True, exist_ok=True)
        self.ctl_dir.mkdir(parents=True, exist_ok=True)
        tried: list[str] = []
        while True:
            taken = subnets_of(self.engine.network_ipam()) + host_routes()
            self._lay_out(pick_base(COMPOSE_BASES, len(self.lay["dcs"]), taken, tried))
            self._write_files()
            try:
                self._compose("up", "-d", timeout=600, halt=self._halt)
                return
            except BackendError as e:
                if POOL_OVERLAP in str(e) and len(tried) < len(COMPOSE_BASES) - 1:
                    # Another run took the block between our look and our claim: the next one.
                    _log(f"{self.base}.0.0/16 was taken meanwhile; trying the next block")
                    tried.append(self.base)
                    self._compose("down", "--remove-orphans", timeout=120, check=False)
                    continue
                raise BackendError(f"{e}{self._failed_starts()}") from e

    def _write_files(self) -> None:
        from testbed.deploy.image import IMAGE

        self.deployment.write(self.run_dir / "deployment.json")
        dcs = [(dc, subnet, _ip(subnet, WAN_HOST)) for dc, (_, subnet) in self.lay["dcs"].items()]
        (self.run_dir / "wan.json").write_text(
            json.dumps(
                wan_config(
                    self.project,
                    dcs,
                    self.links,
                    self.method,
                    65000,
                    f"{CTL_DIR}/dl.sock",
                    f"{IN_CONTAINER}/timeseries/delayline.jsonl",
                    f"{IN_CONTAINER}/wan-ready",
                ),
                indent=1,
            )
        )
        spec = compose_spec(
            self.sc,
            self.profile,
            self.project,
            IMAGE,
            self.run_dir,
            self.ctl_dir,
            router_port=self.host_port,
            base=self.base,
        )
        (self.run_dir / "compose.yaml").write_text(
            f"# prfaas-testbed: scenario {self.sc.name}. Rerun by hand:\n"
            f"#   docker compose -p {self.project} -f compose.yaml up -d   (or docker-compose)\n"
            f"# with {' and '.join(CREDENTIAL_ENV)} exported (any values: the router's API key and the run secret)\n"
            + yaml.safe_dump(spec, sort_keys=False)
        )

    def _failed_starts(self) -> str:
        """Containers of the project that did not start or have ended, each with its last log lines."""
        try:
            failed = [c for c in self.containers().items() if c[1].status in ("created", "exited", "dead")]
            return "".join(
                f"\ncontainer {svc} {c.describe()}; last log lines:\n{self.engine.logs(c.id)}"
                for svc, c in sorted(failed)
            )
        except BackendError as e:
            return f"\n({e})"

    def containers(self) -> dict[str, ContainerState]:
        """service name -> its container's state."""
        return {
            c.labels.get(COMPOSE_SERVICE, c.name): c
            for c in self.engine.containers(f"{COMPOSE_PROJECT}={self.project}")
        }

    def _wait_healthy(self, timeout: float = CONTAINER_HEALTH_TIMEOUT_S) -> None:
        import time

        want = set(self.lay["hosts"]) | {"wan"}
        deadline = time.monotonic() + timeout
        while True:
            status = self.containers()
            bad = [s for s, c in status.items() if c.ended]
            if bad or time.monotonic() > deadline:
                svc = bad[0] if bad else sorted(s for s in want if s not in status or status[s].health != "healthy")[0]
                text = self.engine.logs(status[svc].id) if svc in status else "(no container)"
                raise BackendError(f"container {svc} {'exited' if bad else 'not healthy'}; last log lines:\n{text}")
            if want <= set(status) and all(c.health == "healthy" for s, c in status.items() if s in want):
                return
            if self._halt.wait(0.5):
                raise BackendError("stopped waiting for the containers to be healthy (interrupted)")

    async def on_t0(self, t0: float) -> None:
        from testbed.metrics.series_format import Sample, SeriesWriter
        from testbed.net.monitor import LinkMonitor, WatchedLink

        pid = (await asyncio.to_thread(self.containers))["wan"].pid
        w = SeriesWriter(self.run_dir / "timeseries" / "wan.jsonl", "wan")
        self._series = w
        w.write(
            [Sample("link_rate_bps_wire", p.rate_bps, {"link": f"{a}->{b}"}) for (a, b), p in self.links.items()], ts=t0
        )
        watched = [WatchedLink(f"dc{self.lay['dcs'][b][0]}", f"{a}->{b}") for (a, b) in self.links]
        self._monitor = LinkMonitor(f"/proc/{pid}/ns/net", watched, w, 0.05)
        await asyncio.to_thread(self._monitor.start)
        if self.sc.faults:
            from testbed.deploy.container_faults import SdkEngine, container_fault_target
            from testbed.deploy.fault_injection import start_faults

            ctl = self.ctl_dir / "dl.sock" if self.method == "fallback" else None
            target = container_fault_target(
                self.deployment,
                SdkEngine(self.engine, self.containers),
                self.run_dir / "wan.json",
                int(pid),
                ctl,
                KV_PORT,
                self.run_dir / "logs",
            )
            self._faults = start_faults(self.sc, target, t0, self.run_dir)

    async def run_client(self, make: Callable[[], Awaitable[T]]) -> T:
        # The host reaches the containers' bridge networks directly.
        return await make()

    async def host_url(self) -> str:
        if self.host_port is None:
            raise BackendError("the router's port is not published: construct the backend with host_port")
        return f"http://127.0.0.1:{self.host_port}"

    def _remove(self) -> None:
        engine = self._engine or try_connect()
        if engine is not None:
            remove_compose_project(engine, self.project)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        faults, monitor, series = self._faults, self._monitor, self._series

        async def down() -> None:
            if self._cli and (self.run_dir / "compose.yaml").exists():
                try:
                    await asyncio.to_thread(
                        self._compose, "down", "-v", "--remove-orphans", "--timeout", "5", timeout=120, check=False
                    )
                except BackendError as e:  # it hung: the label sweep below removes the same objects
                    _log(str(e))

        await every_step(
            # first: a paused container must be unpaused to stop
            lambda: faults.stop() if faults is not None else None,
            lambda: asyncio.to_thread(monitor.stop) if monitor is not None else None,
            lambda: series.close() if series is not None else None,  # writes: may fail on a full disk
            down,
            lambda: asyncio.to_thread(self._remove),
            lambda: shutil.rmtree(self.ctl_dir, ignore_errors=True),
            lambda: owners.release(self.project),
        )
