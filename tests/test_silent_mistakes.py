"""Mistakes that used to pass without a word now say so in one line: a plan file replayed without
the trace it was sized for, a --budget naming hardware no base has, an empty trace validated, and
`capacity --trace` quoting the model on the synthetic workload instead of the trace's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.config.scenarios import load_scenario
from testbed.run.run_args import RunArgs, trace_for

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "traces" / "samples" / "mooncake-sample.jsonl"


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.app
def test_a_plan_file_without_its_trace_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--trace",
                str(SAMPLE),
                "--kinds",
                "prfaas",
                "--no-sim",
                "--top",
                "1",
                "--out",
                str(tmp_path / "plan"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    sc = load_scenario(str(tmp_path / "plan" / "plan-prfaas-1.yaml"))
    assert sc.workload.planned_for == f"--trace {SAMPLE}"
    none = RunArgs()  # no --trace
    trace_for(sc, none)
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("warning: plan-prfaas-1 was planned for --trace ") and "synthetic workload" in line
    trace_for(load_scenario("paper-prfaas"), none)  # a scenario not made by plan: nothing to say
    assert capsys.readouterr().err == ""


@pytest.mark.pure
def test_a_budget_for_hardware_no_base_has_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--trace", str(SAMPLE), "--budget", "h300=4", "--no-sim", "--out", str(tmp_path / "p")])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and "--budget h300=4: no hardware 'h300'" in line and "h200" in line, line
    rc = main(
        [
            "plan",
            "--trace",
            str(SAMPLE),
            "--kinds",
            "homogeneous",
            "--budget",
            "prfaas:h200=2",
            "--no-sim",
            "--out",
            str(tmp_path / "q"),
        ]
    )
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and "'prfaas' is not planned" in line, line


@pytest.mark.pure
def test_an_empty_trace_does_not_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trace", "validate", str(empty)]) == 2
    assert _one_line(capsys.readouterr().err) == f"{empty}: no requests: an empty trace has nothing to replay"
    assert main(["trace", "validate", str(SAMPLE)]) == 0


@pytest.mark.app
def test_capacity_quotes_the_model_on_the_traces_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    head = tmp_path / "head.jsonl"
    head.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:30]))
    assert main(["model", "--scenario", "paper-prfaas", "--trace", str(head), "--json"]) == 0
    on_trace = json.loads(capsys.readouterr().out)["scenarios"][0]["lambda_max"]
    assert main(["model", "--scenario", "paper-prfaas", "--json"]) == 0
    synthetic = json.loads(capsys.readouterr().out)["scenarios"][0]["lambda_max"]
    assert abs(on_trace / synthetic - 1) > 0.05  # the two workloads differ: the check can fail
    assert (
        main(
            [
                "capacity",
                "--scenario",
                "paper-prfaas",
                "--trace",
                str(SAMPLE),
                "--requests",
                "30",
                "--backend",
                "sim",
                "--probes",
                "1",
                "--out",
                str(tmp_path / "cap"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"Analytical model: {on_trace:.2f} req/s" in out, out
    assert json.loads((tmp_path / "cap" / "capacity.json").read_text())["model_lambda_max"] == pytest.approx(on_trace)
