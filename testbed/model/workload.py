"""The model's workload read from a trace: empirical incremental lengths, outputs and rate.

The threshold and the prefill times are judged on the *incremental* (uncached) prompt length
(PAPER.md, "Request flow"), so a trace is reduced to, per request, the prefix a cache would
hold given the requests before it. Assumption, stated once here: one unbounded prefix cache
that every earlier request of the trace has filled (the clusters' pools never evict and a
prefix found in either cluster is usable, as with cache-aware routing when bandwidth is
abundant). A request reuses what `testbed.core.prefix_cache.HybridPrefixCache.match` would
find in such a pool:

- the longest run of its *leading* blocks whose (position, hash) an earlier request inserted
  (the trace formats say "equal hash at equal position is an equal prefix block"); only full
  blocks are inserted, and at least one prompt token is always computed;
- for a model with linear-attention or sliding-window layers, only up to the longest such run
  at which an earlier request left a state snapshot (its last full-block boundary): the state
  is valid only at the exact length it was taken at.

Hence the cached share here can be below `testbed trace info`'s "blocks seen earlier", which
counts every repeated hash wherever it sits. Requests enter the cache in arrival order, at
once (the replay inserts a prompt when its prefill ends, so near-simultaneous repeats hit a
little less there).

The window, when given, starts with an empty cache, like a replay of that window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import numpy.typing as npt

from testbed.core.kvsize import KVModel
from testbed.model.analytical import DiscreteDistribution, FloatArray, Workload
from testbed.traces.csvutil import Window
from testbed.traces.loader import load_trace
from testbed.traces.types import Trace, TraceRequest

IntArray = npt.NDArray[np.int64]


class EmpiricalDistribution(DiscreteDistribution):
    """A sample's lengths as atoms: each distinct length with its share of the sample.

    At a threshold t an atom at exactly t counts as below (L <= t is prefilled locally), so
    p(t), l_long(t), l_short(t) are step functions that change only at the sample's lengths.
    """

    def __init__(self, lengths: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> None:
        x = np.asarray(lengths, dtype=np.float64).ravel()
        if x.size == 0:
            raise ValueError("an empirical distribution needs at least one length")
        if not np.all(np.isfinite(x)) or np.any(x < 0):
            raise ValueError("lengths must be finite and >= 0")
        w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
        if w.shape != x.shape or np.any(w < 0) or not w.sum() > 0:
            raise ValueError("weights must be >= 0, one per length, with a positive sum")
        values, inverse = np.unique(x, return_inverse=True)
        mass = np.bincount(inverse, weights=w, minlength=values.size)
        self.values = values
        self.mass = mass / mass.sum()
        self.lo, self.hi = float(values[0]), float(values[-1])
        self._init_cum()

    def _split(self, ts: FloatArray) -> tuple[npt.NDArray[np.intp], FloatArray]:
        k = np.searchsorted(self.values, ts, side="right") - 1
        frac = np.where(k >= 0, 1.0, 0.0)
        return np.maximum(k, 0), frac

    @property
    def atoms(self) -> int:
        return int(self.values.size)


def usable_cached_tokens(requests: Iterable[TraceRequest], block_tokens: int, linear_state: bool) -> IntArray:
    """Per request, the cached prefix (tokens) an unbounded pool filled by the earlier requests
    would give it (the rules of `HybridPrefixCache.match` and `insert`; module docstring)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    blocks: set[tuple[int, int]] = set()
    states: set[tuple[int, int]] = set()
    out: list[int] = []
    for r in requests:
        ids = r.hash_ids
        limit = min(max(r.input_tokens - 1, 0) // block_tokens, len(ids))
        full = 0
        while full < limit and (full, ids[full]) in blocks:
            full += 1
        usable = full
        if linear_state:
            usable = 0
            for k in range(full, 0, -1):
                if (k, ids[k - 1]) in states:
                    usable = k
                    break
        out.append(usable * block_tokens)
        n = min(r.input_tokens // block_tokens, len(ids))
        blocks.update((i, ids[i]) for i in range(n))
        if n:
            states.add((n, ids[n - 1]))
    return np.asarray(out, dtype=np.int64)


def _reuse_share(requests: Iterable[TraceRequest]) -> float:
    """Share of blocks whose hash appeared earlier anywhere (what `testbed trace info` reports)."""
    seen: set[int] = set()
    total = reused = 0
    for r in requests:
        for h in r.hash_ids:
            if h in seen:
                reused += 1
            else:
                seen.add(h)
        total += len(r.hash_ids)
    return reused / total if total else 0.0


@dataclass(frozen=True, eq=False)
class TraceWorkload:
    """A trace reduced to what the model reads, per request: input, cached prefix, output."""

    source: str
    block_tokens: int
    linear_state: bool      # the cache rule used: a state snapshot needed at the matched length
    duration_s: float
    rate: float             # requests/s, 1 / mean inter-arrival gap (`Trace.rate`)
    input_tokens: IntArray
    cached_tokens: IntArray
    output_tokens: IntArray
    reuse_share: float      # blocks seen earlier anywhere in the trace
    dist: EmpiricalDistribution = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.input_tokens.size
        if n == 0:
            raise ValueError(f"{self.source}: no requests")
        if self.cached_tokens.size != n or self.output_tokens.size != n:
            raise ValueError("input, cached and output arrays must have one entry per request")
        object.__setattr__(self, "dist", EmpiricalDistribution(self.uncached_tokens))

    @classmethod
    def from_trace(cls, trace: Trace, kv: KVModel) -> "TraceWorkload":
        """The cache rule follows the model: linear or sliding-window layers need a state snapshot."""
        if len(trace) == 0:
            raise ValueError(f"{trace.source}: no requests")
        linear = "linear" in kv.kinds
        reqs = trace.requests
        rate = trace.rate if len(trace) > 1 else 0.0
        return cls(
            source=trace.source,
            block_tokens=trace.block_tokens,
            linear_state=linear,
            duration_s=trace.duration,
            rate=rate if math.isfinite(rate) else 0.0,
            input_tokens=np.fromiter((r.input_tokens for r in reqs), dtype=np.int64, count=len(reqs)),
            cached_tokens=usable_cached_tokens(reqs, trace.block_tokens, linear),
            output_tokens=np.fromiter((r.output_tokens for r in reqs), dtype=np.int64, count=len(reqs)),
            reuse_share=_reuse_share(reqs),
        )

    @property
    def requests(self) -> int:
        return int(self.input_tokens.size)

    @property
    def uncached_tokens(self) -> IntArray:
        out: IntArray = self.input_tokens - self.cached_tokens
        return out

    @property
    def cached_share(self) -> float:
        """Cached prompt tokens over all prompt tokens."""
        total = int(self.input_tokens.sum())
        return float(self.cached_tokens.sum()) / total if total else 0.0

    @property
    def mean_output(self) -> float:
        """Mean output tokens; at least 1 (every request decodes its first token)."""
        return max(float(self.output_tokens.mean()), 1.0)

    def model_workload(self) -> Workload:
        o = np.maximum(self.output_tokens.astype(np.float64), 1.0)
        return Workload(
            self.dist, self.mean_output, self.rate, self.source,
            output_sq_tokens=float(np.mean(o * o)),
            context_tokens=float(self.input_tokens.mean()) + 0.5 * self.mean_output,
        )

    def summary(self) -> dict[str, Any]:
        def stats(a: IntArray) -> dict[str, float]:
            p50, p90 = np.percentile(a, [50, 90])
            return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "max": float(a.max())}

        return {
            "source": self.source,
            "requests": self.requests,
            "duration_s": self.duration_s,
            "rate_rps": self.rate,
            "input_tokens": stats(self.input_tokens),
            "uncached_tokens": stats(self.uncached_tokens),
            "output_tokens": stats(self.output_tokens),
            "cached_share": self.cached_share,
            "reuse_share": self.reuse_share,
            "cache_rule": "leading blocks with a state snapshot" if self.linear_state else "leading blocks",
        }


def load_trace_workload(
    path: str | Path, kv: KVModel, window: Window | None = None, format: str = "auto"
) -> TraceWorkload:
    """Read a trace file (any format `testbed.traces.load_trace` reads) into a TraceWorkload."""
    return TraceWorkload.from_trace(load_trace(path, format, window=window), kv)
