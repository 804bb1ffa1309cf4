"""Per-request differences between two runs of one workload (the simulator's against the
emulation's), from their records alone.

Requests are paired by trace index (both runs replay the same trace), and each TTFT is split
into the stages of `testbed.metrics.summary.breakdown_wire`; the mean per-stage difference over
the pairs sums to the mean TTFT difference, so a TTFT gap names the stage it comes from. The
rest says which requests were routed or shipped differently. Everything is paper units: each
run's wire seconds times its own speedup.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from testbed.core.record import RequestRecord
from testbed.metrics.summary import BREAKDOWN_STAGES, breakdown_wire

STAGE_NAMES: dict[str, str] = {
    "routing": "routing",
    "prefill_queue": "prefill queue wait",
    "prefill_compute": "prefill compute",
    "transfer_tail": "KV transfer tail",
    "decode_queue": "decode admission wait",
    "first_step": "first decode step",
    "other": "HTTP hops and first-token streaming (other)",
}


@dataclass(frozen=True)
class RunRecords:
    """One run's records and its time scale (paper seconds = wire seconds x speedup)."""

    label: str
    records: Sequence[RequestRecord]
    speedup: float

    def completed(self) -> dict[int, RequestRecord]:
        return {r.trace_index: r for r in self.records if r.outcome == "completed"}


@dataclass(frozen=True)
class Pairing:
    """The requests both runs completed, as (a, b) pairs in trace order, and how many only one did."""

    pairs: list[tuple[RequestRecord, RequestRecord]]
    only_a: int
    only_b: int


def pair(a: RunRecords, b: RunRecords) -> Pairing:
    da, db = a.completed(), b.completed()
    both = sorted(da.keys() & db.keys())
    return Pairing([(da[i], db[i]) for i in both], len(da.keys() - db.keys()), len(db.keys() - da.keys()))


@dataclass(frozen=True)
class StageDiff:
    stage: str
    a: float  # mean over the pairs, paper s
    b: float

    @property
    def diff(self) -> float:
        return self.a - self.b


@dataclass(frozen=True)
class Decomposition:
    """Mean TTFT of a set of paired requests in each run, split by stage."""

    n: int
    stages: list[StageDiff]

    @property
    def total(self) -> float:
        return sum(s.diff for s in self.stages)

    def leading(self, share: float = 0.7, most: int = 3) -> list[StageDiff]:
        """The stages with the largest differences, as many as make up `share` of their absolute sum."""
        ranked = sorted(self.stages, key=lambda s: abs(s.diff), reverse=True)
        whole = sum(abs(s.diff) for s in ranked)
        out: list[StageDiff] = []
        acc = 0.0
        for s in ranked[:most]:
            if out and acc >= share * whole:
                break
            out.append(s)
            acc += abs(s.diff)
        return out

    def share(self, s: StageDiff) -> float:
        whole = sum(abs(x.diff) for x in self.stages)
        return abs(s.diff) / whole if whole > 0 else 0.0


def decompose_ttft(
    a: RunRecords,
    b: RunRecords,
    pairs: Sequence[tuple[RequestRecord, RequestRecord]],
    band: tuple[float, float] | None = None,
) -> Decomposition | None:
    """Stage means over `pairs`, or over those whose TTFT in run b ranks within `band` (fractions
    of the pairs, e.g. (0.8, 1.0) for the slowest fifth, which decides the P90)."""
    ok = [(x, y) for x, y in pairs if math.isfinite(x.ttft) and math.isfinite(y.ttft)]
    if band is not None:
        ok.sort(key=lambda p: p[1].ttft)
        lo = min(int(band[0] * len(ok)), max(len(ok) - 1, 0))
        ok = ok[lo : max(math.ceil(band[1] * len(ok)), lo + 1)]
    if not ok:
        return None
    ba = [breakdown_wire(x) for x, _ in ok]
    bb = [breakdown_wire(y) for _, y in ok]
    stages = [
        StageDiff(k, statistics.fmean(r[k] for r in ba) * a.speedup, statistics.fmean(r[k] for r in bb) * b.speedup)
        for k in BREAKDOWN_STAGES
    ]
    return Decomposition(len(ok), stages)


