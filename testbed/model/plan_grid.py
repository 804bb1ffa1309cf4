"""The planner's vectorised core: one family's figures over grids of (split, threshold) for one
(N_prfaas, N_pd) pair, and one configuration's figures from its routing request by request.

Every figure is the analytical model's (`analytical.evaluate` gives the same Lambda_max and
thetas for a candidate's scenario) plus a queueing estimate of TTFT at the workload's own
rate (`queueing`): per stage G/G/c with the service times of the lengths routed to it, by its
GI/M/c skeleton on the workload's measured gap law thinned to the stage's share (`gim_wait`;
M/G/c on the SCV alone without a law), the decode slots likewise with N_d * BS_max servers, the
last layer's KV crossing the link and the link's one-way delay for offloaded requests, one decode
step and the wait for the running batch's step boundary. One configuration scored request by
request (`Evaluator.score_split`) reads each stage's own arrivals span by span (`_windowed`).

For one (N_prfaas, N_pd) pair every split and every threshold is one numpy array. With an
empirical distribution, p, l_long, l_short change only at the sample's lengths, so the
thresholds tried are those lengths (thinned beyond `MAX_THRESHOLDS`): nothing between two of
them can rank differently. A chosen t is then moved to the roundest number that splits the
sample the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import numpy as np
import numpy.typing as npt

from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.prefill_batch import BatchPolicy
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.hardware import DecodeSpec, HardwareSpec
from testbed.model.analytical import (
    DiscreteDistribution,
    FloatArray,
    LengthDistribution,
    Workload,
    kv_bytes,
    last_layer_bytes,
    prefill_seconds,
)
from testbed.model.arrivals import GapLaw, Windows
from testbed.model.batching import batching_adjustment
from testbed.model.plan_types import Candidate, Family, PlanError, PlanSettings, kind_pools
from testbed.model.queueing import Branch, Wait, gim_wait, mgc_wait, mixture_quantile, split_scv, windowed_wait

MAX_THRESHOLDS = 20000  # thresholds tried per (counts, split) grid
_P90_TRIES = 8  # per split: next-best thresholds tried when the best misses the P90 SLO
_P90_SHORTLIST = 48  # objective ttft-p90: thresholds (best by mean TTFT) whose P90 is computed
_MAX_ROLE = 64  # ClusterSpec: at most 64 prefill and 64 decode instances per cluster


@dataclass(frozen=True)
class _Atoms:
    """Per-length figures of the workload on one family's hardware."""

    v: FloatArray
    m: FloatArray
    t_prf: FloatArray | None
    t_pd: FloatArray
    kv: FloatArray
    tail: FloatArray  # last layer's KV over the link (s)


@dataclass(frozen=True)
class _Sides:
    """Per-threshold split of the workload (arrays over K thresholds)."""

    ts: FloatArray
    p: FloatArray
    unit_prf: FloatArray  # 1 / T_prfaas(l_long): Theta_prfaas per instance (plain form)
    link_cap: FloatArray  # B_out / S_kv(l_long)
    unit_pd: FloatArray  # 1 / T_pd(l_short)
    es_prf: FloatArray
    es2_prf: FloatArray
    es_pd: FloatArray
    es2_pd: FloatArray
    tail_long: FloatArray  # mean KV tail of offloaded requests
    kv_long: FloatArray  # E[S_kv | offloaded]


class Grid(TypedDict):
    """Arrays over (split j, threshold k) of one PrfaaS size (`Evaluator.grid`), and what scoring
    one split adds (its threshold's sides, the stages' mean waits, span by span where windowed)."""

    n_d: npt.NDArray[np.int64]
    lam: FloatArray
    th_prf: FloatArray
    th_pdp: FloatArray
    th_pdd: FloatArray
    lim_prf: FloatArray
    lim_pdp: FloatArray
    mean: FloatArray
    free: FloatArray
    feasible: npt.NDArray[np.bool_]
    w_prf: Wait
    w_pdp: Wait
    w_dec: Wait
    sides: NotRequired[_Sides]
    wait_pd: NotRequired[float]
    wait_prfaas: NotRequired[float]
    span_waits: NotRequired[tuple[FloatArray, FloatArray, FloatArray]]


