"""The run directory: a scenario name cannot lead outside it, and cleaning up a previous run
never touches a directory that held no run."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from testbed.config.scenarios import ScenarioError, load_scenario
from testbed.run import runner
from testbed.run.runner import clear_previous_run

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


def _users_folder(tmp_path: Path) -> Path:
    d = tmp_path / "mine"
    d.mkdir()
    for name in ("report.md", "records.csv", "summary.json"):
        (d / name).write_text(f"my own {name}")
    return d


def test_replay_into_a_folder_of_the_users_files_is_refused_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from testbed.cli import main

    d = _users_folder(tmp_path)
    rc = main(["replay", "--scenario", "paper-prfaas", "--backend", "sim", "--requests", "3", "--out", str(d)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and str(d) in lines[0] and "Traceback" not in err, err
    assert all(name in lines[0] for name in ("records.csv", "summary.json", "report.md")), err
    assert sorted(p.name for p in d.iterdir()) == ["records.csv", "report.md", "summary.json"]
    assert (d / "report.md").read_text() == "my own report.md"


def test_a_new_empty_or_previous_run_directory_is_accepted(tmp_path: Path) -> None:
    from testbed.core.errors import UserError
    from testbed.run.runner import check_run_dir

    check_run_dir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_run_dir(tmp_path / "empty")
    d = _users_folder(tmp_path)
    (d / "notes.txt").write_text("unrelated")
    with pytest.raises(UserError, match="report.md"):
        check_run_dir(d)
    (d / "run.json").write_text(json.dumps({"note": "not a run of ours"}))
    with pytest.raises(UserError, match="run.json"):
        check_run_dir(d)
    (d / "run.json").write_text(json.dumps({"scenario": "paper-prfaas"}))
    check_run_dir(d)  # a previous run: replaced as before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("nothing a run writes")
    check_run_dir(other)


def test_run_json_names_the_platform_as_python_does_without_running_uname() -> None:
    """`platform.platform()` but for the processor, which Linux asks `uname -p` for: the same words
    where the processor is the machine or unknown, as on the usual Linux machine."""
    u = platform.uname()
    if u.system != "Linux" or u.processor not in ("", "unknown", u.machine):
        pytest.skip(f"platform.platform() words a {u.system} machine with processor {u.processor!r} otherwise")
    assert runner._platform() == platform.platform()
