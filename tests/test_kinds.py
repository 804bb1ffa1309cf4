"""Dispatch over Literal kinds refuses a value no case handles, naming it, instead of taking a
default: a policy the model or router gets, a fault kind the executor gets, a cache-routing
mode, a prefill model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.fault_timeline import NODE_KINDS, FaultEvent, faulted_links, kind_scope
from testbed.core.routing.load_aware import router_policy
from testbed.core.routing.policy import get_policy
from testbed.core.schema.kinds import UnknownKind
from testbed.core.schema.linkprofile import LinkParams
from testbed.core.schema.scenario import Scenario
from testbed.deploy.fault_injection import FaultScheduler, FaultTarget
from testbed.model.analytical import evaluate
from testbed.model.planner import kind_pools

pytestmark = pytest.mark.pure


@dataclass(frozen=True)
class FreezeFault:
    """A fault of a kind the scenario schema does not have (as a newer file or a plugin might give)."""

    kind: str = "freeze"
    at_s: float = 1.0
    duration_s: float = 2.0
    node: str = "pd-d0"


class Nodes:
    """Records what the executor asks of the nodes: it must ask nothing."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def kill(self, node: str) -> dict[str, str]:
        self.calls.append(f"kill {node}")
        return {}

    pause = resume = start = kill

    async def slow(self, node: str, factor: float, until: float | None) -> dict[str, str]:
        self.calls.append(f"slow {node}")
        return {}


def _event(spec: object) -> FaultEvent:
    return FaultEvent(0, spec, 1.0, 3.0, "pd-d0", ())  # type: ignore[arg-type]


def test_executor_refuses_an_unknown_fault_kind_rather_than_killing(tmp_path: Path) -> None:
    nodes = Nodes()
    with pytest.raises(UnknownKind, match="unknown fault kind 'freeze'") as ei:
        FaultScheduler([_event(FreezeFault())], FaultTarget("fake", nodes), 0.0, 1.0, tmp_path / "faults.jsonl")
    assert ei.value.kind == "freeze" and "kill" in ei.value.known
    assert nodes.calls == [] and not (tmp_path / "faults.jsonl").exists()


def test_link_shaping_refuses_an_unknown_fault_kind() -> None:
    base = {("dc0", "dc1"): LinkParams(1e9, 0.01, 0.0, 0.0, 0.0, 1 << 20, None)}
    with pytest.raises(UnknownKind, match="unknown fault kind 'freeze'"):
        faulted_links(base, [_event(FreezeFault())])


def test_fault_kinds_from_a_file_are_classified_or_refused() -> None:
    assert NODE_KINDS == ("kill", "pause", "restart", "slow")
    assert kind_scope("tcp_reset") == "connection"
    with pytest.raises(UnknownKind, match="unknown fault kind 'freeze'"):
        kind_scope("freeze")  # type: ignore[arg-type]


def _with_policy(sc: Scenario, **update: object) -> Scenario:
    # model_copy does not validate: the way a policy name no schema knows reaches the dispatch.
    return sc.model_copy(update={"policy": sc.policy.model_copy(update=update)})


def test_model_refuses_an_unknown_policy_rather_than_evaluating_it_as_naive() -> None:
    sc = _with_policy(load_scenario("paper-naive"), name="greedy")
    with pytest.raises(UnknownKind, match="unknown policy 'greedy'"):
        evaluate(sc, 1e9)


def test_router_and_planner_refuse_an_unknown_policy() -> None:
    with pytest.raises(UnknownKind, match="unknown policy 'greedy'; known: homogeneous, naive, prfaas"):
        get_policy("greedy")  # type: ignore[arg-type]
    with pytest.raises(UnknownKind, match="unknown policy 'greedy'"):
        kind_pools("greedy")  # type: ignore[arg-type]


def test_router_refuses_an_unknown_cache_routing() -> None:
    sc = _with_policy(load_scenario("paper-prfaas"), cache_routing="nearest")
    with pytest.raises(UnknownKind, match="unknown cache routing 'nearest'"):
        router_policy(sc, None, None)  # type: ignore[arg-type]


class SplinePrefill:
    pass


def test_service_time_refuses_an_unknown_prefill_model() -> None:
    with pytest.raises(UnknownKind, match="unknown prefill model 'SplinePrefill'"):
        PrefillTime.from_spec(SplinePrefill())  # type: ignore[arg-type]
