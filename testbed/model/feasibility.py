"""The feasibility map by the analytical model: for each model profile and inter-DC link rate,
the PrfaaS-PD deployment's best threshold, offload share, Lambda_max and P90 TTFT, against
homogeneous PD on the same hardware (docs/paper.md, Tables 1, 3 and 6; section 3.4).

Deployments are the paper's (scenarios paper-prfaas and paper-homogeneous: 4 H200 PrfaaS
instances + 8 H20 PD instances, against 12 H20 PD instances) with a profile of
scenarios/models swapped in. A profile gives the model's KV and its prefill curve on the
H200 only; the H20 curve comes from one of two rules (`PdCurve`):
- "scaled" (default): the model's H200 time at each of its curve's lengths times the H20/H200
  time ratio of the paper's case-study model at that length (1.4x at 1K up to 3.1x at 128K):
  the model runs on both GPU kinds, each as much slower than the other as the case study's;
- "parent": the base scenario's H20 curve unchanged (what `extends: [paper-prfaas.yaml,
  models/X.yaml]` gives): the case-study 1T model's H20 times under every model's H200 times.

Splits (`SplitMode`): "optimise" runs the paper's 2-D search (t and N_p/N_d of the 8 PD
instances) for PrfaaS-PD and the best N_p/N_d of the 12 for homogeneous PD, so each model gets
the deployment the paper's method would give it; "fixed" keeps Table 6's 3/5 and 9/3 and
optimises t alone.

Queue-free fluid figures: Lambda_max does not depend on the link's RTT; P90 TTFT does, as
offloaded requests wait for their KV's one-way delay and the last layer's transfer tail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np

from testbed.config.scenarios import ScenarioError, load_model_profile, load_scenario, model_profiles, profile_sources
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.hardware import TablePrefill
from testbed.core.schema.scenario import Scenario
from testbed.model.analytical import (
    LengthDistribution,
    ModelResult,
    StagePools,
    evaluate,
    last_layer_bytes,
    prefill_seconds,
    weighted_quantile,
)
from testbed.model.errors import ModelError
from testbed.model.optimise import optimise, optimise_threshold
from testbed.model.paper_bandwidth import MODEL_NAMES, TABLE3_GBPS

PdCurve = Literal["scaled", "parent"]
SplitMode = Literal["optimise", "fixed"]
Kind = Literal["hybrid", "dense"]

PRFAAS_BASE = "paper-prfaas"
HOMOGENEOUS_BASE = "paper-homogeneous"
PROFILE_HARDWARE = "h200"  # the hardware a profile's curve is for (Table 3)
PD_HARDWARE = "h20"  # the local PD cluster's (Table 6)
DEFAULT_RATES_GBPS: tuple[float, ...] = (1, 3, 10, 25, 50, 100, 200, 400)
DEFAULT_RTTS_MS: tuple[float, ...] = (30, 150)
# Break-even search range and resolution (bit/s; relative).
BREAK_EVEN_LO = 0.1e9
BREAK_EVEN_HI = 100e12
BREAK_EVEN_RTOL = 0.002


def default_models(source: str = "paper") -> list[str]:
    """The paper's six in Table 3's order (hybrids, then the dense two), then other profiles, of
    those `source` ships."""
    shipped = model_profiles(source)
    return [m for m in TABLE3_GBPS if m in shipped] + [m for m in shipped if m not in TABLE3_GBPS]


def label(model: str) -> str:
    return MODEL_NAMES.get(model, model)


def kind_of(kv: KVModel) -> Kind:
    """Dense: every layer full attention (KV grows with every token of every layer)."""
    return "hybrid" if "linear" in kv.kinds else "dense"


def scaled_pd_prefill(
    model_h200: PrefillTime, parent_h200: PrefillTime, parent_pd: PrefillTime, lengths: Sequence[float]
) -> TablePrefill:
    """The model's PD-hardware curve: its H200 time at each length times the parent's PD/H200
    time ratio there, interpolated linearly between those lengths (as the profiles are)."""
    pts = [
        (float(x), model_h200.uncached_time(x) * parent_pd.uncached_time(x) / parent_h200.uncached_time(x))
        for x in lengths
    ]
    return TablePrefill(kind="table", points=pts)


def _curve_lengths(pt: PrefillTime) -> list[float]:
    # A polynomial profile has no points of its own: Table 3's lengths stand in.
    return list(pt.xs) if pt.xs else [1024.0, 8192.0, 32768.0, 131072.0]


def model_overrides(
    model: str, pd_curve: PdCurve = "scaled", base: str = PRFAAS_BASE, source: str = "paper"
) -> dict[str, object]:
    """Scenario overrides that swap profile `model` (name or path; a name from `source`) into the
    paper deployments."""
    prof = load_model_profile(model, source)
    if PROFILE_HARDWARE not in prof.hardware:
        raise ScenarioError(f"model profile {model!r} has no {PROFILE_HARDWARE!r} prefill curve")
    hw: dict[str, object] = {PROFILE_HARDWARE: prof.hardware[PROFILE_HARDWARE].model_dump(mode="json")}
    if pd_curve == "scaled":
        parent = load_scenario(base)
        m200 = PrefillTime.from_spec(prof.hardware[PROFILE_HARDWARE].prefill)
        curve = scaled_pd_prefill(
            m200,
            PrefillTime.from_spec(parent.hardware[PROFILE_HARDWARE].prefill),
            PrefillTime.from_spec(parent.hardware[PD_HARDWARE].prefill),
            _curve_lengths(m200),
        )
        hw[PD_HARDWARE] = {"prefill": curve.model_dump(mode="json")}
    return {"model": prof.model.model_dump(mode="json"), "hardware": hw}


@dataclass(frozen=True)
class Deployments:
    """One model in both paper deployments."""

    model: str  # profile name (or a path's stem)
    kind: Kind
    prfaas: Scenario
    homogeneous: Scenario
    overrides: dict[str, object]  # what was swapped into the base scenarios


def model_key(model: str) -> str:
    return model if model in model_profiles() else Path(model).stem


def load_deployments(
    model: str,
    pd_curve: PdCurve = "scaled",
    prfaas_base: str = PRFAAS_BASE,
    homogeneous_base: str = HOMOGENEOUS_BASE,
    source: str = "paper",
) -> Deployments:
    key = model_key(model)
    ov = model_overrides(model, pd_curve, prfaas_base, source)
    pf = load_scenario(prfaas_base, {**ov, "name": f"prfaas-{key}"})
    hm = load_scenario(homogeneous_base, {**ov, "name": f"homogeneous-{key}"})
    if pf.policy.name != "prfaas" or hm.policy.name != "homogeneous":
        raise ScenarioError(f"{prfaas_base!r} must have policy prfaas and {homogeneous_base!r} policy homogeneous")
    return Deployments(key, kind_of(KVModel.from_spec(pf.model)), pf, hm, ov)


def _pd(sc: Scenario) -> tuple[int, int]:
    pds = [c for c in sc.clusters if c.kind == "pd"]
    if len(pds) != 1:
        raise ScenarioError(f"scenario {sc.name!r}: the map needs exactly one PD cluster, it has {len(pds)}")
    return pds[0].prefill, pds[0].decode


@dataclass(frozen=True)
class HomogeneousPoint:
    lambda_max: float
    n_p: int
    n_d: int
    bottleneck: str
    ttft_p90_s: float
    # The same with PD-P's capacity N_p / E[T(L)] instead of the formula's N_p / T(E[L]): what a
    # long replay sustains when prefill binds and T is convex in l (lower, by Jensen).
    lambda_mean_service: float


def best_homogeneous(sc: Scenario, split: SplitMode = "optimise") -> HomogeneousPoint:
    """Homogeneous PD at its scenario's split, or at the N_p/N_d of its instances with the
    largest Lambda_max (ties: the split whose PD-P and PD-D capacities are closest)."""
    n_p0, n_d0 = _pd(sc)
    total = n_p0 + n_d0
    splits = [(n_p0, n_d0)] if split == "fixed" else [(k, total - k) for k in range(1, total)]
    best: tuple[float, float, ModelResult] | None = None
    for s in splits:
        r = evaluate(sc, split=s)
        gap = abs((r.theta_pdp or 0.0) - r.theta_pdd) / r.theta_pdd
        if (
            best is None
            or r.lambda_max > best[0] * (1 + 1e-9)
            or (r.lambda_max >= best[0] * (1 - 1e-9) and gap < best[1])
        ):
            best = (r.lambda_max, gap, r)
    assert best is not None
    r = best[2]
    dist = LengthDistribution.from_spec(sc.workload.input)
    pools = StagePools.from_scenario(sc, (r.n_p, r.n_d)).pd_prefill
    mean_cap = 0.0
    for pool in pools:
        mean_cap += pool.instances / dist.expect(partial(prefill_seconds, pool.prefill))
    return HomogeneousPoint(r.lambda_max, r.n_p, r.n_d, r.bottleneck, r.ttft_p90_s, min(mean_cap, r.theta_pdd))


def best_prfaas(sc: Scenario, link_bps: float, split: SplitMode = "optimise") -> ModelResult:
    """PrfaaS-PD at its best threshold (and with "optimise", its best N_p/N_d) over `link_bps`."""
    if split == "optimise":
        o = optimise(sc, link_bps)
    else:
        o = optimise_threshold(sc, link_bps)
    return evaluate(sc, link_bps, threshold=o.threshold, split=(o.n_p, o.n_d))


def wan_ttft_p90(sc: Scenario, res: ModelResult, one_way_s: float) -> float:
    """Queue-free P90 TTFT with the WAN: an offloaded request's first token waits for its
    prefill, then its last layer's KV (the tail the layer-wise stream leaves) and the one-way delay."""
    assert res.threshold is not None
    dist = LengthDistribution.from_spec(sc.workload.input)
    dep = StagePools.from_scenario(sc, (res.n_p, res.n_d))
    if len(dep.prfaas) != 1 or len(dep.pd_prefill) != 1:
        raise ScenarioError(f"scenario {sc.name!r}: the map needs one PrfaaS and one PD prefill pool")
    v = dist.values
    kv = KVModel.from_spec(sc.model)
    remote = prefill_seconds(dep.prfaas[0].prefill, v) + one_way_s + last_layer_bytes(kv, v) * 8.0 / res.link_bps
    local = prefill_seconds(dep.pd_prefill[0].prefill, v)
    return weighted_quantile(np.where(v > res.threshold, remote, local), dist.mass, 0.9)


