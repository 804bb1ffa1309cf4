"""The mean TTFT difference between the testbed and a peer split, from the two runs' paired
records, into what made it: an exact sum, each term a mean over the requests both completed.

- cache: the single-prompt prefill time (the timing table both sides read) of the tokens each
  side found cached, testbed minus peer: where one side's prefix cache held more;
- batching: each side's prefill compute beyond that single-prompt time (a pass shared with other
  prompts, a prompt cut in chunks, each paying a pass), testbed minus peer: the prefill scheduler;
- placed: waits for a prefill instance while another instance of the pool computed nothing (the
  router put the request behind a busy one), testbed minus peer: the router's choice;
- queue: every other wait for a prefill instance (all were busy): load;
- other: the remaining stages (routing, KV transfer, decode admission, first step).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from testbed.core.engine.servicetime import PrefillTime
from testbed.core.record import RequestRecord
from testbed.core.schema.hardware import HardwareSpec
from testbed.metrics.summary import breakdown_wire
from testbed.studies.crosscheck.crosscheck_explain import Side

WAITED_S = 1e-3  # a wait shorter than this (paper s) is a step boundary, not queueing


def placed_waits(side: Side) -> dict[int, float]:
    """Trace index -> prefill queue wait (paper s) of each completed request that waited while
    another prefill instance was idle, judged from the records: every instance's busy spans
    (prefill start to end of the requests it computed)."""
    s = side.speedup
    done = [r for r in side.records if r.outcome == "completed" and r.prefill_node]
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in done:
        a, b = r.times.prefill_start, r.times.prefill_end
        if math.isfinite(a) and math.isfinite(b):
            spans[r.prefill_node].append((a, b))
    # Merged per instance: a batching instance's spans overlap (several prompts in its passes).
    merged: dict[str, list[tuple[float, float]]] = {}
    for node, sp in spans.items():
        sp.sort()
        out: list[tuple[float, float]] = []
        for a, b in sp:
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        merged[node] = out
    starts = {node: [a for a, _ in sp] for node, sp in merged.items()}

    def busy(node: str, t: float) -> bool:
        i = bisect.bisect_right(starts[node], t) - 1
        return i >= 0 and merged[node][i][1] > t

    placed: dict[int, float] = {}
    for r in done:
        w = (r.times.prefill_start - r.times.prefill_queued) * s
        if not math.isfinite(w) or w <= WAITED_S:
            continue
        if any(n != r.prefill_node and not busy(n, r.times.prefill_queued) for n in merged):
            placed[r.trace_index] = w
    return placed


def prefill_load(side: Side, hw: HardwareSpec) -> tuple[float, float]:
    """(mean, busiest) prefill instance load: the single-prompt time of the tokens each computed
    (what its prompts would take one whole prompt a pass) over the run's prefill span, from the
    records: more cache misses or a router that concentrates prompts raise it, and a batching
    scheduler then shares more passes and queues more."""
    t = PrefillTime.from_spec(hw.prefill)
    work: dict[str, float] = defaultdict(float)
    lo, hi = math.inf, -math.inf
    for r in side.records:
        if r.outcome != "completed" or not r.prefill_node or not math.isfinite(r.times.prefill_end):
            continue
        work[r.prefill_node] += t(r.input_tokens - r.cached_tokens, r.cached_tokens)
        lo, hi = min(lo, r.times.arrival), max(hi, r.times.prefill_end)
    span = (hi - lo) * side.speedup
    if not work or span <= 0:
        return math.nan, math.nan
    return statistics.fmean(work.values()) / span, max(work.values()) / span


@dataclass(frozen=True)
class Placement:
    """Where the router sent prompts, from the records: to an instance already computing another
    prompt (then it waits for the pass in flight and may share the next ones), and how many of those
    while another instance was idle; and how many prompts shared a pass with another."""

    sent_busy: int
    sent_busy_idle_elsewhere: int
    shared: int


def placement(side: Side) -> Placement:
    done = [r for r in side.records if r.outcome == "completed" and r.prefill_node]
    by: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in done:
        by[r.prefill_node].append(r)
    cols = {
        n: (
            np.array([x.times.prefill_start for x in v]),
            np.array([x.times.prefill_end for x in v]),
            np.array([x.trace_index for x in v]),
        )
        for n, v in by.items()
    }

    def busy(node: str, t: float, me: int = -1) -> bool:
        a, b, i = cols[node]
        return bool(np.any((a <= t) & (b > t) & (i != me)))

    sent = idle = shared = 0
    for r in done:
        t, a, b, i = r.times.prefill_queued, *cols[r.prefill_node]
        if busy(r.prefill_node, t, r.trace_index):
            sent += 1
            idle += any(n != r.prefill_node and not busy(n, t) for n in cols)
        shared += bool(np.any((a < r.times.prefill_end) & (b > r.times.prefill_start) & (i != r.trace_index)))
    return Placement(sent, idle, shared)


def instances(side: Side) -> int:
    return len({r.prefill_node for r in side.records if r.outcome == "completed" and r.prefill_node})


@dataclass(frozen=True)
class Attribution:
    """Mean TTFT, testbed minus peer (paper s), over `n` paired requests, and its terms
    (`total` is their sum)."""

    n: int
    cache: float
    batching: float
    placed: float
    queue: float
    other: float
    stretch_testbed: float  # mean prefill compute over the single-prompt time (1: one whole prompt a pass)
    stretch_peer: float

    @property
    def total(self) -> float:
        return self.cache + self.batching + self.placed + self.queue + self.other

    def without(self, *terms: str) -> float:
        """The difference left once the named terms are taken out."""
        parts = {"cache": self.cache, "batching": self.batching, "placed": self.placed, "queue": self.queue}
        return self.total - sum(parts[t] for t in terms)


def _stages(r: RequestRecord, s: float, t: PrefillTime) -> tuple[float, float, float, float]:
    """(TTFT, prefill queue, prefill compute, single-prompt prefill time), paper s."""
    b = breakdown_wire(r)
    return (
        r.ttft * s,
        b["prefill_queue"] * s,
        b["prefill_compute"] * s,
        t(r.input_tokens - r.cached_tokens, r.cached_tokens),
    )


def attribute(
    tb: Side, peer: Side, pairs: Sequence[tuple[RequestRecord, RequestRecord]], hw: HardwareSpec
) -> Attribution | None:
    """The split of the mean TTFT difference over `pairs` (testbed record, peer record)."""
    ok = [(x, y) for x, y in pairs if math.isfinite(x.ttft) and math.isfinite(y.ttft)]
    if not ok:
        return None
    t = PrefillTime.from_spec(hw.prefill)
    pa, pb = placed_waits(tb), placed_waits(peer)
    sums = [0.0] * 5
    ratios: tuple[list[float], list[float]] = ([], [])
    for x, y in ok:
        tx, qx, cx, mx = _stages(x, tb.speedup, t)
        ty, qy, cy, my = _stages(y, peer.speedup, t)
        wx, wy = pa.get(x.trace_index, 0.0), pb.get(y.trace_index, 0.0)
        terms = (mx - my, (cx - mx) - (cy - my), wx - wy, (qx - wx) - (qy - wy))
        for i, v in enumerate(terms):
            sums[i] += v
        sums[4] += (tx - ty) - sum(terms)
        for out, c, m in ((ratios[0], cx, mx), (ratios[1], cy, my)):
            if m > 0:
                out.append(c / m)
    n = len(ok)
    cache, batching, placed, queue, other = (v / n for v in sums)
    return Attribution(
        n,
        cache,
        batching,
        placed,
        queue,
        other,
        statistics.fmean(ratios[0]) if ratios[0] else math.nan,
        statistics.fmean(ratios[1]) if ratios[1] else math.nan,
    )


def _dt(x: float) -> str:
    return f"{x * 1e3:+.1f} ms" if abs(x) < 1 else f"{x:+.3f} s"


def describe(
    a: Attribution,
    peer_name: str,
    peer_ttft: float,
    placed_counts: tuple[int, int],
    loads: tuple[tuple[float, float], tuple[float, float]],
    placements: tuple[Placement, Placement],
) -> str:
    """The split in one paragraph, with what is left once the cache and the router's placement
    (the two deployments' differences, not the scheduler's) are taken out."""
    left = a.without("cache", "placed")
    pa, pb = placements
    share = f" ({left / peer_ttft * 100:+.1f}% of {peer_name}'s mean TTFT)" if peer_ttft > 0 else ""
    return (
        f"Split of the mean TTFT difference ({_dt(a.total)} over {a.n} requests), from the paired records: "
        f"cached prefixes {_dt(a.cache)} (the timing table's time for the tokens each side found cached); "
        f"router placement {_dt(a.placed)} (waits behind a busy prefill instance while another was idle: "
        f"{placed_counts[0]} requests in the testbed, {placed_counts[1]} in {peer_name}); "
        f"batching {_dt(a.batching)} (prefill compute beyond the single-prompt time: {a.stretch_testbed:.3f}x in "
        f"the testbed, {a.stretch_peer:.3f}x in {peer_name}); other prefill queueing {_dt(a.queue)}; the other "
        f"stages {_dt(a.other)}. Prompts the router sent to a prefill instance already computing another: "
        f"{pa.sent_busy} in the testbed ({pa.sent_busy_idle_elsewhere} while another was idle), {pb.sent_busy} in "
        f"{peer_name} ({pb.sent_busy_idle_elsewhere}); prompts that shared a forward pass: {pa.shared} and "
        f"{pb.shared}: the batching and queueing terms follow where the router sends prompts. Prefill load (the "
        f"single-prompt time of the computed tokens over the run, mean and busiest instance): testbed "
        f"{loads[0][0]:.0%} / {loads[0][1]:.0%}, {peer_name} {loads[1][0]:.0%} / {loads[1][1]:.0%}. "
        f"Without the cache and placement terms, the difference is {_dt(left)}{share}."
    )
