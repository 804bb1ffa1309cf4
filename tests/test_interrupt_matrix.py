"""A run stopped the hard ways, on every backend that starts services (local, netns, compose):
a second Ctrl-C while the first one's teardown runs, Ctrl-C twice then SIGTERM, `kill -9`
followed by `testbed down --prefix` with the run's own prefix, and a disk that fills up under
the run directory. Afterwards nothing of the run is left (its processes, namespaces and their
qdiscs, containers, networks, volumes, control folders, listening sockets); every request of
the trace has a record with an outcome and, unless it completed, a reason (after `kill -9`,
those the process held in flight are counted as lost, as no record of them could be written);
and `testbed report` says what happened to the run.

Each backend's case runs under its own tier's marker (app, netns, docker). Signals go to the
runner's process alone, as `kill` sends them; a terminal's Ctrl-C reaches its whole process
group, which the services leave (each runs in a session of its own)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deployment_sizes import ONE_PER_ROLE
from procinfo import pids_naming

from testbed.config.privilege import AS_USER_ENV
from testbed.net.procs import JOURNAL_DIR

REQUESTS = 60
LABEL = "prfaas-testbed.project"


def _docker_ok() -> bool:
    return (
        shutil.which("docker") is not None and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    )


BACKENDS = {
    "local": ([pytest.mark.app], ["--set", "scale.speedup=20", "--set", "scale.byte_scale=1024", *ONE_PER_ROLE]),
    "netns": (
        [pytest.mark.netns, pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")],
        ["--set", "scale.speedup=20", "--set", "scale.byte_scale=1000", *ONE_PER_ROLE],
    ),
    "compose": (
        [
            pytest.mark.docker,
            pytest.mark.skipif(os.geteuid() != 0, reason="the WAN router needs root"),
            pytest.mark.skipif(not _docker_ok(), reason="no Docker engine reachable"),
        ],
        ["--set", "scale.speedup=10", "--set", "scale.byte_scale=1000", *ONE_PER_ROLE],
    ),
}


def _each(*backends: str) -> list[Any]:
    return [pytest.param(b, marks=BACKENDS[b][0], id=b) for b in backends]


def _testbed(*args: str) -> list[str]:
    return [sys.executable, "-m", "testbed", *args]


def _prefix(out: Path) -> str | None:
    """The run's name for `testbed down --prefix`, once run.json holds it."""
    try:
        shaping = json.loads((out / "run.json").read_text())["shaping"]
    except (OSError, ValueError, KeyError):
        return None
    name = shaping.get("prefix") or shaping.get("project")
    return name if isinstance(name, str) else None


def _records(out: Path) -> list[dict[str, str]]:
    try:
        with (out / "records.csv").open() as fh:
            return list(csv.DictReader(fh))
    except OSError:
        return []


@contextlib.contextmanager
def _under_way(out: Path, backend: str, done: int, timeout: float = 600) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A replay yielded with its prefix once `done` requests have a record; killed on the way out
    if the test left it running."""
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
            "2",
            "--out",
            str(out),
            "--set",
            "workload.output_tokens=400",
            "--set",
            "serving.stream_interval=8",
            *BACKENDS[backend][1],
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + timeout
        prefix = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"the run ended early ({proc.returncode}): {proc.communicate()[1][-3000:]}")
            prefix = prefix or _prefix(out)
            if prefix and len(_records(out)) >= done:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"fewer than {done} records after {timeout} s")
        yield proc, prefix
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A":  # LISTEN
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _run_ports(out: Path) -> set[int]:
    """The loopback ports a local run's services listened on (deployment.json)."""
    try:
        dep = json.loads((out / "deployment.json").read_text())
    except (OSError, ValueError):
        return set()
    found: set[int] = set()

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if isinstance(x.get("port"), int) and x.get("host") in ("127.0.0.1", "localhost"):
                found.add(x["port"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(dep)
    return found


def _host_links_naming(prefix: str) -> list[str]:
    """Interfaces (and so their qdiscs) of this namespace whose name carries the prefix."""
    r = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if prefix in line]


def leftovers(out: Path, backend: str, prefix: str) -> dict[str, object]:
    """Everything of the run still there, by kind (all empty: nothing left)."""
    left: dict[str, object] = {
        "processes": pids_naming(str(out)) + pids_naming(prefix),
        "sockets": sorted(_run_ports(out) & _listening_ports()) if backend == "local" else [],
        "journal": [str(JOURNAL_DIR / f"{prefix}.json")] if (JOURNAL_DIR / f"{prefix}.json").exists() else [],
        "namespaces": sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix))
        if os.path.isdir("/run/netns")
        else [],
        "links and their qdiscs": _host_links_naming(prefix),
        "control folder": [f"/tmp/{prefix}-ctl"] if Path(f"/tmp/{prefix}-ctl").exists() else [],
    }
    if backend == "compose":
        for kind in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
            left[f"docker {kind[0]}"] = subprocess.run(
                ["docker", *kind, "--filter", f"label={LABEL}={prefix}"], capture_output=True, text=True
            ).stdout.split()
    return {k: v for k, v in left.items() if v}


