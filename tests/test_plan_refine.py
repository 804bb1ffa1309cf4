"""Plans checked and chosen by simulation: configurations scored on their own routing
(`planner.score_config`), the estimate's burstiness, the simulator's verdict and ranking
(`studies.plan.plan_sim`), and a small real `testbed plan --refine` on the simulator (slow tier)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.engine.kvsize import KVModel
from testbed.model.analytical import evaluate
from testbed.model.planner import (
    Candidate,
    PlanSettings,
    family_for,
    family_workload,
    plan_family,
    ready_after,
    routing_for,
    score_config,
)
from testbed.model.workload import TraceWorkload
from testbed.studies.plan import plan as plan_cmd
from testbed.studies.plan import plan_command
from testbed.studies.plan.plan_sim import refined_key, sim_verdict, simulate_rows, with_simulation
from testbed.traces.mooncake import write_mooncake
from testbed.traces.synthetic import synth_with_prefixes
from testbed.traces.types import Trace

pure = pytest.mark.pure


def _settings(**kw: Any) -> PlanSettings:
    base = dict(ttft_slo_s=10.0, tpot_slo_s=0.025, link_bps=100e9, link_delay_s=0.015)
    base.update(kw)
    return PlanSettings(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def trace() -> Trace:
    """Two thousand conversation turns at 3.3 req/s (ten minutes), as `make replay-load-aware`'s trace."""
    return synth_with_prefixes(2000, 3.3333, 1)


@pure
@pytest.mark.parametrize("kind, t", [("prfaas", 2000), ("homogeneous", None), ("naive", None)])
def test_score_config_is_the_model_on_its_own_replay(trace: Trace, kind: str, t: int | None) -> None:
    """One round: the prompts enter the pools when their prefill alone would end; the figures are
    then `evaluate`'s on that replay's lengths (the plain form)."""
    fam = family_for(kind, load_scenario(f"paper-{kind}"))  # type: ignore[arg-type]
    kv = KVModel.from_spec(fam.base.model)
    wl = family_workload(fam, trace).model_workload()
    pd = fam.base.cluster("pd")
    n_prf = fam.base.cluster("prfaas").prefill if fam.prfaas_cluster else 0
    c = score_config(fam, wl, trace, _settings(), n_prf, pd.prefill, pd.decode, t, True, rounds=1)
    own = TraceWorkload.from_trace(trace, kv, routing_for(fam.kind, t, True), ready_after(fam))
    m = evaluate(fam.base, 100e9, threshold=t, workload=own.model_workload())
    assert c.lambda_max == pytest.approx(m.lambda_max, rel=1e-6)
    assert c.p == pytest.approx(m.p, abs=1e-9)
    assert c.ttft_free_s == pytest.approx(m.ttft_mean_s, rel=1e-6)
    # A second round adds the stages' waits to when prompts are ready: fewer hits, no faster.
    c2 = score_config(fam, wl, trace, _settings(), n_prf, pd.prefill, pd.decode, t, True)
    assert c2.ttft_mean_s >= c.ttft_mean_s - 1e-9


@pure
def test_the_length_only_base_is_modelled_as_it_routes(trace: Trace) -> None:
    """paper-prfaas routes on the whole prompt (cache_aware false): its offload share is that of
    prompts over 19.4K, not of incremental lengths over it, and its whole KV ships."""
    fam = family_for("prfaas", load_scenario("paper-prfaas"))
    wl = family_workload(fam, trace).model_workload()
    s = _settings()
    blind = score_config(fam, wl, trace, s, 4, 3, 5, 19400, cache_aware=False)
    aware = score_config(fam, wl, trace, s, 4, 3, 5, 19400, cache_aware=True)
    inputs = np.array([r.input_tokens for r in trace])
    assert blind.p == pytest.approx(float(np.mean(inputs > 19400)))
    assert aware.p < blind.p / 2  # most long prompts are cached follow-ups
    assert blind.egress_bps > aware.egress_bps
    assert blind.util_pdp is not None and aware.util_pdp is not None and blind.util_pdp < aware.util_pdp


