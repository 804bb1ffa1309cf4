"""A vLLM-like decode batch (I/O-free): KV admission by blocks, preemption by recompute.

Where `DecodeBatch` reserves a sequence's whole KV (prompt and every token it will generate) at
admission, this batch holds KV in blocks of `block_tokens` as vLLM's block manager does: a
sequence is admitted when the blocks for its tokens so far and the next one are free (FCFS, BS_max
permitting), and takes a block each time its tokens cross a block boundary. When a step's new
tokens need more blocks than are free, the running sequence admitted last is preempted by
recompute: its blocks are freed and it goes back to the head of the waiting queue with the tokens
it has generated; when it is admitted again, the step it rejoins also recomputes its KV (prompt
and generated tokens), which takes the instance's single-prompt prefill time for that many tokens
(`recompute`), in that step. `preemptions` lists each one: which sequence, when, and when it ran
again.

The simulator runs the steps between membership changes at once: `steps_to_finish` also stops
at the last step before the pool runs out, so a preemption always happens at a step boundary
(`admit`), as the live node's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from testbed.core.engine.decode_batch import AdmissionError, Batch, DecodeBatch, DecodeSeq, StepResult, new_batch
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import DecodeStepTime, PrefillTime
from testbed.core.schema.hardware import HardwareSpec


@dataclass
class Preemption:
    request_id: str
    at: float  # the step boundary it was preempted at (the driver's time)
    tokens: int  # prompt + generated tokens it held then
    resumed_at: float | None = None  # the boundary it was admitted again at
    recompute_s: float = 0.0  # the recompute its rejoining step carried (modelled, driver's unit)


def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block)


class BlockBatch(DecodeBatch):
    def __init__(
        self,
        step_time: DecodeStepTime,
        bs_max: int,
        blocks: int,
        block_tokens: int,
        block_bytes: int,
        recompute: Callable[[int], float],
        time_scale: float = 1.0,
    ) -> None:
        super().__init__(step_time, bs_max, blocks * block_bytes, time_scale)
        self.blocks = blocks
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.recompute = recompute  # modelled seconds to recompute a sequence's KV of n tokens
        self.free = blocks
        self.held: dict[str, int] = {}  # running sequence -> its blocks
        self.extra = 0.0  # recompute time the next step carries (driver's unit)
        self.preemptions: list[Preemption] = []
        self._open: dict[str, Preemption] = {}  # preempted, not yet running again

    @staticmethod
    def _tokens(s: DecodeSeq) -> int:
        return s.context_tokens + s.generated

    def submit(self, seq: DecodeSeq) -> None:
        need = _blocks(seq.context_tokens + seq.output_tokens, self.block_tokens)
        if need > self.blocks:
            raise AdmissionError(
                f"request {seq.request_id} needs {need} KV blocks to finish, more than the instance's {self.blocks}"
            )
        self.waiting.append(seq)

    def _need(self, steps: int) -> int:
        """Blocks the running sequences take over the next `steps` steps."""
        b = self.block_tokens
        return sum(_blocks(self._tokens(s) + steps, b) - self.held[s.request_id] for s in self.running)

    def _sync(self) -> None:
        self.kv_used = (self.blocks - self.free) * self.block_bytes

    def admit(self, now: float) -> list[DecodeSeq]:
        """Preempt (latest admitted first) until the next step's tokens fit, then admit FCFS
        while a slot and the blocks for a sequence's tokens and its next one are free. Returns
        the sequences admitted for the first time (one admitted again is not)."""
        while self.running and self._need(1) > self.free:
            victim = self.running.pop()
            self.free += self.held.pop(victim.request_id)
            self.context -= self._tokens(victim)
            p = Preemption(victim.request_id, now, self._tokens(victim))
            self.preemptions.append(p)
            self._open[victim.request_id] = p
            self.waiting.appendleft(victim)
        out: list[DecodeSeq] = []
        while self.waiting and len(self.running) < self.bs_max:
            head = self.waiting[0]
            need = _blocks(self._tokens(head) + 1, self.block_tokens)
            if need + self._need(1) > self.free:  # the running sequences' next tokens come first
                break  # FCFS: do not let smaller requests overtake the head
            self.waiting.popleft()
            self.free -= need
            self.held[head.request_id] = need
            self.context += self._tokens(head)
            self.running.append(head)
            back = self._open.pop(head.request_id, None)
            if back is None:
                head.admitted_at = now
                out.append(head)
            else:
                back.resumed_at = now
                back.recompute_s = self.recompute(self._tokens(head)) / self.time_scale
                self.extra += back.recompute_s
        self._sync()
        return out

    # -- step times: the steady series plus the recompute the next step carries ------------------

    def step_duration(self) -> float:
        return super().step_duration() + self.extra

    def _series(self) -> tuple[float, float]:
        return super().step_duration(), self.step_time.per_context_token_s * len(self.running) / self.time_scale

    def duration_of(self, steps: int) -> float:
        return super().duration_of(steps) + (self.extra if steps > 0 and self.running else 0.0)

    def steps_until(self, elapsed: float) -> int:
        if elapsed <= 0 or not self.running:
            return 0
        if elapsed <= self.extra:
            return 1
        return super().steps_until(elapsed - self.extra)

    def steps_to_finish(self) -> int:
        """Steps until the first finish or, sooner, the last step before the free blocks run
        out (the boundary after it preempts)."""
        m = super().steps_to_finish()
        if m == 0 or self._need(m) <= self.free:
            return m
        lo, hi = 1, m  # _need(lo) <= free (admit saw to it), _need(hi) > free
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._need(mid) <= self.free:
                lo = mid
            else:
                hi = mid
        return lo

    def _steps(self, steps: int) -> list[StepResult]:
        before = {s.request_id: self._tokens(s) for s in self.running}
        results = super()._steps(steps)
        b = self.block_tokens
        for r in results:
            rid = r.seq.request_id
            held = self.held.pop(rid)
            if r.finished:
                self.free += held
            else:
                now_held = max(held, _blocks(before[rid] + steps, b))
                self.free -= now_held - held
                self.held[rid] = now_held
        self.extra = 0.0
        self._sync()
        return results

    def advance_finished(self, steps: int) -> list[DecodeSeq]:
        if steps <= 0:
            return []
        if steps > self.steps_to_finish():
            raise ValueError(f"advance({steps}): the batch changes after {self.steps_to_finish()} steps")
        return [r.seq for r in self._steps(steps) if r.finished]

    def advance(self, steps: int) -> list[StepResult]:
        if steps <= 0:
            return []
        if steps > self.steps_to_finish():
            raise ValueError(f"advance({steps}): the batch changes after {self.steps_to_finish()} steps")
        return self._steps(steps)

    def abort(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.free += held
        self._open.pop(request_id, None)
        gone = super().abort(request_id)
        self._sync()
        return gone


def block_count(kv_capacity_bytes: int, block_tokens: int, bytes_per_token: float) -> int:
    """The KV blocks an instance's memory holds (a block: `block_tokens` tokens' full-attention KV)."""
    return max(math.floor(kv_capacity_bytes / (block_tokens * bytes_per_token)), 1) if bytes_per_token > 0 else 1


def decode_batch_for(hw: HardwareSpec, kv: KVModel, time_scale: float = 1.0, compiled: bool = True) -> Batch:
    """A decode instance's batch as its hardware's scheduler says: `fcfs` reserves whole
    sequences (`DecodeBatch`, or its compiled twin where built and `compiled`); `vllm` holds KV
    in blocks and preempts by recompute (`BlockBatch`, pure Python: the compiled twin steps aside
    for it, as run.json's `mechanisms` says)."""
    spec = hw.decode
    assert spec is not None
    step = DecodeStepTime.from_spec(spec)
    sched = hw.scheduler
    if sched.kind == "fcfs":
        if compiled and time_scale == 1.0:
            return new_batch(step, spec.bs_max, spec.kv_capacity_bytes)
        return DecodeBatch(step, spec.bs_max, spec.kv_capacity_bytes, time_scale=time_scale)
    per_token = kv.full_bytes_per_token
    blocks = sched.kv_blocks or block_count(spec.kv_capacity_bytes, sched.block_size, per_token)
    block_bytes = max(round(sched.block_size * per_token), 1)
    return BlockBatch(
        step, spec.bs_max, blocks, sched.block_size, block_bytes, PrefillTime.from_spec(hw.prefill), time_scale
    )