def _every_request_recorded(out: Path) -> list[dict[str, str]]:
    rows = _records(out)
    assert len(rows) == REQUESTS and len({r["request_id"] for r in rows}) == REQUESTS
    assert all(r["outcome"] for r in rows)
    assert all(r["reason"] for r in rows if r["outcome"] != "completed"), [
        r for r in rows if r["outcome"] != "completed" and not r["reason"]
    ][:3]
    return rows


def _report(out: Path) -> str:
    r = subprocess.run(_testbed("report", str(out)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return " ".join((r.stdout + r.stderr).split())  # the terminal table wraps its warnings


@pytest.mark.parametrize("backend", _each("local", "netns", "compose"))
@pytest.mark.parametrize(
    ("signals", "gap"), [(("INT", "INT"), 0.5), (("INT", "INT", "TERM"), 0.05)], ids=["INT-INT", "INT-INT-TERM"]
)
def test_signals_during_teardown_do_not_cut_it_short(
    tmp_path: Path, backend: str, signals: tuple[str, ...], gap: float
) -> None:
    """Ctrl-C twice, the second once the first one's teardown is under way; and Ctrl-C, Ctrl-C,
    SIGTERM in quick succession, the later ones before the cancellation has reached the teardown
    (as a loaded machine makes of any gap: they once escaped the event loop and left the run's
    containers and a "running" run.json behind)."""
    out = tmp_path / "run"
    with _under_way(out, backend, 3) as (proc, prefix):
        for i, name in enumerate(signals):
            if i:
                time.sleep(gap)
            proc.send_signal(getattr(signal, f"SIG{name}"))
        _, err = proc.communicate(timeout=300)
    # Ctrl-C's code, or SIGTERM's when one came (the CLI answers a SIGTERM as what it is)
    assert proc.returncode == (128 + signal.SIGTERM if "TERM" in signals else 130), err[-3000:]
    assert leftovers(out, backend, prefix) == {}
    rows = _every_request_recorded(out)
    assert any(r["outcome"] == "completed" for r in rows)
    meta = json.loads((out / "run.json").read_text())
    assert meta["interrupted"] is True and meta["state"] == "interrupted"
    assert "interrupted" in _report(out)


@pytest.mark.parametrize("backend", _each("local", "compose"))
def test_kill_9_then_down_with_the_runs_prefix_leaves_nothing(tmp_path: Path, backend: str) -> None:
    """(netns: test_netns_backend.test_sigkill_then_down_leaves_nothing.) A local run is swept by
    a user without root too: only namespaces need it."""
    out = tmp_path / "run"
    with _under_way(out, backend, 3) as (proc, prefix):
        proc.kill()
        proc.communicate()
    assert leftovers(out, backend, prefix), "a killed run leaves its deployment (down is what removes it)"
    env = {**os.environ, AS_USER_ENV: "1"} if backend == "local" and os.geteuid() == 0 else None
    down = subprocess.run(
        _testbed("down", "--prefix", prefix, "--json"), capture_output=True, text=True, timeout=300, env=env
    )
    assert down.returncode == 0, down.stderr[-3000:]
    assert leftovers(out, backend, prefix) == {}
    again = subprocess.run(
        _testbed("down", "--prefix", prefix, "--json"), capture_output=True, text=True, timeout=300, env=env
    )
    assert again.returncode == 0 and not any(v for v in json.loads(again.stdout).get("local_runs", {}).values())
    text = _report(out)
    assert "ended without closing the run" in text and f"testbed down --prefix {prefix}" in text
    summary = json.loads((out / "summary.json").read_text())
    recorded = summary["requests"]["total"]
    assert summary["run"]["cut_short"] is True and summary["run"]["trace_requests"] == REQUESTS
    assert 3 <= recorded < REQUESTS
    assert all(r["outcome"] and (r["outcome"] == "completed" or r["reason"]) for r in _records(out))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a full disk) needs root")
@pytest.mark.parametrize("backend", _each("netns", "compose"))
def test_a_full_disk_stops_the_run_and_leaves_nothing(tmp_path: Path, backend: str) -> None:
    """(local: test_e2e_app.test_a_full_disk_stops_every_service_and_says_so.) The run directory
    on a tmpfs that fills up while the run goes: one line, nothing left; once space is freed,
    `testbed report` says how the run ended."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(small)], check=True)
    out = small / "run"
    try:
        r = subprocess.run(
            _testbed(
                "replay",
                "--scenario",
                "paper-prfaas",
                "--backend",
                backend,
                "--requests",
                str(REQUESTS),
                "--rate",
                "4",
                "--out",
                str(out),
                "--set",
                "workload.output_tokens=64",
                *BACKENDS[backend][1],
            ),
            capture_output=True,
            text=True,
            timeout=900,
        )
        prefix = _prefix(out)
        assert r.returncode in (1, 2), r.stderr[-3000:]
        lines = r.stderr.strip().splitlines()
        assert "Traceback" not in r.stderr and lines, r.stderr[-3000:]
        assert "could not be written" in lines[-1] or "No space left" in lines[-1], lines[-1]
        assert prefix is not None
        assert leftovers(out, backend, prefix) == {}
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        text = _report(out)
        assert "ended without closing the run" in text or "interrupted" in text or "failed" in text, text[-2000:]
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


START_UP_DECODE = 150  # services that take seconds to start (netns: ~10 s to build their network here)


@pytest.mark.parametrize(
    ("backend", "stage"),
    [
        pytest.param("local", "services", marks=BACKENDS["local"][0], id="local-services"),
        pytest.param("netns", "network", marks=BACKENDS["netns"][0], id="netns-network"),
        pytest.param("netns", "services", marks=BACKENDS["netns"][0], id="netns-services"),
    ],
)
def test_sigterm_during_start_up_stops_it_within_seconds(tmp_path: Path, backend: str, stage: str) -> None:
    """SIGTERM while a large deployment starts: while the netns backend builds its namespaces,
    and while services are being spawned. The start stops where it stands (it once went on
    spawning every service, or building every namespace after the teardown had run), everything
    started so far is removed, and run.json says the run was interrupted."""
    out = tmp_path / "run"
    services = str(out / "deployment.json")  # on every service's command line, not on the runner's
    proc = subprocess.Popen(
        _testbed(
            "replay",
            "--scenario",
            "paper-prfaas",
            "--backend",
            backend,
            "--requests",
            "5",
            "--out",
            str(out),
            "--force-capacity",
            *ONE_PER_ROLE,
            "--set",
            f"clusters.1.decode={START_UP_DECODE}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        began, prefix = time.monotonic(), None
        while proc.poll() is None and time.monotonic() - began < 600:
            prefix = prefix or _prefix(out)
            spaces = (
                [n for n in os.listdir("/run/netns") if prefix and n.startswith(prefix)]
                if os.path.isdir("/run/netns")
                else []
            )
            if prefix and (len(spaces) >= 40 if stage == "network" else len(pids_naming(services)) >= 20):
                break
            time.sleep(0.05)
        assert proc.poll() is None and prefix, f"the start-up ended or never began: {proc.communicate()[1][-3000:]}"
        reached = time.monotonic() - began
        if stage == "network":
            assert pids_naming(services) == [], "the network was built before the signal"
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=300)
        stop_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    print(f"{backend} {stage}: SIGTERM {reached:.1f} s into the start-up, exited {stop_s:.1f} s later")
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    # Seconds, not the minutes the whole start-up takes; as loaded as the machine that got there.
    assert stop_s < 10 + reached, f"{stop_s:.1f} s to stop"
    left = leftovers(out, backend, prefix)
    # The ports of services never started were only picked, not held: another program may
    # listen on one meanwhile. Those of the services that did start must be free.
    started = sorted(p.stem for p in (out / "logs").glob("*.log"))
    dep = json.loads((out / "deployment.json").read_text())
    ports = (
        {dep["router"]["port"]}
        | {dep["nodes"][k]["http"]["port"] for k in started if k in dep["nodes"]}
        | {dep["nodes"][k]["kv"]["port"] for k in started if k in dep["nodes"]}
    )
    if backend == "local" and "sockets" in left:
        left["sockets"] = sorted(set(left["sockets"]) & ports)  # type: ignore[call-overload]
    assert {k: v for k, v in left.items() if v} == {}
    assert len(started) < START_UP_DECODE, f"{len(started)} services were started after all"
    meta = json.loads((out / "run.json").read_text())
    assert meta["interrupted"] is True and meta["state"] == "interrupted"
