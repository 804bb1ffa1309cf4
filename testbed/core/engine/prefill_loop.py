"""One prefill instance's job lifecycle (I/O-free): which job starts when, what a slowed instance's
job takes, when a job waits for a cached prefix moved in from another cluster, and what giving up
on a request, pausing and killing the instance do. The live prefill node
(`testbed.live.prefill_node`) sleeps until each layer's deadline; the simulator
(`testbed.sim.prefill`) schedules the compute's end and streams the KV into its flow network. Both
drive this class, so both decide a prefill's lifecycle the same way.

The states of a job: queued (FCFS, `PrefillQueue`) -> started, either computing or blocked (its
moved-in prefix has not arrived; the instance is held, as attention needs that prefix) -> ended
(`finish`) or given up (`abort`, `fail`, `kill`). One job holds the instance at a time; the
slowdown in force when it starts multiplies its modelled duration. Layer i of n has its KV at
`start + duration * (i + 1) / n` (`layer_ready`).

With a batching scheduler (`testbed.core.engine.prefill_batch`, `batching` true) the instance
runs forward passes instead: each carries chunks of several jobs, a job is started at its first
pass and ends with its last, and a job waiting for a moved-in prefix stays queued (it holds
nothing), as does a job whose cached prefix another job here is still computing (`after`: an
engine's prompt finds the blocks its running prompts computed once they are; one prompt at a
time in FCFS order gives that alone). Driving it then:
    got = loop.next_pass(now)      # a `PrefillPass`, a time to try again, None (idle, or paused)
    ... until got.end ...
    done = loop.end_pass(now)      # the jobs whose last chunk it computed

Driving it (fcfs):
    loop.submit(job, now)
    got = loop.start_next(now)     # a job (computing, or `loop.blocked`), a time to try again, None
    loop.prefix_arrived(rid, now)  # the blocked job computes from now (returned)
    loop.finish(now)               # the computing job's compute ended
"""

from __future__ import annotations

from enum import Enum

from testbed.core.engine.prefill_batch import BatchPolicy, PassStats, PrefillPass, plan_pass
from testbed.core.engine.prefill_queue import PrefillJob, PrefillQueue
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.fault_timeline import SlowDown

# Wire seconds a blocked job waits for its moved-in prefix before failing (the live node and the
# simulator alike).
CACHE_IN_TIMEOUT_S = 120.0


class Dropped(Enum):
    """Where a request given up on was (`PrefillLoop.abort`)."""

    QUEUED = "queued"  # removed from the queue; nothing ran
    BLOCKED = "blocked"  # held the instance waiting for its moved-in prefix
    COMPUTING = "computing"  # its compute stopped; its driver stops its KV stream


def layer_ready(job: PrefillJob, layer: int, layers: int) -> float:
    """When layer `layer` (0-based) of `layers` has its KV: its share of the compute has passed."""
    assert job.started_at is not None
    return job.started_at + job.duration * (layer + 1) / layers


