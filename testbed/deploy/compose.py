"""Compose backend: the scenario as a compose file (one container per node instance, one internal
bridge network per datacenter, a WAN router container joined to every datacenter network that
shapes the links with the same plan as the netns backend), started with the compose CLI.

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
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

import yaml

from testbed.core.linkprofile import LinkParams, LinkProfile
from testbed.core.scaling import Scale
from testbed.config.resolved import ResolvedScenario
from testbed.core.scenario import Scenario
from testbed.core.topology import node_specs
from testbed.deploy.local import BackendError
from testbed.deploy.netns import local_dc, wan_links
from testbed.live.deployment import Deployment, Endpoint, NodeEndpoint
from testbed.net.container_wan import wan_config

if TYPE_CHECKING:
    from testbed.deploy.faults import FaultScheduler

T = TypeVar("T")
HTTP_PORT = 8000
KV_PORT = 9000
WAN_HOST = 254          # the WAN router's host number on every datacenter network
FIRST_HOST = 10
IN_CONTAINER = "/run/testbed"      # the run directory, bind-mounted
CTL_DIR = "/ctl"                   # short path for the delay line's UNIX socket
# bash's /dev/tcp, not Python: a Python health check every second in each of a dozen containers
# costs more than a core of interpreter start-ups and skews the very timings the run measures.
HEALTH_CMD = ["CMD", "bash", "-c",
              "exec 3<>/dev/tcp/127.0.0.1/8000 && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 "
              "&& head -1 <&3 | grep -q ' 200 '"]
PREFIX = "ptb"


def compose_cli() -> list[str]:
    """`docker compose` (plugin) where present, else `docker-compose`."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise BackendError("neither `docker compose` nor `docker-compose` is installed")


