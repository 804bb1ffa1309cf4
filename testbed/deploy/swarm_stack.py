"""The swarm backend's stack files, pure (no I/O): `stack.yaml`'s document, the WAN router's `wan.json`
and the deployment every service reads, with the labels and paths they share with `testbed.deploy.swarm`."""

from __future__ import annotations

from dataclasses import replace

from testbed.config.resolved import ResolvedScenario
from testbed.core.json_types import JSONObject
from testbed.core.schema.linkprofile import LinkParams, LinkProfile
from testbed.core.schema.scenario import Scenario
from testbed.core.schema.topology import node_specs
from testbed.deploy.compose import (
    CREDENTIAL_ENV,
    HEALTH_CMD,
    HTTP_PORT,
    IN_CONTAINER,
    Layout,
    dc_subnets,
    deployment_for,
    layout,
)
from testbed.deploy.discovery import EXTRA_KEY, with_hosts
from testbed.deploy.engine import PROJECT_LABEL
from testbed.deploy.subnets import SWARM_BASES
from testbed.live.deployment import Deployment
from testbed.net.container_wan import wan_config

SUBNET_BASE = SWARM_BASES[0]  # the first choice; apart from compose's and netns's 10.231
OVERLAY_MTU = 65000
VXLAN_OVERHEAD = 50  # Docker gives containers the overlay's MTU minus this
CONFIG_DIR = "/etc/testbed"  # swarm configs (read-only files)
WAN_RUN = "/run/wan"  # the WAN router's own state: delay line config (beside "ready") and socket
DC_LABEL = "prfaas.dc."  # node label prfaas.dc.<dc>=true: the node may run that DC's services
WAN_LABEL = "prfaas.wan"  # node label prfaas.wan=true: the node may run the WAN router
DISCOVER_URL = f"http://wan:{HTTP_PORT}"


def dc_label(dc: str) -> str:
    return DC_LABEL + dc


def _constraint(label: str) -> str:
    return f"node.labels.{label} == true"


def container_mtu(profile: LinkProfile) -> int:
    """MTU the containers get: the link profile's if it sets one, else the largest the overlay allows."""
    return profile.mtu if profile.mtu else OVERLAY_MTU - VXLAN_OVERHEAD


def swarm_deployment(rs: ResolvedScenario, lay: Layout) -> Deployment:
    """The deployment every service reads: service names as hosts until discovery fills in
    addresses, and what discovery needs (who is in which DC, the DC subnets)."""
    dep = with_hosts(deployment_for(rs, lay), {sid: sid for sid in lay["hosts"]})
    info: JSONObject = {"members": {sid: dc for sid, (dc, _) in lay["hosts"].items()}, "subnets": {**dc_subnets(lay)}}
    return replace(dep, extra={**dep.extra, EXTRA_KEY: info})


def wan_stack_config(project: str, lay: Layout, links: dict[tuple[str, str], LinkParams], mtu: int) -> JSONObject:
    """wan.json for `testbed.deploy.swarm_wan`: addresses blank (found by subnet), method probed there."""
    cfg = wan_config(
        project,
        [(dc, subnet, "") for dc, (_, subnet) in lay["dcs"].items()],
        links,
        "auto",
        mtu,
        f"{WAN_RUN}/dl.sock",
        f"{IN_CONTAINER}/timeseries/delayline.jsonl",
        f"{WAN_RUN}/ready",
    )
    cfg["members"] = {sid: dc for sid, (dc, _) in lay["hosts"].items()}
    cfg["run_dir"] = IN_CONTAINER
    return cfg


def stack_spec(sc: Scenario, profile: LinkProfile, project: str, image: str, base: str = SUBNET_BASE) -> JSONObject:
    """The stack document (pure: no I/O). Config files are named relative to it; `base`: the
    block of the datacenter networks (deploy/subnets.py)."""
    lay = layout(sc, base)
    labels = {PROJECT_LABEL: project}
    tcp = profile.tcp
    sysctls: dict[str, str] = {}
    if tcp.rmem_max:
        sysctls["net.ipv4.tcp_rmem"] = f"4096 131072 {tcp.rmem_max}"
    if tcp.wmem_max:
        sysctls["net.ipv4.tcp_wmem"] = f"4096 16384 {tcp.wmem_max}"
    networks: JSONObject = {
        f"dc-{dc}": {
            "driver": "overlay",
            "attachable": True,
            "driver_opts": {"com.docker.network.driver.mtu": str(container_mtu(profile) + VXLAN_OVERHEAD)},
            "ipam": {"config": [{"subnet": subnet}]},
            "labels": {**labels},
        }
        for dc, (_, subnet) in lay["dcs"].items()
    }

    def common(label: str) -> JSONObject:
        # restart none: a task that fails stays failed, and the run reports it (as compose does).
        return {
            "image": image,
            "cap_add": ["NET_ADMIN"],
            "labels": {**labels},
            "healthcheck": {"test": list(HEALTH_CMD), "interval": "2s", "timeout": "10s", "retries": 150},
            "stop_grace_period": "5s",
            "deploy": {
                "endpoint_mode": "dnsrr",
                "replicas": 1,
                "restart_policy": {"condition": "none"},
                "labels": {**labels},
                "placement": {"constraints": [_constraint(label)]},
            },
        }

    roles = {n.id: n.role for n in node_specs(sc)}
    services: JSONObject = {}
    for sid, (dc, _) in lay["hosts"].items():
        services[sid] = {
            **common(dc_label(dc)),
            "command": [
                "serve",
                roles.get(sid, "router"),
                "--deployment",
                f"{CONFIG_DIR}/deployment.json",
                "--id",
                sid,
                "--discover",
                DISCOVER_URL,
                "--serve-files",
            ],
            "networks": [f"dc-{dc}"],
            "sysctls": {**sysctls},
            "environment": [*CREDENTIAL_ENV],  # values from the deploying CLI's environment
            "configs": [{"source": "deployment", "target": f"{CONFIG_DIR}/deployment.json"}],
        }
    services["wan"] = {
        **common(WAN_LABEL),
        "entrypoint": ["python3", "-m", "testbed.deploy.swarm_wan", f"{CONFIG_DIR}/wan.json"],
        "init": True,
        "networks": [*networks],
        "sysctls": {
            "net.ipv4.ip_forward": "1",
            "net.ipv4.conf.all.rp_filter": "0",
            "net.ipv4.conf.default.rp_filter": "0",
        },
        "configs": [{"source": "wan", "target": f"{CONFIG_DIR}/wan.json"}],
    }
    configs: JSONObject = {
        "deployment": {"file": "./deployment.json", "labels": {**labels}},
        "wan": {"file": "./wan.json", "labels": {**labels}},
    }
    return {"version": "3.8", "services": services, "networks": networks, "configs": configs}
