"""Continuous batching on a decode instance, with BS_max and KV-memory admission.

A driver calls `admit`, sleeps `step_duration()`, then `complete_step()`; every running
sequence emits one token per step. Sequences wait FCFS until a slot and their KV fit.
A driver in virtual time runs the steps between membership changes at once (`advance`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from testbed.core import native
from testbed.core.engine.servicetime import DecodeStepTime


@dataclass
class DecodeSeq:
    request_id: str
    context_tokens: int
    output_tokens: int
    kv_bytes: int  # memory reserved for the whole sequence (prompt KV + generated)
    generated: int = 0
    admitted_at: float | None = None


class StepResult(NamedTuple):
    """A sequence's part in a step (a tuple: a step makes one per running sequence)."""

    seq: DecodeSeq
    finished: bool


class AdmissionError(ValueError):
    pass


class DecodeBatch:
    def __init__(self, step_time: DecodeStepTime, bs_max: int, kv_capacity: int, time_scale: float = 1.0) -> None:
        self.step_time = step_time
        self.bs_max = bs_max
        self.kv_capacity = kv_capacity
        self.time_scale = time_scale  # modelled seconds are divided by this (speedup)
        self.waiting: deque[DecodeSeq] = deque()
        self.running: list[DecodeSeq] = []
        self.kv_used = 0
        self.context = 0  # tokens the running sequences hold (prompt + generated)

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
                break  # FCFS: do not let smaller requests overtake the head
            self.waiting.popleft()
            head.admitted_at = now
            self.kv_used += head.kv_bytes
            self.context += head.context_tokens + head.generated
            self.running.append(head)
            out.append(head)
        return out

    def step_duration(self) -> float:
        # `self.step_time(len(self.running), self.context)`, inlined (the same sums): the
        # simulator asks for it at every plan of a decode instance.
        st = self.step_time
        return (st.base_s + st.per_seq_s * len(self.running) + st.per_context_token_s * self.context) / self.time_scale

    def complete_step(self) -> list[StepResult]:
        return self._steps(1)

    def _steps(self, steps: int) -> list[StepResult]:
        results: list[StepResult] = []
        keep: list[DecodeSeq] = []
        self.context += steps * len(self.running)
        for s in self.running:
            g = s.generated = s.generated + steps
            if g >= s.output_tokens:
                results.append(StepResult(s, True))
                self.kv_used -= s.kv_bytes
                self.context -= s.context_tokens + g
            else:
                results.append(StepResult(s, False))
                keep.append(s)
        self.running = keep
        return results

    # -- many steps at once (a driver in virtual time skips the steps where nothing changes)

    def steps_to_finish(self) -> int:
        """Steps until the first running sequence finishes (0 when none runs)."""
        return min([s.output_tokens - s.generated for s in self.running], default=0)

    def duration_of(self, steps: int) -> float:
        """Time of the next `steps` steps with the present membership. Each step adds one token
        per sequence, so the context term grows by the batch size per step: an arithmetic series."""
        if steps <= 0 or not self.running:
            return 0.0
        st = self.step_time
        n = len(self.running)
        first = (st.base_s + st.per_seq_s * n + st.per_context_token_s * self.context) / self.time_scale
        growth = st.per_context_token_s * n / self.time_scale
        return steps * first + growth * steps * (steps - 1) / 2

    def _series(self) -> tuple[float, float]:
        """(duration of the next step, growth of each later one)."""
        return self.step_duration(), self.step_time.per_context_token_s * len(self.running) / self.time_scale

    def steps_until(self, elapsed: float) -> int:
        """The fewest steps whose end is at or after `elapsed` from the present step boundary
        (0 for elapsed <= 0): the boundary where something arriving then can join."""
        if elapsed <= 0 or not self.running:
            return 0
        first, growth = self._series()

        def span(m: int) -> float:
            return m * first + growth * m * (m - 1) / 2

        if growth > 0:
            # m*first + growth*m*(m-1)/2 = elapsed, solved for m.
            b = first - growth / 2
            m = max(math.ceil((-b + math.sqrt(b * b + 2 * growth * elapsed)) / growth), 1)
        else:
            m = max(math.ceil(elapsed / first), 1)
        while m > 1 and span(m - 1) >= elapsed:
            m -= 1
        while span(m) < elapsed:
            m += 1
        return m

    def advance(self, steps: int) -> list[StepResult]:
        """Run `steps` steps at once: the same state as that many `complete_step` calls, and the
        last step's results. No sequence may finish before the last step."""
        if steps <= 0:
            return []
        if steps > self.steps_to_finish():
            raise ValueError(f"advance({steps}): a sequence finishes after {self.steps_to_finish()} steps")
        return self._steps(steps)

    def advance_finished(self, steps: int) -> list[DecodeSeq]:
        """`advance`, returning only the sequences that finish at the last step (a driver that
        skips steps needs no result for the others)."""
        if steps <= 0:
            return []
        running = self.running
        if any(s.output_tokens - s.generated < steps for s in running):
            raise ValueError(f"advance({steps}): a sequence finishes after {self.steps_to_finish()} steps")
        self.context += steps * len(running)
        done: list[DecodeSeq] = []
        for s in running:
            g = s.generated = s.generated + steps
            if g >= s.output_tokens:
                done.append(s)
        if done:
            self.running = [s for s in running if s.generated < s.output_tokens]
            for s in done:
                self.kv_used -= s.kv_bytes
                self.context -= s.context_tokens + s.generated
        return done

    @property
    def n_running(self) -> int:
        return len(self.running)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    @property
    def head_id(self) -> str | None:
        """The request id of the first waiting sequence (None: nothing waits)."""
        return self.waiting[0].request_id if self.waiting else None

    def abort(self, request_id: str) -> bool:
        for s in self.running:
            if s.request_id == request_id:
                self.running.remove(s)
                self.kv_used -= s.kv_bytes
                self.context -= s.context_tokens + s.generated
                return True
        for s in self.waiting:
            if s.request_id == request_id:
                self.waiting.remove(s)
                return True
        return False

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting


class Batch(Protocol):
    """A decode instance's batch as its drivers see it: `DecodeBatch`, or its compiled twin
    (`testbed_native.DecodeBatch`: the same decisions and the same float bits; `new_batch`
    picks). The twin keeps each running sequence's count itself and writes it back to the
    `DecodeSeq` when the sequence finishes or leaves, or when `running` lists it."""

    @property
    def step_time(self) -> DecodeStepTime: ...
    @property
    def bs_max(self) -> int: ...
    @property
    def kv_capacity(self) -> int: ...
    @property
    def kv_used(self) -> int: ...
    @property
    def running(self) -> Sequence[DecodeSeq]: ...
    @property
    def waiting(self) -> Sequence[DecodeSeq]: ...
    @property
    def n_running(self) -> int: ...
    @property
    def n_waiting(self) -> int: ...
    @property
    def head_id(self) -> str | None: ...
    @property
    def idle(self) -> bool: ...
    def submit(self, seq: DecodeSeq) -> None: ...
    def admit(self, now: float) -> list[DecodeSeq]: ...
    def step_duration(self) -> float: ...
    def complete_step(self) -> list[StepResult]: ...
    def steps_to_finish(self) -> int: ...
    def duration_of(self, steps: int) -> float: ...
    def steps_until(self, elapsed: float) -> int: ...
    def advance(self, steps: int) -> list[StepResult]: ...
    def advance_finished(self, steps: int) -> list[DecodeSeq]: ...
    def abort(self, request_id: str) -> bool: ...


def new_batch(step_time: DecodeStepTime, bs_max: int, kv_capacity: int) -> Batch:
    """A simulated instance's batch: the compiled twin where it is built (`testbed.core.native`),
    else `DecodeBatch`."""
    ext = native.module()
    if ext is None:
        return DecodeBatch(step_time, bs_max, kv_capacity)
    batch: Batch = ext.DecodeBatch(step_time, bs_max, kv_capacity)
    return batch
