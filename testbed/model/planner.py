"""Deployment planner: for each deployment kind, the threshold, P/D split and instance counts
the analytical model ranks best on a workload (typically a trace's, `testbed.model.workload`).

Kinds, each on its own base scenario (its hardware and instance budget):
- prfaas: a PrfaaS cluster prefilling requests whose incremental length exceeds t, and a PD
  cluster split N_p / N_d; searched over t, the split and (optionally) both counts;
- homogeneous: the PD cluster alone, searched over its split;
- naive: every prefill in PrfaaS, the PD cluster all decode.

Every figure is the analytical model's (`analytical.evaluate` gives the same Lambda_max and
thetas for a candidate's scenario) plus a queueing estimate of TTFT at the workload's own
rate (`queueing`): per stage M/G/c with the service times of the lengths routed to it, the
decode slots as M/G/(N_d * BS_max), the last layer's KV crossing the link and the link's
one-way delay for offloaded requests, and one decode step.

The search is vectorised: for one (N_prfaas, N_pd) pair every split and every threshold is one
numpy array. With an empirical distribution, p, l_long, l_short change only at the sample's
lengths, so the thresholds tried are those lengths (thinned beyond `MAX_THRESHOLDS`): nothing
between two of them can rank differently. A chosen t is then moved to the roundest number
that splits the sample the same way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from testbed.core.errors import UserError
from testbed.core.kvsize import KVModel
from testbed.core.scenario import ClusterSpec, DecodeSpec, Scenario
from testbed.core.servicetime import PrefillTime
from testbed.model.analytical import (
    DEFAULT_LINK_BPS,
    DiscreteDistribution,
    FloatArray,
    LengthDistribution,
    Workload,
    kv_bytes,
    last_layer_bytes,
    prefill_seconds,
)
from testbed.model.queueing import Branch, mgc_wait, mixture_quantile

Kind = Literal["prfaas", "homogeneous", "naive"]
Objective = Literal["lambda", "ttft", "ttft-p90"]
KINDS: tuple[Kind, ...] = ("prfaas", "homogeneous", "naive")
OBJECTIVES: tuple[Objective, ...] = ("lambda", "ttft", "ttft-p90")

MAX_THRESHOLDS = 20000     # thresholds tried per (counts, split) grid
_P90_TRIES = 8             # per split: next-best thresholds tried when the best misses the P90 SLO
_P90_SHORTLIST = 48        # objective ttft-p90: thresholds (best by mean TTFT) whose P90 is computed
_MAX_ROLE = 64             # ClusterSpec: at most 64 prefill and 64 decode instances per cluster


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
    prfaas_cluster: str | None         # None for homogeneous
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


def family_for(kind: Kind, base: Scenario, budget: Mapping[str, int] | None = None,
               vary_counts: bool = False) -> Family:
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
    min_pd = 1 if kind == "naive" else 2
    if kind == "homogeneous":
        top = budget.get(pd.hardware, n_pd0)
        counts = [(0, n) for n in (range(min_pd, top + 1) if vary_counts else [top])]
        fam = Family(kind, base, None, pd.name, tuple(counts))
    else:
        if pf is None:
            raise PlanError(f"kind {kind!r} needs a 'prfaas' cluster; scenario {base.name!r} has none")
        if pf.hardware == pd.hardware:
            total = budget.get(pd.hardware, pf.prefill + n_pd0)
            pairs = [(f, n) for f in range(1, total) for n in range(min_pd, total - f + 1)
                     if vary_counts or f + n == total]
        else:
            f_top = budget.get(pf.hardware, pf.prefill)
            n_top = budget.get(pd.hardware, n_pd0)
            pairs = [(f, n) for f in (range(1, f_top + 1) if vary_counts else [f_top])
                     for n in (range(min_pd, n_top + 1) if vary_counts else [n_top])]
        fam = Family(kind, base, pf.name, pd.name, tuple((f, n) for f, n in pairs if f >= 1 and n >= min_pd))
    if not fam.counts:
        raise PlanError(f"kind {kind!r} on {base.name!r}: the budget leaves no deployment "
                        f"(needs >= 1 PrfaaS instance where used and >= {min_pd} PD instances)")
    return fam


# ---------------------------------------------------------------------------------------------
# Settings and candidates


@dataclass(frozen=True)
class PlanSettings:
    ttft_slo_s: float
    tpot_slo_s: float
    objective: Objective = "lambda"
    link_bps: float = DEFAULT_LINK_BPS
    link_delay_s: float = 0.0          # one-way; offloaded requests' KV crosses it once
    rate: float | None = None          # offered rate for TTFT; None: the workload's
    quantile: float = 0.9
    t_min: float | None = None         # threshold range; default [max(min length, 1024), max length)
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
    p: float                      # share of requests prefilled in PrfaaS
    lambda_max: float             # the paper's Lambda_max
    theta_prfaas: float | None
    theta_pdp: float | None
    theta_pdd: float
    bottleneck: str
    rate: float                   # the offered rate the TTFT figures are at
    ttft_free_s: float            # queue-free mean TTFT (prefill alone, as the paper's Table 6)
    ttft_mean_s: float            # queueing estimate at `rate` (inf: a stage saturates)
    ttft_p90_s: float
    util_prfaas: float | None     # utilisation of each stage at `rate` (queueing form)
    util_pdp: float | None
    util_pdd: float
    egress_bps: float             # PrfaaS -> PD KV at `rate`
    egress_share: float           # of the link
    meets_slo: bool
    notes: tuple[str, ...] = ()
    simulated: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def instances(self) -> int:
        return self.n_prfaas + self.n_p + self.n_d

    @property
    def label(self) -> str:
        t = "-" if self.threshold is None else f"t={kilo(self.threshold)}"
        return f"{self.kind} {t} {self.n_prfaas}/{self.n_p}/{self.n_d}"

    def to_dict(self) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------
# The vectorised core


@dataclass(frozen=True)
class _Atoms:
    """Per-length figures of the workload on one family's hardware."""

    v: FloatArray
    m: FloatArray
    t_prf: FloatArray | None
    t_pd: FloatArray
    kv: FloatArray
    tail: FloatArray        # last layer's KV over the link (s)


