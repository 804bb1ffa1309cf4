"""Queueing estimates for TTFT at an offered rate: each stage as an M/G/c queue.

The analytical model is queue-free; a plan needs TTFT at the trace's own rate. A stage of c
instances serving requests one at a time (a prefill pool; or decode slots, c = N_d * BS_max)
is approximated by Allen-Cunneen: E[W] ~ C(c, a) / (c / E[S] - lambda) * (1 + cs^2) / 2, with
C the Erlang-C probability of waiting, a = lambda E[S] the offered load and cs^2 the squared
coefficient of variation of the service time. The wait is taken as 0 with probability 1 - C
and exponential otherwise (mean E[W] / C), which gives quantiles of S + W. The service time
is the true mean E[T(L)] over the routed lengths, so a stage saturates at c / E[T(L)], a
little below the paper's plain-form Theta = c / T(E[L]) when T is convex. All vectorised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

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
    b = np.ones(a.shape, dtype=np.float64)       # Erlang B at k servers, by the stable recursion
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
    utilisation: FloatArray   # lambda E[S] / c

    @property
    def tail_mean(self) -> FloatArray:
        """E[W | W > 0]: the mean of the exponential part."""
        with np.errstate(divide="ignore", invalid="ignore"):
            out: FloatArray = np.where(self.p_wait > 0, self.mean / np.where(self.p_wait > 0, self.p_wait, 1.0), 0.0)
        return out


def mgc_wait(rate: npt.ArrayLike, es: npt.ArrayLike, es2: npt.ArrayLike, servers: npt.ArrayLike) -> Wait:
    """Allen-Cunneen waiting time at arrival `rate` with service moments E[S], E[S^2] on
    `servers` instances (all broadcast). A zero rate waits 0; servers < 1 with traffic is saturated."""
    lam, s1, s2, c = np.broadcast_arrays(
        np.asarray(rate, dtype=np.float64), np.asarray(es, dtype=np.float64),
        np.asarray(es2, dtype=np.float64), np.asarray(servers, dtype=np.int64),
    )
    has = (lam > 0) & (s1 > 0)
    c_safe = np.maximum(c, 1)
    load = np.where(has, lam * s1, 0.0)
    util = np.where(c >= 1, load / c_safe, np.where(has, np.inf, 0.0))
    pw = np.where(has & (c >= 1), erlang_c(c_safe, load), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cs2 = np.where(s1 > 0, np.maximum(s2 / np.where(s1 > 0, s1 * s1, 1.0) - 1.0, 0.0), 0.0)
        slack = np.where(s1 > 0, c_safe / np.where(s1 > 0, s1, 1.0), np.inf) - lam
        w = np.where(slack > 0, pw / np.where(slack > 0, slack, 1.0) * (1.0 + cs2) / 2.0, np.inf)
    saturated = has & ((c < 1) | (util >= 1.0))
    mean = np.where(saturated, np.inf, np.where(has, w, 0.0))
    return Wait(np.where(saturated, 1.0, pw), mean, util)


@dataclass(frozen=True)
class Branch:
    """One route of a request: its share of requests as atom masses (summing to the share),
    the TTFT of each atom without waiting (service + fixed extras), and the stage's wait."""

    mass: FloatArray
    offset: FloatArray
    p_wait: float
    wait_tail_mean: float   # E[W | W > 0]


def mixture_quantile(branches: Sequence[Branch], q: float, rtol: float = 1e-5) -> float:
    """q-quantile of TTFT = offset + W over the branches (W independent of the atom); inf when
    a branch with mass is saturated."""
    if not 0.0 < q < 1.0:
        raise ValueError("q must be in (0, 1)")
    live = [b for b in branches if b.mass.size and float(b.mass.sum()) > 0]
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
