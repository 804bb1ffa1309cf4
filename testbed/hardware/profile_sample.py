"""Sample a timing source into a hardware profile (a scenario's `hardware:` entry).

A source is anything that answers two questions (`Predictor`): how long one prefill of l
uncached tokens after c cached ones takes, and how long one decode step of a batch takes at a
given context. NVIDIA's aiconfigurator answers both from measured kernels
(`testbed.hardware.aiconfigurator`); the tests answer them with closed forms. Pure: no I/O.

- Prefill: a table over uncached tokens whose points are the source's own answers, with points
  added where the straight line between two of them strays more than `tolerance` from the
  source at the segment's middle; then `cached_token_s` and `cached_attention_s` fitted to
  prefills after cached prefixes (least squares on the relative error of the whole time, both
  terms non-negative). The source's time is kernel time: `overhead_s` is what the user adds.
- Decode: BS_max is the largest batch whose step at `decode_context` tokens per sequence meets
  the TPOT target (and whose KV fits, when the capacity is known); the three-term step model is
  fitted (`testbed.hardware.calibrate.fit_decode`) to steps over batches up to BS_max and contexts
  up to the longest prompt.

Every fitted or interpolated term is scored against the source where it was not fitted, and
the scores go into the profile's provenance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.errors import UserError
from testbed.core.schema.hardware import DecodeSpec, TablePrefill
from testbed.hardware.calibrate import DecodeFit, DecodePoint, fit_decode

# The batch sizes tried for BS_max, at most.
MAX_BATCH = 1024


class SampleError(UserError, ValueError):
    """The source cannot be sampled into a profile with these settings."""


class Predictor(Protocol):
    """A timing source, in seconds."""

    def prefill_s(self, uncached: int, cached: int) -> float: ...

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences, each holding `context` tokens."""
        ...


@runtime_checkable
class BatchPredictor(Protocol):
    """A source that also times a batched prefill pass (aiconfigurator does)."""

    def prefill_batch_s(self, batch: int, tokens: int) -> float:
        """One forward pass over `batch` prompts of `tokens` uncached tokens each."""
        ...


@dataclass(frozen=True)
class SampleSettings:
    min_tokens: int = 1
    max_tokens: int = 131072
    tolerance: float = 0.005  # table vs source at every segment's middle
    max_points: int = 160
    overhead_s: float = 0.0  # fixed time per prefill the user adds to kernel time
    cached_uncached: tuple[int, ...] = (256, 1024, 4096, 16384, 65536)
    cached_prefix: tuple[int, ...] = (512, 2048, 8192, 32768, 131072)
    decode_context: int = 28672  # per sequence, for BS_max
    tpot_s: float = 0.025
    bs_max: int | None = None  # None: the largest batch meeting tpot_s (and the KV capacity)
    kv_capacity_bytes: int | None = None
    decode_contexts: tuple[int, ...] = (1024, 4096, 16384, 32768, 65536, 131072)
    # A batched pass's token-bound part is read from passes of prompts this short (attention
    # negligible), and the split it gives is scored on these (batch, tokens) passes.
    pass_unit: int = 128
    batch_probes: tuple[tuple[int, int], ...] = tuple((b, t) for t in (512, 2048, 8192) for b in (2, 4, 8))

    def check(self) -> None:
        if not 1 <= self.min_tokens < self.max_tokens:
            raise SampleError(f"token range {self.min_tokens}..{self.max_tokens}: need 1 <= min < max")
        if not 0 < self.tolerance < 0.5:
            raise SampleError(f"tolerance {self.tolerance:g}: need 0 < tolerance < 0.5 (a relative error)")
        if self.overhead_s < 0 or not math.isfinite(self.overhead_s):
            raise SampleError(f"overhead {self.overhead_s:g} s: need a finite number >= 0")
        if self.tpot_s <= 0 or self.decode_context < 1:
            raise SampleError("the TPOT target must be > 0 s and the decode context >= 1 token")
        if self.bs_max is not None and not 1 <= self.bs_max <= MAX_BATCH:
            raise SampleError(f"BS_max {self.bs_max}: need 1..{MAX_BATCH}")


@dataclass(frozen=True)
class Scores:
    """Relative errors |profile - source| / source over a set of probes."""

    n: int
    mean_abs: float
    max_abs: float

    @classmethod
    def of(cls, errors: Sequence[float]) -> Scores:
        a = np.abs(np.asarray(errors, dtype=float))
        return cls(len(a), float(a.mean()) if len(a) else 0.0, float(a.max()) if len(a) else 0.0)


