"""Prefill placement inside a cluster (`policy.placement`) and per-instance prefix caches
(`clusters[].cache_scope: instance`), through the core route step both routers call (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from testbed.config.resolved import ResolvedScenario
from testbed.core.router.route_step import route
from testbed.core.router.router_books import RouterBooks
from testbed.core.routing.placement import Placement, PrefillLoad, kv_overlap_cost, placement_for
from testbed.core.routing.policy import Decision
from testbed.core.schema.scaling import Scale
from testbed.core.schema.scenario import ClusterSpec
from testbed.core.schema.topology import node_specs
from testbed.run.load import load
from testbed.run.run_args import overrides_for

BT = 512
PAPER = Scale()


def _rs(*sets: str) -> ResolvedScenario:
    return load("paper-homogeneous", overrides_for("paper-homogeneous", ["clusters.0.prefill=3", *sets]))


def _books(rs: ResolvedScenario) -> RouterBooks:
    sc = rs.spec
    return RouterBooks.for_scenario(sc, rs.threshold, rs.intra_dc, rs.inter_dc, [n.id for n in node_specs(sc)])


def _decision(node: str = "pd-p0", cached: int = 0, tokens: int = 4096) -> Decision:
    return Decision("pd", node, "pd", "pd-d0", cached, tokens - cached, False, None, "homogeneous")


@pytest.mark.pure
def test_kv_overlap_cost_is_dynamos_prefill_and_active_blocks() -> None:
    load_ = PrefillLoad("pd-p0", 0.0, 1, inflight_tokens=1024, inflight_blocks=3)
    # (1024 in flight + 4096 prompt - 2048 cached) / 512 = 6 prefill blocks, + 3 active + 8 of the prompt.
    assert kv_overlap_cost(1.0, BT, 4096, 2048, load_) == 17.0
    assert kv_overlap_cost(2.0, BT, 4096, 2048, load_) == 23.0
    assert kv_overlap_cost(0.0, BT, 4096, 2048, load_) == 11.0  # weight 0: active blocks alone


@pytest.mark.pure
def test_kv_overlap_waits_behind_the_instance_holding_the_prefix_only_while_it_pays() -> None:
    pl = Placement(True, 1.0, BT, frozenset({"pd"}))
    busy = PrefillLoad("pd-p0", 0.5, 1, 1024, 2)
    idle = PrefillLoad("pd-p1", 0.0, 0, 0, 0)
    # p0 holds 6 of the prompt's 8 blocks: (1024 + 4096 - 3072) / 512 + 2 + 8 = 14 against p1's 8 + 0 + 8 = 16.
    d = pl.place(_decision("pd-p1", 3072), 4096, [busy, idle], {"pd-p0": 3072, "pd-p1": 0})
    assert (d.prefill_node, d.cached_tokens, d.incremental_tokens) == ("pd-p0", 3072, 1024)
    assert "kv_overlap pd-p0: 14.0 blocks" in d.reason
    # With 1 block held, p0 costs 9 + 2 + 8 = 19 > 16: the idle instance, computing it all.
    d = pl.place(_decision("pd-p1", 512), 4096, [busy, idle], {"pd-p0": 512, "pd-p1": 0})
    assert (d.prefill_node, d.cached_tokens, d.incremental_tokens) == ("pd-p1", 0, 4096)


@pytest.mark.pure
def test_kv_overlap_ties_go_by_the_least_loaded_order() -> None:
    pl = Placement(True, 1.0, BT, frozenset())
    # Equal cost (no cache, nothing in flight): backlog, then assigned, then name decide.
    loads = [PrefillLoad("pd-p2", 0.0, 0, 0, 0), PrefillLoad("pd-p1", 0.0, 0, 0, 0), PrefillLoad("pd-p0", 0.1, 0, 0, 0)]
    assert pl.place(_decision(), 4096, loads, {}).prefill_node == "pd-p1"
    # Cluster scope: every instance finds the cluster pool's prefix, the decision's own.
    d = pl.place(_decision("pd-p0", 2048), 4096, loads, {})
    assert d.prefill_node == "pd-p1" and d.cached_tokens == 2048


@pytest.mark.pure
def test_scope_fields_validate_and_split_the_pool() -> None:
    base = {"name": "pd", "datacenter": "dc", "kind": "pd", "hardware": "h20", "prefill": 4, "decode": 1}
    c = ClusterSpec.model_validate(base | {"cache_bytes": "4TiB", "cache_scope": "instance"})
    assert c.instance_pool_bytes() == 2**40
    c = ClusterSpec.model_validate(base | {"cache_scope": "instance", "instance_cache_bytes": "1GiB"})
    assert c.instance_pool_bytes() == 2**30
    with pytest.raises(ValidationError, match="instance_cache_bytes needs cache_scope: instance"):
        ClusterSpec.model_validate(base | {"instance_cache_bytes": "1GiB"})
    assert placement_for(_rs().spec) is None  # the default deployment skips placement altogether
    with pytest.raises(Exception, match="placement"):
        _rs("policy.placement=nearest")


def _route(b: RouterBooks, rs: ResolvedScenario, rid: str, tokens: int, hashes: tuple[int, ...]) -> Decision:
    return route(b, rs.spec, rid, tokens, hashes, 0.0, PAPER).d


def _done(b: RouterBooks, rs: ResolvedScenario, rid: str, tokens: int, hashes: tuple[int, ...]) -> Decision:
    """Route, prefill and finish one request; its decision."""
    plan = route(b, rs.spec, rid, tokens, hashes, 0.0, PAPER)
    b.prefilled(rid, plan, tokens, moved=False)
    b.tracker.prefill_done(plan.d, plan.work, plan.rid, plan.hashes)
    b.attempt_over(rid, plan, True)
    b.tracker.decode_done(plan.d)
    return plan.d


PROMPT = tuple(range(100, 108))  # 8 blocks
FOLLOW = (*PROMPT, 200, 201)  # the next turn: the same 8 blocks and 2 more


@pytest.mark.pure
@pytest.mark.parametrize(
    ("sets", "node", "cached"),
    [
        ((), "pd-p1", 4096),  # one cluster pool: any instance reads the prefix
        (("clusters.0.cache_scope=instance",), "pd-p1", 0),  # p1's own pool holds nothing
        (("clusters.0.cache_scope=instance", "policy.placement=kv_overlap"), "pd-p0", 4096),  # waits on p0
    ],
)
def test_a_follow_up_finds_the_prefix_where_the_deployment_keeps_it(
    sets: tuple[str, ...], node: str, cached: int
) -> None:
    rs = _rs(*sets)
    b = _books(rs)
    first = _done(b, rs, "a", 8 * BT, PROMPT)
    assert first.prefill_node == "pd-p0" and first.cached_tokens == 0
    # p0 is busy with an unrelated short prompt when the next turn arrives.
    busy = _route(b, rs, "x", BT, (900,))
    assert busy.prefill_node == "pd-p0"
    d = _route(b, rs, "b", 10 * BT, FOLLOW)
    assert (d.prefill_node, d.cached_tokens, d.incremental_tokens) == (node, cached, 10 * BT - cached)
    assert b.book is not None
    if "clusters.0.cache_scope=instance" in sets:
        # Each instance's pool holds what its own prefills put there, and nothing else.
        pools = b.book.index.instance_pools["pd"]
        assert pools["pd-p0"].usable_tokens(FOLLOW, 10 * BT) == 4096
        assert pools["pd-p1"].usable_tokens(FOLLOW, 10 * BT) == 0
        assert b.book.index.usable(FOLLOW, 10 * BT) == {"pd": 4096}


FULL = ("model.layer_pattern=[full]", "model.linear_state_bytes=0")  # every cached block reusable


@pytest.mark.pure
def test_blocks_shared_by_prompts_in_flight_count_once_as_dynamo_counts_active_blocks() -> None:
    rs = _rs("policy.placement=kv_overlap")
    b = _books(rs)
    a = route(b, rs.spec, "a", 8 * BT, PROMPT, 0.0, PAPER)
    assert a.d.prefill_node == "pd-p0" and b.tracker.inflight_blocks["pd-p0"] == 8
    # The next turn on the same instance adds only its 2 new blocks to the instance's active ones.
    d = _route(b, rs, "b", 10 * BT, FOLLOW)
    assert d.prefill_node == "pd-p1"  # p0 is computing 8 * BT tokens: the idle one costs less
    assert b.tracker.new_blocks("pd-p0", FOLLOW, 10 * BT) == 2
    assert b.tracker.new_blocks("pd-p1", FOLLOW, 10 * BT) == 0  # p1 holds all 10 now
    assert b.tracker.new_blocks("pd-p2", FOLLOW + (7,), 11 * BT) == 11
    # A prompt without hashes: every block its own.
    assert b.tracker.new_blocks("pd-p0", (), 3 * BT) == 3
    b.tracker.prefill_done(a.d, a.work, a.rid, a.hashes)
    assert b.tracker.inflight_blocks["pd-p0"] == 0
    assert b.tracker.new_blocks("pd-p0", FOLLOW, 10 * BT) == 10


@pytest.mark.pure
def test_an_instance_counts_the_prefix_its_prompts_in_flight_compute_and_waits_for_them() -> None:
    rs = _rs("clusters.0.cache_scope=instance", "policy.placement=kv_overlap", *FULL)
    b = _books(rs)
    assert _done(b, rs, "z", 6 * BT, PROMPT[:6]).prefill_node == "pd-p0"  # p0's pool: PROMPT's first 6 blocks
    a = route(b, rs.spec, "a", 8 * BT + 100, PROMPT, 0.0, PAPER)
    assert (a.d.prefill_node, a.d.cached_tokens, a.d.prefix_after) == ("pd-p0", 6 * BT, "")
    # The next turn arrives while "a" computes: p0 will hold a's 8 full blocks when "b" starts there,
    # (1124 in flight + 5120 - 4096) / 512 + 9 active + 2 new = 15.2 blocks against p1's 10 + 10.
    d = _route(b, rs, "b", 10 * BT, FOLLOW)
    assert (d.prefill_node, d.cached_tokens, d.incremental_tokens, d.prefix_after) == ("pd-p0", 8 * BT, 2 * BT, "a")
    assert "pd-p0's own cache 4096 once a's prefill ends" in d.reason
    # What p0's pool holds already waits for nobody.
    assert b.tracker.held_prefix("pd-p0", (*PROMPT[:3], 300, 301, 302), 6 * BT, 3 * BT) == (3 * BT, "")
    # Once "a" answered, its blocks are in p0's pool: "b"'s full blocks are what p0 computes next.
    b.prefilled("a", a, 8 * BT + 100, moved=False)
    b.tracker.prefill_done(a.d, a.work, a.rid, a.hashes)
    assert b.tracker.held_prefix("pd-p0", (*FOLLOW, 600), 11 * BT, 8 * BT) == (10 * BT, "b")
    assert b.tracker.held_prefix("pd-p1", (*FOLLOW, 600), 11 * BT, 0) == (0, "")


@pytest.mark.pure
def test_a_hybrid_model_counts_only_what_the_pool_holds() -> None:
    # A linear state is kept only at a prompt's own length: what a prompt in flight computes is
    # reusable only once its prefill put the state in the pool, so nothing in flight counts.
    rs = _rs("clusters.0.cache_scope=instance", "policy.placement=kv_overlap")
    b = _books(rs)
    route(b, rs.spec, "a", 8 * BT + 100, PROMPT, 0.0, PAPER)
    d = _route(b, rs, "b", 10 * BT, FOLLOW)
    assert (d.cached_tokens, d.prefix_after) == (0, "")
