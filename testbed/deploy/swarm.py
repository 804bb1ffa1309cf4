"""Swarm backend: the compose backend's deployment as a Docker Swarm stack, for one host or many.

`docker stack deploy` ignores static `ipv4_address` and `devices`, and hosts share no file
system, so the stack differs from `compose.yaml` where those were relied on:

- one overlay network per datacenter with a fixed `ipam` subnet (attachable, so the host's
  client container can join the home DC's), services in `endpoint_mode: dnsrr` (no IPVS in the
  path), each DC's services placed on nodes labelled `prfaas.dc.<dc>=true` and the WAN router on
  one labelled `prfaas.wan=true` (keys, not values, so one node can carry every label);
- addresses are learned at start: every service registers with the WAN router, the one service
  on every DC network (`testbed.deploy.discovery`), and routes the other DCs through it;
- the deployment and the WAN router's config go in as swarm `configs`; the WAN router creates
  /dev/net/tun itself, probes netem on its own kernel and samples its own interface counters;
- the replayer runs on this host, in the network namespace of a small container attached to
  the home DC's network, and writes the records here as on every backend; at the end the host
  pulls every service's time series over HTTP and saves `docker service logs`.

`stack.yaml` (with `deployment.json` and `wan.json` beside it) is written into the run
directory (built in `testbed.deploy.swarm_stack`): `docker stack deploy -c stack.yaml NAME` brings the
same services up by hand. Stacks are a feature of the CLI, so deploying and removing one is
`testbed.deploy.dockercli`; the tasks, logs, nodes and the client container go through the engine's
API (`testbed.deploy.engine`).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypedDict, TypeVar
from urllib.parse import quote

import yaml

from testbed.config.privilege import is_root
from testbed.config.resolved import ResolvedScenario
from testbed.core.json_types import JSONObject
from testbed.deploy import dockercli
from testbed.deploy.base import BackendError
from testbed.deploy.cleanup import remove_swarm_project
from testbed.deploy.compose import (
    CREDENTIAL_ENV,
    HTTP_PORT,
    dc_subnets,
    layout,
    link_facts,
)
from testbed.deploy.discovery import ADDRESSES, FILES, with_hosts
from testbed.deploy.engine import PROJECT_LABEL, Engine, SwarmNode, Task, connect, try_connect
from testbed.deploy.netns import wan_links
from testbed.deploy.subnets import SWARM_BASES, pick_base, subnets_of
from testbed.deploy.swarm_stack import (
    DC_LABEL,
    SUBNET_BASE,
    WAN_LABEL,
    container_mtu,
    dc_label,
    stack_spec,
    swarm_deployment,
    wan_stack_config,
)
from testbed.net import owners
from testbed.net.forward import NetnsForwarder
from testbed.net.nsthread import NetnsLoop

T = TypeVar("T")
MONITOR_INTERVAL_S = 0.05
START_RETRIES = 2  # of a container the engine failed to start (engine_start_failure)
BAD_STATES = {"failed", "rejected", "orphaned", "complete", "shutdown", "remove"}
HEALTH_TIMEOUT_S = 300.0
COLLECT_TIMEOUT_S = 120.0
TASKS_GONE_S = 60.0  # for the nodes to stop the stack's containers after its removal
PROBE_TIMEOUT_S = 5.0  # a service that does not answer /health in this at the end is lost


class NodeFacts(TypedDict):
    """A node that runs services, as run.json's shaping facts name it."""

    id: str
    address: str
    state: str  # at start
    labels: dict[str, str]  # the testbed's own (prfaas.*)


# -- reading the swarm's state (pure) ------------------------------------------------------------


def task_problem(tasks: list[Task], superseded: Iterable[str] = ()) -> Task | None:
    """The first task that will not come up: ended, rejected, or unschedulable (tasks replaced by
    a retry, `superseded` ids, aside)."""
    gone = set(superseded)
    for t in tasks:
        if t.id in gone:
            continue
        if t.state in BAD_STATES or (t.state == "pending" and "no suitable node" in t.error):
            return t
    return None


def engine_start_failure(t: Task) -> bool:
    """The engine could not start the task's container (a mount busy while another stack's
    containers go, say): a fault of the host, not of the program, which never ran."""
    return t.state in ("failed", "rejected") and t.error.startswith("starting container failed")


