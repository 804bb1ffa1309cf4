"""A hardware profile of the testbed as the timing tables Dynamo's mocker reads.

The mocker's offline replay takes an external timing model (`timing_model: {type: external,
provider: dynamo_profile, config: {path: FILE.npz}}`): an NPZ of five arrays, the same layout
as the planner's profiling data --

- `prefill_isl`, `prefill_ttft_ms`: one forward pass's time over the new tokens it computes,
  interpolated linearly and extrapolated at the ends;
- `decode_active_kv_tokens`, `decode_context_length`, `decode_itl` (ms, rows x columns): one
  decode step over the KV tokens the batch holds and the batch's mean context, bilinear.

The testbed's prefill time is a table (the same piecewise-linear form: exported as is) or a
polynomial (sampled where a linear interpolation stays within `PREFILL_TOL` of it), and its
decode step is `base + per_seq * batch + per_context_token * sum(context)`. With batch = KV
tokens / mean context that is linear in the KV tokens for each context, so two columns of KV
tokens hold it exactly and the contexts are sampled where the bilinear table stays within
`DECODE_TOL`. What the export could not hold exactly is measured and said (`max_*_err`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.hardware import DecodeSpec, HardwareSpec, TablePrefill

PREFILL_TOL = 0.002  # relative error of the exported prefill curve at any point
DECODE_TOL = 0.002  # relative error of the exported decode step at any grid midpoint
MAX_POINTS = 4096


@dataclass(frozen=True)
class MockerTiming:
    """The five arrays and how far they are from the testbed's own service times."""

    prefill_isl: np.ndarray
    prefill_ttft_ms: np.ndarray
    decode_active_kv_tokens: np.ndarray
    decode_context_length: np.ndarray
    decode_itl: np.ndarray
    max_prefill_err: float  # relative, worst point checked between the exported ones
    max_decode_err: float

    def write(self, path: Path) -> Path:
        np.savez(
            path,
            prefill_isl=self.prefill_isl,
            prefill_ttft_ms=self.prefill_ttft_ms,
            decode_active_kv_tokens=self.decode_active_kv_tokens,
            decode_context_length=self.decode_context_length,
            decode_itl=self.decode_itl,
        )
        return path

    def describe(self) -> str:
        return (
            f"prefill table of {self.prefill_isl.size} points from {self.prefill_isl[0]:,.0f} to "
            f"{self.prefill_isl[-1]:,.0f} tokens (worst error {self.max_prefill_err:.2%}), decode table of "
            f"{self.decode_active_kv_tokens.size} x {self.decode_context_length.size} points (worst error "
            f"{self.max_decode_err:.2%})"
        )


def _refine(
    f: Callable[[float], float], lo: float, hi: float, tol: float, geometric: bool
) -> tuple[list[float], float]:
    """Points from lo to hi where linear interpolation of f between neighbours stays within
    `tol` (relative) at each interval's midpoint; the worst error left."""

    def mid(a: float, b: float) -> float:
        return math.sqrt(a * b) if geometric and a > 0 else (a + b) / 2

    def err(a: float, b: float) -> float:
        m = mid(a, b)
        lin = f(a) + (f(b) - f(a)) * (m - a) / (b - a)
        exact = f(m)
        return abs(lin - exact) / max(abs(exact), 1e-12)

    pts = [lo, hi]
    worst = 0.0
    i = 0
    while i < len(pts) - 1:
        a, b = pts[i], pts[i + 1]
        e = err(a, b)
        if e > tol and b - a > 1.0 and len(pts) < MAX_POINTS:
            pts.insert(i + 1, float(round(mid(a, b))))
            if pts[i + 1] in (a, b):  # integer tokens: nothing left between
                pts.pop(i + 1)
                worst = max(worst, e)
                i += 1
            continue
        worst = max(worst, e)
        i += 1
    return pts, worst


def prefill_table(spec: HardwareSpec, max_tokens: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(tokens, ms, worst relative error) of one prefill over 1..max_tokens new tokens."""
    t = PrefillTime.from_spec(spec.prefill)
    hi = float(max(max_tokens, 2))
    if isinstance(spec.prefill, TablePrefill):
        # Linear between the same points and extrapolated from the end segments: the same curve.
        xs = [float(p[0]) for p in spec.prefill.points]
        return np.array(xs), np.array([t.uncached_time(x) * 1e3 for x in xs]), 0.0
    xs, worst = _refine(t.uncached_time, 1.0, hi, PREFILL_TOL, geometric=True)
    return np.array(xs), np.array([t.uncached_time(x) * 1e3 for x in xs]), worst


def decode_table(spec: DecodeSpec, max_context: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(KV tokens, mean contexts, step ms [KV x context], worst relative error) of one decode step
    for batches up to `spec.bs_max` sequences of up to `max_context` tokens each."""
    top = float(spec.bs_max * max(max_context, 1))
    kv = np.array([0.0, top])

    def step_s(context: float, tokens: float = top) -> float:
        return spec.base_s + spec.per_seq_s * tokens / context + spec.per_context_token_s * tokens

    ctx, worst = _refine(lambda c: step_s(c), 1.0, float(max(max_context, 2)), DECODE_TOL, geometric=True)
    grid = np.array([[step_s(c, x) * 1e3 for c in ctx] for x in kv])
    return kv, np.array(ctx), grid, worst


def mocker_timing(spec: HardwareSpec, max_input: int, max_context: int) -> MockerTiming:
    """The tables for one hardware profile, covering prefills of up to `max_input` new tokens and
    decode batches of sequences of up to `max_context` tokens (beyond, the mocker extrapolates)."""
    if spec.decode is None:
        raise ValueError("the hardware profile has no decode step to export")
    xs, ms, perr = prefill_table(spec, max_input)
    kv, ctx, grid, derr = decode_table(spec.decode, max_context)
    return MockerTiming(xs, ms, kv, ctx, grid, perr, derr)
