"""The vLLM-like prefill scheduler (`testbed.core.engine.prefill_batch`) in the one prefill loop:
what a pass carries, what it takes by the stated rule on the single-prompt curve, and the
lifecycle of jobs across passes."""

from __future__ import annotations

import pytest

from testbed.core.engine.prefill_batch import BatchPolicy, last_pass_layer_ready, plan_pass
from testbed.core.engine.prefill_loop import Dropped, PrefillLoop
from testbed.core.engine.prefill_queue import PrefillJob
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.fault_timeline import SlowDown
from testbed.core.schema.hardware import SchedulerSpec, TablePrefill

pytestmark = pytest.mark.pure

# A convex curve with a fixed part: T(l) = 0.1 + l/10000 + (l/20000)^2, tabled, plus overhead.
CURVE = TablePrefill(
    kind="table",
    points=[(float(x), 0.1 + x / 1e4 + (x / 2e4) ** 2) for x in (1000, 4000, 8192, 16384, 32768, 65536)],
    overhead_s=0.2,
    cached_token_s=1e-6,
    cached_attention_s=1e-10,
)
TIME = PrefillTime.from_spec(CURVE)
POLICY = BatchPolicy(token_budget=8192, max_seqs=4, chunked=True)


def _job(rid: str, tokens: int, cached: int = 0, awaits_prefix: bool = False) -> PrefillJob:
    return PrefillJob(rid, tokens, cached, TIME(tokens, cached), awaits_prefix=awaits_prefix)


def test_the_policy_of_fcfs_is_none_and_vllm_takes_the_engine_knobs() -> None:
    assert BatchPolicy.from_spec(SchedulerSpec()) is None
    p = BatchPolicy.from_spec(SchedulerSpec(kind="vllm", max_num_batched_tokens=4096, chunked_prefill=False))
    assert p == BatchPolicy(4096, 256, False)


def test_a_whole_prompt_alone_takes_the_single_prompt_time() -> None:
    for tokens, cached in ((1000, 0), (5000, 2048), (30000, 0)):
        assert TIME.pass_time([(0, tokens, cached)]) == pytest.approx(TIME(tokens, cached), rel=1e-12)


def test_chunks_cost_their_increments_and_the_fixed_part_once_per_pass() -> None:
    fixed = TIME.fixed_time()
    whole = TIME(20000, 1000)
    chunks = [(0, 8192, 1000), (8192, 8192, 1000), (16384, 3616, 1000)]
    assert sum(TIME.pass_time([c]) for c in chunks) == pytest.approx(whole + 2 * fixed, rel=1e-9)
    # Batching short prompts shares the fixed part: cheaper than running them one by one.
    two = TIME.pass_time([(0, 2000, 0), (0, 3000, 0)])
    assert two == pytest.approx(TIME(2000) + TIME(3000) - fixed, rel=1e-9)
    assert two < TIME(2000) + TIME(3000)


def test_a_pass_fills_the_budget_running_prompts_first_then_fcfs() -> None:
    a, b, c, d = _job("a", 3000), _job("b", 2000), _job("c", 10000), _job("d", 100)
    a.done = 1000  # partly computed: continues first
    chunks = plan_pass([a], [b, c, d], POLICY)
    assert [(j.request_id, n) for j, n in chunks] == [("a", 2000), ("b", 2000), ("c", 4192)]
    # Chunked prefill off: the prompt that does not fit waits (nothing overtakes it) ...
    off = BatchPolicy(8192, 4, chunked=False)
    assert [(j.request_id, n) for j, n in plan_pass([], [b, c, d], off)] == [("b", 2000)]
    # ... and one longer than the whole budget goes alone.
    assert [(j.request_id, n) for j, n in plan_pass([], [c, d], off)] == [("c", 10000)]
    # At most max_seqs prompts a pass.
    many = [_job(str(i), 10) for i in range(6)]
    assert len(plan_pass([], many, POLICY)) == 4


def _loop(slow: SlowDown | None = None) -> PrefillLoop:
    return PrefillLoop(slow, POLICY, TIME)


