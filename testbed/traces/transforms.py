"""Pure trace transforms: each returns a new Trace (the input is never modified).

Results are rebased so their first request is at 0 s, and `source` records the transform
chain for provenance in run reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from testbed.traces.types import Trace, TraceRequest


def _rebuild(trace: Trace, requests: Iterable[TraceRequest], what: str, scale: float = 1.0) -> Trace:
    reqs = list(requests)
    t0 = reqs[0].timestamp if reqs else 0.0
    if t0 != 0.0 or scale != 1.0:
        # `replace` keeps the session fields (a turn's think time is the user's, never rescaled).
        reqs = [
            TraceRequest(
                r.request_id,
                (r.timestamp - t0) / scale,
                r.input_tokens,
                r.output_tokens,
                r.hash_ids,
                r.session_id,
                r.parent_id,
                r.think_s,
            )
            for r in reqs
        ]
    return Trace(reqs, source=f"{trace.source} | {what}", block_tokens=trace.block_tokens, notes=trace.notes)


def time_scale(trace: Trace, factor: float) -> Trace:
    """Divide every timestamp by `factor`: 2 replays twice as fast (rate x2)."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"factor must be a positive finite number, got {factor}")
    return _rebuild(trace, trace.requests, f"time_scale({factor:g})", scale=factor)


def rescale_rate(trace: Trace, rate: float) -> Trace:
    """Stretch or compress all inter-arrival gaps by one factor so that `Trace.rate` (1 / mean
    gap) becomes `rate`. Burst structure is kept; only the time axis changes."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive finite number, got {rate}")
    current = trace.rate
    if not (current > 0 and math.isfinite(current)):
        raise ValueError(f"{trace.source}: cannot rescale a trace of {len(trace)} requests spanning {trace.duration} s")
    return _rebuild(trace, trace.requests, f"rescale_rate({rate:g})", scale=rate / current)


def sample(trace: Trace, n: int, seed: int) -> Trace:
    """Keep `n` requests chosen uniformly without replacement, in their original order and
    at their original (rebased) times, i.e. a thinned trace at ~n/len of the rate."""
    if not 0 <= n <= len(trace):
        raise ValueError(f"n must be in [0, {len(trace)}], got {n}")
    idx = np.sort(np.random.default_rng(seed).choice(len(trace), size=n, replace=False))
    reqs = trace.requests
    return _rebuild(trace, (reqs[int(i)] for i in idx), f"sample({n}, seed={seed})")


def head(trace: Trace, n: int) -> Trace:
    """The first `n` requests (all of them if the trace is shorter)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return _rebuild(trace, trace.requests[:n], f"head({n})")


def filter_lengths(trace: Trace, min_input: int | None = None, max_input: int | None = None) -> Trace:
    """Requests with min_input <= input_tokens <= max_input (either bound optional)."""
    lo = -1 if min_input is None else min_input
    hi = math.inf if max_input is None else max_input
    if lo > hi:
        raise ValueError(f"min_input {min_input} > max_input {max_input}")
    kept = (r for r in trace.requests if lo <= r.input_tokens <= hi)
    return _rebuild(trace, kept, f"filter_lengths({min_input}, {max_input})")


def window(trace: Trace, start_s: float, end_s: float) -> Trace:
    """Requests arriving in [start_s, end_s) of the trace's own time axis."""
    if not start_s <= end_s:
        raise ValueError(f"start_s {start_s} > end_s {end_s}")
    kept = (r for r in trace.requests if start_s <= r.timestamp < end_s)
    return _rebuild(trace, kept, f"window({start_s:g}, {end_s:g})")


def cap_output(trace: Trace, max_output: int) -> Trace:
    """Clamp output lengths to `max_output` tokens (inputs, times and hashes unchanged)."""
    if max_output < 0:
        raise ValueError(f"max_output must be >= 0, got {max_output}")
    reqs = (
        r if r.output_tokens <= max_output else dataclasses.replace(r, output_tokens=max_output) for r in trace.requests
    )
    return _rebuild(trace, reqs, f"cap_output({max_output})")