@dataclass(frozen=True)
class MapPoint:
    """One cell of the map: model x link rate x RTT, by the analytical model."""

    model: str
    kind: Kind
    rate_gbps: float
    rtt_ms: float
    threshold: int
    n_prfaas: int
    n_p: int
    n_d: int
    offload_share: float
    lambda_max: float
    bottleneck: str
    prfaas_bound: str | None
    egress_gbps: float  # PrfaaS egress at Lambda_max
    link_utilisation: float  # of the link's rate
    ttft_p90_s: float  # queue-free, with the WAN's one-way delay and KV tail
    ttft_p90_prefill_s: float  # queue-free prefill only (Table 6's reading)
    homogeneous_lambda_max: float
    homogeneous_n_p: int
    homogeneous_n_d: int
    homogeneous_ttft_p90_s: float
    gain: float  # Lambda_max(PrfaaS-PD) / Lambda_max(homogeneous PD)

    @property
    def key(self) -> str:
        return point_key(self.model, self.rate_gbps, self.rtt_ms)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def point_key(model: str, rate_gbps: float, rtt_ms: float) -> str:
    return f"{model}@{rate_gbps:g}g/{rtt_ms:g}ms"


@dataclass(frozen=True)
class BreakEven:
    """The smallest link rate at which the gain reaches 1 (within the search's resolution).

    `bound`: "exact" (found inside [lo, hi]), "below" (already >= 1 at lo: rate_bps is lo),
    "never" (still < 1 at hi: the deployment's compute, not the link, keeps it below;
    rate_bps is None)."""

    rate_bps: float | None
    bound: Literal["exact", "below", "never"]
    lo_bps: float
    hi_bps: float
    gain_at_hi: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def smallest_rate(
    f: Callable[[float], float],
    target: float,
    lo: float,
    hi: float,
    rtol: float = BREAK_EVEN_RTOL,
    known: Mapping[float, float] | None = None,
) -> BreakEven:
    """Smallest x in [lo, hi] with f(x) >= target, for f non-decreasing, by bisection in log x;
    the answer is an x known to reach the target, at most `rtol` above the true one. `known`
    values of f (x -> f(x), e.g. the map's grid) narrow the bracket before any new evaluation."""
    if not (0 < lo < hi) or rtol <= 0:
        raise ValueError(f"need 0 < lo < hi and rtol > 0, got lo={lo}, hi={hi}, rtol={rtol}")
    seen = {x: v for x, v in (known or {}).items() if lo <= x <= hi}

    def at(x: float) -> float:
        if x not in seen:
            seen[x] = f(x)
        return seen[x]

    f_hi = at(hi)
    if f_hi < target:
        return BreakEven(None, "never", lo, hi, f_hi)
    if at(lo) >= target:
        return BreakEven(lo, "below", lo, hi, f_hi)
    a = max(x for x, v in seen.items() if v < target)
    b = min(x for x, v in seen.items() if v >= target)
    if b < a:
        raise ValueError(f"f is not non-decreasing: f({b:g}) >= {target:g} > f({a:g})")
    while b / a > 1 + rtol:
        mid = math.sqrt(a * b)
        if at(mid) >= target:
            b = mid
        else:
            a = mid
    return BreakEven(b, "exact", lo, hi, f_hi)


