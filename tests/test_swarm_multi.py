"""The swarm backend on a swarm of three Docker engines on this machine (`testbed.deploy.swarm_lab`:
Docker-in-Docker nodes, one per datacenter and one for the WAN router): placement across engines,
KV crossing between engines through the WAN router's, the loss of a node's engine mid-run, and
teardown on SIGTERM. The pure parts (node plan, the host's pid of a container of another pid
namespace, which services a lost node takes) run without an engine.

Time budget: the docker tests together stop at BUDGET_S (every wait and child process gets what
is left of it); they took ~130 s on 2 cores here once the images were built (two labs of ~22 s
each, three short replays)."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import docker_available
from replay_exit import RAN
from wan_bound import counters_bound

from testbed.config.scenarios import load_scenario
from testbed.deploy.base import BackendError
from testbed.deploy.swarm import host_pid, lost_services
from testbed.deploy.swarm_lab import NODE_FILES, Lab, down, node_hash, plan_nodes, up

PROJECT_LABEL = "prfaas-testbed.project"
BUDGET_S = 600.0  # for every docker test of this file together, lab builds included


FAST = [
    "--set",
    "scale.byte_scale=1000",
    "--set",
    "scale.speedup=10",
    "--set",
    "workload.output_tokens=64",
    "--set",
    "serving.stream_interval=8",
]


@pytest.mark.pure
def test_each_datacenter_and_the_wan_router_get_a_node_of_their_own() -> None:
    plans = plan_nodes(load_scenario("paper-prfaas"))
    assert [(p.role, p.labels) for p in plans] == [
        ("dc-local", {"prfaas.dc.dc-local": "true"}),  # the home DC first: the manager
        ("dc-remote", {"prfaas.dc.dc-remote": "true"}),
        ("wan", {"prfaas.wan": "true"}),
    ]


@pytest.mark.pure
def test_node_image_tag_follows_its_files_and_its_base(tmp_path: Path) -> None:
    for rel in NODE_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("a")
    h = node_hash(tmp_path, "sha256:1")
    assert node_hash(tmp_path, "sha256:1") == h and node_hash(tmp_path, "sha256:2") != h
    (tmp_path / NODE_FILES[1]).write_text("b")
    assert node_hash(tmp_path, "sha256:1") != h


@pytest.mark.pure
def test_host_pid_of_a_container_in_another_pid_namespace(tmp_path: Path) -> None:
    cid = "4af9b5e7" * 8
    inner = f"9:pids:/docker/{'c56a' * 16}/docker/{cid}\n"
    for pid, cgroup in ((1, "9:pids:/\n"), (359, "9:pids:/docker/other\n"), (20600, inner), (20601, inner)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(cgroup)
    (tmp_path / "self").mkdir()
    # The node's engine says 359, which here is another process: the cgroup names the container.
    assert host_pid(cid, 359, tmp_path) == 20600
    assert host_pid(cid, 20601, tmp_path) == 20601  # an engine of this pid namespace: as reported
    with pytest.raises(BackendError, match="no process of container 000000000000 "):
        host_pid("0" * 64, 359, tmp_path)


@pytest.mark.pure
def test_services_on_a_node_no_longer_ready_are_lost() -> None:
    placement = {"router": "a", "prfaas-p0": "b", "wan": "c", "pd-d0": "gone"}
    nodes = [
        {"hostname": "a", "state": "ready"},
        {"hostname": "b", "state": "down"},
        {"hostname": "c", "state": "ready"},
    ]
    assert lost_services(placement, nodes) == {
        "pd-d0": "node gone is gone from the swarm",
        "prfaas-p0": "node b is down",
    }


# -- docker tier ----------------------------------------------------------------------------------

needs_engine = pytest.mark.skipif(not docker_available(), reason="no Docker engine reachable")
needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="the lab starts Docker engines in containers and the replayer enters a container's namespace (root)",
)


def _docker(*args: str, host: str | None = None) -> list[str]:
    argv = ["docker", *(["-H", host] if host else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout.split()


def _host_state() -> tuple[str, ...]:
    return tuple(_docker("info", "--format", "{{.Swarm.LocalNodeState}} {{.Swarm.NodeID}}"))


def _lab_left(name: str) -> dict[str, list[str]]:
    sel = f"label={PROJECT_LABEL}={name}"
    return {
        "containers": _docker("ps", "-aq", "--filter", sel),
        "networks": _docker("network", "ls", "-q", "--filter", sel),
        "volumes": _docker("volume", "ls", "-q", "--filter", sel),
        "folders": [name] if Path(f"/run/prfaas-testbed/lab/{name}").exists() else [],
    }


def _stack_left(lab: Lab, project: str) -> dict[str, list[str]]:
    """What the run left on the lab's engines: the manager's swarm objects, each live node's containers."""
    sel = f"label=com.docker.stack.namespace={project}"
    mgr = lab.docker_host
    out = {
        "services": _docker("service", "ls", "-q", "--filter", sel, host=mgr),
        "networks": _docker("network", "ls", "-q", "--filter", sel, host=mgr),
        "configs": _docker("config", "ls", "-q", "--filter", f"label={PROJECT_LABEL}={project}", host=mgr),
    }
    for n in lab.nodes:
        if _docker("ps", "-q", "--filter", f"name=^{n.name}$", "--filter", "status=running"):
            out[f"containers on {n.role}"] = _docker("ps", "-aq", "--filter", sel, host=f"unix://{n.socket}")
    return out


