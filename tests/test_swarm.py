"""Swarm backend: the generated stack (pure), address discovery (app, on loopback), and real runs
on a single-node swarm (docker tier)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from deployment_sizes import ONE_PER_ROLE, SERVICES_ONE_PER_ROLE
from held import answers, check_api_key, check_held_run, drive_with_openai, start_hold
from replay_exit import RAN
from wan_bound import counters_bound

from testbed.config.profiles import load_profile
from testbed.config.scenarios import load_scenario
from testbed.deploy.compose import compose_spec, layout
from testbed.deploy.discovery import (
    ADDRESSES,
    FILES,
    REGISTER,
    Registry,
    add_file_routes,
    add_registry_routes,
    discover,
    routes_via_wan,
    with_hosts,
)
from testbed.deploy.engine import parse_tasks
from testbed.deploy.swarm import all_running, engine_start_failure, missing_labels, task_problem
from testbed.deploy.swarm_stack import DC_LABEL, SUBNET_BASE, WAN_LABEL, stack_spec, swarm_deployment, wan_stack_config
from testbed.run.load import resolve

PROJECT_LABEL = "prfaas-testbed.project"


def _walk(x: Any) -> Iterator[Any]:
    """Every key and value of a nested document."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from _walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v)
    else:
        yield x


@pytest.mark.pure
def test_stack_has_the_compose_services_on_overlay_networks_placed_by_datacenter(tmp_path: Path) -> None:
    sc = load_scenario("paper-prfaas")
    prof = load_profile(sc.links.inter_dc)
    spec = stack_spec(sc, prof, "ptb1234", "prfaas-testbed:latest")
    compose = compose_spec(sc, prof, "ptb1234", "prfaas-testbed:latest", tmp_path, tmp_path / "ctl")
    assert set(spec["services"]) == set(compose["services"])  # the same scenario, the same services
    assert set(spec["networks"]) == set(compose["networks"])
    # Nothing `docker stack deploy` ignores, and no bind mount of a directory other hosts lack.
    keys = set(_walk(spec))
    assert not keys & {"ipv4_address", "devices", "volumes", "depends_on", "container_name"}
    lay = layout(sc, SUBNET_BASE)
    for name, net in spec["networks"].items():
        dc = name.removeprefix("dc-")
        assert net["driver"] == "overlay" and net["attachable"] is True
        assert net["ipam"]["config"] == [{"subnet": lay["dcs"][dc][1]}]
        assert net["driver_opts"]["com.docker.network.driver.mtu"] == "65000"
        assert net["labels"] == {PROJECT_LABEL: "ptb1234"}
    for sid, svc in spec["services"].items():
        dep = svc["deploy"]
        assert dep["endpoint_mode"] == "dnsrr" and dep["replicas"] == 1
        assert dep["restart_policy"] == {"condition": "none"}
        assert dep["labels"] == svc["labels"] == {PROJECT_LABEL: "ptb1234"}
        assert "healthcheck" in svc and "NET_ADMIN" in svc["cap_add"]
        if sid == "wan":
            continue
        dc = lay["hosts"][sid][0]
        assert svc["networks"] == [f"dc-{dc}"]
        assert dep["placement"]["constraints"] == [f"node.labels.{DC_LABEL}{dc} == true"]
        cmd = svc["command"]
        assert cmd[cmd.index("--discover") + 1] == "http://wan:8000" and "--serve-files" in cmd
        assert svc["configs"] == [{"source": "deployment", "target": "/etc/testbed/deployment.json"}]
    assert spec["services"]["router"]["deploy"]["placement"]["constraints"] == [
        "node.labels.prfaas.dc.dc-local == true"
    ]
    wan = spec["services"]["wan"]
    assert wan["networks"] == list(spec["networks"]) and wan["init"] is True
    assert wan["deploy"]["placement"]["constraints"] == [f"node.labels.{WAN_LABEL} == true"]
    assert wan["entrypoint"][:3] == ["python3", "-m", "testbed.deploy.swarm_wan"]
    assert wan["sysctls"]["net.ipv4.ip_forward"] == "1"
    assert {k: v["file"] for k, v in spec["configs"].items()} == {
        "deployment": "./deployment.json",
        "wan": "./wan.json",
    }
    assert spec["version"] == "3.8"
    assert yaml.safe_load(yaml.safe_dump(spec)) == spec and "&id" not in yaml.safe_dump(spec)


