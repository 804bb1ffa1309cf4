"""What the CLI does with an error the user can fix: one line on stderr and exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main
from testbed.core.errors import UserError
from testbed.deploy.base import BackendError
from testbed.deploy.dockercli import compose_cli

pytestmark = pytest.mark.pure


def _no_programs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # neither docker nor docker-compose on it


def test_a_backend_error_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_programs(tmp_path, monkeypatch)
    with pytest.raises(BackendError) as e:
        compose_cli()
    assert isinstance(e.value, UserError)


def test_no_docker_compose_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_programs(tmp_path, monkeypatch)
    rc = main(
        ["up", "--backend", "compose", "--scenario", "paper-prfaas", "--requests", "1", "--out", str(tmp_path / "run")]
    )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2, err
    assert lines == [
        "error: neither `docker compose` nor `docker-compose` is installed: install the Docker Compose "
        "plugin (or Debian's docker-compose)"
    ], err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "cmd",
    [
        ["replay", "--scenario", "paper-prfaas", "--backend", "sim"],
        ["up", "--backend", "compose", "--scenario", "paper-prfaas"],
        ["sweep", "--scenario", "paper-prfaas", "--param", "policy.threshold=1,2"],
        ["crosscheck", "--scenario", "paper-prfaas"],
        ["capacity", "--scenario", "paper-prfaas"],
    ],
    ids=lambda c: c[0],
)
@pytest.mark.parametrize("where", ["root", "file"])
def test_out_that_is_no_directory_to_write_is_refused(
    cmd: list[str], where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = "/" if where == "root" else str(tmp_path / "a-file")
    if where == "file":
        Path(target).write_text("mine")
    rc = main([*cmd, "--out", target])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --out {target!r}: "), err
    assert ("filesystem root" if where == "root" else "existing file") in err
    if where == "file":
        assert Path(target).read_text() == "mine"


def test_a_run_directory_that_is_a_file_is_refused_by_the_runner(tmp_path: Path) -> None:
    from testbed.run.load import load
    from testbed.run.runner import run_sim
    from testbed.traces.loader import trace_from_workload

    rs = load("paper-prfaas", {"workload": {"requests": 2}})
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(UserError, match="an existing file"):
        run_sim(rs, trace_from_workload(rs.spec.workload), tmp_path / "a-file")
