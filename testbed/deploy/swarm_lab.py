"""A swarm of several Docker engines on one machine, for the swarm backend: Docker-in-Docker nodes.

    python -m testbed.deploy.swarm_lab up --scenario paper-prfaas     # prints DOCKER_HOST=...
    DOCKER_HOST=unix:///run/prfaas-testbed/lab/NAME/dc-local/docker.sock testbed up --backend swarm ...
    python -m testbed.deploy.swarm_lab down [NAME]                    # or: testbed down
    python -m testbed.deploy.swarm_lab run --scenario paper-prfaas -- --requests 12 ...   # all three

Each node is a container of `compose/node.Dockerfile` (the project's debootstrap base plus Debian's
`docker.io`, built once and kept under a tag of its content hash) running its own dockerd, with
/var/lib/docker on a volume of its own (overlay2 needs a real file system under it), on a bridge
network of the lab's. One node per datacenter of the scenario (the home datacenter's first: it is
the swarm manager, where the testbed's client container runs) and one for the WAN router, each
labelled for its role only, so every datacenter's services land on an engine of their own and the
KV of a remote prefill crosses from one engine to another through the WAN router's. The project
image goes into every node by `docker save | docker load`. The host's testbed drives the manager
through its socket, bound out of the node into `LAB_DIR/NAME/<node>/docker.sock`; the replayer
still runs on this host, in the client container's network namespace (found by its cgroup,
`testbed.deploy.swarm.host_pid`), and writes the run directory here.

Nodes get every capability but CAP_SYS_RESOURCE instead of `--privileged` (see
compose/node-entrypoint.sh). Everything the lab creates carries the project label with the lab's
name, so `down`, an interrupted `up` and `testbed down` remove it all; the host engine's own swarm
state is never touched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import docker

from testbed.core.json_types import JSONObject
from testbed.core.schema.scenario import Scenario
from testbed.core.schema.topology import local_dc
from testbed.deploy.base import BackendError
from testbed.deploy.cleanup import LAB_DIR, remove_compose_project, remove_lab_dirs
from testbed.deploy.engine import PROJECT_LABEL, Engine, connect, engine_errors
from testbed.deploy.image import BASE, IMAGE, REPO_ROOT, SOURCE_LABEL, ensure_image
from testbed.deploy.swarm_stack import WAN_LABEL, dc_label

NODE_REPO = "prfaas-testbed-node"
NODE_HASH_LABEL = "io.prfaas-testbed.node-hash"
NODE_FILES = ("compose/node.Dockerfile", "compose/node-entrypoint.sh")
SOCKET_IN_NODE = "/run/lab"
# VXLAN adds 50 bytes to the overlay's 65000: a bridge this wide carries them unfragmented.
LAB_MTU = 65535
READY_TIMEOUT_S = 90.0
Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"swarm-lab: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class NodePlan:
    role: str  # a datacenter's name, or "wan"
    labels: dict[str, str]


@dataclass(frozen=True)
class LabNode:
    name: str  # container name, hostname and swarm node hostname
    role: str
    labels: dict[str, str]
    socket: str  # this host's path of the node engine's socket
    address: str = ""  # on the lab's network
    node_id: str = ""  # in the swarm


@dataclass(frozen=True)
class Lab:
    name: str
    nodes: tuple[LabNode, ...]

    @property
    def manager(self) -> LabNode:
        return self.nodes[0]

    @property
    def docker_host(self) -> str:
        return f"unix://{self.manager.socket}"

    def to_dict(self) -> JSONObject:
        return {"name": self.name, "docker_host": self.docker_host, "nodes": [asdict(n) for n in self.nodes]}


def plan_nodes(sc: Scenario) -> list[NodePlan]:
    """One node per datacenter, the home one first (the manager), then one for the WAN router:
    each carries only its own label, so the scheduler has one choice per service (pure)."""
    home = local_dc(sc)
    dcs = [home] + [dc for dc in dict.fromkeys(c.datacenter for c in sc.clusters) if dc != home]
    return [NodePlan(dc, {dc_label(dc): "true"}) for dc in dcs] + [NodePlan("wan", {WAN_LABEL: "true"})]


def node_hash(root: Path = REPO_ROOT, base_id: str = "") -> str:
    """SHA-256 over the node image's files and the base image's id: a change of either rebuilds it."""
    h = hashlib.sha256(base_id.encode() + b"\0")
    for rel in NODE_FILES:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes())
    return h.hexdigest()


def ensure_node_image(engine: Engine, log: Log = _stderr) -> str:
    """The node image, built (after the project image and its base) when its tag is missing."""
    ensure_image(log=log, engine=engine)
    with engine_errors(f"inspecting image {BASE}"):
        base_id = str(engine.client.images.get(BASE).id)
    h = node_hash(base_id=base_id)
    tag = f"{NODE_REPO}:{h[:12]}"
    if engine.image_labels(tag) is not None:
        log(f"node image {tag} is up to date")
        return tag
    t0 = time.monotonic()
    log(f"building {tag} (Debian's docker.io on {BASE}) ...")
    with tempfile.TemporaryDirectory(prefix="prfaas-node-") as ctx:  # only the two files, not compose/wheels
        for rel in NODE_FILES:
            shutil.copy2(REPO_ROOT / rel, Path(ctx) / Path(rel).name)
        for line in engine.build(Path(ctx), "node.Dockerfile", tag, {"BASE_IMAGE": BASE, "NODE_HASH": h}, False):
            if line.strip():
                log(line)
    log(f"built {tag} in {time.monotonic() - t0:.1f} s")
    with engine_errors(f"listing the {NODE_REPO} images"):
        stale = [t for i in engine.client.images.list(NODE_REPO) for t in i.tags if t != tag]
    for old in stale:  # the one before this build; a node still running it keeps it
        try:
            with engine_errors(f"removing {old}"):
                engine.client.images.remove(old)
        except BackendError as e:
            log(f"keeping {old}: {e}")
    return tag


def _node_client(socket: str, timeout: int = 300) -> docker.DockerClient:
    return docker.DockerClient(base_url=f"unix://{socket}", timeout=timeout)


def _wait_engine(socket: str, container: Any, timeout: float = READY_TIMEOUT_S) -> docker.DockerClient:
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(socket):
            try:
                client = _node_client(socket)
                client.ping()
                return client
            except Exception:  # noqa: BLE001 - not answering yet
                pass
        container.reload()
        if container.status != "running" or time.monotonic() > deadline:
            tail = container.logs(tail=15).decode(errors="replace")
            raise BackendError(
                f"the engine of node {container.name} did not come up ({container.status}); last log lines:\n{tail}"
            )
        time.sleep(0.5)


def _start_node(host: Engine, lab: str, image: str, plan: NodePlan) -> tuple[LabNode, docker.DockerClient]:
    name = f"{lab}-{plan.role}"
    sock_dir = LAB_DIR / lab / plan.role
    sock_dir.mkdir(parents=True, exist_ok=True)
    labels = {PROJECT_LABEL: lab}
    with engine_errors(f"starting lab node {name}"):
        host.client.volumes.create(f"{name}-docker", labels=labels)
        c = host.client.containers.run(
            image,
            [
                "--host",
                f"unix://{SOCKET_IN_NODE}/docker.sock",
                "--host",
                "unix:///var/run/docker.sock",
                "--storage-driver",
                "overlay2",
            ],
            name=name,
            hostname=name,
            labels=labels,
            network=f"{lab}-net",
            detach=True,
            init=True,
            cap_add=["ALL"],
            cap_drop=["SYS_RESOURCE"],
            cgroupns="private",
            security_opt=["seccomp=unconfined", "apparmor=unconfined"],
            device_cgroup_rules=["c *:* rmw", "b *:* rmw"],
            volumes={
                f"{name}-docker": {"bind": "/var/lib/docker", "mode": "rw"},
                str(sock_dir): {"bind": SOCKET_IN_NODE, "mode": "rw"},
            },
        )
        client = _wait_engine(str(sock_dir / "docker.sock"), c)
        c.reload()
        addr = str(c.attrs["NetworkSettings"]["Networks"][f"{lab}-net"]["IPAddress"])
    return LabNode(name, plan.role, plan.labels, str(sock_dir / "docker.sock"), addr), client


def _load_image(archive: Path, node: LabNode, client: docker.DockerClient, want: str) -> None:
    with engine_errors(f"loading {IMAGE} into node {node.name}"), archive.open("rb") as f:
        client.images.load(f)
        got = client.images.get(IMAGE).labels.get(SOURCE_LABEL)
    if got != want:
        raise BackendError(f"node {node.name}: {IMAGE} carries sources {got!r}, expected {want!r}")


def up(sc: Scenario, log: Log = _stderr, host: Engine | None = None) -> Lab:
    """Start the lab for the scenario's datacenters; on any failure (or Ctrl-C) remove what it made."""
    from testbed.net.topology import new_prefix

    host = host or connect()
    image = ensure_node_image(host, log)
    want = (host.image_labels(IMAGE) or {}).get(SOURCE_LABEL, "")
    name = new_prefix()
    t0 = time.monotonic()
    plans = plan_nodes(sc)
    try:
        with engine_errors(f"creating network {name}-net"):
            host.client.networks.create(
                f"{name}-net",
                driver="bridge",
                labels={PROJECT_LABEL: name},
                options={"com.docker.network.driver.mtu": str(LAB_MTU)},
            )
        with ThreadPoolExecutor(len(plans)) as pool:
            started = list(pool.map(lambda p: _start_node(host, name, image, p), plans))
        log(f"{name}: {len(started)} engines up in {time.monotonic() - t0:.1f} s")
        archive = LAB_DIR / name / "image.tar"
        t1 = time.monotonic()
        with engine_errors(f"saving {IMAGE}"), archive.open("wb") as f:
            for chunk in host.client.images.get(IMAGE).save(named=True):
                f.write(chunk)
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(lambda nc: _load_image(archive, nc[0], nc[1], want), started))
        archive.unlink()
        log(f"{name}: {IMAGE} loaded into every node in {time.monotonic() - t1:.1f} s")
        nodes = _form_swarm(started)
        lab = Lab(name, tuple(nodes))
        (LAB_DIR / name / "lab.json").write_text(json.dumps(lab.to_dict(), indent=1))
        log(
            f"{name}: swarm of {len(nodes)} ready in {time.monotonic() - t0:.1f} s: "
            + ", ".join(f"{n.name} ({', '.join(n.labels)})" for n in nodes)
        )
        return lab
    except BaseException as e:
        removed = down(name, host, log)
        log(
            f"{name}: {'interrupted' if isinstance(e, KeyboardInterrupt) else 'failed'}; removed "
            + ", ".join(f"{len(v)} {k}" for k, v in removed.items() if v)
        )
        raise