def _stack_gone(lab: Lab, project: str, timeout: float = 60.0) -> float:
    """Seconds until nothing of the run is left on the lab's live engines. The run's teardown
    returns once the manager has removed the stack and every task's container has stopped; the
    other nodes' agents remove their stopped containers afterwards, on their own."""
    t = time.monotonic()
    while any((remaining := _stack_left(lab, project)).values()):
        assert time.monotonic() - t < timeout, remaining
        time.sleep(1.0)
    return time.monotonic() - t


@pytest.fixture(scope="module")
def left() -> Callable[[], float]:
    """Seconds of the file's budget still left, from its first docker test on (at least 1: the
    call that needs it then times out)."""
    start = time.monotonic()
    return lambda: max(BUDGET_S - (time.monotonic() - start), 1.0)


@pytest.fixture(scope="module")
def lab(left: Callable[[], float]) -> Iterator[Lab]:
    before = _host_state()
    t = time.monotonic()
    made = up(load_scenario("paper-prfaas"))
    print(f"\nswarm lab {made.name}: up in {time.monotonic() - t:.0f} s")
    try:
        yield made
    finally:
        down(made.name)
        assert _lab_left(made.name) == {"containers": [], "networks": [], "volumes": [], "folders": []}
        assert _host_state() == before  # the host engine's own swarm state is untouched


def _up(lab: Lab, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "testbed",
        "up",
        "--backend",
        "swarm",
        "--scenario",
        "paper-prfaas",
        "--out",
        str(out),
        *FAST,
        *extra,
    ]


def _env(lab: Lab) -> dict[str, str]:
    return {**os.environ, "DOCKER_HOST": lab.docker_host}


def _wait_for_records(proc: subprocess.Popen[str], out: Path, rows: int, within_s: float) -> None:
    """Until the run in `proc` has more than `rows` records in `out` (header included), it ends,
    or `within_s` passes."""
    deadline = time.time() + within_s
    while (
        time.time() < deadline
        and proc.poll() is None
        and not ((out / "records.csv").exists() and len((out / "records.csv").read_text().splitlines()) > rows)
    ):
        time.sleep(0.1)


