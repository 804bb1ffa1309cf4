"""A trace's arrival process as the queueing estimate reads it: its mean rate, how variable its
gaps are, and how busy its busiest stretches run.

- The squared coefficient of variation of the inter-arrival gaps (SCV, ca^2) is what a G/G/c
  approximation (`queueing.ggc_wait`) needs of a renewal process: 1 for Poisson, above 1 when
  requests come in bursts.
- The index of dispersion of counts, I(w) = Var(N_w) / E[N_w] over consecutive windows of w
  seconds, is the same for a renewal process once w spans many gaps (it tends to ca^2), and grows
  with w when bursts last longer than a gap (a busy minute, a quiet hour): then the gaps alone
  understate the variability a queue sees.
- The busiest window of w seconds (sliding) over the mean rate says how far a burst pushes the
  load above its mean: a stage at utilisation u overloads in it when u times that ratio exceeds 1.
- `GapLaw` is the whole gap distribution by its Laplace transform A*(s) = E[exp(-s G)], which
  the GI/M/c skeleton of the queueing estimate needs (`queueing.gim_wait`): the root sigma of
  sigma = A*(c mu (1 - sigma)) is the chance a burst finds the servers busy, where two moments
  of the gaps say too little about how bursts bunch.
- `windows` cuts the trace into spans of LOAD_WINDOW_S with their counts and their own gap SCV:
  the queueing estimate takes load that changes from span to span (a busy quarter hour) from
  them, and bursts shorter than a span from the gaps within it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

# The windows `summary` reports (seconds).
BUSY_WINDOWS_S = (10.0, 60.0)
# Windows of I(w) need this many to estimate a variance worth reading.
MIN_WINDOWS = 20
# Spans of `windows`: long enough that a renewal stream's count in one varies little (CV 3 at
# 3.3 req/s: ~10%), so the spans' rates carry only load that really changes.
LOAD_WINDOW_S = 300.0


# GapLaw's grid: s times the mean gap, log-spaced; outside it 1 - A*(s) follows its limits.
_U = np.logspace(-4.0, 4.0, 241)
_SIGMA_STEPS = 60  # bisection steps for sigma (2^-60: far below any figure's precision)
MIN_GAPS = 8  # fewer gaps than this say nothing of a law: use the stream's whole one


@dataclass(frozen=True, eq=False)
class GapLaw:
    """Inter-arrival gaps by B(u) = 1 - A*(u / mean): 1 minus their Laplace transform at s = u /
    mean gap, tabulated on a log grid of u (log B against log u is smooth: slope 1 near 0, flat
    where A* vanishes), with the gaps' mean and SCV."""

    mean: float
    scv: float
    log_b: FloatArray  # log B at _U

    @classmethod
    def from_gaps(cls, gaps: npt.ArrayLike) -> GapLaw | None:
        """None with fewer than MIN_GAPS gaps or no time between them."""
        g = np.asarray(gaps, dtype=np.float64).ravel()
        if g.size < MIN_GAPS or not g.mean() > 0:
            return None
        m = float(g.mean())
        x = g / m
        b = np.empty(_U.size)
        for i in range(0, _U.size, 32):  # -expm1 keeps 1 - A* exact where it is tiny
            b[i : i + 32] = -np.expm1(-_U[i : i + 32, None] * x[None, :]).mean(axis=1)
        return cls(m, float(g.var() / (m * m)), np.log(np.maximum(b, 1e-300)))

    def one_minus(self, s: npt.ArrayLike, share: npt.ArrayLike = 1.0, mean: float | None = None) -> FloatArray:
        """1 - A_q*(s) for the stream thinned at random to `share` q (A_q* = q A* / (1 - (1-q) A*)),
        with the gaps stretched to mean `mean` (default: the law's own)."""
        u = np.asarray(s, dtype=np.float64) * (self.mean if mean is None else mean)
        lu = np.log(np.maximum(u, 1e-300))
        b = np.exp(np.interp(lu, np.log(_U), self.log_b))
        small = u < _U[0]
        b = np.where(small, u * (1.0 - 0.5 * u * (1.0 + self.scv)), b)
        q = np.asarray(share, dtype=np.float64)
        out: FloatArray = b / (q + (1.0 - q) * b)
        return out

    def sigma(self, cmu: npt.ArrayLike, share: npt.ArrayLike = 1.0, mean: float | None = None) -> FloatArray:
        """The root in (0, 1) of sigma = A_q*(cmu (1 - sigma)) (arrays broadcast); 1 where the
        stage gets at least its capacity (cmu times the thinned mean gap <= 1)."""
        c, q = np.broadcast_arrays(np.asarray(cmu, dtype=np.float64), np.asarray(share, dtype=np.float64))
        m = self.mean if mean is None else mean
        with np.errstate(divide="ignore", invalid="ignore"):
            stable = (q > 0) & (c * m / np.where(q > 0, q, 1.0) > 1.0)
        lo, hi = np.zeros(c.shape), np.ones(c.shape)  # y = 1 - sigma: B_q(cmu y) = y
        for _ in range(_SIGMA_STEPS):
            y = 0.5 * (lo + hi)
            above = self.one_minus(c * y, q, m) > y
            lo, hi = np.where(above, y, lo), np.where(above, hi, y)
        out: FloatArray = np.where(stable, 1.0 - 0.5 * (lo + hi), np.where(q > 0, 1.0, 0.0))
        return out


