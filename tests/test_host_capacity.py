"""The host-capacity check: a deployment this host cannot hold is refused before anything is
written or started, in one line giving the figures and the flag that forces it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from procinfo import pids_naming

from testbed.config.overrides import overrides_for
from testbed.config.resolved import ResolvedScenario
from testbed.core.errors import UserError
from testbed.deploy import host_capacity as hc
from testbed.deploy.registry import check_capacity, refusal
from testbed.run.load import load

pytestmark = pytest.mark.pure
GB = 1 << 30


def _host(memory: int = 64 * GB, cpus: int = 16, tasks: int | None = None, nofile: int = 65536) -> hc.Host:
    return hc.Host(
        hc.Limit(memory, "MemAvailable"),
        cpus,
        hc.Limit(tasks, "cgroup /x: pids.max 100 (0 in use)") if tasks is not None else None,
        nofile,
    )


def _need(services: int, decode: int = 1, prefill: int = 1) -> hc.Need:
    return hc.need_of(services, decode, prefill, 4, hc.PROCESS_HEALTH_TIMEOUT_S, "local")


def test_a_deployment_that_fits_is_not_refused() -> None:
    assert hc.refusal(_need(14), _host()) is None
    hc.check(_need(14), host=_host())


def test_memory_is_services_times_their_figure_plus_the_reserve() -> None:
    n = 100
    exact = n * hc.SERVICE_BYTES + hc.RESERVE_BYTES
    assert hc.shortfalls(_need(n), _host(memory=exact)) == []
    (short,) = hc.shortfalls(_need(n), _host(memory=exact - 1))
    assert short.startswith(f"memory: {n} services x {hc.SERVICE_BYTES >> 20} MB")
    assert f"{n - 1} services fit" in short and "MemAvailable" in short


def test_cpus_bound_the_services_that_start_within_the_health_timeout() -> None:
    fit = int(hc.PROCESS_HEALTH_TIMEOUT_S * 2 / hc.STARTUP_CPU_S)
    assert hc.shortfalls(_need(fit), _host(cpus=2)) == []
    (short,) = hc.shortfalls(_need(fit + 1), _host(cpus=2))
    assert short.startswith(f"CPUs: {fit + 1} services") and f"{fit} services fit" in short
    assert hc.shortfalls(_need(fit + 1), _host(cpus=4)) == []


def test_process_and_open_file_limits() -> None:
    short = hc.shortfalls(_need(30), _host(tasks=100))
    assert len(short) == 1 and "processes: 30 services x" in short[0] and "pids.max" in short[0]
    assert hc.shortfalls(_need(25), _host(tasks=100)) == []
    # 1,000 decode nodes, 4 KV connections each from every prefill node
    (files,) = hc.shortfalls(hc.need_of(1010, 1000, 9, 4, 1e9, "local"), _host(memory=1000 * GB, nofile=1024))
    assert files.startswith(f"open files: the busiest service may hold {hc.BASE_FDS + 4000}")


def test_the_refusal_is_one_line_with_every_figure_and_the_flag() -> None:
    why = hc.refusal(_need(4104), _host(memory=22 * GB, cpus=2))
    assert why is not None and "\n" not in why
    assert "4104 services on the local backend" in why and "memory:" in why and "CPUs:" in why
    assert "nothing was started" in why and hc.FORCE_FLAG in why
    with pytest.raises(UserError, match="4104 services"):
        hc.check(_need(4104), host=_host(memory=22 * GB, cpus=2))
    hc.check(_need(4104), force=True, host=_host(memory=22 * GB, cpus=2))


def test_the_registry_counts_every_service_of_the_scenario() -> None:
    sets = ["clusters.0.prefill=4096", "clusters.1.prefill=4096", "clusters.1.decode=4096"]
    rs = load("paper-prfaas", overrides_for("paper-prfaas", sets))
    with pytest.raises(UserError, match=r"cannot hold 12289 services on the local backend"):
        check_capacity("local", [rs])
    with pytest.raises(UserError, match=r"cannot hold 12290 services on the netns backend"):  # + delay line
        check_capacity("netns", [rs])
    check_capacity("local", [rs], force=True)
    check_capacity("inproc", [rs])  # one process: no service processes to count


def test_netns_refuses_more_hosts_than_a_datacenter_subnet_holds() -> None:
    """A hard limit, forced or not: before, 4,096 decode nodes on netns ended in a traceback
    from the topology builder after the run had begun."""

    def rs(decode: int) -> ResolvedScenario:
        return load("paper-prfaas", overrides_for("paper-prfaas", [f"clusters.1.decode={decode}"]))

    # the local cluster's 3 prefill nodes, the router and the client share the decode nodes' /24
    assert refusal("netns", rs(240)) is None
    why = refusal("netns", rs(241))
    assert why is not None and "'dc-local' would hold 246 hosts, and at most 245 fit" in why
    assert refusal("local", rs(4096)) is None


def test_cgroup_v2_headroom_and_the_tightest_ancestor(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    leaf = tmp_path / "a" / "b"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (tmp_path / "a" / "memory.max").write_text(f"{2 * GB}\n")
    (tmp_path / "a" / "memory.current").write_text(f"{GB // 2}\n")
    dirs = hc.cgroup_dirs("memory", "0::/a/b\n", tmp_path)
    assert dirs == [leaf, tmp_path / "a", tmp_path]
    assert hc.memory_headroom(leaf) is None
    room = hc.memory_headroom(tmp_path / "a")
    assert room is not None and room[0] == 2 * GB - GB // 2 and "memory.max 2048 MB" in room[1]


def test_cgroup_v1_headroom_leaves_out_reclaimable_cache(tmp_path: Path) -> None:
    d = tmp_path / "memory" / "job"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{2 * GB}\n")
    (d / "memory.usage_in_bytes").write_text(f"{GB}\n")
    (d / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {GB // 4}\n")
    assert hc.cgroup_dirs("memory", "4:memory:/job\n3:pids:/\n", tmp_path) == [d, tmp_path / "memory"]
    room = hc.memory_headroom(d)
    assert room is not None and room[0] == 2 * GB - (GB - GB // 4)
    (d / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert hc.memory_headroom(d) is None


def test_this_host_reads() -> None:
    h = hc.read_host()
    assert h.memory.value > 0 and h.cpus >= 1 and h.nofile > 0


def test_the_cli_refuses_with_exit_2_and_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "testbed",
            "replay",
            "--scenario",
            "paper-prfaas",
            "--set",
            "clusters.0.prefill=4096",
            "--set",
            "clusters.1.prefill=4096",
            "--set",
            "clusters.1.decode=4096",
            "--backend",
            "local",
            "--requests",
            "5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "12289 services" in lines[0] and "--force-capacity" in lines[0], r.stderr
    assert not out.exists() and pids_naming(str(out)) == []


def test_the_start_stops_when_memory_runs_short_as_services_grow() -> None:
    """The guard between spawns counts what the services just started will still take (a fresh
    process holds little of its 70 MB), not only what is taken now."""
    mb = hc.MB
    fresh = {1: 5 * mb, 2: 5 * mb, 3: hc.SERVICE_BYTES + 10 * mb}  # two just spawned, one grown
    growing = hc.still_to_grow([1, 2, 3, 4], fresh.get)  # 4: gone (counts as grown)
    assert growing == 2 * (hc.SERVICE_BYTES - 5 * mb)
    room = growing + 8 * hc.SERVICE_BYTES + hc.RESERVE_BYTES
    assert hc.start_shortfall(4, 100, hc.Limit(room, "MemAvailable"), growing, 8) is None
    why = hc.start_shortfall(4, 100, hc.Limit(room - 1, "MemAvailable"), growing, 8)
    assert why is not None and why.startswith("memory ran short while starting services: 4 of 100 started")
    assert "\n" not in why and f"{growing // mb} MB still to be taken" in why


def test_a_running_process_has_a_resident_size() -> None:
    import os

    assert (hc.resident_bytes(os.getpid()) or 0) > 1 << 20
    assert hc.resident_bytes(2**22 + 7) is None
