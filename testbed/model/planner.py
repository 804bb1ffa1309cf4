"""Deployment planner: for each deployment kind, the threshold, P/D split and instance counts
the analytical model ranks best on a workload (typically a trace's, `testbed.model.workload`).

Kinds, each on its own base scenario (its hardware and instance budget):
- prfaas: a PrfaaS cluster prefilling requests whose incremental length exceeds t, and a PD
  cluster split N_p / N_d; searched over t, the split and (optionally) both counts;
- homogeneous: the PD cluster alone, searched over its split;
- naive: every prefill in PrfaaS, the PD cluster all decode.

The vocabulary is `plan_types`, the vectorised search and its queueing estimate `plan_grid`.
Here: a family's search (`plan_family`), the trace as a family's search reads it
(`family_workload`: the prefix cache replayed with prompts entering it when their prefill ends),
and one configuration scored on the trace replayed under its own routing (`score_config`), which
is how the best few and a base scenario as it stands are judged.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.scenario import Scenario
from testbed.model.analytical import Workload
from testbed.model.plan_grid import MAX_THRESHOLDS, ROUND_RTOL, Evaluator
from testbed.model.plan_types import (
    KINDS,
    OBJECTIVES,
    Candidate,
    Family,
    Kind,
    KindPools,
    Objective,
    PlanError,
    PlanSettings,
    family_for,
    kilo,
    kind_pools,
    objective_key,
)
from testbed.model.workload import ReadyAfter, Routing, TraceWorkload, replay_cache
from testbed.traces.types import Trace

__all__ = [
    "KINDS",
    "MAX_THRESHOLDS",
    "OBJECTIVES",
    "ROUND_RTOL",
    "Candidate",
    "Evaluator",
    "Family",
    "FamilyPlan",
    "Kind",
    "KindPools",
    "Objective",
    "PlanError",
    "PlanSettings",
    "candidate_scenario",
    "family_for",
    "family_workload",
    "kilo",
    "kind_pools",
    "objective_key",
    "plan_family",
    "rank_all",
    "ready_after",
    "routing_for",
    "scenario_patch",
    "score_config",
]


@dataclass(frozen=True)
class FamilyPlan:
    family: Family
    candidates: tuple[Candidate, ...]  # ranked, best first
    reference: Candidate | None  # the base scenario as it stands (None: not this kind)


def plan_family(
    fam: Family, wl: Workload, settings: PlanSettings, reference_threshold: float | None = None, round_top: int = 10
) -> FamilyPlan:
    """Every (counts, split) of the family with its best threshold, ranked; the first
    `round_top` moved to a rounder threshold where that costs (almost) nothing."""
    kv = KVModel.from_spec(fam.base.model)
    ev = Evaluator(fam, wl, kv, settings)
    cands: list[Candidate] = []
    for n_prf, n_pd in fam.counts:
        cands.extend(ev.best(n_prf, n_pd))
    cands.sort(key=lambda c: objective_key(c, settings.objective))
    cands[:round_top] = [ev.rounder(c) for c in cands[:round_top]]
    cands.sort(key=lambda c: objective_key(c, settings.objective))
    ref = None
    base = fam.base
    if base.policy.name == fam.kind:
        pd = base.cluster(fam.pd_cluster)
        n_prf = base.cluster(fam.prfaas_cluster).prefill if fam.prfaas_cluster else 0
        if not kind_pools(fam.kind).threshold or reference_threshold is not None:
            ref = ev.score(n_prf, pd.prefill, pd.decode, reference_threshold)
    return FamilyPlan(fam, tuple(cands), ref)


def routing_for(kind: Kind, threshold: float | None, cache_aware: bool) -> Routing:
    """How a configuration of `kind` sends prefills, for `workload.replay_cache`."""
    uses = kind_pools(kind)
    if uses.threshold and threshold is None:
        raise PlanError("a prfaas configuration needs a threshold")
    return Routing(
        threshold=float(threshold) if uses.threshold and threshold is not None else None,
        offload_all=uses.prfaas and not uses.pd_prefill,
        cache_aware=cache_aware,
    )


@dataclass(frozen=True)
class SpanWaits:
    """Mean waits of the PD prefill and PrfaaS stages span by span (`plan_grid`'s spans)."""

    edges: npt.NDArray[np.float64]
    pd: npt.NDArray[np.float64]
    prfaas: npt.NDArray[np.float64]


def ready_after(
    fam: Family, wait_pd: float = 0.0, wait_prfaas: float = 0.0, spans: SpanWaits | None = None
) -> ReadyAfter:
    """When a prompt enters the pools after its arrival on the family's hardware: its prefill
    time (on PrfaaS's hardware when offloaded) plus the stage's wait, the mean of the span it
    arrived in when `spans` are given (a burst's requests wait longer, so their follow-ups miss
    more), else the stage's mean (finite waits only)."""
    hw = fam.base.hardware
    pd = PrefillTime.from_spec(hw[fam.pd_hw].prefill)
    prf = pd if fam.prfaas_hw is None else PrefillTime.from_spec(hw[fam.prfaas_hw].prefill)
    w_pd = wait_pd if math.isfinite(wait_pd) else 0.0
    w_prf = wait_prfaas if math.isfinite(wait_prfaas) else 0.0
    if spans is not None:
        edges = [float(x) for x in spans.edges[1:-1]]
        by_pd: list[float] = [float(x) for x in np.where(np.isfinite(spans.pd), spans.pd, 0.0)]
        by_prf: list[float] = [float(x) for x in np.where(np.isfinite(spans.prfaas), spans.prfaas, 0.0)]

        def ready_in_span(offloaded: bool, tokens: int, at: float) -> float:
            i = bisect.bisect_right(edges, at)
            if offloaded:
                return prf.uncached_time(tokens) + by_prf[i]
            return pd.uncached_time(tokens) + by_pd[i]

        return ready_in_span

    def ready(offloaded: bool, tokens: int, at: float) -> float:
        return prf.uncached_time(tokens) + w_prf if offloaded else pd.uncached_time(tokens) + w_pd

    return ready


def family_workload(fam: Family, trace: Trace, threshold: float | None = None) -> TraceWorkload:
    """The trace as a family's search reads it: cached prefixes replayed with each prompt entering
    the pools when its queue-free prefill would end, on the hardware it is routed to (for a
    threshold kind at `threshold`, else as if all on the PD cluster: the slower, so it errs toward
    fewer hits)."""
    kv = KVModel.from_spec(fam.base.model)
    uses = kind_pools(fam.kind)
    if uses.threshold and threshold is None:
        routing = Routing()
    else:
        routing = routing_for(fam.kind, threshold, cache_aware=True)
    return TraceWorkload.from_trace(trace, kv, routing, ready_after(fam))


# Replays per configuration in `score_config`: the first with prompts ready when their prefill
# alone would end, the next adding the stages' waits the one before estimated, until the waits
# move less than SCORE_RTOL (or SCORE_ROUNDS replays: a deployment whose waits keep growing as its
# cache misses more is far past its SLOs by then).
SCORE_ROUNDS = 5
SCORE_RTOL = 0.05


def score_config(
    fam: Family,
    wl: Workload,
    trace: Trace,
    settings: PlanSettings,
    n_prf: int,
    n_p: int,
    n_d: int,
    threshold: int | None,
    cache_aware: bool,
    rounds: int = SCORE_ROUNDS,
) -> Candidate:
    """One configuration's figures with the trace replayed under its own routing
    (`workload.replay_cache`): where each request goes, the prefix it then reuses (its own
    cluster's pool when routing is length-only) and the KV it ships follow the configuration, and
    a prompt enters the pools when its prefill ends (service plus the wait estimated for its
    stage in its span). `wl` is the family's workload (rate, arrivals, outputs)."""
    kv = KVModel.from_spec(fam.base.model)
    routing = routing_for(fam.kind, threshold, cache_aware)
    ev = Evaluator(fam, wl, kv, settings)
    reqs = trace.requests
    inputs = np.fromiter((r.input_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    linear = "linear" in kv.kinds
    ready = ready_after(fam)
    before: tuple[float, float] | None = None
    c: Candidate | None = None
    for _ in range(max(rounds, 1)):
        rep = replay_cache(reqs, trace.block_tokens, linear, routing, ready)
        c, g = ev.score_split(n_prf, n_p, n_d, threshold, rep.offloaded, inputs - rep.cached, rep.cached, rep.shipped)
        waits = (g["wait_pd"], g["wait_prfaas"])
        if before is not None and all(abs(a - b) <= SCORE_RTOL * max(abs(b), 0.01) for a, b in zip(waits, before)):
            break
        before = waits
        spans = g.get("span_waits")
        ready = ready_after(fam, *waits, spans=SpanWaits(*spans) if spans is not None else None)
    assert c is not None
    return c


def rank_all(plans: Sequence[FamilyPlan], objective: Objective) -> list[Candidate]:
    """Every candidate of every kind, best first."""
    return sorted((c for fp in plans for c in fp.candidates), key=lambda c: objective_key(c, objective))


def candidate_scenario(fam: Family, c: Candidate, name: str, cache_aware: bool) -> Scenario:
    """The candidate as a full scenario on the family's base (what a plan file resolves to)."""
    return Scenario.model_validate(scenario_patch(fam, c, name, cache_aware, full=True))


def scenario_patch(fam: Family, c: Candidate, name: str, cache_aware: bool, full: bool = False) -> dict[str, object]:
    """The fields a plan file sets over its base: name, policy, the whole cluster list (YAML
    lists replace, not merge). `full` returns the merged scenario as a dict instead."""
    clusters = []
    for cl in fam.base.clusters:
        d = cl.model_dump(mode="json")
        if cl.name == fam.pd_cluster:
            d.update(prefill=c.n_p, decode=c.n_d)
        elif cl.kind == "prfaas":
            d.update(prefill=c.n_prfaas if cl.name == fam.prfaas_cluster else 0)
        clusters.append(d)
    policy: dict[str, object] = {"name": c.kind, "threshold": c.threshold, "cache_aware": cache_aware}
    if not kind_pools(c.kind).threshold:  # only a threshold can move with the bandwidth
        policy["bandwidth_aware"] = False
    if not full:
        return {"name": name, "policy": policy, "clusters": clusters}
    merged = fam.base.model_dump(mode="json")
    merged.update(name=name, clusters=clusters)
    merged["policy"] = {**merged["policy"], **policy}
    return merged
