"""The analytical model as the long-term loop's planner (`testbed.core.control.longterm.Planner`).

For a split N_p / N_d and the recent requests (their incremental lengths as an empirical
distribution, their mean output length, their rate) it gives the threshold the optimiser
picks (`optimise_threshold`: the paper's Lambda_max, ties toward the balance condition) or
takes the one asked about, and each stage's predicted load there: the offered rate over the
rate the stage saturates at (Theta_prfaas / p, Theta_pdp / (1 - p), Theta_pdd). Under the
homogeneous policy everything prefills on PD-P and no threshold is planned (it is infinite).
"""

from __future__ import annotations

import math

import numpy as np

from testbed.core.control.longterm import Planner, ThresholdPlan, WorkloadSample
from testbed.core.engine.kvsize import KVModel
from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.scenario import Scenario


def _load(rate: float, limit: float) -> float:
    return rate / limit if limit > 0 else math.inf


def role_planner(sc: Scenario, link_bps: float) -> Planner:
    kv = KVModel.from_spec(sc.model)
    ctl = sc.policy.control
    offload: bool | None  # None: no re-planning
    match sc.policy.name:
        case "prfaas":
            offload = True
        case "homogeneous":
            offload = False
        case "naive":  # built for every scenario, but control.long_term is refused under naive
            offload = None
        case _:
            unknown_kind("policy", sc.policy.name)

    def plan(smp: WorkloadSample, n_p: int, n_d: int, threshold: float | None) -> ThresholdPlan:
        # Imported at the first plan: every simulated run builds a planner, few long-term loops
        # run, and the model is a tenth of a short run's start-up.
        from testbed.model.analytical import StagePools, Workload, stage_capacity, threshold_curves
        from testbed.model.optimise import optimise_threshold
        from testbed.model.workload import EmpiricalDistribution

        if offload is None:
            raise ValueError("role re-planning needs policy 'prfaas' or 'homogeneous', not 'naive'")
        out = float(np.mean(smp.outputs)) if len(smp.outputs) else float(sc.workload.output_tokens)
        dist = EmpiricalDistribution(smp.lengths)
        dep = StagePools.from_scenario(sc, (n_p, n_d), max(out, 1.0))
        pdd = _load(smp.rate, dep.decode_rate)
        if not offload:
            theta = float(stage_capacity(dep.pd_prefill, np.array([dist.mean()]))[0])
            return ThresholdPlan(math.inf, {"pdp": _load(smp.rate, theta), "pdd": pdd})
        if threshold is None:
            wl = Workload(dist, max(out, 1.0), smp.rate, "recent requests")
            threshold = float(
                optimise_threshold(
                    sc, link_bps, (n_p, n_d), ctl.min_threshold, ctl.max_threshold, workload=wl
                ).threshold
            )
        cur = threshold_curves(dep, dist, kv, np.array([float(threshold)]), link_bps)
        return ThresholdPlan(
            threshold,
            {
                "prfaas": _load(smp.rate, float(cur.prfaas_limit[0])),
                "pdp": _load(smp.rate, float(cur.pdp_limit[0])),
                "pdd": pdd,
            },
        )

    return plan
