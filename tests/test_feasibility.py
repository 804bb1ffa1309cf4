"""The feasibility map: grid, break-even search and the paper's hybrid/dense contrast by the
model (pure), and `testbed feasibility` at a tiny grid, simulated and with the confirmation
plumbing on the inproc backend (app)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from testbed.cli import main
from testbed.config.profiles import load_profile
from testbed.config.scenarios import ScenarioError, load_scenario
from testbed.core.engine.servicetime import PrefillTime
from testbed.model.feasibility import (
    Deployments,
    ModelMap,
    compute_map,
    load_deployments,
    scaled_pd_prefill,
    smallest_rate,
)
from testbed.studies.feasibility.feasibility import link_profile, pick_confirm, subset_keys

HYBRID, DENSE = "qwen3.5-397b", "minimax-m2.5"
RATES = [10.0, 50.0, 100.0]
RTTS = [30.0, 150.0]


@pytest.fixture(scope="module")
def small_map() -> ModelMap:
    return compute_map([load_deployments(HYBRID), load_deployments(DENSE)], RATES, RTTS)


# ---------------------------------------------------------------------------------------------
# Break-even bisection


@pytest.mark.pure
def test_smallest_rate_brackets_a_step_within_rtol() -> None:
    step = 37.3e9
    calls: list[float] = []

    def f(x: float) -> float:
        calls.append(x)
        return 2.0 if x >= step else 0.5

    be = smallest_rate(f, 1.0, 1e8, 1e13, rtol=0.001)
    assert be.bound == "exact" and be.rate_bps is not None
    assert step <= be.rate_bps <= step * 1.001
    # Grid values of f bracket the search: fewer new evaluations, same answer.
    n = len(calls)
    calls.clear()
    again = smallest_rate(f, 1.0, 1e8, 1e13, rtol=0.001, known={25e9: 0.5, 50e9: 2.0, 1e13: 2.0})
    assert again.rate_bps is not None and step <= again.rate_bps <= step * 1.001
    assert len(calls) <= n - 4


@pytest.mark.pure
def test_smallest_rate_continuous_and_edges() -> None:
    be = smallest_rate(lambda x: math.log10(x), 10.5, 1e8, 1e13, rtol=1e-4)
    assert be.rate_bps == pytest.approx(10**10.5, rel=1e-4)
    assert smallest_rate(lambda x: 3.0, 1.0, 1e8, 1e13).bound == "below"
    never = smallest_rate(lambda x: 0.9, 1.0, 1e8, 1e13)
    assert never.bound == "never" and never.rate_bps is None and never.gain_at_hi == 0.9
    with pytest.raises(ValueError, match="non-decreasing"):
        smallest_rate(lambda x: 2.0 if x >= 1e12 else 0.0, 1.0, 1e8, 1e13, known={1e9: 2.0, 1e10: 0.5})
    with pytest.raises(ValueError):
        smallest_rate(lambda x: 0.0, 1.0, 1e10, 1e9)


# ---------------------------------------------------------------------------------------------
# Deployments


@pytest.mark.pure
def test_scaled_pd_curve_of_the_case_study_is_its_own_h20_curve() -> None:
    base = load_scenario("paper-prfaas")
    h200 = PrefillTime.from_spec(base.hardware["h200"].prefill)
    h20 = PrefillTime.from_spec(base.hardware["h20"].prefill)
    lengths = [1024.0, 8192.0, 32768.0, 131072.0]
    curve = PrefillTime.from_spec(scaled_pd_prefill(h200, h200, h20, lengths))
    for x in lengths:
        assert curve.uncached_time(x) == pytest.approx(h20.uncached_time(x), rel=1e-12)


@pytest.mark.pure
def test_deployments_swap_the_model_in() -> None:
    base = load_scenario("paper-prfaas")
    scaled = load_deployments(DENSE)
    parent = load_deployments(DENSE, "parent")
    assert scaled.kind == "dense" and load_deployments(HYBRID).kind == "hybrid"
    assert scaled.prfaas.model.full_attention_bytes_per_token == 253952
    assert scaled.prfaas.hardware["h200"] == scaled.homogeneous.hardware["h200"] != base.hardware["h200"]
    assert parent.prfaas.hardware["h20"] == base.hardware["h20"]
    assert scaled.prfaas.hardware["h20"] != base.hardware["h20"]
    assert scaled.homogeneous.policy.name == "homogeneous"
    assert sum(c.prefill + c.decode for c in scaled.homogeneous.clusters) == 12


@pytest.mark.pure
def test_fixed_split_reproduces_table6_for_the_case_study() -> None:
    case = Deployments("case-study", "hybrid", load_scenario("paper-prfaas"), load_scenario("paper-homogeneous"), {})
    mm = compute_map([case], [100.0], [30.0], split="fixed", with_break_even=False)
    p = mm.points[0]
    assert (p.n_p, p.n_d, p.homogeneous_n_p, p.homogeneous_n_d) == (3, 5, 9, 3)
    assert p.threshold == pytest.approx(19400, rel=0.05)
    assert p.offload_share == pytest.approx(0.496, abs=0.02)
    assert p.homogeneous_lambda_max == pytest.approx(2.11, rel=0.02)
    assert p.gain == pytest.approx(1.54, rel=0.03)


# ---------------------------------------------------------------------------------------------
# The map by the model


@pytest.mark.pure
def test_grid_shape_and_rtt(small_map: ModelMap) -> None:
    mm = small_map
    assert len(mm.points) == 2 * len(RATES) * len(RTTS)
    assert len({p.key for p in mm.points}) == len(mm.points)
    for p in mm.points:
        assert p.n_prfaas == 4 and p.n_p + p.n_d == 8
        assert p.homogeneous_n_p + p.homogeneous_n_d == 12
        assert 0.0 < p.offload_share < 1.0
        assert p.gain == pytest.approx(p.lambda_max / p.homogeneous_lambda_max)
        near, far = mm.point(p.model, p.rate_gbps, 30.0), mm.point(p.model, p.rate_gbps, 150.0)
        # Throughput is a fluid figure; only TTFT sees the longer path (at most the extra one-way delay).
        assert near.lambda_max == far.lambda_max and near.threshold == far.threshold
        assert 0.0 <= far.ttft_p90_s - near.ttft_p90_s <= 0.060 + 1e-9
        assert near.ttft_p90_s >= near.ttft_p90_prefill_s
    # Where the P90 request is an offloaded one, it waits the longer way.
    assert mm.point(HYBRID, 100.0, 150.0).ttft_p90_s > mm.point(HYBRID, 100.0, 30.0).ttft_p90_s
    for m in mm.models:
        gains = [mm.point(m.model, r, 30.0).gain for r in RATES]
        assert gains == sorted(gains), m.model


@pytest.mark.pure
def test_hybrid_gains_at_100g_and_the_dense_link_saturates(small_map: ModelMap) -> None:
    mm = small_map
    hy, de = mm.point(HYBRID, 100.0, 30.0), mm.point(DENSE, 100.0, 30.0)
    assert hy.gain > 1.3
    assert hy.prfaas_bound == "compute" and hy.link_utilisation < 0.5
    # The dense model's 4 PrfaaS instances would need ~4 x 60 Gbit/s: at 100 the link binds,
    # the optimiser offloads only what fits it, and the gain is a fraction of the hybrid's.
    assert de.prfaas_bound == "link" and de.link_utilisation > 0.95
    assert de.offload_share < hy.offload_share - 0.25
    assert de.gain < hy.gain - 0.3
    assert mm.point(DENSE, 50.0, 30.0).gain < 1.0 < mm.point(HYBRID, 50.0, 30.0).gain


@pytest.mark.pure
def test_break_even_is_where_the_gain_reaches_one(small_map: ModelMap) -> None:
    mm = small_map
    by = {m.model: m for m in mm.models}
    be = by[DENSE].break_even
    assert be is not None and be.bound == "exact" and be.rate_bps is not None
    assert 50e9 < be.rate_bps < 100e9 * 1.01
    dep, hom = load_deployments(DENSE), by[DENSE].homogeneous
    from testbed.model.feasibility import gain_curve

    g = gain_curve(dep, hom)
    assert g(be.rate_bps) >= 1.0 > g(be.rate_bps / 1.01)
    hy = by[HYBRID].break_even
    assert hy is not None and hy.rate_bps is not None and hy.rate_bps < 50e9


@pytest.mark.pure
def test_confirm_picks_and_subset(small_map: ModelMap) -> None:
    mm = small_map
    assert pick_confirm(mm, 2) == [f"{DENSE}@100g/30ms", f"{HYBRID}@100g/30ms"]
    # Kimi Linear's 4 PrfaaS instances saturate 10 Gbit/s: the third pick, a link-bound hybrid at the longest RTT.
    kimi = compute_map(
        [load_deployments("kimi-linear"), load_deployments(DENSE)], [10.0, 100.0], RTTS, with_break_even=False
    )
    picks = pick_confirm(kimi, 3)
    assert picks == [f"{DENSE}@100g/30ms", "kimi-linear@100g/30ms", "kimi-linear@10g/150ms"]
    third = kimi.point("kimi-linear", 10.0, 150.0)
    assert third.bottleneck == "prfaas" and third.prfaas_bound == "link"
    assert len(pick_confirm(kimi, 5)) == 5 == len(set(pick_confirm(kimi, 5)))
    assert pick_confirm(mm, 1, [f"{HYBRID}@50g/150ms"]) == [f"{HYBRID}@50g/150ms"]
    with pytest.raises(ScenarioError, match="not a point"):
        pick_confirm(mm, 1, [f"{HYBRID}@7g/30ms"])
    with pytest.raises(ScenarioError, match="MODEL@RATE"):
        pick_confirm(mm, 1, ["qwen"])
    sub = subset_keys(mm)
    assert f"{DENSE}@100g/150ms" in sub and f"{DENSE}@50g/30ms" in sub
    assert len(sub) == len(set(sub)) < len(mm.points)


@pytest.mark.pure
def test_link_profile_keeps_the_base_tcp_settings() -> None:
    near, far = link_profile(25, 30), link_profile(400, 150)
    assert (near.rate, near.delay, near.name) == (25e9, 0.015, "wan-25g-30ms")
    assert near.tcp == load_profile("cross-region-100g").tcp
    assert (far.rate, far.delay) == (400e9, 0.075) and far.tcp == load_profile("intercontinental-100g").tcp


# ---------------------------------------------------------------------------------------------
# The command


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.app
def test_command_tiny_grid_simulated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "map"
    argv = [
        "feasibility",
        "--model",
        "kimi-linear",
        "--model",
        DENSE,
        "--rates",
        "10,100",
        "--rtts",
        "30",
        "--requests",
        "60",
        "--probes",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "break-even" in printed and "MiniMax-M2.5" in printed
    table = _csv(out / "map.csv")
    assert len(table) == 4
    for r in table:
        assert float(r["lambda_max_sim"]) > 0 and float(r["gain_sim"]) > 0 and r["ttft_p90_sim_s"]
        assert float(r["gain_sim"]) == pytest.approx(
            float(r["lambda_max_sim"]) / float(r["homogeneous_lambda_max_sim"])
        )
    data = json.loads((out / "map.json").read_text())
    assert data["timing"]["sim_runs"] == 6 and data["timing"]["sim_reused"] == 0
    # Each simulated point ran its own scenario over its own link profile, kept for reruns.
    sc = yaml.safe_load((out / "scenarios" / f"prfaas-{DENSE}-10g-30ms.yaml").read_text())
    link = yaml.safe_load(Path(sc["links"]["inter_dc"]).read_text())
    assert link["rate"] == 10e9 and link["delay"] == 0.015
    point = next(p for p in data["points"] if p["key"] == f"{DENSE}@10g/30ms")
    assert sc["policy"]["threshold"] == point["threshold"]
    assert [c["prefill"] for c in sc["clusters"] if c["kind"] == "pd"] == [point["n_p"]]
    assert not (Path(point["sim"]["out"]) / "rate-{:.3f}".format(point["sim"]["probes"][0][0]) / "timeseries").exists()
    report = (out / "report.md").read_text()
    assert "## Headline" in report and "by simulation" in report and "map.png" in report
    assert (out / "map.png").stat().st_size > 10_000
    # A rerun (told to replace the output) reuses every measurement whose scenario and settings are unchanged.
    assert main([*argv, "--overwrite"]) == 0
    again = json.loads((out / "map.json").read_text())
    assert again["timing"]["sim_runs"] == 0 and again["timing"]["sim_reused"] == 6
    assert [p["gain_sim"] for p in again["points"]] == [p["gain_sim"] for p in data["points"]]


@pytest.mark.app
def test_command_confirm_plumbing_inproc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "map"
    assert (
        main(
            [
                "feasibility",
                "--model",
                "kimi-linear",
                "--model",
                DENSE,
                "--rates",
                "100",
                "--rtts",
                "30",
                "--sim",
                "none",
                "--no-break-even",
                "--confirm",
                "1",
                "--confirm-backend",
                "inproc",
                "--requests",
                "8",
                "--probes",
                "1",
                "--set",
                "scale.speedup=40",
                "--set",
                "workload.output_tokens=16",
                "--set",
                "serving.stream_interval=4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"confirm {DENSE}@100g/30ms: emulated" in printed
    conf = json.loads((out / "confirm.json").read_text())
    assert [c["point"] for c in conf] == [f"{DENSE}@100g/30ms"]
    assert conf[0]["emulated"]["backend"] == "inproc" and conf[0]["simulated"]["backend"] == "sim"
    run = Path(conf[0]["emulated"]["out"])
    assert run.parent.name == "inproc" and len(_csv(next(run.glob("rate-*")) / "records.csv")) == 8
    # The confirmed point was simulated for the comparison; the others were not (--sim none).
    table = {r["model"]: r for r in _csv(out / "map.csv")}
    assert table[DENSE]["lambda_max_sim"] and not table["kimi-linear"]["lambda_max_sim"]
    assert "## Confirmed by emulation" in (out / "report.md").read_text()


@pytest.mark.app
def test_command_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        "feasibility",
        "--model",
        "kimi-linear",
        "--rates",
        "100",
        "--rtts",
        "30",
        "--sim",
        "none",
        "--no-break-even",
        "--out",
        str(tmp_path),
    ]
    assert main([*base, "--model", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main([*base, "--confirm-at", "kimi-linear@3g/30ms", "--confirm-backend", "inproc"]) == 2
    assert "not a point" in capsys.readouterr().err
    assert main([*base, "--spread", "1.5"]) == 2
    with pytest.raises(SystemExit):
        main([*base[:4], "fast", "--rtts", "30"])