@dataclass(frozen=True)
class _Sides:
    """Per-threshold split of the workload (arrays over K thresholds)."""

    ts: FloatArray
    p: FloatArray
    unit_prf: FloatArray      # 1 / T_prfaas(l_long): Theta_prfaas per instance (plain form)
    link_cap: FloatArray      # B_out / S_kv(l_long)
    unit_pd: FloatArray       # 1 / T_pd(l_short)
    es_prf: FloatArray
    es2_prf: FloatArray
    es_pd: FloatArray
    es2_pd: FloatArray
    tail_long: FloatArray     # mean KV tail of offloaded requests
    kv_long: FloatArray       # E[S_kv | offloaded]


def _atoms(fam: Family, dist: DiscreteDistribution, kv: KVModel, link_bps: float) -> _Atoms:
    hw = fam.base.hardware
    v = dist.values
    t_prf = None if fam.prfaas_hw is None else prefill_seconds(PrefillTime.from_spec(hw[fam.prfaas_hw].prefill), v)
    t_pd = prefill_seconds(PrefillTime.from_spec(hw[fam.pd_hw].prefill), v)
    return _Atoms(v, dist.mass, t_prf, t_pd, kv_bytes(kv, v), last_layer_bytes(kv, v) * 8.0 / link_bps)


