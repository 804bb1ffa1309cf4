"""The planner's vocabulary: deployment kinds and where they prefill, a kind on a base scenario
with the instance counts to try (`Family`), the settings of a plan, and a candidate deployment
with its predicted figures (`Candidate`) and how candidates rank (`objective_key`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from testbed.core.errors import UserError
from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.scenario import ClusterSpec, PolicyName, Scenario
from testbed.model.analytical import DEFAULT_LINK_BPS

Kind = PolicyName
Objective = Literal["lambda", "ttft", "ttft-p90"]
KINDS: tuple[Kind, ...] = ("prfaas", "homogeneous", "naive")


@dataclass(frozen=True)
class KindPools:
    """Where a kind prefills: in the PrfaaS cluster, on PD prefill instances, split by a threshold."""

    prfaas: bool
    pd_prefill: bool
    threshold: bool


def kind_pools(kind: Kind) -> KindPools:
    match kind:
        case "homogeneous":
            return KindPools(prfaas=False, pd_prefill=True, threshold=False)
        case "naive":
            return KindPools(prfaas=True, pd_prefill=False, threshold=False)
        case "prfaas":
            return KindPools(prfaas=True, pd_prefill=True, threshold=True)
        case _:
            unknown_kind("policy", kind)


OBJECTIVES: tuple[Objective, ...] = ("lambda", "ttft", "ttft-p90")


def kilo(tokens: int) -> str:
    """19400 -> 19.4K, 4750 -> 4.75K, 8000 -> 8K: exact, and short when the number is round."""
    return f"{tokens / 1000:g}K"


class PlanError(UserError, ValueError):
    """A base scenario or budget the planner cannot use."""


# ---------------------------------------------------------------------------------------------
# Families: a kind on a base scenario, with the instance counts to try


@dataclass(frozen=True)
class Family:
    kind: Kind
    base: Scenario
    prfaas_cluster: str | None  # None for homogeneous
    pd_cluster: str
    counts: tuple[tuple[int, int], ...]  # (N_prfaas, PD cluster instances) pairs to try

    @property
    def prfaas_hw(self) -> str | None:
        return None if self.prfaas_cluster is None else self.base.cluster(self.prfaas_cluster).hardware

    @property
    def pd_hw(self) -> str:
        return self.base.cluster(self.pd_cluster).hardware


def _one(base: Scenario, kind: str) -> ClusterSpec | None:
    cs = [c for c in base.clusters if c.kind == kind]
    if len(cs) > 1:
        raise PlanError(f"scenario {base.name!r} has {len(cs)} {kind!r} clusters; the planner needs at most one")
    return cs[0] if cs else None


def family_for(
    kind: Kind, base: Scenario, budget: Mapping[str, int] | None = None, vary_counts: bool = False
) -> Family:
    """The kind on `base`'s hardware. `budget`: instances per hardware name (default: the base's
    own counts). Without `vary_counts` the whole budget is deployed; with it, every count from 1
    (2 for a PD cluster that prefills and decodes) up to the budget is tried."""
    budget = dict(budget or {})
    pd = _one(base, "pd")
    if pd is None:
        raise PlanError(f"scenario {base.name!r} has no 'pd' cluster")
    if base.hardware[pd.hardware].decode is None:
        raise PlanError(f"scenario {base.name!r}: PD hardware {pd.hardware!r} has no decode profile")
    pf = _one(base, "prfaas")
    n_pd0 = pd.prefill + pd.decode
    uses = kind_pools(kind)
    min_pd = 2 if uses.pd_prefill else 1
    if not uses.prfaas:
        top = budget.get(pd.hardware, n_pd0)
        counts = [(0, n) for n in (range(min_pd, top + 1) if vary_counts else [top])]
        fam = Family(kind, base, None, pd.name, tuple(counts))
    else:
        if pf is None:
            raise PlanError(f"kind {kind!r} needs a 'prfaas' cluster; scenario {base.name!r} has none")
        if pf.hardware == pd.hardware:
            total = budget.get(pd.hardware, pf.prefill + n_pd0)
            pairs = [
                (f, n) for f in range(1, total) for n in range(min_pd, total - f + 1) if vary_counts or f + n == total
            ]
        else:
            f_top = budget.get(pf.hardware, pf.prefill)
            n_top = budget.get(pd.hardware, n_pd0)
            pairs = [
                (f, n)
                for f in (range(1, f_top + 1) if vary_counts else [f_top])
                for n in (range(min_pd, n_top + 1) if vary_counts else [n_top])
            ]
        fam = Family(kind, base, pf.name, pd.name, tuple((f, n) for f, n in pairs if f >= 1 and n >= min_pd))
    if not fam.counts:
        raise PlanError(
            f"kind {kind!r} on {base.name!r}: the budget leaves no deployment "
            f"(needs >= 1 PrfaaS instance where used and >= {min_pd} PD instances)"
        )
    return fam


# ---------------------------------------------------------------------------------------------
# Settings and candidates


@dataclass(frozen=True)
class PlanSettings:
    ttft_slo_s: float
    tpot_slo_s: float
    objective: Objective = "lambda"
    link_bps: float = DEFAULT_LINK_BPS
    link_delay_s: float = 0.0  # one-way; offloaded requests' KV crosses it once
    rate: float | None = None  # offered rate for TTFT; None: the workload's
    quantile: float = 0.9
    t_min: float | None = None  # threshold range; default [max(min length, 1024), max length)
    t_max: float | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise PlanError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not (self.link_bps > 0 and self.ttft_slo_s > 0 and self.tpot_slo_s > 0):
            raise PlanError("link rate and SLOs must be > 0")


@dataclass(frozen=True)
class Candidate:
    """One deployment and its predicted figures (rates in req/s, times in s, egress in bit/s)."""

    kind: Kind
    base: str
    n_prfaas: int
    n_p: int
    n_d: int
    threshold: int | None
    p: float  # share of requests prefilled in PrfaaS
    lambda_max: float  # the paper's Lambda_max
    theta_prfaas: float | None
    theta_pdp: float | None
    theta_pdd: float
    bottleneck: str
    rate: float  # the offered rate the TTFT figures are at
    ttft_free_s: float  # queue-free mean TTFT (prefill alone, as the paper's Table 6)
    ttft_mean_s: float  # queueing estimate at `rate` (inf: a stage saturates)
    ttft_p90_s: float
    util_prfaas: float | None  # utilisation of each stage at `rate` (queueing form)
    util_pdp: float | None
    util_pdd: float
    egress_bps: float  # PrfaaS -> PD KV at `rate`
    egress_share: float  # of the link
    meets_slo: bool  # the verdict in force: the simulator's once simulated
    notes: tuple[str, ...] = ()
    simulated: dict[str, Any] | None = field(default=None, compare=False)
    meets_slo_model: bool | None = None  # the model's verdict (what `meets_slo` is until simulated)

    @property
    def instances(self) -> int:
        return self.n_prfaas + self.n_p + self.n_d

    @property
    def label(self) -> str:
        t = "-" if self.threshold is None else f"t={kilo(self.threshold)}"
        return f"{self.kind} {t} {self.n_prfaas}/{self.n_p}/{self.n_d}"

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["instances"] = self.instances
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def objective_key(c: Candidate, objective: Objective) -> tuple[float, ...]:
    """Sort key, best first: SLO-meeting first, then the objective, then the other figure,
    then fewer instances (flat tops of Lambda_max are common: decode bound at many t)."""
    lam = -round(c.lambda_max, 9)
    if objective == "lambda":
        body: tuple[float, ...] = (lam, c.ttft_mean_s)
    elif objective == "ttft":
        body = (round(c.ttft_mean_s, 9), lam)
    else:
        body = (round(c.ttft_p90_s, 9), lam)
    return (0.0 if c.meets_slo else 1.0, *body, float(c.instances))
