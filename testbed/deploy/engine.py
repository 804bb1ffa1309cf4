"""The Docker engine through its API (the `docker` SDK): the calls the container backends, the
image build and the cleanup make, with the engine's structured answers rather than CLI text.

Every engine error comes out as a `BackendError` that names the object it concerned and gives
the engine's own reason; a container that fails to start also brings its last log lines.
`Engine` takes the client object, so tests give it a fake at this seam.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict, get_args

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound

from testbed.core.schema.kinds import unknown_kind
from testbed.deploy.base import BackendError

PROJECT_LABEL = "prfaas-testbed.project"  # on every object a run creates
COMPOSE_PROJECT = "com.docker.compose.project"  # set by compose on its containers
COMPOSE_SERVICE = "com.docker.compose.service"
STACK_NAMESPACE = "com.docker.stack.namespace"  # set by `docker stack deploy` on its objects
API_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 3600  # a build's output may pause for minutes (a step with no output)
LOG_TAIL = 15
# What a label sweep removes, in the order that frees what the next kind needs: services own
# containers, containers hold volumes and networks.
ContainerAction = Literal["kill", "pause", "unpause", "start"]
SWEEP_KINDS = ("services", "containers", "volumes", "networks", "configs")


def reason(e: BaseException) -> str:
    """The engine's own words for an error (its message, not the HTTP wrapper's)."""
    if isinstance(e, APIError):
        return str(e.explanation or e)
    if isinstance(e, requests.exceptions.ConnectionError):
        return f"the Docker engine is not reachable ({e})"
    if isinstance(e, requests.exceptions.Timeout):
        return f"the Docker engine did not answer in time ({e})"
    return str(e) or type(e).__name__


@contextmanager
def engine_errors(what: str) -> Iterator[None]:
    """Turn the engine's errors inside into BackendError("what: reason")."""
    try:
        yield
    except (DockerException, requests.exceptions.RequestException) as e:
        raise BackendError(f"{what}: {reason(e)}") from e


def connect(timeout: int = API_TIMEOUT_S) -> Engine:
    """The engine the environment names (DOCKER_HOST, the CLI's context, else the local socket)."""
    try:
        return Engine(docker.from_env(timeout=timeout))
    except (DockerException, requests.exceptions.RequestException) as e:
        # The SDK's words ("Error while fetching server API version: ('Connection aborted.', ...)")
        # say neither where it looked nor what to do.
        where = os.environ.get("DOCKER_HOST") or "the local socket (/var/run/docker.sock)"
        if _denied(e):
            # The engine runs; this user may not talk to it (not root, not in the socket's group).
            raise BackendError(
                f"this user may not use the Docker engine at {where} (permission denied): run as "
                "root or as a member of the group that owns the socket (usually docker)"
            ) from e
        raise BackendError(
            f"no Docker engine answers at {where}: start the Docker daemon or point DOCKER_HOST at "
            f"one that runs ({reason(e)})"
        ) from e


def _denied(e: BaseException) -> bool:
    """Whether a PermissionError lies under `e`: in its cause or context, or among its arguments
    (the SDK wraps the socket's error in urllib3's and requests' as an argument, not a cause)."""
    seen: set[int] = set()
    todo: list[object] = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen or not isinstance(x, BaseException):
            continue
        seen.add(id(x))
        if isinstance(x, PermissionError):
            return True
        todo += [x.__cause__, x.__context__, *x.args]
    return False


def try_connect(timeout: int = API_TIMEOUT_S) -> Engine | None:
    """connect(), or None where there is no engine to reach (not installed, not running)."""
    try:
        return connect(timeout)
    except BackendError:
        return None


# What the code reads of the engine's task documents (untyped in the SDK); any may be missing.
class _TaskStatusDoc(TypedDict, total=False):
    State: str
    Err: str | None


class TaskDoc(TypedDict, total=False):
    """A task document (GET /tasks)."""

    ID: str
    ServiceID: str
    NodeID: str
    DesiredState: str
    Status: _TaskStatusDoc | None


