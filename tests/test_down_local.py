"""`testbed down` finds the services of a local run whose runner was killed (`kill -9`): each
service process group is journaled while it runs, and a journal whose owner is gone is swept."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.net.procs import ProcessGroup, start_time, sweep_orphans

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if start_time(pid) is None:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.app
def test_an_orphaned_group_is_stopped_and_a_live_one_left_alone(tmp_path: Path) -> None:
    journals = tmp_path / "procs"
    # A group owned by this (live) process: down must not touch it.
    mine = ProcessGroup(tmp_path / "mine", journal=journals / "mine.json")
    mine.spawn("a", SLEEPER)
    # A group whose owner is a process that is then killed with SIGKILL.
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import sys, time
from pathlib import Path
from testbed.net.procs import ProcessGroup
g = ProcessGroup(Path({str(tmp_path / "orphan")!r}), journal=Path({str(journals / "orphan.json")!r}))
g.spawn("router", {SLEEPER!r})
g.spawn("pd-d0", {SLEEPER!r})
print("up", flush=True)
time.sleep(300)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "up"
        entry = json.loads((journals / "orphan.json").read_text())
        pids = [e["pid"] for e in entry["procs"].values()]
        assert all(start_time(p) is not None for p in pids)
        # While the owner lives, its group is its own.
        assert sweep_orphans(journals).stopped == {}
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert all(start_time(p) is not None for p in pids)  # orphaned, still running
        swept = sweep_orphans(journals, grace=2.0)
        assert sorted(swept.stopped) == ["orphan"] and not swept.errors
        assert all(_gone(p) for p in pids)
        assert not (journals / "orphan.json").exists()
        assert mine.procs["a"].poll() is None and (journals / "mine.json").exists()
        assert sweep_orphans(journals).stopped == {}  # idempotent
    finally:
        mine.stop(grace=1.0)
        owner.kill()
    assert not (journals / "mine.json").exists()


@pytest.mark.pure
def test_a_reused_pid_is_not_taken_for_a_service(tmp_path: Path) -> None:
    journals = tmp_path / "procs"
    journals.mkdir()
    # The owner is gone; the "service" pid is this very process, but with another start time:
    # a later process given the same pid. It must not be signalled.
    me = os.getpid()
    (journals / "old.json").write_text(
        json.dumps(
            {
                "owner": {"pid": 2**22 + 7, "start": 1},
                "procs": {"router": {"pid": me, "start": (start_time(me) or 0) + 12345}},
            }
        )
    )
    swept = sweep_orphans(journals, grace=0.1)
    assert sorted(swept.stopped) == ["old"]  # forgotten, and this process still here
    (journals / "bad.json").write_text("{not json")
    assert "unreadable" in sweep_orphans(journals).errors[0]


@pytest.mark.app
def test_down_with_a_runs_prefix_stops_that_runs_services_only(tmp_path: Path) -> None:
    """A local run is journaled under its prefix (run.json's shaping.prefix): `testbed down
    --prefix P` stops that run's orphaned services and leaves another orphaned run's alone."""
    from testbed.deploy.cleanup import sweep_processes

    journals = tmp_path / "procs"
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import time
from pathlib import Path
from testbed.net.procs import ProcessGroup
for name in ("ptbaaaa", "ptbbbbb"):
    g = ProcessGroup(Path({str(tmp_path)!r}) / name, journal=Path({str(journals)!r}) / f"{{name}}.json")
    g.spawn("router", {SLEEPER!r})
print("up", flush=True)
time.sleep(300)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "up"
        pids = {
            n: json.loads((journals / f"{n}.json").read_text())["procs"]["router"]["pid"]
            for n in ("ptbaaaa", "ptbbbbb")
        }
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        swept = sweep_processes("ptbaaaa", journal_dir=journals)
        assert list(swept.to_dict()["local_runs"]) == ["ptbaaaa"] and not swept.errors  # type: ignore[call-overload]
        assert _gone(pids["ptbaaaa"]) and start_time(pids["ptbbbbb"]) is not None
        assert (journals / "ptbbbbb.json").exists() and not (journals / "ptbaaaa.json").exists()
        assert sweep_processes("ptbaaaa", journal_dir=journals).stopped == {}
        assert list(sweep_processes("ptb", journal_dir=journals).stopped) == ["ptbbbbb"]
        assert _gone(pids["ptbbbbb"])
    finally:
        owner.kill()
        for f in journals.glob("*.json"):
            for e in json.loads(f.read_text())["procs"].values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(e["pid"], signal.SIGKILL)
