"""A command's hold on its output directory (`testbed.config.run_lock`): a live holder is named
and never displaced, a dead one never blocks, and a previous output is replaced only with
--overwrite (or under a folder this command took with it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.config import run_lock
from testbed.config.run_lock import LOCK_NAME, DirBusy, DirTaken, acquire, holding, read_holder, release


def _mark_previous(d: Path, pid: int = 2**22 + 3) -> None:
    """A lock file as a finished command of another invocation leaves it."""
    d.mkdir(parents=True, exist_ok=True)
    (d / LOCK_NAME).write_text(
        json.dumps(
            {
                "pid": pid,
                "start": 1,
                "host": "h",
                "command": "testbed replay --out old",
                "started": "2026-01-01T00:00:00+00:00",
                "invocation": "older",
            }
        )
    )


@pytest.mark.pure
def test_a_new_directory_is_taken_and_a_previous_output_needs_overwrite(tmp_path: Path) -> None:
    run_lock.begin_command(["replay", "--out", str(tmp_path / "a")])
    d = tmp_path / "a"
    with holding(d):
        h = read_holder(d)
        assert h is not None and h.pid == os.getpid() and h.command == f"testbed replay --out {d}"
        (d / "records.csv").write_text("x\n")
    assert (d / LOCK_NAME).exists()  # stays: the mark of a previous output
    run_lock.begin_command(["replay", "--out", str(d)])  # the next command
    with pytest.raises(DirTaken, match=r"holds the output of `testbed replay --out .*`.*give --overwrite"):
        acquire(d)
    assert (d / "records.csv").read_text() == "x\n"
    with holding(d, overwrite=True):
        pass
    # A run.json written before the lock existed is a previous run too.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "run.json").write_text(json.dumps({"scenario": "paper-prfaas", "backend": "local", "state": "finished"}))
    with pytest.raises(DirTaken, match="a previous run .scenario paper-prfaas, backend local, state finished"):
        acquire(legacy)


@pytest.mark.pure
def test_runs_under_a_folder_taken_with_overwrite_may_be_replaced_and_the_hold_is_reentrant(tmp_path: Path) -> None:
    run_lock.begin_command(["sweep"])
    base = tmp_path / "sweep"
    _mark_previous(base)
    _mark_previous(base / "point-1")
    with pytest.raises(DirTaken):
        acquire(base / "point-1")
    with holding(base, overwrite=True):
        with holding(base):  # the runner takes the command's own directory again
            with holding(base / "point-1"):  # a previous run under it: this command replaces it
                assert run_lock.replaceable(base / "point-1")
        assert read_holder(base) is not None and read_holder(base).invocation != "older"  # type: ignore[union-attr]
    assert not run_lock.replaceable(base / "point-1")
    # A directory this invocation wrote is its own to write again (a study repeating a run).
    with holding(tmp_path / "again"):
        (tmp_path / "again" / "x").write_text("")
    with holding(tmp_path / "again"):
        pass


@pytest.mark.pure
def test_a_command_that_wrote_nothing_leaves_the_directory_as_it_found_it(tmp_path: Path) -> None:
    run_lock.begin_command(["replay"])
    with holding(tmp_path / "new"):
        pass
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    with holding(tmp_path / "old"):
        pass
    assert (tmp_path / "old").is_dir() and not list((tmp_path / "old").iterdir())
    # A scope releases what the command took and did not give back.
    with run_lock.command_scope(["plan"]):
        acquire(tmp_path / "scoped")
        (tmp_path / "scoped" / "plan.md").write_text("")
    fresh = subprocess.run(
        [
            sys.executable,
            "-c",
            f"""
from pathlib import Path
from testbed.config.run_lock import holding
with holding(Path({str(tmp_path / "scoped")!r}), overwrite=True):
    print("taken")
""",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fresh.stdout.strip() == "taken", fresh.stderr


HOLDER = """
import sys, time
from pathlib import Path
from testbed.config import run_lock
run_lock.begin_command(["replay", "--out", sys.argv[1]])
run_lock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(300)
"""


@pytest.mark.app
def test_a_live_holder_is_named_and_a_killed_one_does_not_block(tmp_path: Path) -> None:
    d = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(d)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        run_lock.begin_command(["replay", "--out", str(d)])
        for overwrite in (False, True):  # --overwrite never displaces a live run
            with pytest.raises(DirBusy, match=rf"in use by a live run: pid {proc.pid} \(`testbed replay --out {d}`\)"):
                acquire(d, overwrite=overwrite)
        os.kill(proc.pid, signal.SIGKILL)  # no teardown: the kernel drops the lock
        proc.wait()
        with pytest.raises(DirTaken, match=f"pid {proc.pid}"):
            acquire(d)
        acquire(d, overwrite=True)
        release(d)
    finally:
        proc.kill()
        proc.wait()