@dataclass(frozen=True)
class RoutingChanges:
    """Paired requests the two runs routed differently."""

    crossed_only_a: list[RequestRecord]  # run a's records
    crossed_only_b: list[RequestRecord]
    other_cluster: int  # prefill cluster differs (any reason)


def routing_changes(pairs: Sequence[tuple[RequestRecord, RequestRecord]]) -> RoutingChanges:
    return RoutingChanges(
        [x for x, y in pairs if x.crossed_wan and not y.crossed_wan],
        [y for x, y in pairs if y.crossed_wan and not x.crossed_wan],
        sum(x.prefill_cluster != y.prefill_cluster for x, y in pairs),
    )


@dataclass(frozen=True)
class WanBytes:
    """Run a's WAN bytes minus run b's (paper bytes), split by where the difference comes from."""

    crossed_only_a: float  # requests completed in both, offloaded in a only
    crossed_only_b: float  # ... in b only (counted as b's bytes, positive)
    both_kv_diff: float  # offloaded in both: a's KV bytes minus b's
    completed_only_a: float  # offloaded requests a completed and b did not
    completed_only_b: float
    cache_move_diff: float  # cached-prefix moves, a minus b

    @property
    def total(self) -> float:
        return (
            self.crossed_only_a
            - self.crossed_only_b
            + self.both_kv_diff
            + self.completed_only_a
            - self.completed_only_b
            + self.cache_move_diff
        )


def wan_bytes(a: RunRecords, b: RunRecords) -> WanBytes:
    da, db = a.completed(), b.completed()

    def kv(r: RequestRecord) -> float:
        return float(r.kv_bytes_paper) if r.crossed_wan else 0.0

    both = da.keys() & db.keys()
    return WanBytes(
        crossed_only_a=sum(kv(da[i]) for i in both if not db[i].crossed_wan),
        crossed_only_b=sum(kv(db[i]) for i in both if not da[i].crossed_wan),
        both_kv_diff=sum(kv(da[i]) - kv(db[i]) for i in both if da[i].crossed_wan and db[i].crossed_wan),
        completed_only_a=sum(kv(da[i]) for i in da.keys() - both),
        completed_only_b=sum(kv(db[i]) for i in db.keys() - both),
        cache_move_diff=float(
            sum(r.cache_move_bytes_paper for r in da.values()) - sum(r.cache_move_bytes_paper for r in db.values())
        ),
    )


def mean_by(
    run: RunRecords, value: Callable[[RequestRecord], float], key: Callable[[RequestRecord], str]
) -> dict[str, float]:
    """Mean of `value` (wire s, returned in paper s) over completed records grouped by `key`;
    non-finite values are left out."""
    groups: dict[str, list[float]] = {}
    for r in run.completed().values():
        v = value(r)
        if math.isfinite(v):
            groups.setdefault(key(r), []).append(v * run.speedup)
    return {k: statistics.fmean(v) for k, v in sorted(groups.items())}


def transfer_duration(r: RequestRecord) -> float:
    """First KV layer handed to the sender to the decode node holding every byte (wire s)."""
    return r.times.transfer_end - r.times.transfer_start


def queue_wait(r: RequestRecord) -> float:
    return r.times.prefill_start - r.times.prefill_queued


def mean_paper(run: RunRecords, value: Callable[[RequestRecord], float]) -> float | None:
    vals = [value(r) for r in run.completed().values()]
    vals = [v for v in vals if math.isfinite(v)]
    return statistics.fmean(vals) * run.speedup if vals else None


def median_paired(
    pairs: Sequence[tuple[RequestRecord, RequestRecord]],
    value: Callable[[RequestRecord], float],
    speedup_a: float,
    speedup_b: float,
) -> float | None:
    """Median over the pairs of value(a) - value(b), paper units."""
    d = [value(x) * speedup_a - value(y) * speedup_b for x, y in pairs]
    d = [v for v in d if math.isfinite(v)]
    return statistics.median(d) if d else None