@pytest.mark.pure
def test_deployment_and_wan_config_leave_addresses_to_discovery() -> None:
    sc = load_scenario("paper-prfaas")
    lay = layout(sc, SUBNET_BASE)
    dep = swarm_deployment(resolve(sc), lay)
    assert dep.router.host == "router" and dep.nodes["prfaas-p0"].http.host == "prfaas-p0"
    info = dep.extra["discovery"]
    assert info["members"]["router"] == "dc-local" and info["members"]["prfaas-p0"] == "dc-remote"
    assert info["subnets"] == {"dc-remote": "10.234.0.0/24", "dc-local": "10.234.1.0/24"}
    # Each service binds to its own address (found by discovery), HTTP also to loopback.
    assert dep.run_dir == "/run/testbed" and dep.bind_host is None and dep.bind_loopback
    resolved = with_hosts(dep, {"router": "10.234.1.7", "prfaas-p0": "10.234.0.3"})
    assert resolved.router.url == "http://10.234.1.7:8000"
    p0 = resolved.nodes["prfaas-p0"]
    assert (p0.http.host, p0.kv and p0.kv.host, p0.kv and p0.kv.port) == ("10.234.0.3", "10.234.0.3", 9000)
    assert resolved.nodes["pd-d0"].http.host == "pd-d0"  # not listed: unchanged
    assert routes_via_wan("dc-remote", info["subnets"], {"dc-remote": "10.234.0.5", "dc-local": "10.234.1.5"}) == [
        "10.234.1.0/24=10.234.0.5"
    ]
    prof = load_profile(sc.links.inter_dc)
    from testbed.core.schema.scaling import Scale
    from testbed.deploy.netns import wan_links

    cfg = wan_stack_config("ptb1234", lay, wan_links(sc, prof, Scale.from_spec(sc.scale)), 64950)
    assert [(d["name"], d["index"], d["subnet"], d["address"]) for d in cfg["dcs"]] == [
        ("dc-remote", 0, "10.234.0.0/24", ""),
        ("dc-local", 1, "10.234.1.0/24", ""),
    ]
    assert cfg["method"] == "auto" and cfg["mtu"] == 64950 and cfg["members"] == info["members"]
    assert set(cfg["links"]) == {"dc-remote->dc-local", "dc-local->dc-remote"}


@pytest.mark.pure
def test_task_states_tell_running_from_failed_and_unschedulable() -> None:
    # The engine's task documents (GET /tasks): service and node by id.
    services = {f"s-{n}": f"ptb1_{n}" for n in ("wan", "pd-d0", "router")}
    nodes = {"n1": "vm"}

    def row(name: str, state: str, error: str = "", tid: str = "x") -> dict[str, Any]:
        return {
            "ID": tid,
            "ServiceID": f"s-{name}",
            "NodeID": "n1",
            "Slot": 1,
            "DesiredState": "running",
            "Status": {"State": state, "Message": state, **({"Err": error} if error else {})},
        }

    def parse(*rows: dict[str, Any]) -> list[Any]:
        return parse_tasks(list(rows), services, nodes, "ptb1")

    tasks = parse(row("wan", "running"), row("pd-d0", "starting"))
    assert [(t.service, t.state, t.node) for t in tasks] == [("wan", "running", "vm"), ("pd-d0", "starting", "vm")]
    assert task_problem(tasks) is None and not all_running(tasks, {"wan", "pd-d0"}) and all_running(tasks, {"wan"})
    bad = parse(row("pd-d0", "failed", "task: non-zero exit (1)"))
    assert task_problem(bad) == bad[0]
    stuck = parse(row("router", "pending", "no suitable node (scheduling constraints not satisfied on 1 node)"))
    assert task_problem(stuck) == stuck[0]
    assert task_problem(parse(row("router", "pending"))) is None
    # A container the engine could not start is retried: its task is superseded by the new one.
    busy = parse(
        row(
            "pd-d0",
            "failed",
            "starting container failed: unable to remount dir as readonly: "
            "mount tmpfs:/var/lib/docker/containers/x/mounts/secrets: device or resource busy",
            tid="old",
        ),
        row("pd-d0", "starting", tid="new"),
    )
    assert engine_start_failure(busy[0]) and not engine_start_failure(bad[0])
    assert task_problem(busy) == busy[0] and task_problem(busy, {"old"}) is None
    nodes = [{"id": "a", "labels": {"prfaas.dc.dc-local": "true"}}, {"id": "b", "labels": {"prfaas.wan": "no"}}]
    assert missing_labels(nodes, ["prfaas.dc.dc-local", "prfaas.dc.dc-remote", "prfaas.wan"]) == [
        "prfaas.dc.dc-remote",
        "prfaas.wan",
    ]