def _records(out: Path) -> list[dict[str, str]]:
    with (out / "records.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.docker
@needs_engine
@needs_root
def test_replay_across_three_engines_crosses_the_wan_between_them(
    lab: Lab, left: Callable[[], float], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    t = time.monotonic()
    r = subprocess.run(
        _up(lab, out, "--requests", "12", "--rate", "2", "--json"),
        env=_env(lab),
        capture_output=True,
        text=True,
        timeout=left(),
    )
    took = time.monotonic() - t
    assert r.returncode in RAN, r.stderr[-3000:]
    s = json.loads(r.stdout)
    meta = json.loads((out / "run.json").read_text())
    sh = meta["shaping"]
    node = {n.role: n.name for n in lab.nodes}
    # Every service on the engine of its datacenter, the WAN router on its own: three engines.
    place = sh["placement"]
    assert len(place) == 14 and len(set(place.values())) == 3
    for svc, host in place.items():
        role = "wan" if svc == "wan" else "dc-remote" if svc.startswith("prfaas-") else "dc-local"
        assert host == node[role], (svc, host)
    assert {h: (n["id"], n["labels"]) for h, n in sh["nodes"].items()} == {
        n.name: (n.node_id, n.labels) for n in lab.nodes
    }
    # Records complete; the offloaded requests' KV left the dc-remote engine for the dc-local one
    # through the WAN router's engine, whose own interface counters saw it.
    rows = _records(out)
    assert len(rows) == 12 and all(row["outcome"] == "completed" for row in rows)
    crossed = [row for row in rows if row["crossed_wan"] == "1"]
    assert crossed and all(place[row["prefill_node"]] == node["dc-remote"] for row in crossed)
    assert all(place[row["decode_node"]] == node["dc-local"] for row in crossed)
    w = s["wan_link"]
    assert w["link"] == "dc-remote->dc-local" and w["mean_bps_paper"] > 0
    assert 1.0 <= w["counters_over_records"] < counters_bound(out, s)
    running = [
        c
        for n in lab.nodes
        for c in _docker(
            "ps", "-q", "--filter", f"label=com.docker.stack.namespace={sh['project']}", host=f"unix://{n.socket}"
        )
    ]
    assert running == []  # stopped on every engine when the run returns
    gone = _stack_gone(lab, sh["project"])
    print(
        f"three engines: {took:.0f} s wall, {len(crossed)} of 12 crossed {node['dc-remote']} -> {node['wan']} -> "
        f"{node['dc-local']}, WAN {w['links']['dc-remote->dc-local']['bytes_wire']:.0f} B on the wire "
        f"(counters/records {w['counters_over_records']:.4f}), mean {w['mean_bps_paper'] / 1e9:.2f} Gbit/s paper; "
        f"the workers removed their stopped containers {gone:.0f} s after the run"
    )


@pytest.mark.docker
@needs_engine
@needs_root
def test_losing_the_remote_engine_mid_run_accounts_for_every_request(
    lab: Lab, left: Callable[[], float], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # 60 arrivals over 6 s of wire time: the kill lands while most are still to come.
    proc = subprocess.Popen(
        _up(lab, out, "--requests", "60", "--rate", "1", "--json"),
        env=_env(lab),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = next(n for n in lab.nodes if n.role == "dc-remote")
    try:
        _wait_for_records(proc, out, 5, left())
        assert proc.poll() is None, f"the run ended before the kill: {proc.communicate()[1][-3000:]}"
        subprocess.run(["docker", "kill", victim.name], check=True, capture_output=True, timeout=60)
        killed = time.monotonic()
        stdout, err = proc.communicate(timeout=left())
        after = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in RAN, err[-3000:]
    meta = json.loads((out / "run.json").read_text())
    assert meta["state"] == "finished"
    rows = _records(out)
    assert len(rows) == 60  # every request has its row
    assert all(row["outcome"] in ("completed", "failed") for row in rows)
    failed = [row for row in rows if row["outcome"] == "failed"]
    assert all(row["reason"] for row in failed)  # and every failure its reason
    # The four prefill instances of dc-remote went with its engine; the run says so and why.
    lost = meta["shaping"]["unreachable_at_end"]
    assert sorted(lost) == ["prfaas-p0", "prfaas-p1", "prfaas-p2", "prfaas-p3"]
    assert all(victim.name in why for why in lost.values())
    assert (out / "logs" / "prfaas-p0.log").read_text().startswith("(no log: ")
    assert (out / "timeseries" / "wan.jsonl").stat().st_size > 0 and (out / "timeseries" / "router.jsonl").is_file()
    gone = _stack_gone(lab, meta["shaping"]["project"])
    reasons: dict[str, int] = {}
    for row in failed:
        key = re.sub(r"prfaas-p\d|\d+\.\d+\.\d+\.\d+", "*", row["reason"])[:90]
        reasons[key] = reasons.get(key, 0) + 1
    done = sum(row["outcome"] == "completed" for row in rows)
    print(
        f"node loss: {done} completed, {len(failed)} failed of 60 ({reasons}); "
        f"{sum(row['retries'] not in ('', '0') for row in rows)} retried; run ended {after:.0f} s after the kill, "
        f"the live workers' containers gone {gone:.0f} s later"
    )


@pytest.mark.docker
@needs_engine
@needs_root
def test_sigterm_to_the_lab_run_removes_every_engine_and_keeps_the_records(
    left: Callable[[], float], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    before = _host_state()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testbed.deploy.swarm_lab",
            "run",
            "--scenario",
            "paper-prfaas",
            "--",
            "--out",
            str(out),
            *FAST,
            "--requests",
            "200",
            "--rate",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_records(proc, out, 3, left())
        assert proc.poll() is None, f"the run ended before the signal: {proc.communicate()[1][-3000:]}"
        proc.send_signal(signal.SIGTERM)
        t = time.monotonic()
        _, err = proc.communicate(timeout=left())
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    name = re.search(r"swarm-lab: (ptb[0-9a-f]{4}): ", err)
    assert name is not None, err[-2000:]
    assert _lab_left(name.group(1)) == {"containers": [], "networks": [], "volumes": [], "folders": []}
    assert _host_state() == before
    assert json.loads((out / "run.json").read_text())["interrupted"] is True
    assert len(_records(out)) == 200
    print(f"lab SIGTERM: exit 130, the run's teardown and the lab's removal {took:.0f} s after the signal")