def _form_swarm(started: list[tuple[LabNode, docker.DockerClient]]) -> list[LabNode]:
    (first, mgr), workers = started[0], started[1:]
    with engine_errors(f"swarm init on {first.name}"):
        mgr.swarm.init(advertise_addr=first.address, listen_addr=f"{first.address}:2377")
        mgr.swarm.reload()
        token = str(mgr.swarm.attrs["JoinTokens"]["Worker"])
    for node, client in workers:
        with engine_errors(f"swarm join of {node.name}"):
            client.swarm.join(
                remote_addrs=[f"{first.address}:2377"],
                join_token=token,
                advertise_addr=node.address,
                listen_addr=f"{node.address}:2377",
            )
    manager = Engine(mgr)
    out = []
    for node, client in started:
        node_id = str(client.info()["Swarm"]["NodeID"])
        manager.add_node_labels(node_id, node.labels)
        out.append(LabNode(node.name, node.role, node.labels, node.socket, node.address, node_id))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        with engine_errors("listing the lab's swarm nodes"):
            ready = {str(n["ID"]) for n in mgr.api.nodes() if (n.get("Status") or {}).get("State") == "ready"}
        if {n.node_id for n in out} <= ready:
            return out
        if time.monotonic() > deadline:
            raise BackendError(
                f"swarm nodes not ready after {READY_TIMEOUT_S:g} s: "
                + ", ".join(n.name for n in out if n.node_id not in ready)
            )
        time.sleep(0.5)