def _sides(dist: DiscreteDistribution, a: _Atoms, kv: KVModel, link_bps: float, fam: Family,
           ts: FloatArray) -> _Sides:
    pb = dist.cdf(ts)
    p = 1.0 - pb

    def split(f: FloatArray) -> tuple[FloatArray, FloatArray]:
        below = dist.partial_below(f, ts)
        return below, float(np.dot(a.m, f)) - below

    def per(x: FloatArray, share: FloatArray) -> FloatArray:
        with np.errstate(divide="ignore", invalid="ignore"):
            out: FloatArray = np.where(share > 0, x / np.where(share > 0, share, 1.0), np.nan)
        return out

    l_below, l_above = split(a.v)
    l_long, l_short = per(l_above, p), per(l_below, pb)
    # Where a side has no requests, evaluate at the bound (as analytical.threshold_curves).
    l_long_eval = np.where(np.isnan(l_long), dist.hi, l_long)
    l_short_eval = np.where(np.isnan(l_short), dist.lo, l_short)
    hw = fam.base.hardware
    pd_pt = PrefillTime.from_spec(hw[fam.pd_hw].prefill)
    unit_pd = 1.0 / prefill_seconds(pd_pt, l_short_eval)
    sd_pd, _ = split(a.t_pd)
    sq_pd, _ = split(a.t_pd * a.t_pd)
    zeros = np.zeros_like(ts)
    if a.t_prf is not None and fam.prfaas_hw is not None:
        prf_pt = PrefillTime.from_spec(hw[fam.prfaas_hw].prefill)
        unit_prf = 1.0 / prefill_seconds(prf_pt, l_long_eval)
        _, s_prf = split(a.t_prf)
        _, q_prf = split(a.t_prf * a.t_prf)
        es_prf, es2_prf = per(s_prf, p), per(q_prf, p)
    else:
        unit_prf, es_prf, es2_prf = zeros, zeros, zeros
    _, tail_up = split(a.tail)
    _, kv_up = split(a.kv)

    def clean(x: FloatArray) -> FloatArray:
        # An empty side's figures are NaN; they carry zero weight, so any finite value will do.
        out: FloatArray = np.nan_to_num(x, nan=0.0)
        return out

    return _Sides(
        ts=ts, p=p, unit_prf=unit_prf, link_cap=link_bps / (8.0 * kv_bytes(kv, l_long_eval)), unit_pd=unit_pd,
        es_prf=clean(es_prf), es2_prf=clean(es2_prf), es_pd=clean(per(sd_pd, pb)), es2_pd=clean(per(sq_pd, pb)),
        tail_long=clean(per(tail_up, p)), kv_long=clean(per(kv_up, p)),
    )


@dataclass(frozen=True)
class _Decode:
    per_instance: float    # Theta_pdd per decode instance
    slots: int             # BS_max under the TPOT SLO
    step_s: float          # T_decode
    service_s: float       # E[slot time] = T_decode * E[L_out]
    service_sq: float      # E[slot time^2]
    note: str | None


def _decode(spec: DecodeSpec, wl: Workload, tpot_slo: float) -> _Decode:
    """Theta_pdd per instance = BS / (T_decode * L_out) (the paper's form), with BS the largest
    batch whose step time meets the TPOT SLO (BS_max unless per-sequence terms push it over)."""
    ctx = wl.context_tokens if wl.context_tokens is not None else wl.dist.mean() + 0.5 * wl.output_tokens
    per_seq = spec.per_seq_s + spec.per_context_token_s * ctx
    note = None
    if spec.base_s > tpot_slo * (1.0 + 1e-9):
        bs, note = 0, f"T_decode {spec.base_s * 1e3:.1f} ms exceeds the TPOT SLO {tpot_slo * 1e3:.1f} ms"
    elif per_seq > 0:
        bs = min(spec.bs_max, int((tpot_slo - spec.base_s) / per_seq + 1e-9))
        if bs < spec.bs_max:
            note = f"TPOT SLO caps the decode batch at {bs} of BS_max {spec.bs_max}"
    else:
        bs = spec.bs_max
    out = wl.output_tokens
    sq = wl.output_sq_tokens if wl.output_sq_tokens is not None else out * out
    return _Decode(bs / (spec.base_s * out), bs, spec.base_s, spec.base_s * out, spec.base_s ** 2 * sq, note)