@dataclass(frozen=True)
class ProfileSample:
    prefill: TablePrefill
    decode: DecodeSpec
    interpolation: Scores  # prefill table vs source at quarter points of every segment
    cached: Scores  # whole prefill after a cached prefix vs source
    decode_fit: Scores  # decode step model vs source over the fitted grid
    decode_at_bs_max: float  # the source's step at BS_max and decode_context, s
    notes: tuple[str, ...] = field(default=())
    batched: Scores | None = None  # batched passes by the pass_tokens split vs the source
    batched_curve_only: Scores | None = None  # the same passes priced on the curve alone

    def fit_record(self) -> dict[str, float]:
        """For the profile's provenance: how closely each term follows the source."""

        def r(v: float) -> float:
            return float(f"{v:.4g}")

        return {
            "prefill_points": len(self.prefill.points),
            "prefill_interpolation_max_rel_error": r(self.interpolation.max_abs),
            "cached_probes": self.cached.n,
            "cached_max_rel_error": r(self.cached.max_abs),
            "cached_mean_rel_error": r(self.cached.mean_abs),
            "decode_probes": self.decode_fit.n,
            "decode_max_rel_error": r(self.decode_fit.max_abs),
            "decode_mean_rel_error": r(self.decode_fit.mean_abs),
            "decode_step_at_bs_max_s": r(self.decode_at_bs_max),
            **(
                {
                    "batch_probes": self.batched.n,
                    "batch_max_rel_error": r(self.batched.max_abs),
                    "batch_mean_rel_error": r(self.batched.mean_abs),
                    "batch_curve_only_max_rel_error": r(self.batched_curve_only.max_abs),
                }
                if self.batched is not None and self.batched_curve_only is not None
                else {}
            ),
        }


def _checked(what: str, v: float) -> float:
    if not (v > 0 and math.isfinite(v)):
        raise SampleError(f"the source gave {v!r} s for {what}: not a positive time")
    return v


def start_knots(lo: int, hi: int) -> list[int]:
    """Where the table starts before it is refined: lo, hi, and every power of two between them
    with the length one above it. Kernel tables are collected at powers of two and a source
    that interpolates them can step just past one (aiconfigurator: 2048 -> 2049 tokens takes
    2.7% longer); a knot on each side keeps the step out of every segment."""
    out = {lo, hi}
    p = 1
    while p <= hi:
        out |= {x for x in (p, p + 1) if lo <= x <= hi}
        p *= 2
    return sorted(out)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    return PrefillTime(tuple(xs), tuple(ys), (), 0.0).length_time(x)


