"""Node instances of a scenario, named `{cluster}-p{i}` (prefill) and `{cluster}-d{i}` (decode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from testbed.core.scenario import Scenario, node_id

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class NodeSpec:
    id: str
    cluster: str
    datacenter: str
    kind: str          # cluster kind: prfaas | pd
    role: Role
    index: int
    hardware: str


def node_specs(sc: Scenario) -> list[NodeSpec]:
    out: list[NodeSpec] = []
    for c in sc.clusters:
        for i in range(c.prefill):
            out.append(NodeSpec(node_id(c.name, "prefill", i), c.name, c.datacenter, c.kind, "prefill", i, c.hardware))
        for i in range(c.decode):
            out.append(NodeSpec(node_id(c.name, "decode", i), c.name, c.datacenter, c.kind, "decode", i, c.hardware))
    return out
