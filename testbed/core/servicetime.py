"""Calibrated service-time models, in paper seconds."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from testbed.core.scenario import DecodeSpec, PolynomialPrefill, PrefillSpec, TablePrefill


@dataclass(frozen=True)
class PrefillTime:
    """T_prefill(uncached, cached): table (piecewise linear, extrapolated) or polynomial."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    coefficients: tuple[float, ...]
    cached_token_s: float

    @classmethod
    def from_spec(cls, spec: PrefillSpec) -> "PrefillTime":
        if isinstance(spec, TablePrefill):
            return cls(
                xs=tuple(p[0] for p in spec.points),
                ys=tuple(p[1] for p in spec.points),
                coefficients=(),
                cached_token_s=spec.cached_token_s,
            )
        assert isinstance(spec, PolynomialPrefill)
        return cls(xs=(), ys=(), coefficients=tuple(spec.coefficients), cached_token_s=spec.cached_token_s)

    def __call__(self, uncached: float, cached: float = 0.0) -> float:
        return self.uncached_time(uncached) + self.cached_token_s * cached

    def uncached_time(self, tokens: float) -> float:
        if self.coefficients:
            t = 0.0
            for c in reversed(self.coefficients):
                t = t * tokens + c
            return max(t, 0.0)
        xs, ys = self.xs, self.ys
        i = bisect.bisect_right(xs, tokens)
        # Clamp to the first/last segment so the ends extrapolate linearly.
        i = min(max(i, 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 1e-6)


@dataclass(frozen=True)
class DecodeStepTime:
    """One continuous-batching step: base + per sequence + per context token held in the batch."""

    base_s: float
    per_seq_s: float
    per_context_token_s: float

    @classmethod
    def from_spec(cls, spec: DecodeSpec) -> "DecodeStepTime":
        return cls(spec.base_s, spec.per_seq_s, spec.per_context_token_s)

    def __call__(self, batch: int, context_tokens: int) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_context_token_s * context_tokens