def _subnet(base: str, i: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(f"{base}.{i}.0/24")


def _ip(net: ipaddress.IPv4Network | ipaddress.IPv6Network | str, host: int) -> str:
    return str(ipaddress.ip_network(net).network_address + host)


def layout(sc: Scenario, base: str = "10.232") -> dict[str, Any]:
    """Addresses of every container: {dcs: {name: (index, subnet)}, hosts: {id: (dc, ip)}}."""
    dcs = list(dict.fromkeys(c.datacenter for c in sc.clusters))
    home = local_dc(sc)
    counts = {d: 0 for d in dcs}
    hosts: dict[str, tuple[str, str]] = {}
    for name, dc in [(n.id, n.datacenter) for n in node_specs(sc)] + [("router", home)]:
        net = _subnet(base, dcs.index(dc))
        hosts[name] = (dc, _ip(net, FIRST_HOST + counts[dc]))
        counts[dc] += 1
    return {"dcs": {d: (i, str(_subnet(base, i))) for i, d in enumerate(dcs)}, "hosts": hosts, "home": home}


def deployment_for(rs: ResolvedScenario, lay: dict[str, Any]) -> Deployment:
    nodes = {}
    for n in node_specs(rs.spec):
        dc, ip = lay["hosts"][n.id]
        nodes[n.id] = NodeEndpoint(n.id, n.role, n.cluster, n.datacenter, Endpoint(ip, HTTP_PORT),
                                   Endpoint(ip, KV_PORT))
    _, rip = lay["hosts"]["router"]
    return Deployment(rs, Endpoint(rip, HTTP_PORT), nodes, run_dir=IN_CONTAINER, bind_host="0.0.0.0")


def compose_spec(sc: Scenario, profile: LinkProfile, project: str, image: str, run_dir: Path,
                 ctl_dir: Path, mtu: int = 65000) -> dict[str, Any]:
    """The compose document (pure: no I/O)."""
    lay = layout(sc)
    tcp = profile.tcp
    sysctls: dict[str, str] = {}
    if tcp.rmem_max:
        sysctls["net.ipv4.tcp_rmem"] = f"4096 131072 {tcp.rmem_max}"
    if tcp.wmem_max:
        sysctls["net.ipv4.tcp_wmem"] = f"4096 16384 {tcp.wmem_max}"
    networks: dict[str, Any] = {}
    for dc, (i, subnet) in lay["dcs"].items():
        # Not `internal`: Docker isolates internal networks with netfilter rules that (bridge
        # netfilter on) drop every frame whose destination lies outside the network's subnet, i.e.
        # all cross-datacenter traffic on its way to the WAN router.
        networks[f"dc-{dc}"] = {
            "driver": "bridge",
            "driver_opts": {"com.docker.network.driver.mtu": str(mtu)},
            "ipam": {"config": [{"subnet": subnet}]},
            "labels": {"prfaas-testbed.project": project},
        }
    volumes = [f"{run_dir.resolve()}:{IN_CONTAINER}"]
    labels = {"prfaas-testbed.project": project}
    services: dict[str, Any] = {}
    wan_ip = {dc: _ip(subnet, WAN_HOST) for dc, (_, subnet) in lay["dcs"].items()}
    for sid, (dc, ip) in lay["hosts"].items():
        role = "router" if sid == "router" else next(n.role for n in node_specs(sc) if n.id == sid)
        routes = [f"--route={subnet}={wan_ip[dc]}" for other, (_, subnet) in lay["dcs"].items() if other != dc]
        services[sid] = {
            "image": image,
            "command": ["serve", role, "--deployment", f"{IN_CONTAINER}/deployment.json", "--id", sid, *routes],
            "networks": {f"dc-{dc}": {"ipv4_address": ip}},
            "cap_add": ["NET_ADMIN"],
            "sysctls": dict(sysctls),
            "volumes": list(volumes),
            "healthcheck": {"test": HEALTH_CMD, "interval": "2s", "timeout": "10s", "retries": 150},
            "labels": dict(labels),
            "depends_on": ["wan"],
        }
    services["wan"] = {
        "image": image,
        "entrypoint": ["python3", "-m", "testbed.net.container_wan", f"{IN_CONTAINER}/wan.json"],
        "networks": {f"dc-{dc}": {"ipv4_address": wan_ip[dc]} for dc in lay["dcs"]},
        "cap_add": ["NET_ADMIN"],
        "devices": ["/dev/net/tun:/dev/net/tun"],
        "sysctls": {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                    "net.ipv4.conf.default.rp_filter": "0"},
        "volumes": [*volumes, f"{ctl_dir}:{CTL_DIR}"],
        # A shell test, not Python: interpreter start-up in a busy container can outlast the timeout.
        # ($$ is compose's escape for a literal $.)
        "healthcheck": {"test": ["CMD-SHELL", f"r=$$(cat {IN_CONTAINER}/wan-ready) && "
                                              '{ [ "$$r" = netem ] || test -S "$$r"; }'],
                        "interval": "2s", "timeout": "10s", "retries": 150},
        "labels": dict(labels),
    }
    return {"services": services, "networks": networks}


def _run(cmd: list[str], timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise BackendError(f"{' '.join(cmd[:4])}... failed ({r.returncode}):\n{(r.stderr or r.stdout)[-2000:]}")
    return r


def _log_image(line: str) -> None:
    import sys
    print(f"image: {line}", file=sys.stderr, flush=True)


def link_facts(links: dict[tuple[str, str], LinkParams], scale: Scale) -> dict[str, dict[str, float]]:
    """Parameters of every shaped direction, wire and paper units, for run.json."""
    return {f"{a}->{b}": {"rate_bps_wire": p.rate_bps, "rate_bps_paper": scale.paper_rate_bps(p.rate_bps),
                          "delay_s_wire": p.delay_s, "jitter_s_wire": p.jitter_s, "loss": p.loss,
                          "loss_correlation": p.loss_correlation, "queue_bytes": p.queue_bytes}
            for (a, b), p in links.items()}


def remove_project(project: str, include_swarm: bool = True) -> dict[str, list[str]]:
    """Every container, network and volume labelled with this project (or, for the bare prefix,
    with any project): what `compose down` would remove, also when the compose file is gone.
    With include_swarm, also the project's swarm services, overlay networks and configs."""
    if shutil.which("docker") is None:
        return {"containers": [], "networks": [], "volumes": []}
    if include_swarm:
        from testbed.deploy.swarm import remove_stack

        swarm = remove_stack(project)
        rest = remove_project(project, include_swarm=False)
        return {k: list(dict.fromkeys(swarm.get(k, []) + rest.get(k, []))) for k in {**swarm, **rest}}
    sel = f"label=prfaas-testbed.project={project}" if project != PREFIX else "label=prfaas-testbed.project"
    out: dict[str, list[str]] = {}
    for kind, ls, rm in (("containers", ["docker", "ps", "-aq", "--filter", sel], ["docker", "rm", "-f", "-v"]),
                         ("networks", ["docker", "network", "ls", "-q", "--filter", sel], ["docker", "network", "rm"]),
                         ("volumes", ["docker", "volume", "ls", "-q", "--filter", sel], ["docker", "volume", "rm", "-f"])):
        ids = _run(ls, check=False).stdout.split()
        if ids:
            _run(rm + ids, check=False)
        out[kind] = ids
    return out


class ComposeBackend:
    name = "compose"

    def __init__(self, rs: ResolvedScenario, run_dir: Path, rebuild_image: bool = False) -> None:
        from testbed.net.topology import new_prefix

        sc = self.sc = rs.spec
        self.run_dir = run_dir.resolve()
        self.project = new_prefix()
        self.ctl_dir = Path(f"/tmp/{self.project}-ctl")
        self.profile = rs.inter_dc
        self.scale = rs.scale
        self.lay = layout(sc)
        self.deployment = deployment_for(rs, self.lay)
        self.rebuild_image = rebuild_image
        self.links = wan_links(sc, self.profile, self.scale)
        self.method = "unknown"
        self._cli: list[str] = []
        self._monitor: Any = None
        self._series: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        self._faults: FaultScheduler | None = None

    def _compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([*self._cli, "-p", self.project, "-f", str(self.run_dir / "compose.yaml"), *args],
                    timeout=timeout, check=check)

    def shaping(self) -> dict[str, Any]:
        return {
            "method": self.method, "backend": "compose", "project": self.project, "profile": self.profile.name,
            "mtu": 65000,
            "links": link_facts(self.links, self.scale),
            "detail": "WAN router container: HTB rate class + bfifo (or netem) on its interface into each DC network; "
                      "delay, jitter and loss by the userspace delay line on tun0 where the kernel lacks netem",
        }

    async def start(self) -> None:
        try:
            await asyncio.to_thread(self._up)
            await asyncio.to_thread(self._wait_healthy)
        except BaseException:
            await self.stop()
            raise

    def _up(self) -> None:
        from testbed.deploy.image import IMAGE, ensure_image
        from testbed.net.capabilities import choose_method, probe_shaping

        self._cli = compose_cli()
        ensure_image(rebuild=self.rebuild_image, log=_log_image)
        self.method = choose_method(probe_shaping(), "auto")
        (self.run_dir / "timeseries").mkdir(parents=True, exist_ok=True)
        self.ctl_dir.mkdir(parents=True, exist_ok=True)
        self.deployment.write(self.run_dir / "deployment.json")
        dcs = [(dc, subnet, _ip(subnet, WAN_HOST)) for dc, (_, subnet) in self.lay["dcs"].items()]
        (self.run_dir / "wan.json").write_text(json.dumps(wan_config(
            self.project, dcs, self.links, self.method, 65000, f"{CTL_DIR}/dl.sock",
            f"{IN_CONTAINER}/timeseries/delayline.jsonl", f"{IN_CONTAINER}/wan-ready"), indent=1))
        spec = compose_spec(self.sc, self.profile, self.project, IMAGE, self.run_dir, self.ctl_dir)
        (self.run_dir / "compose.yaml").write_text(
            f"# prfaas-testbed: scenario {self.sc.name}. Rerun by hand:\n"
            f"#   docker compose -p {self.project} -f compose.yaml up -d   (or docker-compose)\n"
            + yaml.safe_dump(spec, sort_keys=False))
        self._compose("up", "-d", timeout=600)

    def containers(self) -> dict[str, str]:
        """service name -> container id."""
        out = {}
        for cid in self._compose("ps", "-q", check=False).stdout.split():
            svc = _run(["docker", "inspect", "-f", '{{index .Config.Labels "com.docker.compose.service"}}', cid],
                       check=False).stdout.strip()
            out[svc] = cid
        return out

    def _wait_healthy(self, timeout: float = 300.0) -> None:
        import time
        want = set(self.lay["hosts"]) | {"wan"}
        deadline = time.monotonic() + timeout
        while True:
            ids = self.containers()
            status = {}
            for svc, cid in ids.items():
                st = _run(["docker", "inspect", "-f", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                           cid], check=False).stdout.split()
                status[svc] = st
            bad = [s for s, st in status.items() if st and st[0] in ("exited", "dead")]
            if bad or time.monotonic() > deadline:
                svc = bad[0] if bad else sorted(s for s in want if status.get(s, ["", ""])[-1] != "healthy")[0]
                logs = _run(["docker", "logs", "--tail", "15", ids[svc]], check=False) if svc in ids else None
                text = (logs.stdout + logs.stderr) if logs else "(no container)"
                raise BackendError(f"container {svc} {'exited' if bad else 'not healthy'}; last log lines:\n{text}")
            if want <= set(status) and all(st[-1] == "healthy" for s, st in status.items() if s in want):
                return
            time.sleep(0.5)

    async def on_t0(self, t0: float) -> None:
        from testbed.live.series import SeriesWriter
        from testbed.net.monitor import LinkMonitor, WatchedLink

        pid = _run(["docker", "inspect", "-f", "{{.State.Pid}}", self.containers()["wan"]]).stdout.strip()
        w = SeriesWriter(self.run_dir / "timeseries" / "wan.jsonl", "wan")
        self._series = w
        w.write([("link_rate_bps_wire", p.rate_bps, {"link": f"{a}->{b}"}) for (a, b), p in self.links.items()], ts=t0)
        watched = [WatchedLink(f"dc{self.lay['dcs'][b][0]}", f"{a}->{b}") for (a, b) in self.links]
        self._monitor = LinkMonitor(f"/proc/{pid}/ns/net", watched, w, 0.05)
        await asyncio.to_thread(self._monitor.start)
        if self.sc.faults:
            from testbed.deploy.container_faults import DockerCliEngine, container_fault_target
            from testbed.deploy.faults import start_faults

            ctl = self.ctl_dir / "dl.sock" if self.method == "fallback" else None
            target = container_fault_target(self.deployment, DockerCliEngine(self.containers), self.run_dir / "wan.json",
                                            int(pid), ctl, KV_PORT, self.run_dir / "logs")
            self._faults = start_faults(self.sc, target, t0, self.run_dir)

    async def run_client(self, make: Callable[[], Awaitable[T]]) -> T:
        # The host reaches the containers' bridge networks directly.
        return await make()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._faults is not None:
            await self._faults.stop()      # first: a paused container must be unpaused to stop
        if self._monitor is not None:
            await asyncio.to_thread(self._monitor.stop)
        if self._series is not None:
            self._series.close()
        if self._cli and (self.run_dir / "compose.yaml").exists():
            await asyncio.to_thread(self._compose, "down", "-v", "--remove-orphans", "--timeout", "5",
                                    timeout=120, check=False)
        await asyncio.to_thread(remove_project, self.project, False)
        shutil.rmtree(self.ctl_dir, ignore_errors=True)
