"""Turn a scenario into a Deployment: every service's role and address."""

from __future__ import annotations

from testbed.core.scenario import Scenario
from testbed.core.topology import node_specs
from testbed.deploy.ports import free_ports
from testbed.live.deployment import Deployment, Endpoint, NodeEndpoint


def loopback_deployment(sc: Scenario, run_dir: str | None, threshold: float | None,
                        host: str = "127.0.0.1") -> Deployment:
    specs = node_specs(sc)
    ports = iter(free_ports(1 + 2 * len(specs), host))
    router = Endpoint(host, next(ports))
    nodes: dict[str, NodeEndpoint] = {}
    for s in specs:
        http = Endpoint(host, next(ports))
        kv = Endpoint(host, next(ports))
        nodes[s.id] = NodeEndpoint(s.id, s.role, s.cluster, s.datacenter, http, kv)
    return Deployment(sc, router, nodes, run_dir=run_dir, threshold=threshold, bind_host=host)
