"""A vLLM-like prefill scheduler (I/O-free): what one forward pass computes.

A pass fills a token budget (`max_num_batched_tokens`) with at most `max_num_seqs` prompts:
first the prompts an earlier pass left partly computed, oldest first, then waiting prompts first
come first served. With chunked prefill on, the prompt that meets the end of the budget gets the
tokens left and continues in the next pass; with it off, a prompt goes whole or waits (a prompt
longer than the whole budget goes alone). A prompt whose cached prefix is still being moved in
from another cluster is skipped until it is here, as vLLM's KV connector leaves a request waiting
for its remote KV out of the pass; it does not hold the instance.

The pass's time is the hardware's batched step time (`PrefillTime.pass_time`) times the slowdown
in force when it starts. `testbed.core.engine.prefill_loop.PrefillLoop` runs these passes; the
KV of a prompt streams layer by layer over its last pass (`last_pass_layer_ready`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from testbed.core.engine.prefill_queue import PrefillJob
from testbed.core.schema.hardware import SchedulerSpec


@dataclass(frozen=True)
class BatchPolicy:
    token_budget: int
    max_seqs: int
    chunked: bool

    @classmethod
    def from_spec(cls, spec: SchedulerSpec) -> BatchPolicy | None:
        """The policy of a batching scheduler; None for `fcfs` (one whole prompt per pass)."""
        if spec.kind == "fcfs":
            return None
        return cls(spec.max_num_batched_tokens, spec.max_num_seqs, spec.chunked_prefill)


@dataclass
class PrefillPass:
    """One forward pass: its chunks (job, uncached tokens computed in it) and the jobs it ends."""

    start: float
    duration: float
    chunks: list[tuple[PrefillJob, int]]
    done: list[PrefillJob] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass
class PassStats:
    """What the scheduler did (`testbed.metrics` reports it with the run)."""

    passes: int = 0
    tokens: int = 0
    chunks: int = 0
    prompts: int = 0  # prompts whose last chunk was computed
    busy_s: float = 0.0  # modelled time in passes (slowdowns included)
    max_tokens: int = 0
    max_prompts: int = 0


def merged(stats: list[PassStats]) -> PassStats:
    """Several instances' stats as one (sums; maxima)."""
    out = PassStats()
    for st in stats:
        out.passes += st.passes
        out.tokens += st.tokens
        out.chunks += st.chunks
        out.prompts += st.prompts
        out.busy_s += st.busy_s
        out.max_tokens = max(out.max_tokens, st.max_tokens)
        out.max_prompts = max(out.max_prompts, st.max_prompts)
    return out


def plan_pass(
    running: Iterable[PrefillJob], waiting: Iterable[PrefillJob], policy: BatchPolicy
) -> list[tuple[PrefillJob, int]]:
    """The chunks of the next pass: `running` (partly computed, oldest first) continue first,
    then `waiting` (ready to start, FCFS) fill what budget and slots are left."""
    budget = policy.token_budget
    chunks: list[tuple[PrefillJob, int]] = []
    for job in (*running, *waiting):
        if len(chunks) >= policy.max_seqs or budget <= 0:
            break
        left = job.uncached_tokens - job.done
        if left <= budget:
            n = left
        elif policy.chunked:
            n = budget
        elif not chunks:
            n = left  # longer than the whole budget: alone in its pass
        else:
            break  # FCFS: it waits for a pass of its own rather than being overtaken
        chunks.append((job, n))
        budget -= n
    return chunks


def last_pass_layer_ready(job: PrefillJob, layer: int, layers: int) -> float:
    """When layer `layer` (0-based) of `layers` of the prompt's KV can be sent: its share of the
    prompt's last pass has passed. The chunks before hold their KV until then, so the prompt's
    layers stream over its last pass and the last layer at the pass's end is the transfer tail
    TTFT pays (with one whole prompt per pass: `prefill_loop.layer_ready`)."""
    return job.pass_start + job.pass_s * (layer + 1) / layers
