"""A scenario's faults in virtual time, and the router's health probes.

`FaultRunner` executes the fault timeline (`testbed.core.fault_timeline.fault_timeline`) at its paper
times, as the live scheduler (`testbed.deploy.fault_injection`) does at t0 + at_s / speedup, and writes
the same `faults.jsonl` (`testbed.metrics.fault_effects.FaultLogFile`):

- kill: the instance is gone with its work (`Simulation.kill`); restart: gone, then up again,
  empty, `down_s` later plus the time a service takes to answer its health check (the live
  path's `restart_s`), which is when the end is logged, as live;
- pause: the instance computes, sends and answers nothing until the end; slow: its service
  times x factor for the jobs and steps that start within the window;
- outage, partition, rate_drop: the WAN links' parameters with the faults in force
  (`testbed.core.fault_timeline.faulted_links`), and what that does to the connections
  (`testbed.sim.wan`); tcp_reset: the connections crossing the WAN are reset during the window.

A fault the run ended before (every request done) is logged skipped, one cut short by the end
of the run gets an end line saying so, as live.

`Prober` is the router's active health check: every `PROBE_INTERVAL_S` wire seconds each
instance due is probed; an instance up answers at once, a killed one refuses, a paused one
does not answer within `PROBE_TIMEOUT_S`. Results go to the same health book the requests'
outcomes go to (`testbed.core.router.health`), with its startup grace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from testbed.core.fault_timeline import FaultEvent, Phase, fault_timeline
from testbed.core.json_types import JSONObject
from testbed.core.router.health import PROBE_INTERVAL_S, PROBE_TIMEOUT_S
from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.live_path import LivePathCosts
from testbed.core.schema.scaling import Scale
from testbed.core.schema.scenario import (
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
from testbed.metrics.fault_effects import FaultLogFile
from testbed.sim.events import FAULT, SAMPLE, Loop
from testbed.sim.net_view import Net
from testbed.sim.network import Network
from testbed.sim.reach import Reach
from testbed.sim.router import SimRouter
from testbed.sim.wan import ResetWindow


class FaultHost(Protocol):
    """What faults and probes need of the simulation (`testbed.sim.simulator.Simulation`)."""

    @property
    def sc(self) -> Scenario: ...
    @property
    def scale(self) -> Scale: ...
    @property
    def costs(self) -> LivePathCosts: ...
    @property
    def loop(self) -> Loop: ...
    @property
    def net(self) -> Net: ...
    @property
    def router(self) -> SimRouter: ...
    @property
    def reach(self) -> Reach: ...
    @property
    def busy(self) -> bool: ...
    def kill(self, node: str, t: float) -> None: ...
    def start(self, node: str, t: float) -> None: ...
    def pause(self, node: str, t: float) -> None: ...
    def resume(self, node: str, t: float) -> None: ...
    def slow(self, node: str, factor: float, until: float | None, t: float) -> None: ...


class FaultRunner:
    def __init__(self, sim: FaultHost, run_dir: Path | None) -> None:
        self.sim = sim
        self.timeline = fault_timeline(sim.sc)
        self.speedup = sim.scale.speedup
        self.log = FaultLogFile(run_dir / "faults.jsonl", self.speedup) if run_dir is not None else None
        self.lines: list[JSONObject] = []
        self.phase: dict[int, Phase] = {}
        self.links: list[FaultEvent] = []
        self.windows: dict[int, ResetWindow] = {}

    def start(self) -> None:
        for ev in self.timeline:
            self.sim.loop.at(ev.start_s, FAULT, self._step, (ev, "start"))
            if ev.end_s is not None:
                self.sim.loop.at(ev.end_s, FAULT, self._step, (ev, "end"))

    def _write(self, ev: FaultEvent, phase: Phase, outcome: str, detail: JSONObject, t: float) -> None:
        t_wire = t / self.speedup
        if self.log is not None:
            self.lines.append(self.log.write(ev, phase, outcome, detail, t_wire))
        else:
            self.lines.append(
                {
                    "t": round(t, 4),
                    "fault": ev.index,
                    "kind": ev.kind,
                    "phase": phase,
                    "target": ev.target,
                    "detail": detail,
                    "outcome": outcome,
                }
            )
        if phase == "start" or outcome == "ok":
            self.phase[ev.index] = phase

    def _step(self, arg: tuple[FaultEvent, Phase]) -> None:
        ev, phase = arg
        sim = self.sim
        if not sim.busy or (phase == "end" and ev.index not in self.phase):
            return  # the run ended first (`finish` says so)
        t = sim.loop.now
        spec = ev.spec
        node = ev.node or ""
        detail: JSONObject = {"modelled": True}
        match spec:
            case KillFault():
                sim.kill(node, t)
            case RestartFault():
                if phase == "start":
                    sim.kill(node, t)
                else:
                    up = t + sim.costs.restart_s * self.speedup
                    sim.loop.at(up, FAULT, self._restarted, ev)
                    return
            case PauseFault():
                (sim.pause if phase == "start" else sim.resume)(node, t)
            case SlowFault():
                if phase == "start":
                    sim.slow(node, spec.factor, ev.end_s, t)
                    detail.update({"slow": spec.factor, "until_s": ev.end_s})
                else:
                    sim.slow(node, 1.0, None, t)
            case OutageFault() | RateDropFault() | PartitionFault():
                if phase == "start":
                    self.links.append(ev)
                else:
                    self.links = [e for e in self.links if e is not ev]
                self._net().set_link_faults(self.links)
            case TcpResetFault():
                if phase == "start":
                    assert ev.end_s is not None
                    self.windows[ev.index] = self._net().faults.open_window(
                        ev.index, t, ev.end_s, None if spec.count == "all" else spec.count
                    )
                    detail = {"modelled": True, "ends": spec.ends}
                else:
                    detail.update(self._net().faults.close_window(self.windows.pop(ev.index)))
            case _:
                unknown_kind("fault kind", spec)
        self._write(ev, phase, "ok", detail, t)

    def _net(self) -> Network:
        """The run's network: a run with faults has the Python one (`new_network`)."""
        net = self.sim.net
        assert isinstance(net, Network)
        return net

    def _restarted(self, ev: FaultEvent) -> None:
        sim = self.sim
        if not sim.busy:
            return
        t = sim.loop.now
        sim.start(ev.node or "", t)
        self._write(ev, "end", "ok", {"modelled": True, "healthy_after_s_wire": sim.costs.restart_s}, t)

    def finish(self, t: float) -> None:
        """The run ended at `t`: faults it did not reach, and those it cut short."""
        for ev in self.timeline:
            phase = self.phase.get(ev.index)
            if phase is None:
                self._write(ev, "start", "skipped: the run ended first", {}, t)
            elif phase == "start" and ev.end_s is not None:
                detail: JSONObject = {"cut_short": True}
                if isinstance(ev.spec, TcpResetFault) and ev.index in self.windows:
                    detail.update(self._net().faults.close_window(self.windows.pop(ev.index)))
                self._write(ev, "end", "skipped: the run ended first", detail, t)
        if self.log is not None:
            self.log.close()