@pytest.mark.pure
def test_registry_checks_who_registers_where() -> None:
    reg = Registry(
        {"router": "local", "p0": "remote"},
        {"local": "10.0.1.0/24", "remote": "10.0.0.0/24"},
        {"local": "10.0.1.254", "remote": "10.0.0.254"},
    )
    with pytest.raises(ValueError, match="unknown service"):
        reg.register("d9", "10.0.1.3")
    with pytest.raises(ValueError, match="outside remote's subnet"):
        reg.register("p0", "10.0.1.3")
    with pytest.raises(ValueError, match="not an IP address"):
        reg.register("p0", "p0.local")
    reg.register("p0", "10.0.0.3")
    assert reg.missing() == ["router"]
    reg.register("router", "10.0.1.9")
    assert reg.missing() == [] and reg.view()["hosts"] == {"p0": "10.0.0.3", "router": "10.0.1.9"}


@pytest.mark.app
async def test_registry_and_file_routes_over_http(aiohttp_client: Any, tmp_path: Path) -> None:
    reg = Registry({"router": "local"}, {"local": "127.0.0.0/8"}, {"local": "127.0.0.1"})
    (tmp_path / "timeseries").mkdir()
    (tmp_path / "timeseries" / "router.jsonl").write_bytes(b'{"a": 1}\n{"a": 2}\n{"a"')  # being appended
    (tmp_path / "decisions.jsonl").write_text("")
    (tmp_path.parent / "secret").write_text("outside")
    app = web.Application()
    add_registry_routes(app, reg)
    add_file_routes(app, tmp_path)
    client = await aiohttp_client(app)
    r = await client.get(ADDRESSES)
    assert r.status == 503 and (await r.json())["missing"] == ["router"]
    r = await client.post(REGISTER, json={"id": "router", "address": "10.0.0.1"})
    assert r.status == 400 and "outside" in (await r.json())["error"]
    assert (await client.post(REGISTER, json={"id": "router", "address": "127.0.0.5"})).status == 200
    r = await client.get(ADDRESSES)
    assert r.status == 200 and (await r.json())["hosts"] == {"router": "127.0.0.5"}
    assert (await (await client.get(FILES)).json())["files"] == ["decisions.jsonl", "timeseries/router.jsonl"]
    assert await (await client.get(FILES + "/timeseries/router.jsonl")).read() == b'{"a": 1}\n{"a": 2}\n'
    assert (await client.get(FILES + "/..%2Fsecret")).status == 404
    assert (await client.get(FILES + "/nothing")).status == 404


@pytest.mark.app
async def test_a_service_registers_waits_for_the_others_and_learns_routes(aiohttp_server: Any) -> None:
    sc = load_scenario("paper-prfaas")
    dep = swarm_deployment(resolve(sc), layout(sc, SUBNET_BASE))
    members = dep.extra["discovery"]["members"]
    subnets = {"dc-local": "127.0.0.0/8", "dc-remote": "10.99.0.0/24"}
    dep.extra["discovery"]["subnets"] = subnets
    reg = Registry(dict(members), subnets, {"dc-local": "127.0.0.1", "dc-remote": "10.99.0.254"})
    app = web.Application()
    add_registry_routes(app, reg)
    server = await aiohttp_server(app)
    url = f"http://localhost:{server.port}"
    lines: list[str] = []
    task = asyncio.create_task(asyncio.to_thread(discover, dep, "router", url, 20.0, lines.append))
    await asyncio.sleep(1.0)
    assert not task.done() and reg.hosts == {"router": "127.0.0.1"}  # registered, waiting for the others
    for i, sid in enumerate(s for s in members if s != "router"):
        reg.hosts[sid] = f"10.99.0.{10 + i}" if members[sid] == "dc-remote" else f"127.0.0.{10 + i}"
    resolved, routes = await asyncio.wait_for(task, 10)
    assert resolved.router.host == "127.0.0.1" and resolved.nodes["prfaas-p0"].kv is not None
    assert resolved.nodes["prfaas-p0"].kv.host.startswith("10.99.0.")
    assert routes == ["10.99.0.0/24=127.0.0.1"]
    assert any("registered router at 127.0.0.1" in line for line in lines)
    assert any(line.startswith("discovery: waiting for") for line in lines)