class PrefillLoop:
    def __init__(
        self,
        slow: SlowDown | None = None,
        batch: BatchPolicy | None = None,
        time: PrefillTime | None = None,
        time_scale: float = 1.0,
    ) -> None:
        if batch is not None and time is None:
            raise ValueError("a batching prefill scheduler needs the hardware's step times")
        self.batch = batch
        self.time = time
        self.time_scale = time_scale  # batched passes' modelled seconds are divided by this (speedup)
        self.active: list[PrefillJob] = []  # batched: started, not ended (oldest first)
        self.inflight: PrefillPass | None = None  # batched: the pass computing
        self.stats = PassStats()
        self.queue = PrefillQueue()
        self.slow = slow if slow is not None else SlowDown()
        self.blocked: PrefillJob | None = None  # started, waiting for its moved-in prefix
        self.computing: PrefillJob | None = None
        self.paused = False
        self.completed = 0
        self._arrived: set[str] = set()  # requests whose moved-in prefix is here

    @property
    def batching(self) -> bool:
        return self.batch is not None

    @property
    def busy(self) -> bool:
        """A job holds the instance (computing or blocked), or a batched pass computes."""
        return self.queue.current is not None or self.inflight is not None

    # -- batched passes ----------------------------------------------------------------------

    def next_pass(self, now: float) -> PrefillPass | float | None:
        """On an idle, running, batching instance: the next pass, started at `now`; or the time
        the first call still on its way reaches the instance (try again then); or None."""
        assert self.batch is not None and self.time is not None
        if self.inflight is not None or self.paused:
            return None
        ready, later = [], None
        waiting = self.queue.waiting()
        computing: set[str] | None = None  # ids not ended here, read once a job waits on one
        for j in waiting:
            if j.queued_at > now:
                later = j.queued_at if later is None else min(later, j.queued_at)
            elif j.awaits_prefix and j.request_id not in self._arrived:
                continue
            elif j.after:
                if computing is None:
                    computing = {x.request_id for x in waiting} | {x.request_id for x in self.active}
                if j.after not in computing:
                    ready.append(j)
            else:
                ready.append(j)
        chunks = plan_pass(self.active, ready, self.batch)
        if not chunks:
            return later
        fresh = [j for j, _ in chunks if j.passes == 0]
        self.queue.take(fresh)
        self.active.extend(fresh)
        dur = self.time.pass_time([(j.done, n, j.cached_tokens) for j, n in chunks]) / self.time_scale
        dur *= self.slow.at(now)
        p = PrefillPass(now, dur, chunks)
        for j, n in chunks:
            if j.passes == 0:
                j.started_at = now
            j.done += n
            j.passes += 1
            j.pass_start, j.pass_s = now, dur
            if j.done >= j.uncached_tokens:
                p.done.append(j)
        st = self.stats
        st.passes += 1
        st.tokens += p.tokens
        st.chunks += len(chunks)
        st.busy_s += dur
        st.max_tokens = max(st.max_tokens, p.tokens)
        st.max_prompts = max(st.max_prompts, len(chunks))
        self.inflight = p
        return p

    def end_pass(self, now: float) -> list[PrefillJob]:
        """The pass computing ended: the jobs whose last chunk it computed (given up ones left out)."""
        p = self.inflight
        assert p is not None
        self.inflight = None
        done = [j for j in p.done if j in self.active]
        for j in done:
            self.active.remove(j)
            self._arrived.discard(j.request_id)
        self.completed += len(done)
        self.stats.prompts += len(done)
        return done

    def drop(self, request_id: str) -> PrefillJob | None:
        """Batched: a started job failed or was given up: it computes no further."""
        for j in self.active:
            if j.request_id == request_id:
                self.active.remove(j)
                self._arrived.discard(request_id)
                return j
        return None

    # -- one job at a time (fcfs) --------------------------------------------------------------

    def submit(self, job: PrefillJob, now: float) -> None:
        """Queue `job`; its call reaches the instance at `now` (a simulator may submit a call
        still on its way: `start_next` waits for it)."""
        self.queue.push(job, now)

    def start_next(self, now: float) -> PrefillJob | float | None:
        """On an idle, running instance: the head job, started at `now` (computing, or `blocked`
        until its moved-in prefix is here); or the time the head's call reaches the instance, if
        it is still on its way (try again then); or None (nothing to start)."""
        if self.busy or self.paused:
            return None
        head = self.queue.head
        if head is None:
            return None
        if head.queued_at > now:
            return head.queued_at
        job = self.queue.start_next(now, self.slow.at(now))
        assert job is not None
        if job.awaits_prefix and job.request_id not in self._arrived:
            self.blocked = job
        else:
            self._compute(job, now)
        return job

    def prefix_arrived(self, request_id: str, now: float) -> PrefillJob | None:
        """The cached prefix moved in for `request_id` is here: its job, if it was blocked on it
        (and the instance is not paused), computes from `now` and is returned."""
        self._arrived.add(request_id)
        job = self.blocked
        if job is None or job.request_id != request_id or self.paused:
            return None
        self.blocked = None
        self._compute(job, now)
        return job

    def finish(self, now: float) -> PrefillJob:
        """The computing job's compute ended: the instance is free."""
        job = self.queue.finish(now)
        assert job is self.computing
        self.computing = None
        self._arrived.discard(job.request_id)
        self.completed += 1
        return job

    def abort(self, request_id: str, now: float) -> Dropped | None:
        """The router gave up on `request_id`: drop its job or stop it (None: not held here)."""
        self._arrived.discard(request_id)
        if self.queue.remove(request_id):
            return Dropped.QUEUED
        if self.batching:
            return Dropped.COMPUTING if self.drop(request_id) is not None else None
        if self.blocked is not None and self.blocked.request_id == request_id:
            self.blocked = None
            self.queue.finish(now)
            return Dropped.BLOCKED
        if self.computing is not None and self.computing.request_id == request_id:
            self.computing = None
            self.queue.finish(now)
            return Dropped.COMPUTING
        return None

    def fail(self, now: float) -> PrefillJob | None:
        """The job holding the instance failed (its transfer, its moved prefix): free the instance."""
        if self.queue.current is None:
            return None
        job = self.queue.finish(now)
        self.blocked = self.computing = None
        self._arrived.discard(job.request_id)
        return job

    def pause(self) -> bool:
        """The process stopped (SIGSTOP): nothing starts until `resume`. False if already paused."""
        if self.paused:
            return False
        self.paused = True
        return True

    def resume(self, now: float) -> PrefillJob | float | None:
        """The process runs again. A computing job goes on (its driver decides what its end does;
        None). A blocked job whose prefix arrived meanwhile computes from `now`; an idle instance
        starts its next job: either is returned as `start_next` returns it."""
        self.paused = False
        if self.computing is not None or self.batching:  # a batching driver asks `next_pass`
            return None
        job = self.blocked
        if job is not None:
            return self.prefix_arrived(job.request_id, now) if job.request_id in self._arrived else None
        return self.start_next(now)

    def kill(self) -> None:
        """The process is gone with its queue (its driver fails the requests it held)."""
        self.queue = PrefillQueue()
        self.blocked = self.computing = None
        self.active, self.inflight = [], None
        self.paused = False
        self._arrived.clear()

    def _compute(self, job: PrefillJob, now: float) -> None:
        job.started_at = now
        self.computing = job
