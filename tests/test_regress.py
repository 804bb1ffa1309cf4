"""`testbed regress`: baselines, tolerances, verdicts and exit codes.

Pure tests use synthetic summary.json files; one app test runs real tiny replays.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from replay_exit import RAN, replay_until_valid
from summaries import summary_figures

from testbed.cli import main
from testbed.core.record import RequestRecord, StageTimes
from testbed.metrics.records import write_records
from testbed.metrics.regress import (
    DEFAULT_METRICS,
    Baseline,
    MetricSpec,
    band,
    check_metric,
    default_spec,
    load_baseline,
    lookup,
)
from testbed.metrics.verdict import EXIT_INVALID

# Pure tests and one app test share this file, so tiers are marked per test.
pure = pytest.mark.pure


def summary(**over: Any) -> dict[str, Any]:
    """A summary.json's content (version 2, valid); `over` replaces figures by `__`-separated path."""
    return summary_figures(**over)


def write_run(path: Path, s: dict[str, Any], backend: str | None = "inproc") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "summary.json").write_text(json.dumps(s))
    if backend is not None:
        (path / "run.json").write_text(json.dumps({"backend": backend, "scale": {"speedup": 10, "byte_scale": 256}}))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def base(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    run = write_run(tmp_path / "ref", summary())
    path = tmp_path / "baseline.yaml"
    rc, _, _ = run_cli(capsys, "regress", str(run), "--baseline", str(path), "--update", "--note", "unit test")
    assert rc == 0
    return path


@pure
def test_update_writes_defaults_and_provenance(base: Path) -> None:
    b = load_baseline(base)
    assert list(b.metrics) == list(DEFAULT_METRICS)
    m = b.metrics
    assert (m["ttft_s.mean"].rel, m["ttft_s.p90"].rel, m["ttft_s.p99"].rel) == (0.15, 0.20, 0.25)
    assert m["ttft_s.mean"].direction == "lower_is_better"
    assert (m["throughput.completed_rps_paper"].direction, m["throughput.completed_rps_paper"].rel) == (
        "higher_is_better",
        0.10,
    )
    assert (m["requests.failed"].baseline, m["requests.failed"].abs) == (0, 0)
    assert m["offload.ratio"].direction == "both" and m["wan_egress.mean_Bps_paper"].direction == "both"
    assert m["tpot_s.mean"].baseline == 0.025
    tf = b.taken_from
    assert (tf.scenario, tf.speedup, tf.byte_scale, tf.shaping, tf.requests, tf.backend, tf.note) == (
        "paper-prfaas",
        10.0,
        256.0,
        "none",
        40,
        "inproc",
        "unit test",
    )
    assert tf.created
    assert base.read_text().startswith("# testbed regress baseline")


@pure
def test_same_run_passes_with_table(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "regress", str(tmp_path / "ref"), "--baseline", str(base))
    assert rc == 0, out + err
    assert "regress: PASS, 9 metrics within tolerance" in out
    assert "ttft_s.p99" in out and "FAIL" not in out and "warning" not in err


@pure
def test_within_tolerance_passes(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 14% slower mean (allowed 15%), 24% slower P99 (allowed 25%), 9% less throughput (allowed 10%).
    s = summary(ttft_s__mean=2.5 * 1.14, ttft_s__p99=5.1 * 1.24, throughput__completed_rps_paper=1.25 * 0.91)
    rc, out, _ = run_cli(capsys, "regress", str(write_run(tmp_path / "r", s)), "--baseline", str(base))
    assert rc == 0, out


@pure
def test_worsened_run_fails_naming_each_metric(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    worse = summary(
        tpot_s__mean=0.05,
        ttft_s__mean=3.0,
        throughput__completed_rps_paper=1.0,
        requests__failed=2,
        offload__ratio=0.40,
    )
    run = write_run(tmp_path / "worse", worse)
    rc, out, _ = run_cli(capsys, "regress", str(run), "--baseline", str(base))
    assert rc == 1
    fails = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert [f.split(":")[0] for f in fails] == [
        "FAIL requests.failed",
        "FAIL throughput.completed_rps_paper",
        "FAIL ttft_s.mean",
        "FAIL tpot_s.mean",
        "FAIL offload.ratio",
    ]
    tpot = next(f for f in fails if "tpot_s.mean" in f)
    assert "measured 0.05 vs baseline 0.025 (+100.0%)" in tpot and "allowed <= 0.02875" in tpot
    assert "lower is better; tolerance rel 15%" in tpot
    thr = next(f for f in fails if "throughput" in f)
    assert "allowed >= 1.125" in thr
    off = next(f for f in fails if "offload" in f)
    assert "allowed [0.455, 0.495]" in off
    assert "5 of 9 metrics outside tolerance" in out


@pure
def test_json_verdict(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "worse", summary(tpot_s__mean=0.05))
    rc, out, _ = run_cli(capsys, "regress", str(run), "--baseline", str(base), "--json")
    assert rc == 1
    v = json.loads(out)
    assert v["verdict"] == "fail" and v["failed"] == ["tpot_s.mean"]
    tp = next(m for m in v["metrics"] if m["key"] == "tpot_s.mean")
    assert tp["baseline"] == 0.025 and tp["measured"] == 0.05 and tp["high"] == pytest.approx(0.02875)
    assert tp["low"] is None and tp["change"] == pytest.approx(1.0) and tp["passed"] is False


@pure
def test_tolerance_override_at_check_and_update(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "worse", summary(tpot_s__mean=0.05))
    rc, _, _ = run_cli(capsys, "regress", str(run), "--baseline", str(base), "--tolerance", "tpot_s.mean=100%")
    assert rc == 0
    rc, _, err = run_cli(capsys, "regress", str(run), "--baseline", str(base), "--tolerance", "nope.key=0.1")
    assert rc == 1 and "nope.key" in err
    # With --update the override is written, and survives a later --update (tolerances are kept).
    path = tmp_path / "b2.yaml"
    ref = tmp_path / "ref"
    assert (
        run_cli(
            capsys,
            "regress",
            str(ref),
            "--baseline",
            str(path),
            "--update",
            "--tolerance",
            "ttft_s.p99=0.4",
            "--abs-tolerance",
            "tpot_s.mean=0.002",
            "--metric",
            "ttft_s.n",
        )[0]
        == 0
    )
    b = load_baseline(path)
    assert b.metrics["ttft_s.p99"].rel == 0.4 and b.metrics["tpot_s.mean"].abs == 0.002
    assert "ttft_s.n" in b.metrics
    write_run(ref, summary(ttft_s__p99=6.0))
    assert run_cli(capsys, "regress", str(ref), "--baseline", str(path), "--update")[0] == 0
    b = load_baseline(path)
    assert b.metrics["ttft_s.p99"].rel == 0.4 and b.metrics["ttft_s.p99"].baseline == 6.0
    for bad in ("ttft_s.mean", "ttft_s.mean=x", "ttft_s.mean=-1"):
        assert run_cli(capsys, "regress", str(ref), "--baseline", str(path), "--tolerance", bad)[0] == 2


@pure
def test_mismatched_setup_warns(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = summary(run__scenario="paper-naive", run__speedup=40.0, run__shaping_method="tbf")
    run = write_run(tmp_path / "other", s, backend="local")
    rc, _, err = run_cli(capsys, "regress", str(run), "--baseline", str(base))
    assert rc == 0
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1
    for part in (
        "scenario paper-naive (baseline paper-prfaas)",
        "speedup 40 (baseline 10)",
        "shaping tbf (baseline none)",
        "backend local (baseline inproc)",
    ):
        assert part in warning[0]
    rc, out, _ = run_cli(capsys, "regress", str(run), "--baseline", str(base), "--json")
    assert "scenario paper-naive" in json.loads(out)["warnings"][0]


@pure
def test_missing_or_null_metric_fails(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A figure of a section the file leaves out (no shaped link: `wan_link` without a headline).
    data = yaml.safe_load(base.read_text())
    data["metrics"]["wan_link.mean_bps_paper"] = {"baseline": 1e9, "direction": "both", "rel": 0.1}
    with_link = tmp_path / "link.yaml"
    with_link.write_text(yaml.safe_dump(data))
    s = summary(wan_egress__mean_Bps_paper=None)
    rc, out, _ = run_cli(capsys, "regress", str(write_run(tmp_path / "r", s)), "--baseline", str(with_link))
    assert rc == 1
    assert "FAIL wan_link.mean_bps_paper: measured missing" in out and "not in the run's summary" in out
    assert "FAIL wan_egress.mean_Bps_paper: measured missing" in out


@pure
def test_summary_missing_a_required_section_is_a_one_line_error(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = summary()
    del s["offload"]
    run = write_run(tmp_path / "r", s)
    rc, out, err = run_cli(capsys, "regress", str(run), "--baseline", str(base))
    assert rc == 2 and out == ""
    assert err.strip() == f"regress: {run / 'summary.json'}: offload: Field required"


@pure
def test_update_skips_null_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "homo", summary(wan_egress__mean_Bps_paper=None))
    rc, _, err = run_cli(capsys, "regress", str(run), "--baseline", str(tmp_path / "b.yaml"), "--update")
    assert rc == 0 and "wan_egress.mean_Bps_paper: the run has no value" in err
    assert "wan_egress.mean_Bps_paper" not in load_baseline(tmp_path / "b.yaml").metrics


@pure
def test_update_from_an_invalid_run_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "late", summary(validity={"valid": False, "reasons": ["decode steps 21.3% late"]}))
    rc, _, err = run_cli(capsys, "regress", str(run), "--baseline", str(tmp_path / "b.yaml"), "--update")
    assert rc == 0 and "the run is marked invalid (decode steps 21.3% late)" in err


@pure
def test_unreadable_inputs_exit_2_naming_the_file(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = str(tmp_path / "ref")
    missing = tmp_path / "nope.yaml"
    rc, _, err = run_cli(capsys, "regress", ref, "--baseline", str(missing))
    assert rc == 2 and str(missing) in err
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("metrics: [unclosed\n")
    rc, _, err = run_cli(capsys, "regress", ref, "--baseline", str(bad_yaml))
    assert rc == 2 and str(bad_yaml) in err and "not valid YAML" in err
    bad_dir = tmp_path / "dir.yaml"
    data = yaml.safe_load(base.read_text())
    data["metrics"]["ttft_s.mean"]["direction"] = "smaller"
    bad_dir.write_text(yaml.safe_dump(data))
    rc, _, err = run_cli(capsys, "regress", ref, "--baseline", str(bad_dir))
    assert rc == 2 and str(bad_dir) in err and "metrics.ttft_s.mean.direction" in err
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert run_cli(capsys, "regress", ref, "--baseline", str(empty))[0] == 2
    rc, _, err = run_cli(capsys, "regress", str(tmp_path / "no-run"), "--baseline", str(base))
    assert rc == 2 and "no-run" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "summary.json").write_text("{not json")
    rc, _, err = run_cli(capsys, "regress", str(broken), "--baseline", str(base))
    assert rc == 2 and str(broken / "summary.json") in err
    norun = tmp_path / "norun"
    norun.mkdir()
    rc, _, err = run_cli(capsys, "regress", str(norun), "--baseline", str(base))
    assert rc == 2 and str(norun / "run.json") in err


@pure
def test_summary_recomputed_when_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(
        json.dumps(
            {
                "name": "r",
                "scenario": "paper-prfaas",
                "policy": "prfaas",
                "t0": 100.0,
                "t_end": 104.0,
                "scale": {"speedup": 4, "byte_scale": 256},
                "shaping": {"method": "none"},
                "backend": "inproc",
            }
        )
    )
    recs = [
        RequestRecord(
            f"r{i}",
            i,
            1000,
            3,
            tokens_received=3,
            outcome="completed",
            times=StageTimes(arrival=0.1 * i, first_token=0.1 * i + 0.5, last_token=0.1 * i + 0.52),
        )
        for i in range(4)
    ]
    write_records(run / "records.csv", recs)
    rc, out, _ = run_cli(capsys, "regress", str(run), "--baseline", str(tmp_path / "b.yaml"), "--update")
    assert rc == 0
    b = load_baseline(tmp_path / "b.yaml")
    assert b.metrics["ttft_s.mean"].baseline == pytest.approx(2.0)  # 0.5 wire s x speedup 4
    assert b.metrics["tpot_s.mean"].baseline == pytest.approx(0.04)
    assert not (run / "summary.json").exists()  # regress writes nothing into the run
    assert run_cli(capsys, "regress", str(run), "--baseline", str(tmp_path / "b.yaml"))[0] == 0


@pure
def test_run_argument_may_be_the_summary_file(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "regress", str(tmp_path / "ref" / "summary.json"), "--baseline", str(base))[0] == 0


@pure
def test_bands_and_lookup() -> None:
    assert band(MetricSpec(baseline=10, direction="lower_is_better", rel=0.1, abs=2)) == (None, 12)
    assert band(MetricSpec(baseline=10, direction="higher_is_better", rel=0.1)) == (9, None)
    assert band(MetricSpec(baseline=-10, direction="both", rel=0.1)) == (-11, -9)
    assert band(MetricSpec(baseline=10, direction="both")) == (10, 10)
    s = summary()
    assert lookup(s, "links.prfaas-p0{dest=127.0.0.1:4000}.mean_Bps_paper") == 1.0e8
    with pytest.raises(KeyError):
        lookup(s, "ttft_s.p95")
    with pytest.raises(KeyError):
        lookup(s, "ttft_s.mean.x")
    # Exact reproduction passes even through float rounding of the stored value.
    spec = MetricSpec(baseline=0.1 + 0.2, direction="both")
    assert check_metric("x", spec, {"x": 0.3}).passed
    assert default_spec("ttft_breakdown_s.transfer_tail", 0.005).abs == 0.01
    assert default_spec("requests.completed", 40).direction == "higher_is_better"
    assert default_spec("bytes.kv_total_paper", 1e9).direction == "both"


@pure
def test_hand_written_baseline_minimal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("metrics:\n  tpot_s.mean: {baseline: 0.025, direction: lower_is_better, rel: 0.2}\n")
    assert isinstance(load_baseline(path), Baseline)
    run = write_run(tmp_path / "r", summary(tpot_s__mean=0.0299))
    assert run_cli(capsys, "regress", str(run), "--baseline", str(path))[0] == 0
    write_run(tmp_path / "r", summary(tpot_s__mean=0.0301))
    assert run_cli(capsys, "regress", str(run), "--baseline", str(path))[0] == 1


@pure
def test_worsened_summary_does_not_alter_baseline_object(base: Path) -> None:
    b = load_baseline(base)
    before = copy.deepcopy(b.model_dump())
    check_metric("tpot_s.mean", b.metrics["tpot_s.mean"], summary(tpot_s__mean=1.0))
    assert b.model_dump() == before


# ------------------------------------------------------------------------------------------ app

APP_FAST = [
    "--backend",
    "inproc",
    "--scenario",
    "paper-prfaas",
    "--set",
    "scale.speedup=5",
    "--set",
    "workload.output_tokens=16",
    "--set",
    "serving.stream_interval=4",
    "--requests",
    "12",
    "--json",
]


@pytest.mark.app
def test_real_slow_decode_fails_on_tpot_and_rerun_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two tiny real replays and a rerun. Speedup 5: at 40 a decode step is 0.6 ms on the wire and
    event-loop overhead hides a doubled base_s (TPOT 42 vs 53 ms measured); at 10 (2.5 ms steps,
    timers in whole milliseconds) CI once found 15-21% of the steps late in three runs in a row,
    and the testbed rightly marked every one invalid. Tolerances are widened for this test (TTFT 100%,
    TPOT 40%, throughput 25%) because a 12-request run on a shared 2-core machine swings that much when
    others load it."""
    normal, rerun, slow = tmp_path / "normal", tmp_path / "rerun", tmp_path / "slow"
    # The comparison means something only between runs the testbed timed faithfully: a baseline
    # whose steps ran late already has the slowed TPOT. Three invalid runs in a row: this host cannot
    # time the test now, which the testbed says; no verdict on the regression check is possible.
    for out_dir, extra in ((normal, []), (slow, ["--set", "hardware.h20.decode.base_s=0.05"])):
        rc = replay_until_valid(["replay", *APP_FAST, "--out", str(out_dir), *extra])
        assert rc in RAN
        if rc == EXIT_INVALID:
            pytest.skip(f"the testbed marked {out_dir.name} invalid three times: this host cannot time it now")
    assert replay_until_valid(["replay", *APP_FAST, "--out", str(rerun)]) in RAN
    capsys.readouterr()
    path = tmp_path / "baseline.yaml"
    wide = [f"--tolerance={k}=1.0" for k in ("ttft_s.mean", "ttft_s.p50", "ttft_s.p90", "ttft_s.p99")]
    # Twelve requests on a shared 2-core machine: throughput and egress move with scheduling noise.
    wide += [
        "--tolerance=tpot_s.mean=0.4",
        "--tolerance=throughput.completed_rps_paper=0.5",
        "--tolerance=wan_egress.mean_Bps_paper=0.5",
    ]
    assert run_cli(capsys, "regress", str(normal), "--baseline", str(path), "--update", *wide)[0] == 0

    rc, out, _ = run_cli(capsys, "regress", str(slow), "--baseline", str(path))
    assert rc == 1, out
    assert any(line.startswith("FAIL tpot_s.mean: measured") for line in out.splitlines()), out

    # A rerun the testbed itself marks invalid (its timing slipped on a loaded host) is correctly
    # a FAIL; what this test checks is that a valid rerun passes, so such a rerun is redone, as a
    # user would, at most twice. Any other FAIL fails the test at once.
    for attempt in range(3):
        rc, out, err = run_cli(capsys, "regress", str(rerun), "--baseline", str(path))
        invalid_only = rc == 1 and "1 of 10 metrics outside tolerance: validity.valid" in out
        if not invalid_only or attempt == 2:
            break
        assert main(["replay", *APP_FAST, "--out", str(rerun), "--overwrite"]) in RAN
        capsys.readouterr()
    assert rc == 0, out
    assert "warning" not in err  # same scenario, scale, shaping, backend and requests
