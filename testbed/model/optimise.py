"""The paper's 2-D grid search: threshold t and the PD cluster's N_p/N_d split maximising Lambda_max.

Lambda_max(t) is flat-topped whenever a stage that does not depend on t binds (PD-D, or a
PD-P/PrfaaS stage saturated at every t): many t then give the same Lambda_max.  Ties are
broken toward the t where Theta_prfaas/p = Theta_pdp/(1-p), the paper's balance condition,
because that t leaves both prefill stages the same headroom.  Ties between splits (rare) go to
the one closest to the paper's second condition, Theta_prfaas + Theta_pdp = Theta_pdd.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from testbed.core.engine.kvsize import KVModel
from testbed.core.schema.scenario import Scenario
from testbed.model.analytical import (
    DEFAULT_LINK_BPS,
    DiscreteDistribution,
    FloatArray,
    StagePools,
    ThresholdCurves,
    Workload,
    threshold_curves,
)
from testbed.model.errors import ModelError

# Relative tolerance for "the same Lambda_max" on a flat top.
_TIE_RTOL = 1e-9


@dataclass(frozen=True)
class OptimiseResult:
    scenario: str
    threshold: int
    n_p: int
    n_d: int
    lambda_max: float
    theta_prfaas: float
    theta_pdp: float
    theta_pdd: float
    p: float
    balanced: bool  # True when the balance condition holds at the chosen t (within 1%)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class _Pick:
    index: int
    lam: float
    imbalance: float


def _best_index(cur: ThresholdCurves) -> _Pick:
    lam = cur.lambda_max
    top = float(np.max(lam))
    flat = np.flatnonzero(lam >= top * (1.0 - _TIE_RTOL))
    imb = cur.imbalance[flat]
    i = int(flat[int(np.argmin(imb))])
    return _Pick(i, float(lam[i]), float(cur.imbalance[i]))


def _search_t(
    dep: StagePools,
    dist: DiscreteDistribution,
    kv: KVModel,
    link_bps: float,
    t_min: float,
    t_max: float,
    step: float,
) -> tuple[ThresholdCurves, _Pick]:
    """Coarse grid at `step` tokens, then a 1-token pass around the coarse winner."""
    ts: FloatArray = np.arange(t_min, t_max + step / 2, step, dtype=np.float64)
    centre = float(ts[_best_index(threshold_curves(dep, dist, kv, ts, link_bps)).index])
    # Include the coarse winner so the fine pass can only improve on it.
    fine_ts: FloatArray = np.union1d(
        np.arange(max(t_min, centre - step), min(t_max, centre + step) + 0.5, 1.0, dtype=np.float64), [centre]
    )
    fine = threshold_curves(dep, dist, kv, fine_ts, link_bps)
    return fine, _best_index(fine)


def _t_range(dist: DiscreteDistribution, t_min: float | None, t_max: float | None) -> tuple[float, float]:
    lo = float(t_min) if t_min is not None else max(dist.lo, 1024.0)
    hi = float(t_max) if t_max is not None else max(dist.hi, lo)
    if hi < lo:
        raise ModelError(f"empty threshold range [{lo}, {hi}]")
    return lo, hi


def _result(scenario: Scenario, dep: StagePools, cur: ThresholdCurves, pick: _Pick) -> OptimiseResult:
    i = pick.index
    return OptimiseResult(
        scenario=scenario.name,
        threshold=int(round(float(cur.ts[i]))),
        n_p=dep.n_p,
        n_d=dep.n_decode,
        lambda_max=pick.lam,
        theta_prfaas=float(cur.theta_prfaas[i]),
        theta_pdp=float(cur.theta_pdp[i]),
        theta_pdd=cur.theta_pdd,
        p=float(cur.p[i]),
        balanced=pick.imbalance <= 0.01,
    )


def optimise_threshold(
    scenario: Scenario,
    link_bps: float = DEFAULT_LINK_BPS,
    split: tuple[int, int] | None = None,
    t_min: float | None = None,
    t_max: float | None = None,
    step: float = 100.0,
    workload: Workload | None = None,
) -> OptimiseResult:
    """Best t for a fixed split (the scenario's own unless `split` is given); `workload`
    replaces the scenario's synthetic one (e.g. a trace's)."""
    wl = workload if workload is not None else Workload.from_scenario(scenario)
    dep = StagePools.from_scenario(scenario, split, wl.output_tokens)
    if not dep.prfaas or not dep.pd_prefill:
        raise ModelError("threshold search needs prefill instances in both a PrfaaS and a PD cluster")
    kv = KVModel.from_spec(scenario.model)
    lo, hi = _t_range(wl.dist, t_min, t_max)
    cur, pick = _search_t(dep, wl.dist, kv, link_bps, lo, hi, step)
    return _result(scenario, dep, cur, pick)


def optimise(
    scenario: Scenario,
    link_bps: float = DEFAULT_LINK_BPS,
    t_min: float | None = None,
    t_max: float | None = None,
    step: float = 100.0,
    workload: Workload | None = None,
) -> OptimiseResult:
    """2-D search over t and N_p/N_d of the (single) PD cluster, N_p + N_d fixed, both >= 1."""
    pds = [c for c in scenario.clusters if c.kind == "pd"]
    if len(pds) != 1:
        raise ModelError(f"split search needs exactly one PD cluster, scenario {scenario.name!r} has {len(pds)}")
    total = pds[0].prefill + pds[0].decode
    if total < 2:
        raise ModelError(f"PD cluster {pds[0].name!r} has {total} instance(s); a split needs at least 2")
    best: tuple[float, float, OptimiseResult] | None = None
    for n_p in range(1, total):
        res = optimise_threshold(scenario, link_bps, (n_p, total - n_p), t_min, t_max, step, workload)
        # Second condition of the paper as the tie-breaker between equal Lambda_max.
        gap = abs(res.theta_prfaas + res.theta_pdp - res.theta_pdd) / res.theta_pdd
        if best is None or res.lambda_max > best[0] * (1.0 + _TIE_RTOL):
            best = (res.lambda_max, gap, res)
        elif res.lambda_max >= best[0] * (1.0 - _TIE_RTOL) and gap < best[1]:
            best = (max(best[0], res.lambda_max), gap, res)
    assert best is not None
    return best[2]


def solve_threshold(scenario: Scenario, link_bps: float) -> float:
    """The optimiser's t at the deployed split over a link of `link_bps` (config's ThresholdSolver)."""
    return float(optimise_threshold(scenario, link_bps).threshold)


def resolve_threshold(scenario: Scenario, link_bps: float = DEFAULT_LINK_BPS) -> int:
    """The scenario's fixed threshold, or for "auto" the optimiser's t at the deployed split.

    "auto" optimises t for the split the deployment starts with; the long-term loop
    (`testbed.core.control.longterm`, planner `testbed.model.retune`) re-optimises it as the split changes.
    """
    t = scenario.policy.threshold
    if isinstance(t, int):
        return t
    if t == "auto":
        return optimise_threshold(scenario, link_bps).threshold
    raise ModelError(f"policy {scenario.policy.name!r} of scenario {scenario.name!r} has no length threshold")
