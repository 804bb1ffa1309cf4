"""Node instances of a scenario, named `{cluster}-p{i}` (prefill) and `{cluster}-d{i}` (decode).

With the long-term loop (`policy.control.long_term`) every instance of the PD cluster is a slot
that can hold either role (`testbed.core.control.roles`): both of its nodes exist, so the cluster has a
prefill and a decode node per slot, and the router routes only to the role each slot holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from testbed.core.schema.scenario import ClusterSpec, Scenario, node_id

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class NodeSpec:
    id: str
    cluster: str
    datacenter: str
    kind: str  # cluster kind: prfaas | pd
    role: Role
    index: int
    hardware: str


def role_slots(sc: Scenario, c: ClusterSpec) -> tuple[int, int]:
    """How many prefill and decode nodes cluster `c` runs: its counts, or with the long-term loop
    one of each per instance of the PD cluster."""
    if c.kind == "pd" and sc.policy.control.long_term.enabled:
        n = c.prefill + c.decode
        return n, n
    return c.prefill, c.decode


def node_specs(sc: Scenario) -> list[NodeSpec]:
    out: list[NodeSpec] = []
    for c in sc.clusters:
        n_p, n_d = role_slots(sc, c)
        for i in range(n_p):
            out.append(NodeSpec(node_id(c.name, "prefill", i), c.name, c.datacenter, c.kind, "prefill", i, c.hardware))
        for i in range(n_d):
            out.append(NodeSpec(node_id(c.name, "decode", i), c.name, c.datacenter, c.kind, "decode", i, c.hardware))
    return out


def local_dc(sc: Scenario) -> str:
    """The datacenter of the decode cluster: where the router and the clients sit (every
    emulating backend places them there; the simulator's router too)."""
    return next(c.datacenter for c in sc.clusters if c.kind == "pd" and c.decode > 0)
