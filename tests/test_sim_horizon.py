"""Virtual time that cannot stall: traces spanning days finish, and a signal stops a simulation
between two events with its records kept.

Far into a run a network step can be shorter than half the float spacing of t (5.8e-11 s at
t = 280,000 s): the event used to reschedule itself at the same t forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from long_sim import start_long_sim_replay

from testbed.run.load import load
from testbed.sim import simulate
from testbed.traces.loader import trace_from_workload

DAY = 86400.0


@pytest.mark.pure
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(days=st.floats(min_value=2.0, max_value=12.0), seed=st.integers(0, 10_000), n=st.integers(20, 120))
def test_a_trace_spanning_days_finishes(days: float, seed: int, n: int) -> None:
    # The paper's workload (long prompts cross the WAN, short ones stay) spread over days.
    rs = load("paper-prfaas", {"workload": {"requests": n, "rate": n / (days * DAY), "seed": seed}})
    st_ = simulate(rs, trace_from_workload(rs.spec.workload))
    assert st_.completed == n
    assert st_.events < 5000 * n  # progress, not a stall at one instant


@pytest.mark.pure
def test_the_instant_that_stalled_the_simulator_is_passed() -> None:
    # 300 requests at 0.00075/s (400,000 s) never finished: a path's step near t = 280,000 s
    # rounded to t itself and its event rescheduled itself there forever.
    rs = load("paper-prfaas", {"workload": {"requests": 300, "rate": 0.00075}})
    st_ = simulate(rs, trace_from_workload(rs.spec.workload))
    assert st_.completed == 300


@pytest.mark.app
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_sim_replay_with_its_records(tmp_path: Path, sig: int) -> None:
    out = tmp_path / "run"
    records = out / "records.csv"
    # Enough requests that the simulation takes many seconds; the signal must not wait for it.
    p = start_long_sim_replay(out, 400_000, 100_000)
    t = time.monotonic()
    os.kill(p.pid, sig)
    try:
        _, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail("the simulation did not stop on the signal")
    stopped = time.monotonic() - t
    assert p.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else 130), err[-2000:]
    assert "testbed report" in err
    rows = records.read_text().splitlines()
    assert len(rows) > 10
    meta = json.loads((out / "run.json").read_text())
    assert meta["state"] == "interrupted" and meta["interrupted"] is True
    # A stop writes run.json and nothing else: it does not wait for the summary (seconds of CPU
    # for the records kept, `testbed report` makes it). The bound leaves a busy host room.
    assert stopped < 10, stopped
    rep = subprocess.run(
        [sys.executable, "-m", "testbed", "report", str(out)], capture_output=True, text=True, timeout=300
    )
    assert rep.returncode == 0 and "interrupted" in rep.stdout + rep.stderr, rep.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["requests"]["total"] == len(rows) - 1