@pure
def test_bursty_arrivals_wait_longer(trace: Trace) -> None:
    fam = family_for("homogeneous", load_scenario("paper-homogeneous"))
    wl = family_workload(fam, trace).model_workload()
    assert wl.arrival_scv == pytest.approx(1.0, abs=0.15)
    calm = plan_family(fam, wl, _settings()).candidates
    bursty = plan_family(fam, replace(wl, arrival_scv=9.0), _settings()).candidates
    for c in calm[:3]:
        b = next(x for x in bursty if (x.n_p, x.n_d) == (c.n_p, c.n_d))
        assert b.ttft_mean_s > c.ttft_mean_s and b.ttft_free_s == c.ttft_free_s
        assert b.lambda_max == c.lambda_max  # capacity does not depend on the arrivals


# ---------------------------------------------------------------------------------------------
# The simulator's verdict and ranking


def _cand(**kw: Any) -> Candidate:
    base: dict[str, Any] = dict(
        kind="homogeneous",
        base="b",
        n_prfaas=0,
        n_p=8,
        n_d=4,
        threshold=None,
        p=0.0,
        lambda_max=6.0,
        theta_prfaas=None,
        theta_pdp=6.0,
        theta_pdd=7.0,
        bottleneck="pdp",
        rate=3.0,
        ttft_free_s=1.0,
        ttft_mean_s=1.2,
        ttft_p90_s=2.0,
        util_prfaas=None,
        util_pdp=0.5,
        util_pdd=0.3,
        egress_bps=0.0,
        egress_share=0.0,
        meets_slo=True,
        meets_slo_model=True,
    )
    base.update(kw)
    return Candidate(**base)


def _figs(**kw: Any) -> dict[str, Any]:
    f: dict[str, Any] = {
        "ttft_mean_s": 1.0,
        "ttft_p90_s": 2.0,
        "tpot_p90_s": 0.025,
        "offload_share": 0.0,
        "egress_gbps": 0.0,
        "completed_rps": 3.0,
        "slo_attainment": 1.0,
        "requests": 100,
        "failed": 0,
    }
    f.update(kw)
    return f


@pure
def test_sim_verdict() -> None:
    s = _settings()
    assert sim_verdict(_figs(), s) == (True, None)
    assert sim_verdict(_figs(tpot_p90_s=0.02524), s)[0]  # within the summary's 1% slack
    for figs, why in (
        (_figs(ttft_p90_s=10.2), "TTFT"),
        (_figs(tpot_p90_s=0.0256), "TPOT"),
        (_figs(failed=3), "3 of 100"),
        (_figs(ttft_p90_s=None), "TTFT"),
        ({"error": "x"}, "failed"),
    ):
        ok, reason = sim_verdict(figs, s)
        assert not ok and reason is not None and why in reason
    c = with_simulation(_cand(), _figs(ttft_p90_s=12.0), s)
    assert not c.meets_slo and c.meets_slo_model and c.simulated is not None and "12.0" in c.notes[-1]


@pure
def test_refined_key_ranks_by_the_simulation() -> None:
    s = _settings()
    fast_model = with_simulation(_cand(ttft_mean_s=0.5, n_p=7, n_d=5), _figs(ttft_mean_s=1.4), s)
    fast_sim = with_simulation(_cand(ttft_mean_s=0.9, n_p=9, n_d=3), _figs(ttft_mean_s=1.1), s)
    failing = with_simulation(_cand(ttft_mean_s=0.1), _figs(ttft_mean_s=0.2, ttft_p90_s=11.0), s)
    broken = with_simulation(_cand(), {"error": "boom"}, s)
    for obj in ("lambda", "ttft", "ttft-p90"):
        ranked = sorted([broken, failing, fast_model, fast_sim], key=lambda c: refined_key(c, obj))  # type: ignore[arg-type]
        assert ranked[0] is fast_sim or obj == "ttft-p90"
        assert set(ranked[2:]) == {failing, broken}
    bigger = with_simulation(_cand(lambda_max=7.0), _figs(ttft_mean_s=3.0), s)
    assert refined_key(bigger, "lambda") < refined_key(fast_sim, "lambda")  # Λ_max first
    assert refined_key(fast_sim, "ttft") < refined_key(bigger, "ttft")