def down(name: str, host: Engine | None = None, log: Log = _stderr) -> dict[str, list[str]]:
    """Remove the lab's node containers (their engines and every container inside go with them),
    volumes and network, and its folder. Idempotent."""
    host = host or connect()
    removed = remove_compose_project(host, name, warn=log)
    removed["folders"] = remove_lab_dirs(name)
    return removed


def labs() -> list[str]:
    return sorted(d.name for d in LAB_DIR.glob("ptb*") if (d / "lab.json").is_file()) if LAB_DIR.is_dir() else []


# -- command line ---------------------------------------------------------------------------------


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _run(lab: Lab, up_args: Sequence[str], scenario: str) -> int:
    """`testbed up --backend swarm` on the lab's manager; SIGTERM to this process is passed on."""
    env = {**os.environ, "DOCKER_HOST": lab.docker_host}
    argv = [sys.executable, "-m", "testbed", "up", "--backend", "swarm", "--scenario", scenario, *up_args]
    proc = subprocess.Popen(argv, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the child from the terminal; SIGTERM came to this process only.
        proc.send_signal(signal.SIGINT)
        return proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    from testbed.config.scenarios import load_scenario

    p = argparse.ArgumentParser(
        prog="python -m testbed.deploy.swarm_lab",
        description="A swarm of Docker-in-Docker engines on this machine, one per "
        "datacenter of the scenario plus one for the WAN router.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start a lab and print its DOCKER_HOST (the manager's socket)")
    u.add_argument("--scenario", default="paper-prfaas")
    u.add_argument("--json", action="store_true", help="print the lab's description as JSON")
    d = sub.add_parser("down", help="remove a lab (every lab without a name)")
    d.add_argument("name", nargs="?")
    r = sub.add_parser("run", help="up, `testbed up --backend swarm` on it with the arguments after --, down")
    r.add_argument("--scenario", default="paper-prfaas")
    r.add_argument("up_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print(
            f"error: the lab runs Docker engines in containers and binds their sockets under {LAB_DIR} (root)",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.cmd == "down":
            for name in [args.name] if args.name else labs():
                removed = down(name)
                _stderr(f"{name}: removed " + ", ".join(f"{len(v)} {k}" for k, v in removed.items() if v))
            return 0
        lab = up(load_scenario(args.scenario))
        if args.cmd == "up":
            print(json.dumps(lab.to_dict(), indent=1) if args.json else f"DOCKER_HOST={lab.docker_host}")
            return 0
        try:
            rest = [a for a in args.up_args if a != "--"]
            return _run(lab, rest, args.scenario)
        finally:
            down(lab.name)
            _stderr(f"{lab.name}: removed")
    except BackendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
