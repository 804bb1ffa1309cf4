"""The long-term loop: role slots, the controller's judgements (bottleneck, hysteresis, drain
before switch, retune), its records, the simulator converging from a bad split, and the live
router converting an instance on loopback."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from testbed.core.control.bandwidth import BandwidthController
from testbed.core.control.longterm import (
    DecodeSignals,
    LongTermController,
    PrefillSignals,
    RoleSignals,
    ThresholdPlan,
    WorkloadSample,
    apply,
    controller_for,
    decision_line,
)
from testbed.core.control.roles import RoleBook, RoleError
from testbed.core.control.short_term import stage_model
from testbed.core.schema.scenario import ControlSpec, LongTermSpec
from testbed.core.schema.topology import node_specs

PAPER = "paper-prfaas"


def _cfg(**kw: Any) -> LongTermSpec:
    base: dict[str, Any] = {"enabled": True, "interval_s": 10.0, "confirm": 2, "min_interval_s": 0.0, "min_requests": 1}
    return LongTermSpec(**{**base, **kw})


class Feed:
    """Samples every 2 s into a controller: each stage at a chosen load and queue."""

    def __init__(self, ctl: LongTermController) -> None:
        self.ctl = ctl
        self.t = 0.0
        self.active: dict[str, int] = {n: 0 for n in ctl.roles.nodes()}

    def step(self, pdp: float, pdd: float, pdp_queue: float = 0.0, waiting: float = 0.0, dt: float = 2.0) -> list[Any]:
        self.t += dt
        roles = self.ctl.roles
        n_p, n_d = len(roles.routable("prefill")), len(roles.routable("decode"))
        sig = RoleSignals(
            now=self.t,
            interval_s=dt,
            pdp=PrefillSignals(n_p, pdp * n_p * dt, pdp_queue),
            pdd=DecodeSignals(n_d, pdd * n_d * 20, waiting * n_d, 20),
            prfaas=PrefillSignals(4, 0.3 * 4 * dt, 0.0),
            active=dict(self.active),
            rate=1.0,
            lengths=(1000.0,) * 50,
            outputs=(500.0,) * 50,
        )
        return self.ctl.update(sig)

    def run(self, seconds: float, **kw: Any) -> list[Any]:
        out: list[Any] = []
        for _ in range(int(round(seconds / 2.0))):
            out += self.step(**kw)
        return out


# -- role slots ------------------------------------------------------------------------------


@pytest.mark.pure
def test_slots_keep_the_clusters_ids_and_route_only_the_role_each_holds() -> None:
    rb = RoleBook("pd", 3, 5)
    assert rb.routable("prefill") == ["pd-p0", "pd-p1", "pd-p2"]
    assert sorted(rb.routable("decode")) == [f"pd-d{i}" for i in range(5)]
    assert rb.unroutable() == frozenset({"pd-p3", "pd-p4", "pd-p5", "pd-p6", "pd-p7", "pd-d5", "pd-d6", "pd-d7"})
    assert rb.decode_node(0) == "pd-d7" and rb.decode_node(3) == "pd-d4"
    rb.apply(3, "convert")  # a decode slot becomes prefill: it drains first
    assert rb.states[3] == "to_prefill" and {"pd-p3", "pd-d4"} <= rb.unroutable()
    assert rb.counts() == {"prefill": 3, "decode": 4, "draining": 1}
    assert rb.draining() == [(3, "pd-d4", "prefill")]
    with pytest.raises(RoleError):
        rb.apply(3, "convert")  # one conversion of a slot at a time
    rb.apply(3, "drained")
    assert "pd-p3" in rb.routable("prefill") and "pd-d4" not in rb.routable("decode")
    with pytest.raises(RoleError):
        rb.apply(0, "drained")


@pytest.mark.pure
def test_the_scenario_switch_doubles_the_pd_clusters_nodes_and_checks_its_use() -> None:
    from testbed.config.scenarios import ScenarioError, load_scenario

    on = {"policy": {"control": {"long_term": {"enabled": True}}}}
    sc = load_scenario(PAPER, on)
    ids = [n.id for n in node_specs(sc)]
    assert [i for i in ids if i.startswith("pd-p")] == [f"pd-p{i}" for i in range(8)]
    assert [i for i in ids if i.startswith("pd-d")] == [f"pd-d{i}" for i in range(8)]
    assert len([n for n in node_specs(load_scenario(PAPER)) if n.cluster == "pd"]) == 8
    ctl = controller_for(sc, 19400.0, None)
    assert ctl is not None and ctl.roles.counts() == {"prefill": 3, "decode": 5, "draining": 0}
    assert controller_for(load_scenario(PAPER), 19400.0, None) is None
    with pytest.raises(ScenarioError, match="naive"):
        load_scenario("paper-naive", on)
    with pytest.raises(ScenarioError, match="donor_utilisation"):
        load_scenario(PAPER, {"policy": {"control": {"long_term": {"enabled": True, "donor_utilisation": 0.95}}}})
    with pytest.raises(ScenarioError, match="min_decode"):
        load_scenario(PAPER, {"policy": {"control": {"long_term": {"enabled": True, "min_decode": 6}}}})


# -- the controller --------------------------------------------------------------------------


@pytest.mark.pure
def test_a_prefill_bottleneck_drains_a_decode_instance_and_switches_it_once_empty() -> None:
    ctl = LongTermController(_cfg(), RoleBook("pd", 3, 5))
    f = Feed(ctl)
    f.active["pd-d2"] = 4
    f.active.update({n: 1 for n in ("pd-d0", "pd-d1", "pd-d3", "pd-d4")})
    # One judgement of a hot PD-P is not enough (confirm = 2).
    assert f.run(10, pdp=1.3, pdd=0.3) == []
    (d,) = f.run(10, pdp=1.3, pdd=0.3)
    assert d.action == "drain" and d.role == "prefill"
    # The donor: the decode instance holding the fewest requests (the last slot among equals).
    assert d.node == "pd-d0" and ctl.roles.draining() == [(7, "pd-d0", "prefill")]
    assert "PD-P is the bottleneck" in d.reason and "PD-P load 1.30" in d.reason
    assert d.signals["load_pdp"] == pytest.approx(1.3) and (d.prefill, d.decode, d.draining) == (3, 4, 1)
    # While its requests run, neither of the slot's nodes is routed to and nothing else converts.
    for _ in range(15):
        assert all(x.action != "drain" for x in f.step(pdp=1.3, pdd=0.3))
        assert {"pd-d0", "pd-p7"} <= ctl.roles.unroutable()
    f.active["pd-d0"] = 0
    (act,) = f.step(pdp=1.3, pdd=0.3)
    assert act.action == "activate" and act.node == "pd-p7" and act.role == "prefill"
    assert "pd-p7" in ctl.roles.routable("prefill") and (act.prefill, act.decode, act.draining) == (4, 4, 0)


@pytest.mark.pure
def test_a_decode_bottleneck_converts_the_emptiest_prefill_instance() -> None:
    ctl = LongTermController(_cfg(), RoleBook("pd", 4, 2))
    f = Feed(ctl)
    f.active.update({"pd-p0": 3, "pd-p1": 0, "pd-p2": 2, "pd-p3": 1})
    out = f.run(20, pdp=0.3, pdd=0.95, waiting=3.0)
    (d,) = [x for x in out if x.action == "drain"]
    assert d.node == "pd-p1" and d.role == "decode" and "PD-D is the bottleneck" in d.reason
    (act,) = f.step(pdp=0.3, pdd=0.95)  # pd-p1 holds nothing: the switch comes at the next sample
    assert act.action == "activate" and act.node == ctl.roles.decode_node(1) == "pd-d4"


@pytest.mark.pure
def test_a_draining_queue_is_a_past_bottleneck_but_a_standing_one_counts() -> None:
    ctl = LongTermController(_cfg(confirm=1), RoleBook("pd", 3, 5))
    f = Feed(ctl)
    q = 30.0
    for _ in range(10):  # 30 s of queue shrinking, load low: no action
        q -= 2.0
        assert f.step(pdp=0.5, pdd=0.3, pdp_queue=q) == []
    assert ctl.assessments and not any(a.hot["pdp"] for a in ctl.assessments)
    out = f.run(10, pdp=0.5, pdd=0.3, pdp_queue=q + 1)  # standing (and growing) at >= 5 s
    assert [x.action for x in out] == ["drain"]


@pytest.mark.pure
def test_alternating_bottlenecks_and_a_busy_donor_do_not_flap() -> None:
    ctl = LongTermController(_cfg(confirm=2), RoleBook("pd", 3, 5))
    f = Feed(ctl)
    out: list[Any] = []
    for k in range(12):  # the hot role changes every judgement: never confirmed
        out += f.run(10, pdp=1.2 if k % 2 else 0.3, pdd=0.3 if k % 2 else 0.95)
    assert out == []
    # PD-P stays hot, but PD-D one short would run at 0.68 * 5/4 = 0.85 > 0.7: held, recorded once.
    out = f.run(100, pdp=1.2, pdd=0.68)
    assert [x.action for x in out] == ["hold"] and "would run at load 0.85" in out[0].reason
    # Both hot: no role has an instance to give.
    out = f.run(40, pdp=1.2, pdd=0.95)
    assert [x.action for x in out] == ["hold"] and "both bottlenecks" in out[0].reason


@pytest.mark.pure
def test_conversions_are_spaced_by_the_minimum_interval_and_stop_at_the_floor() -> None:
    ctl = LongTermController(_cfg(confirm=1, min_interval_s=60.0, min_decode=2), RoleBook("pd", 2, 6))
    f = Feed(ctl)
    drains = []
    for _ in range(150):  # 300 s of a hot PD-P with an idle PD-D
        for d in f.step(pdp=1.5, pdd=0.05):
            if d.action == "drain":
                drains.append(d.at)
    assert len(drains) == 4 and ctl.roles.counts()["decode"] == 2  # stopped at min_decode
    # Each drain ends at once (nothing on the node), so each 60 s gap runs from the switch.
    assert all(b - a >= 60.0 for a, b in zip(drains, drains[1:]))
    assert ctl.decisions[-1].action == "hold" and "minimum of 2" in ctl.decisions[-1].reason


def _planner(best: float) -> Any:
    """A model whose PD-P load rises and PrfaaS load falls with t; at 3 P the best t is `best`,
    with more PD-P instances a higher one (both loads 0.4 * sqrt(3 / N_p) there)."""

    def plan(smp: WorkloadSample, n_p: int, n_d: int, t: float | None) -> ThresholdPlan:
        t = best * (n_p / 3) ** 0.5 if t is None else t
        return ThresholdPlan(t, {"prfaas": 0.4 * best / t, "pdp": 0.4 * (t / best) * 3 / n_p, "pdd": 0.2 * 5 / n_d})

    return plan


@pytest.mark.pure
def test_the_threshold_is_reoptimised_and_its_judgement_starts_no_prefill_conversion() -> None:
    plan = _planner(5000.0)
    ctl = LongTermController(_cfg(confirm=1), RoleBook("pd", 3, 5), 19400.0, plan)
    f = Feed(ctl)
    out = f.run(10, pdp=1.3, pdd=0.3)
    (r,) = out
    assert r.action == "retune" and r.threshold_old == 19400.0 and r.threshold == 5000.0
    assert (
        "best t for 3 P / 5 D on the last 50 requests" in r.reason and "at t=19400: prfaas 0.10, pdp 1.55" in r.reason
    )
    # Next judgement: the same t, so no retune; PD-P still hot, the model agrees 4 P / 4 D is better.
    (d,) = f.run(10, pdp=1.3, pdd=0.3)
    assert d.action == "drain" and "model: peak load 0.40 now" in d.reason
    # A model that predicts no gain holds the conversion.
    ctl2 = LongTermController(
        _cfg(confirm=1),
        RoleBook("pd", 3, 5),
        19400.0,
        lambda s, p, d, t: ThresholdPlan(19400.0, {"pdp": 0.5, "pdd": 0.5 * 5 / d}),
    )
    out = Feed(ctl2).run(20, pdp=1.3, pdd=0.3)
    assert [x.action for x in out] == ["hold"] and "no gain" in out[0].reason


@pytest.mark.pure
def test_small_or_useless_retunes_are_not_made() -> None:
    ctl = LongTermController(_cfg(), RoleBook("pd", 3, 5), 5200.0, _planner(5000.0))
    assert Feed(ctl).run(40, pdp=0.3, pdd=0.3) == []  # within min_change
    flat = LongTermController(
        _cfg(),
        RoleBook("pd", 3, 5),
        19400.0,
        lambda s, p, d, t: ThresholdPlan(t or 5000.0, {"prfaas": 0.5, "pdp": 0.5, "pdd": 1.4}),
    )
    assert Feed(flat).run(40, pdp=0.3, pdd=0.3) == []  # no gain where t matters
    off = LongTermController(_cfg(retune=False), RoleBook("pd", 3, 5), 19400.0, _planner(5000.0))
    assert Feed(off).run(40, pdp=0.3, pdd=0.3) == []


@pytest.mark.pure
def test_decisions_reach_the_short_term_loop_and_the_records() -> None:
    from testbed.config.scenarios import load_scenario

    sc = load_scenario(PAPER)
    bw = BandwidthController(19400.0, 100e9, stage_model(sc), ControlSpec(), 131072.0)
    ctl = LongTermController(_cfg(confirm=1), RoleBook("pd", 3, 5), 19400.0, _planner(5000.0))
    f = Feed(ctl)
    made = f.run(10, pdp=1.3, pdd=0.3)
    done = apply(ctl, made, bw)
    assert done.threshold == 5000.0 and bw.base == bw.threshold == 5000.0 and bw.t_min == 1250.0
    metrics = [m for m, _, _ in done.lines]
    assert metrics == ["role_decision", "threshold_change"]
    _, value, labels = done.lines[1]
    assert value == 5000.0 and labels["old"] == "19400" and labels["reason"].startswith("long-term loop: ")
    made = f.run(10, pdp=1.3, pdd=0.3) + f.run(2, pdp=1.3, pdd=0.3)
    # The new split has its own best t (5000 * sqrt(4/3)): retuned as the slot switches.
    assert [d.action for d in made] == ["drain", "activate", "retune"]
    assert "split now 4 P / 4 D" in made[2].reason
    apply(ctl, made, bw)
    assert bw.model.pdp_instances == 4 and bw.base == pytest.approx(5000 * (4 / 3) ** 0.5)
    name, v, lab = decision_line(made[1], "pd")
    assert (name, v, lab["action"], lab["node"], lab["prefill"], lab["decode"]) == (
        "role_decision",
        4.0,
        "activate",
        "pd-p7",
        "4",
        "4",
    )
    assert float(lab["load_pdp"]) == pytest.approx(1.3)


@pytest.mark.pure
def test_the_model_planner_reoptimises_like_the_optimiser() -> None:
    import numpy as np

    from testbed.config.scenarios import load_scenario
    from testbed.model.retune import role_planner
    from testbed.traces.synthetic import sample_lengths

    sc = load_scenario(PAPER)
    lengths = sample_lengths(np.random.default_rng(4), 2000, sc.workload.input).astype(float)
    smp = WorkloadSample(tuple(lengths), (1024.0,) * 2000, 3.0)
    plan = role_planner(sc, 100e9)
    best = plan(smp, 3, 5, None)
    assert 17000 < best.threshold < 22000  # the paper's t = 19.4K for 3 P / 5 D
    assert best.loads["prfaas"] == pytest.approx(best.loads["pdp"], rel=0.05)  # the balance condition
    assert best.loads["pdd"] == pytest.approx(3.0 / 3.91, rel=0.02)  # Theta_pdd = 3.91 req/s
    at = plan(smp, 3, 5, 19400.0)
    assert at.threshold == 19400.0 and at.prefill_peak >= best.prefill_peak
    assert plan(smp, 5, 3, None).threshold > best.threshold  # more PD-P: more stays local
    homog = role_planner(load_scenario("paper-homogeneous"), 100e9)(smp, 9, 3, None)
    assert set(homog.loads) == {"pdp", "pdd"}


# -- the simulator ---------------------------------------------------------------------------


def _split_run(long_term: bool, p: int, d: int, run_dir: Path | None = None) -> tuple[float, Any]:
    from testbed.run.load import load
    from testbed.sim import simulate
    from testbed.traces.loader import trace_from_workload

    rs = load(
        PAPER,
        {
            "clusters": [
                {
                    "name": "prfaas",
                    "datacenter": "dc-remote",
                    "kind": "prfaas",
                    "hardware": "h200",
                    "prefill": 4,
                    "decode": 0,
                },
                {"name": "pd", "datacenter": "dc-local", "kind": "pd", "hardware": "h20", "prefill": p, "decode": d},
            ],
            "workload": {"requests": 400, "rate": 1.6, "output_tokens": 1024, "seed": 5},
            "policy": {
                "control": {
                    "long_term": {"enabled": long_term, "interval_s": 10, "min_interval_s": 20, "min_requests": 30}
                }
            },
        },
    )
    st = simulate(rs, trace_from_workload(rs.spec.workload), run_dir)
    recs = st.records
    if run_dir is not None:
        from testbed.metrics.records import read_records

        recs = read_records(run_dir / "records.csv")
    recs = sorted(recs, key=lambda r: r.times.arrival)
    assert all(r.outcome == "completed" for r in recs)
    return statistics.mean(r.ttft * rs.spec.scale.speedup for r in recs[len(recs) // 2 :]), rs


@pytest.mark.pure
def test_a_simulated_run_from_a_decode_starved_split_converts_and_its_ttft_recovers(tmp_path: Path) -> None:
    static, _ = _split_run(False, 6, 2)
    (tmp_path / "timeseries").mkdir()
    adaptive, rs = _split_run(True, 6, 2, tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    roles = [x["labels"] for x in lines if x["metric"] == "role_decision"]
    acts = [x for x in roles if x["action"] == "activate"]
    assert acts and acts[0]["node"].startswith("pd-d") and int(roles[-1]["decode"]) >= 3
    assert "PD-D is the bottleneck" in next(x["reason"] for x in roles if x["action"] == "drain")
    # Two decode instances cannot keep up at 1.6 req/s x 1024 tokens (Theta_pdd 1.56 req/s): the
    # static run's decode queue grows all run; the loop's converted instance takes it.
    assert adaptive < 0.5 * static, (adaptive, static)
    # No request was routed to a node after it left routing, nor to a spare before it joined.
    from testbed.metrics.records import read_records

    recs = read_records(tmp_path / "records.csv")
    events = [(x["ts"], x["labels"]) for x in lines if x["metric"] == "role_decision"]  # the sim's clock: records' too
    joined = {lab["node"]: ts for ts, lab in events if lab["action"] == "activate"}
    for ts, lab in events:
        if lab["action"] == "drain" and lab["node"] not in joined:
            assert not [r for r in recs if lab["node"] in (r.prefill_node, r.decode_node) and r.times.routed > ts]
    for r in recs:
        if r.decode_node not in ("pd-d0", "pd-d1"):
            assert r.decode_node in joined and r.times.routed >= joined[r.decode_node], r.decode_node
    assert any(r.decode_node in joined for r in recs)


@pytest.mark.pure
def test_the_report_draws_the_roles_and_lists_the_decisions(tmp_path: Path) -> None:
    import asyncio

    from testbed.run.load import load
    from testbed.run.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    rs = load(
        PAPER,
        {
            "clusters": [
                {
                    "name": "prfaas",
                    "datacenter": "dc-remote",
                    "kind": "prfaas",
                    "hardware": "h200",
                    "prefill": 4,
                    "decode": 0,
                },
                {"name": "pd", "datacenter": "dc-local", "kind": "pd", "hardware": "h20", "prefill": 6, "decode": 2},
            ],
            "workload": {"requests": 300, "rate": 1.6, "output_tokens": 1024, "seed": 5},
            "policy": {
                "bandwidth_aware": True,
                "control": {"long_term": {"enabled": True, "interval_s": 10, "min_interval_s": 20, "min_requests": 30}},
            },
        },
    )
    res = asyncio.run(run_replay_async(rs, trace_from_workload(rs.spec.workload), tmp_path, "sim"))
    lt, ctl = res.summary.long_term, res.summary.control
    assert lt is not None and ctl is not None
    assert lt.split_start == "6/2" and lt.conversions >= 1 and lt.split_end != "6/2"
    assert lt.decisions["drain"] >= lt.conversions and lt.changes[0].t_s > 0
    report = (tmp_path / "report.md").read_text()
    assert "## Long-term loop" in report and "roles.png" in report and "| 6/2 -> " in report
    assert (tmp_path / "roles.png").stat().st_size > 10_000
    retunes = [c for c in ctl.changes if c.reason.startswith("long-term loop:")]
    assert len(retunes) == lt.decisions["retune"]


# -- live, on loopback -----------------------------------------------------------------------


@pytest.mark.app
async def test_the_live_router_converts_a_prefill_instance_to_decode_without_losing_a_request(tmp_path: Path) -> None:
    from testbed.config.scenarios import load_scenario
    from testbed.metrics.records import read_records
    from testbed.run.load import resolve
    from testbed.run.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    # One decode instance for 2 req/s x 512 tokens (Theta_pdd 1.56 req/s): its slots fill within
    # ~10 paper seconds and the loop moves a prefill instance over.
    sc = load_scenario(
        PAPER,
        {
            "clusters": [
                {
                    "name": "prfaas",
                    "datacenter": "dc-remote",
                    "kind": "prfaas",
                    "hardware": "h200",
                    "prefill": 4,
                    "decode": 0,
                },
                {"name": "pd", "datacenter": "dc-local", "kind": "pd", "hardware": "h20", "prefill": 4, "decode": 1},
            ],
            "scale": {"speedup": 10, "byte_scale": 1024},
            "workload": {"requests": 90, "rate": 2.0, "output_tokens": 512, "seed": 3},
            "serving": {"stream_interval": 8},
            "policy": {
                "control": {
                    "long_term": {
                        "enabled": True,
                        "sample_s": 1.0,
                        "interval_s": 5.0,
                        "confirm": 1,
                        "min_interval_s": 0.0,
                        "min_requests": 10,
                    }
                }
            },
        },
    )
    res = await run_replay_async(resolve(sc), trace_from_workload(sc.workload), tmp_path, "inproc")
    recs = read_records(tmp_path / "records.csv")
    assert len(recs) == 90 and all(r.outcome == "completed" for r in recs), [r.reason for r in recs if r.reason]
    lines = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    t0 = json.loads((tmp_path / "run.json").read_text())["t0"]  # records are relative to it
    events = [(x["ts"] - t0, x["labels"]) for x in lines if x["metric"] == "role_decision"]
    drains = [(ts, lab) for ts, lab in events if lab["action"] == "drain"]
    acts = [(ts, lab) for ts, lab in events if lab["action"] == "activate"]
    assert drains and acts, events
    (t_drain, drain), (t_act, act) = drains[0], acts[0]
    assert (
        drain["node"].startswith("pd-p") and drain["role"] == "decode" and "PD-D is the bottleneck" in drain["reason"]
    )
    assert act["node"].startswith("pd-d") and act["node"] != "pd-d0" and t_act >= t_drain
    # The drained prefill instance got nothing new; what it had finished before the switch, and
    # the decode node of its slot served only after the switch.
    assert not [r for r in recs if r.prefill_node == drain["node"] and r.times.routed > t_drain]
    assert all(r.times.prefill_end <= t_act for r in recs if r.prefill_node == drain["node"])
    on_new = [r for r in recs if r.decode_node == act["node"]]
    assert on_new and min(r.times.routed for r in on_new) >= t_act
    assert res.summary.long_term is not None and res.summary.long_term.conversions >= 1
    assert "## Long-term loop" in (tmp_path / "report.md").read_text()
