"""`testbed plan` says what it is doing while it works on a long trace, and when stopped says
where: it used to print nothing for minutes and exit silently on SIGTERM."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.core.schema.scenario import WorkloadSpec
from testbed.studies.plan.plan_progress import PlanProgress
from testbed.traces.formats import FORMATS, WriteOptions
from testbed.traces.synthetic import synthetic_trace


@pytest.mark.pure
def test_a_step_that_goes_on_says_so() -> None:
    out = io.StringIO()
    with PlanProgress(out, heartbeat_s=0.15) as step:
        step("loading the trace t.jsonl")
        time.sleep(0.6)
        step("searching")
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("] loading the trace t.jsonl")
    assert any(ln.endswith("] still loading the trace t.jsonl") for ln in lines[1:-1]), lines
    assert lines[-1].endswith("] searching")
    assert "interrupted while searching" in step.interrupted()


@pytest.mark.pure
def test_quiet_progress_prints_nothing() -> None:
    out = io.StringIO()
    with PlanProgress(out, quiet=True) as step:
        step("loading")
    assert out.getvalue() == ""


@pytest.mark.slow
def test_sigterm_says_plan_was_interrupted_and_where(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    FORMATS["mooncake"].write(trace, synthetic_trace(WorkloadSpec(requests=20000, rate=20.0, seed=3)), WriteOptions())
    proc = subprocess.Popen(
        [sys.executable, "-m", "testbed", "plan", "--trace", str(trace), "--no-sim", "--out", str(tmp_path / "plan")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # the first steps are printed as they start
        seen.append(line)
        if "measuring the workload of 20,000 requests" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=60)
    err = "".join(seen) + rest
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert seen[0].startswith("plan: [") and "loading the trace" in seen[0]
    assert "plan: interrupted while " in err and "plan.md and plan.json were not written" in err, err
    assert not (tmp_path / "plan" / "plan.json").exists()
