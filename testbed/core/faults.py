"""The fault timeline of a scenario, and what faults in force do to links and service times.

Pure: a scenario's `faults` become `FaultEvent`s sorted by start (paper seconds after the
replay's t0), each with its end and what it acts on; `faulted_links` turns the link parameters
in force plus the link faults active now into the parameters to shape with; `SlowDown` is a
node's service-time factor over time. The deploy layer executes the timeline (see
`testbed.deploy.faults`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from testbed.core.linkprofile import LinkParams
from testbed.core.scenario import (
    NODE_FAULTS, FaultSpec, KillFault, OutageFault, PartitionFault, RateDropFault, RestartFault, Scenario,
)

Link = tuple[str, str]          # (source datacenter, destination datacenter): one direction
Phase = Literal["start", "end"]


@dataclass(frozen=True)
class FaultEvent:
    index: int                  # position in the scenario's `faults` list
    spec: FaultSpec
    start_s: float              # paper seconds after t0
    end_s: float | None         # None: lasts to the end of the run (a kill)
    node: str | None            # the instance, for node faults
    links: tuple[Link, ...]     # the directions, for link faults (tcp_reset: every inter-DC one)

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def target(self) -> str:
        """What the fault acts on, for logs and reports: a node id, `a->b`, `a<->b` or `wan`."""
        if self.node is not None:
            return self.node
        s = self.spec
        if isinstance(s, PartitionFault):
            return f"{s.src}->{s.dst}"
        if isinstance(s, OutageFault | RateDropFault) and s.between is not None:
            return f"{s.between[0]}<->{s.between[1]}"
        return "wan"


@dataclass(frozen=True)
class FaultStep:
    """One thing to do at `t_s` (paper seconds after t0): start or end a fault."""

    t_s: float
    phase: Phase
    event: FaultEvent


def datacenters(sc: Scenario) -> list[str]:
    return list(dict.fromkeys(c.datacenter for c in sc.clusters))


def _links(sc: Scenario, spec: FaultSpec) -> tuple[Link, ...]:
    dcs = datacenters(sc)
    if isinstance(spec, PartitionFault):
        return ((spec.src, spec.dst),)
    if isinstance(spec, OutageFault | RateDropFault) and spec.between is not None:
        a, b = spec.between
        return ((a, b), (b, a))
    return tuple((a, b) for a in dcs for b in dcs if a != b)


def _end(spec: FaultSpec) -> float | None:
    if isinstance(spec, KillFault):
        return None
    if isinstance(spec, RestartFault):
        return spec.at_s + spec.down_s     # up again (starting) from then on
    return spec.at_s + spec.duration_s


def fault_timeline(sc: Scenario) -> list[FaultEvent]:
    """The scenario's faults sorted by start time (ties keep the file's order)."""
    out = []
    for i, f in enumerate(sc.faults):
        node = f.node_id() if isinstance(f, NODE_FAULTS) else None
        out.append(FaultEvent(i, f, f.at_s, _end(f), node, () if node is not None else _links(sc, f)))
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
    return isinstance(e.spec, OutageFault | RateDropFault | PartitionFault)


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
            if isinstance(e.spec, RateDropFault):
                out[link] = replace(p, rate_bps=p.rate_bps * e.spec.factor)
            else:
                out[link] = replace(p, loss=1.0, loss_correlation=0.0)
    return out


@dataclass
class SlowDown:
    """A node's service-time factor: `factor` until `until` (the driver's clock), else 1."""

    factor: float = 1.0
    until: float | None = None     # None with factor != 1: until cleared

    def set(self, factor: float, until: float | None) -> None:
        if factor <= 0:
            raise ValueError(f"slow factor must be > 0, got {factor}")
        self.factor, self.until = factor, until

    def at(self, now: float) -> float:
        if self.factor == 1.0 or (self.until is not None and now >= self.until):
            return 1.0
        return self.factor

