"""A decode instance in virtual time, as `testbed.live.decode_node` runs one, without stepping.

The core `DecodeBatch` holds the sequences. As in the live batch loop, a sequence whose KV has
arrived joins at the next step boundary (at once when the instance is idle), BS_max and KV
memory permitting, FCFS; its first token comes at the end of its first step and its last when
it has generated its output. Between two membership changes (an admission, a finish) every
step is known in advance, so the instance keeps one event: the next boundary where
membership changes, and `DecodeBatch.advance` runs the steps up to it at once.
"""

from __future__ import annotations

from testbed.core.decode_batch import AdmissionError, DecodeBatch, DecodeSeq
from testbed.core.kvsize import KVModel
from testbed.core.lifecycle import Event
from testbed.core.scenario import DecodeSpec
from testbed.core.servicetime import DecodeStepTime
from testbed.core.topology import NodeSpec
from testbed.sim.host import Host
from testbed.sim.events import DECODE
from testbed.sim.request import SimRequest


class DecodeSim:
    __slots__ = ("node", "sim", "batch", "kv", "reqs", "base", "version", "due", "due_steps", "fresh", "steps",
                 "completed")

    def __init__(self, node: NodeSpec, spec: DecodeSpec, kv: KVModel, sim: Host) -> None:
        self.node = node
        self.sim = sim
        self.batch = DecodeBatch(DecodeStepTime.from_spec(spec), spec.bs_max, spec.kv_capacity_bytes)
        self.kv = kv
        self.reqs: dict[str, SimRequest] = {}
        self.base = 0.0            # the present step boundary (while sequences run)
        self.version = 0
        self.due = 0.0             # the next boundary where membership changes
        self.due_steps = 0         # steps from `base` to it
        self.fresh: list[SimRequest] = []   # admitted at `base`: their first step is the one from `base`
        self.steps = 0
        self.completed = 0

    def kv_arrived(self, req: SimRequest, t: float) -> None:
        tr = req.tr
        # Memory for the prompt's KV and for what decoding will append (as the live node reserves it).
        growth = round(self.kv.full_bytes_per_token * tr.output_tokens)
        seq = DecodeSeq(req.rid, tr.input_tokens, tr.output_tokens, self.kv.total(tr.input_tokens) + growth)
        try:
            self.batch.submit(seq)
        except AdmissionError as e:
            self.sim.fail(req, str(e), t)
            return
        self.reqs[req.rid] = req
        b = self.batch
        if not b.running:
            self.base = t
            self._boundary(t)
            return
        if len(b.running) >= b.bs_max or b.waiting[0] is not seq:
            return          # a finish frees the slot (or the FCFS head goes first)
        m = b.steps_until(t - self.base)
        if m == 0:
            self._admit(t)
            self._plan()
        elif m < self.due_steps:
            self._set_due(m)

    def _admit(self, t: float) -> None:
        b = self.batch
        for s in b.admit(t):
            req = self.reqs[s.request_id]
            req.admitted = t
            req.life.apply(Event.ADMIT, t)
            self.fresh.append(req)
        # The first step from this boundary decides every fresh sequence's first token.
        first = t + b.step_duration()
        for req in self.fresh:
            req.first = first

    def _boundary(self, t: float) -> None:
        """At a step boundary: admit what may join, then plan the next change."""
        self.fresh = []
        self._admit(t)
        self._plan()

    def _plan(self) -> None:
        b = self.batch
        if not b.running:
            self.version += 1
            return
        # Whatever waits now waits for memory or a slot: only a finish changes that.
        self._set_due(b.steps_to_finish())

    def _set_due(self, m: int) -> None:
        self.version += 1
        self.due_steps = m
        self.due = self.base + self.batch.duration_of(m)
        self.sim.loop.at(self.due, DECODE, self._due, self.version)

    def _due(self, version: int) -> None:
        if version != self.version:
            return
        t = self.sim.loop.now
        b = self.batch
        results = b.advance(self.due_steps)
        self.steps += self.due_steps
        self.base = t
        for r in results:
            if r.finished:
                req = self.reqs.pop(r.seq.request_id)
                req.last = t
                self.completed += 1
                self.sim.finished(req, t)
        self._boundary(t)

    @property
    def waiting(self) -> int:
        return len(self.batch.waiting)