def _thresholds(dist: DiscreteDistribution, s: PlanSettings) -> FloatArray:
    lo = s.t_min if s.t_min is not None else max(dist.lo, 1024.0)
    hi = s.t_max if s.t_max is not None else dist.hi
    if isinstance(dist, LengthDistribution):
        ts: FloatArray = np.arange(lo, hi, 100.0, dtype=np.float64)
    else:
        # Thresholds at or past the longest length send nothing to PrfaaS: not a PrfaaS plan.
        inner = dist.values[(dist.values > lo) & (dist.values < min(hi, dist.hi))]
        ts = np.unique(np.concatenate(([lo], inner)))
        if ts.size > MAX_THRESHOLDS:
            ts = np.unique(ts[np.linspace(0, ts.size - 1, MAX_THRESHOLDS).astype(np.int64)])
    if ts.size == 0 or lo >= dist.hi:
        raise PlanError(f"no threshold in [{lo:g}, {hi:g}) splits the workload (lengths {dist.lo:g}..{dist.hi:g})")
    return ts


def _round_threshold(dist: DiscreteDistribution, t: float) -> int:
    """The roundest integer in [t, next length): the same split, easier to read."""
    if isinstance(dist, LengthDistribution):
        return int(round(t))
    above = dist.values[dist.values > t]
    nxt = float(above[0]) if above.size else math.inf
    for step in (1000, 500, 100, 50, 10, 1):
        r = math.ceil(t / step) * step
        if r < nxt:
            return int(r)
    return int(math.ceil(t))


# A rounder threshold may cost this much of the objective's figures (relative) and nothing else.
ROUND_RTOL = 0.005
_ROUND_STEPS = (1000, 500, 250, 100, 50)


