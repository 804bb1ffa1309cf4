"""The deployment planner (`testbed.model.planner`), its queueing estimates and `testbed plan`."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from summaries import make_summary

from testbed.config.scenarios import load_scenario
from testbed.core.engine.kvsize import KVModel
from testbed.core.schema.scenario import LengthDist
from testbed.model.analytical import evaluate
from testbed.model.planner import (
    PlanError,
    PlanSettings,
    candidate_scenario,
    family_for,
    objective_key,
    plan_family,
)
from testbed.model.queueing import Branch, erlang_c, mgc_wait, mixture_quantile
from testbed.model.workload import TraceWorkload
from testbed.studies.plan import plan as plan_cmd
from testbed.studies.plan import plan_command
from testbed.traces.mooncake import write_mooncake
from testbed.traces.synthetic import synth_with_prefixes
from testbed.traces.trace_command import prefix_reuse_share
from testbed.traces.types import Trace

pytestmark = pytest.mark.pure


# ---------------------------------------------------------------------------------------------
# A surrogate of an hour of production conversation traffic, from its published statistics only
# (~12,000 requests/hour, mean input ~12K, P90 ~27K, ~350 output tokens, ~37% of blocks seen
# before): multi-turn sessions of `synth_with_prefixes`, 1.5 turns each on average.


def surrogate_trace() -> Trace:
    return synth_with_prefixes(
        12000,
        12000 / 3600,
        1,
        sessions=8000,
        system_prompt_tokens=1024,
        first_turn=LengthDist(mu=8.7, sigma=1.1, min=128, max=100000),
        follow_up=LengthDist(mu=7.0, sigma=1.2, min=16, max=16384),
        output=LengthDist(mu=5.7, sigma=0.6, min=16, max=2000),
    )


@pytest.fixture(scope="module")
def surrogate() -> Trace:
    return surrogate_trace()


@pytest.fixture(scope="module")
def surrogate_file(surrogate: Trace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("surrogate") / "conversation-surrogate.jsonl"
    write_mooncake(p, surrogate)
    return p


def test_surrogate_has_the_stated_statistics(surrogate: Trace) -> None:
    inp = np.array([r.input_tokens for r in surrogate], dtype=float)
    out = np.array([r.output_tokens for r in surrogate], dtype=float)
    assert len(surrogate) == 12000 and 3400 <= surrogate.duration <= 3800
    assert 11000 <= inp.mean() <= 13500 and 24000 <= np.percentile(inp, 90) <= 30000
    assert 300 <= out.mean() <= 400
    assert 0.33 <= prefix_reuse_share(surrogate)[0] <= 0.41


# ---------------------------------------------------------------------------------------------
# Queueing


def test_erlang_c_known_values() -> None:
    assert erlang_c(1, 0.6) == pytest.approx(0.6)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    # Table value: c = 10, a = 8 Erlangs -> 0.409.
    assert erlang_c(10, 8.0) == pytest.approx(0.4092, abs=1e-3)
    assert list(erlang_c([1, 3], [2.0, 3.5])) == [1.0, 1.0]  # saturated


def test_mgc_wait_single_server_is_pollaczek_khinchine() -> None:
    lam, s = 0.5, 1.2
    rho = lam * s
    det = mgc_wait(lam, s, s * s, 1)  # M/D/1
    assert float(det.mean) == pytest.approx(rho * s / (2 * (1 - rho)))
    exp = mgc_wait(lam, s, 2 * s * s, 1)  # M/M/1
    assert float(exp.mean) == pytest.approx(rho / (1 / s - lam))
    assert float(exp.utilisation) == pytest.approx(rho)
    assert math.isinf(float(mgc_wait(1.0, 1.0, 1.0, 1).mean))
    idle = mgc_wait(0.0, 1.0, 1.0, 0)
    assert float(idle.mean) == 0.0 and float(idle.utilisation) == 0.0


def test_mixture_quantile() -> None:
    b = Branch(np.array([1.0]), np.array([1.0]), p_wait=0.5, wait_tail_mean=2.0)
    # P(T <= x) = 1 - 0.5 exp(-(x - 1) / 2) = 0.9.
    assert mixture_quantile([b], 0.9) == pytest.approx(1 + 2 * math.log(5), rel=1e-4)
    no_wait = Branch(np.array([0.5, 0.5]), np.array([1.0, 3.0]), p_wait=0.0, wait_tail_mean=0.0)
    assert mixture_quantile([no_wait], 0.4) == pytest.approx(1.0, rel=1e-4)
    assert mixture_quantile([no_wait], 0.9) == pytest.approx(3.0, rel=1e-4)
    assert math.isinf(mixture_quantile([Branch(np.ones(1), np.ones(1), 1.0, math.inf)], 0.9))


# ---------------------------------------------------------------------------------------------
# Planner on the surrogate


def _settings(**kw: Any) -> PlanSettings:
    base = dict(ttft_slo_s=10.0, tpot_slo_s=0.025, link_bps=100e9, link_delay_s=0.015)
    base.update(kw)
    return PlanSettings(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def workload(surrogate: Trace) -> TraceWorkload:
    return TraceWorkload.from_trace(surrogate, KVModel.from_spec(load_scenario("paper-prfaas").model))


def test_prfaas_plan_beats_homogeneous_and_the_static_config(workload: TraceWorkload) -> None:
    wl, s = workload.model_workload(), _settings()
    prf = plan_family(family_for("prfaas", load_scenario("paper-prfaas")), wl, s, reference_threshold=19400)
    hom = plan_family(family_for("homogeneous", load_scenario("paper-homogeneous")), wl, s)
    best_prf, best_hom = prf.candidates[0], hom.candidates[0]
    assert best_prf.lambda_max > best_hom.lambda_max
    assert best_prf.meets_slo
    static = prf.reference
    assert static is not None and (static.threshold, static.n_p, static.n_d) == (19400, 3, 5)
    assert static.lambda_max < best_prf.lambda_max
    assert objective_key(best_prf, "lambda") < objective_key(static, "lambda")
    # Every split of the 8 H20 instances is a candidate, with its own best threshold.
    assert sorted((c.n_p, c.n_d) for c in prf.candidates) == [(n, 8 - n) for n in range(1, 8)]


@pytest.mark.parametrize("kind", ["prfaas", "homogeneous", "naive"])
def test_planner_figures_are_the_models(workload: TraceWorkload, kind: str) -> None:
    """A candidate's Lambda_max, thetas and queue-free TTFT are what `evaluate` gives its scenario."""
    wl = workload.model_workload()
    fp = plan_family(family_for(kind, load_scenario(f"paper-{kind}")), wl, _settings())  # type: ignore[arg-type]
    for c in fp.candidates[:3]:
        sc = candidate_scenario(fp.family, c, "x", cache_aware=True)
        m = evaluate(sc, 100e9, threshold=c.threshold, workload=wl)
        assert m.lambda_max == pytest.approx(c.lambda_max, rel=1e-9)
        assert m.theta_pdd == pytest.approx(c.theta_pdd, rel=1e-9)
        assert m.p == pytest.approx(c.p, abs=1e-9)
        assert m.ttft_mean_s == pytest.approx(c.ttft_free_s, rel=1e-9)
        if c.theta_pdp is not None:
            assert m.theta_pdp == pytest.approx(c.theta_pdp, rel=1e-9)


