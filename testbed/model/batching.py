"""A batching prefill instance's capacity in the analytical model.

The vLLM-like scheduler (`testbed.core.engine.prefill_batch`) runs forward passes that carry k
prompts (fractional with chunked prefill: a long prompt spans 1/k passes) and N uncached tokens;
saturated, its passes are full: with chunked prefill N = min(B, S * L) for prompts of L tokens (B
the token budget, S the prompts a pass at most), without it k = min(floor(B / L), S), at least one
whole prompt, and N = k * L. One prompt then occupies the instance for one k-th of a pass's shared
cost plus its own:

- priced on the curve alone (`PrefillTime.pass_time` without `pass_tokens`): the pass pays the
  fixed part F (the overhead and the curve's intercept) once, so T(L) - F + F / k;
- with the hardware's `pass_tokens` P(N) (a batched pass's token-bound time): the overhead and
  P(N) are shared, the attention T(L) - P(L) is the prompt's own: (overhead + P(N)) / k + T(L) - P(L).

FCFS (one whole prompt a pass, the paper's) is T(L) itself, so Table 6 is unchanged. This is the
capacity at saturation (what Theta means); a lone prompt on an idle instance still takes T(L),
which is what the model's TTFT uses.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from testbed.core.engine.prefill_batch import BatchPolicy
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.hardware import SchedulerSpec

FloatArray = npt.NDArray[np.float64]


def pass_fixed_seconds(pt: PrefillTime) -> float:
    """F: what a forward pass costs whatever it carries (the overhead and the curve's intercept)."""
    return pt.overhead_s + max(pt.fixed_time() - pt.overhead_s, 0.0)


def full_pass(tokens: FloatArray, batch: BatchPolicy) -> tuple[FloatArray, FloatArray]:
    """(k, N): the prompts (fractional when chunked) and the uncached tokens of a full pass of
    prompts of `tokens` each."""
    tokens = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
    if batch.chunked:
        n = np.minimum(float(batch.token_budget), batch.max_seqs * tokens)
        return n / tokens, n
    k = np.maximum(np.minimum(np.floor(batch.token_budget / tokens), batch.max_seqs), 1.0)
    return k, k * tokens


def _table(xs: tuple[float, ...], ys: tuple[float, ...], v: FloatArray) -> FloatArray:
    """Vectorised `servicetime.table_time` (same extrapolation and floor)."""
    x, y = np.asarray(xs), np.asarray(ys)
    i = np.clip(np.searchsorted(x, v, side="right"), 1, len(x) - 1)
    out: FloatArray = np.maximum(y[i - 1] + (y[i] - y[i - 1]) * (v - x[i - 1]) / (x[i] - x[i - 1]), 1e-6)
    return out


def batching_adjustment(pt: PrefillTime, tokens: FloatArray, batch: BatchPolicy | None) -> FloatArray:
    """What batching adds to (negative: saves from) a prompt's single-prompt time overhead + T(L)
    in instance-seconds at saturation; zero for FCFS."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if batch is None:
        return np.zeros_like(tokens)
    k, n = full_pass(tokens, batch)
    if pt.pass_xs:
        shared = (pt.overhead_s + _table(pt.pass_xs, pt.pass_ys, n)) / k
        split: FloatArray = shared - pt.overhead_s - _table(pt.pass_xs, pt.pass_ys, tokens)
        return split
    out: FloatArray = pass_fixed_seconds(pt) * (1.0 / k - 1.0)
    return out


def scheduler_text(spec: SchedulerSpec) -> str:
    """How a plan or a model figure names the scheduler it assumed."""
    if spec.kind == "fcfs":
        return "fcfs (one whole prompt a pass)"
    chunked = "chunked" if spec.chunked_prefill else "whole prompts"
    return f"vllm (token budget {spec.max_num_batched_tokens}, at most {spec.max_num_seqs} prompts a pass, {chunked})"