def gain_curve(
    dep: Deployments, homogeneous: HomogeneousPoint, split: SplitMode = "optimise"
) -> Callable[[float], float]:
    """Gain as a function of the link rate (bit/s); non-decreasing, as more bandwidth only
    loosens the link bound at every t."""

    def gain(rate_bps: float) -> float:
        return best_prfaas(dep.prfaas, rate_bps, split).lambda_max / homogeneous.lambda_max

    return gain


def break_even(
    dep: Deployments,
    homogeneous: HomogeneousPoint,
    split: SplitMode = "optimise",
    lo: float = BREAK_EVEN_LO,
    hi: float = BREAK_EVEN_HI,
    rtol: float = BREAK_EVEN_RTOL,
    known: Mapping[float, float] | None = None,
) -> BreakEven:
    """The smallest link rate (bit/s) at which PrfaaS-PD's Lambda_max reaches homogeneous PD's;
    `known` gains (bit/s -> gain) bracket the search."""
    return smallest_rate(gain_curve(dep, homogeneous, split), 1.0, lo, hi, rtol, known)


@dataclass(frozen=True)
class ModelSummary:
    model: str
    kind: Kind
    homogeneous: HomogeneousPoint
    break_even: BreakEven | None  # None: not searched

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "kind": self.kind,
            "homogeneous": asdict(self.homogeneous),
            "break_even": None if self.break_even is None else self.break_even.to_dict(),
        }


