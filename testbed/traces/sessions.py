"""A trace's sessions: as its source states them, or inferred from its prefix block hashes.

Inference (a trace without session fields, such as Mooncake's): request R follows the earlier
request P when R's blocks extend P's reusable prefix, that is all of P's blocks but its last,
which a prompt that does not end on a block boundary leaves partial and a follow-up rewrites
(all of them when R holds them all). A prefix that more than `MAX_FANOUT` requests continue in
different ways is a shared prompt (a system prompt many conversations open with), which says
nothing about who follows whom: no request follows a request through it alone.
- Ties: of several such P, the one whose prefix R extends furthest; among equals the latest
  (the conversation's most recent turn).
- Branches: a P may be followed by several requests (a conversation edited and resent, an agent
  fanning out); each is a turn of P's session one deeper than P.
What it cannot see it leaves a first turn: a follow-up whose parent added no full block to a
shared prompt, a follow-up of a request outside the trace (cut off by a window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from testbed.core.sessions import ROOT, ArrivalMode, SessionPlan, plan_sessions
from testbed.traces.types import Trace, TraceRequest


def run_sessions(trace: Trace, arrivals: ArrivalMode) -> SessionPlan | None:
    """The sessions a run records and (closed loop) follows: the trace's stated ones; inferred
    from hash_ids only for a closed-loop run (inference reads the whole trace, which an open-loop
    run of a large trace without sessions need not pay for). None: no request follows another."""
    if arrivals == "open" and not has_stated_sessions(trace):
        return None
    plan, _ = session_plan(trace)
    return plan if plan.has_sessions else None


def has_stated_sessions(trace: Trace) -> bool:
    return any(r.parent_id or r.session_id for r in trace.requests)


# A prefix that more than this many requests continue differently is a shared prompt (a system
# prompt, an agent's tool list), not a turn of one conversation.
MAX_FANOUT = 3


def infer_parents(requests: list[TraceRequest]) -> list[int]:
    """Each request's parent index by the module's rule (`ROOT` for none)."""
    # A trie of every request's block hashes: node = dict child hash -> node, built whole first so
    # each node's fan-out (how many different blocks follow it) is known; then, in arrival order,
    # key -1 (never a hash: hashes are non-negative) holds the latest request registered there.
    root: dict[int, Any] = {}
    for r in requests:
        node = root
        for h in r.hash_ids:
            node = node.setdefault(h, {})
    out: list[int] = []
    for i, r in enumerate(requests):
        ids = r.hash_ids
        n = len(ids)
        best, best_depth = ROOT, 0
        node = root
        for depth, h in enumerate(ids, 1):
            node = node[h]
            if depth >= n:
                break  # a strict extension only: the same blocks again are a resend, not a turn
            who = node.get(-1)
            if who is not None and depth >= best_depth and len(node) - 1 <= MAX_FANOUT:
                best, best_depth = who, depth
        out.append(best)
        # Register R under its reusable prefix (all but its last block) and its whole prompt.
        node = root
        for depth, h in enumerate(ids, 1):
            node = node[h]
            if depth >= n - 1:
                node[-1] = i
    return out


def session_plan(trace: Trace) -> tuple[SessionPlan, str]:
    """The trace's plan and where its sessions come from: "stated" (the source's fields),
    "inferred" (from hash_ids) or "none"."""
    reqs = trace.requests
    ids = [r.request_id for r in reqs]
    ts = [r.timestamp for r in reqs]
    thinks = [r.think_s for r in reqs]
    if has_stated_sessions(trace):
        return plan_sessions(ids, ts, [r.parent_id for r in reqs], [r.session_id for r in reqs], thinks), "stated"
    parents = infer_parents(reqs)
    pids = [ids[p] if p != ROOT else "" for p in parents]
    plan = plan_sessions(ids, ts, pids, [""] * len(reqs), thinks)
    return plan, "inferred" if plan.has_sessions else "none"


@dataclass(frozen=True, slots=True)
class SessionStats:
    """What `trace info` says of a trace's sessions."""

    source: str  # stated | inferred | none
    sessions: int
    turns: int  # requests in sessions of two or more turns
    multi_turn_sessions: int
    turns_per_session: tuple[float, float, float, int]  # mean, P50, P90, max
    think_s: tuple[float, float, float] | None  # stated think times: mean, P50, P90
    gap_s: tuple[float, float, float] | None  # trace gap parent -> follow-up: mean, P50, P90


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _dist(xs: list[float]) -> tuple[float, float, float] | None:
    return (sum(xs) / len(xs), _pct(xs, 0.5), _pct(xs, 0.9)) if xs else None


def session_stats(trace: Trace) -> SessionStats:
    plan, source = session_plan(trace)
    sizes: dict[str, int] = {}
    for s in plan.session:
        sizes[s] = sizes.get(s, 0) + 1
    counts = [float(c) for c in sizes.values()]
    follow = [i for i, p in enumerate(plan.parent) if p != ROOT]
    thinks = [trace.requests[i].think_s for i in follow if math.isfinite(trace.requests[i].think_s)]
    multi = sum(1 for c in sizes.values() if c > 1)
    return SessionStats(
        source=source,
        sessions=len(sizes),
        turns=sum(c for c in sizes.values() if c > 1),
        multi_turn_sessions=multi,
        turns_per_session=(
            (sum(counts) / len(counts), _pct(counts, 0.5), _pct(counts, 0.9), int(max(counts)))
            if counts
            else (0.0, 0.0, 0.0, 0)
        ),
        think_s=_dist(thinks),
        gap_s=_dist([plan.gap[i] for i in follow]),
    )