# -- docker tier: a single-node swarm on this engine ---------------------------------------------


def _docker(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120, check=check)


def _engine_ok() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return _docker("info").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_engine = pytest.mark.skipif(not _engine_ok(), reason="no Docker engine reachable")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the replayer enters the client container's namespace (root)")


def _labels() -> dict[str, dict[str, str]]:
    ids = _docker("node", "ls", "-q", check=True).stdout.split()
    out = _docker("node", "inspect", "--format", "{{.ID}} {{json .Spec.Labels}}", *ids, check=True).stdout
    return {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) or {} for line in out.splitlines()}


@pytest.fixture(scope="module")
def single_node_swarm() -> Iterator[None]:
    """A swarm to run in: this engine's own if it is a manager already (left as found: labels the
    runs add are removed again), else a single-node swarm on loopback, left again at the end."""
    state = _docker("info", "--format", "{{.Swarm.LocalNodeState}} {{.Swarm.ControlAvailable}}").stdout.split()
    had_gwbridge = _docker("network", "inspect", "docker_gwbridge").returncode == 0
    mine = state[:1] == ["inactive"]
    if mine:
        _docker("swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", "127.0.0.1:2377", check=True)
    elif state != ["active", "true"]:
        pytest.skip(f"this engine is in a swarm but not as a manager (state {state})")
    before = _labels()
    try:
        yield
    finally:
        if mine:
            _docker("swarm", "leave", "--force")
            if not had_gwbridge:
                _docker("network", "rm", "docker_gwbridge")
        else:
            for node, labels in _labels().items():
                added = [k for k in labels if k.startswith("prfaas.") and k not in before.get(node, {})]
                if added:
                    _docker("node", "update", *[a for k in added for a in ("--label-rm", k)], node)


def _left(project: str) -> dict[str, list[str]]:
    sel = f"label={PROJECT_LABEL}={project}"
    stack = f"label=com.docker.stack.namespace={project}"
    return {
        "services": _docker("service", "ls", "-q", "--filter", sel).stdout.split()
        + _docker("service", "ls", "-q", "--filter", stack).stdout.split(),
        "containers": _docker("ps", "-aq", "--filter", sel).stdout.split()
        + _docker("ps", "-aq", "--filter", stack).stdout.split(),
        "networks": _docker("network", "ls", "-q", "--filter", sel).stdout.split()
        + _docker("network", "ls", "-q", "--filter", stack).stdout.split(),
        "configs": _docker("config", "ls", "-q", "--filter", sel).stdout.split(),
        "volumes": _docker("volume", "ls", "-q", "--filter", sel).stdout.split()
        + _docker("volume", "ls", "-q", "--filter", stack).stdout.split(),
        "netns": [n for n in os.listdir("/run/netns") if n.startswith(project)] if os.path.isdir("/run/netns") else [],
    }


def _up(out: Path, *extra: str) -> list[str]:
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
        "--set",
        "scale.byte_scale=1000",
        *extra,
    ]


