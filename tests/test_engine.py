"""The engine seam (`testbed.deploy.engine`) and the cleanup built on it, against a fake Docker
client: the engine's errors as BackendError naming the object, label sweeps that remove exactly
what carries the label, swarm state read from the engine's documents, and the backends' start
failures reported with the container's or service's last log lines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from docker.errors import APIError, ImageNotFound, NotFound

from testbed.deploy.base import BackendError
from testbed.deploy.cleanup import (
    DOCKER_KINDS,
    DockerLeftovers,
    DownReport,
    project_label,
    remove_compose_project,
    remove_docker_leftovers,
    remove_swarm_project,
)
from testbed.deploy.engine import COMPOSE_PROJECT, COMPOSE_SERVICE, PROJECT_LABEL, ContainerState, Engine, Task
from testbed.deploy.local import BackendError as LocalBackendError
from testbed.net.teardown import NsProcess, TeardownReport

pytestmark = pytest.mark.pure


# -- the fake client --------------------------------------------------------------------------


def _matches(labels: dict[str, str], want: str) -> bool:
    key, _, value = want.partition("=")
    return key in labels and (not value or labels[key] == value)


class FakeObject:
    def __init__(
        self,
        store: FakeCollection,
        oid: str,
        labels: dict[str, str] | None = None,
        *,
        name: str = "",
        driver: str = "bridge",
        attrs: dict[str, Any] | None = None,
        refuse: list[Exception] | None = None,
        log: bytes = b"",
    ) -> None:
        self.store, self.id, self.labels, self.driver = store, oid, dict(labels or {}), driver
        self.name = name or oid
        self.attrs = attrs or {"Id": oid, "Name": "/" + self.name, "Config": {"Labels": self.labels}}
        self.refuse = list(refuse or [])  # errors the next remove() calls raise, in turn
        self.removed_with: dict[str, Any] | None = None
        self.log = log

    @property
    def short_id(self) -> str:
        return self.id[:12]

    def remove(self, **kw: Any) -> None:
        if self.refuse:
            raise self.refuse.pop(0)
        self.removed_with = kw
        self.store.objects.remove(self)

    def logs(self, **kw: Any) -> Any:
        self.store.calls.append(("logs", kw))
        return self.log if "timestamps" not in kw else iter([self.log[:3], self.log[3:]])


class FakeCollection:
    def __init__(self, kind: str, order: list[str]) -> None:
        self.kind = kind
        self.objects: list[FakeObject] = []
        self.calls: list[tuple[str, Any]] = []
        self.fail: Exception | None = None
        self.order = order  # the client's: which kind was listed when

    def add(self, oid: str, labels: dict[str, str] | None = None, **kw: Any) -> FakeObject:
        o = FakeObject(self, oid, labels, **kw)
        self.objects.append(o)
        return o

    def list(self, filters: dict[str, Any] | None = None, **kw: Any) -> list[FakeObject]:
        self.calls.append(("list", {"filters": filters, **kw}))
        self.order.append(self.kind)
        if self.fail is not None:
            raise self.fail
        f = filters or {}
        return [o for o in self.objects if _matches(o.labels, f["label"]) and f.get("driver", o.driver) == o.driver]

    def get(self, name: str) -> FakeObject:
        self.calls.append(("get", name))
        if self.fail is not None:
            raise self.fail
        for o in self.objects:
            if name in (o.id, o.name):
                return o
        raise NotFound(f"404 {name}", explanation=f"No such {self.kind[:-1]}: {name}")


class FakeAPI:
    def __init__(self) -> None:
        self.tasks_: list[dict[str, Any]] = []
        self.nodes_: list[dict[str, Any]] = []
        self.build_chunks: list[dict[str, Any]] = []
        self.calls: list[tuple[str, Any]] = []

    def tasks(self, filters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.calls.append(("tasks", filters))
        if filters is None:
            return list(self.tasks_)
        return [t for t in self.tasks_ if t["ServiceID"] in filters.get("service", [])]

    def nodes(self) -> list[dict[str, Any]]:
        return self.nodes_

    def inspect_node(self, node_id: str) -> dict[str, Any]:
        return next(n for n in self.nodes_ if n["ID"] == node_id)

    def update_node(self, node_id: str, version: int, spec: dict[str, Any]) -> bool:
        self.calls.append(("update_node", (node_id, version, spec)))
        return True

    def build(self, **kw: Any) -> Iterator[dict[str, Any]]:
        self.calls.append(("build", kw))
        return iter(self.build_chunks)


class FakeImages:
    def __init__(self) -> None:
        self.labels: dict[str, dict[str, str] | None] = {}
        self.pruned: list[dict[str, Any]] = []

    def get(self, name: str) -> Any:
        if name not in self.labels:
            raise ImageNotFound(f"404 {name}", explanation=f"No such image: {name}")
        return type("Image", (), {"labels": self.labels[name] or {}})()

    def prune(self, filters: dict[str, Any]) -> dict[str, Any]:
        self.pruned.append(filters)
        return {}


class FakeClient:
    def __init__(self, swarm: str = "active", manager: bool = True) -> None:
        self.listed: list[str] = []
        self.containers, self.networks, self.volumes, self.services, self.configs = (
            FakeCollection(k, self.listed) for k in ("containers", "networks", "volumes", "services", "configs")
        )
        self.api = FakeAPI()
        self.images = FakeImages()
        self.swarm = {"LocalNodeState": swarm, "ControlAvailable": manager}

    def info(self) -> dict[str, Any]:
        return {"Swarm": self.swarm}

    def version(self) -> dict[str, Any]:
        return {"Version": "20.10.24", "ApiVersion": "1.41"}


def _engine(client: FakeClient) -> Engine:
    return Engine(client)  # type: ignore[arg-type]


def _state(
    oid: str,
    status: str,
    health: str | None = None,
    code: int = 0,
    error: str = "",
    labels: dict[str, str] | None = None,
    pid: int = 0,
) -> dict[str, Any]:
    st: dict[str, Any] = {"Status": status, "ExitCode": code, "Error": error, "Pid": pid}
    if health is not None:
        st["Health"] = {"Status": health}
    return {"Id": oid, "Name": f"/{oid}", "State": st, "Config": {"Labels": labels or {}}}


# -- errors -------------------------------------------------------------------------------------


def test_engine_errors_become_backend_errors_that_name_the_object() -> None:
    assert LocalBackendError is BackendError  # the old import path still works
    c = FakeClient()
    c.containers.fail = APIError("409 Client Error", explanation="container abc is restarting, wait until it is")
    with pytest.raises(BackendError) as err:
        _engine(c).container("ptb1-client")
    assert str(err.value) == "inspecting container ptb1-client: container abc is restarting, wait until it is"
    c.containers.fail = requests.exceptions.ConnectionError("socket gone")
    with pytest.raises(BackendError, match=r"^reading the log of container wan: the Docker engine is not reachable "):
        _engine(c).logs("wan")
    c.services.fail = APIError("503", explanation="This node is not a swarm manager.")
    with pytest.raises(BackendError, match="^listing the tasks of stack ptb1: This node is not a swarm manager.$"):
        _engine(c).stack_tasks("ptb1")
    # "Not there" is an answer, not an error.
    c = FakeClient()
    assert _engine(c).container("nothing") is None and _engine(c).logs("nothing") == "(no container)"
    assert _engine(c).remove_container("nothing") is False and _engine(c).service_logs("ptb1_wan") == ""
    assert _engine(c).image_labels("prfaas-testbed:latest") is None
    c.images.labels["prfaas-testbed:latest"] = None
    c.images.labels["b"] = {"io.prfaas-testbed.source-hash": "ab12"}
    assert _engine(c).image_labels("prfaas-testbed:latest") == {}
    assert _engine(c).image_labels("b") == {"io.prfaas-testbed.source-hash": "ab12"}


def test_a_container_that_will_not_start_is_named_with_its_last_log_lines() -> None:
    c = FakeClient()

    class Created(FakeObject):
        def start(self) -> None:
            raise APIError("500", explanation="OCI runtime create failed: sysctl net.ipv4.tcp_rmem: invalid argument")

        def reload(self) -> None:
            pass

    made: list[dict[str, Any]] = []

    def create(image: str, command: list[str], **kw: Any) -> FakeObject:
        made.append({"image": image, "command": command, **kw})
        o = Created(c.containers, "c0ffee", name=kw["name"], log=b"starting\nbad sysctl\n")
        c.containers.objects.append(o)
        return o

    c.containers.create = create  # type: ignore[attr-defined]
    with pytest.raises(BackendError) as err:
        _engine(c).run(
            "prfaas-testbed:latest",
            "ptb1-client",
            ["infinity"],
            entrypoint=["sleep"],
            labels={PROJECT_LABEL: "ptb1"},
            network="ptb1_dc-dc-local",
        )
    assert str(err.value) == (
        "starting container ptb1-client: OCI runtime create failed: sysctl net.ipv4.tcp_rmem: "
        "invalid argument; last log lines:\nstarting\nbad sysctl\n"
    )
    assert made == [
        {
            "image": "prfaas-testbed:latest",
            "command": ["infinity"],
            "name": "ptb1-client",
            "entrypoint": ["sleep"],
            "labels": {PROJECT_LABEL: "ptb1"},
            "network": "ptb1_dc-dc-local",
            "detach": True,
        }
    ]


def test_container_state_from_the_engines_inspect_document() -> None:
    up = ContainerState.from_attrs(_state("a1", "running", "healthy", labels={COMPOSE_SERVICE: "router"}, pid=42))
    assert (up.name, up.status, up.health, up.pid, up.ended, up.labels) == (
        "a1",
        "running",
        "healthy",
        42,
        False,
        {COMPOSE_SERVICE: "router"},
    )
    plain = ContainerState.from_attrs(_state("a2", "running"))
    assert plain.health == "" and plain.describe() == "running"
    dead = ContainerState.from_attrs(_state("a3", "exited", "unhealthy", code=1, error='exec: "testbed": not found'))
    assert dead.ended and dead.describe() == 'exited (code 1): exec: "testbed": not found'


def test_build_streams_whole_lines_and_stops_at_the_engines_error(tmp_path: Path) -> None:
    c = FakeClient()
    c.api.build_chunks = [
        {"stream": "Step 1/3 : FROM base\n"},
        {"stream": " ---> 1234\nStep 2/3 : RUN pip "},
        {"stream": "install\n"},
        {"status": "Pulling fs layer", "id": "ab"},
        {"stream": "oops"},
        {"error": "The command '/bin/sh -c pip install' returned a non-zero code: 1\n", "errorDetail": {"code": 1}},
    ]
    lines: list[str] = []
    with pytest.raises(BackendError) as err:
        for line in _engine(c).build(tmp_path, "compose/Dockerfile", "img:t", {"SOURCE_HASH": "ab"}, nocache=True):
            lines.append(line)
    assert lines == ["Step 1/3 : FROM base", " ---> 1234", "Step 2/3 : RUN pip install", "Pulling fs layer ab", "oops"]
    assert str(err.value) == "building image img:t: The command '/bin/sh -c pip install' returned a non-zero code: 1"
    ((_, kw),) = c.api.calls
    assert kw["path"] == str(tmp_path) and kw["dockerfile"] == "compose/Dockerfile" and kw["tag"] == "img:t"
    assert kw["buildargs"] == {"SOURCE_HASH": "ab"} and kw["nocache"] is True
    assert kw["rm"] is True and kw["decode"] is True  # as `docker build`: intermediates removed

    # The image module's build: its ImageError (a BackendError) ends with the last lines.
    from testbed.deploy.image import ImageError, _build

    c.api.calls.clear()
    with pytest.raises(ImageError) as ierr:
        _build(_engine(c), "base:1", "cafe", False, lambda line: None)
    assert str(ierr.value).endswith(
        "returned a non-zero code: 1; last lines:\nStep 1/3 : FROM base\n ---> 1234\n"
        "Step 2/3 : RUN pip install\nPulling fs layer ab\noops"
    )
    assert isinstance(ierr.value, BackendError)
    assert c.api.calls[0][1]["buildargs"] == {"BASE_IMAGE": "base:1", "SOURCE_HASH": "cafe"}
    _engine(c).prune_images("io.prfaas-testbed.stage")
    assert c.images.pruned == [{"label": "io.prfaas-testbed.stage", "dangling": True}]


# -- label sweeps -------------------------------------------------------------------------------


def _populate(c: FakeClient) -> None:
    for p in ("ptb1", "ptb2"):
        c.containers.add(f"{p}aaaaaaaaaaaaaaaa", {PROJECT_LABEL: p})
        c.networks.add(f"{p}nnnnnnnnnnnnnnnn", {PROJECT_LABEL: p}, driver="overlay" if p == "ptb2" else "bridge")
        c.volumes.add(f"{p}-vol", {PROJECT_LABEL: p}, name=f"{p}-vol")
        c.services.add(f"{p}ssssssssssssssss", {PROJECT_LABEL: p})
        c.configs.add(f"{p}cccccccccccccccc", {PROJECT_LABEL: p})
    for col in (c.containers, c.networks, c.volumes, c.services, c.configs):
        col.add("other00000000000000", {"com.example": "x"})  # not ours: never touched


def test_compose_sweep_removes_exactly_the_projects_containers_networks_volumes() -> None:
    c = FakeClient()
    _populate(c)
    warned: list[str] = []
    out = remove_compose_project(_engine(c), "ptb1", warn=warned.append)
    assert out == {"containers": ["ptb1aaaaaaaa"], "networks": ["ptb1nnnnnnnn"], "volumes": ["ptb1-vol"]}
    assert warned == []
    assert c.containers.calls == [
        ("list", {"filters": {"label": f"{PROJECT_LABEL}=ptb1"}, "all": True, "sparse": True})
    ]
    assert [o.id for o in c.containers.objects] == ["ptb2aaaaaaaaaaaaaaaa", "other00000000000000"]
    assert {o.id for o in c.services.objects} >= {"ptb1ssssssssssssssss"}  # swarm kinds: not compose's
    # Forced, with anonymous volumes, as `docker rm -f -v`; volumes forced as `docker volume rm -f`.
    c2 = FakeClient()
    ctr = c2.containers.add("ptb1x", {PROJECT_LABEL: "ptb1"})
    vol = c2.volumes.add("ptb1v", {PROJECT_LABEL: "ptb1"})
    remove_compose_project(_engine(c2), "ptb1")
    assert ctr.removed_with == {"force": True, "v": True} and vol.removed_with == {"force": True}
    # Idempotent: a second sweep finds nothing.
    assert remove_compose_project(_engine(c), "ptb1") == {"containers": [], "networks": [], "volumes": []}
    # The bare prefix is every project (any value of the label), still nothing unlabelled.
    assert project_label("ptb") == PROJECT_LABEL and project_label("ptb1") == f"{PROJECT_LABEL}=ptb1"
    out = remove_compose_project(_engine(c), "ptb")
    assert out["containers"] == ["ptb2aaaaaaaa"] and out["volumes"] == ["ptb2-vol"]
    assert [o.id for o in c.containers.objects] == ["other00000000000000"]


def test_a_live_runs_project_is_spared_by_every_label_sweep() -> None:
    """`testbed down` with the bare prefix leaves the objects of a project whose run lives."""
    c = FakeClient()
    _populate(c)
    out = remove_docker_leftovers("ptb", _engine(c), spare={"ptb1"})
    assert all(not any(k.startswith("ptb1") for k in keys) for keys in out.values()), out
    assert out["containers"] == ["ptb2aaaaaaaa"] and out["services"] == ["ptb2ssssssss"]
    for col in (c.containers, c.networks, c.volumes, c.services, c.configs):
        assert sorted(o.labels.get(PROJECT_LABEL, "") for o in col.objects) == ["", "ptb1"]
    assert remove_docker_leftovers("ptb1", _engine(c), spare={"ptb1"}) == {k: [] for k in DOCKER_KINDS}


def test_swarm_sweep_repeats_until_nothing_is_left_and_names_what_stays() -> None:
    c = FakeClient()
    _populate(c)
    # The overlay network is still in use on the first pass (its tasks are stopping).
    busy = APIError("403", explanation="error while removing network: network ptb2_dc-a has active endpoints")
    c.networks.objects[1].refuse = [busy]
    removed: list[str] = []
    warned: list[str] = []
    out = remove_swarm_project(_engine(c), "ptb2", warn=warned.append, stack_rm=removed.append, pause=0.0)
    assert removed == ["ptb2"]  # `docker stack rm` first, on a manager
    assert out == {
        "services": ["ptb2ssssssss"],
        "containers": ["ptb2aaaaaaaa"],
        "networks": ["ptb2nnnnnnnn"],
        "configs": ["ptb2cccccccc"],
        "volumes": ["ptb2-vol"],
    }
    assert warned == [] and not [o for o in c.networks.objects if o.labels.get(PROJECT_LABEL) == "ptb2"]
    assert ("list", {"filters": {"label": f"{PROJECT_LABEL}=ptb2", "driver": "overlay"}}) in c.networks.calls
    # Services before the containers they own, containers before the networks and volumes they use.
    assert c.listed[:5] == ["services", "containers", "volumes", "networks", "configs"]
    # A second pass removes the network that was busy, a third finds nothing and ends the sweep.
    assert len(c.listed) == 15
    # One that never goes is named once the time is up, with the engine's reason.
    c.networks.add("ptb3stuckstuckstuck", {PROJECT_LABEL: "ptb3"}, driver="overlay", refuse=[busy] * 100)
    out = remove_swarm_project(_engine(c), "ptb3", timeout=0.0, warn=warned.append, stack_rm=removed.append, pause=0.0)
    assert out["networks"] == ["ptb3stuckstu"]
    assert warned == [
        "could not remove network ptb3stuckstu: error while removing network: network ptb2_dc-a has active endpoints"
    ]
    # The bare prefix: no `stack rm` (it takes a stack name), the label sweep does it all.
    removed.clear()
    remove_swarm_project(_engine(c), "ptb", warn=warned.append, stack_rm=removed.append, pause=0.0, timeout=0.0)
    assert removed == []


def test_off_a_manager_only_containers_and_volumes_are_swept() -> None:
    c = FakeClient(swarm="inactive", manager=False)
    _populate(c)
    c.services.fail = APIError("503", explanation="This node is not a swarm manager.")
    removed: list[str] = []
    out = remove_swarm_project(_engine(c), "ptb1", stack_rm=removed.append, pause=0.0)
    assert removed == [] and c.services.calls == [] and c.configs.calls == []
    assert out["containers"] == ["ptb1aaaaaaaa"] and out["volumes"] == ["ptb1-vol"] and out["services"] == []


def test_leftovers_report_every_kind_and_a_listing_failure_is_a_warning() -> None:
    c = FakeClient(swarm="inactive", manager=False)
    _populate(c)
    c.volumes.fail = requests.exceptions.ConnectionError("socket gone")
    warned: list[str] = []
    out = remove_docker_leftovers("ptb1", _engine(c), warn=warned.append)
    assert list(out) == list(DOCKER_KINDS)
    assert out == {
        "containers": ["ptb1aaaaaaaa"],
        "networks": ["ptb1nnnnnnnn"],
        "volumes": [],
        "services": [],
        "configs": [],
    }
    assert warned and all(
        w.startswith(f"listing volumes labelled {PROJECT_LABEL}=ptb1: the Docker engine is not reachable")
        for w in warned
    )
    report = DownReport(
        (TeardownReport("ptb1", ("ptb1-a",), (NsProcess(7, "ptb1-a", "sleep", "SIGTERM"),)), DockerLeftovers(out))
    )
    d = report.to_dict()
    assert d == {
        "prefix": "ptb1",
        "namespaces": ["ptb1-a"],
        "processes": [{"pid": 7, "netns": "ptb1-a", "comm": "sleep", "signal": "SIGTERM"}],
        "errors": [],
        "docker": out,
    }
    assert report.summary().endswith("\ndocker: removed 1 containers, 1 networks, 0 volumes, 0 services, 0 configs")
    assert report.errors == ()
    quiet = DownReport((TeardownReport("ptb9", (), ()), DockerLeftovers({k: [] for k in DOCKER_KINDS})))
    assert quiet.summary() == "nothing to remove for prefix 'ptb9'"


# -- swarm state --------------------------------------------------------------------------------


def test_stack_tasks_and_nodes_from_the_engines_documents() -> None:
    c = FakeClient()
    for sid, name in (("s1", "ptb1_wan"), ("s2", "ptb1_router")):
        c.services.add(sid, {"com.docker.stack.namespace": "ptb1"}, attrs={"Spec": {"Name": name}})
    c.services.add("s9", {"com.docker.stack.namespace": "ptb9"}, attrs={"Spec": {"Name": "ptb9_wan"}})
    c.api.nodes_ = [
        {
            "ID": "n1",
            "Version": {"Index": 7},
            "Description": {"Hostname": "vm"},
            "Spec": {"Role": "manager", "Availability": "active", "Labels": {"prfaas.dc.dc-local": "true"}},
            "Status": {"State": "ready", "Addr": "172.18.0.2"},
        }
    ]
    c.api.tasks_ = [
        {"ServiceID": "s1", "NodeID": "n1", "DesiredState": "running", "Status": {"State": "running"}},
        {
            "ServiceID": "s2",
            "NodeID": "",
            "DesiredState": "running",
            "Status": {"State": "pending", "Err": "no suitable node (scheduling constraints not satisfied on 1 node)"},
        },
        {"ServiceID": "s9", "NodeID": "n1", "DesiredState": "running", "Status": {"State": "failed"}},
    ]
    e = _engine(c)
    assert e.stack_tasks("ptb1") == [
        Task("wan", "running", "running", "", "vm"),
        Task("router", "pending", "running", "no suitable node (scheduling constraints not satisfied on 1 node)", ""),
    ]
    assert ("tasks", {"service": ["s1", "s2"]}) in c.api.calls
    assert e.stack_tasks("ptb5") == []  # no such stack: no tasks, no error
    assert e.swarm_state() == ("active", True)
    assert e.nodes() == [
        {
            "id": "n1",
            "hostname": "vm",
            "labels": {"prfaas.dc.dc-local": "true"},
            "state": "ready",
            "address": "172.18.0.2",
        }
    ]
    e.add_node_labels("n1", {"prfaas.wan": "true"})
    assert c.api.calls[-1] == (
        "update_node",
        (
            "n1",
            7,
            {
                "Role": "manager",
                "Availability": "active",
                "Labels": {"prfaas.dc.dc-local": "true", "prfaas.wan": "true"},
            },
        ),
    )
    c.services.add("ptb1_wan", {}, log=b"2024 line\n")
    assert e.service_logs("ptb1_wan", 15) == "2024 line\n"
    assert ("logs", {"stdout": True, "stderr": True, "timestamps": True, "tail": "15"}) in c.services.calls


# -- the backends' start failures -------------------------------------------------------------------


def test_compose_names_the_container_that_exited_with_its_last_log_lines(tmp_path: Path) -> None:
    from testbed.deploy.compose import ComposeBackend
    from testbed.run.load import load

    b = ComposeBackend(load("paper-prfaas"), tmp_path)
    c = FakeClient()
    proj = {COMPOSE_PROJECT: b.project}
    for svc in ("wan", "router", "prfaas-p0"):
        dead = svc == "prfaas-p0"
        c.containers.add(
            f"id-{svc}",
            attrs=_state(
                f"id-{svc}",
                "exited" if dead else "running",
                "unhealthy" if dead else "healthy",
                labels={**proj, COMPOSE_SERVICE: svc},
                code=1 if dead else 0,
            ),
            labels={**proj, COMPOSE_SERVICE: svc},
            log=b"Traceback\nOSError: address in use\n",
        )
    b._engine = _engine(c)
    assert set(b.containers()) == {"wan", "router", "prfaas-p0"}
    assert (
        "list",
        {"filters": {"label": f"{COMPOSE_PROJECT}={b.project}"}, "all": True, "ignore_removed": True},
    ) in c.containers.calls
    with pytest.raises(BackendError) as err:
        b._wait_healthy(timeout=30)
    assert str(err.value) == "container prfaas-p0 exited; last log lines:\nTraceback\nOSError: address in use\n"
    assert ("logs", {"stdout": True, "stderr": True, "tail": 15}) in c.containers.calls
    assert (
        b._failed_starts()
        == "\ncontainer prfaas-p0 exited (code 1); last log lines:\nTraceback\nOSError: address in use\n"
    )


def test_swarm_names_the_failed_service_with_its_node_and_last_log_lines(tmp_path: Path) -> None:
    from testbed.deploy.swarm import SwarmBackend
    from testbed.run.load import load

    b = SwarmBackend(load("paper-prfaas"), tmp_path)
    c = FakeClient()
    ns = {"com.docker.stack.namespace": b.project}
    c.services.add(
        "s1",
        ns,
        attrs={"Spec": {"Name": f"{b.project}_pd-d0"}},
        name=f"{b.project}_pd-d0",
        log=b"2024-01-01T00:00:00Z boom\n",
    )
    c.api.nodes_ = [{"ID": "n1", "Description": {"Hostname": "vm"}, "Spec": {}}]
    c.api.tasks_ = [
        {
            "ServiceID": "s1",
            "NodeID": "n1",
            "DesiredState": "shutdown",
            "Status": {"State": "failed", "Err": "task: non-zero exit (1)"},
        }
    ]
    b._engine = _engine(c)
    with pytest.raises(BackendError) as err:
        b._wait_running(timeout=30)
    assert str(err.value) == (
        "service pd-d0 failed (task: non-zero exit (1)) on vm; last log lines:\n2024-01-01T00:00:00Z boom\n"
    )


def test_swarm_teardown_waits_for_the_nodes_to_stop_the_stack_but_not_for_a_lost_node(tmp_path: Path) -> None:
    from testbed.deploy.swarm import SwarmBackend
    from testbed.run.load import load

    b = SwarmBackend(load("paper-prfaas"), tmp_path)
    c = FakeClient()
    c.api.nodes_ = [
        {"ID": "n-up", "Description": {"Hostname": "a"}, "Spec": {}, "Status": {"State": "ready"}},
        {"ID": "n-lost", "Description": {"Hostname": "b"}, "Spec": {}, "Status": {"State": "down"}},
    ]
    c.api.tasks_ = [
        {"ID": "t1", "ServiceID": "s1", "NodeID": "n-up"},
        {"ID": "t2", "ServiceID": "s2", "NodeID": "n-lost"},
    ]
    looks = 0
    listed = c.api.tasks

    def tasks(filters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        nonlocal looks
        looks += 1
        if looks == 3:  # the ready node has stopped its container: the store drops the task
            c.api.tasks_ = [t for t in c.api.tasks_ if t["ID"] != "t1"]
        return listed(filters)

    c.api.tasks = tasks  # type: ignore[method-assign]
    b._wait_tasks_gone(_engine(c), {"t1": "n-up", "t2": "n-lost"}, timeout=30)
    assert looks == 3  # until t1 went; t2, on a node that is down, is not waited for
    looks = 0
    c.api.tasks_.append({"ID": "t3", "ServiceID": "s1", "NodeID": "n-up"})
    b._wait_tasks_gone(_engine(c), {"t3": "n-up"}, timeout=0)
    assert looks == 1  # past the timeout: one look, then it gives up (and says so)
