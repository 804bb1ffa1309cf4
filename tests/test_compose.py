"""Compose backend: the generated file (pure), and a real run on the Docker engine (docker tier)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from deployment_sizes import ONE_PER_ROLE, SERVICES_ONE_PER_ROLE
from held import LONG_PROMPT, answers, check_api_key, check_held_run, drive_with_openai, start_hold
from replay_exit import RAN
from wan_bound import counters_bound

from testbed.config.profiles import load_profile
from testbed.config.scenarios import load_scenario
from testbed.core.schema.scaling import Scale
from testbed.deploy.compose import compose_spec, layout
from testbed.deploy.netns import wan_links


def _docker_ok() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.mark.pure
def test_compose_file_has_one_container_per_instance_and_a_wan_router(tmp_path: Path) -> None:
    sc = load_scenario("paper-prfaas")
    prof = load_profile(sc.links.inter_dc)
    spec = compose_spec(sc, prof, "ptb1234", "prfaas-testbed:latest", tmp_path, tmp_path / "ctl")
    services = spec["services"]
    assert len(services) == (4 + 3 + 5) + 1 + 1  # instances + router + WAN router
    assert set(spec["networks"]) == {"dc-dc-remote", "dc-dc-local"}
    assert not any(n.get("internal") for n in spec["networks"].values())  # see compose_spec
    lay = layout(sc)
    wan = services["wan"]
    assert set(wan["networks"]) == set(spec["networks"]) and "NET_ADMIN" in wan["cap_add"]
    assert wan["devices"] == ["/dev/net/tun:/dev/net/tun"]
    assert wan["sysctls"]["net.ipv4.ip_forward"] == "1"
    # A PrfaaS node routes the local DC's subnet through the WAN router's address on its own network.
    p0 = services["prfaas-p0"]
    ((net, cfg),) = p0["networks"].items()
    assert net == "dc-dc-remote" and cfg["ipv4_address"] == lay["hosts"]["prfaas-p0"][1]
    local_subnet = lay["dcs"]["dc-local"][1]
    assert f"--route={local_subnet}=10.232.0.254" in p0["command"]
    assert p0["command"][:2] == ["serve", "prefill"] and "healthcheck" in p0
    assert services["router"]["networks"].keys() == {"dc-dc-local"}
    # The same document works for both compose tools: no top-level name or version keys.
    assert set(spec) == {"services", "networks"}
    yaml.safe_load(yaml.safe_dump(spec))
    assert set(wan_links(sc, prof, Scale.from_spec(sc.scale))) == {("dc-remote", "dc-local"), ("dc-local", "dc-remote")}


@pytest.mark.pure
def test_a_foreign_router_container_is_health_checked_on_its_own_address(tmp_path: Path) -> None:
    sc = load_scenario("paper-prfaas", {"router": {"kind": "vllm-router"}})
    spec = compose_spec(sc, load_profile(sc.links.inter_dc), "ptb1234", "img", tmp_path, tmp_path / "ctl")
    router = spec["services"]["router"]
    ip = layout(sc)["hosts"]["router"][1]
    # `testbed serve router` adds the routes, then execs the router bound to this address alone.
    assert router["command"][:2] == ["serve", "router"]
    assert f"/dev/tcp/{ip}/8000" in router["healthcheck"]["test"][-1]
    assert "/dev/tcp/127.0.0.1/8000" in spec["services"]["pd-p0"]["healthcheck"]["test"][-1]


def _sse(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """A streamed chat completion: (the answer's id, the chunks that carried text)."""
    import urllib.request

    body = {"model": "kimi-linear-1t", "max_tokens": max_tokens, "stream": True}
    body["messages"] = [{"role": "user", "content": prompt}]
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    rid, chunks = "", 0
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                obj = json.loads(line[5:])
                rid = obj["id"]
                chunks += bool(obj["choices"] and obj["choices"][0]["delta"].get("content"))
    return rid, chunks


@pytest.mark.docker
@pytest.mark.skipif(not _docker_ok(), reason="no Docker engine reachable")
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN router and the link monitor need root")
def test_vllm_router_held_on_compose_serves_then_testbed_down_removes_everything(tmp_path: Path) -> None:
    import urllib.request

    out = tmp_path / "run"
    held = start_hold(
        out,
        "--backend",
        "compose",
        "--scenario",
        "paper-prfaas",
        "--router",
        "vllm-router",
        "--router-policy",
        "round_robin",
        "--set",
        "scale.byte_scale=1000",
        *ONE_PER_ROLE,
        ready_timeout=600,
    )
    project = held.info["prefix"]
    try:
        assert held.info["backend"] == "compose" and project.startswith("ptb")
        # Round robin over the two prefill nodes: one of the two requests is prefilled remotely.
        got = [_sse(held.info["url"], LONG_PROMPT, 5), _sse(held.info["url"], LONG_PROMPT, 5)]
        assert all(rid.startswith("___prefill_addr_") and n == 5 for rid, n in got), got
        # vllm-router's own Prometheus endpoint, on its container's address, reached from this host.
        metrics_url = (out / "router-metrics-url").read_text().strip()
        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            assert "vllm_router" in r.read().decode()
    except BaseException:
        held.kill()
        raise
    down = subprocess.run(
        [sys.executable, "-m", "testbed", "down", "--force", project], capture_output=True, text=True, timeout=300
    )
    assert down.returncode == 0, down.stderr
    last = held.wait(timeout=300)
    assert last["ended"].startswith("the deployment went away") and last["requests"] == 2, last
    from testbed.metrics.records import read_records

    recs = {r.request_id: r for r in read_records(out / "records.csv")}
    assert set(recs) == {rid for rid, _ in got}
    assert all(r.outcome == "completed" and r.tokens_received == 5 and r.kv_bytes_wire > 0 for r in recs.values())
    assert sorted(r.crossed_wan for r in recs.values()) == [False, True]
    for kind in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
        left = subprocess.run(
            ["docker", *kind, "--filter", f"label=prfaas-testbed.project={project}"], capture_output=True, text=True
        ).stdout.split()
        assert left == [], kind
    assert not Path(f"/tmp/{project}-ctl").exists() and not answers(held.info["url"])


@pytest.mark.docker
@pytest.mark.skipif(not _docker_ok(), reason="no Docker engine reachable")
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN router and the link monitor need root")
def test_compose_replay_and_teardown(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Someone else's network holds the first block's second /24 (as a CI runner's did): the run
    # must take another block, not fail with the engine's "Pool overlaps".
    squatter = f"ptbtest-squatter-{os.getpid()}"
    subprocess.run(
        ["docker", "network", "create", "--subnet", "10.232.1.0/24", squatter], check=True, capture_output=True
    )
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "testbed",
                "up",
                "--backend",
                "compose",
                "--scenario",
                "paper-prfaas",
                "--requests",
                "12",
                "--rate",
                "2",
                "--out",
                str(out),
                "--json",
                "--set",
                "scale.speedup=10",
                "--set",
                "scale.byte_scale=1000",
                "--set",
                "workload.output_tokens=64",
                "--set",
                "serving.stream_interval=8",
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    finally:
        subprocess.run(["docker", "network", "rm", squatter], capture_output=True)
    assert r.returncode in RAN, r.stderr[-3000:]  # 3: the run is recorded, this host could not time it
    subnets = json.loads((out / "run.json").read_text())["shaping"]["subnets"]
    assert not any(s.startswith("10.232.") for s in subnets.values()), subnets
    s = json.loads(r.stdout)
    assert s["requests"]["completed"] == 12
    meta = json.loads((out / "run.json").read_text())
    project = meta["shaping"]["project"]
    spec = yaml.safe_load((out / "compose.yaml").read_text())
    assert len(spec["services"]) == 12 + 2
    assert s["wan_link"]["link"] == "dc-remote->dc-local"
    assert 1.0 <= s["wan_link"]["counters_over_records"] < counters_bound(out, s)
    left = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=prfaas-testbed.project={project}"], capture_output=True, text=True
    ).stdout.split()
    nets = subprocess.run(
        ["docker", "network", "ls", "-q", "--filter", f"label=prfaas-testbed.project={project}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert left == [] and nets == []


@pytest.mark.docker
@pytest.mark.skipif(not _docker_ok(), reason="no Docker engine reachable")
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN router and the link monitor need root")
def test_sigterm_mid_replay_removes_every_container_network_and_volume(tmp_path: Path) -> None:
    # SIGTERM here, Ctrl-C in the hold test below: the CLI turns both into one teardown path,
    # and each reaches this backend once.
    sig = signal.SIGTERM
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testbed",
            "up",
            "--backend",
            "compose",
            "--scenario",
            "paper-prfaas",
            "--requests",
            "60",
            "--rate",
            "2",
            "--out",
            str(out),
            "--set",
            "scale.speedup=10",
            "--set",
            "scale.byte_scale=1000",
            "--set",
            "workload.output_tokens=400",
            *ONE_PER_ROLE,
        ],
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
            time.sleep(0.5)
        assert proc.poll() is None, (
            f"the run ended before the interrupt ({proc.returncode}): {proc.communicate()[1][-3000:]}"
        )
        project = json.loads((out / "run.json").read_text())["shaping"]["project"]
        running = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=prfaas-testbed.project={project}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(running) == SERVICES_ONE_PER_ROLE
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err[-3000:]
    for kind in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
        left = subprocess.run(
            ["docker", *kind, "--filter", f"label=prfaas-testbed.project={project}"], capture_output=True, text=True
        ).stdout.split()
        assert left == [], kind
    rows = (out / "records.csv").read_text().splitlines()
    assert len(rows) == 61


@pytest.mark.docker
@pytest.mark.skipif(not _docker_ok(), reason="no Docker engine reachable")
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN router and the link monitor need root")
def test_hold_serves_the_openai_package_then_ctrl_c_removes_everything(tmp_path: Path) -> None:
    out = tmp_path / "run"
    t = time.monotonic()
    held = start_hold(
        out,
        "--backend",
        "compose",
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
        assert held.info["backend"] == "compose" and project.startswith("ptb")
        assert held.info["base_url"].startswith("http://127.0.0.1:")
        running = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=prfaas-testbed.project={project}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(running) == SERVICES_ONE_PER_ROLE
        sent = drive_with_openai(held.info["base_url"], check_api_key(held.info))
    except BaseException:
        held.kill()
        raise
    t = time.monotonic()
    last = held.end(timeout=300, sig=signal.SIGINT)
    took = time.monotonic() - t
    check_held_run(out, sent, last)
    assert json.loads((out / "run.json").read_text())["shaping"]["project"] == project
    for kind in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
        left = subprocess.run(
            ["docker", *kind, "--filter", f"label=prfaas-testbed.project={project}"], capture_output=True, text=True
        ).stdout.split()
        assert left == [], kind
    assert not Path(f"/tmp/{project}-ctl").exists() and not answers(held.info["url"])
    print(f"compose hold: ready in {ready:.0f} s, Ctrl-C to everything removed {took:.0f} s")