def busy_seconds(spec: HardwareSpec, pt: PrefillTime, tokens: FloatArray) -> FloatArray:
    """Instance-seconds a prompt occupies at saturation under the hardware's scheduler
    (`testbed.model.batching`): the capacity units; the waits keep the single-prompt time."""
    out: FloatArray = prefill_seconds(pt, tokens) + batching_adjustment(
        pt, tokens, BatchPolicy.from_spec(spec.scheduler)
    )
    return out


def _atoms(fam: Family, dist: DiscreteDistribution, kv: KVModel, link_bps: float) -> _Atoms:
    hw = fam.base.hardware
    v = dist.values
    t_prf = None if fam.prfaas_hw is None else prefill_seconds(PrefillTime.from_spec(hw[fam.prfaas_hw].prefill), v)
    t_pd = prefill_seconds(PrefillTime.from_spec(hw[fam.pd_hw].prefill), v)
    return _Atoms(v, dist.mass, t_prf, t_pd, kv_bytes(kv, v), last_layer_bytes(kv, v) * 8.0 / link_bps)


def _sides(dist: DiscreteDistribution, a: _Atoms, kv: KVModel, link_bps: float, fam: Family, ts: FloatArray) -> _Sides:
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
    unit_pd = 1.0 / busy_seconds(hw[fam.pd_hw], pd_pt, l_short_eval)
    sd_pd, _ = split(a.t_pd)
    sq_pd, _ = split(a.t_pd * a.t_pd)
    zeros = np.zeros_like(ts)
    if a.t_prf is not None and fam.prfaas_hw is not None:
        prf_pt = PrefillTime.from_spec(hw[fam.prfaas_hw].prefill)
        unit_prf = 1.0 / busy_seconds(hw[fam.prfaas_hw], prf_pt, l_long_eval)
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
        ts=ts,
        p=p,
        unit_prf=unit_prf,
        link_cap=link_bps / (8.0 * kv_bytes(kv, l_long_eval)),
        unit_pd=unit_pd,
        es_prf=clean(es_prf),
        es2_prf=clean(es2_prf),
        es_pd=clean(per(sd_pd, pb)),
        es2_pd=clean(per(sq_pd, pb)),
        tail_long=clean(per(tail_up, p)),
        kv_long=clean(per(kv_up, p)),
    )


@dataclass(frozen=True)
class _Decode:
    per_instance: float  # Theta_pdd per decode instance
    slots: int  # BS_max under the TPOT SLO
    step_s: float  # T_decode
    service_s: float  # E[slot time] = T_decode * E[L_out]
    service_sq: float  # E[slot time^2]
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
    return _Decode(bs / (spec.base_s * out), bs, spec.base_s, spec.base_s * out, spec.base_s**2 * sq, note)


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


