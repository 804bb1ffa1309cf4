from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.config.scenarios import load_scenario
from testbed.core.engine.decode_batch import AdmissionError, DecodeBatch, DecodeSeq
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.prefill_queue import PrefillJob, PrefillQueue
from testbed.core.engine.servicetime import DecodeStepTime, PrefillTime
from testbed.core.lifecycle import Event, InvalidTransition, Lifecycle, State
from testbed.core.routing.load_tracker import LoadTracker
from testbed.core.routing.policy import RoutingRequest, get_policy
from testbed.core.schema.scaling import Scale

pytestmark = pytest.mark.pure

HAPPY = [
    Event.ROUTE,
    Event.ENQUEUE_PREFILL,
    Event.START_PREFILL,
    Event.TRANSFER_START,
    Event.END_PREFILL,
    Event.KV_COMPLETE,
    Event.ADMIT,
    Event.FIRST_TOKEN,
    Event.FINISH,
]


def test_lifecycle_happy_path_records_times() -> None:
    life = Lifecycle("r")
    for i, ev in enumerate(HAPPY):
        life.apply(ev, float(i))
    assert life.state is State.COMPLETED and life.done
    assert life.times[Event.KV_COMPLETE] == 5.0


def test_lifecycle_rejects_admission_before_kv() -> None:
    life = Lifecycle("r")
    for ev in HAPPY[:5]:
        life.apply(ev, 0.0)
    with pytest.raises(InvalidTransition, match="admit not allowed in state transferring"):
        life.apply(Event.ADMIT, 1.0)


def test_lifecycle_fail_from_any_live_state_but_not_twice() -> None:
    for k in range(len(HAPPY)):
        life = Lifecycle("r")
        for ev in HAPPY[:k]:
            life.apply(ev, 0.0)
        life.apply(Event.FAIL, 1.0, "boom")
        assert life.state is State.FAILED and life.reason == "boom"
        with pytest.raises(InvalidTransition):
            life.apply(Event.FAIL, 2.0)


def test_prefill_time_table_interpolates_and_extrapolates() -> None:
    sc = load_scenario("paper-prfaas")
    h200 = PrefillTime.from_spec(sc.hardware["h200"].prefill)
    assert h200(8192) == pytest.approx(0.72)
    assert h200((8192 + 32768) / 2) == pytest.approx((0.72 + 1.84) / 2)
    assert h200(131072) == pytest.approx(7.40)
    slope = (0.72 - 0.44) / (8192 - 1024)
    assert h200(128) == pytest.approx(0.44 - slope * (1024 - 128))
    h20 = PrefillTime.from_spec(sc.hardware["h20"].prefill)
    assert h20(10000) == pytest.approx(0.4678 + 1.3004e-4 * 1e4 + 2.979e-10 * 1e8)


def test_prefill_time_cached_term() -> None:
    from testbed.core.schema.hardware import PolynomialPrefill

    pt = PrefillTime.from_spec(PolynomialPrefill(kind="polynomial", coefficients=[0.1, 1e-4], cached_token_s=1e-6))
    assert pt(1000, 5000) == pytest.approx(0.1 + 0.1 + 0.005)


def test_kv_model_matches_table5_and_splits_exactly() -> None:
    sc = load_scenario("paper-prfaas")
    kv = KVModel.from_spec(sc.model)
    mib = 1024 * 1024
    for tokens, table in ((1024, 190.8), (8192, 308.9), (32768, 701.3), (131072, 2316.3)):
        assert kv.total(tokens) / mib == pytest.approx(table, rel=0.02)
    layers = kv.layer_bytes(30000, byte_scale=256)
    assert len(layers) == 64
    assert sum(layers) == round(180355072 / 256) + round(17143 * 30000 / 256)
    # Full-attention layers (every 4th) carry the per-token part.
    assert layers[3] > layers[0]


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_per_layer_split_sums_exactly(lin: int, full: int) -> None:
    kv = KVModel(1, 1.0, ("linear", "linear", "linear", "full") * 3)
    parts = kv.per_layer(lin, full)
    assert sum(parts) == lin + full and min(parts) >= 0


def test_scale_round_trips() -> None:
    s = Scale(speedup=4, byte_scale=256)
    assert s.wire_seconds(2.0) == 0.5 and s.paper_seconds(0.5) == 2.0
    assert s.wire_rate_bps(100e9) == pytest.approx(100e9 / 256 * 4)
    assert s.paper_rate_bps(s.wire_rate_bps(13e9)) == pytest.approx(13e9)


