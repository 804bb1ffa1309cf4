"""A sim replay long enough to be stopped mid-way: started as its own process session, and
returned once its records show it is well under way."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def start_long_sim_replay(
    out: Path, requests: int, min_record_bytes: int, stdout: int = subprocess.PIPE, timeout: float = 120.0
) -> subprocess.Popen[str]:
    """The paper-prfaas workload at 40 req/s on the simulator into `out`, once `records.csv`
    holds `min_record_bytes`; it must still be running then (the caller stops it)."""
    cmd = [
        sys.executable,
        "-m",
        "testbed",
        "replay",
        "--backend",
        "sim",
        "--scenario",
        "paper-prfaas",
        "--set",
        f"workload.requests={requests}",
        "--set",
        "workload.rate=40",
        "--out",
        str(out),
    ]
    p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True)
    records = out / "records.csv"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        if records.is_file() and records.stat().st_size > min_record_bytes:
            break
        time.sleep(0.1)
    assert p.poll() is None, f"the run ended before it was stopped: {p.communicate()[1][-2000:]}"
    return p
