"""The one prefill-instance lifecycle (`testbed.core.engine.prefill_loop`) that the live node and the
simulator both drive: FCFS, a slowdown fixed at start, blocking on a moved-in prefix, giving up
in each state, pause and kill."""

from __future__ import annotations

import pytest

from testbed.core.engine.prefill_loop import Dropped, PrefillLoop, layer_ready
from testbed.core.engine.prefill_queue import PrefillJob
from testbed.core.fault_timeline import SlowDown

pytestmark = pytest.mark.pure


def _job(rid: str, duration: float = 1.0, awaits_prefix: bool = False) -> PrefillJob:
    return PrefillJob(rid, 100, 0, duration, awaits_prefix=awaits_prefix)


def test_one_job_at_a_time_in_arrival_order() -> None:
    loop = PrefillLoop()
    loop.submit(_job("a"), 0.0)
    loop.submit(_job("b"), 0.1)
    a = loop.start_next(0.2)
    assert isinstance(a, PrefillJob) and a.request_id == "a" and loop.computing is a and a.started_at == 0.2
    assert loop.start_next(0.3) is None  # the instance is held
    assert loop.finish(1.2) is a and loop.completed == 1 and not loop.busy
    b = loop.start_next(1.2)
    assert isinstance(b, PrefillJob) and b.request_id == "b"


def test_layers_are_ready_at_their_share_of_the_compute() -> None:
    loop = PrefillLoop()
    loop.submit(_job("a", duration=4.0), 0.0)
    job = loop.start_next(1.0)
    assert isinstance(job, PrefillJob)
    assert [layer_ready(job, i, 4) for i in range(4)] == [2.0, 3.0, 4.0, 5.0]


def test_a_slowdown_in_force_at_start_stretches_the_job() -> None:
    slow = SlowDown()
    slow.set(3.0, 10.0)
    loop = PrefillLoop(slow)
    loop.submit(_job("a", duration=2.0), 0.0)
    job = loop.start_next(0.0)
    assert isinstance(job, PrefillJob) and job.duration == 6.0


def test_a_call_still_on_its_way_is_started_when_it_arrives() -> None:
    loop = PrefillLoop()
    loop.submit(_job("a"), 5.0)
    assert loop.start_next(4.0) == 5.0 and not loop.busy
    assert isinstance(loop.start_next(5.0), PrefillJob)


def test_a_job_waits_for_its_moved_prefix_holding_the_instance() -> None:
    loop = PrefillLoop()
    loop.submit(_job("a", awaits_prefix=True), 0.0)
    loop.submit(_job("b"), 0.0)
    a = loop.start_next(0.0)
    assert a is loop.blocked and loop.computing is None and loop.busy
    assert loop.start_next(1.0) is None
    assert loop.prefix_arrived("a", 2.0) is a and loop.computing is a and a.started_at == 2.0


def test_a_prefix_that_arrived_before_its_job_started_does_not_block_it() -> None:
    loop = PrefillLoop()
    loop.submit(_job("a", awaits_prefix=True), 0.0)
    assert loop.prefix_arrived("a", 0.5) is None
    a = loop.start_next(1.0)
    assert a is loop.computing and loop.blocked is None


@pytest.mark.parametrize("state", ["queued", "blocked", "computing"])
def test_giving_up_frees_what_the_job_held(state: str) -> None:
    loop = PrefillLoop()
    loop.submit(_job("a", awaits_prefix=state == "blocked"), 0.0)
    loop.submit(_job("b"), 0.0)
    rid = "b" if state == "queued" else "a"
    if state != "queued":
        loop.start_next(0.0)
    else:
        loop.start_next(0.0)
        loop.finish(1.0)
    assert loop.abort(rid, 1.5) is Dropped(state)
    assert loop.abort(rid, 1.5) is None  # not held any more
    assert not loop.busy
    assert loop.blocked is None and loop.computing is None


def test_a_paused_instance_starts_nothing_and_resumes_where_it_was() -> None:
    loop = PrefillLoop()
    assert loop.pause() and not loop.pause()
    loop.submit(_job("a", awaits_prefix=True), 0.0)
    assert loop.start_next(0.0) is None
    a = loop.resume(1.0)
    assert a is loop.blocked  # started on resume, still waiting for its prefix
    loop.pause()
    assert loop.prefix_arrived("a", 2.0) is None  # arrived while paused: computes on resume
    assert loop.resume(3.0) is a and a.started_at == 3.0


def test_a_failed_job_frees_the_instance_and_a_kill_forgets_everything() -> None:
    loop = PrefillLoop()
    loop.submit(_job("a"), 0.0)
    loop.submit(_job("b"), 0.0)
    a = loop.start_next(0.0)
    assert loop.fail(0.5) is a and not loop.busy and loop.fail(0.6) is None
    loop.start_next(0.6)
    loop.pause()
    loop.kill()
    assert not loop.busy and not loop.paused and loop.queue.depth == 0 and loop.start_next(1.0) is None
