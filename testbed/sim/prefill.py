"""A prefill instance in virtual time, as `testbed.live.prefill_node` runs one.

The core `PrefillLoop` decides each job's lifecycle, as for the live node: FCFS, one at a time;
a slowdown in force when a job starts multiplies its duration; a job whose cached prefix is being
moved in from another cluster holds the instance until the move has arrived, then computes. Layer i's KV exists when
i + 1 of the n layers' shares of the modelled compute have passed; the transport sends what
exists, so KV streams into the path to the decode node while the prefill computes. The
simulator releases the first n - 1 layers as a steady stream over the compute (the path's queue
stays empty while the link keeps up, and holds the same bytes at the end when it does not) and
the last layer at once when compute ends: what is left to send then is the transfer tail TTFT
pays. Under vLLM's protocol (`layerwise` False) nothing streams: the KV is held when compute
ends, for the decode node to pull (`testbed.sim.transfer`).

With a batching scheduler (`testbed.core.engine.prefill_batch`) the instance runs forward
passes: a prompt's KV streams over its last pass (`last_pass_layer_ready`), the prompts a pass
ends streaming to the same decode node one after the other in the path's byte order, and each
prompt's last layer enters at the pass's end.

Faults: a paused instance (SIGSTOP) computes and sends nothing; on resume the layers whose time
has passed go at once and the compute ends at its planned time or at once if that has passed
(the live node's layer deadlines are absolute). A killed one loses its queue; its requests are
the caller's to fail (`kill` returns them).
"""

from __future__ import annotations

from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.prefill_batch import BatchPolicy, PrefillPass, last_pass_layer_ready
from testbed.core.engine.prefill_loop import Dropped, PrefillLoop, layer_ready
from testbed.core.engine.prefill_queue import PrefillJob, PrefillQueue
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.fault_timeline import SlowDown
from testbed.core.lifecycle import Event
from testbed.core.schema.hardware import SchedulerSpec
from testbed.core.schema.topology import NodeSpec
from testbed.sim.events import PREFILL
from testbed.sim.host import Host
from testbed.sim.net_view import PathHandle
from testbed.sim.request import SimRequest


