"""The PD cluster's instances as role slots, for the long-term loop (I/O-free).

The mock nodes run one process per role (`testbed.live.prefill_node`, `decode_node`), and a
real instance that changes role keeps its GPUs but restarts its engine in the other mode. The
testbed models that without touching the nodes: with `policy.control.long_term` every
instance of the PD cluster is a *slot* for which both a prefill and a decode node run
(`testbed.core.schema.topology.role_slots`), and the slot holds one role at a time. The router routes
only to the role each slot holds; the other node idles, as the GPUs would not serve it.
Converting a slot takes the role it holds out of routing (what that node was given runs to the
end: it drains) and, once nothing is left on it, brings the slot's node of the other role into
routing. A draining node is just one the router no longer picks, like an instance the health
book took out (`testbed.core.router.health`), so no node, wire message or deployment backend learns
about roles, and a conversion cannot lose a request.

Slot i holds prefill node `{cluster}-p{i}` and decode node `{cluster}-d{n-1-i}` (n slots): with
N_p prefill instances configured, slots 0..N_p-1 start as prefill (p0..p{N_p-1}) and the rest
as decode (d0..d{N_d-1}), the ids the cluster has without the loop.

States and transitions are data:

    prefill --convert--> to_decode --drained--> decode --convert--> to_prefill --drained--> prefill

A slot in a `to_*` state has neither node in routing.
"""

from __future__ import annotations

from typing import Literal

from testbed.core.schema.scenario import node_id

Role = Literal["prefill", "decode"]
SlotState = Literal["prefill", "decode", "to_decode", "to_prefill"]
SlotEvent = Literal["convert", "drained"]

_NEXT: dict[tuple[SlotState, SlotEvent], SlotState] = {
    ("prefill", "convert"): "to_decode",
    ("to_decode", "drained"): "decode",
    ("decode", "convert"): "to_prefill",
    ("to_prefill", "drained"): "prefill",
}


class RoleError(ValueError):
    """A transition the slot machine does not have (a driver bug, not user input)."""


def other(role: Role) -> Role:
    return "decode" if role == "prefill" else "prefill"


class RoleBook:
    def __init__(self, cluster: str, prefill: int, decode: int) -> None:
        if prefill < 0 or decode < 0 or prefill + decode < 1:
            raise ValueError(f"a cluster of {prefill} prefill and {decode} decode instances has no slot")
        self.cluster = cluster
        self.size = prefill + decode
        p: list[SlotState] = ["prefill"] * prefill
        d: list[SlotState] = ["decode"] * decode
        self.states = p + d

    def prefill_node(self, slot: int) -> str:
        return node_id(self.cluster, "prefill", slot)

    def decode_node(self, slot: int) -> str:
        return node_id(self.cluster, "decode", self.size - 1 - slot)

    def node(self, slot: int, role: Role) -> str:
        return self.prefill_node(slot) if role == "prefill" else self.decode_node(slot)

    def nodes(self) -> list[str]:
        return [n for i in range(self.size) for n in (self.prefill_node(i), self.decode_node(i))]

    def apply(self, slot: int, event: SlotEvent) -> SlotState:
        old = self.states[slot]
        new = _NEXT.get((old, event))
        if new is None:
            raise RoleError(f"slot {slot} of {self.cluster} is {old!r}: no {event!r} from there")
        self.states[slot] = new
        return new

    def holding(self, role: Role) -> list[int]:
        """Slots that hold `role` and are routed to."""
        return [i for i, s in enumerate(self.states) if s == role]

    def routable(self, role: Role) -> list[str]:
        return [self.node(i, role) for i in self.holding(role)]

    def unroutable(self) -> frozenset[str]:
        """Every node of the cluster the router must not pick: the role a slot does not hold, and
        both nodes of a slot changing role."""
        live = set(self.routable("prefill")) | set(self.routable("decode"))
        return frozenset(n for n in self.nodes() if n not in live)

    def draining(self) -> list[tuple[int, str, Role]]:
        """(slot, the node draining, the role it goes to) of every slot changing role."""
        out: list[tuple[int, str, Role]] = []
        for i, s in enumerate(self.states):
            if s == "to_decode":
                out.append((i, self.prefill_node(i), "decode"))
            elif s == "to_prefill":
                out.append((i, self.decode_node(i), "prefill"))
        return out

    def counts(self) -> dict[str, int]:
        """Slots routed as prefill, as decode, and changing role."""
        return {
            "prefill": len(self.holding("prefill")),
            "decode": len(self.holding("decode")),
            "draining": len(self.draining()),
        }
