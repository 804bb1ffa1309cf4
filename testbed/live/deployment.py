"""Where every service of a running scenario listens: written by a deploy backend, read by
each service process (`testbed serve ROLE --deployment FILE --id NODE`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from testbed.config.resolved import ResolvedScenario
from testbed.core.json_types import JSONObject
from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scenario import Scenario
from testbed.live.credentials import Credentials


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class NodeEndpoint:
    id: str
    role: str  # prefill | decode
    cluster: str
    datacenter: str
    http: Endpoint
    kv: Endpoint | None = None  # KV receiver address as seen by senders (decode: prefill KV; prefill: cache moves)


@dataclass
class Deployment:
    """The resolved scenario plus every service's address: all a service process needs."""

    resolved: ResolvedScenario
    router: Endpoint
    nodes: dict[str, NodeEndpoint]
    run_dir: str | None = None
    # Address every service binds to; None: each binds to the host of its own endpoints (its
    # namespace's or container's address), so nothing listens on the others.
    bind_host: str | None = "127.0.0.1"
    # HTTP also on 127.0.0.1 (containers: the engine's health check connects there; loopback is
    # reachable only from inside the container).
    bind_loopback: bool = False
    extra: JSONObject = field(default_factory=dict)
    # The API key and run secret: never written with the rest (`to_json`); a service started by a
    # backend reads them from its environment (`read`).
    credentials: Credentials = field(default_factory=Credentials.new, repr=False)

    def http_binds(self, service_id: str) -> list[str]:
        """Addresses the HTTP server of `service_id` ("router" or a node id) listens on."""
        if self.bind_host is not None:
            hosts = [self.bind_host]
        else:
            hosts = [(self.router if service_id == "router" else self.nodes[service_id].http).host]
        if self.bind_loopback and "127.0.0.1" not in hosts:
            hosts.append("127.0.0.1")
        return hosts

    def kv_bind(self, node_id: str) -> str:
        """Address the KV receiver of `node_id` listens on."""
        if self.bind_host is not None:
            return self.bind_host
        kv = self.nodes[node_id].kv
        if kv is None:
            raise ValueError(f"node {node_id} has no KV endpoint")
        return kv.host

    def node_hosts(self) -> frozenset[str]:
        """Every node's addresses: where KV may come from (prefill to decode, cache moves)."""
        return frozenset(h for n in self.nodes.values() for h in (n.http.host, n.kv.host if n.kv else n.http.host))

    @property
    def scenario(self) -> Scenario:
        return self.resolved.spec

    @property
    def threshold(self) -> float | None:
        """The routing threshold in force at start (tokens)."""
        return self.resolved.threshold

    @property
    def inter_dc(self) -> LinkProfile:
        return self.resolved.inter_dc

    def to_json(self) -> str:
        return json.dumps(
            {
                "resolved": self.resolved.to_json_dict(),
                "router": asdict(self.router),
                "nodes": {k: asdict(v) for k, v in self.nodes.items()},
                "run_dir": self.run_dir,
                "bind_host": self.bind_host,
                "bind_loopback": self.bind_loopback,
                "extra": self.extra,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, credentials: Credentials | None = None) -> Deployment:
        """The deployment `to_json` wrote, with `credentials` (None: fresh ones)."""
        d = json.loads(text)
        nodes = {}
        for k, v in d["nodes"].items():
            kv = Endpoint(**v["kv"]) if v.get("kv") else None
            nodes[k] = NodeEndpoint(v["id"], v["role"], v["cluster"], v["datacenter"], Endpoint(**v["http"]), kv)
        return cls(
            resolved=ResolvedScenario.model_validate(d["resolved"]),
            router=Endpoint(**d["router"]),
            nodes=nodes,
            run_dir=d.get("run_dir"),
            bind_host=d.get("bind_host", "127.0.0.1"),
            bind_loopback=bool(d.get("bind_loopback", False)),
            extra=d.get("extra", {}),
            credentials=credentials if credentials is not None else Credentials.new(),
        )

    def write(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def read(cls, path: Path) -> Deployment:
        """A service's deployment: the file, and the credentials its backend put in the environment."""
        return cls.from_json(path.read_text(), Credentials.from_env())