def test_ttft_estimate_tends_to_queue_free(workload: TraceWorkload) -> None:
    wl = workload.model_workload()
    fam = family_for("prfaas", load_scenario("paper-prfaas"))
    idle = plan_family(fam, wl, _settings(rate=1e-6)).candidates[0]
    kv_tail_and_delay = idle.p * 0.015
    assert idle.ttft_mean_s == pytest.approx(idle.ttft_free_s + 0.025 + kv_tail_and_delay, abs=2e-3)
    busy = plan_family(fam, wl, _settings(rate=wl.rate * 2)).candidates
    same = next(c for c in busy if (c.n_p, c.n_d) == (idle.n_p, idle.n_d))
    assert same.ttft_mean_s > idle.ttft_mean_s


def test_objectives_and_slo(workload: TraceWorkload) -> None:
    wl = workload.model_workload()
    fam = family_for("prfaas", load_scenario("paper-prfaas"))
    by_ttft = plan_family(fam, wl, _settings(objective="ttft")).candidates
    assert by_ttft[0].ttft_mean_s == min(c.ttft_mean_s for c in by_ttft if c.meets_slo)
    by_p90 = plan_family(fam, wl, _settings(objective="ttft-p90")).candidates
    assert by_p90[0].ttft_p90_s == min(c.ttft_p90_s for c in by_p90 if c.meets_slo)
    strict = plan_family(fam, wl, _settings(ttft_slo_s=0.5)).candidates
    assert not any(c.meets_slo for c in strict) and all(c.notes for c in strict)
    tpot = plan_family(fam, wl, _settings(tpot_slo_s=0.02)).candidates
    assert not tpot[0].meets_slo and "TPOT" in tpot[0].notes[0]


