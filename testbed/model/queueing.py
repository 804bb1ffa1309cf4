"""Queueing estimates for TTFT at an offered rate: each stage as a G/G/c queue.

The analytical model is queue-free; a plan needs TTFT at the trace's own rate. A stage of c
instances serving requests one at a time (a prefill pool; or decode slots, c = N_d * BS_max)
is approximated by Allen-Cunneen: E[W] ~ C(c, a) / (c / E[S] - lambda) * (ca^2 + cs^2) / 2, with
C the Erlang-C probability of waiting, a = lambda E[S] the offered load, ca^2 the squared
coefficient of variation of the inter-arrival gaps (1 for Poisson: then this is the M/G/c form,
and for c = 1 Pollaczek-Khinchine exactly) and cs^2 that of the service time. A stage that
receives a random share q of a stream of gap SCV ca^2 sees q ca^2 + 1 - q (`split_scv`): random
thinning moves any renewal stream toward Poisson.

Two moments describe bunched arrivals badly (a trace with inter-arrival CV 3 waits several times
what Allen-Cunneen gives it), so where the gaps' whole law is known (`arrivals.GapLaw`) a stage
is estimated by its GI/M/c skeleton instead (`gim_wait`), which is the same for Poisson
arrivals. Over a trace cut into spans, `windowed_wait` adds what load changing from span to
span does. The wait is taken as 0 with probability P(W > 0) and exponential otherwise (mean
E[W] / P(W > 0); exact for GI/M/c), which gives quantiles of S + W. The service time
is the true mean E[T(L)] over the routed lengths, so a stage saturates at c / E[T(L)], a
little below the paper's plain-form Theta = c / T(E[L]) when T is convex. All vectorised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def erlang_c(servers: npt.ArrayLike, load: npt.ArrayLike) -> FloatArray:
    """P(wait > 0) in M/M/c with `servers` c >= 1 and offered load a = lambda E[S] (Erlangs);
    1 where a >= c (the queue never empties). Broadcasts c against a."""
    a = np.asarray(load, dtype=np.float64)
    c = np.asarray(servers, dtype=np.int64)
    a, c = np.broadcast_arrays(a, c)
    if c.size and int(c.min()) < 1:
        raise ValueError("erlang_c needs at least one server")
    out = np.ones(a.shape, dtype=np.float64)
    b = np.ones(a.shape, dtype=np.float64)  # Erlang B at k servers, by the stable recursion
    cmax = int(c.max()) if c.size else 0
    for k in range(1, cmax + 1):
        b = a * b / (k + a * b)
        sel = c == k
        if sel.any():
            rho = a[sel] / k
            out[sel] = b[sel] / (1.0 - rho * (1.0 - b[sel]))
    out = np.where(a >= c, 1.0, np.clip(out, 0.0, 1.0))
    return out


@dataclass(frozen=True)
class Wait:
    """Waiting time of an M/G/c stage: P(W > 0) and E[W] (inf where the stage is saturated)."""

    p_wait: FloatArray
    mean: FloatArray
    utilisation: FloatArray  # lambda E[S] / c

    @property
    def tail_mean(self) -> FloatArray:
        """E[W | W > 0]: the mean of the exponential part."""
        with np.errstate(divide="ignore", invalid="ignore"):
            out: FloatArray = np.where(self.p_wait > 0, self.mean / np.where(self.p_wait > 0, self.p_wait, 1.0), 0.0)
        return out


def split_scv(scv: npt.ArrayLike, share: npt.ArrayLike) -> FloatArray:
    """Gap SCV of the part of a renewal stream (gap SCV `scv`) that a random `share` of its
    requests forms: share * scv + 1 - share (a thinned renewal process)."""
    q = np.clip(np.asarray(share, dtype=np.float64), 0.0, 1.0)
    out: FloatArray = q * np.asarray(scv, dtype=np.float64) + 1.0 - q
    return out


def mgc_wait(
    rate: npt.ArrayLike, es: npt.ArrayLike, es2: npt.ArrayLike, servers: npt.ArrayLike, arrival_scv: npt.ArrayLike = 1.0
) -> Wait:
    """Allen-Cunneen waiting time at arrival `rate` with service moments E[S], E[S^2] on
    `servers` instances, arrivals of gap SCV `arrival_scv` (1: Poisson; all broadcast). A zero
    rate waits 0; servers < 1 with traffic is saturated."""
    lam, s1, s2, c, ca2 = np.broadcast_arrays(
        np.asarray(rate, dtype=np.float64),
        np.asarray(es, dtype=np.float64),
        np.asarray(es2, dtype=np.float64),
        np.asarray(servers, dtype=np.int64),
        np.asarray(arrival_scv, dtype=np.float64),
    )
    has = (lam > 0) & (s1 > 0)
    c_safe = np.maximum(c, 1)
    load = np.where(has, lam * s1, 0.0)
    util = np.where(c >= 1, load / c_safe, np.where(has, np.inf, 0.0))
    pw = np.where(has & (c >= 1), erlang_c(c_safe, load), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cs2 = np.where(s1 > 0, np.maximum(s2 / np.where(s1 > 0, s1 * s1, 1.0) - 1.0, 0.0), 0.0)
        slack = np.where(s1 > 0, c_safe / np.where(s1 > 0, s1, 1.0), np.inf) - lam
        w = np.where(slack > 0, pw / np.where(slack > 0, slack, 1.0) * (ca2 + cs2) / 2.0, np.inf)
    saturated = has & ((c < 1) | (util >= 1.0))
    mean = np.where(saturated, np.inf, np.where(has, w, 0.0))
    return Wait(np.where(saturated, 1.0, pw), mean, util)


def gim_wait(
    rate: npt.ArrayLike,
    es: npt.ArrayLike,
    es2: npt.ArrayLike,
    servers: npt.ArrayLike,
    sigma: npt.ArrayLike,
    arrival_scv: npt.ArrayLike,
) -> Wait:
    """The wait of a G/G/c stage by its GI/M/c skeleton, for arrivals whose bursts two moments
    describe badly. `sigma` is the root of sigma = A*(c mu (1 - sigma)), A* the Laplace transform
    of the stage's inter-arrival gaps (`arrivals.GapLaw.sigma`): the chance an arrival finds a
    burst's work ahead of it (rho for Poisson arrivals, more for bunched ones). Then
    - E[W | W > 0] = 1 / (c mu (1 - sigma)): exact for GI/M/c; times (ca^2 + cs^2) / (ca^2 + 1)
      for general service (a two-moment correction; with Poisson arrivals this is Allen-Cunneen's
      (1 + cs^2) / 2);
    - P(W > 0) = Erlang C at load c sigma: exact for one server (sigma) and for Poisson arrivals.
    So Poisson arrivals give `mgc_wait`'s M/G/c exactly. Broadcasts; saturated as `mgc_wait`."""
    lam, s1, s2, c, sig, ca2 = np.broadcast_arrays(
        np.asarray(rate, dtype=np.float64),
        np.asarray(es, dtype=np.float64),
        np.asarray(es2, dtype=np.float64),
        np.asarray(servers, dtype=np.int64),
        np.asarray(sigma, dtype=np.float64),
        np.asarray(arrival_scv, dtype=np.float64),
    )
    has = (lam > 0) & (s1 > 0)
    c_safe = np.maximum(c, 1)
    util = np.where(c >= 1, np.where(has, lam * s1, 0.0) / c_safe, np.where(has, np.inf, 0.0))
    saturated = has & ((c < 1) | (util >= 1.0) | (sig >= 1.0))
    sig_ok = np.clip(np.where(saturated | ~has, 0.0, sig), 0.0, 1.0 - 1e-12)
    pw = np.where(has & ~saturated, erlang_c(c_safe, c_safe * sig_ok), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cs2 = np.where(s1 > 0, np.maximum(s2 / np.where(s1 > 0, s1 * s1, 1.0) - 1.0, 0.0), 0.0)
        cmu = np.where(s1 > 0, c_safe / np.where(s1 > 0, s1, 1.0), np.inf)
        w = pw / (cmu * (1.0 - sig_ok)) * (ca2 + cs2) / (ca2 + 1.0)
    mean = np.where(saturated, np.inf, np.where(has, w, 0.0))
    return Wait(np.where(saturated, 1.0, pw), mean, util)


def windowed_wait(
    rates: npt.ArrayLike,
    spans: npt.ArrayLike,
    es: float,
    es2: float,
    servers: int,
    arrival_scv: npt.ArrayLike,
    sigma: npt.ArrayLike | None = None,
) -> tuple[Wait, FloatArray]:
    """The wait of a stage over consecutive spans of a trace (arrays over spans, in order): per
    span the G/G/c wait at the span's own rate and gap SCV (`gim_wait` with the spans' `sigma`
    when given, else `mgc_wait`), and the backlog earlier spans left.

    - A queue is no more stationary than its span: the G/G/c mean is capped by what a queue
      starting empty at critical load builds within one span, a reflected Brownian motion
      (E[Q(t)] = sqrt(2 sigma^2 t / pi), sigma^2 = lambda (ca^2 + cs^2)), averaged over the span
      (2/3 of its end value) and served at c / E[S]. So a span at or over capacity waits that,
      not forever; below it the cap seldom binds.
    - Work beyond capacity is a fluid: a span's arrivals over c / E[S] leave a backlog the next
      span starts with (it drains at the spare capacity); its mean over a span's arrivals, over
      the service rate, is the span's second term.
    Returns the spans' waits (`Wait`, the mean capped) and their backlog waits."""
    lam = np.asarray(rates, dtype=np.float64)
    span = np.asarray(spans, dtype=np.float64)
    ca2 = np.broadcast_to(np.asarray(arrival_scv, dtype=np.float64), lam.shape)
    if es <= 0 or not lam.size:
        zeros = np.zeros_like(lam)
        return Wait(zeros, zeros, zeros), zeros
    w = mgc_wait(lam, es, es2, servers, ca2) if sigma is None else gim_wait(lam, es, es2, servers, sigma, ca2)
    if servers < 1:
        return w, np.where(lam > 0, np.inf, 0.0)
    mu = servers / es
    cs2 = max(es2 / (es * es) - 1.0, 0.0)
    cap = (2.0 / 3.0) * np.sqrt(2.0 * lam * (ca2 + cs2) * span / math.pi) / mu
    mean = np.minimum(w.mean, cap)
    fluid = np.zeros_like(lam)
    backlog = 0.0
    for i in range(lam.size):
        slope, d = lam[i] - mu, span[i]
        if slope >= 0 or backlog + slope * d >= 0:
            area, end = backlog * d + 0.5 * slope * d * d, backlog + slope * d
        else:  # drained within the span, at backlog / -slope
            t = backlog / -slope
            area, end = 0.5 * backlog * t, 0.0
        fluid[i] = area / d / mu
        backlog = max(end, 0.0)
    return Wait(w.p_wait, mean, w.utilisation), fluid


@dataclass(frozen=True)
class Branch:
    """One route of a request: its share of requests as atom masses (summing to the share),
    the TTFT of each atom without waiting (service + fixed extras), and the stage's wait."""

    mass: FloatArray
    offset: FloatArray
    p_wait: float
    wait_tail_mean: float  # E[W | W > 0]


# `mixture_quantile` merges a branch's atoms within this relative width of each other (at most
# that much error in the quantile, far below the model's own), so many branches of thousands of
# atoms (one per request and span) stay cheap.
ATOM_RTOL = 1e-3


def _compact(b: Branch, rel: float = ATOM_RTOL) -> Branch:
    """The branch with atoms on a log grid of width `rel` merged (mass-weighted mean offset)."""
    if b.offset.size <= 256:
        return b
    key = np.floor(np.log(np.maximum(b.offset, 1e-9)) / rel).astype(np.int64)
    _, inv = np.unique(key, return_inverse=True)
    mass = np.bincount(inv, weights=b.mass).astype(np.float64)
    keep = mass > 0
    offset: FloatArray = np.bincount(inv, weights=b.mass * b.offset)[keep] / mass[keep]
    return Branch(mass[keep], offset, b.p_wait, b.wait_tail_mean)


def mixture_quantile(branches: Sequence[Branch], q: float, rtol: float = 1e-5) -> float:
    """q-quantile of TTFT = offset + W over the branches (W independent of the atom); inf when
    a branch with mass is saturated. Atoms closer than ATOM_RTOL are merged first."""
    if not 0.0 < q < 1.0:
        raise ValueError("q must be in (0, 1)")
    live = [_compact(b) for b in branches if b.mass.size and float(b.mass.sum()) > 0]
    if not live:
        return 0.0
    total = sum(float(b.mass.sum()) for b in live)
    if any(not math.isfinite(b.wait_tail_mean) for b in live):
        return math.inf

    def cdf(x: float) -> float:
        acc = 0.0
        for b in live:
            y = x - b.offset
            ok = y >= 0
            if not ok.any():
                continue
            f = 1.0 - b.p_wait * np.exp(-y[ok] / b.wait_tail_mean) if b.wait_tail_mean > 0 else np.ones(int(ok.sum()))
            acc += float(np.dot(b.mass[ok], f))
        return acc / total

    lo = min(float(b.offset.min()) for b in live)
    hi = max(float(b.offset.max()) for b in live)
    # Beyond every offset, each branch's CDF is at least 1 - p_wait exp(-(x - max)/theta).
    hi += max(0.0, *(b.wait_tail_mean * math.log(max(b.p_wait, 1e-300) / (1.0 - q)) for b in live))
    hi += 1e-9
    for _ in range(200):
        if hi - lo <= rtol * max(hi, 1e-9):
            break
        mid = 0.5 * (lo + hi)
        if cdf(mid) >= q:
            hi = mid
        else:
            lo = mid
    return hi
