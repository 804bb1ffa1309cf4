"""Generated traces.

`synthetic_trace` is the paper's workload (Poisson arrivals, truncated log-normal input, fixed
output, no prefix reuse). `synth_with_prefixes` is a multi-turn, conversation-like generator
whose later turns share the earlier turns' prefix blocks, for exercising prefix caches.
Both are deterministic for a given seed (numpy's PCG64 via `default_rng`), and both can replace
Poisson arrivals by a burstier or smoother process of a given inter-arrival coefficient of
variation (`arrival_times`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from testbed.core.schema.scenario import LengthDist, WorkloadSpec
from testbed.traces.types import Trace, TraceRequest

DEFAULT_BLOCK_TOKENS = 512


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def truncated_lognormal_mean(dist: LengthDist) -> float:
    """E[X | min <= X <= max] for X ~ LogNormal(mu, sigma), in closed form.

    The paper's (9.90, 1.00, [128, 131072]) gives ~27.5K tokens.
    """
    mu, s = dist.mu, dist.sigma
    la, lb = math.log(dist.min), math.log(dist.max)
    mass = _phi((lb - mu) / s) - _phi((la - mu) / s)
    if mass <= 0.0:
        raise ValueError(f"log-normal(mu={mu}, sigma={s}) has no mass in [{dist.min}, {dist.max}]")
    upper = _phi((lb - mu - s * s) / s) - _phi((la - mu - s * s) / s)
    return math.exp(mu + s * s / 2.0) * upper / mass


def sample_lengths(rng: np.random.Generator, n: int, dist: LengthDist) -> npt.NDArray[np.int64]:
    """`n` token counts from LogNormal(mu, sigma) truncated to [min, max] by rejection: draws
    outside the bounds are redrawn (not clipped, which would pile mass on the bounds)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # Closed-form mass guards against looping forever on a window the distribution never hits.
    mass = _phi((math.log(dist.max) - dist.mu) / dist.sigma) - _phi((math.log(dist.min) - dist.mu) / dist.sigma)
    if mass < 1e-6:
        raise ValueError(
            f"log-normal(mu={dist.mu}, sigma={dist.sigma}) has too little mass ({mass:.2g}) in [{dist.min}, {dist.max}]"
        )
    out = np.empty(n, dtype=np.float64)
    filled = 0
    while filled < n:
        need = n - filled
        x = rng.lognormal(dist.mu, dist.sigma, size=need)
        x = x[(x >= dist.min) & (x <= dist.max)]
        out[filled : filled + x.size] = x
        filled += x.size
    # Integer bounds, so rounding an accepted draw cannot leave [min, max].
    return np.rint(out).astype(np.int64)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> npt.NDArray[np.float64]:
    """`n` arrival times (s) of a Poisson process at `rate` req/s, the first at 0."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive finite number, got {rate}")
    if n <= 0:
        return np.zeros(0, dtype=np.float64)
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


# Bursts of `arrival_times` above CV 1: the rate during a burst over the mean rate.
DEFAULT_BURST_PEAK = 4.0


def arrival_times(
    rng: np.random.Generator, n: int, rate: float, cv: float = 1.0, peak: float = DEFAULT_BURST_PEAK
) -> npt.NDArray[np.float64]:
    """`n` arrival times (s, the first at 0) at mean `rate` whose gaps have coefficient of
    variation `cv`:

    - cv = 1: Poisson (`poisson_arrivals`, the same draws; other CVs take those draws too, so
      what a generator draws after the times is the same at every CV);
    - cv < 1: a gamma renewal process (shape 1/cv^2), smoother than Poisson;
    - cv > 1: an interrupted Poisson process: bursts at `peak` times the mean rate, each lasting an
      exponential time, separated by exponential silences. Its gaps are independent and
      hyperexponential with SCV 1 + 2 lambda_on omega_on / (omega_on + omega_off)^2 (omega: the rates
      of leaving each phase), which with the burst share f = 1 / peak fixes the mean cycle
      on + off = (cv^2 - 1) / (2 rate (1 - f)^2): bursts are short at low CV, long at high CV
      (cv 3 at 3.3 req/s and peak 4: ~0.54 s bursts every ~2.2 s; cv 13 at 1 req/s and peak 12:
      ~8 s bursts every ~100 s).
    """
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"the arrival CV must be a positive finite number, got {cv}")
    if cv != 1.0 and cv > 1.0 and not (peak > 1 and math.isfinite(peak)):
        raise ValueError(f"the burst peak must be a finite rate ratio > 1, got {peak}")
    # The Poisson draws are taken whatever the CV, so the draws after them (lengths, sessions)
    # are the same at every CV; another CV's times come from a child stream.
    poisson = poisson_arrivals(rng, n, rate)
    if cv == 1.0 or n <= 0:
        return poisson
    sub = rng.spawn(1)[0]
    if cv < 1.0:
        k = 1.0 / (cv * cv)
        gaps = sub.gamma(k, 1.0 / (k * rate), size=n - 1)
        return np.concatenate(([0.0], np.cumsum(gaps)))
    f = 1.0 / peak
    cycle = (cv * cv - 1.0) / (2.0 * rate * (1.0 - f) ** 2)
    on_s, off_s, on_rate = f * cycle, (1.0 - f) * cycle, rate * peak
    chunks: list[npt.NDArray[np.float64]] = []
    got, t0 = 0, 0.0
    while got < n:
        # Enough cycles for the rest on average, and some; Poisson counts in each burst, the
        # arrivals of a burst uniform within it (a Poisson process given its count).
        m = int((n - got) / (on_rate * on_s) * 1.2) + 16
        on = sub.exponential(on_s, size=m)
        off = sub.exponential(off_s, size=m)
        starts = t0 + np.concatenate(([0.0], np.cumsum(on + off)[:-1]))
        counts = sub.poisson(on_rate * on)
        at = np.repeat(starts, counts) + sub.random(int(counts.sum())) * np.repeat(on, counts)
        chunks.append(np.sort(at))
        got += at.size
        t0 = float(starts[-1] + on[-1] + off[-1])
    times = np.concatenate(chunks)[:n]
    out: npt.NDArray[np.float64] = times - times[0]
    return out


def _blocks(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def synthetic_trace(
    spec: WorkloadSpec,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    *,
    arrival_cv: float = 1.0,
    burst_peak: float = DEFAULT_BURST_PEAK,
) -> Trace:
    """The paper's synthetic workload for `spec` (arrivals Poisson unless `arrival_cv` says
    otherwise: `arrival_times`).

    Draw order (fixed, for reproducibility): inter-arrival gaps, then input lengths. Every
    request gets fresh block hashes (ceil(input / block_tokens) of them), so the trace states
    "no prefix reuse" explicitly and round-trips through the Mooncake format.
    """
    s = SyntheticStream(spec, block_tokens, arrival_cv=arrival_cv, burst_peak=burst_peak)
    return Trace(list(s), source=s.source, block_tokens=block_tokens)


class SyntheticStream:
    """`synthetic_trace`'s requests, made one at a time as they are iterated: what `trace synth`
    writes of a trace too long to hold (ten million requests held took ~27 GB). The draws are
    taken up front (three numbers a request), so every pass gives the same requests."""

    def __init__(
        self,
        spec: WorkloadSpec,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        *,
        arrival_cv: float = 1.0,
        burst_peak: float = DEFAULT_BURST_PEAK,
    ) -> None:
        rng = np.random.default_rng(spec.seed)
        self.times = arrival_times(rng, spec.requests, spec.rate, arrival_cv, burst_peak)
        self.lengths = sample_lengths(rng, spec.requests, spec.input)
        self.spec, self.block_tokens = spec, block_tokens
        d = spec.input
        self.source = (
            f"synthetic(lognormal mu={d.mu} sigma={d.sigma} [{d.min}, {d.max}], output={spec.output_tokens}, "
            f"rate={spec.rate}, requests={spec.requests}, seed={spec.seed}{_arrivals_note(arrival_cv, burst_peak)})"
        )

    def __len__(self) -> int:
        return self.spec.requests

    def __iter__(self) -> Iterator[TraceRequest]:
        out, block = self.spec.output_tokens, self.block_tokens
        next_id, i = 0, 0
        step = 1 << 16  # numbers become Python objects a slice at a time
        for lo in range(0, len(self.times), step):
            for t, inp in zip(self.times[lo : lo + step].tolist(), self.lengths[lo : lo + step].tolist()):
                i += 1
                nb = _blocks(inp, block)
                yield TraceRequest(f"synthetic-{i}", t, inp, out, tuple(range(next_id, next_id + nb)))
                next_id += nb

    @property
    def duration(self) -> float:
        """As `Trace.duration`."""
        return float(self.times[-1] - self.times[0]) if len(self.times) else 0.0


# Defaults in the spirit of Mooncake's conversation trace: inputs mostly 1K-60K tokens (mean
# ~13-15K), outputs 50-1000, context growing turn by turn; ~2/3 of blocks repeat earlier ones.
FIRST_TURN = LengthDist(mu=8.6, sigma=1.1, min=128, max=60000)
FOLLOW_UP = LengthDist(mu=6.5, sigma=1.2, min=16, max=16384)
OUTPUT = LengthDist(mu=5.9, sigma=0.6, min=50, max=1000)

# Named shapes of `synth_with_prefixes` (`testbed trace synth --prefix-reuse PROFILE`):
# - chat: the defaults above, short conversations (~3 turns) of mostly short prompts;
# - agent: long-context agent sessions (~10 turns): a 6K-token tool/system prompt shared by
#   every session of one of 4 agents, a task of ~8K, then tool results of ~2K per turn, so
#   contexts grow to 30-120K tokens with ~90% of every prompt cached from the turn before.
REUSE_PROFILES: dict[str, dict[str, object]] = {
    "chat": {},
    "agent": {
        "turns_per_session": 10,
        "concurrency": 12,
        "system_prompts": 4,
        "system_prompt_tokens": 6144,
        "first_turn": LengthDist(mu=8.8, sigma=0.8, min=512, max=40000),
        "follow_up": LengthDist(mu=7.6, sigma=0.9, min=64, max=16384),
        "output": LengthDist(mu=5.5, sigma=0.6, min=32, max=1024),
        "think_median_s": 0.3,
    },
}


def _arrivals_note(cv: float, peak: float) -> str:
    if cv == 1.0:
        return ""
    return f", arrival_cv={cv:g}" + (f", burst_peak={peak:g}" if cv > 1.0 else "")


def synth_profile(
    name: str, n: int, rate: float, seed: int, arrival_cv: float = 1.0, burst_peak: float = DEFAULT_BURST_PEAK
) -> Trace:
    """`synth_with_prefixes` with one of REUSE_PROFILES."""
    try:
        kw = dict(REUSE_PROFILES[name])
    except KeyError:
        raise ValueError(f"unknown prefix-reuse profile {name!r}; known: {', '.join(REUSE_PROFILES)}") from None
    per = kw.pop("turns_per_session", None)
    if isinstance(per, int):
        kw["sessions"] = max(1, n // per)
    return synth_with_prefixes(n, rate, seed, arrival_cv=arrival_cv, burst_peak=burst_peak, **kw)  # type: ignore[arg-type]


def synth_with_prefixes(
    n: int,
    rate: float,
    seed: int,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    *,
    sessions: int | None = None,
    concurrency: int = 16,
    system_prompts: int = 3,
    system_prompt_tokens: int = 1024,
    first_turn: LengthDist = FIRST_TURN,
    follow_up: LengthDist = FOLLOW_UP,
    output: LengthDist = OUTPUT,
    max_input: int = 131072,
    arrival_cv: float = 1.0,
    burst_peak: float = DEFAULT_BURST_PEAK,
    think_median_s: float | None = None,
) -> Trace:
    """Multi-turn conversations with prefix reuse, `n` requests arriving as Poisson at `rate`
    (or as `arrival_times` of `arrival_cv` and `burst_peak`).

    - `sessions` conversations (default n / 3, i.e. ~3 turns each, skewed: many have one turn,
      a few many); at most `concurrency` are open at once and each arrival goes to a random open
      one, so a conversation's turns are spread over a bounded stretch of time.
    - Each conversation starts from one of `system_prompts` shared system prompts of
      `system_prompt_tokens` tokens; its full blocks carry the same hashes in every session.
    - Turn 1 input = system prompt + a `first_turn` message; turn k+1 input = turn k input +
      turn k output + a `follow_up` message. Turn k+1 reuses the hashes of turn k's *full*
      input blocks; the rest (the partial tail block, now extended, and new text) get new ids.
    - A turn that would exceed `max_input` starts the conversation afresh (as users do).
    - len(hash_ids) == ceil(input_tokens / block_tokens) for every request.
    - Every request states its session (`session_id`; a restarted conversation is a new one) and
      the turn it follows (`parent_id`); with `think_median_s`, follow-ups also state a think time,
      log-normal about that median (sigma 0.6) and under 1 s (tool calls: an agent answers at once).
      Those draws come after all others, so the rest of the trace is the same with or without.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    if concurrency < 1 or system_prompts < 1:
        raise ValueError("concurrency and system_prompts must be >= 1")
    if not 0 <= system_prompt_tokens < max_input:
        raise ValueError(f"system_prompt_tokens must be in [0, max_input), got {system_prompt_tokens}")
    n_sessions = max(1, round(n / 3)) if sessions is None else sessions
    if n > 0 and not 1 <= n_sessions <= n:
        raise ValueError(f"sessions must be in [1, n={n}], got {n_sessions}")

    rng = np.random.default_rng(seed)
    times = arrival_times(rng, n, rate, arrival_cv, burst_peak)
    if n == 0:
        return Trace([], source=f"synth_with_prefixes(n=0, seed={seed})", block_tokens=block_tokens)
    weights = rng.exponential(size=n_sessions)
    turns = 1 + rng.multinomial(n - n_sessions, weights / weights.sum())
    prompt_of = rng.integers(0, system_prompts, size=n_sessions)
    # Draw per request up front (vectorised); request i uses first[i] or follow[i], never both.
    first = sample_lengths(rng, n, first_turn)
    follow = sample_lengths(rng, n, follow_up)
    outs = sample_lengths(rng, n, output)
    picks = rng.random(n)

    sys_full = system_prompt_tokens // block_tokens
    prompt_ids = [tuple(range(p * sys_full, (p + 1) * sys_full)) for p in range(system_prompts)]
    next_id = system_prompts * sys_full

    # Per session: context length before the next user message (previous input + its output),
    # hashes of the previous input's full blocks (the reusable prefix), and turns taken.
    ctx = [0] * n_sessions
    shared: list[tuple[int, ...]] = [()] * n_sessions
    taken = [0] * n_sessions
    left = [int(t) for t in turns]
    pending = deque(range(n_sessions))
    open_: list[int] = []
    reqs: list[TraceRequest] = []
    prev_id = [""] * n_sessions  # the session's latest request: the next turn's parent
    name = [f"s{s}" for s in range(n_sessions)]
    restarts = [0] * n_sessions
    for i in range(n):
        while len(open_) < concurrency and pending:
            open_.append(pending.popleft())
        k = int(picks[i] * len(open_))
        s = open_[k]
        fresh = taken[s] == 0
        inp = ctx[s] + int(follow[i])
        if not fresh and inp > max_input:
            fresh = True
        if fresh:
            shared[s] = prompt_ids[int(prompt_of[s])]
            inp = system_prompt_tokens + int(first[i])
            if taken[s]:  # a conversation begun afresh: a session of its own
                restarts[s] += 1
                name[s] = f"s{s}-r{restarts[s]}"
            prev_id[s] = ""
        inp = min(inp, max_input)
        keep = shared[s]
        new = _blocks(inp, block_tokens) - len(keep)
        ids = keep + tuple(range(next_id, next_id + new))
        next_id += new
        taken[s] += 1
        rid = f"s{s}-t{taken[s]}"
        reqs.append(TraceRequest(rid, float(times[i]), inp, int(outs[i]), ids, name[s], prev_id[s]))
        prev_id[s] = rid
        shared[s] = ids[: inp // block_tokens]
        ctx[s] = inp + int(outs[i])
        left[s] -= 1
        if left[s] == 0:
            # Swap-remove: O(1), and deterministic since the pick is by index.
            open_[k] = open_[-1]
            open_.pop()
    if think_median_s is not None:
        thinks = np.minimum(rng.lognormal(math.log(think_median_s), 0.6, size=n), 0.999)
        reqs = [r if not r.parent_id else dataclasses.replace(r, think_s=float(thinks[i])) for i, r in enumerate(reqs)]
    source = (
        f"synth_with_prefixes(n={n}, rate={rate}, seed={seed}, sessions={n_sessions}"
        f"{_arrivals_note(arrival_cv, burst_peak)})"
    )
    return Trace(reqs, source=source, block_tokens=block_tokens)
