"""The router's view of instance health (pure)."""

from __future__ import annotations

import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.router.health import HealthBook
from testbed.core.routing.load_tracker import LoadTracker
from testbed.core.routing.policy import RoutingRequest, homogeneous

pytestmark = pytest.mark.pure


def test_a_refused_connection_takes_the_instance_out_at_once_and_an_answer_brings_it_back() -> None:
    hb = HealthBook(["a", "b"], max_failures=3)
    ch = hb.report("a", "refused", 1.0, "connection refused")
    assert ch is not None and (ch.old, ch.new) == ("up", "down") and "connection refused" in ch.reason
    assert hb.down() == {"a"}
    assert hb.report("a", "refused", 1.5) is None
    back = hb.report("a", "ok", 2.0)
    assert back is not None and back.new == "up" and hb.down() == frozenset()


def test_other_failures_count_and_a_success_resets_the_count() -> None:
    hb = HealthBook(["a"], max_failures=3)
    assert hb.report("a", "failed", 0.0, "timeout") is None
    assert hb.report("a", "failed", 0.1, "timeout") is None
    assert hb.report("a", "ok", 0.2) is None
    assert hb.report("a", "failed", 0.3) is None and hb.report("a", "failed", 0.4) is None
    ch = hb.report("a", "failed", 0.5, "HTTP 500")
    assert ch is not None and ch.new == "down" and "3 failure(s)" in ch.reason and "HTTP 500" in ch.reason


def test_probes_are_due_once_per_interval() -> None:
    hb = HealthBook(["a", "b"], probe_interval_s=0.5)
    assert sorted(hb.due_probes(0.0)) == ["a", "b"]
    assert hb.due_probes(0.2) == []
    assert sorted(hb.due_probes(0.5)) == ["a", "b"]


def test_unknown_nodes_are_ignored() -> None:
    assert HealthBook(["a"]).report("zz", "refused", 0.0) is None


def test_a_down_decode_instance_gets_no_new_requests() -> None:
    sc = load_scenario("paper-homogeneous")
    tracker = LoadTracker(sc)
    hb = HealthBook(tracker.active)
    dead = sorted(n for n in tracker.active if "-d" in n)[0]
    hb.report(dead, "refused", 0.0)
    for i in range(20):
        d = homogeneous(tracker.view(None, down=hb.down()), RoutingRequest(f"r{i}", 1000))
        assert d.decode_node != dead
        tracker.assign(d, 0.1)


def test_with_every_prfaas_instance_down_prfaas_routing_falls_back_to_pd_prefill() -> None:
    from testbed.core.routing.policy import prfaas

    sc = load_scenario("paper-prfaas")
    tracker = LoadTracker(sc)
    down = frozenset(n for n in tracker.active if n.startswith("prfaas-"))
    d = prfaas(tracker.view(19400.0, down=down), RoutingRequest("r", 60_000))
    assert d.prefill_cluster == "pd" and not d.crossed_wan and "only pd prefill is up" in d.reason
    up = prfaas(tracker.view(19400.0), RoutingRequest("r", 60_000))
    assert up.prefill_cluster == "prfaas"


def test_probes_of_an_instance_not_yet_listening_do_not_take_it_out_during_startup() -> None:
    # The router starts beside its instances: its first probe round reached some before they
    # listened and took them out for a probe interval (every netns run showed 3-14 such).
    hb = HealthBook(["a", "b"], startup_grace_s=30.0)
    hb.due_probes(0.0)
    assert hb.report("a", "refused", 0.01, "connection refused", probe=True) is None
    assert hb.report("a", "failed", 0.5, "timeout", probe=True) is None
    assert hb.down() == frozenset()
    # A real request refused there still takes it out at once.
    ch = hb.report("b", "refused", 0.6, "connection refused")
    assert ch is not None and ch.new == "down"
    # Once it has answered, a refused probe is evidence again.
    assert hb.report("a", "ok", 1.0, probe=True) is None
    ch = hb.report("a", "refused", 1.5, "connection refused", probe=True)
    assert ch is not None and ch.new == "down"


def test_an_instance_that_never_comes_up_is_taken_out_after_the_startup_grace() -> None:
    hb = HealthBook(["a"], startup_grace_s=5.0)
    hb.due_probes(0.0)
    assert hb.report("a", "refused", 4.9, probe=True) is None
    ch = hb.report("a", "refused", 5.0, "connection refused", probe=True)
    assert ch is not None and ch.new == "down"
