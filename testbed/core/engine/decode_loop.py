"""One decode instance's batch loop (I/O-free): when sequences join, when each step ends, what
a slowed instance's steps take, and how much memory a sequence reserves. The live decode node
(`testbed.live.decode_node`) sleeps until each step's end; the simulator (`testbed.sim.decode`)
runs the steps between two membership changes at once. Both drive this class, so both batch
the same way.

The cadence. Steps run back to back on absolute deadlines: a step starts where the previous one
was due to end, so timer lateness never accumulates; a driver that stalled for a whole step
(the live node on a busy host, or paused) restarts the cadence from its present time and that
time is lost for good (`late_s`). Whatever is waiting joins at a step's start (at once on an
idle instance), BS_max and KV memory permitting, FCFS (`DecodeBatch.admit`); a step's duration
is fixed when it starts, with the slowdown factor in force then (`testbed.core.fault_timeline.SlowDown`).

Driving it, step by step:
    admitted, end = loop.begin(now)       # None: nothing runs; wait for a submit or a finish
    ... until `end` ...
    results = loop.end_step()
or many steps at once (no membership change may fall among them): `run(m)`, with `steps_until`
and `span` to find the boundaries.
"""

from __future__ import annotations

from testbed.core.engine.decode_batch import Batch, DecodeSeq, StepResult
from testbed.core.engine.kvsize import KVModel
from testbed.core.fault_timeline import SlowDown

# Wire seconds a decode request waits for its KV before failing (the live node and the simulator alike).
KV_TIMEOUT_S = 120.0


def reservation(kv: KVModel, prompt_kv_bytes: int, output_tokens: int) -> int:
    """KV memory a sequence holds on the decode instance: its prompt's KV and what decoding
    will append (full-attention bytes per generated token)."""
    return prompt_kv_bytes + round(kv.full_bytes_per_token * output_tokens)


def decode_seq(
    kv: KVModel, request_id: str, input_tokens: int, output_tokens: int, prompt_kv_bytes: int | None = None
) -> DecodeSeq:
    """The sequence a decode instance admits for a request (its prompt's KV: `kv.total` unless given)."""
    prompt = kv.total(input_tokens) if prompt_kv_bytes is None else prompt_kv_bytes
    return DecodeSeq(request_id, input_tokens, output_tokens, reservation(kv, prompt, output_tokens))


class DecodeLoop:
    def __init__(self, batch: Batch, slow: SlowDown | None = None) -> None:
        self.batch = batch
        self.slow = slow if slow is not None else SlowDown()
        self.step_start: float | None = None  # the present step's start (None: not running)
        self.step_end = 0.0  # when the present step is due to end
        self.step_factor = 1.0  # the slowdown fixed when the present step began
        self.steps = 0
        self.modelled_s = 0.0  # the steps' modelled time (slowdowns included)
        self.late_s = 0.0  # time the driver fell behind the cadence and never caught up

    @property
    def idle(self) -> bool:
        return self.batch.idle

    @property
    def running(self) -> bool:
        return self.batch.n_running > 0

    def submit(self, seq: DecodeSeq) -> None:
        """A sequence whose KV has arrived; `AdmissionError` if it can never fit."""
        self.batch.submit(seq)

    def abort(self, request_id: str) -> bool:
        return self.batch.abort(request_id)

    def rest(self) -> None:
        """The driver waits (idle, or the FCFS head waits for memory): the cadence starts afresh."""
        self.step_start = None

    def begin(self, now: float) -> tuple[list[DecodeSeq], float | None]:
        """At a step boundary (or on waking): admit what may join and start the next step.
        Returns the sequences admitted and when the step ends (None: nothing runs)."""
        b = self.batch
        if self.step_start is None:
            self.step_start = now
        elif now - self.step_start > b.step_duration():
            self.late_s += now - self.step_start
            self.step_start = now
        admitted = b.admit(now)
        if not b.n_running:
            self.step_start = None
            return admitted, None
        self.step_factor = self.slow.at(now)
        self.step_end = self.step_start + b.step_duration() * self.step_factor
        return admitted, self.step_end

    def end_step(self) -> list[StepResult]:
        """The step started by `begin` ended (the driver stamps its tokens with its own clock)."""
        assert self.step_start is not None
        self.steps += 1
        self.modelled_s += self.step_end - self.step_start
        self.step_start = self.step_end
        return self.batch.complete_step()

    # -- many steps at once ---------------------------------------------------------------------

    def span(self, steps: int) -> float:
        """Time of the next `steps` steps from the present step's start, with the present
        membership and slowdown (a driver running many steps at once begins again where either
        changes)."""
        return self.batch.duration_of(steps) * self.step_factor

    def steps_until(self, t: float) -> int:
        """The fewest steps from the present step's start whose end is at or after `t` (0 at or
        before that start): the boundary where something arriving at `t` joins."""
        if self.step_start is None:
            return 0
        return self.batch.steps_until((t - self.step_start) / self.step_factor)

    def run(self, steps: int) -> list[StepResult]:
        """`steps` steps from the present step's start at once (none may finish a sequence but
        the last): the same state as that many `end_step` calls, and the last step's results.
        The next step starts where they end."""
        assert self.step_start is not None and steps > 0
        took = self.span(steps)
        results = self.batch.advance(steps)
        self.steps += steps
        self.modelled_s += took
        self.step_start += took
        self.step_end = self.step_start
        return results

    def run_finished(self, steps: int) -> list[DecodeSeq]:
        """`run`, returning only the sequences that finish at the last step."""
        assert self.step_start is not None and steps > 0
        took = self.span(steps)
        done = self.batch.advance_finished(steps)
        self.steps += steps
        self.modelled_s += took
        self.step_start += took
        self.step_end = self.step_start
        return done

    def samples(self, kv_bytes_received: float) -> list[tuple[str, float, dict[str, str]]]:
        """The decode instance's time-series samples."""
        b = self.batch
        return [
            ("running_batch", float(b.n_running), {}),
            ("queue_depth", float(b.n_waiting), {}),
            ("kv_usage_bytes", float(b.kv_used), {}),
            ("kv_bytes_received", float(kv_bytes_received), {}),
            ("decode_step_modelled_s", self.modelled_s, {}),
            ("decode_step_late_s", self.late_s, {}),
        ]