@pytest.mark.docker
@needs_engine
@needs_root
@pytest.mark.usefixtures("single_node_swarm")
def test_swarm_replay_over_the_shaped_link_and_teardown(tmp_path: Path) -> None:
    out = tmp_path / "run"
    t = time.monotonic()
    r = subprocess.run(
        _up(
            out,
            "--requests",
            "12",
            "--rate",
            "2",
            "--json",
            "--set",
            "scale.speedup=10",
            "--set",
            "workload.output_tokens=64",
            "--set",
            "serving.stream_interval=8",
        ),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    took = time.monotonic() - t
    assert r.returncode in RAN, r.stderr[-3000:]
    s = json.loads(r.stdout)
    meta = json.loads((out / "run.json").read_text())
    project = meta["shaping"]["project"]
    assert meta["backend"] == "swarm" and meta["shaping"]["method"] in ("netem", "fallback")
    assert s["requests"]["completed"] == 12
    # Link usage from the WAN router's own counters, pulled at the end, agrees with the records.
    assert s["wan_link"]["link"] == "dc-remote->dc-local"
    assert 1.0 <= s["wan_link"]["counters_over_records"] < counters_bound(out, s)
    assert s["wan_link"]["mean_bps_paper"] > 0
    spec = yaml.safe_load((out / "stack.yaml").read_text())
    assert len(spec["services"]) == 12 + 2 and (out / "deployment.json").is_file() and (out / "wan.json").is_file()
    pulled = {p.name for p in (out / "timeseries").iterdir()}
    assert {"wan.jsonl", "router.jsonl", "prfaas-p0.jsonl", "pd-d0.jsonl"} <= pulled
    assert (out / "decisions.jsonl").stat().st_size > 0 and (out / "logs" / "wan.log").stat().st_size > 0
    assert set(meta["shaping"]["placement"]) == set(spec["services"])
    assert _left(project) == {k: [] for k in ("services", "containers", "networks", "configs", "volumes", "netns")}
    print(
        f"swarm replay: {took:.0f} s wall, {s['requests']['completed']} completed, WAN mean "
        f"{s['wan_link']['mean_bps_paper'] / 1e9:.2f} Gbit/s (paper), counters/records "
        f"{s['wan_link']['counters_over_records']:.4f}, method {meta['shaping']['method']}"
    )


@pytest.mark.docker
@needs_engine
@needs_root
@pytest.mark.usefixtures("single_node_swarm")
def test_swarm_ctrl_c_mid_replay_keeps_records_and_removes_everything(tmp_path: Path) -> None:
    # Ctrl-C here, SIGTERM in the hold test below: one teardown path, each signal once per backend.
    sig = signal.SIGINT
    out = tmp_path / "run"
    # 200 arrivals over 20 s of wire time: the interrupt lands mid-replay.
    proc = subprocess.Popen(
        _up(out, "--requests", "200", "--rate", "2", "--set", "scale.speedup=5", *ONE_PER_ROLE),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 900
        records = out / "records.csv"
        while (
            time.time() < deadline
            and proc.poll() is None
            and not (records.exists() and len(records.read_text().splitlines()) > 3)
        ):
            time.sleep(0.2)
        assert proc.poll() is None, (
            f"the run ended before the interrupt ({proc.returncode}): {proc.communicate()[1][-3000:]}"
        )
        project = json.loads((out / "run.json").read_text())["shaping"]["project"]
        running = _docker("service", "ls", "-q", "--filter", f"label={PROJECT_LABEL}={project}").stdout.split()
        assert len(running) == SERVICES_ONE_PER_ROLE
        proc.send_signal(sig)
        t = time.monotonic()
        _, err = proc.communicate(timeout=300)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert json.loads((out / "run.json").read_text())["interrupted"] is True
    assert _left(project) == {k: [] for k in ("services", "containers", "networks", "configs", "volumes", "netns")}
    rows = (out / "records.csv").read_text().splitlines()
    assert len(rows) == 201  # every request has a row: the finished ones and the cut-off ones
    assert (out / "timeseries" / "wan.jsonl").stat().st_size > 0
    done = sum(1 for line in rows[1:] if ",completed," in line)
    print(f"swarm Ctrl-C: {done} of 200 completed before the interrupt, exit 130 and teardown {took:.1f} s after it")


@pytest.mark.docker
@needs_engine
@needs_root
@pytest.mark.usefixtures("single_node_swarm")
def test_swarm_hold_serves_the_openai_package_then_sigterm_removes_everything(tmp_path: Path) -> None:
    out = tmp_path / "run"
    t = time.monotonic()
    held = start_hold(
        out,
        "--backend",
        "swarm",
        "--scenario",
        "paper-prfaas",
        "--set",
        "scale.byte_scale=1000",
        "--set",
        "serving.stream_interval=2",
        *ONE_PER_ROLE,
        ready_timeout=600,
    )
    ready = time.monotonic() - t
    project = held.info["prefix"]
    try:
        # The base URL is a loopback port whose connections are made in the client container's namespace.
        assert held.info["backend"] == "swarm" and project.startswith("ptb")
        assert held.info["base_url"].startswith("http://127.0.0.1:")
        running = _docker("service", "ls", "-q", "--filter", f"label={PROJECT_LABEL}={project}").stdout.split()
        assert len(running) == SERVICES_ONE_PER_ROLE
        sent = drive_with_openai(held.info["base_url"], check_api_key(held.info))
    except BaseException:
        held.kill()
        raise
    t = time.monotonic()
    last = held.end(timeout=300, sig=signal.SIGTERM)
    took = time.monotonic() - t
    check_held_run(out, sent, last)
    assert (out / "timeseries" / "wan.jsonl").stat().st_size > 0
    assert _left(project) == {k: [] for k in ("services", "containers", "networks", "configs", "volumes", "netns")}
    assert not answers(held.info["url"])
    print(f"swarm hold: ready in {ready:.0f} s, SIGTERM to everything removed {took:.0f} s")
