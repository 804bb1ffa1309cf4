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
    monkeypatch.setenv("PATH", str(empty))       # neither docker nor docker-compose on it


def test_a_backend_error_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_programs(tmp_path, monkeypatch)
    with pytest.raises(BackendError) as e:
        compose_cli()
    assert isinstance(e.value, UserError)


def test_no_docker_compose_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _no_programs(tmp_path, monkeypatch)
    rc = main(["up", "--scenario", "paper-prfaas", "--requests", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2, err
    assert lines == ["error: neither `docker compose` nor `docker-compose` is installed"], err
    assert "Traceback" not in err
