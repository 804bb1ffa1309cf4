"""Where every service of a running scenario listens: written by a deploy backend, read by
each service process (`testbed serve ROLE --deployment FILE --id NODE`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.config.resolved import ResolvedScenario
from testbed.core.linkprofile import LinkProfile
from testbed.core.scenario import Scenario


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
    role: str            # prefill | decode
    cluster: str
    datacenter: str
    http: Endpoint
    kv: Endpoint | None = None    # KV receiver address as seen by senders (decode: prefill KV; prefill: cache moves)


@dataclass
class Deployment:
    """The resolved scenario plus every service's address: all a service process needs."""

    resolved: ResolvedScenario
    router: Endpoint
    nodes: dict[str, NodeEndpoint]
    run_dir: str | None = None
    bind_host: str = "127.0.0.1"          # address services bind to inside their host/namespace
    extra: dict[str, Any] = field(default_factory=dict)

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
                "extra": self.extra,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> "Deployment":
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
            extra=d.get("extra", {}),
        )

    def write(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def read(cls, path: Path) -> "Deployment":
        return cls.from_json(path.read_text())
