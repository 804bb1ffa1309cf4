"""Where services listen: each on its own namespace's or container's address, never on all of
them. Pure: the Deployment every backend builds; app: services started from such a deployment
answer on their own address and not on another one."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from pathlib import Path

import pytest

from testbed.config.scenarios import load_scenario
from testbed.deploy.compose import deployment_for, layout
from testbed.deploy.discovery import with_hosts
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.netns import ROUTER_HOST, build_netns_topology, netns_deployment
from testbed.deploy.plan import loopback_deployment
from testbed.deploy.swarm_stack import SUBNET_BASE, swarm_deployment
from testbed.deploy.swarm_wan import listen_hosts
from testbed.live.deployment import Deployment
from testbed.run.load import resolve


def every_service(dep: Deployment) -> list[str]:
    return ["router", *dep.nodes]


@pytest.mark.pure
def test_netns_services_bind_to_their_own_namespace_address() -> None:
    rs = resolve(load_scenario("paper-prfaas"))
    topo, _ = build_netns_topology(rs, "ptb0b1d", "netem")
    dep = netns_deployment(rs, topo, "/tmp/run")
    assert dep.bind_host is None and not dep.bind_loopback
    assert dep.http_binds("router") == [topo.host(ROUTER_HOST).ip]
    for nid in dep.nodes:
        ip = topo.host(nid).ip
        assert dep.http_binds(nid) == [ip] and dep.kv_bind(nid) == ip
    binds = {h for sid in every_service(dep) for h in dep.http_binds(sid)}
    assert len(binds) == len(every_service(dep)) and "0.0.0.0" not in binds


@pytest.mark.pure
def test_compose_services_bind_to_their_container_address_and_loopback_for_the_health_check() -> None:
    sc = load_scenario("paper-prfaas")
    lay = layout(sc)
    dep = deployment_for(resolve(sc), lay)
    for sid in every_service(dep):
        _, ip = lay["hosts"][sid]
        assert dep.http_binds(sid) == [ip, "127.0.0.1"]
        if sid != "router":
            assert dep.kv_bind(sid) == ip  # KV: its own address only
    back = Deployment.from_json(dep.to_json())
    assert (back.bind_host, back.bind_loopback) == (None, True)


@pytest.mark.pure
def test_swarm_services_bind_to_the_address_discovery_found() -> None:
    sc = load_scenario("paper-prfaas")
    dep = swarm_deployment(resolve(sc), layout(sc, SUBNET_BASE))
    # Until discovery the hosts are service names; serve.py binds only after discover() has
    # moved the service's endpoints to its address on its DC network.
    found = with_hosts(dep, {"router": "10.234.1.7", "prfaas-p0": "10.234.0.3"})
    assert found.http_binds("prfaas-p0") == ["10.234.0.3", "127.0.0.1"] and found.kv_bind("prfaas-p0") == "10.234.0.3"
    assert found.http_binds("router") == ["10.234.1.7", "127.0.0.1"]
    # The WAN router: every DC address it found by subnet, and loopback; not 0.0.0.0.
    assert listen_hosts([{"name": "a", "address": "10.234.0.254"}, {"name": "b", "address": "10.234.1.254"}]) == [
        "10.234.0.254",
        "10.234.1.254",
        "127.0.0.1",
    ]


@pytest.mark.pure
def test_loopback_deployments_and_old_files_keep_one_bind_host() -> None:
    rs = resolve(load_scenario("paper-prfaas"))
    dep = loopback_deployment(rs, None)
    assert dep.http_binds("router") == ["127.0.0.1"] and dep.kv_bind("pd-d0") == "127.0.0.1"
    old = dep.to_json().replace('"bind_loopback": false,', "")  # written before bind_loopback existed
    assert Deployment.from_json(old).bind_loopback is False
    with pytest.raises(ValueError, match="no KV endpoint"):
        dataclasses.replace(
            dep, bind_host=None, nodes={**dep.nodes, "pd-d0": dataclasses.replace(dep.nodes["pd-d0"], kv=None)}
        ).kv_bind("pd-d0")


def _reachable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


@pytest.mark.app
async def test_services_listen_on_their_own_address_only(tmp_path: Path) -> None:
    """Own address 127.0.0.1; 127.0.0.2 is another address of this host (all of 127/8 is
    loopback): with bind_host=None nothing answers there, with 0.0.0.0 everything would."""
    rs = resolve(load_scenario("paper-prfaas", {"scale": {"speedup": 40, "byte_scale": 1024}}))
    dep = dataclasses.replace(loopback_deployment(rs, str(tmp_path)), bind_host=None)
    async with InProcessBackend(dep):
        d0 = dep.nodes["pd-d0"]
        assert d0.kv is not None
        checks = [(d0.http.host, d0.http.port), (d0.kv.host, d0.kv.port), (dep.router.host, dep.router.port)]
        for host, port in checks:
            assert await asyncio.to_thread(_reachable, host, port)
            assert not await asyncio.to_thread(_reachable, "127.0.0.2", port)