def test_vary_counts_and_budget() -> None:
    sc = load_scenario("paper-prfaas")
    assert family_for("prfaas", sc).counts == ((4, 8),)
    assert family_for("prfaas", sc, {"h200": 2, "h20": 10}).counts == ((2, 10),)
    fam = family_for("prfaas", sc, vary_counts=True)
    assert len(fam.counts) == 4 * 7 and (1, 2) in fam.counts and (4, 8) in fam.counts
    assert family_for("naive", sc, vary_counts=True).counts[0] == (1, 1)
    assert family_for("homogeneous", load_scenario("paper-homogeneous"), {"h20": 16}).counts == ((0, 16),)
    with pytest.raises(PlanError):
        family_for("prfaas", load_scenario("paper-homogeneous"))
    assert plan_cmd.parse_budget(["h200=4,h20=8", "homogeneous:h20=12"]) == {
        None: {"h200": 4, "h20": 8},
        "homogeneous": {"h20": 12},
    }
    for bad in ("h200", "x:h20=3", "h20=0", "h20=two"):
        with pytest.raises(PlanError):
            plan_cmd.parse_budget([bad])


def test_round_threshold_costs_at_most_the_tolerance(workload: TraceWorkload) -> None:
    wl = workload.model_workload()
    fam = family_for("prfaas", load_scenario("paper-prfaas"))
    exact = plan_family(fam, wl, _settings(), round_top=0).candidates[0]
    rounded = plan_family(fam, wl, _settings()).candidates[0]
    assert rounded.threshold is not None and exact.threshold is not None
    assert rounded.lambda_max >= exact.lambda_max * (1 - 0.005)
    assert rounded.threshold % 50 == 0 or rounded.threshold == exact.threshold


# ---------------------------------------------------------------------------------------------
# The command


