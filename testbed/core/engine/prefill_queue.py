"""FCFS prefill queue of one instance: one prefill at a time, as long-context prefills run
(chunked prefill of a single long prompt already fills the instance). The instance's lifecycle
around it is `testbed.core.engine.prefill_loop.PrefillLoop`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class PrefillJob:
    request_id: str
    uncached_tokens: int
    cached_tokens: int
    duration: float  # modelled, in the driver's time unit
    queued_at: float = 0.0
    started_at: float | None = None
    awaits_prefix: bool = False  # a cached prefix moved in from another cluster must arrive first
    after: str = ""  # a request on this instance computing the end of the cached prefix: it ends first
    # Batched passes (`testbed.core.engine.prefill_batch`): uncached tokens computed so far, the
    # passes it was in, and its last pass's start and modelled time.
    done: int = 0
    passes: int = 0
    pass_start: float = 0.0
    pass_s: float = 0.0


class PrefillQueue:
    def __init__(self) -> None:
        self._q: deque[PrefillJob] = deque()
        self.current: PrefillJob | None = None
        self._busy_until = 0.0

    def push(self, job: PrefillJob, now: float) -> None:
        job.queued_at = now
        self._q.append(job)

    def start_next(self, now: float, slow: float = 1.0) -> PrefillJob | None:
        """Start the head job if the instance is idle; returns it (its end is now + duration).
        `slow` multiplies its modelled duration (a slowed instance, see `testbed.core.fault_timeline`)."""
        if self.current is not None or not self._q:
            return None
        job = self._q.popleft()
        job.started_at = now
        job.duration *= slow
        self.current = job
        self._busy_until = now + job.duration
        return job

    def finish(self, now: float) -> PrefillJob:
        if self.current is None:
            raise RuntimeError("finish() with no prefill running")
        job, self.current = self.current, None
        return job

    @property
    def head(self) -> PrefillJob | None:
        """The job that starts next (None: none waits)."""
        return self._q[0] if self._q else None

    def waiting(self) -> list[PrefillJob]:
        """The waiting jobs, oldest first."""
        return list(self._q)

    def take(self, jobs: list[PrefillJob]) -> None:
        """`jobs` (waiting) start in a batched pass: they leave the queue."""
        gone = {id(j) for j in jobs}
        self._q = deque(j for j in self._q if id(j) not in gone)

    def remove(self, request_id: str) -> bool:
        for job in self._q:
            if job.request_id == request_id:
                self._q.remove(job)
                return True
        return False

    @property
    def depth(self) -> int:
        """Waiting jobs (not counting the one running)."""
        return len(self._q)

    def waiting_work(self) -> float:
        """Modelled work of the jobs waiting (not counting the one running)."""
        return sum(j.duration for j in self._q)

    def backlog(self, now: float) -> float:
        """Modelled work left: the running job's remainder plus every waiting job."""
        rest = max(self._busy_until - now, 0.0) if self.current else 0.0
        return rest + sum(j.duration for j in self._q)

    def samples(self, kv_backlog_bytes: float, kv_bytes_sent: float) -> list[tuple[str, float, dict[str, str]]]:
        """The prefill instance's time-series samples (its sender's KV backlog and bytes sent, wire)."""
        return [
            ("queue_depth", float(self.depth), {}),
            ("running", 1.0 if self.current is not None else 0.0, {}),
            ("kv_backlog_bytes", float(kv_backlog_bytes), {}),
            ("kv_bytes_sent", float(kv_bytes_sent), {}),
        ]
