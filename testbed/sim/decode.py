"""A decode instance in virtual time, as `testbed.live.decode_node` runs one, without stepping.

Both drive the core `DecodeLoop` (`testbed.core.engine.decode_loop`): a sequence whose KV has arrived
joins at the next step boundary (at once when the instance is idle), BS_max and KV memory
permitting, FCFS; its first token comes at the end of its first step and its last when it has
generated its output. Between two membership changes (an admission, a finish) every step is
known in advance, so the instance keeps one event, the next boundary where something changes,
and `DecodeLoop.run` runs the steps up to it at once. What else changes the plan is brought to
a boundary the same way: a sequence leaving (its request failed or was given up: it leaves at
once and the step in progress ends on its own time), a slowdown starting or ending (steps
starting from the next boundary take the new factor), a pause (the step in progress ends when
the instance resumes, and the cadence restarts from there, as the live loop's late step does).
"""

from __future__ import annotations

import random

from testbed.core.engine.decode_batch import AdmissionError, Batch
from testbed.core.engine.decode_blocks import decode_batch_for
from testbed.core.engine.decode_loop import DecodeLoop, decode_seq
from testbed.core.engine.kvsize import KVModel
from testbed.core.failures import Failure
from testbed.core.failures import FailureKind as K
from testbed.core.fault_timeline import SlowDown
from testbed.core.lifecycle import Event
from testbed.core.schema.hardware import HardwareSpec
from testbed.core.schema.topology import NodeSpec
from testbed.sim.events import DECODE
from testbed.sim.host import Host
from testbed.sim.request import SimRequest