def all_running(tasks: list[Task], services: set[str]) -> bool:
    """Every service has a running task (with a health check, swarm says running once healthy)."""
    return services <= {t.service for t in tasks if t.state == "running"}


def missing_labels(nodes: list[SwarmNode], wanted: list[str]) -> list[str]:
    """Labels of `wanted` that no node carries with the value "true"."""
    return [w for w in wanted if not any(n.get("labels", {}).get(w) == "true" for n in nodes)]


def lost_services(placement: dict[str, str], nodes: list[SwarmNode]) -> dict[str, str]:
    """Service -> why it cannot be reached, for services whose node the manager no longer sees as
    ready (its engine or host gone): nothing would answer there, and asking would wait out timeouts."""
    state = {n["hostname"]: n.get("state", "") for n in nodes}
    return {
        svc: f"node {node} is {state.get(node) or 'gone from the swarm'}"
        for svc, node in sorted(placement.items())
        if state.get(node) != "ready"
    }


def host_pid(container_id: str, pid: int, proc: Path = Path("/proc")) -> int:
    """This host's pid of a process of the container. An engine in this pid namespace reports it
    as it is; one in a container of its own (a Docker-in-Docker node) reports its own namespace's
    number, which here may be another process's: the container's processes are the ones whose
    cgroup path names its id, as seen from here, whatever engine made them."""

    def belongs(p: Path) -> bool:
        try:
            return container_id in (p / "cgroup").read_text()
        except OSError:
            return False

    if pid > 0 and belongs(proc / str(pid)):
        return pid
    for p in sorted((p for p in proc.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        if belongs(p):
            return int(p.name)
    raise BackendError(
        f"no process of container {container_id[:12]} is visible on this host (its engine reports "
        f"pid {pid}): the replayer must run on the machine of the manager's engine"
    )


def _log(line: str) -> None:
    print(f"swarm: {line}", file=sys.stderr, flush=True)


async def _on(loop: NetnsLoop, aw: Awaitable[T]) -> T:
    return await asyncio.wrap_future(loop.submit(aw))


async def _get_json(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(url) as r:
            return r.status, await r.json(content_type=None)


async def _answers(url: str, timeout: float) -> None:
    """Return once the URL answers with any status; raise when it cannot be reached in time."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(url) as r:
            await r.read()


async def _post_json(url: str, body: JSONObject, timeout: float = 10.0) -> Any:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(url, json=body) as r:
            r.raise_for_status()
            return await r.json(content_type=None)


async def pull_files(
    base_url: str, dest: Path, timeout: float = 60.0, headers: dict[str, str] | None = None
) -> list[str]:
    """Copy every file a service exports (GET /testbed/files) into dest under the same relative path.
    `headers`: the run secret, which the services ask for."""
    import aiohttp

    got = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), headers=headers) as s:
        async with s.get(base_url + FILES) as r:
            r.raise_for_status()
            files = (await r.json())["files"]
        for rel in files:
            p = Path(rel)
            if p.is_absolute() or ".." in p.parts:
                continue
            async with s.get(f"{base_url}{FILES}/{quote(rel)}") as r:
                r.raise_for_status()
                data = await r.read()
            (dest / p).parent.mkdir(parents=True, exist_ok=True)
            (dest / p).write_bytes(data)
            got.append(rel)
    return got


class SwarmBackend:
    name = "swarm"

    def __init__(
        self,
        rs: ResolvedScenario,
        run_dir: Path,
        rebuild_image: bool = False,
        extra: JSONObject | None = None,
        host_port: int = 0,
    ) -> None:
        from testbed.net.topology import new_prefix

        sc = self.sc = rs.spec
        self.run_dir = run_dir.resolve()
        self.project = new_prefix()
        self.profile = rs.inter_dc
        self.scale = rs.scale
        self.rs = rs
        self._extra = dict(extra or {})
        self.links = wan_links(sc, self.profile, self.scale)
        self.mtu = container_mtu(self.profile)
        self._lay_out(SUBNET_BASE)
        self.rebuild_image = rebuild_image
        self.method = "unknown"  # the WAN router probes its own kernel and says
        self.placement: dict[str, str] = {}
        self.nodes: dict[str, NodeFacts] = {}  # hostname -> its facts at start
        self.lost: dict[str, str] = {}  # service -> why it was unreachable at the end
        self.nodes_at_end: dict[str, str] = {}  # hostname -> state when the run stopped
        self.labelled: list[str] = []
        self._client_name = f"{self.project}-client"
        self._engine: Engine | None = None
        self._client: NetnsLoop | None = None
        self._netns_attached = False
        self._wan_ip: str | None = None
        self._hosts: dict[str, str] = {}
        self._cancel = threading.Event()
        self._host_port = host_port
        self._forwarder: NetnsForwarder | None = None
        self._deploying = threading.Lock()
        self._deployed = False
        self._stopped = False

    def _lay_out(self, base: str) -> None:
        self.base = base
        self.lay = layout(self.sc, base)
        self.template = swarm_deployment(self.rs, self.lay)
        self.template.extra.update(self._extra)
        self.deployment = self.template

    def shaping(self) -> dict[str, object]:
        return {
            "method": self.method,
            "backend": "swarm",
            "project": self.project,
            "profile": self.profile.name,
            "mtu": self.mtu,
            "subnets": dc_subnets(self.lay),
            "links": link_facts(self.links, self.scale),
            "placement": dict(self.placement),
            "nodes": {h: dict(n) for h, n in self.nodes.items()},
            **({"nodes_at_end": dict(self.nodes_at_end)} if self.nodes_at_end else {}),
            **({"unreachable_at_end": dict(self.lost)} if self.lost else {}),
            "nodes_labelled": list(self.labelled),
            "detail": "WAN router service: HTB rate class + bfifo (or netem) on its interface into each DC overlay "
            "network; delay, jitter and loss by the userspace delay line on tun0 where its kernel lacks "
            "netem; link usage from its own interface counters",
        }

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = connect()
        return self._engine

    # -- start ------------------------------------------------------------------------------
    async def start(self) -> None:
        # Before any service exists: `testbed down` leaves a live owner's project alone.
        owners.claim(self.project, "swarm", self.run_dir)
        try:
            await asyncio.to_thread(self._deploy)
            await asyncio.to_thread(self._wait_running)
            await asyncio.to_thread(self._start_client)
            await self._discover()
        except BaseException:
            await self.stop()
            raise

    def _check_swarm(self) -> None:
        if not is_root():
            raise BackendError(
                "the swarm backend needs root: the replayer runs in the network namespace of a "
                "container on the home datacenter's overlay network"
            )
        state, manager = self.engine.swarm_state()
        if state != "active":
            raise BackendError(
                f"this Docker engine is not in a swarm (state {state!r}): run `docker swarm init` "
                "(or join one), then label the nodes; see compose/README.md, Multi-host"
            )
        if not manager:
            raise BackendError("this node is a swarm worker: run `testbed up --backend swarm` on a manager")
        nodes = self.engine.nodes()
        wanted = [dc_label(dc) for dc in self.lay["dcs"]] + [WAN_LABEL]
        missing = missing_labels(nodes, wanted)
        if missing and len(nodes) == 1:
            # One node is the only place for everything: label it (the labels stay; removing them
            # would evict another run's tasks from this node).
            self.engine.add_node_labels(nodes[0]["id"], {m: "true" for m in missing})
            self.labelled = missing
            _log(f"labelled the only node {nodes[0]['hostname']} with {', '.join(f'{m}=true' for m in missing)}")
        elif missing:
            cmds = "\n".join(f"  docker node update --label-add {m}=true NODE" for m in missing)
            raise BackendError(f"no swarm node carries {', '.join(missing)}; put each datacenter on its hosts:\n{cmds}")

    def _deploy(self) -> None:
        from testbed.deploy.image import IMAGE, ensure_image

        self._check_swarm()  # before a build of a minute or more
        ensure_image(
            rebuild=self.rebuild_image, log=lambda line: print(line, file=sys.stderr, flush=True), engine=self.engine
        )
        # Overlay networks are the swarm's: only the engine's own list can say what is taken.
        self._lay_out(pick_base(SWARM_BASES, len(self.lay["dcs"]), subnets_of(self.engine.network_ipam())))
        self.template.write(self.run_dir / "deployment.json")
        (self.run_dir / "wan.json").write_text(
            json.dumps(wan_stack_config(self.project, self.lay, self.links, self.mtu), indent=1)
        )
        spec = stack_spec(self.sc, self.profile, self.project, IMAGE, self.base)
        (self.run_dir / "stack.yaml").write_text(
            f"# prfaas-testbed: scenario {self.sc.name}, for Docker Swarm. Deploy by hand from this directory:\n"
            f"#   docker stack deploy --resolve-image never -c stack.yaml {self.project}\n"
            f"# with {' and '.join(CREDENTIAL_ENV)} exported (any values: the router's API key and the run secret)\n"
            f"# (nodes labelled {', '.join(dc_label(d) + '=true' for d in self.lay['dcs'])} and {WAN_LABEL}=true;\n"
            f"#  the image {IMAGE} loaded on each). Remove: docker stack rm {self.project}\n"
            + yaml.safe_dump(spec, sort_keys=False)
        )
        with self._deploying:  # stop() waits for it: a sweep racing the deploy could miss a service
            if self._cancel.is_set():  # stopped while the image was being built
                return
            self._deployed = True
            r = dockercli.stack_deploy(self.run_dir / "stack.yaml", self.project, env=self.template.credentials.env())
        ignored = [line for line in (r.stdout + r.stderr).splitlines() if "Ignoring unsupported" in line]
        if ignored:
            _log("; ".join(ignored))

    def tasks(self) -> list[Task]:
        return self.engine.stack_tasks(self.project)

    def service_logs(self, service: str, tail: int | None = None) -> str:
        try:
            return self.engine.service_logs(f"{self.project}_{service}", tail)
        except BackendError as e:  # the log is wanted for a report: say why it is missing instead
            return f"({e})"

    def _wait_running(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        want = set(self.lay["hosts"]) | {"wan"}
        deadline = time.monotonic() + timeout
        superseded: set[str] = set()
        retries: dict[str, int] = {}
        while not self._cancel.is_set():
            tasks = self.tasks()
            bad = task_problem(tasks, superseded)
            if bad is not None and engine_start_failure(bad) and retries.get(bad.service, 0) < START_RETRIES:
                # Swarm would retry on its own, but the stack's restart policy is `none` so that a
                # node killed mid-run stays dead; a container that never started is retried here.
                retries[bad.service] = retries.get(bad.service, 0) + 1
                superseded.add(bad.id)
                _log(f"service {bad.service}: {bad.error}; starting it again ({retries[bad.service]}/{START_RETRIES})")
                self.engine.force_update(f"{self.project}_{bad.service}")
                continue
            if bad is not None or time.monotonic() > deadline:
                if bad is None:
                    up = {t.service for t in tasks if t.state == "running"}
                    svc = sorted(want - up)[0]
                    bad = next((t for t in tasks if t.service == svc), Task(svc, "missing", "", "", ""))
                how = (
                    f"{bad.state}" + (f" ({bad.error})" if bad.error else "") + (f" on {bad.node}" if bad.node else "")
                )
                hint = ""
                if "no suitable node" in bad.error:
                    hint = (
                        "\n(no node satisfies its placement: "
                        f"label the nodes with {DC_LABEL}<dc>=true, {WAN_LABEL}=true)"
                    )
                elif "No such image" in bad.error:
                    hint = "\n(the image is missing on that node: docker save IMAGE | ssh NODE docker load)"
                raise BackendError(
                    f"service {bad.service} {how}; last log lines:\n"
                    f"{self.service_logs(bad.service, 15) or '(none)'}{hint}"
                )
            if all_running(tasks, want):
                self.placement = {t.service: t.node for t in tasks if t.state == "running"}
                self.nodes = {
                    n["hostname"]: {
                        "id": n["id"],
                        "address": n.get("address", ""),
                        "state": n.get("state", ""),
                        "labels": {k: v for k, v in n["labels"].items() if k.startswith("prfaas.")},
                    }
                    for n in self.engine.nodes()
                    if n["hostname"] in set(self.placement.values())
                }
                return
            time.sleep(1.0)

    def _start_client(self) -> None:
        """A container on the home DC's network whose namespace the replayer runs in."""
        from pyroute2 import netns  # type: ignore[import-untyped]

        from testbed.deploy.image import IMAGE
        from testbed.net.nsthread import run_in_netns
        from testbed.net.routes import add_routes

        home = self.lay["home"]
        c = self.engine.run(
            IMAGE,
            self._client_name,
            ["infinity"],
            entrypoint=["sleep"],
            labels={PROJECT_LABEL: self.project},
            network=f"{self.project}_dc-{home}",
        )
        pid = host_pid(c.id, c.pid)
        # Its DNS answers for the home network: the WAN router's address there.
        code, out = self.engine.exec(self._client_name, ["getent", "hosts", "wan"])
        got = out.split() if code == 0 else []
        if not got:
            raise BackendError(
                f"the client container cannot resolve the WAN router (`wan`): getent exit {code}"
                + (f", {out.strip()}" if out.strip() else "")
            )
        self._wan_ip = got[0]
        netns.attach(self._client_name, pid)
        self._netns_attached = True
        others = [f"{subnet}={self._wan_ip}" for dc, (_, subnet) in self.lay["dcs"].items() if dc != home]
        run_in_netns(self._client_name, add_routes, others)
        self._client = NetnsLoop(self._client_name).start()

    async def _discover(self) -> None:
        assert self._client is not None
        base = f"http://{self._wan_ip}:{HTTP_PORT}"
        status, view = await _on(self._client, _get_json(base + ADDRESSES))
        if status != 200:
            raise BackendError(f"the WAN router's registry is incomplete: {view}")
        _, info = await _on(self._client, _get_json(base + "/testbed/info"))
        self._hosts = dict(view["hosts"])
        self.deployment = with_hosts(self.template, self._hosts)
        self.method = str(info["method"])
        _log(
            f"{self.project}: {len(self.placement)} services running on "
            f"{', '.join(sorted(set(self.placement.values())))}; shaping {self.method}, MTU {info['mtu']}"
        )

    # -- during the run ---------------------------------------------------------------------
    async def on_t0(self, t0: float) -> None:
        assert self._client is not None
        await _on(
            self._client,
            _post_json(
                f"http://{self._wan_ip}:{HTTP_PORT}/testbed/monitor", {"t0": t0, "interval": MONITOR_INTERVAL_S}
            ),
        )

    async def run_client(self, make: Callable[[], Awaitable[T]]) -> T:
        if self._client is None:
            raise BackendError("the client container is not up")
        return await self._client.run_from(make)

    async def host_url(self) -> str:
        """A port on this host's loopback whose connections are made from the client container's
        namespace, on the home DC's overlay: the router is reachable so wherever it runs, with
        nothing published on any node's interfaces (dnsrr services cannot use the ingress mesh)."""
        if self._forwarder is None:
            r = self.deployment.router
            fwd = NetnsForwarder(self._client_name, (r.host, r.port), ("127.0.0.1", self._host_port))
            await fwd.start()
            self._forwarder = fwd
        host, port = self._forwarder.address
        return f"http://{host}:{port}"

    # -- stop -------------------------------------------------------------------------------
    async def _collect(self) -> None:
        """The WAN router's counters stop; every service's files come here, from those that answer."""
        wan = f"http://{self._wan_ip}:{HTTP_PORT}"
        targets = {
            sid: url
            for sid, url in {"wan": wan, **{sid: f"http://{ip}:{HTTP_PORT}" for sid, ip in self._hosts.items()}}.items()
            if sid not in self.lost
        }
        # A node lost a moment ago may still be "ready" to the manager: a service that does not
        # answer now would only hold the collection up to its timeout.
        probes = await asyncio.gather(
            *(_answers(url + "/health", PROBE_TIMEOUT_S) for url in targets.values()), return_exceptions=True
        )
        for sid, probe in zip(list(targets), probes):
            if isinstance(probe, BaseException):
                why = f"{type(probe).__name__}: {probe}" if str(probe) else type(probe).__name__
                self.lost[sid] = f"no answer at the end ({why}); its node {self.placement.get(sid, '?')}"
                _log(f"{sid} unreachable: {self.lost[sid]}")
                del targets[sid]
        try:
            if "wan" in targets:
                await _post_json(wan + "/testbed/monitor/stop", {})
        except Exception as e:
            _log(f"stopping the WAN router's monitor failed: {e}")
        secret = self.deployment.credentials.runner_headers()
        results = await asyncio.gather(
            *(pull_files(url, self.run_dir, headers=secret) for url in targets.values()), return_exceptions=True
        )
        for sid, res in zip(targets, results):
            if isinstance(res, BaseException):
                _log(f"could not collect the files of {sid}: {res!r}")

    def _save_logs(self) -> None:
        services = sorted(set(self.lay["hosts"]) | {"wan"})
        (self.run_dir / "logs").mkdir(exist_ok=True)
        reachable = [s for s in services if s not in self.lost]
        with ThreadPoolExecutor(4) as pool:
            for svc, text in zip(reachable, pool.map(self.service_logs, reachable)):
                (self.run_dir / "logs" / f"{svc}.log").write_text(text)
        for svc in services:
            if svc in self.lost:  # the manager would wait for a log the node cannot send
                (self.run_dir / "logs" / f"{svc}.log").write_text(f"(no log: {self.lost[svc]})\n")

    def _check_nodes(self) -> None:
        """Which services sit on nodes that are no longer ready, before anything asks them."""
        if not self.placement:
            return
        try:
            nodes = self.engine.nodes()
        except BackendError as e:
            _log(f"listing the nodes failed: {e}")
            return
        self.nodes_at_end = {n["hostname"]: n.get("state", "") for n in nodes if n["hostname"] in self.nodes}
        self.lost = lost_services(self.placement, nodes)
        if self.lost:
            _log("unreachable at the end: " + "; ".join(f"{s} ({why})" for s, why in self.lost.items()))

    def _remove_client(self) -> None:
        from pyroute2 import netns

        if self._client is not None:
            self._client.close()
            self._client = None
        if self._netns_attached:
            netns.remove(self._client_name)
            self._netns_attached = False
        engine = self._engine or try_connect()
        if engine is not None:
            try:
                engine.remove_container(self._client_name)
            except BackendError as e:  # the label sweep that follows tries again
                _log(str(e))

    def _remove_stack(self) -> dict[str, list[str]]:
        with self._deploying:
            engine = self._engine or try_connect()
            if engine is None:
                return {}
            try:
                tasks = engine.task_nodes(self.project)
            except BackendError as e:
                _log(str(e))
                tasks = {}
            left = remove_swarm_project(engine, self.project)
            self._wait_tasks_gone(engine, tasks)
            return left

    def _wait_tasks_gone(self, engine: Engine, tasks: dict[str, str], timeout: float = TASKS_GONE_S) -> None:
        """Until the nodes have stopped the stack's containers: the manager removes services at
        once, other nodes their containers within the grace period. Tasks on a node that is not
        ready cannot go (nothing runs there to stop them): not waited for."""
        deadline = time.monotonic() + timeout
        while tasks:
            try:
                present = engine.task_nodes()
                ready = {n["id"] for n in engine.nodes() if n.get("state") == "ready"}
            except BackendError as e:
                _log(str(e))
                return
            waiting = [t for t in tasks if t in present and tasks[t] in ready]
            if not waiting:
                return
            if time.monotonic() > deadline:
                _log(f"{len(waiting)} tasks of {self.project} still stopping after {timeout:g} s")
                return
            time.sleep(0.5)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._cancel.set()
        if self._forwarder is not None:
            await self._forwarder.close()
        if self._deployed:
            await asyncio.to_thread(self._check_nodes)
        if self._client is not None and self._wan_ip:
            try:
                await asyncio.wait_for(_on(self._client, self._collect()), COLLECT_TIMEOUT_S)
            except Exception as e:
                _log(f"collecting files failed: {e!r}")
        if self._deployed:
            await asyncio.to_thread(self._save_logs)
        await asyncio.to_thread(self._remove_client)
        left = await asyncio.to_thread(self._remove_stack)
        owners.release(self.project)
        if any(left.values()):
            _log(f"{self.project} removed: " + ", ".join(f"{len(v)} {k}" for k, v in left.items() if v))