def test_prefill_queue_fcfs_and_backlog() -> None:
    q = PrefillQueue()
    q.push(PrefillJob("a", 10, 0, 1.0), 0.0)
    q.push(PrefillJob("b", 10, 0, 2.0), 0.0)
    a = q.start_next(0.0)
    assert a is not None and a.request_id == "a"
    assert q.start_next(0.1) is None  # busy
    assert q.depth == 1 and q.backlog(0.5) == pytest.approx(0.5 + 2.0)
    q.finish(1.0)
    b = q.start_next(1.0)
    assert b is not None and b.request_id == "b" and b.started_at == 1.0


def _batch(bs: int = 2, cap: int = 100) -> DecodeBatch:
    return DecodeBatch(DecodeStepTime(0.025, 0.001, 0.0), bs_max=bs, kv_capacity=cap, time_scale=4)


def test_decode_batch_bs_max_and_step_time() -> None:
    b = _batch(bs=2)
    for i in range(3):
        b.submit(DecodeSeq(f"r{i}", 10, 2, 10))
    assert [s.request_id for s in b.admit(0.0)] == ["r0", "r1"]
    assert b.step_duration() == pytest.approx((0.025 + 0.002) / 4)
    res = b.complete_step()
    assert [r.finished for r in res] == [False, False]
    res = b.complete_step()
    assert all(r.finished for r in res) and not b.running and b.kv_used == 0
    assert [s.request_id for s in b.admit(1.0)] == ["r2"]


def test_decode_batch_kv_memory_admission_is_fcfs() -> None:
    b = _batch(bs=8, cap=100)
    b.submit(DecodeSeq("big", 10, 1, 70))
    b.submit(DecodeSeq("big2", 10, 1, 60))
    b.submit(DecodeSeq("small", 10, 1, 10))
    assert [s.request_id for s in b.admit(0.0)] == ["big"]  # big2 does not fit; small may not overtake
    b.complete_step()
    assert [s.request_id for s in b.admit(1.0)] == ["big2", "small"]
    with pytest.raises(AdmissionError, match="more than the instance"):
        b.submit(DecodeSeq("huge", 10, 1, 101))


def test_decode_batch_abort_frees_memory() -> None:
    b = _batch()
    b.submit(DecodeSeq("a", 10, 5, 40))
    b.admit(0.0)
    assert b.abort("a") and b.kv_used == 0 and b.idle


def test_policies_route_as_the_paper_says() -> None:
    sc = load_scenario("paper-prfaas")
    tr = LoadTracker(sc)
    view = tr.view(19400.0)
    pol = get_policy("prfaas")
    long = pol(view, RoutingRequest("l", 30000))
    short = pol(view, RoutingRequest("s", 5000))
    edge = pol(view, RoutingRequest("e", 19400))
    assert long.prefill_cluster == "prfaas" and long.crossed_wan
    assert short.prefill_cluster == "pd" and not short.crossed_wan
    assert edge.prefill_cluster == "pd"  # l <= t stays local
    assert long.decode_cluster == "pd" and long.decode_node.startswith("pd-d")
    naive = get_policy("naive")(
        load_scenario("paper-naive") and LoadTracker(load_scenario("paper-naive")).view(None), RoutingRequest("x", 100)
    )
    assert naive.prefill_cluster == "prfaas"
    homo = get_policy("homogeneous")(
        LoadTracker(load_scenario("paper-homogeneous")).view(None), RoutingRequest("x", 100000)
    )
    assert homo.prefill_cluster == "pd" and not homo.crossed_wan


def test_policy_picks_least_loaded_instances() -> None:
    sc = load_scenario("paper-prfaas")
    tr = LoadTracker(sc)
    pol = get_policy("prfaas")
    seen_p, seen_d = set(), set()
    for i in range(4):
        d = pol(tr.view(19400.0), RoutingRequest(f"r{i}", 50000))
        tr.assign(d, 1.0)
        seen_p.add(d.prefill_node)
        seen_d.add(d.decode_node)
    assert seen_p == {"prfaas-p0", "prfaas-p1", "prfaas-p2", "prfaas-p3"}
    assert len(seen_d) == 4


def test_unknown_policy_named() -> None:
    with pytest.raises(ValueError, match="unknown policy 'magic'"):
        get_policy("magic")


def test_no_nan_in_scale() -> None:
    assert not math.isnan(Scale().wire_seconds(1.0))
