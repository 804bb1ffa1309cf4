"""Fit a hardware profile (a scenario's `hardware:` entry) to measurements of a real server.

Pure: numpy, no I/O. The readers in `testbed.hardware.measurements` turn files into the points and
request records used here; `testbed calibrate` (hardware/calibrate_command.py) wires the two.

- Prefill: T(uncached, cached) as a table (piecewise linear over uncached tokens, extrapolated
  from the end segments, exactly as `PrefillTime` evaluates it) or a polynomial, plus
  `cached_token_s` per cached token and `cached_attention_s` per cached x uncached token when the
  cached counts vary. Least squares on relative error (measurements spread over 0.1-10 s and
  their noise grows with the time). The fixed time per prefill is made explicit as `overhead_s`:
  either the fitted curve's own time at zero uncached tokens, moved out of the curve (`overhead
  None`, totals unchanged), or a known value, the curve then fitted to what remains.
- Decode step = base_s + per_seq_s * batch + per_context_token_s * sum(context), non-negative
  least squares on relative error.
- Held-out points: every k-th point in input order is left out of the fit and scored against
  it (for prefill, not those at the shortest or longest length: the profile must span them);
  the returned spec is the fit to the remaining points, so the held-out error describes it.

From per-request benchmark records (aiperf, `vllm bench serve`), a request's decode steps are
its time after the first token over its output tokens less one; the batch and context in force
are the time averages, over that window, of the requests of the same run then decoding. TTFT of
a request with no other in flight until its first token (concurrency 1 in effect) is its prefill
plus one decode step of batch 1 over its prompt, so prefill = TTFT - step(1, prompt tokens).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np
from numpy.typing import NDArray

from testbed.core.engine.servicetime import PrefillTime
from testbed.core.errors import UserError
from testbed.core.schema.hardware import PolynomialPrefill, TablePrefill

Array = NDArray[np.float64]
# Request-overlap matrices are built a block of rows at a time, at most this many cells a block
# (a few such float matrices live at once: ~100 MB).
_BLOCK_CELLS = 2_000_000
# Overlap in flight shorter than this is clock rounding (a closed-loop client sends its next request
# the instant the last ends; exports round and mix wall and monotonic clocks), not a shared server.
_OVERLAP_TOLERANCE_S = 1e-3


class CalibrationError(UserError, ValueError):
    """The measurements cannot give a fit (too few points, nothing varies, a negative time)."""


@dataclass(frozen=True)
class PrefillPoint:
    """One prefill time: `count` requests of the same lengths (their median) or one CSV row."""

    uncached: float
    cached: float
    seconds: float
    label: str = ""
    count: int = 1


@dataclass(frozen=True)
class DecodePoint:
    """One decode step time at a batch size and a total context (tokens held by the batch)."""

    batch: float
    context_tokens: float
    seconds: float
    label: str = ""


@dataclass(frozen=True)
class PointError:
    label: str
    inputs: tuple[float, float]  # (uncached, cached) or (batch, context tokens)
    measured: float
    fitted: float
    held_out: bool

    @property
    def rel_error(self) -> float:
        return (self.fitted - self.measured) / self.measured


@dataclass(frozen=True)
class ErrorSummary:
    """Relative errors (fitted - measured) / measured over a set of points."""

    n: int
    mean_abs: float
    max_abs: float
    rms: float

    @classmethod
    def of(cls, errors: Sequence[float]) -> ErrorSummary | None:
        if not errors:
            return None
        a = np.abs(np.asarray(errors, dtype=float))
        return cls(len(a), float(a.mean()), float(a.max()), float(np.sqrt((a * a).mean())))


@dataclass(frozen=True)
class PrefillFit:
    spec: TablePrefill | PolynomialPrefill
    points: tuple[PointError, ...]
    train: ErrorSummary
    held_out: ErrorSummary | None
    notes: tuple[str, ...] = ()

    def time(self, uncached: float, cached: float = 0.0) -> float:
        return PrefillTime.from_spec(self.spec)(uncached, cached)


@dataclass(frozen=True)
class DecodeFit:
    base_s: float
    per_seq_s: float
    per_context_token_s: float
    points: tuple[PointError, ...]
    train: ErrorSummary
    held_out: ErrorSummary | None
    notes: tuple[str, ...] = ()

    def step(self, batch: float, context_tokens: float) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_context_token_s * context_tokens


def holdout_mask(n: int, every: int) -> NDArray[np.bool_]:
    """True for the held-out points: every `every`-th point (the k-th, 2k-th, ...); 0 = none."""
    if every < 0 or every == 1:
        raise CalibrationError(f"hold-out every {every}: must be 0 (none) or >= 2")
    idx = np.arange(n)
    return (idx % every == every - 1) if every else np.zeros(n, dtype=bool)


def _split(n: int, every: int, need: int, what: str, keep: NDArray[np.bool_] | None = None) -> NDArray[np.bool_]:
    held = holdout_mask(n, every)
    if keep is not None:
        held &= ~keep
    if n - int(held.sum()) < need:
        raise CalibrationError(
            f"{what}: {n} point{'s' if n != 1 else ''}, {n - int(held.sum())} left to fit after holding out every "
            f"{every}th; the fit needs at least {need} (more measurements, or --holdout-every 0)"
        )
    return held


def _relative_lstsq(a: Array, y: Array) -> tuple[Array, float]:
    """min sum(((a @ x) - y) / y)^2: least squares on relative error. (x, residual)."""
    aw = a / y[:, None]
    x, *_ = np.linalg.lstsq(aw, np.ones_like(y), rcond=None)
    r = aw @ x - 1.0
    return np.asarray(x, dtype=np.float64), float(r @ r)


def _summaries(errors: list[PointError]) -> tuple[ErrorSummary, ErrorSummary | None]:
    train = ErrorSummary.of([e.rel_error for e in errors if not e.held_out])
    assert train is not None
    return train, ErrorSummary.of([e.rel_error for e in errors if e.held_out])


# ---- prefill ---------------------------------------------------------------------------------


def _check_prefill(points: Sequence[PrefillPoint]) -> tuple[Array, Array, Array]:
    if not points:
        raise CalibrationError("prefill: no measurements")
    u = np.array([p.uncached for p in points], dtype=float)
    c = np.array([p.cached for p in points], dtype=float)
    y = np.array([p.seconds for p in points], dtype=float)
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise CalibrationError("prefill: every time must be a positive finite number of seconds")
    return u, c, y


def _range_ends(u: Array) -> NDArray[np.bool_]:
    """The shortest and longest lengths stay in the fit, so the profile spans every measured
    length and the held-out points score interpolation, where the profile is used."""
    ends: NDArray[np.bool_] = (u == u.min()) | (u == u.max())
    return ends


def table_knots(uncached: Array, max_points: int) -> Array:
    """Where the table's points go: every distinct measured length when there are at most
    `max_points` (a benchmark sweep at fixed lengths), else `max_points` of them evenly spaced in
    rank, the shortest and longest included, so that each point sits where there is data and no
    measured length needs extrapolating. (Evenly in rank over distinct lengths: a geometric sweep
    keeps its spacing, lengths that are all distinct give quantiles.)"""
    distinct = np.unique(uncached)
    if len(distinct) <= max_points:
        return distinct
    return np.unique(distinct[np.round(np.linspace(0, len(distinct) - 1, max_points)).astype(int)])


def hat_basis(xs: Array, u: Array) -> Array:
    """Rows: the weights of the table's y values in PrefillTime's interpolation at each u (the
    end segments extrapolate)."""
    n = len(xs)
    i = np.clip(np.searchsorted(xs, u, side="right"), 1, n - 1)
    x0, x1 = xs[i - 1], xs[i]
    t = (u - x0) / (x1 - x0)
    basis = np.zeros((len(u), n))
    rows = np.arange(len(u))
    basis[rows, i - 1] = 1.0 - t
    basis[rows, i] = t
    return basis


def _with_cached(a: Array, u: Array, c: Array, y: Array, notes: list[str]) -> tuple[Array, float, float]:
    """Fit `a`, plus (when the cached counts vary) a column per cached token and one per cached x
    uncached token; returns (x over a's columns, cached_token_s, cached_attention_s). A negative
    cost is not a cost: of the supports whose cached terms come out non-negative, the closest fit."""
    if np.ptp(c) > 0:
        cs, ps = float(c.max()), float((u * c).max()) or 1.0
        extra = {0: c / cs, 1: u * c / ps}
        best: tuple[float, tuple[int, ...], Array] | None = None
        for support in ((0, 1), (0,), (1,)):
            x, res = _relative_lstsq(np.column_stack([a, *(extra[k] for k in support)]), y)
            if np.all(x[a.shape[1] :] >= 0) and (best is None or res < best[0]):
                best = (res, support, x)
        if best is not None:
            terms = [0.0, 0.0]
            for k, v in zip(best[1], best[2][a.shape[1] :]):
                terms[k] = float(v) / (cs, ps)[k]
            return best[2][: a.shape[1]], terms[0], terms[1]
        notes.append("the cached-token terms came out negative; fitted without them")
    elif np.any(c > 0):
        notes.append("every point has the same cached tokens: no cached-token term can be told apart")
    x, _ = _relative_lstsq(a, y)
    return x, 0.0, 0.0


def split_overhead(spec: TablePrefill | PolynomialPrefill) -> tuple[TablePrefill | PolynomialPrefill, str | None]:
    """The curve's own time at zero uncached tokens moved into `overhead_s` (a table's first
    segment extrapolated to 0, a polynomial's constant): the same totals, the fixed part named.
    (spec, a note when there is none to move: an intercept not above 0, or a table whose points
    are not all above it.)"""
    if spec.kind == "polynomial":
        c0 = spec.coefficients[0]
        if c0 <= 0:
            return spec, f"the fitted curve's time at 0 tokens is {c0:.3g} s: no fixed overhead to name"
        return spec.model_copy(
            update={"overhead_s": spec.overhead_s + c0, "coefficients": [0.0, *spec.coefficients[1:]]}
        ), None
    (x0, y0), (x1, y1) = spec.points[0], spec.points[1]
    b = y0 - (y1 - y0) * x0 / (x1 - x0)
    if b <= 0:
        return spec, f"the fitted curve's time at 0 tokens is {b:.3g} s: no fixed overhead to name"
    if any(y <= b for _, y in spec.points):
        return spec, (
            f"the fitted curve extrapolates to {b:.3g} s at 0 tokens, above one of its points: "
            "no fixed overhead can be told apart"
        )
    return spec.model_copy(
        update={"overhead_s": spec.overhead_s + b, "points": [(x, y - b) for x, y in spec.points]}
    ), None


def _less_overhead(y: Array, overhead: float, what: str) -> Array:
    if overhead < 0:
        raise CalibrationError(f"{what}: the fixed overhead must be >= 0 s, not {overhead:g}")
    if overhead and np.any(y <= overhead):
        raise CalibrationError(
            f"{what}: a measured prefill of {float(y.min()):.4g} s is not above the fixed overhead "
            f"of {overhead:g} s (a smaller --overhead, or fit it)"
        )
    return y - overhead


def _named_overhead(
    spec: TablePrefill | PolynomialPrefill, overhead: float | None, notes: list[str]
) -> TablePrefill | PolynomialPrefill:
    if overhead is not None:
        return spec.model_copy(update={"overhead_s": overhead})
    spec, note = split_overhead(spec)
    if note:
        notes.append(note)
    return spec


def _prefill_errors(points: Sequence[PrefillPoint], held: NDArray[np.bool_], t: PrefillTime) -> list[PointError]:
    return [
        PointError(p.label, (p.uncached, p.cached), p.seconds, t(p.uncached, p.cached), bool(h))
        for p, h in zip(points, held)
    ]


def fit_prefill_table(
    points: Sequence[PrefillPoint], max_points: int = 16, holdout_every: int = 5, overhead: float | None = None
) -> PrefillFit:
    """`overhead`: None moves the fitted curve's own fixed part into overhead_s (see
    `split_overhead`); a number of seconds is taken as known, the table fitted to the rest."""
    u, c, y = _check_prefill(points)
    y = _less_overhead(y, overhead or 0.0, "prefill table")
    if max_points < 2:
        raise CalibrationError("prefill table: needs at least 2 points (--points)")
    held = _split(len(points), holdout_every, 2, "prefill table", _range_ends(u))
    tu, tc, ty = u[~held], c[~held], y[~held]
    xs = table_knots(tu, max_points)
    if len(xs) < 2:
        raise CalibrationError(
            f"prefill table: every training point has {xs[0]:g} uncached tokens; a curve needs at least two lengths"
        )
    notes: list[str] = []
    ys, cached_s, attention_s = _with_cached(hat_basis(xs, tu), tu, tc, ty, notes)
    bad = [f"{x:g}" for x, v in zip(xs, ys) if v <= 0]
    if bad:
        raise CalibrationError(
            f"prefill table: the fitted time at {', '.join(bad)} uncached tokens is not positive; "
            "too few or too noisy measurements there (fewer --points, or a polynomial)"
        )
    spec = _named_overhead(
        TablePrefill(
            kind="table",
            points=[(float(x), float(v)) for x, v in zip(xs, ys)],
            cached_token_s=cached_s,
            cached_attention_s=attention_s,
        ),
        overhead,
        notes,
    )
    errors = _prefill_errors(points, held, PrefillTime.from_spec(spec))
    train, held_out = _summaries(errors)
    return PrefillFit(spec, tuple(errors), train, held_out, tuple(notes))


def fit_prefill_polynomial(
    points: Sequence[PrefillPoint], degree: int = 2, holdout_every: int = 5, overhead: float | None = None
) -> PrefillFit:
    """`overhead` as for `fit_prefill_table` (None: the constant coefficient becomes overhead_s)."""
    u, c, y = _check_prefill(points)
    y = _less_overhead(y, overhead or 0.0, f"prefill polynomial of degree {degree}")
    if not 0 <= degree <= 6:
        raise CalibrationError(f"prefill polynomial: degree {degree} is not in 0..6")
    held = _split(len(points), holdout_every, degree + 1, f"prefill polynomial of degree {degree}", _range_ends(u))
    tu, tc, ty = u[~held], c[~held], y[~held]
    if len(np.unique(tu)) < degree + 1:
        raise CalibrationError(
            f"prefill polynomial: {len(np.unique(tu))} distinct lengths cannot fix "
            f"{degree + 1} coefficients (lower --degree)"
        )
    # Powers of u / max(u) keep the columns comparable; the coefficients are rescaled after.
    scale = float(tu.max()) or 1.0
    notes: list[str] = []
    a, cached_s, attention_s = _with_cached(np.vander(tu / scale, degree + 1, increasing=True), tu, tc, ty, notes)
    coefficients = [float(v / scale**i) for i, v in enumerate(a)]
    spec = _named_overhead(
        PolynomialPrefill(
            kind="polynomial", coefficients=coefficients, cached_token_s=cached_s, cached_attention_s=attention_s
        ),
        overhead,
        notes,
    )
    errors = _prefill_errors(points, held, PrefillTime.from_spec(spec))
    train, held_out = _summaries(errors)
    return PrefillFit(spec, tuple(errors), train, held_out, tuple(notes))


# ---- decode ----------------------------------------------------------------------------------

_DECODE_TERMS = ("base_s", "per_seq_s", "per_context_token_s")


def fit_decode(points: Sequence[DecodePoint], holdout_every: int = 5) -> DecodeFit:
    """Non-negative least squares (on relative error) of the three-term step model. With three
    unknowns the exact optimum is the best feasible unconstrained fit over the supports that
    keep base_s; a term whose input never varies (or moves with the other's) is fixed at 0."""
    if not points:
        raise CalibrationError("decode: no measurements")
    b = np.array([p.batch for p in points], dtype=float)
    ctx = np.array([p.context_tokens for p in points], dtype=float)
    y = np.array([p.seconds for p in points], dtype=float)
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise CalibrationError("decode: every step time must be a positive finite number of seconds")
    held = _split(len(points), holdout_every, 1, "decode")
    tb, tctx, ty = b[~held], ctx[~held], y[~held]
    bs, cs = float(tb.max()) or 1.0, float(tctx.max()) or 1.0
    cols = np.column_stack([np.ones_like(tb), tb / bs, tctx / cs])
    notes: list[str] = []
    free = [1, 2]
    if np.ptp(tb) == 0:
        free.remove(1)
        notes.append(f"batch size never varies ({tb[0]:g}): per_seq_s fixed at 0, base_s absorbs it")
    if np.ptp(tctx) == 0:
        free.remove(2)
        notes.append(f"context never varies ({tctx[0]:g} tokens): per_context_token_s fixed at 0")
    if len(free) == 2 and np.linalg.matrix_rank(cols) < 3:
        free.remove(2)
        notes.append(
            "context grows in step with the batch size: per_context_token_s fixed at 0, "
            "per_seq_s absorbs it (vary the prompt lengths to separate them)"
        )
    best: tuple[float, list[int], Array] | None = None
    for k in range(len(free) + 1):
        for sub in combinations(free, k):
            support = [0, *sub]
            x, res = _relative_lstsq(cols[:, support], ty)
            if x[0] > 0 and np.all(x >= 0) and (best is None or res < best[0]):
                best = (res, support, x)
    if best is None:
        raise CalibrationError("decode: no step model with base_s > 0 and non-negative terms fits these points")
    coef = [0.0, 0.0, 0.0]
    for col, v in zip(best[1], best[2]):
        coef[col] = float(v) / (1.0, bs, cs)[col]
    dropped = [_DECODE_TERMS[i] for i in free if i not in best[1]]
    if dropped:
        notes.append(f"{', '.join(dropped)} would come out negative; fixed at 0")
    fit = DecodeFit(coef[0], coef[1], coef[2], (), ErrorSummary(0, 0, 0, 0), None, tuple(notes))
    errors = [
        PointError(p.label, (p.batch, p.context_tokens), p.seconds, fit.step(p.batch, p.context_tokens), bool(h))
        for p, h in zip(points, held)
    ]
    train, held_out = _summaries(errors)
    return DecodeFit(coef[0], coef[1], coef[2], tuple(errors), train, held_out, tuple(notes))


# ---- per-request benchmark records -> points --------------------------------------------------


@dataclass(frozen=True)
class RequestRecord:
    """One successful request as a benchmark client saw it (seconds, tokens)."""

    source: str  # "file:line" (or "file:line:index"), for labels and messages
    run: str  # requests of one run shared a server and a clock
    prompt_tokens: int
    cached_tokens: int | None  # None: the export does not say (taken as 0)
    output_tokens: int
    ttft_s: float
    latency_s: float  # send to last token
    start_s: float | None  # send time on the run's clock; None: the export has none
    concurrency: int | None = None  # the run's fixed number of requests in flight, if stated


@dataclass(frozen=True)
class FirstStep:
    """A request with nothing else in flight until its first token, and the step that produced it."""

    record: RequestRecord
    batch: float
    context_tokens: float


@dataclass(frozen=True)
class RequestAnalysis:
    decode: tuple[DecodePoint, ...]
    first_steps: tuple[FirstStep, ...]
    notes: tuple[str, ...]


def _generated_at(t: Array, d: Array, e: Array, out: Array) -> Array:
    """Tokens a request has produced by time t in its decode window [d, e]: 1 at d, all at e."""
    span = np.where(e > d, e - d, 1.0)
    return 1.0 + (out - 1.0) * np.clip((t - d) / span, 0.0, 1.0)


def _analyse_timed(recs: list[RequestRecord]) -> tuple[list[DecodePoint], list[FirstStep]]:
    s = np.array([r.start_s for r in recs], dtype=float)
    d = s + np.array([r.ttft_s for r in recs], dtype=float)
    e = s + np.array([r.latency_s for r in recs], dtype=float)
    p = np.array([r.prompt_tokens for r in recs], dtype=float)
    o = np.array([r.output_tokens for r in recs], dtype=float)
    n = len(recs)
    decode: list[DecodePoint] = []
    first: list[FirstStep] = []
    chunk = max(1, _BLOCK_CELLS // n)
    for lo in range(0, n, chunk):
        rows = np.arange(lo, min(lo + chunk, n))
        di, ei = d[rows, None], e[rows, None]
        # Decode windows: time-averaged batch and context over each request's own window.
        a = np.maximum(di, d[None, :])
        b = np.minimum(ei, e[None, :])
        ov = np.clip(b - a, 0.0, None)
        mid = (a + b) / 2
        held = ov * (p[None, :] + _generated_at(mid, d[None, :], e[None, :], o[None, :]))
        # Another request in flight before this one's first token: it queued behind that one's
        # prefill, or waited for a running decode step to end, so its TTFT is more than one
        # prefill plus one step of its own.
        busy = np.clip(np.minimum(di, e[None, :]) - np.maximum(s[rows, None], s[None, :]), 0.0, None)
        busy[np.arange(len(rows)), rows] = 0.0
        for k, i in enumerate(rows):
            r = recs[i]
            window = e[i] - d[i]
            if r.output_tokens >= 2 and window > 0:
                decode.append(
                    DecodePoint(
                        float(ov[k].sum() / window),
                        float(held[k].sum() / window),
                        float(window / (r.output_tokens - 1)),
                        r.source,
                    )
                )
            if not np.any(busy[k] > _OVERLAP_TOLERANCE_S):
                first.append(FirstStep(r, 1.0, float(p[i])))
    return decode, first


def _analyse_fixed(recs: list[RequestRecord], n: int) -> tuple[list[DecodePoint], list[FirstStep]]:
    """No timestamps (or a stated concurrency): every request decoded beside n - 1 others holding
    the run's mean context; only at n = 1 is TTFT free of queueing."""
    mean_ctx = float(np.mean([r.prompt_tokens + (r.output_tokens + 1) / 2 for r in recs]))
    decode = [
        DecodePoint(
            float(n),
            r.prompt_tokens + (r.output_tokens + 1) / 2 + (n - 1) * mean_ctx,
            (r.latency_s - r.ttft_s) / (r.output_tokens - 1),
            r.source,
        )
        for r in recs
        if r.output_tokens >= 2 and r.latency_s > r.ttft_s
    ]
    first = [FirstStep(r, 1.0, float(r.prompt_tokens)) for r in recs] if n == 1 else []
    return decode, first


def analyse_requests(records: Sequence[RequestRecord], concurrency: int | None = None) -> RequestAnalysis:
    """Decode points of every request with two or more output tokens; the requests fit for a
    prefill point. `concurrency` (requests in flight throughout) replaces what the timestamps
    tell; without either, a run cannot be used."""
    runs: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        runs[r.run].append(r)
    decode: list[DecodePoint] = []
    first: list[FirstStep] = []
    notes: list[str] = []
    for run, recs in runs.items():
        n = concurrency or (None if all(r.start_s is not None for r in recs) else recs[0].concurrency)
        if n is None and any(r.start_s is None for r in recs):
            raise CalibrationError(
                f"{run}: the records have no send times and the run states no fixed concurrency, so "
                "the batch size in force is unknown: pass --concurrency N"
            )
        dp, fs = _analyse_fixed(recs, n) if n is not None else _analyse_timed(recs)
        decode += dp
        first += fs
        how = f"concurrency {n} as stated" if n is not None else "batch sizes from the timestamps"
        notes.append(
            f"{run}: {len(recs)} requests, {len(dp)} decode points, {len(fs)} with a queue-free prefill ({how})"
        )
    return RequestAnalysis(tuple(decode), tuple(first), tuple(notes))


def prefill_points(
    first_steps: Sequence[FirstStep], step: Callable[[float, float], float] | None
) -> tuple[list[PrefillPoint], list[str]]:
    """Prefill = TTFT - the first decode step (`step`, e.g. the decode fit; None: nothing taken
    off); the requests of equal (uncached, cached) lengths become one point, their median."""
    groups: dict[tuple[int, int], list[tuple[float, str]]] = defaultdict(list)
    dropped = 0
    for f in first_steps:
        r = f.record
        t = r.ttft_s - (step(f.batch, f.context_tokens) if step is not None else 0.0)
        if t <= 0:
            dropped += 1
            continue
        cached = r.cached_tokens or 0
        groups[(r.prompt_tokens - cached, cached)].append((t, r.source))
    notes = [f"{dropped} request(s) left out: TTFT not above the modelled first step"] if dropped else []
    points = []
    for (u, c), vals in sorted(groups.items()):
        times = [v[0] for v in vals]
        label = vals[0][1] if len(vals) == 1 else f"{len(vals)} requests, first {vals[0][1]}"
        points.append(PrefillPoint(float(u), float(c), float(np.median(times)), label, len(vals)))
    return points, notes