class DecodeSim:
    __slots__ = (
        "node",
        "sim",
        "loop",
        "spec",
        "hw",
        "kv",
        "reqs",
        "version",
        "due",
        "due_steps",
        "fresh",
        "completed",
        "paused",
        "stall_rate",
        "stall_s",
        "rng",
    )

    def __init__(
        self, node: NodeSpec, hw: HardwareSpec, kv: KVModel, sim: Host, stalls: tuple[float, float] = (0.0, 0.0)
    ) -> None:
        spec = hw.decode
        assert spec is not None
        self.node = node
        self.sim = sim
        self.spec = spec
        self.kv = kv
        self.hw = hw
        self.loop = DecodeLoop(decode_batch_for(hw, kv))
        self.reqs: dict[str, SimRequest] = {}
        self.version = 0
        self.due = 0.0  # the next boundary where membership changes
        self.due_steps = 0  # steps from the present step's start to it
        self.fresh: list[SimRequest] = []  # admitted at the present step's start: their first step is this one
        self.completed = 0
        self.paused = False
        # Stalls of the live batch loop (`testbed.core.schema.live_path`): per paper second of decoding,
        # and the mean paper seconds each loses; a seeded stream per instance.
        self.stall_rate, self.stall_s = stalls
        self.rng = random.Random(node.id) if self.stall_rate > 0 else None

    @property
    def batch(self) -> Batch:
        return self.loop.batch

    @property
    def steps(self) -> int:
        return self.loop.steps

    @property
    def slow(self) -> SlowDown:
        return self.loop.slow

    def kv_arrived(self, req: SimRequest, t: float) -> None:
        tr = req.tr
        try:
            self.loop.submit(decode_seq(self.kv, req.rid, tr.input_tokens, tr.output_tokens))
        except AdmissionError as e:
            # It happened here, but a node that cannot hold it is not to blame (`DecodeSim` is one).
            self.sim.attempt_failed(req, Failure(K.DECODE_ERROR, self.node.id, str(e)), t)
            return
        self.reqs[req.rid] = req
        if self.paused:
            return
        b = self.batch
        if not b.n_running:
            self._boundary(t)
            return
        if b.n_running >= b.bs_max or b.head_id != req.rid:
            return  # a finish frees the slot (or the FCFS head goes first)
        self._change_at(t)

    def _change_at(self, t: float) -> None:
        """Something changes from the boundary at or after `t`: plan to be there."""
        m = self.loop.steps_until(t)
        if m == 0:
            self._boundary(t, again=True)
        elif m < self.due_steps:
            self._set_due(m)

    def _boundary(self, t: float, again: bool = False) -> None:
        """At a step boundary: admit what may join, then plan the next change. `again`: the
        step from here was begun already (what joined then keeps its first step)."""
        if not again:
            self.fresh = []
        admitted, end = self.loop.begin(t)
        for s in admitted:
            req = self.reqs[s.request_id]
            req.decode_admitted = t
            req.life.apply(Event.ADMIT, t)
            self.fresh.append(req)
        if end is None:
            self.version += 1
            return
        # The first step from this boundary decides every fresh sequence's first token.
        for req in self.fresh:
            req.decode_first_token = end
        # Whatever waits now waits for memory or a slot: only a finish changes that.
        self._set_due(self.batch.steps_to_finish())

    def _set_due(self, m: int) -> None:
        self.version += 1
        self.due_steps = m
        if self.loop.step_start is None:
            self.due = self.sim.loop.now
        else:
            span = self.loop.span(m)
            self.due = self.loop.step_start + span + (self._stalled(span) if self.rng is not None else 0.0)
        self.sim.loop.at(self.due, DECODE, self._due, self.version)

    def _stalled(self, span: float) -> float:
        """Time the loop loses to stalls over `span` of steps (Poisson stalls, exponential losses):
        the boundary comes that much later, and the cadence restarts from it (`DecodeLoop.begin`)."""
        assert self.rng is not None
        lost, t = 0.0, self.rng.expovariate(self.stall_rate)
        while t < span:
            lost += self.rng.expovariate(1.0 / self.stall_s)
            t += self.rng.expovariate(self.stall_rate)
        return lost

    def _due(self, version: int) -> None:
        if version != self.version:
            return
        self._steps(self.due_steps, self.sim.loop.now)
        self._boundary(self.sim.loop.now)

    def _steps(self, m: int, t: float) -> None:
        """Run `m` steps at once; sequences finishing at their end are done at `t`."""
        for seq in self.loop.run_finished(m):
            req = self.reqs.pop(seq.request_id)
            req.decode_last_token = t
            self.completed += 1
            self.sim.finished(req, t)

    def _settle(self, t: float) -> None:
        """Run the steps that ended by `t` (none finishing a sequence: the plan has a boundary at
        the first finish); the present step is then the one in progress at `t`."""
        if not self.batch.n_running or self.loop.step_start is None:
            return
        m = self.loop.steps_until(t)
        whole = m if self.loop.step_start + self.loop.span(m) <= t else m - 1
        whole = min(whole, self.due_steps - 1)
        if whole > 0:
            self._steps(whole, t)
            self.due_steps -= whole
            self.fresh = []

    # -- what changes the plan from outside ------------------------------------------------------

    def leave(self, req: SimRequest, t: float) -> None:
        """The request's sequence leaves (its attempt failed or was given up)."""
        if self.reqs.pop(req.rid, None) is None:
            return
        running = any(s.request_id == req.rid for s in self.batch.running)
        if self.paused or not running:
            self.batch.abort(req.rid)
            if not self.paused and not self.batch.n_running and self.batch.n_waiting:
                self._boundary(t)
            return
        self._settle(t)
        self.batch.abort(req.rid)
        self.fresh = [r for r in self.fresh if r is not req]
        if not self.batch.n_running:
            self.loop.rest()
            self.version += 1
            if self.batch.n_waiting:
                self._boundary(t)
            return
        # The step in progress ends on its own time; from there, a new plan.
        self._set_due(1)

    def slow_changed(self, t: float) -> None:
        """A slowdown started or ended: steps from the next boundary take the factor in force."""
        if self.paused or not self.batch.n_running or self.loop.step_start is None:
            return
        self._settle(t)
        if self.loop.step_start < t:
            self._set_due(1)
        else:
            self._boundary(t, again=True)

    def pause(self, t: float) -> None:
        self._settle(t)
        self.version += 1
        self.paused = True

    def resume(self, t: float) -> None:
        """The step in progress when it paused ends now; the cadence restarts from here."""
        self.paused = False
        if self.batch.n_running and self.loop.step_start is not None:
            if t < self.loop.step_start + self.loop.span(1):
                self._set_due(1 if self.batch.n_waiting else self.due_steps)  # paused within a step: the plan stands
                return
            self._steps(1, t)
            for req in self.fresh:
                req.decode_first_token = t
        self._boundary(t)

    def kill(self) -> list[SimRequest]:
        """Everything on the instance is lost; returns the requests it held."""
        held = list(self.reqs.values())
        self.reqs.clear()
        self.version += 1
        self.fresh = []
        slow = self.loop.slow
        self.loop = DecodeLoop(decode_batch_for(self.hw, self.kv), slow)
        self.paused = False
        return held

    @property
    def waiting(self) -> int:
        return self.batch.n_waiting
