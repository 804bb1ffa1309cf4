"""Core pieces a driver in virtual time leans on: many decode steps at once, the KV a prefill
ships without its per-layer list, and a load tracker that answers in O(clusters). Each is
checked against the step-by-step, list-building or full-view original it stands in for."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.config.scenarios import load_scenario
from testbed.core.engine.decode_batch import DecodeBatch, DecodeSeq
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import DecodeStepTime
from testbed.core.routing.load_tracker import LoadTracker
from testbed.core.routing.policy import NoCapacity, RoutingRequest

pytestmark = pytest.mark.pure


def _batch(seqs: list[tuple[int, int]], per_seq: float = 0.001, per_ctx: float = 2e-7) -> DecodeBatch:
    b = DecodeBatch(DecodeStepTime(0.025, per_seq, per_ctx), bs_max=64, kv_capacity=10**12, time_scale=2)
    for i, (ctx, out) in enumerate(seqs):
        b.submit(DecodeSeq(f"r{i}", ctx, out, 1))
    b.admit(0.0)
    return b


@given(st.lists(st.tuples(st.integers(1, 50000), st.integers(1, 300)), min_size=1, max_size=12), st.integers(0, 300))
@settings(max_examples=60, deadline=None)
def test_advance_is_that_many_steps_and_duration_of_is_their_sum(seqs: list[tuple[int, int]], want: int) -> None:
    a, b = _batch(seqs), _batch(seqs)
    m = min(want, a.steps_to_finish())
    elapsed = 0.0
    stepped = []
    for _ in range(m):
        elapsed += b.step_duration()
        stepped = b.complete_step()
    assert a.duration_of(m) == pytest.approx(elapsed, rel=1e-9, abs=1e-12)
    got = a.advance(m)
    assert [(r.seq.request_id, r.finished) for r in got] == [(r.seq.request_id, r.finished) for r in stepped]
    assert [(s.request_id, s.generated) for s in a.running] == [(s.request_id, s.generated) for s in b.running]
    assert (a.kv_used, a.context, a.step_duration()) == (b.kv_used, b.context, pytest.approx(b.step_duration()))


def test_advance_refuses_to_run_past_a_finish() -> None:
    b = _batch([(100, 3), (100, 5)])
    with pytest.raises(ValueError, match="finishes after 3 steps"):
        b.advance(4)


@given(
    st.lists(st.tuples(st.integers(1, 50000), st.integers(50, 300)), min_size=1, max_size=8),
    st.floats(0.0, 2.0),
    st.sampled_from([0.0, 1e-6]),
)
@settings(max_examples=80, deadline=None)
def test_steps_until_is_the_first_boundary_at_or_after(
    seqs: list[tuple[int, int]], elapsed: float, per_ctx: float
) -> None:
    b = _batch(seqs, per_ctx=per_ctx)
    m = b.steps_until(elapsed)
    if elapsed <= 0:
        assert m == 0
        return
    assert b.duration_of(m) >= elapsed
    assert m == 1 or b.duration_of(m - 1) < elapsed


@pytest.mark.parametrize("name", ["paper-prfaas", "paper-prfaas-dense"])
def test_shipped_is_the_total_and_last_layer_of_layer_bytes(name: str) -> None:
    kv = KVModel.from_spec(load_scenario(name).model)
    rng = random.Random(3)
    for _ in range(500):
        tokens = rng.randint(1, 131072)
        cached = rng.randint(0, tokens)
        scale = rng.choice([1.0, 7.5, 256.0])
        layers = kv.layer_bytes(tokens, cached, scale)
        assert kv.shipped(tokens, cached, scale) == (sum(layers), layers[-1])


@pytest.mark.parametrize(
    "scenario", ["paper-prfaas", "paper-prfaas-cache", "paper-prfaas-load-aware", "paper-homogeneous", "paper-naive"]
)
def test_the_trackers_view_decides_as_the_full_listing_does(scenario: str) -> None:
    """The view lists only each cluster's least-loaded instances (what a 10,000-GPU deployment
    needs), among those not down: every policy decides on it exactly as on every instance."""
    from testbed.config.resolved import resolve
    from testbed.core.routing.load_aware import router_policy

    sc = load_scenario(
        scenario,
        {
            "clusters": [
                {
                    "name": "prfaas",
                    "datacenter": "dc-remote",
                    "kind": "prfaas",
                    "hardware": "h200",
                    "prefill": 9,
                    "decode": 0,
                },
                {"name": "pd", "datacenter": "dc-local", "kind": "pd", "hardware": "h20", "prefill": 7, "decode": 11},
            ]
        }
        if scenario != "paper-homogeneous"
        else {},
    )
    rs = resolve(sc)
    policy = router_policy(sc, rs.intra_dc, rs.inter_dc)
    tr = LoadTracker(sc)
    nodes = list(tr.active)
    rng = random.Random(7)
    open_: list[tuple[object, float, bool]] = []
    down: frozenset[str] = frozenset()
    for i in range(3000):
        if rng.random() < 0.01:  # instances go down and come back now and then
            down = frozenset(rng.sample(nodes, rng.randint(0, 3)))
        cached = {c.name: rng.choice([0, 0, 512 * rng.randint(1, 40)]) for c in sc.clusters}
        req = RoutingRequest(f"r{i}", rng.randint(100, 120000), cached)
        try:
            d_full = policy(tr.full_view(19400.0, down=down), req)
        except NoCapacity:
            with pytest.raises(NoCapacity):
                policy(tr.view(19400.0, down=down), req)
            continue
        assert policy(tr.view(19400.0, down=down), req) == d_full
        # Ties are common (equal work): the same key order must break them the same way.
        work = float(rng.choice([1, 2, 3]))
        tr.assign(d_full, work)
        open_.append((d_full, work, False))
        while open_ and rng.random() < 0.5:
            j = rng.randrange(len(open_))
            d, w, prefilled = open_[j]
            if prefilled:
                tr.decode_done(d)  # type: ignore[arg-type]
                open_.pop(j)
            else:
                tr.prefill_done(d, w)  # type: ignore[arg-type]
                open_[j] = (d, w, True)
