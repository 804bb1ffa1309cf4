"""The model's workload read from a trace: empirical incremental lengths, outputs and rate.

The threshold and the prefill times are judged on the *incremental* (uncached) prompt length
(docs/paper.md, "System"), so a trace is reduced to, per request, the prefix a cache would
hold given the requests before it. Assumption, stated once here: one unbounded prefix cache
that every earlier request of the trace has filled (the clusters' pools never evict and a
prefix found in either cluster is usable, as with cache-aware routing when bandwidth is
abundant). A request reuses what `testbed.core.routing.prefix_cache.HybridPrefixCache.match` would
find in such a pool:

- the longest run of its *leading* blocks whose (position, hash) an earlier request inserted
  (the trace formats say "equal hash at equal position is an equal prefix block"); only full
  blocks are inserted, and at least one prompt token is always computed;
- for a model with linear-attention or sliding-window layers, only up to the longest such run
  at which an earlier request left a state snapshot (its last full-block boundary): the state
  is valid only at the exact length it was taken at.

Hence the cached share here can be below `testbed trace info`'s "blocks seen earlier", which
counts every repeated hash wherever it sits. By default requests enter the cache in arrival
order, at once. `replay_cache` follows a deployment instead (`Routing`): a prompt enters the
pools when its prefill ends (`ReadyAfter`: as the testbed's pools fill, so a follow-up that
arrives before the turn it extends has been prefilled finds less), and with length-only routing
each side reuses only its own pool.

The window, when given, starts with an empty cache, like a replay of that window.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import numpy as np
import numpy.typing as npt

from testbed.core.engine.kvsize import KVModel
from testbed.model.analytical import DiscreteDistribution, FloatArray, Workload
from testbed.model.arrivals import Arrivals
from testbed.model.errors import ModelError
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
            raise ModelError("an empirical distribution needs at least one length")
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


class _Pool:
    """An unbounded pool by the rules of `HybridPrefixCache.match` and `insert` (module docstring)."""

    def __init__(self, block_tokens: int, linear_state: bool) -> None:
        self.block_tokens, self.linear_state = block_tokens, linear_state
        self.blocks: set[tuple[int, int]] = set()
        self.states: set[tuple[int, int]] = set()

    def match(self, r: TraceRequest) -> int:
        ids, blocks = r.hash_ids, self.blocks
        limit = min(max(r.input_tokens - 1, 0) // self.block_tokens, len(ids))
        full = 0
        while full < limit and (full, ids[full]) in blocks:
            full += 1
        if not self.linear_state:
            return full * self.block_tokens
        for k in range(full, 0, -1):
            if (k, ids[k - 1]) in self.states:
                return k * self.block_tokens
        return 0

    def insert(self, r: TraceRequest) -> None:
        ids = r.hash_ids
        n = min(r.input_tokens // self.block_tokens, len(ids))
        self.blocks.update(zip(range(n), ids[:n]))
        if n:
            self.states.add((n, ids[n - 1]))


def usable_cached_tokens(requests: Iterable[TraceRequest], block_tokens: int, linear_state: bool) -> IntArray:
    """Per request, the cached prefix (tokens) an unbounded pool filled by the earlier requests
    would give it (the rules of `HybridPrefixCache.match` and `insert`; module docstring)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    pool = _Pool(block_tokens, linear_state)
    out: list[int] = []
    for r in requests:
        out.append(pool.match(r))
        pool.insert(r)
    return np.asarray(out, dtype=np.int64)


@dataclass(frozen=True)
class Routing:
    """How a deployment sends prefills, as `replay_cache` follows it.

    - `threshold` None: every prefill on one side, PrfaaS when `offload_all` (naive), else the PD
      cluster (homogeneous);
    - cache-aware (the paper's rules with bandwidth abundant): a request goes to PrfaaS when its
      length beyond the longest cached prefix anywhere exceeds the threshold, and reuses that prefix;
      only the KV the PD cluster lacks crosses;
    - length-only (`cache_aware` False): the whole prompt is judged against the threshold; each side
      reuses only its own pool, and an offloaded request's whole KV crosses.

    The PD pool receives every prompt (its own prefills', and offloaded ones' when their KV
    arrives), so it is the union of all; PrfaaS's holds only what PrfaaS prefilled.
    """

    threshold: float | None = None
    offload_all: bool = False
    cache_aware: bool = True


# Seconds after its arrival that a request's prompt enters the pools (its prefill's end), given
# whether it went to PrfaaS, the tokens it computes and when it arrived (s from the first arrival).
ReadyAfter = Callable[[bool, int, float], float]


@dataclass(frozen=True, eq=False)
class CacheReplay:
    """Per request: routed to PrfaaS, the cached prefix its prefill reuses, and the prompt tokens
    whose KV the decode cluster lacks (what an offloaded request ships)."""

    offloaded: npt.NDArray[np.bool_]
    cached: IntArray
    shipped: IntArray