def test_a_long_prompt_is_chunked_across_passes_and_short_ones_join() -> None:
    loop = _loop()
    loop.submit(_job("long", 20000), 0.0)
    loop.submit(_job("s1", 1000), 0.0)
    p1 = loop.next_pass(0.0)
    assert not isinstance(p1, float) and p1 is not None
    assert [(j.request_id, n) for j, n in p1.chunks] == [("long", 8192)] and not p1.done
    assert loop.next_pass(0.1) is None  # a pass is in flight
    assert loop.end_pass(p1.end) == []
    p2 = loop.next_pass(p1.end)
    assert not isinstance(p2, float) and p2 is not None
    assert [(j.request_id, n) for j, n in p2.chunks] == [("long", 8192)]
    loop.end_pass(p2.end)
    p3 = loop.next_pass(p2.end)
    assert not isinstance(p3, float) and p3 is not None
    assert [(j.request_id, n) for j, n in p3.chunks] == [("long", 3616), ("s1", 1000)]
    long, s1 = p3.chunks[0][0], p3.chunks[1][0]
    assert {j.request_id for j in p3.done} == {"long", "s1"}
    assert long.started_at == 0.0 and long.passes == 3 and s1.started_at == p2.end
    # Its layers stream over its last pass; the last layer is ready at the pass's end.
    assert last_pass_layer_ready(long, 3, 4) == pytest.approx(p3.end)
    assert last_pass_layer_ready(long, 1, 4) == pytest.approx(p3.start + p3.duration / 2)
    assert loop.end_pass(p3.end) == p3.done and loop.completed == 2 and not loop.busy
    st = loop.stats
    assert (st.passes, st.tokens, st.chunks, st.prompts, st.max_prompts) == (3, 21000, 4, 2, 2)
    assert st.busy_s == pytest.approx(p1.duration + p2.duration + p3.duration)


def test_a_prompt_waiting_for_its_moved_prefix_holds_nothing() -> None:
    loop = _loop()
    loop.submit(_job("moved", 1000, cached=4096, awaits_prefix=True), 0.0)
    loop.submit(_job("plain", 1000), 0.0)
    p = loop.next_pass(0.0)
    assert not isinstance(p, float) and p is not None
    assert [j.request_id for j, _ in p.chunks] == ["plain"]
    loop.end_pass(p.end)
    assert loop.next_pass(p.end) is None  # waits for its prefix
    assert loop.prefix_arrived("moved", p.end + 1) is None
    q = loop.next_pass(p.end + 1)
    assert not isinstance(q, float) and q is not None and [j.request_id for j, _ in q.chunks] == ["moved"]


def test_a_prompt_whose_prefix_another_here_computes_waits_for_its_last_pass() -> None:
    loop = _loop()
    loop.submit(_job("parent", 12000), 0.0)
    child = PrefillJob("child", 1000, 12000, TIME(1000, 12000), after="parent")
    loop.submit(child, 0.0)
    loop.submit(_job("other", 1000), 0.0)
    p1 = loop.next_pass(0.0)
    assert not isinstance(p1, float) and p1 is not None
    assert [j.request_id for j, _ in p1.chunks] == ["parent"]  # 8,192 of 12,000: the budget
    loop.end_pass(p1.end)
    p2 = loop.next_pass(p1.end)
    assert not isinstance(p2, float) and p2 is not None
    # The parent's last chunk and the unrelated prompt share the pass; the child is not in it.
    assert [j.request_id for j, _ in p2.chunks] == ["parent", "other"]
    assert [j.request_id for j in loop.end_pass(p2.end)] == ["parent", "other"]
    p3 = loop.next_pass(p2.end)
    assert not isinstance(p3, float) and p3 is not None and [j.request_id for j, _ in p3.chunks] == ["child"]
    # A holder given up on (not here any more) holds nobody back.
    loop.end_pass(p3.end)
    loop.submit(PrefillJob("orphan", 1000, 4096, TIME(1000, 4096), after="gone"), p3.end)
    p4 = loop.next_pass(p3.end)
    assert not isinstance(p4, float) and p4 is not None and [j.request_id for j, _ in p4.chunks] == ["orphan"]


def test_a_call_on_its_way_is_waited_for_and_a_slowdown_stretches_the_pass() -> None:
    slow = SlowDown()
    slow.set(2.0, None)
    loop = _loop(slow)
    loop.submit(_job("a", 1000), 5.0)
    assert loop.next_pass(1.0) == 5.0
    p = loop.next_pass(5.0)
    assert not isinstance(p, float) and p is not None
    assert p.duration == pytest.approx(2 * TIME(1000))


def test_giving_up_on_a_prompt_in_any_state() -> None:
    loop = _loop()
    loop.submit(_job("long", 20000), 0.0)
    loop.submit(_job("queued", 9000), 0.0)
    p = loop.next_pass(0.0)
    assert not isinstance(p, float) and p is not None
    assert loop.abort("queued", 0.1) is Dropped.QUEUED
    assert loop.abort("long", 0.1) is Dropped.COMPUTING  # its remaining chunks are not computed
    assert loop.abort("nobody", 0.1) is None
    assert loop.end_pass(p.end) == [] and loop.next_pass(p.end) is None and loop.completed == 0