def _ns(trace: Path, out: Path, *extra: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    plan_command.register(ap.add_subparsers())
    return ap.parse_args(["plan", "--trace", str(trace), "--out", str(out), *extra])


def _args(trace: Path, out: Path, *extra: str) -> plan_cmd.PlanOptions:
    """The options as `cmd_plan` fills them from the flags."""
    return plan_cmd.PlanOptions.from_args(_ns(trace, out, *extra))


def _plan(opts: plan_cmd.PlanOptions, **kw: Any) -> dict[str, Any]:
    """plan.json's content of one run."""
    return plan_cmd.run_plan(opts, **kw).to_json()


def test_plan_command_writes_loadable_scenarios(surrogate_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan"
    res = _plan(_args(surrogate_file, out, "--top", "2"), simulate=None)
    files = sorted(p.name for p in out.glob("plan-*.yaml"))
    assert files == [
        "plan-homogeneous-1.yaml",
        "plan-homogeneous-2.yaml",
        "plan-naive-1.yaml",
        "plan-prfaas-1.yaml",
        "plan-prfaas-2.yaml",
    ]
    assert (out / "plan.md").exists() and json.loads((out / "plan.json").read_text())["ranking"]
    by_file = {r["file"]: r for r in res["ranking"] if r["file"]}
    for name in files:
        sc = load_scenario(out / name)
        row = by_file[name]
        assert sc.name == name[:-5] and sc.policy.name == row["kind"]
        pd = sc.cluster("pd")
        assert (pd.prefill, pd.decode) == (row["n_p"], row["n_d"])
        assert sc.policy.threshold == row["threshold"]
        assert sc.policy.cache_aware  # the trace has prefix reuse: route on the incremental length
    best = res["kinds"]["prfaas"]["best"]
    assert best["lambda_max"] > res["kinds"]["homogeneous"]["best"]["lambda_max"]
    assert res["kinds"]["prfaas"]["reference"]["lambda_max"] < best["lambda_max"]
    assert not res["verified"] and not (out / "candidates").exists()
    assert "not verified by simulation" in (out / "plan.md").read_text()
    assert all(r["simulated"] is None and r["meets_slo"] == r["meets_slo_model"] for r in res["ranking"])
    # The whole hour plans in seconds (the search is vectorised).
    assert res["seconds"] < 60


def _fake_sim(seen: list[tuple[Path, Path, str]], fail: str = "naive", slow: str = "") -> plan_cmd.Simulate:
    """A simulator that reports the model's own figures, fails every run whose name holds `fail`
    and puts a P90 TTFT of 30 s (over the SLO) on the runs whose name holds `slow`."""

    def fake(scenario: Path, trace: Path, name: str) -> dict[str, Any]:
        seen.append((scenario, trace, name))
        if fail and fail in name:
            raise RuntimeError("boom")
        sc = load_scenario(scenario)
        # A made-up but deterministic TTFT that prefers fewer PD decode instances.
        mean = 0.5 + 0.1 * sc.cluster("pd").decode
        return {
            "ttft_mean_s": mean,
            "ttft_p90_s": 30.0 if slow and slow in name else 2 * mean,
            "tpot_p90_s": 0.025,
            "offload_share": 0.4,
            "egress_gbps": 4.0,
            "completed_rps": 3.3,
            "slo_attainment": 0.99,
            "requests": 100,
            "failed": 0,
        }

    return fake


def test_plan_command_simulates_every_written_or_recommended_row(surrogate_file: Path, tmp_path: Path) -> None:
    seen: list[tuple[Path, Path, str]] = []
    out = tmp_path / "plan"
    res = _plan(
        _args(surrogate_file, out, "--refine", "4", "--top", "2", "--kinds", "prfaas,homogeneous"),
        simulate=_fake_sim(seen, fail="homogeneous-0-9-3", slow="paper-prfaas"),
    )
    names = [n for _, _, n in seen]
    assert all(t == surrogate_file for _, t, _ in seen) and len(names) == len(set(names))
    # The best 4 of each kind by the model, and both bases as they stand.
    assert sum(n.startswith("prfaas-") for n in names) == 4 and sum(n.startswith("homogeneous-") for n in names) == 4
    assert {"paper-prfaas", "paper-homogeneous"} <= set(names)
    assert res["verified"]
    for r in res["ranking"]:
        if r["file"]:
            assert r["simulated"] is not None  # every written row was simulated
    ref = res["kinds"]["prfaas"]["reference"]
    assert ref["simulated"]["ttft_p90_s"] == 30.0 and not ref["meets_slo"]  # the simulator's verdict
    failed = next(r for r in res["ranking"] if (r["kind"], r["n_p"], r["n_d"]) == ("homogeneous", 9, 3))
    assert "error" in failed["simulated"] and not failed["meets_slo"]
    # Simulated rows rank by the simulation: the fake prefers fewer decode instances at equal Λ_max,
    # SLO-meeting ones first; the first choice of each kind is the best of its simulated rows.
    for kind in ("prfaas", "homogeneous"):
        simd = [r for r in res["ranking"] if r["kind"] == kind and r["simulated"] is not None]
        first = res["kinds"][kind]["best"]
        assert first == {**simd[0], "file": first["file"]} and first["file"] == f"plan-{kind}-1.yaml"
        ok = [r for r in simd if r["meets_slo"]]
        assert (-round(first["lambda_max"], 9), first["simulated"]["ttft_mean_s"]) == min(
            (-round(r["lambda_max"], 9), r["simulated"]["ttft_mean_s"]) for r in ok
        )
    md = (out / "plan.md").read_text()
    assert "predicted against simulated" in md and "failed: RuntimeError: boom" in md
    assert "## Chosen by simulation" in md and "yes (sim)" in md and "no (sim)" in md
    assert sorted(p.name for p in (out / "candidates").glob("*.yaml")) == sorted(
        f"{n}.yaml" for n in names if n.startswith(("prfaas-", "homogeneous-"))
    )


def test_plan_command_fewest_instances_are_simulated(surrogate_file: Path, tmp_path: Path) -> None:
    seen: list[tuple[Path, Path, str]] = []
    out = tmp_path / "plan"
    res = _plan(
        _args(surrogate_file, out, "--kinds", "homogeneous", "--vary-counts", "--top", "1"),
        simulate=_fake_sim(seen, fail=""),
    )
    few = res["kinds"]["homogeneous"]["fewest"]
    assert few is not None and few["simulated"] is not None and few["meets_slo"]
    assert few["file"] in ("plan-homogeneous-1.yaml", "plan-homogeneous-fewest.yaml")
    assert (out / few["file"]).exists()
    assert (
        few["n_p"] + few["n_d"]
        <= res["kinds"]["homogeneous"]["best"]["n_p"] + res["kinds"]["homogeneous"]["best"]["n_d"]
    )


def test_budget_without_a_kind_is_said_to_cap_every_kind(surrogate_file: Path, tmp_path: Path) -> None:
    res = _plan(_args(surrogate_file, tmp_path / "p", "--budget", "h200=4,h20=8", "--top", "1"), simulate=None)
    assert res["settings"]["budgets"]["homogeneous"] == "h20=8 (--budget every kind)"
    assert res["settings"]["budgets"]["prfaas"] == "h200=4 (--budget every kind), h20=8 (--budget every kind)"
    note = next(n for n in res["notes"] if n.startswith("homogeneous:"))
    assert "caps it below its base's 12 h20" in note and "prfaas:h20=8" in note
    # The plan says which prefill scheduler its capacities assumed, per hardware.
    assert res["settings"]["schedulers"] == {
        "h200": "fcfs (one whole prompt a pass)",
        "h20": "fcfs (one whole prompt a pass)",
    }
    assert "Prefill scheduler assumed" in (tmp_path / "p" / "plan.md").read_text()
    best = res["kinds"]["homogeneous"]["best"]
    assert best["n_p"] + best["n_d"] == 8
    res = _plan(
        _args(
            surrogate_file, tmp_path / "q", "--budget", "prfaas:h20=6", "--top", "1", "--kinds", "prfaas,homogeneous"
        ),
        simulate=None,
    )
    assert res["settings"]["budgets"]["homogeneous"] == "h20=12 (base)" and not res["notes"]
    assert res["settings"]["budgets"]["prfaas"] == "h200=4 (base), h20=6 (--budget prfaas:)"


def test_plan_command_cli(surrogate_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _ns(surrogate_file, tmp_path / "p", "--kinds", "homogeneous", "--json", "--no-sim")
    assert args.func is plan_command.cmd_plan and args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["kinds"]) == ["homogeneous"]
    assert plan_command.cmd_plan(_ns(surrogate_file, tmp_path / "q", "--kinds", "nope")) == 2
    assert "--kinds" in capsys.readouterr().err


def test_pick_bases() -> None:
    prf = plan_cmd.Base("paper-prfaas", Path("x"), load_scenario("paper-prfaas"))
    bases, notes = plan_cmd.pick_bases([prf], ["prfaas", "naive", "homogeneous"])
    assert bases["prfaas"] is prf and bases["naive"] is prf and bases["homogeneous"].name == "paper-homogeneous"
    assert len(notes) == 2
    dense = plan_cmd.Base("paper-prfaas-dense", Path("y"), load_scenario("paper-prfaas-dense"))
    bases, notes = plan_cmd.pick_bases([dense], ["prfaas", "homogeneous"])
    assert "homogeneous" not in bases and "left out" in notes[0]


def test_verify_stops_when_the_simulator_is_unavailable(surrogate_file: Path, tmp_path: Path) -> None:
    calls: list[Path] = []

    def unavailable(scenario: Path, trace: Path, name: str) -> dict[str, Any]:
        calls.append(scenario)
        raise plan_cmd.SimUnavailable("unknown backend 'sim'")

    res = _plan(_args(surrogate_file, tmp_path / "p", "--kinds", "homogeneous,naive"), simulate=unavailable)
    assert len(calls) == 1 and not res["verified"]
    assert "no sim backend" in res["verification"] and all(r["simulated"] is None for r in res["ranking"])


def test_sim_simulator_against_the_runner(tmp_path: Path) -> None:
    """Wired to `run_replay_async(..., backend="sim")`: verified when the runner has the simulator,
    else said so, with nothing left behind."""
    trace = tmp_path / "small.jsonl"
    write_mooncake(trace, synth_with_prefixes(30, 2.0, 4))
    out = tmp_path / "p"
    res = _plan(_args(trace, out, "--kinds", "homogeneous", "--top", "1"))
    if res["verified"]:
        sim = res["kinds"]["homogeneous"]["best"]["simulated"]
        assert sim is not None and set(plan_cmd.SIM_FIGURES) <= set(sim)
        assert (out / "sim" / "paper-homogeneous" / "summary.json").exists()
    else:
        assert "no sim backend" in res["verification"]
        assert not (out / "sim").exists()


def test_simulated_figures_from_a_run_summary() -> None:
    summary = make_summary(
        run__duration_s_paper=100.0,
        ttft_s__mean=1.5,
        ttft_s__p90=3.0,
        offload__ratio=0.4,
        bytes__wan_total_paper=125e9,
        throughput__completed_rps_paper=3.2,
        throughput__slo_attainment=0.97,
        tpot_s__p90=0.025,
        requests__total=10,
        requests__failed=1,
        requests__pending=1,
    )
    f = plan_cmd.figures(summary)
    assert f == {
        "ttft_mean_s": 1.5,
        "ttft_p90_s": 3.0,
        "tpot_p90_s": 0.025,
        "offload_share": 0.4,
        "egress_gbps": pytest.approx(10.0),
        "completed_rps": 3.2,
        "slo_attainment": 0.97,
        "requests": 10,
        "failed": 2,
    }
    assert plan_cmd.figures(make_summary(run__duration_s_paper=None))["egress_gbps"] is None
