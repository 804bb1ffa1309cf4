"""A prefill instance in virtual time, as `testbed.live.prefill_node` runs one.

The core `PrefillQueue` holds the jobs (FCFS, one at a time; a slowdown in force when a job
starts multiplies its duration). A job whose cached prefix is being moved in from another
cluster holds the instance until the move has arrived, then computes. Layer i's KV exists when
i + 1 of the n layers' shares of the modelled compute have passed; the transport sends what
exists, so KV streams into the path to the decode node while the prefill computes. The
simulator releases the first n - 1 layers as a steady stream over the compute (the path's queue
stays empty while the link keeps up, and holds the same bytes at the end when it does not) and
the last layer at once when compute ends: what is left to send then is the transfer tail TTFT
pays.

Faults: a paused instance (SIGSTOP) computes and sends nothing; on resume the layers whose time
has passed go at once and the compute ends at its planned time or at once if that has passed
(the live node's layer deadlines are absolute). A killed one loses its queue; its requests are
the caller's to fail (`kill` returns them).
"""

from __future__ import annotations

from testbed.core.fault_timeline import SlowDown
from testbed.core.engine.kvsize import KVModel
from testbed.core.lifecycle import Event
from testbed.core.engine.prefill_queue import PrefillJob, PrefillQueue
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.topology import NodeSpec
from testbed.sim.host import Host
from testbed.sim.events import PREFILL
from testbed.sim.net_view import PathHandle
from testbed.sim.request import SimRequest


class PrefillSim:
    __slots__ = ("node", "sim", "queue", "time", "kv", "byte_scale", "pending", "blocked", "current", "path",
                 "completed", "slow", "version", "paused", "paused_at", "rate", "ends_at", "late_end")

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
        self.path: PathHandle | None = None              # where the computing job's KV streams
        self.completed = 0
        self.slow = SlowDown()
        self.version = 0                           # of the computing job's end event
        self.paused = False
        self.paused_at = 0.0
        self.rate = 0.0                            # the computing job's KV stream (paper bytes/s)
        self.ends_at = 0.0                         # its planned end
        self.late_end = False                      # its end came while paused

    def submit(self, req: SimRequest, t: float) -> None:
        """The router's call for `req` reaches the instance at `t` (now, or later: across the WAN)."""
        assert req.plan is not None
        d = req.plan.d
        job = PrefillJob(req.rid, d.incremental_tokens, d.cached_tokens,
                         self.time(d.incremental_tokens, d.cached_tokens))
        req.queued = t
        req.life.apply(Event.ENQUEUE_PREFILL, t)
        self.pending[req.rid] = req
        self.queue.push(job, t)
        if self.queue.current is None and not self.paused:
            self._next(self.sim.loop.now)

    def _next(self, t: float) -> None:
        head = self.queue.head
        if head is not None and head.queued_at > t:
            # Its call is still on its way: start it when it is here (if nothing else starts first).
            self.version += 1
            self.sim.loop.at(head.queued_at, PREFILL, self._arrived, self.version)
            return
        job = self.queue.start_next(t, self.slow.at(t))
        if job is None:
            return
        req = self.pending.pop(job.request_id)
        req.job = job
        req.modelled = job.duration
        assert req.plan is not None
        if req.plan.d.cache_move is not None and not req.moved:
            self.blocked = req
            return
        self._compute(req, t)

    def move_arrived(self, req: SimRequest, t: float) -> None:
        """The cached prefix moved in for `req` is here."""
        req.moved = True
        req.move_end = t
        if self.blocked is req and not self.paused:
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
        net = self.sim.net
        path = net.path(self.node.id, d.decode_node)
        lo = net.position(path)
        req.kv_range = (lo, lo + total * self.byte_scale)
        self.current, self.path = req, path
        self.rate = 0.0
        if dur > 0 and early > 0:
            self.rate = early / dur
            net.stream(path, t, self.rate)
            req.tail_bytes = last * self.byte_scale
        else:
            req.tail_bytes = req.kv_wire * self.byte_scale
        self.ends_at = t + dur
        self.version += 1
        self.sim.loop.at(self.ends_at, PREFILL, self._end, (req, self.version))

    def _arrived(self, version: int) -> None:
        if version == self.version and self.queue.current is None and not self.paused:
            self._next(self.sim.loop.now)

    def _end(self, arg: tuple[SimRequest, int]) -> None:
        req, version = arg
        if version != self.version:
            return
        if self.paused:
            self.late_end = True
            return
        self._finish(req, self.sim.loop.now)

    def _finish(self, req: SimRequest, t: float) -> None:
        job = self.queue.finish(t)
        assert job.request_id == req.rid and self.path is not None
        req.end = t
        req.life.apply(Event.END_PREFILL, t)
        path = self.path
        net = self.sim.net
        self.current, self.path = None, None
        self.version += 1
        net.end_stream(path, t, req.tail_bytes)
        self.sim.transfer_handed(req, path, net.position(path))
        self.completed += 1
        self._next(t)

    # -- requests given up, faults ---------------------------------------------------------------

    def abort(self, req: SimRequest, t: float) -> None:
        """The router gave up on the request: drop its job, or stop its compute and its KV."""
        if self.queue.remove(req.rid):
            self.pending.pop(req.rid, None)
            return
        if self.blocked is req:
            self.blocked = None
        elif self.current is req:
            assert self.path is not None
            self.sim.net.end_stream(self.path, t, 0.0)
            self.current, self.path = None, None
            self.version += 1
            self.late_end = False
        else:
            return
        self.queue.finish(t)
        if not self.paused:
            self._next(t)

    def pause(self, t: float) -> None:
        if self.paused:
            return
        self.paused, self.paused_at = True, t
        if self.current is not None and self.path is not None and self.rate > 0:
            self.sim.net.stream(self.path, t, 0.0)

    def resume(self, t: float) -> None:
        if not self.paused:
            return
        self.paused = False
        req = self.current
        if req is not None and self.path is not None:
            net = self.sim.net
            if self.rate > 0:
                # The layers whose time passed while it was stopped go at once.
                net.push(self.path, t, self.rate * (min(self.ends_at, t) - self.paused_at))
                if self.ends_at > t:
                    net.stream(self.path, t, self.rate)
            if self.late_end:
                self.late_end = False
                self._finish(req, t)
            return
        if self.blocked is not None and self.blocked.moved:
            req, self.blocked = self.blocked, None
            self._compute(req, t)
        elif self.queue.current is None:
            self._next(t)

    def kill(self, t: float) -> list[SimRequest]:
        """The process is gone with its queue; returns the requests it held (the caller fails
        them and drops what its senders had not delivered)."""
        held = list(self.pending.values())
        for r in (self.blocked, self.current):
            if r is not None:
                held.append(r)
        if self.current is not None and self.path is not None and self.rate > 0 and not self.paused:
            self.sim.net.stream(self.path, t, 0.0)
        self.pending.clear()
        self.blocked = self.current = None
        self.path = None
        self.queue = PrefillQueue()
        self.version += 1
        self.paused = self.late_end = False
        return held

    @property
    def running(self) -> bool:
        return self.current is not None or self.blocked is not None
