"""The netns backend end to end: a replay over a shaped WAN link, and teardown after SIGINT and
after SIGKILL followed by `testbed down`, read back from the kernel and /proc."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procinfo import pids_naming
from replay_exit import RAN
from wan_bound import counters_bound

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

FAST = [
    "--backend",
    "netns",
    "--set",
    "scale.speedup=20",
    "--set",
    "scale.byte_scale=1000",
    "--set",
    "workload.output_tokens=64",
    "--set",
    "serving.stream_interval=8",
]


def _testbed(*args: str) -> list[str]:
    return [sys.executable, "-m", "testbed", *args]


def _namespaces(prefix: str) -> list[str]:
    run = Path("/run/netns")
    return sorted(p.name for p in run.iterdir() if p.name.startswith(prefix)) if run.exists() else []


def _alive(proc: subprocess.Popen[str] | None) -> None:
    if proc is not None and proc.poll() is not None:
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"the run ended early ({proc.returncode}): {err[-3000:]}")


def _wait_for_prefix(out: Path, timeout: float = 60, proc: subprocess.Popen[str] | None = None) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        _alive(proc)
        topo = out / "topology.json"
        if topo.exists():
            try:
                return str(json.loads(topo.read_text())["prefix"])
            except (ValueError, KeyError):
                pass
        time.sleep(0.1)
    raise AssertionError("the run never wrote topology.json")


def _wait_for_records(out: Path, n: int, timeout: float = 90, proc: subprocess.Popen[str] | None = None) -> None:
    deadline = time.time() + timeout
    f = out / "records.csv"
    while time.time() < deadline:
        _alive(proc)
        if f.exists() and len(f.read_text().splitlines()) > n:
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} records after {timeout} s")


@contextlib.contextmanager
def _replay_under_way(
    out: Path, records: int, *extra: str, quiet: bool = False
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A 60-request replay, yielded with its namespace prefix once `records` requests have ended;
    killed on the way out if the test left it running."""
    pipe = subprocess.DEVNULL if quiet else subprocess.PIPE
    proc = subprocess.Popen(
        _testbed(
            "replay", "--scenario", "paper-prfaas", "--requests", "60", "--rate", "2", "--out", str(out), *FAST, *extra
        ),
        stdout=pipe,
        stderr=pipe,
        text=True,
    )
    try:
        prefix = _wait_for_prefix(out, proc=proc)
        _wait_for_records(out, records, proc=proc)
        yield proc, prefix
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_replay_over_shaped_link_counts_wan_bytes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = subprocess.run(
        _testbed(
            "replay",
            "--scenario",
            "paper-prfaas",
            "--requests",
            "16",
            "--rate",
            "2",
            "--out",
            str(out),
            "--json",
            *FAST,
        ),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode in RAN, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["requests"]["completed"] == 16
    assert s["run"]["shaping_method"] in ("fallback", "netem")
    meta = json.loads((out / "run.json").read_text())
    link = meta["shaping"]["links"]["dc-remote->dc-local"]
    assert link["rate_bps_wire"] == pytest.approx(100e9 / 1000 * 20)
    wan = s["wan_link"]
    assert wan["link"] == "dc-remote->dc-local"
    # Interface counters and the records agree on the KV that crossed (headers add a little).
    assert 1.0 <= wan["counters_over_records"] < counters_bound(out, s)
    assert _namespaces(meta["shaping"]["prefix"]) == []
    assert (out / "wan.png").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_or_sigterm_tears_everything_down_and_keeps_records(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "run"
    with _replay_under_way(out, 3, "--set", "workload.output_tokens=600") as (proc, prefix):
        assert _namespaces(prefix), "the run's namespaces should exist while it runs"
        assert pids_naming(str(out / "deployment.json"))
        proc.send_signal(sig)
        if sig == signal.SIGTERM:
            # `timeout` forwards its SIGTERM to a child that a process-group kill already
            # signalled: two SIGTERMs a moment apart. The second used to abort the teardown
            # (53 namespaces left behind).
            time.sleep(0.3)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert _namespaces(prefix) == []
    assert pids_naming(str(out / "deployment.json")) == []
    assert pids_naming(prefix) == []
    with (out / "records.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 60 and len({r["request_id"] for r in rows}) == 60
    assert any(r["outcome"] == "completed" for r in rows)
    assert json.loads((out / "run.json").read_text())["interrupted"] is True


def test_sigkill_then_down_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with _replay_under_way(out, 1, quiet=True) as (proc, prefix):
        proc.kill()
        proc.wait(30)
    # SIGKILL gives the run no chance to clean up: its namespaces and services are still there.
    assert _namespaces(prefix)
    assert pids_naming(str(out / "deployment.json"))
    down = subprocess.run(_testbed("down", "--prefix", prefix, "--json"), capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    removed = json.loads(down.stdout)
    assert removed["namespaces"] and removed["processes"]
    assert _namespaces(prefix) == []
    assert pids_naming(str(out / "deployment.json")) == []
    again = subprocess.run(_testbed("down", "--prefix", prefix, "--json"), capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and json.loads(again.stdout)["namespaces"] == []


def test_netcaps_through_the_cli_probes_the_kernel() -> None:
    """The CLI's SIGTERM handler must not reach pyroute2's forked helpers (they are told to stop
    with SIGTERM; inheriting the Ctrl-C path broke every namespace operation)."""
    r = subprocess.run(_testbed("netcaps", "--json"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    caps = json.loads(r.stdout)
    assert caps["htb"] is True and caps["method"] in ("netem", "fallback"), caps
