"""Continuous batching on a decode instance, with BS_max and KV-memory admission.

A driver calls `admit`, sleeps `step_duration()`, then `complete_step()`; every running
sequence emits one token per step. Sequences wait FCFS until a slot and their KV fit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from testbed.core.servicetime import DecodeStepTime


@dataclass
class DecodeSeq:
    request_id: str
    context_tokens: int
    output_tokens: int
    kv_bytes: int            # memory reserved for the whole sequence (prompt KV + generated)
    generated: int = 0
    admitted_at: float | None = None


@dataclass(frozen=True)
class StepResult:
    seq: DecodeSeq
    finished: bool


class AdmissionError(ValueError):
    pass


class DecodeBatch:
    def __init__(self, step_time: DecodeStepTime, bs_max: int, kv_capacity: int, time_scale: float = 1.0) -> None:
        self.step_time = step_time
        self.bs_max = bs_max
        self.kv_capacity = kv_capacity
        self.time_scale = time_scale        # modelled seconds are divided by this (speedup)
        self.waiting: deque[DecodeSeq] = deque()
        self.running: list[DecodeSeq] = []
        self.kv_used = 0

    def submit(self, seq: DecodeSeq) -> None:
        if seq.kv_bytes > self.kv_capacity:
            raise AdmissionError(
                f"request {seq.request_id} needs {seq.kv_bytes} KV bytes, more than the instance's {self.kv_capacity}"
            )
        self.waiting.append(seq)

    def admit(self, now: float) -> list[DecodeSeq]:
        """Admit waiting sequences FCFS while a batch slot and KV memory are free."""
        out: list[DecodeSeq] = []
        while self.waiting and len(self.running) < self.bs_max:
            head = self.waiting[0]
            if self.kv_used + head.kv_bytes > self.kv_capacity:
                break   # FCFS: do not let smaller requests overtake the head
            self.waiting.popleft()
            head.admitted_at = now
            self.kv_used += head.kv_bytes
            self.running.append(head)
            out.append(head)
        return out

    def step_duration(self) -> float:
        ctx = sum(s.context_tokens + s.generated for s in self.running)
        return self.step_time(len(self.running), ctx) / self.time_scale

    def complete_step(self) -> list[StepResult]:
        results: list[StepResult] = []
        keep: list[DecodeSeq] = []
        for s in self.running:
            s.generated += 1
            done = s.generated >= s.output_tokens
            results.append(StepResult(s, done))
            if done:
                self.kv_used -= s.kv_bytes
            else:
                keep.append(s)
        self.running = keep
        return results

    def abort(self, request_id: str) -> bool:
        for s in self.running:
            if s.request_id == request_id:
                self.running.remove(s)
                self.kv_used -= s.kv_bytes
                return True
        for s in self.waiting:
            if s.request_id == request_id:
                self.waiting.remove(s)
                return True
        return False

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
