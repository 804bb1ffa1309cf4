"""Virtual time that cannot stall: traces spanning days finish, and a signal stops a simulation
between two events with its records kept.

Far into a run a network step can be shorter than half the float spacing of t (5.8e-11 s at
t = 280,000 s): the event used to reschedule itself at the same t forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from testbed.sim import simulate
from testbed.studies.load import load
from testbed.traces.loader import trace_from_workload

DAY = 86400.0


@pytest.mark.pure
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(days=st.floats(min_value=2.0, max_value=12.0), seed=st.integers(0, 10_000),
       n=st.integers(20, 120))
def test_a_trace_spanning_days_finishes(days: float, seed: int, n: int) -> None:
    # The paper's workload (long prompts cross the WAN, short ones stay) spread over days.
    rs = load("paper-prfaas", {"workload": {"requests": n, "rate": n / (days * DAY), "seed": seed}})
    st_ = simulate(rs, trace_from_workload(rs.spec.workload))
    assert st_.completed == n
    assert st_.events < 5000 * n      # progress, not a stall at one instant


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
    # Enough requests that the simulation takes many seconds; the signal must not wait for it.
    cmd = [sys.executable, "-m", "testbed", "replay", "--backend", "sim", "--scenario", "paper-prfaas",
           "--set", "workload.requests=400000", "--set", "workload.rate=40", "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    records = out / "records.csv"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if records.is_file() and records.stat().st_size > 100_000:
            break
        time.sleep(0.1)
    assert p.poll() is None, f"the run ended before the signal: {p.communicate()[1][-2000:]}"
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
    assert (out / "summary.json").is_file()
    rows = records.read_text().splitlines()
    assert len(rows) > 10
    # Bound from what the run itself shows: the summary of the records kept is the teardown.
    assert stopped < 30, stopped