@dataclass(frozen=True)
class ContainerState:
    id: str
    name: str
    status: str  # created, running, exited, dead, ...
    health: str  # starting, healthy, unhealthy; "" without a health check
    pid: int
    exit_code: int
    error: str  # the engine's reason a start failed ("" if none)
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> ContainerState:
        """From the engine's container inspect document."""
        st = attrs.get("State") or {}
        return cls(
            str(attrs.get("Id", "")),
            str(attrs.get("Name", "")).lstrip("/"),
            str(st.get("Status", "")),
            str((st.get("Health") or {}).get("Status", "")),
            int(st.get("Pid") or 0),
            int(st.get("ExitCode") or 0),
            str(st.get("Error") or ""),
            dict((attrs.get("Config") or {}).get("Labels") or {}),
        )

    @property
    def ended(self) -> bool:
        return self.status in ("exited", "dead")

    def describe(self) -> str:
        """How it ended, for an error message: status, exit code, the engine's reason."""
        if not self.ended:
            return self.status
        return f"{self.status} (code {self.exit_code})" + (f": {self.error}" if self.error else "")


class SwarmNode(TypedDict):
    """A swarm node as `Engine.nodes` reads it."""

    id: str
    hostname: str
    labels: dict[str, str]
    state: str  # ready, down, ...
    address: str


@dataclass(frozen=True)
class Task:
    """A swarm task, as `docker stack ps` shows it."""

    service: str  # the stack's service name (without the stack prefix)
    state: str  # current state, lower case: new, pending, ..., starting, running, failed, ...
    desired: str
    error: str
    node: str  # the node's hostname ("" before the task is assigned)
    id: str = ""


def parse_tasks(
    tasks: list[TaskDoc], service_names: dict[str, str], node_names: dict[str, str], namespace: str
) -> list[Task]:
    """The engine's task documents (GET /tasks) -> tasks; services and nodes named by their ids."""
    out = []
    for t in tasks:
        name = service_names.get(str(t.get("ServiceID", "")), "").removeprefix(namespace + "_")
        status: _TaskStatusDoc = t.get("Status") or {}
        out.append(
            Task(
                name,
                str(status.get("State", "")).lower(),
                str(t.get("DesiredState", "")).lower(),
                str(status.get("Err") or ""),
                node_names.get(str(t.get("NodeID", "")), ""),
                str(t.get("ID", "")),
            )
        )
    return out


def _labels(obj: Any) -> dict[str, str]:
    """An engine object's labels from its document, where each kind keeps them (a sparse
    container, a network, a volume: `Labels`; a service, a config: `Spec.Labels`)."""
    attrs = getattr(obj, "attrs", None) or {}
    for path in (("Labels",), ("Spec", "Labels"), ("Config", "Labels")):
        d: Any = attrs
        for k in path:
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, dict):
            return d
    return {}


