"""The paper's analytical throughput model (docs/paper.md, "Formulas", section 3.4).

Everything here is queue-free and in paper units (seconds, bytes, tokens, bits/s):
stage capacities Theta, the sustainable arrival rate Lambda_max, queue-free TTFT and
PrfaaS egress, under the scenario's synthetic length distribution or, given a `Workload`,
a trace's empirical one (`testbed.model.workload`).

Interpretation (checked against Table 6): each stage's capacity is the plain formula with
T_prefill evaluated *at the conditional mean length* (Theta = N / T(E[L | routed])), not
N / E[T(L) | routed].  The plain form reproduces every Theta of Table 6 within ~2%; the
mean-service-time form puts Theta_prfaas 3.3% and homogeneous Theta_pdp 4.2% low, so the
paper's numbers support the plain form.  TTFT figures are the mean and the P90 of the
TTFT *distribution* (T_prefill of the cluster each length is routed to), which matches
Table 6 within ~3%.

A batching prefill scheduler (`hardware.<hw>.scheduler: vllm`) shares each pass's fixed part among
the prompts in it: its capacity follows `testbed.model.batching` (FCFS, the default, is unchanged).

Decode capacity uses only base_s (T_decode) and bs_max of the PD hardware's decode profile;
per_seq_s and per_context_token_s are ignored, as in the paper's Theta_pdd formula.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np
import numpy.typing as npt

from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.prefill_batch import BatchPolicy
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.scenario import LengthDist, Scenario
from testbed.model.arrivals import GapLaw, Windows
from testbed.model.batching import batching_adjustment
from testbed.model.errors import ModelError

FloatArray = npt.NDArray[np.float64]

DEFAULT_LINK_BPS = 100e9
# 2**16 log-spaced cells over [128, 128K] are ~0.01% wide: integration error is far below
# the model's own calibration error, and one pass over the grid costs well under a millisecond.
DEFAULT_CELLS = 1 << 16

Stage = Literal["prfaas", "pdp", "pdd"]


# ---------------------------------------------------------------------------------------------
# Length distribution


class DiscreteDistribution(ABC):
    """An input-length distribution as atoms: `values` (ascending) with probability `mass`.

    Every figure of the model is a mass-weighted sum over the atoms; subclasses say how a
    threshold t splits the atoms (`_split`) and how quantiles read between them. Lengths are
    the *incremental* (uncached) prompt lengths the threshold is judged on.
    """

    values: FloatArray
    mass: FloatArray
    lo: float
    hi: float
    _cum_mass: FloatArray

    def _init_cum(self) -> None:
        self._cum_mass = np.concatenate(([0.0], np.cumsum(self.mass)))

    @abstractmethod
    def _split(self, ts: FloatArray) -> tuple[npt.NDArray[np.intp], FloatArray]:
        """Atom index k holding each t and the fraction of atom k at or below t (atoms below k are all below)."""

    # -- partial sums -------------------------------------------------------------------------

    def partial_below(self, fvals: FloatArray, ts: FloatArray) -> FloatArray:
        """E[f(L); L <= t] (unnormalised) for each t, given f evaluated on `values`."""
        cum = np.concatenate(([0.0], np.cumsum(self.mass * fvals)))
        k, frac = self._split(np.asarray(ts, dtype=np.float64))
        out: FloatArray = cum[k] + frac * self.mass[k] * fvals[k]
        return out

    def cdf(self, ts: FloatArray) -> FloatArray:
        c = self.partial_below(np.ones_like(self.values), ts)
        # Snap rounding residue so an empty side has exactly zero mass (no 0/0 conditional means).
        out: FloatArray = np.where(c < 1e-12, 0.0, np.where(c > 1.0 - 1e-12, 1.0, c))
        return out

    # -- scalar helpers -----------------------------------------------------------------------

    def expect(self, f: Callable[[FloatArray], FloatArray]) -> float:
        """E[f(L)] for a vectorised f."""
        return float(np.dot(self.mass, f(self.values)))

    def mean(self) -> float:
        return float(np.dot(self.mass, self.values))

    def tail(self, t: float) -> float:
        """p = P(L > t)."""
        return float(1.0 - self.cdf(np.array([t]))[0])

    def conditional(self, f: Callable[[FloatArray], FloatArray], t: float) -> tuple[float | None, float | None]:
        """(E[f(L) | L <= t], E[f(L) | L > t]); None where the condition has no mass."""
        fv = f(self.values)
        below = float(self.partial_below(fv, np.array([t]))[0])
        pb = float(self.cdf(np.array([t]))[0])
        total = float(np.dot(self.mass, fv))
        lo = below / pb if pb > 0 else None
        hi = (total - below) / (1.0 - pb) if pb < 1 else None
        return lo, hi

    def split_means(self, t: float) -> tuple[float, float | None, float | None]:
        """(p, l_long, l_short) at threshold t: p = P(L > t), l_long = E[L | L > t], l_short = E[L | L <= t]."""
        short, long_ = self.conditional(lambda v: v, t)
        return self.tail(t), long_, short

    def quantile(self, q: float) -> float:
        """Smallest atom whose cumulative mass reaches q."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be in [0, 1]")
        i = int(np.searchsorted(self._cum_mass[1:], q * (1.0 - 1e-12), side="left"))
        return float(self.values[min(i, len(self.values) - 1)])