class PrefillSim:
    __slots__ = (
        "node",
        "sim",
        "loop",
        "time",
        "kv",
        "byte_scale",
        "pending",
        "blocked",
        "current",
        "path",
        "version",
        "paused_at",
        "rate",
        "ends_at",
        "late_end",
        "started",
        "streams",
        "layerwise",
    )

    def __init__(
        self,
        node: NodeSpec,
        time: PrefillTime,
        kv: KVModel,
        byte_scale: float,
        sim: Host,
        scheduler: SchedulerSpec | None = None,
        layerwise: bool = True,
    ) -> None:
        self.node = node
        # False: the KV is held when the compute ends, for the decode node to pull (`testbed.sim.transfer`).
        self.layerwise = layerwise
        self.sim = sim
        self.loop = (
            PrefillLoop(None, BatchPolicy.from_spec(scheduler), time) if scheduler is not None else PrefillLoop()
        )
        self.started: dict[str, SimRequest] = {}  # batched: the requests of the loop's active jobs
        # batched: the present pass's KV streams, one per decode node: path, rate, tail bytes, requests
        self.streams: list[tuple[PathHandle, float, float, list[SimRequest]]] = []
        self.time = time
        self.kv = kv
        self.byte_scale = byte_scale
        self.pending: dict[str, SimRequest] = {}
        self.blocked: SimRequest | None = None  # the loop's blocked job's request
        self.current: SimRequest | None = None  # the loop's computing job's request
        self.path: PathHandle | None = None  # where the computing job's KV streams
        self.version = 0  # of the computing job's end event
        self.paused_at = 0.0
        self.rate = 0.0  # the computing job's KV stream (paper bytes/s)
        self.ends_at = 0.0  # its planned end
        self.late_end = False  # its end came while paused

    @property
    def queue(self) -> PrefillQueue:
        return self.loop.queue

    @property
    def slow(self) -> SlowDown:
        return self.loop.slow

    @property
    def paused(self) -> bool:
        return self.loop.paused

    @property
    def completed(self) -> int:
        return self.loop.completed

    def submit(self, req: SimRequest, t: float) -> None:
        """The router's call for `req` reaches the instance at `t` (now, or later: across the WAN)."""
        assert req.plan is not None
        d = req.plan.d
        job = PrefillJob(
            req.rid,
            d.incremental_tokens,
            d.cached_tokens,
            self.time(d.incremental_tokens, d.cached_tokens),
            awaits_prefix=d.cache_move is not None,
            after=d.prefix_after,
        )
        req.prefill_queued = t
        req.life.apply(Event.ENQUEUE_PREFILL, t)
        self.pending[req.rid] = req
        self.loop.submit(job, t)
        if not self.loop.busy and not self.loop.paused:
            self._next(self.sim.loop.now)

    def _next(self, t: float) -> None:
        if self.loop.batching:
            self._pass_next(t)
            return
        self._started(self.loop.start_next(t), t)

    # -- batched passes ----------------------------------------------------------------------------

    def _pass_next(self, t: float) -> None:
        got = self.loop.next_pass(t)
        if got is None:
            return
        if isinstance(got, float):
            self.version += 1
            self.sim.loop.at(got, PREFILL, self._arrived, self.version)
            return
        self._run_pass(got, t)

    def _run_pass(self, p: PrefillPass, t: float) -> None:
        for j, _ in p.chunks:
            if j.passes == 1:  # its first chunk
                req = self.pending.pop(j.request_id)
                req.job, req.prefill_modelled, req.prefill_start = j, j.duration, t
                req.life.apply(Event.START_PREFILL, t)
                self.started[j.request_id] = req
        n, bs, dur, net = self.kv.layers, self.byte_scale, p.duration, self.sim.net
        groups: dict[str, list[SimRequest]] = {}
        for j in p.done:
            req = self.started[j.request_id]
            assert req.plan is not None
            # What the run is held to: its planned span from its first pass to its last's end.
            assert j.started_at is not None
            req.prefill_modelled = j.pass_start + j.pass_s - j.started_at
            if self.layerwise:
                req.transfer_start = last_pass_layer_ready(j, 0, n)
                req.life.apply(Event.TRANSFER_START, req.transfer_start)
            groups.setdefault(req.plan.d.decode_node, []).append(req)
        self.streams = []
        if not self.layerwise:
            # vLLM's protocol: each prompt's KV is held from its last pass's end for the pull.
            for dst, reqs in groups.items():
                for req in reqs:
                    assert req.plan is not None
                    total, _ = self.kv.shipped(req.tr.input_tokens, req.plan.d.decode_cached_tokens, bs)
                    req.kv_bytes_wire, req.tail_bytes = total, total * bs
                self.streams.append((net.path(self.node.id, dst), 0.0, 0.0, reqs))
            groups = {}
        for dst, reqs in groups.items():
            path = net.path(self.node.id, dst)
            lo, early_sum, tails = net.position(path), 0.0, 0.0
            for req in reqs:
                assert req.plan is not None
                total, last = self.kv.shipped(req.tr.input_tokens, req.plan.d.decode_cached_tokens, bs)
                req.kv_bytes_wire = total
                req.kv_range = (lo, lo + total * bs)
                lo += total * bs
                early = (total - last) * bs
                if dur > 0 and early > 0:
                    early_sum += early
                    req.tail_bytes = last * bs
                else:
                    req.tail_bytes = total * bs
                tails += req.tail_bytes
            rate = early_sum / dur if dur > 0 else 0.0
            if rate > 0:
                net.stream(path, t, rate)
            self.streams.append((path, rate, tails, reqs))
        self.ends_at = p.end
        self.version += 1
        self.sim.loop.at(p.end, PREFILL, self._pass_end, self.version)

    def _pass_end(self, version: int) -> None:
        if version != self.version:
            return
        if self.loop.paused:
            self.late_end = True
            return
        self._finish_pass(self.sim.loop.now)

    def _finish_pass(self, t: float) -> None:
        done = {j.request_id for j in self.loop.end_pass(t)}
        net = self.sim.net
        for path, _, tails, reqs in self.streams:
            # A request given up on mid-pass leaves its bytes in the stream (they cross for nothing).
            if self.layerwise:
                net.end_stream(path, t, tails)
            for req in reqs:
                if req.rid not in done:
                    continue
                self.started.pop(req.rid, None)
                req.prefill_end = t
                req.life.apply(Event.END_PREFILL, t)
                if not self.layerwise:
                    self.sim.kv_held(req, path, t)
                    continue
                assert req.kv_range is not None
                self.sim.transfer_handed(req, path, req.kv_range[1])
        self.streams = []
        self.version += 1
        self._next(t)

    def _started(self, got: PrefillJob | float | None, t: float) -> None:
        if got is None:
            return
        if isinstance(got, float):
            # Its call is still on its way: start it when it is here (if nothing else starts first).
            self.version += 1
            self.sim.loop.at(got, PREFILL, self._arrived, self.version)
            return
        req = self.pending.pop(got.request_id)
        req.job = got
        req.prefill_modelled = got.duration
        if self.loop.blocked is got:
            self.blocked = req
            return
        self._compute(req, t)

    def move_arrived(self, req: SimRequest, t: float) -> None:
        """The cached prefix moved in for `req` is here."""
        req.moved = True
        req.cache_move_end = t
        if self.loop.prefix_arrived(req.rid, t) is not None:
            self.blocked = None
            self._compute(req, t)
        elif self.loop.batching and not self.loop.busy and not self.loop.paused:
            self._next(t)

    def _compute(self, req: SimRequest, t: float) -> None:
        job = req.job
        assert job is not None and req.plan is not None and job.started_at == t
        if not self.layerwise:
            self._compute_held(req, job, t)
            return
        d = req.plan.d
        dur = job.duration
        n = self.kv.layers
        req.prefill_start = t
        req.transfer_start = layer_ready(job, 0, n)
        req.life.apply(Event.START_PREFILL, t)
        req.life.apply(Event.TRANSFER_START, req.transfer_start)
        # The wire bytes `kv.layer_bytes` gives the live sender: their total and the last layer.
        total, last = self.kv.shipped(req.tr.input_tokens, d.decode_cached_tokens, self.byte_scale)
        req.kv_bytes_wire = total
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
            req.tail_bytes = req.kv_bytes_wire * self.byte_scale
        self.ends_at = t + dur
        self.version += 1
        self.sim.loop.at(self.ends_at, PREFILL, self._end, (req, self.version))

    def _compute_held(self, req: SimRequest, job: PrefillJob, t: float) -> None:
        """Compute without sending: the KV is held from the end until the decode node pulls it."""
        assert req.plan is not None
        req.prefill_start = t
        req.life.apply(Event.START_PREFILL, t)
        total, _ = self.kv.shipped(req.tr.input_tokens, req.plan.d.decode_cached_tokens, self.byte_scale)
        req.kv_bytes_wire = total
        req.tail_bytes = total * self.byte_scale
        self.current, self.path = req, self.sim.net.path(self.node.id, req.plan.d.decode_node)
        self.rate = 0.0
        self.ends_at = t + job.duration
        self.version += 1
        self.sim.loop.at(self.ends_at, PREFILL, self._end, (req, self.version))

    def _arrived(self, version: int) -> None:
        if version == self.version and not self.loop.busy and not self.loop.paused:
            self._next(self.sim.loop.now)

    def _end(self, arg: tuple[SimRequest, int]) -> None:
        req, version = arg
        if version != self.version:
            return
        if self.loop.paused:
            self.late_end = True
            return
        self._finish(req, self.sim.loop.now)

    def _finish(self, req: SimRequest, t: float) -> None:
        job = self.loop.finish(t)
        assert job.request_id == req.rid and self.path is not None
        req.prefill_end = t
        req.life.apply(Event.END_PREFILL, t)
        path = self.path
        net = self.sim.net
        self.current, self.path = None, None
        self.version += 1
        if self.layerwise:
            net.end_stream(path, t, req.tail_bytes)
            self.sim.transfer_handed(req, path, net.position(path))
        else:
            self.sim.kv_held(req, path, t)
        self._next(t)

    # -- requests given up, faults ---------------------------------------------------------------

    def abort(self, req: SimRequest, t: float) -> None:
        """The router gave up on the request: drop its job, or stop its compute and its KV."""
        how = self.loop.abort(req.rid, t)
        if how is None:
            return
        if how is Dropped.QUEUED:
            self.pending.pop(req.rid, None)
            return
        if self.loop.batching:  # its chunks stop; the pass in flight runs on
            self.started.pop(req.rid, None)
            return
        if how is Dropped.BLOCKED:
            self.blocked = None
        else:
            assert self.current is req and self.path is not None
            self.sim.net.end_stream(self.path, t, 0.0)
            self.current, self.path = None, None
            self.version += 1
            self.late_end = False
        if not self.loop.paused:
            self._next(t)

    def pause(self, t: float) -> None:
        if not self.loop.pause():
            return
        self.paused_at = t
        for path, rate, _, _ in self.streams:
            if rate > 0:
                self.sim.net.stream(path, t, 0.0)
        if self.current is not None and self.path is not None and self.rate > 0:
            self.sim.net.stream(self.path, t, 0.0)

    def resume(self, t: float) -> None:
        if not self.loop.paused:
            return
        if self.loop.batching:
            self.loop.resume(t)
            if self.loop.inflight is None:
                self._next(t)
                return
            net = self.sim.net
            for path, rate, _, _ in self.streams:
                if rate > 0:  # the layers whose time passed while it was stopped go at once
                    net.push(path, t, rate * (min(self.ends_at, t) - self.paused_at))
                    if self.ends_at > t:
                        net.stream(path, t, rate)
            if self.late_end:
                self.late_end = False
                self._finish_pass(t)
            return
        req = self.current
        if req is not None and self.path is not None:
            self.loop.resume(t)
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
        blocked = self.blocked
        got = self.loop.resume(t)
        if got is None:
            return
        if blocked is not None and got is blocked.job:
            self.blocked = None
            self._compute(blocked, t)
            return
        self._started(got, t)

    def kill(self, t: float) -> list[SimRequest]:
        """The process is gone with its queue; returns the requests it held (the caller fails
        them and drops what its senders had not delivered)."""
        held = list(self.pending.values()) + list(self.started.values())
        for r in (self.blocked, self.current):
            if r is not None:
                held.append(r)
        if not self.loop.paused:
            for path, rate, _, _ in self.streams:
                if rate > 0:
                    self.sim.net.stream(path, t, 0.0)
        self.started.clear()
        self.streams = []
        if self.current is not None and self.path is not None and self.rate > 0 and not self.loop.paused:
            self.sim.net.stream(self.path, t, 0.0)
        self.pending.clear()
        self.blocked = self.current = None
        self.path = None
        self.loop.kill()
        self.version += 1
        self.late_end = False
        return held

    @property
    def running(self) -> bool:
        return self.current is not None or self.blocked is not None or self.loop.inflight is not None