@dataclass(frozen=True)
class ModelMap:
    points: list[MapPoint]
    models: list[ModelSummary]
    rates_gbps: list[float]
    rtts_ms: list[float]
    split: SplitMode
    pd_curve: PdCurve

    def point(self, model: str, rate_gbps: float, rtt_ms: float) -> MapPoint:
        for p in self.points:
            if p.model == model and p.rate_gbps == rate_gbps and p.rtt_ms == rtt_ms:
                return p
        raise KeyError(point_key(model, rate_gbps, rtt_ms))


def map_point(
    dep: Deployments, homogeneous: HomogeneousPoint, res: ModelResult, rate_gbps: float, rtt_ms: float
) -> MapPoint:
    assert res.threshold is not None
    return MapPoint(
        model=dep.model,
        kind=dep.kind,
        rate_gbps=rate_gbps,
        rtt_ms=rtt_ms,
        threshold=res.threshold,
        n_prfaas=res.n_prfaas,
        n_p=res.n_p,
        n_d=res.n_d,
        offload_share=res.p,
        lambda_max=res.lambda_max,
        bottleneck=res.bottleneck,
        prfaas_bound=res.prfaas_bound,
        egress_gbps=res.egress_bps / 1e9,
        link_utilisation=res.egress_fraction,
        ttft_p90_s=wan_ttft_p90(dep.prfaas, res, rtt_ms / 2e3),
        ttft_p90_prefill_s=res.ttft_p90_s,
        homogeneous_lambda_max=homogeneous.lambda_max,
        homogeneous_n_p=homogeneous.n_p,
        homogeneous_n_d=homogeneous.n_d,
        homogeneous_ttft_p90_s=homogeneous.ttft_p90_s,
        gain=res.lambda_max / homogeneous.lambda_max,
    )


