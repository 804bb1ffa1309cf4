"""A batching prefill instance's capacity in the analytical model.

The vLLM-like scheduler (`testbed.core.engine.prefill_batch`) pays the pass's fixed part F (the
overhead and the curve's intercept, `PrefillTime.pass_time`) once per forward pass, however many
prompts share it, and a chunk costs its increment on the single-prompt curve. Saturated, its
passes are full, so one prompt of L uncached tokens occupies the instance for

    T(L) - F + F * share(L)

where share(L) is the prompt's part of the passes it rides in: with chunked prefill, the token
budget B is filled to the brim, so share = max(L / B, 1 / S) (S: prompts in a pass at most; a
prompt longer than B spans L / B passes, each paying F); without it, prompts go whole and at most
min(floor(B / L), S) fit a pass, so share = 1 / that (at least one pass). The FCFS scheduler (one
whole prompt a pass, the paper's) has share 1: T(L) itself, so Table 6 is unchanged.

This is the capacity at saturation (what Theta means); a lone prompt on an idle instance still
takes T(L), which is what the model's TTFT uses.
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


def pass_share(tokens: FloatArray, batch: BatchPolicy) -> FloatArray:
    """The part of the passes a prompt of `tokens` uncached tokens rides in, at saturation."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if batch.chunked:
        out: FloatArray = np.maximum(tokens / batch.token_budget, 1.0 / batch.max_seqs)
        return out
    fit = np.minimum(np.floor(batch.token_budget / np.maximum(tokens, 1.0)), batch.max_seqs)
    whole: FloatArray = 1.0 / np.maximum(fit, 1.0)
    return whole


def batching_adjustment(pt: PrefillTime, tokens: FloatArray, batch: BatchPolicy | None) -> FloatArray:
    """What batching adds to (negative: saves from) a prompt's single-prompt time T(L) in
    instance-seconds at saturation: F * (share - 1); zero for FCFS."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if batch is None:
        return np.zeros_like(tokens)
    out: FloatArray = pass_fixed_seconds(pt) * (pass_share(tokens, batch) - 1.0)
    return out


def scheduler_text(spec: SchedulerSpec) -> str:
    """How a plan or a model figure names the scheduler it assumed."""
    if spec.kind == "fcfs":
        return "fcfs (one whole prompt a pass)"
    chunked = "chunked" if spec.chunked_prefill else "whole prompts"
    return f"vllm (token budget {spec.max_num_batched_tokens}, at most {spec.max_num_seqs} prompts a pass, {chunked})"
