"""A prefill instance in virtual time, as `testbed.live.prefill_node` runs one.

The core `PrefillQueue` holds the jobs (FCFS, one at a time). A job whose cached prefix is
being moved in from another cluster holds the instance until the move has arrived, then
computes. Layer i's KV exists when i + 1 of the n layers' shares of the modelled compute have
passed; the transport sends what exists, so KV streams into the path to the decode node while
the prefill computes. The simulator releases the first n - 1 layers as a steady stream over the
compute (the path's queue stays empty while the link keeps up, and holds the same bytes at the
end when it does not) and the last layer at once when compute ends: what is left to send then
is the transfer tail TTFT pays.
"""

from __future__ import annotations

from testbed.core.kvsize import KVModel
from testbed.core.lifecycle import Event
from testbed.core.prefill_queue import PrefillJob, PrefillQueue
from testbed.core.servicetime import PrefillTime
from testbed.core.topology import NodeSpec
from testbed.sim.host import Host
from testbed.sim.events import PREFILL
from testbed.sim.network import Path
from testbed.sim.request import SimRequest


class PrefillSim:
    __slots__ = ("node", "sim", "queue", "time", "kv", "byte_scale", "pending", "blocked", "current", "path",
                 "completed")

    def __init__(self, node: NodeSpec, time: PrefillTime, kv: KVModel, byte_scale: float, sim: Host) -> None:
        self.node = node
        self.sim = sim
        self.queue = PrefillQueue()
        self.time = time
        self.kv = kv
        self.byte_scale = byte_scale
        self.pending: dict[str, SimRequest] = {}
        self.blocked: SimRequest | None = None     # popped, waiting for its moved cached prefix
        self.current: SimRequest | None = None     # computing
        self.path: Path | None = None              # where the computing job's KV streams
        self.completed = 0

    def submit(self, req: SimRequest, t: float) -> None:
        assert req.plan is not None
        d = req.plan.d
        job = PrefillJob(req.rid, d.incremental_tokens, d.cached_tokens,
                         self.time(d.incremental_tokens, d.cached_tokens))
        req.modelled = job.duration
        req.queued = t
        self.pending[req.rid] = req
        self.queue.push(job, t)
        if self.queue.current is None:
            self._next(t)

    def _next(self, t: float) -> None:
        job = self.queue.start_next(t)
        if job is None:
            return
        req = self.pending.pop(job.request_id)
        req.job = job
        assert req.plan is not None
        if req.plan.d.cache_move is not None and not req.moved:
            self.blocked = req
            return
        self._compute(req, t)

    def move_arrived(self, req: SimRequest, t: float) -> None:
        """The cached prefix moved in for `req` is here."""
        req.moved = True
        req.move_end = t
        if self.blocked is req:
            self.blocked = None
            self._compute(req, t)

    def _compute(self, req: SimRequest, t: float) -> None:
        job = req.job
        assert job is not None and req.plan is not None
        d = req.plan.d
        job.started_at = t
        dur = job.duration
        n = self.kv.layers
        req.start = t
        req.transfer_start = t + dur / n
        req.life.apply(Event.START_PREFILL, t)
        req.life.apply(Event.TRANSFER_START, req.transfer_start)
        # The wire bytes `kv.layer_bytes` gives the live sender: their total and the last layer.
        total, last = self.kv.shipped(req.tr.input_tokens, d.decode_cached_tokens, self.byte_scale)
        req.kv_wire = total
        early = (total - last) * self.byte_scale
        path = self.sim.net.path(self.node.id, d.decode_node)
        self.current, self.path = req, path
        if dur > 0 and early > 0:
            self.sim.net.stream(path, t, early / dur)
            req.tail_bytes = last * self.byte_scale
        else:
            req.tail_bytes = req.kv_wire * self.byte_scale
        self.sim.loop.at(t + dur, PREFILL, self._end, req)

    def _end(self, req: SimRequest) -> None:
        t = self.sim.loop.now
        job = self.queue.finish(t)
        assert job.request_id == req.rid and self.path is not None
        req.end = t
        req.life.apply(Event.END_PREFILL, t)
        path = self.path
        net = self.sim.net
        self.current, self.path = None, None
        net.end_stream(path, t, req.tail_bytes)
        self.sim.transfer_handed(req, path, net.position(path))
        self.completed += 1
        self._next(t)

    @property
    def running(self) -> bool:
        return self.current is not None or self.blocked is not None
