"""The run directory: a scenario name cannot lead outside it, and cleaning up a previous run
never touches a directory that held no run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.config.scenarios import ScenarioError, load_scenario
from testbed.studies.runner import clear_previous_run

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("name", ["../../../../x", "a/b", "..", ".hidden", "", "x" * 129, "a b"])
def test_a_scenario_name_that_is_not_one_safe_path_component_is_rejected(name: str) -> None:
    with pytest.raises(ScenarioError, match="field 'name'"):
        load_scenario("paper-prfaas", {"name": name})


def test_a_directory_that_never_held_a_run_keeps_everything(tmp_path: Path) -> None:
    for sub in ("logs", "timeseries"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "keep.txt").write_text("mine")
    (tmp_path / "records.csv").write_text("not a testbed file")
    assert clear_previous_run(tmp_path) == []
    assert (tmp_path / "logs" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "timeseries" / "keep.txt").exists() and (tmp_path / "records.csv").exists()


def test_a_previous_run_is_cleared_of_its_artefacts_only(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"scenario": "paper-prfaas"}))
    (tmp_path / "logs").mkdir()
    (tmp_path / "notes.md").write_text("mine")
    assert sorted(clear_previous_run(tmp_path)) == ["logs", "run.json"]
    assert (tmp_path / "notes.md").exists()
