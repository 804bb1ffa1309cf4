"""Calibrated service-time models, in paper seconds."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from testbed.core.schema.hardware import DecodeSpec, PolynomialPrefill, PrefillSpec, TablePrefill
from testbed.core.schema.kinds import unknown_kind


def table_time(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear in x over the points, the first and last segments extrapolated."""
    i = bisect.bisect_right(xs, x)
    # Clamp to the first/last segment so the ends extrapolate linearly.
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-6)


@dataclass(frozen=True)
class PrefillTime:
    """T_prefill(uncached l, cached c) = overhead_s + T(l) + c * (cached_token_s + cached_attention_s * l),
    T(l) a table (piecewise linear, extrapolated) or a polynomial (`testbed.core.schema.scenario`)."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    coefficients: tuple[float, ...]
    cached_token_s: float
    overhead_s: float = 0.0
    cached_attention_s: float = 0.0
    # A batched pass's token-bound time over its total uncached tokens (`pass_tokens` of the
    # schema); empty: the pass is priced on the curve alone (`chunk_time`).
    pass_xs: tuple[float, ...] = ()
    pass_ys: tuple[float, ...] = ()

    @classmethod
    def from_spec(cls, spec: PrefillSpec) -> PrefillTime:
        xs: tuple[float, ...]
        ys: tuple[float, ...]
        coefficients: tuple[float, ...]
        match spec:
            case TablePrefill():
                xs, ys, coefficients = tuple(p[0] for p in spec.points), tuple(p[1] for p in spec.points), ()
            case PolynomialPrefill():
                xs, ys, coefficients = (), (), tuple(spec.coefficients)
            case _:
                unknown_kind("prefill model", spec)
        passes = spec.pass_tokens or []
        return cls(
            xs=xs,
            ys=ys,
            coefficients=coefficients,
            cached_token_s=spec.cached_token_s,
            overhead_s=spec.overhead_s,
            cached_attention_s=spec.cached_attention_s,
            pass_xs=tuple(p[0] for p in passes),
            pass_ys=tuple(p[1] for p in passes),
        )

    def __call__(self, uncached: float, cached: float = 0.0) -> float:
        t = self.uncached_time(uncached)
        if cached:
            t += cached * (self.cached_token_s + self.cached_attention_s * uncached)
        return t

    def uncached_time(self, tokens: float) -> float:
        """A prefill of `tokens` with nothing cached: the fixed overhead included."""
        return self.overhead_s + self.length_time(tokens)

    def length_time(self, tokens: float) -> float:
        """The curve alone, T(l): what grows with the length, without the fixed overhead."""
        if self.coefficients:
            t = 0.0
            for c in reversed(self.coefficients):
                t = t * tokens + c
            return max(t, 0.0)
        return table_time(self.xs, self.ys, tokens)

    def token_pass_time(self, tokens: float) -> float:
        """A batched pass's token-bound part over `tokens` uncached tokens in all (needs `pass_xs`)."""
        return table_time(self.pass_xs, self.pass_ys, tokens)

    def attention_time(self, tokens: float) -> float:
        """What a prompt of `tokens` costs beyond the token-bound part: its attention over its own
        context, T(l) - token_pass_time(l) (needs `pass_xs`)."""
        return self.length_time(tokens) - self.token_pass_time(tokens)

    def fixed_time(self) -> float:
        """What a prefill costs at zero length by this curve: the overhead plus the curve's own
        intercept (a table's first segment extrapolated to 0 tokens; a polynomial's constant)."""
        if self.coefficients:
            return self.overhead_s + self.coefficients[0]
        x0, x1, y0, y1 = self.xs[0], self.xs[1], self.ys[0], self.ys[1]
        return self.overhead_s + y0 - (y1 - y0) * x0 / (x1 - x0)

    def chunk_time(self, done: float, tokens: float, cached: float) -> float:
        """A chunk's share of a batched forward pass: `tokens` uncached tokens of a prompt of
        which `done` were computed in earlier passes, over a cached prefix of `cached` tokens.

        The rule on the single-prompt curve: a chunk costs its increment on the curve,
        T(done + tokens) - T(done), with T(0) read as the curve's fixed part (`fixed_time` less
        the overhead, at least 0), since a pass pays that part once (`pass_time`); a prompt's
        cached prefix costs `cached_token_s` per token in its first chunk and
        `cached_attention_s` per cached token per uncached token in each. A whole prompt alone
        in a pass therefore takes exactly `self(uncached, cached)`, and a prompt cut in chunks
        the same plus the fixed part once per extra pass."""
        if self.pass_xs:
            # The token-bound part is the pass's (`pass_time`); the chunk adds its attention.
            t = self.attention_time(done + tokens) - (self.attention_time(done) if done > 0 else 0.0)
        else:
            base = self._intercept()
            t = self.length_time(done + tokens) - (self.length_time(done) if done > 0 else base)
        if cached:
            t += cached * (self.cached_attention_s * tokens + (self.cached_token_s if done == 0 else 0.0))
        return t

    def pass_time(self, chunks: list[tuple[float, float, float]]) -> float:
        """A forward pass over `chunks` (done, tokens, cached each; see `chunk_time`): the
        overhead once; with `pass_xs`, the token-bound time of all its tokens and each chunk's
        attention; without, the curve's fixed part once and each chunk's increment on the curve."""
        work = sum(self.chunk_time(d, n, c) for d, n, c in chunks)
        if self.pass_xs:
            return self.overhead_s + self.token_pass_time(sum(n for _, n, _ in chunks)) + work
        return self.overhead_s + self._intercept() + work

    def _intercept(self) -> float:
        return max(self.fixed_time() - self.overhead_s, 0.0)


@dataclass(frozen=True)
class DecodeStepTime:
    """One continuous-batching step: base + per sequence + per context token held in the batch."""

    base_s: float
    per_seq_s: float
    per_context_token_s: float

    @classmethod
    def from_spec(cls, spec: DecodeSpec) -> DecodeStepTime:
        return cls(spec.base_s, spec.per_seq_s, spec.per_context_token_s)

    def __call__(self, batch: int, context_tokens: int) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_context_token_s * context_tokens