@dataclass(frozen=True, eq=False)
class Windows:
    """Consecutive spans of a trace: their edges and lengths (s), arrivals and gap SCV (the
    trace's own where a span has fewer than three gaps)."""

    edges: FloatArray
    span_s: FloatArray
    counts: npt.NDArray[np.int64]
    scv: FloatArray

    def split(self, times: npt.ArrayLike) -> list[FloatArray]:
        """`times` (ascending, on the trace's clock from its first arrival) span by span."""
        t = np.asarray(times, dtype=np.float64)
        cut = np.searchsorted(t, self.edges[1:-1], side="left")
        return list(np.split(t, cut))

    @property
    def rates(self) -> FloatArray:
        out: FloatArray = self.counts / self.span_s
        return out

    @property
    def share(self) -> FloatArray:
        """Each span's share of the requests."""
        out: FloatArray = self.counts / max(int(self.counts.sum()), 1)
        return out


@dataclass(frozen=True, eq=False)
class Arrivals:
    """Arrival times (seconds, ascending, any origin)."""

    times: FloatArray

    def __post_init__(self) -> None:
        t = np.asarray(self.times, dtype=np.float64).ravel()
        if t.size and (not np.all(np.isfinite(t)) or np.any(np.diff(t) < 0)):
            raise ValueError("arrival times must be finite and ascending")
        object.__setattr__(self, "times", t - t[0] if t.size else t)

    @property
    def requests(self) -> int:
        return int(self.times.size)

    @property
    def duration_s(self) -> float:
        return float(self.times[-1]) if self.times.size else 0.0

    @property
    def rate(self) -> float:
        """1 / mean gap (`Trace.rate`); 0 with fewer than two arrivals or no time between them."""
        d = self.duration_s
        return (self.requests - 1) / d if self.requests > 1 and d > 0 else 0.0

    @property
    def gap_scv(self) -> float:
        """Squared coefficient of variation of the gaps; 1 (Poisson) with fewer than two gaps."""
        g = np.diff(self.times)
        if g.size < 2 or not g.mean() > 0:
            return 1.0
        return float(g.var() / g.mean() ** 2)

    @property
    def gap_cv(self) -> float:
        return math.sqrt(self.gap_scv)

    def busiest(self, window_s: float) -> float:
        """The most arrivals in any `window_s` (sliding, from an arrival on) over the mean rate's
        count in as long; 1 when the trace is shorter than the window or has no rate."""
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        if self.rate <= 0 or self.duration_s < window_s:
            return 1.0
        t = self.times
        ends = np.searchsorted(t, t + window_s, side="left")
        most = int((ends - np.arange(t.size)).max())
        return most / (self.rate * window_s)

    def dispersion(self, window_s: float) -> float | None:
        """I(w): variance over mean of the counts in consecutive windows of `window_s` over the
        trace; None when fewer than MIN_WINDOWS fit."""
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        k = int(self.duration_s // window_s)
        if k < MIN_WINDOWS:
            return None
        idx = (self.times // window_s).astype(np.int64)
        counts = np.bincount(idx[idx < k], minlength=k)  # whole windows only
        m = float(counts.mean())
        return float(counts.var(ddof=1) / m) if m > 0 else None

    def windows(self, span_s: float = LOAD_WINDOW_S) -> Windows:
        """The trace cut into spans of `span_s` from its first arrival; a last span shorter than
        half of one joins the one before (a trace shorter than 1.5 spans is one span)."""
        if not span_s > 0:
            raise ValueError("span_s must be > 0")
        d = self.duration_s
        k = max(1, int(d // span_s))
        if d - k * span_s >= 0.5 * span_s:
            k += 1
        edges = np.minimum(np.arange(k + 1, dtype=np.float64) * span_s, d)
        edges[-1] = d
        idx = np.clip(np.searchsorted(edges, self.times, side="right") - 1, 0, k - 1)
        counts = np.bincount(idx, minlength=k).astype(np.int64)
        lengths = np.diff(edges)
        lengths = np.where(lengths > 0, lengths, span_s)
        whole = self.gap_scv
        scv = np.full(k, whole)
        for i in range(k):
            g = np.diff(self.times[idx == i])
            if g.size >= 3 and g.mean() > 0:
                scv[i] = float(g.var() / g.mean() ** 2)
        return Windows(edges, lengths, counts, scv)

    def gap_law(self) -> GapLaw | None:
        return GapLaw.from_gaps(np.diff(self.times))

    def summary(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"rate_rps": self.rate, "gap_cv": self.gap_cv, "gap_scv": self.gap_scv}
        for w in BUSY_WINDOWS_S:
            out[f"busiest_{w:g}s_over_mean"] = self.busiest(w)
            out[f"dispersion_{w:g}s"] = self.dispersion(w)
        win = self.windows()
        out["load_window_s"] = LOAD_WINDOW_S
        out["load_windows"] = int(win.counts.size)
        out["busiest_load_window_over_mean"] = float(win.rates.max() / self.rate) if self.rate > 0 else 1.0
        return out