class Evaluator:
    """A family's figures over grids of (split, threshold) for one (N_prfaas, N_pd) pair."""

    def __init__(self, fam: Family, wl: Workload, kv: KVModel, s: PlanSettings) -> None:
        self.fam, self.wl, self.kv, self.s = fam, wl, kv, s
        self.rate = s.rate if s.rate is not None else wl.rate
        self.atoms = _atoms(fam, wl.dist, kv, s.link_bps)
        spec = fam.base.hardware[fam.pd_hw].decode
        assert spec is not None
        self.dec = _decode(spec, wl, s.tpot_slo_s)
        uses = kind_pools(fam.kind)
        if uses.threshold:
            ts = _thresholds(wl.dist, s)
        else:  # a threshold above every length (all on PD-P) or below (all to PrfaaS)
            ts = np.array([-1.0 if uses.prfaas else math.inf])
        self.sides = _sides(wl.dist, self.atoms, kv, s.link_bps, fam, ts)

    def splits(self, n_pd: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        if not kind_pools(self.fam.kind).pd_prefill:
            n_p = np.array([0])
        else:
            n_p = np.arange(1, n_pd)
        n_d = n_pd - n_p
        ok = (n_p <= _MAX_ROLE) & (n_d <= _MAX_ROLE) & (n_d >= 1)
        return n_p[ok].astype(np.int64), n_d[ok].astype(np.int64)

    def grid(
        self, n_prf: int, n_p: npt.NDArray[np.int64], n_d: npt.NDArray[np.int64], sides: _Sides | None = None
    ) -> Grid:
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
        w_prf = self._wait(sd.p, sd.es_prf, sd.es2_prf, np.asarray(n_prf))  # [K]
        w_pdp = self._wait((1.0 - sd.p)[None, :], sd.es_pd[None, :], sd.es2_pd[None, :], n_p[:, None])  # [J, K]
        w_dec = self._wait(
            np.ones(1), np.asarray(self.dec.service_s), np.asarray(self.dec.service_sq), n_d * self.dec.slots
        )  # [J]
        dec_extra = self.dec_extra(w_dec.mean, n_d)[:, None]
        with np.errstate(invalid="ignore"):
            prf_term = np.where(p > 0, p * (sd.es_prf + w_prf.mean + sd.tail_long + self.s.link_delay_s)[None, :], 0.0)
            pdp_term = np.where(pb > 0, pb * (sd.es_pd[None, :] + w_pdp.mean), 0.0)
        mean = np.broadcast_to(prf_term + pdp_term + dec_extra, shape)
        free = (sd.p * sd.es_prf + (1.0 - sd.p) * sd.es_pd)[None, :] + np.zeros_like(mean)
        feasible = np.isfinite(mean) & (r < lam) & (self.dec.slots > 0)
        return {
            "n_d": n_d,
            "lam": lam,
            "th_prf": np.broadcast_to(th_prf, shape),
            "th_pdp": np.broadcast_to(th_pdp, shape),
            "th_pdd": th_pdd[:, 0],
            "lim_prf": lim_prf,
            "lim_pdp": lim_pdp,
            "mean": mean,
            "free": free,
            "feasible": feasible,
            "w_prf": w_prf,
            "w_pdp": w_pdp,
            "w_dec": w_dec,
        }

    @property
    def stretch(self) -> float:
        """How much longer the gaps are at the evaluated rate than in the workload."""
        return self.wl.rate / self.rate if self.rate > 0 and self.wl.rate > 0 else 1.0

    def _wait(self, share: FloatArray, es: FloatArray, es2: FloatArray, servers: npt.NDArray[np.int64]) -> Wait:
        """A stage receiving a random `share` of the arrivals: GI/G/c on the thinned gap law
        when the workload has one (`queueing.gim_wait`), else M/G/c-like on the SCV alone."""
        r, ca2, law = self.rate, self.wl.arrival_scv, self.wl.gap_law
        q2 = split_scv(ca2, share)
        if law is None:
            return mgc_wait(r * share, es, es2, servers, q2)
        with np.errstate(divide="ignore", invalid="ignore"):
            cmu = np.where(es > 0, servers / np.where(es > 0, es, 1.0), np.inf)
        sig = law.sigma(cmu, share, law.mean * self.stretch)
        return gim_wait(r * share, es, es2, servers, sig, q2)

    def dec_extra(self, wait: npt.ArrayLike, n_d: npt.ArrayLike) -> FloatArray:
        """What decode adds to TTFT: the wait for a slot, the first step, and the wait for the
        running batch's next step boundary (a sequence joins there: half a step on average, when
        the instance has a batch; `busy` is that chance with Poisson-many sequences per instance,
        by Little's law lambda E[slot time] over the instances)."""
        per = self.rate * self.dec.service_s / np.maximum(np.asarray(n_d, dtype=np.float64), 1.0)
        busy = 1.0 - np.exp(-per)
        out: FloatArray = np.asarray(wait, dtype=np.float64) + self.dec.step_s * (1.0 + 0.5 * busy)
        return out

    def p90(self, g: Grid, j: int, k: int) -> float:
        """The quantile of TTFT for grid cell (j, k)."""
        sd, a = self.sides if g.get("sides") is None else g["sides"], self.atoms
        t = float(sd.ts[k])
        if not bool(g["feasible"][j, k]) and not math.isfinite(float(g["mean"][j, k])):
            return math.inf
        w_dec = g["w_dec"]
        extra = float(self.dec_extra(w_dec.mean[j], g["n_d"][j]))
        up = a.v > t
        branches = []
        if up.any() and a.t_prf is not None:
            w = g["w_prf"]
            branches.append(
                Branch(
                    a.m[up],
                    a.t_prf[up] + a.tail[up] + self.s.link_delay_s + extra,
                    float(w.p_wait[k]),
                    float(w.tail_mean[k]),
                )
            )
        if (~up).any():
            w = g["w_pdp"]
            branches.append(Branch(a.m[~up], a.t_pd[~up] + extra, float(w.p_wait[j, k]), float(w.tail_mean[j, k])))
        return mixture_quantile(branches, self.s.quantile)

    def candidate(
        self, g: Grid, n_prf: int, n_p: int, n_d: int, j: int, k: int, p90: float, threshold: int | None
    ) -> Candidate:
        sd = self.sides if g.get("sides") is None else g["sides"]
        kind = self.fam.kind
        uses = kind_pools(kind)
        p = float(sd.p[k])
        lam = float(g["lam"][j, k])
        limits = {"prfaas": float(g["lim_prf"][j, k]), "pdp": float(g["lim_pdp"][j, k]), "pdd": float(g["th_pdd"][j])}
        bottleneck = min(limits, key=lambda x: limits[x])
        if bottleneck == "prfaas":
            bottleneck += " (link)" if float(sd.link_cap[k]) < n_prf * float(sd.unit_prf[k]) else " (compute)"
        r = self.rate
        egress = r * p * float(sd.kv_long[k]) * 8.0 if uses.prfaas else 0.0
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
            kind=kind,
            base=self.fam.base.name,
            n_prfaas=n_prf,
            n_p=n_p,
            n_d=n_d,
            threshold=threshold,
            p=p,
            lambda_max=lam,
            theta_prfaas=float(g["th_prf"][j, k]) if uses.prfaas else None,
            theta_pdp=float(g["th_pdp"][j, k]) if uses.pd_prefill else None,
            theta_pdd=float(g["th_pdd"][j]),
            bottleneck=bottleneck,
            rate=r,
            ttft_free_s=float(g["free"][j, k]),
            ttft_mean_s=mean,
            ttft_p90_s=p90,
            util_prfaas=float(g["w_prf"].utilisation[k]) if uses.prfaas else None,
            util_pdp=float(g["w_pdp"].utilisation[j, k]) if uses.pd_prefill else None,
            util_pdd=float(g["w_dec"].utilisation[j]),
            egress_bps=egress,
            egress_share=egress / self.s.link_bps,
            meets_slo=meets,
            notes=tuple(notes),
            meets_slo_model=meets,
        )

    def _order(self, g: Grid, j: int) -> npt.NDArray[np.intp]:
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
            t = (
                None
                if not kind_pools(self.fam.kind).threshold
                else _round_threshold(self.wl.dist, float(self.sides.ts[k]))
            )
            out.append(self.candidate(g, n_prf, int(n_p[j]), int(n_d[j]), j, k, p90, t))
        return out

    def score(self, n_prf: int, n_p: int, n_d: int, threshold: float | None) -> Candidate:
        """The figures of one given configuration (e.g. a base scenario as it stands)."""
        if kind_pools(self.fam.kind).threshold:
            if threshold is None:
                raise PlanError("a prfaas configuration needs a threshold")
            ts = np.array([float(threshold)])
        else:
            ts = self.sides.ts[:1]
        sides = _sides(self.wl.dist, self.atoms, self.kv, self.s.link_bps, self.fam, ts)
        g = self.grid(n_prf, np.array([n_p]), np.array([n_d]), sides)
        g["sides"] = sides
        p90 = self.p90(g, 0, 0)
        t = None if not kind_pools(self.fam.kind).threshold else int(round(float(ts[0])))
        return self.candidate(g, n_prf, n_p, n_d, 0, 0, p90, t)

    def score_split(
        self,
        n_prf: int,
        n_p: int,
        n_d: int,
        threshold: int | None,
        up: npt.NDArray[np.bool_],
        computed: npt.ArrayLike,
        cached: npt.ArrayLike,
        shipped: npt.ArrayLike,
    ) -> tuple[Candidate, Grid]:
        """The figures of one configuration from its routing request by request (a
        `workload.CacheReplay`): whether each goes to PrfaaS, the tokens its prefill computes and
        reuses (the cached-token term of the prefill time counts here), and those whose KV
        crosses. Returns the candidate and its grid (the stages' waits)."""
        hw, a, kv, link = self.fam.base.hardware, self.atoms, self.kv, self.s.link_bps
        up = np.asarray(up, dtype=np.bool_)
        svc = np.asarray(computed, dtype=np.float64)
        hit = np.asarray(cached, dtype=np.float64)
        ship = np.asarray(shipped, dtype=np.float64)
        down = ~up
        pd_pt = PrefillTime.from_spec(hw[self.fam.pd_hw].prefill)
        t_pd = prefill_seconds(pd_pt, svc) + pd_pt.cached_token_s * hit
        if self.fam.prfaas_hw is not None:
            prf_pt: PrefillTime | None = PrefillTime.from_spec(hw[self.fam.prfaas_hw].prefill)
            assert prf_pt is not None
            t_prf = prefill_seconds(prf_pt, svc) + prf_pt.cached_token_s * hit
        else:
            prf_pt, t_prf = None, np.zeros_like(svc)
        tail = last_layer_bytes(kv, ship) * 8.0 / link
        kvb = kv_bytes(kv, ship)

        def cond(x: FloatArray, m: npt.NDArray[np.bool_], empty: float = 0.0) -> float:
            return float(x[m].mean()) if m.any() else empty

        l_long = cond(svc, up, a.v[-1])
        l_short = cond(svc, down, a.v[0])

        def one(x: float) -> FloatArray:
            return np.array([x], dtype=np.float64)

        sides = _Sides(
            ts=one(-1.0 if threshold is None else threshold),
            p=one(float(up.mean())),
            unit_prf=one(
                1.0 / busy_seconds(hw[self.fam.prfaas_hw], prf_pt, one(l_long))[0]
                if prf_pt is not None and self.fam.prfaas_hw is not None
                else 0.0
            ),
            link_cap=one(link / (8.0 * kv_bytes(kv, one(cond(ship, up, a.v[-1])))[0])),
            unit_pd=one(1.0 / busy_seconds(hw[self.fam.pd_hw], pd_pt, one(l_short))[0]),
            es_prf=one(cond(t_prf, up)),
            es2_prf=one(cond(t_prf * t_prf, up)),
            es_pd=one(cond(t_pd, down)),
            es2_pd=one(cond(t_pd * t_pd, down)),
            tail_long=one(cond(tail, up)),
            kv_long=one(cond(kvb, up)),
        )
        g = self.grid(n_prf, np.array([n_p]), np.array([n_d]), sides)
        g["sides"] = sides
        g["wait_pd"], g["wait_prfaas"] = float(g["w_pdp"].mean[0, 0]), float(g["w_prf"].mean[0])
        win, times = self.wl.windows, self.wl.arrival_times
        if win is not None and times is not None and times.size == svc.size and svc.size:
            p90 = self._windowed(g, win, times, n_prf, n_p, n_d, up, t_prf + tail + self.s.link_delay_s, t_pd)
        else:
            p90 = math.inf
            if bool(g["feasible"][0, 0]) or math.isfinite(float(g["mean"][0, 0])):
                extra = float(self.dec_extra(g["w_dec"].mean[0], n_d))
                w = np.full(svc.size, 1.0 / svc.size)
                branches = []
                if up.any():
                    wp = g["w_prf"]
                    branches.append(
                        Branch(
                            w[up],
                            t_prf[up] + tail[up] + self.s.link_delay_s + extra,
                            float(wp.p_wait[0]),
                            float(wp.tail_mean[0]),
                        )
                    )
                if down.any():
                    wd = g["w_pdp"]
                    branches.append(
                        Branch(w[down], t_pd[down] + extra, float(wd.p_wait[0, 0]), float(wd.tail_mean[0, 0]))
                    )
                p90 = mixture_quantile(branches, self.s.quantile)
        return self.candidate(g, n_prf, n_p, n_d, 0, 0, p90, threshold), g

    def _windowed(
        self,
        g: Grid,
        win: Windows,
        times: FloatArray,
        n_prf: int,
        n_p: int,
        n_d: int,
        up: npt.NDArray[np.bool_],
        off_up: FloatArray,
        off_down: FloatArray,
    ) -> float:
        """Mean and quantile of TTFT span by span (`queueing.windowed_wait`): each stage in each
        span at the rate and with the gaps of the requests routed to it there (`times`: each
        request's arrival), so routing that follows bursts (as cache misses in a burst do)
        shows, with the backlog the spans before it left. Puts the mean, the stages' mean waits
        and their waits span by span in `g`; returns the quantile."""
        sd: _Sides = g["sides"]
        p = float(sd.p[0])
        stretch = self.stretch
        share = win.share
        down = ~up
        spans = win.span_s * stretch

        def stage(mask: npt.NDArray[np.bool_], es: float, es2: float, c: int) -> tuple[Wait, FloatArray]:
            if not mask.any() or es <= 0:
                zeros = np.zeros(share.size)
                return Wait(zeros, zeros, zeros), zeros
            own = times[mask]
            parts = win.split(own)
            whole = GapLaw.from_gaps(np.diff(own))
            rates = np.array([x.size for x in parts], dtype=np.float64) / spans
            cmu = c / es
            sig, scv = np.empty(share.size), np.empty(share.size)
            for i, x in enumerate(parts):
                law = GapLaw.from_gaps(np.diff(x)) or whole
                if law is None:
                    sig[i], scv[i] = min(rates[i] * es / c, 1.0), 1.0  # too few to say: Poisson
                    continue
                sig[i] = float(law.sigma(cmu, 1.0, law.mean * stretch))
                scv[i] = law.scv
            return windowed_wait(rates, spans, es, es2, c, scv, sig)

        w_prf, f_prf = stage(up, float(sd.es_prf[0]), float(sd.es2_prf[0]), n_prf)
        w_pdp, f_pdp = stage(down, float(sd.es_pd[0]), float(sd.es2_pd[0]), n_p)
        w_dec, f_dec = stage(
            np.ones(up.size, dtype=np.bool_), self.dec.service_s, self.dec.service_sq, n_d * self.dec.slots
        )
        extra = self.dec_extra(w_dec.mean + f_dec, n_d)
        prf_wait, pdp_wait = w_prf.mean + f_prf, w_pdp.mean + f_pdp
        n = up.size
        span_of = np.clip(np.searchsorted(win.edges, times, side="right") - 1, 0, share.size - 1)
        n_up = np.bincount(span_of[up], minlength=share.size) / n
        n_down = np.bincount(span_of[down], minlength=share.size) / n
        n_all = n_up + n_down
        with np.errstate(invalid="ignore"):
            mean = float(
                p * (float(sd.es_prf[0]) + float(sd.tail_long[0]) + self.s.link_delay_s)
                + (1.0 - p) * float(sd.es_pd[0])
                + np.dot(n_up, np.where(n_up > 0, prf_wait, 0.0))
                + np.dot(n_down, np.where(n_down > 0, pdp_wait, 0.0))
                + np.dot(n_all, extra)
            )
        g["mean"] = np.array([[mean]])
        g["span_waits"] = (win.edges, pdp_wait, prf_wait)
        g["wait_prfaas"] = float(np.dot(n_up, prf_wait) / n_up.sum()) if n_up.sum() > 0 else 0.0
        g["wait_pd"] = float(np.dot(n_down, pdp_wait) / n_down.sum()) if n_down.sum() > 0 else 0.0
        if not math.isfinite(mean):
            return math.inf
        branches = []
        for i in range(share.size):
            here = span_of == i
            for m, off, w, f in ((up & here, off_up, w_prf, f_prf), (down & here, off_down, w_pdp, f_pdp)):
                if m.any():
                    branches.append(
                        Branch(
                            np.full(int(m.sum()), 1.0 / n), off[m] + extra[i] + f[i], float(w.p_wait[i]), _tail(w, i)
                        )
                    )
        return mixture_quantile(branches, self.s.quantile)

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
            near = sorted(
                {math.floor(c.threshold / step) * step, math.ceil(c.threshold / step) * step},
                key=lambda r: abs(r - c.threshold),  # type: ignore[operator]
            )
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


def _tail(w: Wait, i: int) -> float:
    """E[W | W > 0] of span i (0 where it never waits)."""
    pw = float(w.p_wait[i])
    return float(w.mean[i]) / pw if pw > 0 else 0.0
