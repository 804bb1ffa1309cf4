"""The run journal: `run.json` says `running` from the start, with the pid and host of the
process running it, and how the run ended; a run whose process died without closing it
(`kill -9`) is reported as cut short, with how many requests have a record and how many none."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from long_sim import start_long_sim_replay

from testbed.metrics.artefacts import run_info
from testbed.metrics.artefacts.run_file import was_cut_short

SCALE = {"speedup": 4.0, "byte_scale": 256.0}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.pure
def test_a_running_file_is_cut_short_only_when_its_process_is_gone() -> None:
    host = socket.gethostname()
    assert was_cut_short(run_info(scale=SCALE, state="running", pid=_dead_pid(), host=host))
    assert not was_cut_short(run_info(scale=SCALE, state="running", pid=os.getpid(), host=host))
    assert not was_cut_short(run_info(scale=SCALE, state="running", pid=_dead_pid(), host=host + "-elsewhere"))
    assert was_cut_short(run_info(scale=SCALE, state="running"))  # no pid: nobody closes it
    for ended in ("finished", "interrupted", "failed"):
        assert not was_cut_short(run_info(scale=SCALE, state=ended, pid=_dead_pid(), host=host))
    assert not was_cut_short(run_info(scale=SCALE))  # written before the journal


@pytest.mark.pure
def test_a_finished_sim_run_says_so(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "testbed",
            "replay",
            "--backend",
            "sim",
            "--scenario",
            "paper-prfaas",
            "--set",
            "workload.requests=20",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((out / "run.json").read_text())
    assert meta["state"] == "finished" and meta["pid"] > 0 and meta["host"] == socket.gethostname()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["cut_short"] is False and summary["run"]["trace_requests"] == 20


@pytest.mark.app
def test_a_killed_run_is_reported_as_cut_short(tmp_path: Path) -> None:
    out = tmp_path / "run"
    n = 400_000
    p = start_long_sim_replay(out, n, 50_000, stdout=subprocess.DEVNULL)
    meta = json.loads((out / "run.json").read_text())
    assert meta["state"] == "running" and meta["pid"] == p.pid
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    assert not (out / "summary.json").exists()  # nothing closed the run

    r = subprocess.run([sys.executable, "-m", "testbed", "report", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ended without closing the run" in r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    recorded = summary["requests"]["total"]
    assert summary["run"]["cut_short"] is True and summary["run"]["interrupted"] is True
    assert summary["run"]["trace_requests"] == n and 0 < recorded < n
    report = (out / "report.md").read_text()
    assert "CUT SHORT" in report and f"{n - recorded:,}" in report.replace("\u202f", ",")
