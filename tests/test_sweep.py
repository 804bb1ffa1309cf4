"""`testbed sweep`: grid building, override paths with list indices, outputs, a tiny real sweep."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from summaries import summary_figures

from testbed.cli import main
from testbed.config.overrides import build_overrides, parse_assignments
from testbed.config.scenarios import ScenarioError, load_scenario
from testbed.model.analytical import evaluate
from testbed.studies.sweep import sweep
from testbed.studies.sweep.sweep import (
    build_grid,
    model_curve,
    model_figures,
    parse_param,
    plan_points,
    point_label,
)

# Pure tests and one app test share this file, so tiers are marked per test.
pure = pytest.mark.pure


def resolved(name: str = "paper-prfaas") -> dict[str, Any]:
    return load_scenario(name).model_dump(mode="json")


@pure
def test_parse_param_values_are_yaml() -> None:
    assert parse_param("policy.threshold=10000, 19400,auto") == ("policy.threshold", [10000, 19400, "auto"])
    assert parse_param("workload.rate=0.5,1.5") == ("workload.rate", [0.5, 1.5])
    for bad in ("policy.threshold", "=1,2", "policy.threshold=", "policy.threshold=1,1"):
        with pytest.raises(ScenarioError):
            parse_param(bad)


@pure
def test_grid_is_a_product_first_field_slowest() -> None:
    g = build_grid([("a", [1, 2]), ("b", ["x", "y", "z"])])
    assert g == [
        {"a": 1, "b": "x"},
        {"a": 1, "b": "y"},
        {"a": 1, "b": "z"},
        {"a": 2, "b": "x"},
        {"a": 2, "b": "y"},
        {"a": 2, "b": "z"},
    ]
    assert build_grid([("a", [3])]) == [{"a": 3}]
    with pytest.raises(ScenarioError, match="at most 2"):
        build_grid([("a", [1]), ("b", [1]), ("c", [1])])
    with pytest.raises(ScenarioError, match="twice"):
        build_grid([("a", [1]), ("a", [2])])
    with pytest.raises(ScenarioError):
        build_grid([])


@pure
def test_dict_paths_stay_sparse() -> None:
    ov = build_overrides(resolved(), [("policy.threshold", 30000), ("scale.speedup", 8)])
    assert ov == {"policy": {"threshold": 30000}, "scale": {"speedup": 8}}


@pure
def test_list_index_copies_the_list_and_edits_one_element() -> None:
    base = resolved()
    ov = build_overrides(base, [("clusters.1.prefill", 4), ("clusters.1.decode", 4)])
    assert len(ov["clusters"]) == 2
    assert ov["clusters"][0] == base["clusters"][0]
    assert ov["clusters"][1] == {**base["clusters"][1], "prefill": 4, "decode": 4}
    assert base["clusters"][1]["prefill"] == 3  # the resolved scenario is not modified
    sc = load_scenario("paper-prfaas", ov)
    assert [(c.name, c.prefill, c.decode) for c in sc.clusters] == [("prfaas", 4, 0), ("pd", 4, 4)]


@pure
def test_nested_list_and_mixed_paths() -> None:
    ov = build_overrides(
        resolved(),
        [
            ("hardware.h200.prefill.points.0.1", 0.5),
            ("hardware.h200.prefill.cached_token_s", 1e-6),
            ("clusters.0.prefill", 2),
        ],
    )
    sc = load_scenario("paper-prfaas", ov)
    pre = sc.hardware["h200"].prefill
    assert pre.kind == "table" and pre.points[0] == (1024, 0.5) and pre.points[1] == (8192, 0.72)
    assert pre.cached_token_s == 1e-6
    assert sc.hardware["h20"].decode is not None  # sparse: siblings kept
    assert sc.clusters[0].prefill == 2


@pure
def test_whole_list_then_index() -> None:
    # An earlier assignment that replaces a list whole is what a later index edits.
    ov = build_overrides(resolved(), [("model.layer_pattern", ["linear", "full"]), ("model.layer_pattern.0", "full")])
    assert ov["model"]["layer_pattern"] == ["full", "full"]


@pure
def test_bad_indices_name_the_path() -> None:
    base = resolved()
    with pytest.raises(ScenarioError, match=r"clusters\.5\.prefill.*out of range"):
        build_overrides(base, [("clusters.5.prefill", 1)])
    with pytest.raises(ScenarioError, match=r"'pd' indexes a list"):
        build_overrides(base, [("clusters.pd.prefill", 1)])
    with pytest.raises(ScenarioError, match="empty path"):
        build_overrides(base, [("policy..threshold", 1)])
    with pytest.raises(ScenarioError, match="cannot also hold fields"):
        build_overrides(base, [("policy.threshold", 5), ("policy.threshold.x", 1)])


@pure
def test_plan_points_validates_every_point_first() -> None:
    base = parse_assignments(["scale.speedup=40", "clusters.1.decode=4"])
    pts = plan_points("paper-prfaas", base, build_grid([("clusters.1.prefill", [2, 3])]))
    assert [(p.scenario.clusters[1].prefill, p.scenario.clusters[1].decode) for p in pts] == [(2, 4), (3, 4)]
    assert all(p.scenario.scale.speedup == 40 for p in pts)
    assert pts[0].label == "00-clusters.1.prefill=2"
    with pytest.raises(ScenarioError, match=r"(?s)sweep point clusters\.1\.prefill=-1:.*field 'clusters\.1\.prefill'"):
        plan_points("paper-prfaas", [], build_grid([("clusters.1.prefill", [2, -1])]))


@pure
def test_point_label_is_a_safe_name() -> None:
    assert point_label(3, {"policy.threshold": 19400}) == "03-policy.threshold=19400"
    assert point_label(0, {"a": "x/y z", "b": 0.5}) == "00-a=x-y-z_b=0.5"


@pure
def test_model_figures_match_the_model() -> None:
    sc = load_scenario("paper-prfaas", {"workload": {"rate": 1.6}})
    m = model_figures(sc, 100e9)
    r = evaluate(sc)
    assert m["model_lambda_max"] == r.lambda_max and m["model_ttft_mean_s"] == r.ttft_mean_s
    assert m["model_load"] == pytest.approx(1.6 / r.lambda_max)
    assert m["model_egress_Bps"] == pytest.approx(r.egress_at(1.6) / 8)
    assert m["model_error"] is None
    homo = model_figures(load_scenario("paper-homogeneous"), 100e9)
    assert homo["model_theta_prfaas"] is None and homo["model_lambda_max"] > 0


@pure
def test_model_curve_has_fig5b_shape_and_passes_through_swept_points() -> None:
    sc = load_scenario("paper-prfaas")
    rows = model_curve(sc, 100e9, [19400.0])
    ts = [r["t"] for r in rows]
    assert ts == sorted(ts) and ts[0] == 128 and ts[-1] == 131072 and 19400.0 in ts
    at = next(r for r in rows if r["t"] == 19400.0)
    ev = evaluate(sc, threshold=19400)
    assert at["lambda_max"] == pytest.approx(ev.lambda_max) and at["ttft_mean_s"] == pytest.approx(ev.ttft_mean_s)
    best = max(rows, key=lambda r: r["lambda_max"])
    assert 15000 < best["t"] < 25000  # the paper's optimum, t ~ 19.4K
    with_ttft = [r for r in rows if r["ttft_mean_s"] is not None]
    assert 50 < len(with_ttft) < len(rows)


@pure
def test_interrupted_sweep_keeps_finished_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[Path] = []

    async def fake_run(pt: sweep.Point, run_dir: Path, backend: str, trace: object = None) -> None:
        calls.append(run_dir)
        run_dir.mkdir(parents=True)
        if len(calls) == 2:
            raise KeyboardInterrupt
        (run_dir / "summary.json").write_text(
            json.dumps(
                summary_figures(
                    run__offered_rate_rps=1.6,
                    run__threshold=float(pt.values["policy.threshold"]),
                    requests__total=5,
                    requests__completed=5,
                    requests__failed=0,
                    ttft_s={"n": 5, "mean": 2.0, "p50": 1.9, "p90": 3.0, "p99": 3.5},
                    tpot_s__mean=0.025,
                    throughput__completed_rps_paper=1.5,
                    offload__ratio=0.4,
                    wan_egress__mean_Bps_paper=None,
                )
            )
        )

    monkeypatch.setattr(sweep, "_run_point", fake_run)
    # A coarse curve keeps this test fast; the curve itself is checked above.
    monkeypatch.setattr(sweep, "CURVE_POINTS", 20)
    monkeypatch.setattr(sweep, "TTFT_CURVE_POINTS", 4)
    rc = main(
        ["sweep", "--scenario", "paper-prfaas", "--param", "policy.threshold=10000,19400,40000", "--out", str(tmp_path)]
    )
    _, err = capsys.readouterr()
    assert rc == 130 and len(calls) == 2
    assert "interrupted: kept 2 of 3 points" in err
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["policy.threshold"], r["status"]) for r in rows] == [("10000", "ok"), ("19400", "interrupted")]
    assert rows[0]["ttft_mean_s"] == "2.0" and rows[0]["wan_egress_mean_Bps"] == ""
    assert float(rows[1]["model_lambda_max"]) > 0
    assert "| 19400 | interrupted |" in (tmp_path / "sweep.md").read_text()
    assert (tmp_path / "model_curve.csv").exists()


@pure
def test_bad_param_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sweep", "--scenario", "paper-prfaas", "--param", "clusters.9.prefill=1", "--out", str(tmp_path / "x")])
    assert rc == 2 and "out of range" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------ app

FAST = [
    "--backend",
    "inproc",
    "--set",
    "scale.speedup=40",
    "--set",
    "workload.output_tokens=16",
    "--set",
    "serving.stream_interval=4",
    "--requests",
    "6",
]


@pytest.mark.app
def test_tiny_real_sweep_two_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "sweep",
            "--scenario",
            "paper-prfaas",
            "--param",
            "policy.threshold=10000,40000",
            "--param",
            "clusters.1.prefill=2,3",
            *FAST,
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    table = json.loads(out)
    assert table["params"] == ["policy.threshold", "clusters.1.prefill"]
    pts = table["points"]
    assert [(p["policy.threshold"], p["clusters.1.prefill"]) for p in pts] == [
        (10000, 2),
        (10000, 3),
        (40000, 2),
        (40000, 3),
    ]
    for p in pts:
        assert p["status"] == "ok" and p["completed"] == 6 and p["failed"] == 0
        assert p["threshold_used"] == p["policy.threshold"]
        assert p["ttft_mean_s"] > 0 and p["model_lambda_max"] > 0 and p["model_ttft_mean_s"] > 0
        run = tmp_path / p["run_dir"]
        assert (run / "summary.json").exists() and (run / "report.md").exists()
        assert f"prefill: {p['clusters.1.prefill']}" in (run / "scenario.yaml").read_text()
    # A higher threshold sends fewer requests to PrfaaS; more PD-P instances raise the model's Theta_pdp.
    assert pts[0]["offload_ratio"] >= pts[2]["offload_ratio"]
    assert pts[1]["model_theta_pdp"] > pts[0]["model_theta_pdp"]
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert len(rows) == 4 and rows[0]["run_dir"] == "00-policy.threshold=10000_clusters.1.prefill=2"
    curve = list(csv.DictReader((tmp_path / "model_curve.csv").open()))
    assert {r["clusters.1.prefill"] for r in curve} == {"2", "3"}
    assert {"10000.0", "40000.0"} <= {r["t"] for r in curve}
    md = (tmp_path / "sweep.md").read_text()
    assert md.startswith("# Sweep of paper-prfaas over policy.threshold, clusters.1.prefill")
    assert md.count("| ok |") == 4
