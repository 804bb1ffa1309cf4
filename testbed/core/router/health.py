"""Instance health as the router sees it: which instances may be routed to.

Passive: the router reports each call's outcome. A failure that proves nothing answers (the
connection refused or reset before any reply) takes the instance out at once; other failures
(timeouts, a 5xx) count, and `max_failures` in a row take it out. Active: the driver probes
every instance every `probe_interval_s` (a cheap GET); a down instance that answers comes back,
an up one that does not answer in time counts a failure (a paused process accepts connections
but never replies, so only the probe notices it). A probe that fails on an instance that has
never answered, within `startup_grace_s` of the first probe round, counts nothing: the router
starts beside its instances and its first probes reach some before they listen (seen in every
netns run: 3-14 instances out for the first 0.5 s). A request refused there still takes it out.

States and transitions are data; every change is returned as a `HealthChange` with its reason,
for the router's decision log.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

State = Literal["up", "down"]

# Wire seconds: what the router's probes do on any host (the simulator scales them to paper time).
PROBE_INTERVAL_S = 0.5  # between two probes of one instance
PROBE_TIMEOUT_S = 2.0  # a probe not answered by then counts a failure
STARTUP_GRACE_S = 30.0  # see the module's docstring
MAX_FAILURES = 3
Outcome = Literal["ok", "refused", "failed"]

# (state, outcome) -> next state, before the consecutive-failure rule below.
_NEXT: dict[tuple[State, Outcome], State] = {
    ("up", "ok"): "up",
    ("up", "refused"): "down",
    ("up", "failed"): "up",  # down only after max_failures in a row
    ("down", "ok"): "up",
    ("down", "refused"): "down",
    ("down", "failed"): "down",
}


@dataclass(frozen=True)
class HealthChange:
    node: str
    old: State
    new: State
    now: float
    reason: str


@dataclass
class _Instance:
    state: State = "up"
    failures: int = 0  # consecutive
    next_probe: float = 0.0
    last_reason: str = ""
    answered: bool = False  # has answered a call or a probe at least once


class HealthBook:
    def __init__(
        self,
        nodes: Iterable[str],
        max_failures: int = MAX_FAILURES,
        probe_interval_s: float = PROBE_INTERVAL_S,
        startup_grace_s: float = STARTUP_GRACE_S,
    ) -> None:
        if max_failures < 1:
            raise ValueError("max_failures must be >= 1")
        self.max_failures = max_failures
        self.probe_interval_s = probe_interval_s
        self.startup_grace_s = startup_grace_s
        self._first_probe: float | None = None
        self._nodes = {n: _Instance() for n in nodes}
        self._down: frozenset[str] = frozenset()  # kept as states change: routing asks for it per request

    def state(self, node: str) -> State:
        return self._nodes[node].state

    def down(self) -> frozenset[str]:
        return self._down

    def report(
        self, node: str, outcome: Outcome, now: float, reason: str = "", probe: bool = False
    ) -> HealthChange | None:
        """One call's (or probe's) outcome; returns the change of state it caused, if any."""
        inst = self._nodes.get(node)
        if inst is None:
            return None
        if outcome == "ok":
            inst.answered = True
        elif probe and not inst.answered and self._starting(now):
            return None
        old = inst.state
        new = _NEXT[(old, outcome)]
        if outcome == "ok":
            inst.failures = 0
        else:
            inst.failures += 1
            inst.last_reason = reason or outcome
            if inst.failures >= self.max_failures:
                new = "down"
        inst.state = new
        if new == old:
            return None
        self._down = self._down | {node} if new == "down" else self._down - {node}
        why = "answered again" if new == "up" else f"{inst.failures} failure(s) in a row, last: {inst.last_reason}"
        return HealthChange(node, old, new, now, why)

    def _starting(self, now: float) -> bool:
        return self._first_probe is None or now - self._first_probe < self.startup_grace_s

    def due_probes(self, now: float) -> list[str]:
        """Instances whose probe is due; each is scheduled again `probe_interval_s` later."""
        if self._first_probe is None:
            self._first_probe = now
        due = []
        for n, inst in self._nodes.items():
            if now >= inst.next_probe:
                inst.next_probe = now + self.probe_interval_s
                due.append(n)
        return due
