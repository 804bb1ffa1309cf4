"""A live run whose router dies mid-run fails: non-zero exit, run.json `failed`, a line naming the
router and how it ended. It used to end `finished` with exit 0 and 0/N completed, naming nothing."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.app

FAST = [
    "--set",
    "scale.speedup=40",
    "--set",
    "scale.byte_scale=1024",
    "--set",
    "workload.output_tokens=32",
    "--set",
    "serving.stream_interval=4",
]


def _router_pid(run_dir: Path) -> int | None:
    """The `testbed serve router` process of this run (its command line names the deployment file)."""
    needle = str(run_dir / "deployment.json").encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in argv and b"router" in argv and b"serve" in argv:
                return int(p.name)
    return None


def test_a_sigkilled_router_fails_the_run_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # 40 arrivals over 10 wire seconds (rate 0.1 at speedup 40): when the second has ended, most
    # are still to come, however busy the machine.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testbed",
            "replay",
            "--scenario",
            "paper-prfaas",
            "--requests",
            "40",
            "--rate",
            "0.1",
            "--out",
            str(out),
            "--backend",
            "local",
            *FAST,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    records = out / "records.csv"
    deadline = time.time() + 90
    pid = None
    while time.time() < deadline and proc.poll() is None:
        pid = _router_pid(out)
        if pid is not None and records.exists() and len(records.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert pid is not None and proc.poll() is None, "the run should be under way"
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]  # a failed run, not a usage error
    assert "the router was killed by SIGKILL during the run" in err, err[-2000:]
    meta = json.loads((out / "run.json").read_text())
    assert meta["state"] == "failed" and meta["interrupted"] is False
    with records.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 40  # every request kept, the ones after the death failed
    assert any(r["outcome"] == "completed" for r in rows) and any(r["outcome"] != "completed" for r in rows)
    assert (out / "summary.json").exists()