class LengthDistribution(DiscreteDistribution):
    """Truncated log-normal input length, discretised into fine log-spaced cells.

    Each cell's probability mass is exact (normal CDF differences in log space); its
    representative length is the cell's geometric midpoint.  Expectations are mass-weighted
    sums over cells; at a threshold t the cell holding t is split in proportion to log-length,
    which keeps p(t), l_long(t), l_short(t) continuous in t (the optimiser relies on that).
    """

    def __init__(self, mu: float, sigma: float, lo: float, hi: float, cells: int = DEFAULT_CELLS) -> None:
        if not (0 < lo <= hi):
            raise ModelError(f"need 0 < min <= max, got [{lo}, {hi}]")
        if sigma <= 0:
            raise ModelError("sigma must be > 0")
        self.mu, self.sigma, self.lo, self.hi = mu, sigma, float(lo), float(hi)
        if lo == hi:
            # Degenerate truncation: a point mass (one cell of zero width).
            self.log_edges = np.array([math.log(lo), math.log(lo)])
            self.mass = np.ones(1)
        else:
            self.log_edges = np.linspace(math.log(lo), math.log(hi), cells + 1)
            z = (self.log_edges - mu) / (sigma * math.sqrt(2.0))
            cdf = 0.5 * (1.0 + np.array([math.erf(v) for v in z]))
            raw = np.diff(cdf)
            total = float(raw.sum())
            if total <= 0.0:
                raise ModelError("truncation bounds hold no probability mass")
            self.mass = raw / total
        self.values = np.exp(0.5 * (self.log_edges[:-1] + self.log_edges[1:]))
        self._init_cum()

    @classmethod
    def from_spec(cls, spec: LengthDist) -> LengthDistribution:
        return _cached_dist(spec.mu, spec.sigma, float(spec.min), float(spec.max))

    def _split(self, ts: FloatArray) -> tuple[npt.NDArray[np.intp], FloatArray]:
        """Cell index holding each t and the fraction of that cell at or below t."""
        lt = np.log(np.clip(ts, self.lo, self.hi))
        k = np.clip(np.searchsorted(self.log_edges, lt, side="right") - 1, 0, len(self.mass) - 1)
        width = self.log_edges[k + 1] - self.log_edges[k]
        safe = np.where(width > 0, width, 1.0)
        frac = np.where(width > 0, np.clip((lt - self.log_edges[k]) / safe, 0.0, 1.0), 1.0)
        # Outside the support everything is above (t < min) or below (t >= max).
        frac = np.where(ts < self.lo, 0.0, np.where(ts >= self.hi, 1.0, frac))
        return k, frac

    def quantile(self, q: float) -> float:
        """Length quantile, interpolated in log-length inside a cell."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be in [0, 1]")
        k = int(np.clip(np.searchsorted(self._cum_mass, q, side="right") - 1, 0, len(self.mass) - 1))
        m = float(self.mass[k])
        frac = min(max((q - float(self._cum_mass[k])) / m, 0.0), 1.0) if m > 0 else 0.0
        return math.exp(float(self.log_edges[k]) + frac * float(self.log_edges[k + 1] - self.log_edges[k]))


@lru_cache(maxsize=16)
def _cached_dist(mu: float, sigma: float, lo: float, hi: float) -> LengthDistribution:
    return LengthDistribution(mu, sigma, lo, hi)


@dataclass(frozen=True)
class Workload:
    """What the model reads of a workload: the incremental input-length distribution, the mean
    output length (decode holds a slot for that many steps) and the offered rate.

    `from_scenario` is the scenario's synthetic workload; `testbed.model.workload` builds one
    from a trace (empirical lengths after prefix-cache hits, the trace's own rate).
    """

    dist: DiscreteDistribution
    output_tokens: float
    rate: float
    source: str = "synthetic"
    # For TTFT queueing estimates only: E[L_out^2] (None: every output is the mean) and the mean
    # decode context, prompt plus half the output (None: the distribution's mean plus that).
    output_sq_tokens: float | None = None
    context_tokens: float | None = None
    # Squared coefficient of variation of the inter-arrival gaps (1: Poisson, as the synthetic
    # workload's; a trace's own is measured, `testbed.model.arrivals`), and the trace's spans with
    # their own rates and gap SCV (None: one stationary stream).
    arrival_scv: float = 1.0
    windows: Windows | None = None
    gap_law: GapLaw | None = None  # the gaps' whole law (None: Poisson; SCV alone is read)
    arrival_times: FloatArray | None = field(default=None, compare=False)  # from the first arrival

    @classmethod
    def from_scenario(cls, scenario: Scenario) -> Workload:
        w = scenario.workload
        return cls(LengthDistribution.from_spec(w.input), float(w.output_tokens), w.rate)


def weighted_mean(values: FloatArray, weights: FloatArray) -> float:
    return float(np.dot(values, weights) / weights.sum())


def weighted_quantile(values: FloatArray, weights: FloatArray, q: float) -> float:
    """Smallest value whose cumulative weight reaches q (the distribution's q-quantile)."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, q * cum[-1], side="left"))
    return float(values[order][min(i, len(order) - 1)])


# ---------------------------------------------------------------------------------------------
# StagePools


def prefill_seconds(pt: PrefillTime, tokens: FloatArray) -> FloatArray:
    """Vectorised PrefillTime.uncached_time (same clamping and extrapolation rules, the fixed
    overhead included)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if pt.coefficients:
        acc = np.zeros_like(tokens)
        for c in reversed(pt.coefficients):
            acc = acc * tokens + c
        out: FloatArray = np.maximum(acc, 0.0) + pt.overhead_s
        return out
    xs, ys = np.asarray(pt.xs), np.asarray(pt.ys)
    i = np.clip(np.searchsorted(xs, tokens, side="right"), 1, len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    res: FloatArray = np.maximum(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 1e-6) + pt.overhead_s
    return res


@dataclass(frozen=True)
class Pool:
    """Prefill instances of one cluster: count and per-instance prefill time."""

    cluster: str
    instances: int
    prefill: PrefillTime
    batch: BatchPolicy | None = None  # a batching scheduler's passes (None: FCFS, the paper's)

    def capacity(self, lengths: FloatArray) -> FloatArray:
        busy = prefill_seconds(self.prefill, lengths) + batching_adjustment(self.prefill, lengths, self.batch)
        out: FloatArray = self.instances / busy
        return out


def stage_capacity(pools: Sequence[Pool], lengths: FloatArray) -> FloatArray:
    """Requests/s a set of prefill pools sustains when every request has the given length."""
    total = np.zeros_like(np.asarray(lengths, dtype=np.float64))
    for p in pools:
        total = total + p.capacity(lengths)
    return total


@dataclass(frozen=True)
class StagePools:
    """The clusters of a scenario reduced to what the model needs.

    Several PrfaaS clusters form one stage whose capacity is the sum of theirs (they share
    the one egress figure `link_bps`); likewise several PD clusters.
    """

    prfaas: tuple[Pool, ...]
    pd_prefill: tuple[Pool, ...]
    n_decode: int
    decode_rate: float  # Theta_pdd, requests/s

    @property
    def n_prfaas(self) -> int:
        return sum(p.instances for p in self.prfaas)

    @property
    def n_p(self) -> int:
        return sum(p.instances for p in self.pd_prefill)

    @classmethod
    def from_scenario(
        cls, scenario: Scenario, split: tuple[int, int] | None = None, output_tokens: float | None = None
    ) -> StagePools:
        """`split` = (N_p, N_d) overrides the PD cluster's roles (needs exactly one PD cluster);
        `output_tokens` the mean output length L_out (default: the scenario workload's)."""
        pds = [c for c in scenario.clusters if c.kind == "pd"]
        if split is not None:
            if len(pds) != 1:
                raise ModelError(f"a PD split override needs exactly one PD cluster, scenario has {len(pds)}")
            if split[0] < 0 or split[1] < 1:
                raise ModelError(f"split {split} needs N_p >= 0 and N_d >= 1")
        prfaas = tuple(
            Pool(
                c.name,
                c.prefill,
                PrefillTime.from_spec(scenario.hardware[c.hardware].prefill),
                BatchPolicy.from_spec(scenario.hardware[c.hardware].scheduler),
            )
            for c in scenario.clusters
            if c.kind == "prfaas" and c.prefill > 0
        )
        pd_prefill: list[Pool] = []
        n_decode = 0
        decode_rate = 0.0
        out_tokens = float(scenario.workload.output_tokens if output_tokens is None else output_tokens)
        if out_tokens <= 0:
            raise ModelError(f"mean output length must be > 0 tokens, got {out_tokens}")
        for c in pds:
            n_p, n_d = split if split is not None else (c.prefill, c.decode)
            hw = scenario.hardware[c.hardware]
            if n_p > 0:
                pd_prefill.append(
                    Pool(c.name, n_p, PrefillTime.from_spec(hw.prefill), BatchPolicy.from_spec(hw.scheduler))
                )
            if n_d > 0:
                if hw.decode is None:
                    raise ModelError(f"cluster {c.name!r}: hardware {c.hardware!r} has no decode profile")
                n_decode += n_d
                # Theta_pdd = N_d * BS_max / (T_decode * L_out); per-seq/per-context terms ignored.
                decode_rate += n_d * hw.decode.bs_max / (hw.decode.base_s * out_tokens)
        return cls(prfaas, tuple(pd_prefill), n_decode, decode_rate)


# ---------------------------------------------------------------------------------------------
# Per-threshold capacities (vectorised over t, shared with the optimiser)


@dataclass(frozen=True)
class ThresholdCurves:
    """Model figures of the `prfaas` policy for each threshold in `ts`."""

    ts: FloatArray
    p: FloatArray
    l_long: FloatArray
    l_short: FloatArray
    theta_prfaas_compute: FloatArray
    theta_prfaas_link: FloatArray
    theta_pdp: FloatArray
    theta_pdd: float

    @property
    def theta_prfaas(self) -> FloatArray:
        out: FloatArray = np.minimum(self.theta_prfaas_compute, self.theta_prfaas_link)
        return out

    @property
    def prfaas_limit(self) -> FloatArray:
        """Theta_prfaas / p: arrival rate at which PrfaaS saturates (inf when nothing is offloaded)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            out: FloatArray = np.where(self.p > 0, self.theta_prfaas / np.where(self.p > 0, self.p, 1.0), np.inf)
        return out

    @property
    def pdp_limit(self) -> FloatArray:
        q = 1.0 - self.p
        with np.errstate(divide="ignore", invalid="ignore"):
            out: FloatArray = np.where(q > 0, self.theta_pdp / np.where(q > 0, q, 1.0), np.inf)
        return out

    @property
    def lambda_max(self) -> FloatArray:
        out: FloatArray = np.minimum(np.minimum(self.prfaas_limit, self.pdp_limit), self.theta_pdd)
        return out

    @property
    def imbalance(self) -> FloatArray:
        """|Theta_prfaas/p - Theta_pdp/(1-p)| relative: zero at the paper's balance condition."""
        a, b = self.prfaas_limit, self.pdp_limit
        with np.errstate(invalid="ignore"):
            out: FloatArray = np.where(np.isfinite(a) & np.isfinite(b), np.abs(a - b) / np.maximum(a, b), np.inf)
        return out


def threshold_curves(
    dep: StagePools, dist: DiscreteDistribution, kv: KVModel, ts: FloatArray, link_bps: float = DEFAULT_LINK_BPS
) -> ThresholdCurves:
    ts = np.asarray(ts, dtype=np.float64)
    lengths = dist.values
    below_mass = dist.cdf(ts)
    below_len = dist.partial_below(lengths, ts)
    total_len = float(np.dot(dist.mass, lengths))
    p = 1.0 - below_mass
    with np.errstate(divide="ignore", invalid="ignore"):
        l_long = np.where(p > 0, (total_len - below_len) / np.where(p > 0, p, 1.0), np.nan)
        l_short = np.where(below_mass > 0, below_len / np.where(below_mass > 0, below_mass, 1.0), np.nan)
    # Where a side has no requests, evaluate at the bound (the capacity is then unused anyway).
    l_long_eval = np.where(np.isnan(l_long), dist.hi, l_long)
    l_short_eval = np.where(np.isnan(l_short), dist.lo, l_short)
    s_long = kv_bytes(kv, l_long_eval)
    return ThresholdCurves(
        ts=ts,
        p=p,
        l_long=l_long,
        l_short=l_short,
        theta_prfaas_compute=stage_capacity(dep.prfaas, l_long_eval),
        theta_prfaas_link=link_bps / (8.0 * s_long),
        theta_pdp=stage_capacity(dep.pd_prefill, l_short_eval),
        theta_pdd=dep.decode_rate,
    )


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class ModelResult:
    """All model figures of one scenario (None where a stage or figure does not apply)."""

    scenario: str
    policy: str
    threshold: int | None
    n_prfaas: int
    n_p: int
    n_d: int
    p: float  # share of requests prefilled in PrfaaS
    l_long: float | None  # mean length of PrfaaS-prefilled requests
    l_short: float | None  # mean length of PD-P-prefilled requests
    theta_prfaas: float | None
    theta_prfaas_compute: float | None
    theta_prfaas_link: float | None
    theta_pdp: float | None
    theta_pdd: float
    lambda_max: float
    bottleneck: Stage
    prfaas_bound: Literal["compute", "link"] | None
    ttft_mean_s: float
    ttft_p90_s: float
    kv_tail_mean_s: float  # mean extra TTFT from the last layer's KV crossing the link
    kv_long_bytes: float  # E[S_kv(L) | routed to PrfaaS]
    egress_bps: float  # PrfaaS egress at lambda_max
    link_bps: float

    @property
    def egress_fraction(self) -> float:
        return self.egress_bps / self.link_bps if self.link_bps > 0 else math.inf

    def egress_at(self, rate: float) -> float:
        """PrfaaS egress in bits/s at an offered rate; PrfaaS can't produce KV faster than Theta_prfaas."""
        if self.theta_prfaas is None or self.p == 0.0:
            return 0.0
        return min(rate * self.p, self.theta_prfaas) * self.kv_long_bytes * 8.0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["egress_fraction"] = self.egress_fraction
        return d


def _pool_ttft(pools: Sequence[Pool], lengths: FloatArray, mean_len: float) -> list[tuple[FloatArray, float]]:
    """Per-pool prefill times with the share of requests each pool takes.

    Shares follow capacity at the stage's mean length (work goes where there is room);
    with one pool the share is 1.
    """
    caps = [float(p.capacity(np.array([mean_len]))[0]) for p in pools]
    total = sum(caps)
    return [(prefill_seconds(p.prefill, lengths), c / total) for p, c in zip(pools, caps)]


def kv_bytes(kv: KVModel, lengths: FloatArray) -> FloatArray:
    """S_kv(l) over an array of lengths (KVModel.total without the rounding)."""
    out: FloatArray = state_bytes(kv, lengths) + kv.full_bytes_per_token * lengths
    return out


def state_bytes(kv: KVModel, lengths: FloatArray) -> FloatArray:
    """Request-level (linear and sliding-window) state after each length."""
    out: FloatArray = kv.linear_state_bytes + kv.window_bytes_per_token * np.minimum(lengths, kv.window_tokens)
    return out


def last_layer_bytes(kv: KVModel, lengths: FloatArray) -> FloatArray:
    """Bytes of the last layer's KV: with layer-wise pipelining only this waits after compute ends."""
    kind = kv.kinds[-1]
    n_kind = kv.kinds.count(kind)
    if kind == "linear":
        out: FloatArray = state_bytes(kv, lengths) / n_kind
    else:
        out = kv.full_bytes_per_token * lengths / n_kind
    return out


def evaluate(
    scenario: Scenario,
    link_bps: float = DEFAULT_LINK_BPS,
    threshold: int | None = None,
    split: tuple[int, int] | None = None,
    workload: Workload | None = None,
) -> ModelResult:
    """Run the analytical model on a scenario.

    `threshold` overrides the scenario's (required when it is "auto": resolve it with
    `testbed.model.optimise.resolve_threshold`); `split` = (N_p, N_d) re-roles the PD cluster.
    `link_bps` is the PrfaaS egress link B_out (the scenario's link profiles are not used).
    `workload` replaces the scenario's synthetic one (e.g. a trace's, `testbed.model.workload`).
    """
    pol = scenario.policy.name
    wl = workload if workload is not None else Workload.from_scenario(scenario)
    dist = wl.dist
    kv = KVModel.from_spec(scenario.model)
    dep = StagePools.from_scenario(scenario, split, wl.output_tokens)
    lengths = dist.values
    mass = dist.mass
    ttft_vals: list[FloatArray] = []
    ttft_wts: list[FloatArray] = []

    t_used: int | None = None
    match pol:
        case "prfaas":
            t_raw = threshold if threshold is not None else scenario.policy.threshold
            if not isinstance(t_raw, int):
                raise ModelError(
                    f"scenario {scenario.name!r} has threshold {t_raw!r}: "
                    "pass threshold= (see optimise.resolve_threshold)"
                )
            t_used = t_raw
            if not dep.prfaas or not dep.pd_prefill:
                raise ModelError("policy 'prfaas' needs prefill instances in both a PrfaaS and a PD cluster")
            cur = threshold_curves(dep, dist, kv, np.array([float(t_raw)]), link_bps)
            p = float(cur.p[0])
            l_long = None if p <= 0 else float(cur.l_long[0])
            l_short = None if p >= 1 else float(cur.l_short[0])
            th_c: float | None = float(cur.theta_prfaas_compute[0])
            th_l: float | None = float(cur.theta_prfaas_link[0])
            th_pdp: float | None = float(cur.theta_pdp[0])
            limits: dict[Stage, float] = {
                "prfaas": float(cur.prfaas_limit[0]),
                "pdp": float(cur.pdp_limit[0]),
                "pdd": dep.decode_rate,
            }
            long_mask = lengths > t_raw
            for vals, share in _pool_ttft(dep.prfaas, lengths, l_long or dist.hi):
                ttft_vals.append(vals)
                ttft_wts.append(np.where(long_mask, mass * share, 0.0))
            for vals, share in _pool_ttft(dep.pd_prefill, lengths, l_short or dist.lo):
                ttft_vals.append(vals)
                ttft_wts.append(np.where(long_mask, 0.0, mass * share))
        case "homogeneous":
            if not dep.pd_prefill:
                raise ModelError("policy 'homogeneous' needs PD prefill instances")
            # The prfaas formula at t = infinity: everything on PD-P at l_short = E[L].
            p, l_long, l_short = 0.0, None, dist.mean()
            th_c = th_l = None
            th_pdp = float(stage_capacity(dep.pd_prefill, np.array([l_short]))[0])
            limits = {"pdp": th_pdp, "pdd": dep.decode_rate}
            long_mask = np.zeros(lengths.shape, dtype=bool)
            for vals, share in _pool_ttft(dep.pd_prefill, lengths, l_short):
                ttft_vals.append(vals)
                ttft_wts.append(mass * share)
        case "naive":  # every request prefilled in PrfaaS, no length routing
            if not dep.prfaas:
                raise ModelError("policy 'naive' needs PrfaaS prefill instances")
            p, l_long, l_short = 1.0, dist.mean(), None
            th_c = float(stage_capacity(dep.prfaas, np.array([l_long]))[0])
            th_l = link_bps / (8.0 * float(kv_bytes(kv, np.array([l_long]))[0]))
            th_pdp = None
            limits = {"prfaas": min(th_c, th_l), "pdd": dep.decode_rate}
            long_mask = np.ones(lengths.shape, dtype=bool)
            for vals, share in _pool_ttft(dep.prfaas, lengths, l_long):
                ttft_vals.append(vals)
                ttft_wts.append(mass * share)
        case _:
            unknown_kind("policy", pol)

    th_prfaas = None if th_c is None or th_l is None else min(th_c, th_l)
    bound: Literal["compute", "link"] | None = None
    if th_c is not None and th_l is not None:
        bound = "compute" if th_c <= th_l else "link"
    # Ties go to the earlier stage in request order (prfaas, pdp, pdd).
    bottleneck: Stage = min(limits, key=lambda s: limits[s])
    lam = limits[bottleneck]

    all_vals = np.concatenate(ttft_vals)
    all_wts = np.concatenate(ttft_wts)
    offloaded = mass * long_mask
    kv_long = float(np.dot(offloaded, kv_bytes(kv, lengths)) / offloaded.sum()) if offloaded.sum() > 0 else 0.0
    tail = float(np.dot(offloaded, last_layer_bytes(kv, lengths))) * 8.0 / link_bps

    return ModelResult(
        scenario=scenario.name,
        policy=pol,
        threshold=t_used,
        n_prfaas=dep.n_prfaas,
        n_p=dep.n_p,
        n_d=dep.n_decode,
        p=p,
        l_long=l_long,
        l_short=l_short,
        theta_prfaas=th_prfaas,
        theta_prfaas_compute=th_c,
        theta_prfaas_link=th_l,
        theta_pdp=th_pdp,
        theta_pdd=dep.decode_rate,
        lambda_max=lam,
        bottleneck=bottleneck,
        prfaas_bound=bound,
        ttft_mean_s=weighted_mean(all_vals, all_wts),
        ttft_p90_s=weighted_quantile(all_vals, all_wts, 0.9),
        kv_tail_mean_s=tail,
        kv_long_bytes=kv_long,
        egress_bps=lam * p * kv_long * 8.0,
        link_bps=link_bps,
    )
