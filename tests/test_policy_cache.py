"""Cache-aware PrfaaS routing: the paper's scarce and abundant bandwidth rules (pure)."""

from __future__ import annotations

import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.routing.load_tracker import LoadTracker
from testbed.core.routing.policy import CacheMove, RoutingRequest, get_policy

T = 19400


def _view(bandwidth: str = "scarce"):  # type: ignore[no-untyped-def]
    return LoadTracker(load_scenario("paper-prfaas")).view(float(T), bandwidth=bandwidth)  # type: ignore[arg-type]


@pytest.mark.pure
def test_length_only_ignores_caches_for_routing_and_ships_the_whole_prompt() -> None:
    pol = get_policy("prfaas")
    # 30K prompt with 28K cached in PD: length-only still offloads (30K > t), reusing PrfaaS's own 4K.
    d = pol(_view(), RoutingRequest("a", 30000, {"pd": 28000, "prfaas": 4096}))
    assert d.prefill_cluster == "prfaas" and d.cached_tokens == 4096 and d.crossed_wan
    assert d.decode_cached_tokens == 0 and d.cache_move is None


@pytest.mark.pure
def test_scarce_rule_judges_each_cluster_by_its_own_cache() -> None:
    pol = get_policy("prfaas", cache_aware=True)
    v = _view("scarce")
    # l - l_pd = 2K <= t: stays on PD-P with its 28K prefix; nothing crosses.
    d = pol(v, RoutingRequest("a", 30000, {"pd": 28000, "prfaas": 0}))
    assert d.prefill_cluster == "pd" and d.cached_tokens == 28000 and not d.crossed_wan
    assert d.incremental_tokens == 2000 and d.decode_cached_tokens == 28000
    # l - l_pd = 30K > t: PrfaaS, reusing its own 24K; only the KV beyond PD's 0 cached ships... all of it.
    d = pol(v, RoutingRequest("b", 30000, {"pd": 0, "prfaas": 24000}))
    assert d.prefill_cluster == "prfaas" and d.cached_tokens == 24000 and d.incremental_tokens == 6000
    assert d.decode_cached_tokens == 0 and d.cache_move is None
    # PrfaaS with PD holding part of the prefix: only the KV past PD's 8K crosses.
    d = pol(v, RoutingRequest("c", 40000, {"pd": 8192, "prfaas": 0}))
    assert d.prefill_cluster == "prfaas" and d.decode_cached_tokens == 8192 and d.cache_move is None


@pytest.mark.pure
def test_abundant_rule_takes_the_longer_prefix_and_moves_it() -> None:
    pol = get_policy("prfaas", cache_aware=True)
    v = _view("abundant")
    # The longer prefix (26K) sits in PrfaaS, l - l_prefix = 4K <= t: PD-P, and the cache moves PrfaaS -> PD.
    d = pol(v, RoutingRequest("a", 30000, {"pd": 8192, "prfaas": 26000}))
    assert d.prefill_cluster == "pd" and d.cached_tokens == 26000 and d.incremental_tokens == 4000
    assert d.cache_move == CacheMove("prfaas", "pd", 26000, 8192)
    assert d.decode_cached_tokens == 26000 and not d.crossed_wan
    # Under the scarce rule the same request would have gone to PrfaaS (30K - 8K > t).
    assert (
        get_policy("prfaas", cache_aware=True)(
            _view("scarce"), RoutingRequest("a", 30000, {"pd": 8192, "prfaas": 26000})
        ).prefill_cluster
        == "prfaas"
    )
    # The longer prefix in PD, l - l_prefix > t: PrfaaS, with PD's prefix moved over; PD-D keeps its own.
    d = pol(v, RoutingRequest("b", 60000, {"pd": 20000, "prfaas": 4096}))
    assert d.prefill_cluster == "prfaas" and d.cached_tokens == 20000
    assert d.cache_move == CacheMove("pd", "prfaas", 20000, 4096) and d.decode_cached_tokens == 20000
    # No move when the chosen cluster already holds the longer prefix.
    d = pol(v, RoutingRequest("c", 60000, {"pd": 0, "prfaas": 20000}))
    assert d.prefill_cluster == "prfaas" and d.cache_move is None


@pytest.mark.pure
def test_baselines_reuse_their_own_cluster_cache() -> None:
    homo = get_policy("homogeneous")(
        LoadTracker(load_scenario("paper-homogeneous")).view(None), RoutingRequest("x", 10000, {"pd": 4096})
    )
    assert homo.cached_tokens == 4096 and homo.incremental_tokens == 5904