@pure
def test_simulate_rows_reports_failures_and_absence(tmp_path: Path) -> None:
    s = _settings()
    calls: list[str] = []

    def sim(path: Path, trace: Path, name: str) -> dict[str, Any]:
        calls.append(name)
        if name == "bad":
            raise RuntimeError("no")
        return _figs()

    rows = [
        (_cand(), tmp_path / "a.yaml", "a"),
        (_cand(n_p=7), tmp_path / "b.yaml", "bad"),
        (_cand(), tmp_path / "a.yaml", "a"),
    ]
    done, why = simulate_rows(rows, tmp_path / "t.jsonl", sim, s)
    assert why is None and calls == ["a", "bad"] and done["a"].meets_slo and not done["bad"].meets_slo
    assert simulate_rows(rows, tmp_path / "t.jsonl", None, s) == ({}, "not verified by simulation (--no-sim)")


# ---------------------------------------------------------------------------------------------
# A real refine run on the simulator


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_refine_on_the_simulator(trace: Trace, tmp_path: Path) -> None:
    """Ten minutes of conversation traffic: every written or recommended row simulated, each
    kind's first choice the simulator's best of its simulated rows, no row said to meet the SLOs
    that misses them in simulation, and the estimate near what the simulator measured."""
    path = tmp_path / "chat-10m.jsonl"
    write_mooncake(path, trace)
    ap = argparse.ArgumentParser()
    plan_command.register(ap.add_subparsers())
    out = tmp_path / "plan"
    args = ap.parse_args(
        ["plan", "--trace", str(path), "--refine", "3", "--top", "2", "--out", str(out), "--objective", "ttft"]
    )
    res = plan_cmd.run_plan(plan_cmd.PlanOptions.from_args(args)).to_json()
    if not res["verified"]:
        pytest.skip(res["verification"])
    s = _settings()
    simulated = res["simulated"]
    # The best 3 of each kind (naive has one deployment on these counts) and the three bases.
    assert len(simulated) >= sum(min(3, k["candidates"]) for k in res["kinds"].values()) + 3
    for row in [*res["ranking"], *(k["reference"] for k in res["kinds"].values())]:
        if row["file"] if "file" in row else True:
            assert row["simulated"] is not None
        if row["simulated"] is not None:
            ok, _ = sim_verdict(row["simulated"], s)
            assert row["meets_slo"] == ok
    for kind, k in res["kinds"].items():
        mine = [r for r in res["ranking"] if r["kind"] == kind and r["simulated"] is not None]
        best = min(mine, key=lambda r: (not r["meets_slo"], r["simulated"]["ttft_mean_s"], -r["lambda_max"]))
        assert (k["best"]["n_p"], k["best"]["n_d"], k["best"]["threshold"]) == (
            best["n_p"],
            best["n_d"],
            best["threshold"],
        )
        sim_mean = k["best"]["simulated"]["ttft_mean_s"]
        # Measured at seed 1: within 5% for every kind; the bound leaves room for other seeds.
        assert math.isfinite(k["best"]["ttft_mean_s"]) and abs(k["best"]["ttft_mean_s"] / sim_mean - 1) < 0.15
    plan = json.loads((out / "plan.json").read_text())
    assert plan["kinds"]["prfaas"]["best"]["file"] == "plan-prfaas-1.yaml"