class Prober:
    def __init__(self, sim: FaultHost) -> None:
        self.sim = sim
        self.interval = PROBE_INTERVAL_S * sim.scale.speedup
        self.timeout = PROBE_TIMEOUT_S * sim.scale.speedup

    def start(self) -> None:
        self.sim.loop.at(0.0, SAMPLE, self._round)

    def _round(self, _: Any) -> None:
        sim = self.sim
        t = sim.loop.now
        router, reach = sim.router, sim.reach
        for n in router.books.health.due_probes(t):
            match reach.life[n]:
                case "up" if not reach.reachable(n):  # across a dark WAN: no answer in time
                    sim.loop.at(t + self.timeout, SAMPLE, self._unanswered, n)
                case "up":
                    router.note_health(n, "ok", t, "health probe answered 200", probe=True)
                case "down":
                    router.note_health(
                        n, "refused", t, "health probe: connection refused (the instance is down)", probe=True
                    )
                case _:
                    sim.loop.at(t + self.timeout, SAMPLE, self._unanswered, n)
        if sim.busy:
            sim.loop.at(t + self.interval, SAMPLE, self._round)

    def _unanswered(self, node: str) -> None:
        sim = self.sim
        if sim.reach.life[node] == "up" and sim.reach.reachable(node):  # it resumed (or the link came back) in time
            sim.router.note_health(node, "ok", sim.loop.now, "health probe answered 200", probe=True)
            return
        sim.router.note_health(
            node, "failed", sim.loop.now, f"health probe: no answer within {PROBE_TIMEOUT_S:g} s", probe=True
        )
