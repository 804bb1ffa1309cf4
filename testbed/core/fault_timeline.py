"""The fault timeline of a scenario, and what faults in force do to links and service times.

Pure: a scenario's `faults` become `FaultEvent`s sorted by start (paper seconds after the
replay's t0), each with its end and what it acts on; `faulted_links` turns the link parameters
in force plus the link faults active now into the parameters to shape with; `SlowDown` is a
node's service-time factor over time. The deploy layer executes the timeline (see
`testbed.deploy.fault_injection`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, get_args

from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.linkprofile import LinkParams
from testbed.core.schema.scenario import (
    FaultKind,
    FaultSpec,
    KillFault,
    OutageFault,
    PartitionFault,
    PauseFault,
    RateDropFault,
    RestartFault,
    Scenario,
    SlowFault,
    TcpResetFault,
)

Link = tuple[str, str]  # (source datacenter, destination datacenter): one direction
Phase = Literal["start", "end"]
# What a fault acts on: one node instance, link parameters, or the connections crossing the WAN.
Scope = Literal["node", "link", "connection"]


def kind_scope(kind: FaultKind) -> Scope:
    match kind:
        case "kill" | "pause" | "restart" | "slow":
            return "node"
        case "outage" | "rate_drop" | "partition":
            return "link"
        case "tcp_reset":
            return "connection"
        case _:
            unknown_kind("fault kind", kind, get_args(FaultKind))


def fault_scope(spec: FaultSpec) -> Scope:
    return kind_scope(spec.kind)


NODE_KINDS: tuple[FaultKind, ...] = tuple(k for k in get_args(FaultKind) if kind_scope(k) == "node")


@dataclass(frozen=True)
class FaultEvent:
    index: int  # position in the scenario's `faults` list
    spec: FaultSpec
    start_s: float  # paper seconds after t0
    end_s: float | None  # None: lasts to the end of the run (a kill)
    node: str | None  # the instance, for node faults
    links: tuple[Link, ...]  # the directions, for link faults (tcp_reset: every inter-DC one)

    @property
    def kind(self) -> FaultKind:
        return self.spec.kind

    @property
    def target(self) -> str:
        """What the fault acts on, for logs and reports: a node id, `a->b`, `a<->b` or `wan`."""
        if self.node is not None:
            return self.node
        match self.spec:
            case PartitionFault(src=src, dst=dst):
                return f"{src}->{dst}"
            case OutageFault(between=(a, b)) | RateDropFault(between=(a, b)):
                return f"{a}<->{b}"
            case OutageFault() | RateDropFault() | TcpResetFault():
                return "wan"
            case KillFault() | PauseFault() | RestartFault() | SlowFault():
                return self.spec.node_id()
            case _:
                unknown_kind("fault kind", self.spec)


@dataclass(frozen=True)
class FaultStep:
    """One thing to do at `t_s` (paper seconds after t0): start or end a fault."""

    t_s: float
    phase: Phase
    event: FaultEvent


def datacenters(sc: Scenario) -> list[str]:
    return list(dict.fromkeys(c.datacenter for c in sc.clusters))


def _node(spec: FaultSpec) -> str | None:
    match spec:
        case KillFault() | PauseFault() | RestartFault() | SlowFault():
            return spec.node_id()
        case OutageFault() | RateDropFault() | PartitionFault() | TcpResetFault():
            return None
        case _:
            unknown_kind("fault kind", spec)


def _links(sc: Scenario, spec: FaultSpec) -> tuple[Link, ...]:
    match spec:
        case PartitionFault(src=src, dst=dst):
            return ((src, dst),)
        case OutageFault(between=(a, b)) | RateDropFault(between=(a, b)):
            return ((a, b), (b, a))
        case OutageFault() | RateDropFault() | TcpResetFault():
            dcs = datacenters(sc)
            return tuple((a, b) for a in dcs for b in dcs if a != b)
        case KillFault() | PauseFault() | RestartFault() | SlowFault():
            return ()
        case _:
            unknown_kind("fault kind", spec)


def _end(spec: FaultSpec) -> float | None:
    match spec:
        case KillFault():
            return None
        case RestartFault():
            return spec.at_s + spec.down_s  # up again (starting) from then on
        case PauseFault() | SlowFault() | OutageFault() | RateDropFault() | PartitionFault() | TcpResetFault():
            return spec.at_s + spec.duration_s
        case _:
            unknown_kind("fault kind", spec)


def fault_timeline(sc: Scenario) -> list[FaultEvent]:
    """The scenario's faults sorted by start time (ties keep the file's order)."""
    out = [FaultEvent(i, f, f.at_s, _end(f), _node(f), _links(sc, f)) for i, f in enumerate(sc.faults)]
    return sorted(out, key=lambda e: (e.start_s, e.index))


def fault_steps(timeline: Iterable[FaultEvent]) -> list[FaultStep]:
    """Starts and ends in time order; at equal times an end goes before a start, so a fault that
    ends as another begins on the same target leaves the second one in force."""
    steps = []
    for e in timeline:
        steps.append(FaultStep(e.start_s, "start", e))
        if e.end_s is not None:
            steps.append(FaultStep(e.end_s, "end", e))
    return sorted(steps, key=lambda s: (s.t_s, s.phase != "end", s.event.index))


def shapes_links(e: FaultEvent) -> bool:
    """Faults that change link parameters (a tcp_reset does not: it acts on connections)."""
    return fault_scope(e.spec) == "link"


def faulted_links(base: Mapping[Link, LinkParams], active: Iterable[FaultEvent]) -> dict[Link, LinkParams]:
    """The parameters to shape each direction with: `base` (the profile and its schedule) with the
    active link faults applied. An outage or partition loses every packet (shapers cannot do
    rate 0); rate drops multiply."""
    out = dict(base)
    for e in active:
        if not shapes_links(e):
            continue
        for link in e.links:
            if link not in out:
                continue
            p = out[link]
            match e.spec:
                case RateDropFault(factor=factor):
                    out[link] = replace(p, rate_bps=p.rate_bps * factor)
                case OutageFault() | PartitionFault():
                    out[link] = replace(p, loss=1.0, loss_correlation=0.0)
                case KillFault() | PauseFault() | RestartFault() | SlowFault() | TcpResetFault():
                    pass  # shapes no link
                case _:
                    unknown_kind("fault kind", e.spec)
    return out


# The service-time factors a node takes (the scenario's slow fault: factor in (1, 1000]).
MIN_SLOW_FACTOR = 1e-3
MAX_SLOW_FACTOR = 1000.0


@dataclass
class SlowDown:
    """A node's service-time factor: `factor` until `until` (the driver's clock), else 1."""

    factor: float = 1.0
    until: float | None = None  # None with factor != 1: until cleared

    def set(self, factor: float, until: float | None) -> None:
        if not MIN_SLOW_FACTOR <= factor <= MAX_SLOW_FACTOR:  # also refuses NaN
            raise ValueError(f"slow factor must be in [{MIN_SLOW_FACTOR:g}, {MAX_SLOW_FACTOR:g}], got {factor}")
        self.factor, self.until = factor, until

    def at(self, now: float) -> float:
        if self.factor == 1.0 or (self.until is not None and now >= self.until):
            return 1.0
        return self.factor
