"""The start-up's memory guard on a host whose memory is limited by a cgroup: the issue's case
of a deployment forced past the capacity check under a 2 GiB limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procinfo import pids_naming

pytestmark = pytest.mark.app


def _memory_cgroup(name: str, limit: int) -> tuple[Path, Path] | None:
    """A memory cgroup of `limit` bytes (v1's hierarchy, else v2's root where it delegates memory):
    (its directory, the file a pid is written to), or None where none can be made."""
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            d = v1 / name
            d.mkdir(exist_ok=True)
            (d / "memory.limit_in_bytes").write_text(str(limit))
        elif "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            d = v2 / name
            d.mkdir(exist_ok=True)
            (d / "memory.max").write_text(str(limit))
        else:
            return None
    except OSError:
        return None
    return d, d / "cgroup.procs"


@pytest.mark.skipif(os.geteuid() != 0, reason="a memory cgroup needs root")
def test_a_forced_start_under_a_memory_limit_stops_before_the_kernel_kills(tmp_path: Path) -> None:
    """The issue's case: a deployment forced past the check, under a 2 GiB memory limit, once had
    the runner OOM-killed and its services orphaned. It now stops with the figures, nothing left."""
    cg = _memory_cgroup(f"prfaas-captest-{os.getpid()}", 2 << 30)
    if cg is None:
        pytest.skip("no memory cgroup can be made here")
    d, procs = cg
    out = tmp_path / "run"
    try:
        r = subprocess.run(
            [
                "sh",
                "-c",
                f'echo $$ > {procs} && exec "$@"',
                "sh",
                sys.executable,
                "-m",
                "testbed",
                "replay",
                "--scenario",
                "paper-prfaas",
                "--set",
                "clusters.1.decode=60",
                "--backend",
                "local",
                "--requests",
                "5",
                "--out",
                str(out),
                "--force-capacity",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 2, r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert "memory ran short while starting services" in last and "of 68 started" in last, last
        assert pids_naming(str(out / "deployment.json")) == []
        events = d / "memory.events"
        assert (
            "oom_kill 0" in events.read_text() if events.exists() else (d / "memory.failcnt").read_text().strip() == "0"
        )
        assert json.loads((out / "run.json").read_text())["state"] == "failed"
    finally:
        d.rmdir()
