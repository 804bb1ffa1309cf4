"""The vLLM-like decode batch (`testbed.core.engine.decode_blocks`): admission by KV blocks,
preemption by recompute when they run out, step by step and many steps at once alike; and a
simulated decode pool driven past its blocks says which requests were preempted and for how long."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from testbed.core.engine.decode_batch import AdmissionError, DecodeSeq
from testbed.core.engine.decode_blocks import BlockBatch
from testbed.core.engine.decode_loop import DecodeLoop
from testbed.core.engine.servicetime import DecodeStepTime
from testbed.metrics.preemptions import PREEMPTIONS_CSV, read_preemptions
from testbed.metrics.records import read_records
from testbed.run.load import load
from testbed.run.runner import run_replay_async
from testbed.traces.types import Trace, TraceRequest

STEP = DecodeStepTime(0.01, 0.001, 0.0)


def _recompute(tokens: int) -> float:
    return 0.5 + tokens * 1e-3


def _batch(blocks: int = 10, block: int = 4) -> BlockBatch:
    return BlockBatch(STEP, 8, blocks, block, 100, _recompute)


def _seq(rid: str, context: int, out: int) -> DecodeSeq:
    return DecodeSeq(rid, context, out, 0)


@pytest.mark.pure
def test_admission_takes_the_blocks_held_now_not_the_whole_output() -> None:
    b = _batch(blocks=10)
    b.submit(_seq("a", 7, 20))  # 7 tokens + the next: 2 blocks, though 27 tokens take 7
    b.submit(_seq("b", 11, 20))  # 3 blocks
    assert [s.request_id for s in b.admit(0.0)] == ["a", "b"]
    assert b.free == 5 and b.kv_used == 500
    with pytest.raises(AdmissionError, match="needs 11 KV blocks to finish"):
        b.submit(_seq("huge", 30, 12))


@pytest.mark.pure
def test_running_out_of_blocks_preempts_the_latest_and_it_rejoins_with_its_recompute() -> None:
    b = _batch(blocks=7)
    b.submit(_seq("a", 7, 20))
    b.submit(_seq("b", 7, 20))
    b.admit(0.0)  # 2 + 2 blocks
    loop_steps = 0
    while not b.preemptions:
        b.complete_step()
        loop_steps += 1
        b.admit(float(loop_steps))
    p = b.preemptions[0]
    # After 5 steps each holds 12 tokens (3 blocks): the 13th needs a 4th for each, 2 free -> b goes.
    assert (p.request_id, p.at, p.tokens, loop_steps) == ("b", 5.0, 12, 5)
    assert [s.request_id for s in b.running] == ["a"] and b.waiting[0].request_id == "b"
    while p.resumed_at is None:
        b.complete_step()
        loop_steps += 1
        b.admit(float(loop_steps))
    assert p.resumed_at == 20.0  # a finished (20 tokens) and freed its blocks
    assert p.recompute_s == pytest.approx(_recompute(12))
    assert b.step_duration() == pytest.approx(STEP(1, 0) + _recompute(12))  # the rejoining step
    b.complete_step()
    assert b.step_duration() == pytest.approx(STEP(1, 0))
    assert b.running[0].generated == 6


def _drive(b: BlockBatch, many: bool) -> list[tuple[str, float]]:
    """Run to the end with `DecodeLoop`, one step at a time or many at once; (request, finish time)."""
    loop, t, out = DecodeLoop(b), 0.0, []
    while not b.idle:
        _, end = loop.begin(t)
        assert end is not None
        if many:
            m = b.steps_to_finish()
            t = loop.step_start + loop.span(m) if loop.step_start is not None else t
            done = [s.request_id for s in loop.run_finished(m)]
        else:
            t = end
            done = [r.seq.request_id for r in loop.end_step() if r.finished]
        out += [(rid, round(t, 9)) for rid in done]
    return out


@pytest.mark.pure
def test_many_steps_at_once_decide_as_one_at_a_time() -> None:
    def fresh() -> BlockBatch:
        b = _batch(blocks=9, block=4)
        for i, (ctx, out) in enumerate([(7, 20), (3, 9), (12, 15), (5, 30)]):
            b.submit(_seq(f"r{i}", ctx, out))
        return b

    one, many = fresh(), fresh()
    assert _drive(one, many=False) == _drive(many, many=True)
    assert [p.request_id for p in one.preemptions] == [p.request_id for p in many.preemptions]
    for p, q in zip(one.preemptions, many.preemptions):
        assert (p.at, p.resumed_at) == pytest.approx((q.at, q.resumed_at), rel=1e-9)
    assert one.preemptions  # the pool ran out


@pytest.mark.app
def test_a_simulated_decode_pool_past_its_blocks_preempts_and_says_who_and_for_how_long(tmp_path: Path) -> None:
    # One decode instance whose KV holds ~40K tokens, four requests of 12K tokens generating 2K
    # each arriving together: all are admitted (12K each), then their growth runs the pool dry.
    rs = load(
        "paper-homogeneous",
        {
            "clusters": [
                {"name": "pd", "datacenter": "dc-local", "kind": "pd", "hardware": "h20", "prefill": 4, "decode": 1}
            ],
            "hardware": {
                "h20": {"scheduler": {"kind": "vllm", "block_size": 16, "kv_blocks": 2600}, "decode": {"bs_max": 8}}
            },
        },
    )
    trace = Trace([TraceRequest(f"r{i}", 0.01 * i, 12000, 2000) for i in range(4)], "preemption workload")
    res = asyncio.run(run_replay_async(rs, trace, tmp_path, backend="sim", report=True))
    assert res.stats.completed == 4
    rows = read_preemptions(tmp_path / PREEMPTIONS_CSV)
    assert rows, "the pool ran out of blocks and nothing was preempted"
    recs = {r.request_id: r for r in read_records(tmp_path / "records.csv")}
    for row in rows:
        assert row.request_id in recs and row.decode_node == recs[row.request_id].decode_node
        assert row.waited_s > 0 and row.recompute_s > 0
        # It lost that time: its decode took longer than its tokens' steps alone.
        assert recs[row.request_id].times.last_token > row.resumed_at
    # The latest admitted goes first: the first request is never preempted.
    assert "r0" not in {r.request_id for r in rows}
    # The report says what the scheduler did: its passes and the preemptions, who and how long.
    report = (tmp_path / "report.md").read_text()
    assert "## Scheduler" in report and "| Forward passes |" in report
    n = len({r.request_id for r in rows})
    assert f"| Decode preemptions (by recompute) | {len(rows)} of {n} requests |" in report
