"""Hardware profile schema: an instance's prefill and decode service times, its scheduler, and where the
figures come from. A scenario names one of these per cluster (`testbed.core.schema.scenario`).

Pure data and validation; all figures are in paper units (seconds, bytes, tokens).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Every prefill curve has the same terms on top of its length-dependent part T(l):
#
#   T(uncached l, cached c) = overhead_s + T(l) + c * (cached_token_s + cached_attention_s * l)
#
# - overhead_s: a fixed time per prefill whatever its length (scheduling, launches, the serving
#   framework's own work). Profiles back-solved from the paper carry ~0.3-0.45 s of it; measured
#   kernels carry none (docs/guides/profiles.md).
# - cached_token_s: per cached prefix token (reading its KV back).
# - cached_attention_s: per cached token per uncached token: the new tokens' attention over the
#   cached prefix, which grows with both.


# - pass_tokens (optional): a batched forward pass's token-bound time over N uncached tokens in all,
#   (N, seconds) points: short prompts batched, where the GEMMs and MoE grow with the pass's total
#   and attention is negligible. With it a batched pass costs pass_tokens(sum of its chunks) plus
#   each chunk's attention, T(l) - pass_tokens(l), over its own context; without it, the pass pays
#   the curve's fixed part once and each chunk its increment on T
#   (`testbed.core.engine.servicetime.PrefillTime.pass_time`). A whole prompt alone takes T either way.


def _table_points(v: list[tuple[float, float]]) -> list[tuple[float, float]]:
    xs = [p[0] for p in v]
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError("points must have strictly increasing token counts")
    if any(p[1] <= 0 or p[0] < 0 for p in v):
        raise ValueError("points must have non-negative tokens and positive seconds")
    return v


class TablePrefill(_Strict):
    """Prefill time interpolated piecewise-linearly over uncached tokens (extrapolated at the ends)."""

    kind: Literal["table"]
    points: list[tuple[float, float]] = Field(min_length=2)
    overhead_s: float = Field(default=0.0, ge=0)
    cached_token_s: float = Field(default=0.0, ge=0)
    cached_attention_s: float = Field(default=0.0, ge=0)
    pass_tokens: list[tuple[float, float]] | None = Field(default=None, min_length=2)  # batched pass, see above

    @field_validator("points", "pass_tokens")
    @classmethod
    def _sorted(cls, v: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
        return None if v is None else _table_points(v)


class PolynomialPrefill(_Strict):
    """Prefill time = sum(c_i * l**i) over uncached tokens l, plus the terms above."""

    kind: Literal["polynomial"]
    coefficients: list[float] = Field(min_length=1)
    overhead_s: float = Field(default=0.0, ge=0)
    cached_token_s: float = Field(default=0.0, ge=0)
    cached_attention_s: float = Field(default=0.0, ge=0)
    pass_tokens: list[tuple[float, float]] | None = Field(default=None, min_length=2)  # batched pass, see above

    @field_validator("pass_tokens")
    @classmethod
    def _sorted(cls, v: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
        return None if v is None else _table_points(v)


PrefillSpec = Annotated[TablePrefill | PolynomialPrefill, Field(discriminator="kind")]


class DecodeSpec(_Strict):
    """Decode step time = base_s + per_seq_s * batch + per_context_token_s * sum(context)."""

    base_s: float = Field(gt=0)
    per_seq_s: float = Field(default=0.0, ge=0)
    per_context_token_s: float = Field(default=0.0, ge=0)
    bs_max: int = Field(gt=0)
    kv_capacity_bytes: int = Field(gt=0)


Scalar = str | int | float | bool


class Provenance(_Strict):
    """Where a hardware profile's figures come from, kept in the file beside them (and so in
    every run's resolved scenario). `source` names the kind: e.g. `paper` (back-solved from the
    paper's tables), `aiconfigurator` (NVIDIA's measured-kernel database), `calibrate` (fitted
    to a real server's measurements)."""

    source: str = Field(min_length=1)  # paper | aiconfigurator | calibrate | ...
    tool: str | None = None  # the program and version that wrote the figures
    model: str | None = None  # the model as the source names it
    system: str | None = None  # the GPU system as the source names it
    backend: str | None = None  # the serving framework the source timed (sglang, vllm, trtllm)
    backend_version: str | None = None  # that framework's version as the source names it
    database_mode: str | None = None  # aiconfigurator's database mode (e.g. SILICON: measured kernels)
    parallel: dict[str, int] = {}  # tp, pp, moe_tp, moe_ep, attention_dp ...
    quantization: dict[str, str] = {}  # weights, moe, kv_cache, attention ...
    fit: dict[str, Scalar] = {}  # how well the profile's terms follow the source
    command: str | None = None  # the command that wrote the profile
    notes: list[str] = []  # caveats in words (fit errors, choices made)


class SchedulerSpec(_Strict):
    """How an instance schedules its forward passes (`testbed.core.engine.prefill_batch`).

    `fcfs`: one prompt per pass, whole, first come first served (the paper's throughput model;
    the default). `vllm`: a pass fills a token budget (vLLM's max_num_batched_tokens), carries up
    to `max_num_seqs` prompts, continues partly computed prompts first and chunks long ones
    across passes when `chunked_prefill` is on; its decode instances hold KV in blocks and preempt
    by recompute."""

    kind: Literal["fcfs", "vllm"] = "fcfs"  # fcfs: one whole prompt a pass (the paper's); vllm: batched passes
    max_num_batched_tokens: int = Field(default=8192, gt=0)  # token budget of one prefill pass (vllm)
    max_num_seqs: int = Field(default=256, gt=0)  # prompts in one prefill pass at most (vllm)
    chunked_prefill: bool = True  # cut the prompt that meets the end of the budget across passes (vllm)
    # Decode (`testbed.core.engine.decode_blocks`): KV held in blocks of `block_size` tokens,
    # `kv_blocks` of them (default: the instance's kv_capacity_bytes at the model's
    # full-attention bytes per token), preemption by recompute when they run out.
    block_size: int = Field(default=16, gt=0)
    kv_blocks: int | None = Field(default=None, gt=0)  # decode KV memory in blocks (vllm; default: from bytes)


class HardwareSpec(_Strict):
    prefill: PrefillSpec
    decode: DecodeSpec | None = None
    provenance: Provenance | None = None
    scheduler: SchedulerSpec = SchedulerSpec()