@dataclass
class Sweep:
    """What a label sweep found (ids; names for volumes), and why any of them could not go."""

    found: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class Engine:
    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client

    def version(self) -> str:
        with engine_errors("asking the Docker engine for its version"):
            return str(self.client.version()["Version"])

    # -- images -------------------------------------------------------------------------------
    def image_labels(self, name: str) -> dict[str, str] | None:
        """The image's labels ({} when it has none), or None when there is no such image."""
        with engine_errors(f"inspecting image {name}"):
            try:
                image = self.client.images.get(name)
            except ImageNotFound:
                return None
            return {str(k): str(v) for k, v in image.labels.items()}

    def build(self, path: Path, dockerfile: str, tag: str, buildargs: dict[str, str], nocache: bool) -> Iterator[str]:
        """Build as `docker build` does (the context filtered by its .dockerignore, intermediate
        containers removed), yielding each line of output as it comes; BackendError with the
        engine's message when a step fails. (The low-level call: `images.build` returns only once
        the build has ended.)"""
        what = f"building image {tag}"
        with engine_errors(what):
            stream = self.client.api.build(
                path=str(path),
                dockerfile=dockerfile,
                tag=tag,
                buildargs=buildargs,
                nocache=nocache,
                rm=True,
                decode=True,
                timeout=BUILD_TIMEOUT_S,
            )
            pending = ""
            for chunk in stream:
                if "error" in chunk:
                    if pending:
                        yield pending
                    raise BackendError(f"{what}: {str(chunk['error']).strip()}")
                text = chunk.get("stream")
                if text is None and "status" in chunk:  # pulling a base image
                    text = f"{chunk['status']} {chunk.get('progress') or chunk.get('id') or ''}".rstrip() + "\n"
                if text:
                    # Output arrives in chunks that need not end at a line's end.
                    *lines, pending = (pending + str(text)).split("\n")
                    yield from lines
            if pending:
                yield pending

    def prune_images(self, label: str) -> None:
        """Remove the dangling images carrying label (`key` or `key=value`)."""
        with engine_errors(f"pruning dangling images labelled {label}"):
            self.client.images.prune(filters={"label": label, "dangling": True})

    # -- containers -----------------------------------------------------------------------------
    def containers(self, label: str) -> list[ContainerState]:
        """Every container (running or not) carrying label, as inspected now."""
        with engine_errors(f"listing containers labelled {label}"):
            return [
                ContainerState.from_attrs(c.attrs)
                for c in self.client.containers.list(all=True, filters={"label": label}, ignore_removed=True)
            ]

    def container(self, name: str) -> ContainerState | None:
        """The container's state by id or name, None when there is none."""
        with engine_errors(f"inspecting container {name}"):
            try:
                return ContainerState.from_attrs(self.client.containers.get(name).attrs)
            except NotFound:
                return None

    def signal(self, name: str, action: ContainerAction) -> None:
        """`kill` (SIGKILL), `pause`, `unpause` or `start` a container, for fault injection."""
        with engine_errors(f"{action} of container {name}"):
            c = self.client.containers.get(name)
            match action:
                case "kill":
                    c.kill(signal="SIGKILL")
                case "pause" | "unpause" | "start":
                    getattr(c, action)()
                case _:
                    unknown_kind("container action", action, get_args(ContainerAction))

    def logs(self, name: str, tail: int = LOG_TAIL) -> str:
        """Its last log lines, both streams as they came; "(no container)" when it is gone."""
        with engine_errors(f"reading the log of container {name}"):
            try:
                data = self.client.containers.get(name).logs(stdout=True, stderr=True, tail=tail)
            except NotFound:
                return "(no container)"
        return data.decode(errors="replace")

    def run(
        self, image: str, name: str, command: list[str], *, entrypoint: list[str], labels: dict[str, str], network: str
    ) -> ContainerState:
        """Create and start a detached container; BackendError naming it (with its last log lines
        if it was created but would not start)."""
        with engine_errors(f"creating container {name}"):
            c = self.client.containers.create(
                image, command, name=name, entrypoint=entrypoint, labels=labels, network=network, detach=True
            )
        try:
            with engine_errors(f"starting container {name}"):
                c.start()
                c.reload()
                return ContainerState.from_attrs(c.attrs)
        except BackendError as e:
            raise BackendError(f"{e}; last log lines:\n{self.logs(name)}") from e

    def exec(self, name: str, argv: list[str]) -> tuple[int, str]:
        """Run argv in the running container; (exit code, output of both streams)."""
        with engine_errors(f"running {argv[0]} in container {name}"):
            code, out = self.client.containers.get(name).exec_run(argv)
        text = out.decode(errors="replace") if isinstance(out, bytes) else b"".join(out).decode(errors="replace")
        return (code if code is not None else -1), text

    def remove_container(self, name: str) -> bool:
        """Remove it, running or not, with its anonymous volumes; False when there was none."""
        with engine_errors(f"removing container {name}"):
            try:
                self.client.containers.get(name).remove(force=True, v=True)
            except NotFound:
                return False
        return True

    # -- networks ------------------------------------------------------------------------------
    def network_ipam(self) -> list[dict[str, object]]:
        """The IPAM config entries ({"Subnet": ..., ...}) of every network the engine has."""
        with engine_errors("listing the Docker engine's networks"):
            nets = self.client.networks.list()
        return [cfg for n in nets for cfg in ((n.attrs.get("IPAM") or {}).get("Config") or [])]

    # -- label sweeps -------------------------------------------------------------------------
    def _labelled(self, kind: str, filters: dict[str, str | list[str] | bool]) -> list[Any]:
        c = self.client
        if kind == "containers":
            return list(c.containers.list(all=True, filters=filters, sparse=True))
        if kind == "networks":
            return list(c.networks.list(filters=filters))
        if kind == "volumes":
            return list(c.volumes.list(filters=filters))
        if kind == "services":
            return list(c.services.list(filters=filters))
        if kind == "configs":
            return list(c.configs.list(filters=filters))
        raise ValueError(f"unknown kind {kind!r} (one of {', '.join(SWEEP_KINDS)})")

    def sweep(self, kind: str, label: str, driver: str | None = None, spare: Collection[str] = ()) -> Sweep:
        """Remove every object of kind carrying label (`key` or `key=value`; networks also of
        driver): containers forced, with their anonymous volumes. An object that will not go (a
        network whose containers are still stopping) is named in `failed`; the next sweep finds it
        again. Listing failures raise. Objects of the projects in `spare` (live runs) stay."""
        filters: dict[str, str | list[str] | bool] = {"label": label, **({"driver": driver} if driver else {})}
        with engine_errors(f"listing {kind} labelled {label}"):
            objs = self._labelled(kind, filters)
        out = Sweep()
        for obj in objs:
            if spare and _labels(obj).get(PROJECT_LABEL) in spare:
                continue
            key = str(obj.name if kind == "volumes" else obj.short_id)
            out.found.append(key)
            try:
                if kind == "containers":
                    obj.remove(force=True, v=True)
                elif kind == "volumes":
                    obj.remove(force=True)
                else:
                    obj.remove()
            except NotFound:
                pass  # gone meanwhile
            except (DockerException, requests.exceptions.RequestException) as e:
                out.failed[key] = reason(e)
        return out

    # -- swarm --------------------------------------------------------------------------------
    def swarm_state(self) -> tuple[str, bool]:
        """(LocalNodeState: inactive, active, ...; this node is a manager)."""
        with engine_errors("reading the Docker engine's swarm state"):
            sw = self.client.info().get("Swarm") or {}
        return str(sw.get("LocalNodeState") or "unknown"), bool(sw.get("ControlAvailable"))

    def nodes(self) -> list[SwarmNode]:
        """Every swarm node."""
        with engine_errors("listing the swarm's nodes"):
            raw = self.client.api.nodes()
        return [
            {
                "id": str(n["ID"]),
                "hostname": str((n.get("Description") or {}).get("Hostname", "")),
                "labels": dict((n.get("Spec") or {}).get("Labels") or {}),
                "state": str((n.get("Status") or {}).get("State", "")),
                "address": str((n.get("Status") or {}).get("Addr", "")),
            }
            for n in raw
        ]

    def force_update(self, service: str) -> None:
        """Replace the service's task by a new one (`docker service update --force`)."""
        with engine_errors(f"restarting service {service}"):
            self.client.services.get(service).force_update()

    def add_node_labels(self, node_id: str, labels: dict[str, str]) -> None:
        """Add (or overwrite) labels on a swarm node, keeping the rest of its spec."""
        with engine_errors(f"labelling swarm node {node_id}"):
            node = self.client.api.inspect_node(node_id)
            spec = dict(node["Spec"])
            spec["Labels"] = {**(spec.get("Labels") or {}), **labels}
            self.client.api.update_node(node_id, int(node["Version"]["Index"]), spec)  # type: ignore[arg-type]

    def stack_tasks(self, namespace: str) -> list[Task]:
        """Every task of the stack's services, old ones included, as `docker stack ps` lists them."""
        with engine_errors(f"listing the tasks of stack {namespace}"):
            services = self.client.services.list(filters={"label": f"{STACK_NAMESPACE}={namespace}"})
            if not services:
                return []
            names = {str(s.id): str(s.attrs["Spec"]["Name"]) for s in services}
            raw = self.client.api.tasks(filters={"service": list(names)})
            nodes = {n["id"]: n["hostname"] for n in self.nodes()} if any(t.get("NodeID") for t in raw) else {}
        return parse_tasks(list(raw), names, nodes, namespace)

    def task_nodes(self, namespace: str | None = None) -> dict[str, str]:
        """Task id -> node id of every task in the swarm's store (of the stack's services only,
        with `namespace`). A removed service's tasks stay listed until their node has stopped
        their containers."""
        with engine_errors("listing the swarm's tasks"):
            if namespace is None:
                raw = self.client.api.tasks()
            else:
                services = self.client.services.list(filters={"label": f"{STACK_NAMESPACE}={namespace}"})
                raw = self.client.api.tasks(filters={"service": [str(s.id) for s in services]}) if services else []
        return {str(t["ID"]): str(t.get("NodeID") or "") for t in raw}

    def service_logs(self, name: str, tail: int | None = None) -> str:
        """The log of every task of the service, stamped; "" when there is no such service."""
        with engine_errors(f"reading the log of service {name}"):
            try:
                svc = self.client.services.get(name)
            except NotFound:
                return ""
            chunks = svc.logs(stdout=True, stderr=True, timestamps=True, tail=str(tail) if tail else "all")
            return b"".join(chunks).decode(errors="replace")