def prefill_table(
    t: Callable[[int], float], lo: int, hi: int, tolerance: float, max_points: int
) -> tuple[list[tuple[int, float]], Scores]:
    """Points (tokens, seconds) of `t` from lo to hi, a segment split at its middle while the
    line strays more than `tolerance` (relative) from `t` there; and the table's errors at the
    quarter points of every final segment (where it was not refined on)."""
    memo: dict[int, float] = {}

    def at(x: int) -> float:
        if x not in memo:
            memo[x] = _checked(f"a prefill of {x} tokens", t(x))
        return memo[x]

    def inner(a: int, b: int, parts: int) -> list[int]:
        return sorted({a + (b - a) * k // parts for k in range(1, parts)} - {a, b})

    xs = start_knots(lo, hi)
    changed = True
    while changed:
        changed = False
        new = list(xs)
        for a, b in zip(xs, xs[1:]):
            # The source is itself interpolated from tables, with kinks anywhere: judge the line at
            # the segment's quarter points, not only its middle.
            if b - a < 2 or all(
                abs(at(a) + (at(b) - at(a)) * (q - a) / (b - a) - at(q)) <= tolerance * at(q) for q in inner(a, b, 4)
            ):
                continue
            if b - a > max(4, a // 32):
                new.append((a + b) // 2)
            elif a + 1 not in xs:
                # Narrow and still off: a step, which halving would chase down to single tokens.
                # Bisection puts knots on round lengths, where kernel tables are collected and
                # where the source steps (just after one): a knot one token on takes it out.
                new.append(a + 1)
            else:
                continue
            changed = True
        xs = sorted(set(new))
        if len(xs) > max_points:
            raise SampleError(
                f"the prefill table needs more than {max_points} points to stay within "
                f"{tolerance:.2%} of the source (a larger --tolerance)"
            )
    ys = [at(x) for x in xs]
    # Scored where the refinement never looked: the odd eighths of every segment.
    errors = []
    for a, b in zip(xs, xs[1:]):
        for q in set(inner(a, b, 8)) - set(inner(a, b, 4)):
            ref = _checked(f"a prefill of {q} tokens", t(q))
            errors.append((_interp(xs, ys, q) - ref) / ref)
    return [(x, at(x)) for x in xs], Scores.of(errors)


def fit_cached_terms(
    base: Callable[[float], float], probes: Sequence[tuple[int, int, float]]
) -> tuple[float, float, Scores]:
    """cached_token_s and cached_attention_s of T(u, c) = base(u) + c * (a + b * u) fitted to
    probes (u, c, seconds): least squares on the relative error of the whole time, a and b
    non-negative (the closest fit among the supports whose terms are). (a, b, errors)."""
    if not probes:
        return 0.0, 0.0, Scores.of([])
    u = np.array([p[0] for p in probes], dtype=float)
    c = np.array([p[1] for p in probes], dtype=float)
    y = np.array([p[2] for p in probes], dtype=float)
    b0 = np.array([base(x) for x in u])
    cs, ps = float(c.max()), float((u * c).max())
    cols = {0: c / cs / y, 1: u * c / ps / y}
    rhs = (y - b0) / y
    best: tuple[float, tuple[int, ...], np.ndarray] | None = None
    for support in ((0, 1), (0,), (1,), ()):
        if support:
            a = np.column_stack([cols[k] for k in support])
            x, *_ = np.linalg.lstsq(a, rhs, rcond=None)
            res = float(np.sum((a @ x - rhs) ** 2))
        else:
            x, res = np.zeros(0), float(np.sum(rhs**2))
        if np.all(x >= 0) and (best is None or res < best[0]):
            best = (res, support, x)
    assert best is not None  # the empty support always qualifies
    terms = [0.0, 0.0]
    for k, v in zip(best[1], best[2]):
        terms[k] = float(v) / (cs, ps)[k]
    fitted = b0 + c * (terms[0] + terms[1] * u)
    return terms[0], terms[1], Scores.of(list((fitted - y) / y))


def choose_bs_max(step: Callable[[int], float], tpot_s: float, fits: Callable[[int], bool]) -> int:
    """The largest batch (up to MAX_BATCH) whose step meets tpot_s and whose KV fits, taking
    both as monotone in the batch."""
    if step(1) > tpot_s:
        raise SampleError(
            f"one sequence alone takes {step(1) * 1e3:.1f} ms a step, over the TPOT target of "
            f"{tpot_s * 1e3:.1f} ms: give BS_max (--bs-max) or a longer --tpot"
        )
    if not fits(1):
        raise SampleError("one sequence's KV does not fit the KV capacity: give a larger --kv-capacity")
    lo, hi = 1, MAX_BATCH
    if step(hi) <= tpot_s and fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if step(mid) <= tpot_s and fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _decode_batches(bs_max: int) -> list[int]:
    return sorted(
        {
            1,
            bs_max,
            *(b for b in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if b < bs_max),
            max(1, bs_max // 2),
            max(1, (3 * bs_max) // 4),
        }
    )


def sample_profile(pred: Predictor, kv: KVModel, settings: SampleSettings) -> ProfileSample:
    settings.check()
    s = settings
    notes: list[str] = []
    points, interp = prefill_table(
        lambda x: pred.prefill_s(x, 0), s.min_tokens, s.max_tokens, s.tolerance, s.max_points
    )
    table = PrefillTime(tuple(float(x) for x, _ in points), tuple(y for _, y in points), (), 0.0)
    probes = [
        (u, c, _checked(f"a prefill of {u} tokens after {c} cached", pred.prefill_s(u, c)))
        for u in s.cached_uncached
        for c in s.cached_prefix
        if u + c <= s.max_tokens
    ]
    cached_s, attention_s, cached_scores = fit_cached_terms(table.length_time, probes)
    prefill = TablePrefill(
        kind="table",
        points=[(float(x), float(y)) for x, y in points],
        overhead_s=s.overhead_s,
        cached_token_s=cached_s,
        cached_attention_s=attention_s,
    )
    batched: tuple[Scores, Scores] | None = None
    if isinstance(pred, BatchPredictor):
        prefill, batched = pass_tokens_table(pred, prefill, s)
        notes.append(
            f"batched passes: the token-bound part read from passes of {s.pass_unit}-token prompts; "
            f"{batched[0].n} batched passes priced by it within {batched[0].max_abs:.1%} of the source "
            f"(on the single-prompt curve alone: {batched[1].max_abs:.1%})"
        )

    ctx = s.decode_context

    def step(b: int) -> float:
        return _checked(f"a decode step of batch {b} at {ctx} tokens", pred.decode_step_s(b, ctx))

    def fits(b: int) -> bool:
        return s.kv_capacity_bytes is None or b * kv.total(ctx) <= s.kv_capacity_bytes

    bs_max = s.bs_max if s.bs_max is not None else choose_bs_max(step, s.tpot_s, fits)
    if s.bs_max is None:
        notes.append(
            f"BS_max {bs_max}: the largest batch whose step at {ctx:,} tokens a sequence meets "
            f"{s.tpot_s * 1e3:g} ms" + (" and whose KV fits" if s.kv_capacity_bytes is not None else "")
        )
    contexts = sorted({c for c in s.decode_contexts if c <= s.max_tokens} | {ctx})
    dpoints = [
        DecodePoint(
            float(b),
            float(b * c),
            _checked(f"a decode step of batch {b} at {c} tokens", pred.decode_step_s(b, c)),
            f"batch {b} x {c}",
        )
        for b in _decode_batches(bs_max)
        for c in contexts
    ]
    fit: DecodeFit = fit_decode(dpoints, 0)
    notes += [f"decode: {n}" for n in fit.notes]
    capacity = s.kv_capacity_bytes
    if capacity is None:
        # Unknown: enough that BS_max binds, as the paper's own decode profile is set.
        capacity = bs_max * kv.total(s.max_tokens)
        notes.append(f"KV capacity not known: set to BS_max sequences of {s.max_tokens:,} tokens, so BS_max binds")
    decode = DecodeSpec(
        base_s=fit.base_s,
        per_seq_s=fit.per_seq_s,
        per_context_token_s=fit.per_context_token_s,
        bs_max=bs_max,
        kv_capacity_bytes=int(capacity),
    )
    return ProfileSample(
        prefill,
        decode,
        interp,
        cached_scores,
        Scores.of([e.rel_error for e in fit.points]),
        step(bs_max),
        tuple(notes),
        batched[0] if batched else None,
        batched[1] if batched else None,
    )


def pass_grid(unit: int, hi: int) -> list[int]:
    """Pass sizes in tokens: the unit times 1, 2, 3, 4, 6, 8, 12, ... up to `hi` (and `hi`'s own
    multiple), at most MAX_BATCH prompts a pass."""
    top = min(max(hi // unit, 1), MAX_BATCH)
    ks = {1, top}
    p = 1
    while p <= top:
        ks |= {k for k in (p, 3 * p // 2) if 1 <= k <= top}
        p *= 2
    return [unit * k for k in sorted(ks)]


def pass_tokens_table(
    pred: BatchPredictor, prefill: TablePrefill, s: SampleSettings
) -> tuple[TablePrefill, tuple[Scores, Scores]]:
    """The profile's `pass_tokens` (a batched pass's token-bound time over its tokens) read from
    passes of short prompts, and the scores of batched passes priced with it and without it."""
    u = s.pass_unit
    table = [
        (float(n), _checked(f"a pass of {n // u} prompts of {u} tokens", pred.prefill_batch_s(n // u, u)))
        for n in pass_grid(u, s.max_tokens)
    ]
    with_table = prefill.model_copy(update={"pass_tokens": table, "overhead_s": 0.0})
    split, curve = (
        PrefillTime.from_spec(with_table),
        PrefillTime.from_spec(with_table.model_copy(update={"pass_tokens": None})),
    )
    errors: tuple[list[float], list[float]] = ([], [])
    for b, t in s.batch_probes:
        if b * t > s.max_tokens:
            continue
        ref = _checked(f"a pass of {b} prompts of {t} tokens", pred.prefill_batch_s(b, t))
        errors[0].append((split.pass_time([(0, t, 0)] * b) - ref) / ref)
        errors[1].append((curve.pass_time([(0, t, 0)] * b) - ref) / ref)
    return prefill.model_copy(update={"pass_tokens": table}), (Scores.of(errors[0]), Scores.of(errors[1]))
