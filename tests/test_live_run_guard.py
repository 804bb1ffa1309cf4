"""A second command against a live run: a replay into its --out is refused naming it, and
`testbed down` (any prefix, a partial one included) leaves what it owns alone; the live run then
ends complete, every request recorded."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from deployment_sizes import ONE_PER_ROLE
from replay_exit import RAN

from testbed.config.privilege import AS_USER_ENV
from testbed.deploy import cleanup
from testbed.deploy.cleanup import LiveRuns, sweep_namespaces
from testbed.net import owners
from testbed.net.owners import Owner
from testbed.net.teardown import TeardownReport

REQUESTS = 20


def _testbed(*args: str) -> list[str]:
    return [sys.executable, "-m", "testbed", *args]


def _records(out: Path) -> list[dict[str, str]]:
    try:
        with (out / "records.csv").open() as fh:
            return list(csv.DictReader(fh))
    except OSError:
        return []


def _prefix(out: Path) -> str | None:
    try:
        p = json.loads((out / "run.json").read_text())["shaping"].get("prefix")
    except (OSError, ValueError, KeyError):
        return None
    return p if isinstance(p, str) and p else None


@contextmanager
def _live_run(out: Path, backend: str, *extra: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Run A, yielded with its prefix once it has recorded a request; killed if left running."""
    proc = subprocess.Popen(
        _testbed(
            "replay",
            "--scenario",
            "paper-prfaas",
            "--backend",
            backend,
            "--requests",
            str(REQUESTS),
            "--rate",
            "0.25",
            "--out",
            str(out),
            "--set",
            "workload.output_tokens=64",
            *ONE_PER_ROLE,
            *extra,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"run A ended early ({proc.returncode}): {proc.communicate()[1][-3000:]}")
            prefix = _prefix(out)
            if prefix and _records(out):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("run A recorded nothing in 300 s")
        yield proc, prefix
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _complete(proc: subprocess.Popen[str], out: Path, backend: str) -> None:
    """Run A ends as if nothing had happened: it ran (exit 0, or 3 where this host could not keep
    its time), every request completed, its own run.json."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode in RAN, err[-3000:]
    rows = _records(out)
    assert len(rows) == REQUESTS and all(r["outcome"] == "completed" for r in rows), err[-3000:]
    meta = json.loads((out / "run.json").read_text())
    assert (meta["state"], meta["backend"], meta["trace"]["requests"]) == ("finished", backend, REQUESTS)
    assert (out / "deployment.json").exists() and (out / "logs").is_dir()


@pytest.mark.app
def test_a_second_replay_into_a_live_runs_out_is_refused_and_down_spares_it(tmp_path: Path) -> None:
    out = tmp_path / "x"
    # Its arrivals span 20 s (80 paper s at speedup 4): the second commands come while it runs.
    with _live_run(out, "local", "--set", "scale.speedup=4", "--set", "scale.byte_scale=1024") as (a, prefix):
        r = subprocess.run(
            _testbed(
                "replay",
                "--scenario",
                "paper-prfaas",
                "--backend",
                "sim",
                "--requests",
                "5",
                "--out",
                str(out),
                "--overwrite",
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 2, r.stderr[-3000:]
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("error:") and "in use by a live run" in line and f"pid {a.pid}" in line, line
        assert "--backend local" in line  # the command that holds it
        # `down` with the run's own prefix, as a user without root (local runs need none): spared, listed.
        env = {**os.environ, AS_USER_ENV: "1"}
        d = subprocess.run(
            _testbed("down", "--prefix", prefix, "--json"), capture_output=True, text=True, timeout=300, env=env
        )
        assert d.returncode == 0, d.stderr[-3000:]
        report = json.loads(d.stdout)
        assert report["local_runs"] == {} and prefix in report["local_runs_spared"]
        assert a.poll() is None
        _complete(a, out, "local")
    # Finished: the directory is replaced only when told.
    r = subprocess.run(
        _testbed("replay", "--scenario", "paper-prfaas", "--backend", "sim", "--requests", "5", "--out", str(out)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "give --overwrite" in r.stderr and "state finished" in r.stderr, r.stderr[-3000:]
    assert len(_records(out)) == REQUESTS
    r = subprocess.run(
        _testbed(
            "replay",
            "--scenario",
            "paper-prfaas",
            "--backend",
            "sim",
            "--requests",
            "5",
            "--out",
            str(out),
            "--overwrite",
            "--json",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(_records(out)) == 5 and json.loads((out / "run.json").read_text())["backend"] == "sim"


def _owner(key: str, pid: int, start: int | None) -> Owner:
    import socket

    return Owner(key, "netns", pid, start, socket.gethostname(), f"/runs/{key}", "testbed replay")


@pytest.mark.pure
def test_namespace_sweeps_leave_a_live_owners_namespaces_whatever_the_prefix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    names = ["ptb70b0-wan", "ptb70b0-pd-d0", "ptb7dead-wan", "ptb-probe-12"]
    removed: list[list[str]] = []

    def fake_remove(found: list[str], label: str = "") -> TeardownReport:
        removed.append(found)
        return TeardownReport(label, tuple(found), ())

    monkeypatch.setattr(cleanup, "namespaces", lambda prefix: [n for n in names if n.startswith(prefix)])
    monkeypatch.setattr(cleanup, "remove_namespaces", fake_remove)
    me = os.getpid()
    live = LiveRuns({"ptb70b0": _owner("ptb70b0", me, owners.process_start(me))})
    for prefix in ("ptb", "ptb7", "ptb70b0"):
        removed.clear()
        sweep_namespaces(prefix, live=live)
        assert not [n for n in removed[0] if n.startswith("ptb70b0")], (prefix, removed)
    assert removed == [[]]
    sweep_namespaces("ptb", live=LiveRuns(live.owners, frozenset({"ptb70b0"})))  # --force ptb70b0
    assert removed[-1] == names
    # Owner files: a live owner is one whose pid still runs with the start time recorded.
    d = tmp_path / "owners"
    d.mkdir()
    for key, pid, start in (("ptb70b0", me, owners.process_start(me)), ("ptb1111", me, 1), ("ptb2222", 2**22 + 5, 1)):
        (d / f"{key}.json").write_text(json.dumps(_owner(key, pid, start).__dict__))
    assert sorted(owners.read_owners([d])) == ["ptb1111", "ptb2222", "ptb70b0"]
    assert list(owners.live_owners([d])) == ["ptb70b0"]
    report = cleanup.down([], "ptb", owner_dirs=[d])
    assert list(report.to_dict()["live_runs_spared"]) == ["ptb70b0"]  # type: ignore[call-overload]
    assert "`testbed down --force ptb70b0` removes it" in report.summary()
    assert sorted(p.name for p in d.iterdir()) == ["ptb70b0.json"]  # the dead owners' files are gone


def _netns_names(prefix: str) -> list[str]:
    run = Path("/run/netns")
    return sorted(p.name for p in run.iterdir() if p.name.startswith(prefix)) if run.exists() else []


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_down_with_a_partial_prefix_leaves_a_live_netns_run_complete(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with _live_run(out, "netns", "--set", "scale.speedup=4", "--set", "scale.byte_scale=1000") as (a, prefix):
        before = _netns_names(prefix)
        assert before
        # The shortest part of the run's prefix that selects no one else's namespaces: this machine
        # may run other deployments, which this test must not take down.
        partial = next((prefix[:n] for n in range(4, len(prefix)) if _netns_names(prefix[:n]) == before), None)
        if partial is None:
            pytest.skip(f"every partial prefix of {prefix} also selects another deployment's namespaces")
        results: dict[str, Any] = {}
        for args in (("--prefix", partial), ("--prefix", prefix)):
            d = subprocess.run(_testbed("down", *args, "--json"), capture_output=True, text=True, timeout=300)
            assert d.returncode == 0, d.stderr[-3000:]
            results[args[1]] = json.loads(d.stdout)
            assert _netns_names(prefix) == before and a.poll() is None
        for rep in results.values():
            assert rep["namespaces"] == [] and rep["processes"] == [] and prefix in rep["live_runs_spared"]
        _complete(a, out, "netns")
    assert _netns_names(prefix) == [] and not (owners.ROOT_DIR / f"{prefix}.json").exists()
