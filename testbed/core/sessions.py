"""Sessions and the closed-loop rule: when a turn may leave, what a failed parent does.

The one rule the live replayer and the simulator both follow (times are paper seconds on the
trace's axis; the drivers map them to their clocks):

- a first turn (no parent, or a parent the trace does not hold, e.g. cut off by a window or a
  sample) leaves at its trace timestamp, as in open loop;
- a follow-up leaves at `max(parent_done + think, parent_sent + gap)`, where `gap` is the trace's
  time between the parent's arrival and its own, and `think` is the turn's own think time where the
  source states one (the synthesiser, aiperf's delays) and 0 where it does not. The trace's gap
  already holds the original deployment's answer time plus the user's think time, which cannot be
  told apart: while the system under test keeps up, the turn keeps the trace's pacing (it leaves
  at its own timestamp shifted by its parent's delay); when it falls behind, the turn waits for
  the answer it follows, and never leaves before it;
- a failed parent does not end its session: the next turn leaves by the same rule, counting from
  when the failure was known. The trace says the user went on, and a replay that dropped the rest
  of the session would offer less load than the trace exactly when the system fails.

Open-loop replay of a session trace sends each turn at its timestamp; `early_turns` counts the
turns that left before their parent had finished.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ROOT = -1  # parent index of a first turn
# How a run sends a trace: open (each request at its timestamp) or closed (the rule above).
ArrivalMode = Literal["open", "closed"]
ARRIVAL_MODES: tuple[ArrivalMode, ...] = ("open", "closed")


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """Each request's parent (its index in the trace, `ROOT` for a first turn), its place in its
    session (turn 1 = first) and its session's name; `gap` and `think` as the module says."""

    parent: tuple[int, ...]
    turn: tuple[int, ...]
    session: tuple[str, ...]
    gap: tuple[float, ...]
    think: tuple[float, ...]

    @property
    def has_sessions(self) -> bool:
        """Some request follows another."""
        return any(p != ROOT for p in self.parent)

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.parent]
        for i, p in enumerate(self.parent):
            if p != ROOT:
                out[p].append(i)
        return out


def plan_sessions(
    ids: Sequence[str],
    timestamps: Sequence[float],
    parent_ids: Sequence[str],
    session_ids: Sequence[str],
    think_s: Sequence[float],
) -> SessionPlan:
    """The plan of a trace's requests (in arrival order) from their stated parents. A parent must
    come earlier in the trace; one that does not (or is not in it) makes the turn a first turn."""
    at = {rid: i for i, rid in enumerate(ids)}
    parent: list[int] = []
    turn: list[int] = []
    session: list[str] = []
    gap: list[float] = []
    think: list[float] = []
    for i, rid in enumerate(ids):
        p = at.get(parent_ids[i], ROOT) if parent_ids[i] else ROOT
        if p >= i:
            p = ROOT
        parent.append(p)
        turn.append(1 if p == ROOT else turn[p] + 1)
        session.append(session_ids[i] or (rid if p == ROOT else session[p]))
        gap.append(0.0 if p == ROOT else timestamps[i] - timestamps[p])
        th = think_s[i]
        think.append(th if th >= 0 and math.isfinite(th) else 0.0)
    return SessionPlan(tuple(parent), tuple(turn), tuple(session), tuple(gap), tuple(think))


class ClosedLoop:
    """Which turns are released, and when (the module's rule). The driver calls `sent` when a
    request leaves and `done` when its answer (or its failure) is known; `done` returns the turns
    it releases with the paper time each may leave at."""

    def __init__(self, plan: SessionPlan) -> None:
        self.plan = plan
        self._children = plan.children()
        self._sent = [math.nan] * len(plan.parent)

    def first_turns(self) -> list[int]:
        """The requests that leave at their own timestamps, in trace order."""
        return [i for i, p in enumerate(self.plan.parent) if p == ROOT]

    def sent(self, i: int, t: float) -> None:
        self._sent[i] = t

    def done(self, i: int, t: float) -> list[tuple[int, float]]:
        plan = self.plan
        sent = self._sent[i]
        base = t if math.isnan(sent) else sent
        return [(c, max(t + plan.think[c], base + plan.gap[c])) for c in self._children[i]]


def early_turns(parent: Sequence[int], sent: Sequence[float], finished: Sequence[float]) -> int:
    """How many follow-ups left before their parent had finished (NaN finish: never finished,
    so any follow-up sent counts as early)."""
    n = 0
    for i, p in enumerate(parent):
        if p == ROOT or math.isnan(sent[i]):
            continue
        f = finished[p]
        if math.isnan(f) or sent[i] < f:
            n += 1
    return n
