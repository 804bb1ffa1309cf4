"""Turn a scenario into a Deployment: every service's role and address."""

from __future__ import annotations

from testbed.config.resolved import ResolvedScenario
from testbed.core.schema.topology import node_specs
from testbed.deploy.ports import free_ports
from testbed.live.deployment import Deployment, Endpoint, NodeEndpoint


def loopback_deployment(rs: ResolvedScenario, run_dir: str | None, host: str = "127.0.0.1") -> Deployment:
    specs = node_specs(rs.spec)
    ports = iter(free_ports(1 + 2 * len(specs), host))
    router = Endpoint(host, next(ports))
    nodes: dict[str, NodeEndpoint] = {}
    for s in specs:
        http = Endpoint(host, next(ports))
        kv = Endpoint(host, next(ports))
        nodes[s.id] = NodeEndpoint(s.id, s.role, s.cluster, s.datacenter, http, kv)
    return Deployment(rs, router, nodes, run_dir=run_dir, bind_host=host)
