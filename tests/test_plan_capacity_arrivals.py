"""`testbed plan` and `testbed capacity` on session traces: `--arrivals open|closed` (or the
base scenario's `workload.arrivals`) runs their simulations in that mode, and their output says
which mode they assumed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from testbed.studies.plan import plan as plan_cmd
from testbed.studies.plan import plan_command
from testbed.traces.mooncake import write_mooncake
from testbed.traces.synthetic import synth_profile

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    write_mooncake(path, synth_profile("chat", 40, 2.0, seed=2))
    return path


def _plan(trace: Path, out: Path, *extra: str) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    plan_command.register(ap.add_subparsers())
    ns = ap.parse_args(["plan", "--trace", str(trace), "--out", str(out), "--kinds", "homogeneous", *extra])
    return plan_cmd.run_plan(plan_cmd.PlanOptions.from_args(ns)).to_json()


def _run_arrivals(run_dir: Path) -> str:
    return str(json.loads((run_dir / "run.json").read_text())["trace"]["arrivals"])


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_plan_simulates_in_the_mode_given_and_says_so(chat: Path, tmp_path: Path, mode: str) -> None:
    out = tmp_path / "plan"
    res = _plan(chat, out, "--top", "1", "--arrivals", mode)
    assert res["settings"]["arrivals"] == mode and res["settings"]["sessions"] > 0
    assert f"Arrivals assumed: **{mode}**" in (out / "plan.md").read_text()
    if res["verified"]:  # the simulations ran in that mode
        assert _run_arrivals(out / "sim" / "paper-homogeneous") == mode


def test_plan_defaults_to_the_base_scenarios_mode(
    chat: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = _plan(chat, tmp_path / "p", "--no-sim")
    assert res["settings"]["arrivals"] == "open"  # paper-homogeneous's workload.arrivals
    ap = argparse.ArgumentParser()
    plan_command.register(ap.add_subparsers())
    ns = ap.parse_args(
        ["plan", "--trace", str(chat), "--out", str(tmp_path / "q"), "--kinds", "homogeneous", "--no-sim"]
        + ["--arrivals", "closed"]
    )
    assert ns.func(ns) == 0
    assert "arrivals assumed: closed, " in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_capacity_probes_in_the_mode_given_and_says_so(
    chat: Path, tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from testbed.cli import main

    out = tmp_path / "cap"
    argv = ["capacity", "--scenario", "paper-homogeneous", "--backend", "sim", "--trace", str(chat)]
    argv += ["--requests", "40", "--probes", "2", "--arrivals", mode, "--json", "--out", str(out)]
    assert main(argv) == 0
    assert f"backend sim, {mode} arrivals" in capsys.readouterr().err
    res = json.loads((out / "capacity.json").read_text())
    assert res["arrivals"] == mode and res["sessions"] > 0
    assert f"Arrivals: **{mode}**" in (out / "capacity.md").read_text()
    assert {_run_arrivals(Path(p["run_dir"])) for p in res["probes"]} == {mode}