def compute_map(
    deployments: Sequence[Deployments],
    rates_gbps: Sequence[float] = DEFAULT_RATES_GBPS,
    rtts_ms: Sequence[float] = DEFAULT_RTTS_MS,
    split: SplitMode = "optimise",
    pd_curve: PdCurve = "scaled",
    with_break_even: bool = True,
) -> ModelMap:
    if not deployments or not rates_gbps or not rtts_ms:
        raise ModelError("the map needs at least one model, one link rate and one RTT")
    if any(r <= 0 for r in rates_gbps) or any(r < 0 for r in rtts_ms):
        raise ModelError("link rates must be > 0 Gbit/s and RTTs >= 0 ms")
    points: list[MapPoint] = []
    summaries: list[ModelSummary] = []
    for dep in deployments:
        hom = best_homogeneous(dep.homogeneous, split)
        gains: dict[float, float] = {}
        for rate in rates_gbps:
            res = best_prfaas(dep.prfaas, rate * 1e9, split)  # the RTT does not enter the fluid model
            points += [map_point(dep, hom, res, rate, rtt) for rtt in rtts_ms]
            gains[rate * 1e9] = res.lambda_max / hom.lambda_max
        be = break_even(dep, hom, split, known=gains) if with_break_even else None
        summaries.append(ModelSummary(dep.model, dep.kind, hom, be))
    return ModelMap(points, summaries, list(rates_gbps), list(rtts_ms), split, pd_curve)


@dataclass(frozen=True)
class SourceMaps:
    """The same map computed from each profile source's curves (config.PROFILE_SOURCES), for the
    models each ships: the first is the map's own source."""

    maps: dict[str, ModelMap]

    def sources(self) -> list[str]:
        return list(self.maps)

    def point(self, source: str, model: str, rate_gbps: float, rtt_ms: float) -> MapPoint | None:
        mm = self.maps.get(source)
        if mm is None or not any(m.model == model for m in mm.models):
            return None
        return mm.point(model, rate_gbps, rtt_ms)

    def summary(self, source: str, model: str) -> ModelSummary | None:
        mm = self.maps.get(source)
        return None if mm is None else next((m for m in mm.models if m.model == model), None)

    def models(self) -> list[str]:
        return list(dict.fromkeys(m.model for mm in self.maps.values() for m in mm.models))


def compare_sources(
    primary: str, mm: ModelMap, models: Sequence[str], sources: Sequence[str], with_break_even: bool = True
) -> SourceMaps:
    """`mm` (computed from `primary`'s profiles) beside the map of every other source in
    `sources` over the same grid, for the models of `models` that source ships."""
    maps = {primary: mm}
    for src in sources:
        if src == primary or src in maps:
            continue
        have = [m for m in models if not Path(m).exists() and src in profile_sources(m)]
        if not have:
            continue
        deps = [load_deployments(m, mm.pd_curve, source=src) for m in have]
        maps[src] = compute_map(deps, mm.rates_gbps, mm.rtts_ms, mm.split, mm.pd_curve, with_break_even)
    return SourceMaps(maps)