class _Evaluator:
    """A family's figures over grids of (split, threshold) for one (N_prfaas, N_pd) pair."""

    def __init__(self, fam: Family, wl: Workload, kv: KVModel, s: PlanSettings) -> None:
        self.fam, self.wl, self.kv, self.s = fam, wl, kv, s
        self.rate = s.rate if s.rate is not None else wl.rate
        self.atoms = _atoms(fam, wl.dist, kv, s.link_bps)
        spec = fam.base.hardware[fam.pd_hw].decode
        assert spec is not None
        self.dec = _decode(spec, wl, s.tpot_slo_s)
        if fam.kind == "homogeneous":
            ts = np.array([math.inf])
        elif fam.kind == "naive":
            ts = np.array([-1.0])
        else:
            ts = _thresholds(wl.dist, s)
        self.sides = _sides(wl.dist, self.atoms, kv, s.link_bps, fam, ts)

    def splits(self, n_pd: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        if self.fam.kind == "naive":
            n_p = np.array([0])
        else:
            n_p = np.arange(1, n_pd)
        n_d = n_pd - n_p
        ok = (n_p <= _MAX_ROLE) & (n_d <= _MAX_ROLE) & (n_d >= 1)
        return n_p[ok].astype(np.int64), n_d[ok].astype(np.int64)

    def grid(self, n_prf: int, n_p: npt.NDArray[np.int64], n_d: npt.NDArray[np.int64],
             sides: _Sides | None = None) -> dict[str, Any]:
        """Arrays over (split j, threshold k)."""
        sd = sides or self.sides
        p, pb = sd.p[None, :], 1.0 - sd.p[None, :]
        npc, ndc = n_p[:, None].astype(np.float64), n_d[:, None].astype(np.float64)
        th_prf = np.minimum(n_prf * sd.unit_prf, sd.link_cap)[None, :]
        th_pdp = npc * sd.unit_pd[None, :]
        th_pdd = ndc * self.dec.per_instance
        with np.errstate(divide="ignore", invalid="ignore"):
            lim_prf = np.where(p > 0, th_prf / np.where(p > 0, p, 1.0), np.inf)
            lim_pdp = np.where(pb > 0, th_pdp / np.where(pb > 0, pb, 1.0), np.inf)
        shape = (n_p.size, sd.ts.size)
        lim_prf, lim_pdp = np.broadcast_to(lim_prf, shape), np.broadcast_to(lim_pdp, shape)
        lam = np.minimum(np.minimum(lim_prf, lim_pdp), np.broadcast_to(th_pdd, shape))
        r = self.rate
        w_prf = mgc_wait(r * sd.p, sd.es_prf, sd.es2_prf, n_prf)                     # [K]
        w_pdp = mgc_wait(r * (1.0 - sd.p)[None, :], sd.es_pd[None, :], sd.es2_pd[None, :], n_p[:, None])
        w_dec = mgc_wait(r, self.dec.service_s, self.dec.service_sq, n_d * self.dec.slots)   # [J]
        dec_extra = (w_dec.mean + self.dec.step_s)[:, None]
        with np.errstate(invalid="ignore"):
            prf_term = np.where(p > 0, p * (sd.es_prf + w_prf.mean + sd.tail_long + self.s.link_delay_s)[None, :], 0.0)
            pdp_term = np.where(pb > 0, pb * (sd.es_pd[None, :] + w_pdp.mean), 0.0)
        mean = np.broadcast_to(prf_term + pdp_term + dec_extra, shape)
        free = (sd.p * sd.es_prf + (1.0 - sd.p) * sd.es_pd)[None, :] + np.zeros_like(mean)
        feasible = np.isfinite(mean) & (r < lam) & (self.dec.slots > 0)
        return {
            "lam": lam, "th_prf": np.broadcast_to(th_prf, shape), "th_pdp": np.broadcast_to(th_pdp, shape),
            "th_pdd": th_pdd[:, 0], "lim_prf": lim_prf, "lim_pdp": lim_pdp, "mean": mean, "free": free,
            "feasible": feasible, "w_prf": w_prf, "w_pdp": w_pdp, "w_dec": w_dec,
        }

    def p90(self, g: dict[str, Any], j: int, k: int) -> float:
        """The quantile of TTFT for grid cell (j, k)."""
        sd, a = self.sides if g.get("sides") is None else g["sides"], self.atoms
        t = float(sd.ts[k])
        if not bool(g["feasible"][j, k]) and not math.isfinite(float(g["mean"][j, k])):
            return math.inf
        w_dec = g["w_dec"]
        extra = float(w_dec.mean[j]) + self.dec.step_s
        up = a.v > t
        branches = []
        if up.any() and a.t_prf is not None:
            w = g["w_prf"]
            branches.append(Branch(a.m[up], a.t_prf[up] + a.tail[up] + self.s.link_delay_s + extra,
                                   float(w.p_wait[k]), float(w.tail_mean[k])))
        if (~up).any():
            w = g["w_pdp"]
            branches.append(Branch(a.m[~up], a.t_pd[~up] + extra, float(w.p_wait[j, k]), float(w.tail_mean[j, k])))
        return mixture_quantile(branches, self.s.quantile)

    def candidate(self, g: dict[str, Any], n_prf: int, n_p: int, n_d: int, j: int, k: int,
                  p90: float, threshold: int | None) -> Candidate:
        sd = self.sides if g.get("sides") is None else g["sides"]
        kind = self.fam.kind
        p = float(sd.p[k])
        lam = float(g["lam"][j, k])
        limits = {"prfaas": float(g["lim_prf"][j, k]), "pdp": float(g["lim_pdp"][j, k]),
                  "pdd": float(g["th_pdd"][j])}
        bottleneck = min(limits, key=lambda x: limits[x])
        if bottleneck == "prfaas":
            bottleneck += " (link)" if float(sd.link_cap[k]) < n_prf * float(sd.unit_prf[k]) else " (compute)"
        r = self.rate
        egress = r * p * float(sd.kv_long[k]) * 8.0 if kind != "homogeneous" else 0.0
        mean = float(g["mean"][j, k])
        notes: list[str] = []
        if self.dec.note:
            notes.append(self.dec.note)
        if r >= lam:
            notes.append(f"offered {r:.2f} req/s >= Lambda_max {lam:.2f}")
        elif not math.isfinite(mean):
            notes.append("a stage saturates at the offered rate (mean service time form)")
        elif p90 > self.s.ttft_slo_s:
            notes.append(f"P{self.s.quantile * 100:.0f} TTFT {p90:.2f} s over the SLO {self.s.ttft_slo_s:g} s")
        meets = bool(g["feasible"][j, k]) and p90 <= self.s.ttft_slo_s
        return Candidate(
            kind=kind, base=self.fam.base.name, n_prfaas=n_prf, n_p=n_p, n_d=n_d, threshold=threshold,
            p=p, lambda_max=lam,
            theta_prfaas=float(g["th_prf"][j, k]) if kind != "homogeneous" else None,
            theta_pdp=float(g["th_pdp"][j, k]) if kind != "naive" else None,
            theta_pdd=float(g["th_pdd"][j]), bottleneck=bottleneck, rate=r,
            ttft_free_s=float(g["free"][j, k]), ttft_mean_s=mean, ttft_p90_s=p90,
            util_prfaas=float(g["w_prf"].utilisation[k]) if kind != "homogeneous" else None,
            util_pdp=float(g["w_pdp"].utilisation[j, k]) if kind != "naive" else None,
            util_pdd=float(g["w_dec"].utilisation[j]),
            egress_bps=egress, egress_share=egress / self.s.link_bps, meets_slo=meets, notes=tuple(notes),
        )

    def _order(self, g: dict[str, Any], j: int) -> npt.NDArray[np.intp]:
        """Thresholds of row j, best first by the objective (the P90 objective by mean here)."""
        lam, mean = g["lam"][j], g["mean"][j]
        ok = g["feasible"][j] & (mean <= self.s.ttft_slo_s)
        bad = (~ok).astype(np.int64)
        if self.s.objective == "lambda":
            order: npt.NDArray[np.intp] = np.lexsort((mean, -np.round(lam, 9), bad))
        else:
            order = np.lexsort((-np.round(lam, 9), mean, bad))
        return order

    def best(self, n_prf: int, n_pd: int) -> list[Candidate]:
        """For one (N_prfaas, N_pd) pair: each split's best threshold."""
        n_p, n_d = self.splits(n_pd)
        if n_p.size == 0:
            return []
        g = self.grid(n_prf, n_p, n_d)
        out: list[Candidate] = []
        for j in range(n_p.size):
            order = self._order(g, j)
            if self.s.objective == "ttft-p90":
                picks = order[:_P90_SHORTLIST]
                p90s = [self.p90(g, j, int(k)) for k in picks]
                lam = g["lam"][j][picks]
                ok = np.array([bool(g["feasible"][j, k]) for k in picks]) & (np.array(p90s) <= self.s.ttft_slo_s)
                i = int(np.lexsort((-np.round(lam, 9), np.round(p90s, 9), (~ok).astype(np.int64)))[0])
                k, p90 = int(picks[i]), p90s[i]
            else:
                k, p90 = int(order[0]), self.p90(g, j, int(order[0]))
                if p90 > self.s.ttft_slo_s:
                    for kk in order[1:_P90_TRIES]:
                        if not bool(g["feasible"][j, kk]):
                            break
                        q = self.p90(g, j, int(kk))
                        if q <= self.s.ttft_slo_s:
                            k, p90 = int(kk), q
                            break
            t = None if self.fam.kind != "prfaas" else _round_threshold(self.wl.dist, float(self.sides.ts[k]))
            out.append(self.candidate(g, n_prf, int(n_p[j]), int(n_d[j]), j, k, p90, t))
        return out

    def score(self, n_prf: int, n_p: int, n_d: int, threshold: float | None) -> Candidate:
        """The figures of one given configuration (e.g. a base scenario as it stands)."""
        if self.fam.kind == "prfaas":
            if threshold is None:
                raise PlanError("a prfaas configuration needs a threshold")
            ts = np.array([float(threshold)])
        else:
            ts = self.sides.ts[:1]
        sides = _sides(self.wl.dist, self.atoms, self.kv, self.s.link_bps, self.fam, ts)
        g = self.grid(n_prf, np.array([n_p]), np.array([n_d]), sides)
        g["sides"] = sides
        p90 = self.p90(g, 0, 0)
        t = None if self.fam.kind != "prfaas" else int(round(float(ts[0])))
        return self.candidate(g, n_prf, n_p, n_d, 0, 0, p90, t)


    def rounder(self, c: Candidate) -> Candidate:
        """The candidate at the roundest nearby threshold that keeps its SLO standing and costs
        at most ROUND_RTOL of the objective's figures (dense samples leave no round t that
        splits them exactly the same way)."""
        if c.threshold is None:
            return c
        obj = self.s.objective
        for step in _ROUND_STEPS:
            if c.threshold % step == 0:
                return c
            near = sorted({math.floor(c.threshold / step) * step, math.ceil(c.threshold / step) * step},
                          key=lambda r: abs(r - c.threshold))     # type: ignore[operator]
            for r in near:
                if r <= 0:
                    continue
                d = self.score(c.n_prfaas, c.n_p, c.n_d, float(r))
                if d.meets_slo != c.meets_slo or d.lambda_max < c.lambda_max * (1 - ROUND_RTOL):
                    continue
                figure = {"lambda": "ttft_mean_s", "ttft": "ttft_mean_s", "ttft-p90": "ttft_p90_s"}[obj]
                if getattr(d, figure) <= getattr(c, figure) * (1 + ROUND_RTOL) + 1e-9:
                    return d
        return c


# ---------------------------------------------------------------------------------------------
# Public API


@dataclass(frozen=True)
class FamilyPlan:
    family: Family
    candidates: tuple[Candidate, ...]   # ranked, best first
    reference: Candidate | None         # the base scenario as it stands (None: not this kind)


def plan_family(fam: Family, wl: Workload, settings: PlanSettings, reference_threshold: float | None = None,
                round_top: int = 10) -> FamilyPlan:
    """Every (counts, split) of the family with its best threshold, ranked; the first
    `round_top` moved to a rounder threshold where that costs (almost) nothing."""
    kv = KVModel.from_spec(fam.base.model)
    ev = _Evaluator(fam, wl, kv, settings)
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
        if fam.kind != "prfaas" or reference_threshold is not None:
            ref = ev.score(n_prf, pd.prefill, pd.decode, reference_threshold)
    return FamilyPlan(fam, tuple(cands), ref)


def rank_all(plans: Sequence[FamilyPlan], objective: Objective) -> list[Candidate]:
    """Every candidate of every kind, best first."""
    return sorted((c for fp in plans for c in fp.candidates), key=lambda c: objective_key(c, objective))


def candidate_scenario(fam: Family, c: Candidate, name: str, cache_aware: bool) -> Scenario:
    """The candidate as a full scenario on the family's base (what a plan file resolves to)."""
    return Scenario.model_validate(scenario_patch(fam, c, name, cache_aware, full=True))


def scenario_patch(fam: Family, c: Candidate, name: str, cache_aware: bool, full: bool = False) -> dict[str, Any]:
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
    policy: dict[str, Any] = {"name": c.kind, "threshold": c.threshold, "cache_aware": cache_aware}
    if c.kind != "prfaas":
        policy["bandwidth_aware"] = False
    if not full:
        return {"name": name, "policy": policy, "clusters": clusters}
    merged = fam.base.model_dump(mode="json")
    merged.update(name=name, clusters=clusters)
    merged["policy"] = {**merged["policy"], **policy}
    return merged