def replay_cache(
    requests: Sequence[TraceRequest],
    block_tokens: int,
    linear_state: bool,
    routing: Routing = Routing(),
    ready_after: ReadyAfter | None = None,
) -> CacheReplay:
    """The trace through unbounded pools in arrival order, each prompt entering its pools
    `ready_after` its arrival (None: at once), as the testbed's pools fill when a prefill ends.
    A follow-up that arrives before the turn it extends has been prefilled finds less."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    union, remote = _Pool(block_tokens, linear_state), _Pool(block_tokens, linear_state)
    pending: list[tuple[float, int, bool]] = []  # (ready at, request index, into PrfaaS's pool)
    n = len(requests)
    offloaded = np.zeros(n, dtype=np.bool_)
    cached = np.zeros(n, dtype=np.int64)
    shipped = np.zeros(n, dtype=np.int64)
    t = routing.threshold
    t0 = requests[0].timestamp if n else 0.0
    for i, r in enumerate(requests):
        while pending and pending[0][0] <= r.timestamp:
            _, j, into_remote = heapq.heappop(pending)
            union.insert(requests[j])
            if into_remote:
                remote.insert(requests[j])
        anywhere = union.match(r)
        if t is None:
            off, use = routing.offload_all, anywhere
        elif routing.cache_aware:
            off, use = r.input_tokens - anywhere > t, anywhere
        else:
            off = r.input_tokens > t
            use = remote.match(r) if off else anywhere
        offloaded[i], cached[i] = off, use
        shipped[i] = r.input_tokens - (anywhere if routing.cache_aware else 0)
        delay = 0.0 if ready_after is None else ready_after(off, r.input_tokens - use, r.timestamp - t0)
        heapq.heappush(pending, (r.timestamp + delay, i, off))
    return CacheReplay(offloaded, cached, shipped)


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


class WorkloadSummary(TypedDict):
    """A trace's workload as the model sees it (`TraceWorkload.summary`); token figures are
    {mean, p50, p90, max}."""

    source: str
    requests: int
    duration_s: float
    rate_rps: float
    input_tokens: dict[str, float]
    uncached_tokens: dict[str, float]
    output_tokens: dict[str, float]
    cached_share: float
    reuse_share: float
    cache_rule: str
    arrivals: dict[str, float | None] | None  # `ArrivalProcess.summary`


@dataclass(frozen=True, eq=False)
class TraceWorkload:
    """A trace reduced to what the model reads, per request: input, cached prefix, output."""

    source: str
    block_tokens: int
    linear_state: bool  # the cache rule used: a state snapshot needed at the matched length
    duration_s: float
    rate: float  # requests/s, 1 / mean inter-arrival gap (`Trace.rate`)
    input_tokens: IntArray
    cached_tokens: IntArray
    output_tokens: IntArray
    reuse_share: float  # blocks seen earlier anywhere in the trace
    arrivals: Arrivals | None = None  # the arrival times (None: Poisson assumed)
    # The routing the cached prefixes were replayed under (`replay_cache`); None: one pool filled
    # by every earlier request at once, whatever the routing.
    replay: CacheReplay | None = None
    dist: EmpiricalDistribution = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.input_tokens.size
        if n == 0:
            raise ValueError(f"{self.source}: no requests")
        if self.cached_tokens.size != n or self.output_tokens.size != n:
            raise ValueError("input, cached and output arrays must have one entry per request")
        object.__setattr__(self, "dist", EmpiricalDistribution(self.uncached_tokens))

    @classmethod
    def from_trace(
        cls, trace: Trace, kv: KVModel, routing: Routing | None = None, ready_after: ReadyAfter | None = None
    ) -> TraceWorkload:
        """The cache rule follows the model: linear or sliding-window layers need a state snapshot.
        With `routing`, the cached prefixes are those `replay_cache` finds under it."""
        if len(trace) == 0:
            raise ValueError(f"{trace.source}: no requests")
        linear = "linear" in kv.kinds
        reqs = trace.requests
        rate = trace.rate if len(trace) > 1 else 0.0
        replay = None if routing is None else replay_cache(reqs, trace.block_tokens, linear, routing, ready_after)
        return cls(
            source=trace.source,
            block_tokens=trace.block_tokens,
            linear_state=linear,
            duration_s=trace.duration,
            rate=rate if math.isfinite(rate) else 0.0,
            input_tokens=np.fromiter((r.input_tokens for r in reqs), dtype=np.int64, count=len(reqs)),
            cached_tokens=usable_cached_tokens(reqs, trace.block_tokens, linear) if replay is None else replay.cached,
            output_tokens=np.fromiter((r.output_tokens for r in reqs), dtype=np.int64, count=len(reqs)),
            reuse_share=_reuse_share(reqs),
            arrivals=Arrivals(np.fromiter((r.timestamp for r in reqs), dtype=np.float64, count=len(reqs))),
            replay=replay,
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
            self.dist,
            self.mean_output,
            self.rate,
            self.source,
            output_sq_tokens=float(np.mean(o * o)),
            context_tokens=float(self.input_tokens.mean()) + 0.5 * self.mean_output,
            arrival_scv=self.arrivals.gap_scv if self.arrivals is not None else 1.0,
            windows=self.arrivals.windows() if self.arrivals is not None and self.arrivals.rate > 0 else None,
            gap_law=self.arrivals.gap_law() if self.arrivals is not None else None,
            arrival_times=self.arrivals.times if self.arrivals is not None else None,
        )

    def summary(self) -> WorkloadSummary:
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
            "arrivals": self.arrivals.summary() if self.arrivals is not None else None,
        }


def load_trace_workload(
    path: str | Path, kv: KVModel, window: Window | None = None, format: str = "auto"
) -> TraceWorkload:
    """Read a trace file (any format `testbed.traces.load_trace` reads) into a TraceWorkload."""
    return TraceWorkload.from_trace(load_trace(path, format, window=window), kv)
