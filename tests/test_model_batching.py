"""The analytical capacity of a batching prefill instance (`testbed.model.batching`) against the
scheduler it describes: a saturated instance run by the one prefill loop spends, per prompt, what
the model says; FCFS keeps the paper's single-prompt capacity."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.config import load_scenario
from testbed.core.engine.prefill_batch import BatchPolicy
from testbed.core.engine.prefill_loop import PrefillLoop
from testbed.core.engine.prefill_queue import PrefillJob
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.fault_timeline import SlowDown
from testbed.core.schema.hardware import SchedulerSpec, TablePrefill
from testbed.model.analytical import Pool, StagePools, prefill_seconds
from testbed.model.batching import batching_adjustment, pass_fixed_seconds, scheduler_text

pytestmark = pytest.mark.pure

CURVE = TablePrefill(
    kind="table",
    points=[(float(x), 0.1 + x / 1e4 + (x / 2e4) ** 2) for x in (1000, 4000, 8192, 16384, 32768, 65536)],
    overhead_s=0.2,
    cached_token_s=1e-6,
)
TIME = PrefillTime.from_spec(CURVE)
# The same curve with a batched pass's token-bound part: linear in the pass's tokens past a floor,
# so the attention T(l) - P(l) is what grows faster than linearly.
SPLIT = PrefillTime.from_spec(
    CURVE.model_copy(update={"pass_tokens": [(float(x), 0.1 + x / 1e4) for x in (1000, 8192, 65536, 262144)]})
)


def _saturated_busy_per_prompt(tokens: int, policy: BatchPolicy, time: PrefillTime, prompts: int = 64) -> float:
    """Every prompt queued at 0: the loop's passes back to back; busy seconds per prompt."""
    loop = PrefillLoop(SlowDown(), policy, time)
    for i in range(prompts):
        loop.submit(PrefillJob(f"r{i}", tokens, 0, time(tokens)), 0.0)
    t = 0.0
    while loop.completed < prompts:
        p = loop.next_pass(t)
        assert p is not None and not isinstance(p, float)
        t = p.end
        loop.end_pass(t)
    return loop.stats.busy_s / prompts


@pytest.mark.parametrize("time", [TIME, SPLIT], ids=["curve", "pass_tokens"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("tokens", [500, 2048, 3000, 8192, 20000])
def test_the_model_spends_what_a_saturated_batching_instance_spends(
    tokens: int, chunked: bool, time: PrefillTime
) -> None:
    policy = BatchPolicy(token_budget=8192, max_seqs=8, chunked=chunked)
    model = float(
        prefill_seconds(time, np.array([tokens]))[0] + batching_adjustment(time, np.array([tokens]), policy)[0]
    )
    measured = _saturated_busy_per_prompt(tokens, policy, time)
    # Chunked, the last pass of the run is not full (64 prompts rarely divide the budget): the
    # model's share is the full-pass figure, the run's under 1% more here.
    assert measured == pytest.approx(model, rel=0.01)


def test_fcfs_is_the_single_prompt_time_and_batching_shares_the_fixed_part() -> None:
    lengths = np.array([1000.0, 8192.0, 40000.0])
    assert np.all(batching_adjustment(TIME, lengths, None) == 0.0)
    fixed = pass_fixed_seconds(TIME)
    assert fixed == pytest.approx(TIME.fixed_time())
    chunked = batching_adjustment(TIME, lengths, BatchPolicy(8192, 256, True))
    # A short prompt saves most of the fixed part; one of exactly the budget none; a long one pays
    # the fixed part once more per extra pass.
    assert chunked[0] == pytest.approx(fixed * (1000 / 8192 - 1))
    assert chunked[1] == pytest.approx(0.0, abs=1e-12)
    assert chunked[2] == pytest.approx(fixed * (40000 / 8192 - 1))
    fcfs_pool = Pool("c", 4, TIME)
    vllm_pool = Pool("c", 4, TIME, BatchPolicy(8192, 256, True))
    assert vllm_pool.capacity(lengths)[0] > fcfs_pool.capacity(lengths)[0]
    assert vllm_pool.capacity(lengths)[2] < fcfs_pool.capacity(lengths)[2]


def test_the_paper_deployments_keep_fcfs_and_a_vllm_scheduler_reaches_the_model() -> None:
    sc = load_scenario("paper-prfaas")
    pools = StagePools.from_scenario(sc)
    assert all(p.batch is None for p in (*pools.prfaas, *pools.pd_prefill))
    hw = {name: h.model_copy(update={"scheduler": SchedulerSpec(kind="vllm")}) for name, h in sc.hardware.items()}
    batched = StagePools.from_scenario(sc.model_copy(update={"hardware": hw}))
    assert all(p.batch == BatchPolicy(8192, 256, True) for p in (*batched.prfaas, *batched.pd_prefill))
    assert scheduler_text(SchedulerSpec()) == "fcfs (one whole prompt a pass)"
    assert "token budget 8192" in scheduler_text(SchedulerSpec(kind="vllm"))


def test_with_pass_tokens_a_pass_is_its_tokens_bound_part_and_each_chunks_attention() -> None:
    # A whole prompt alone: the single-prompt time, as without the table.
    for tokens, cached in ((1000, 0), (5000, 2048), (30000, 0)):
        assert SPLIT.pass_time([(0, tokens, cached)]) == pytest.approx(SPLIT(tokens, cached), rel=1e-12)
    # Four short prompts share the token-bound part of their 8,000 tokens; each adds its attention.
    four = SPLIT.pass_time([(0, 2000, 0)] * 4)
    attention = SPLIT.length_time(2000) - SPLIT.token_pass_time(2000)
    assert four == pytest.approx(CURVE.overhead_s + SPLIT.token_pass_time(8000) + 4 * attention, rel=1e-12)
    # A continued chunk adds the attention of its tokens over the longer context.
    cont = SPLIT.pass_time([(8192, 8192, 0)])
    grown = SPLIT.attention_time(16384) - SPLIT.attention_time(8192)
    assert cont == pytest.approx(CURVE.overhead_s + SPLIT.token_pass_time(8192) + grown, rel=1e-12)
