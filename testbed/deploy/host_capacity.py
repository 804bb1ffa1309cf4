"""Whether this host can hold a deployment, checked before a run writes or starts anything:
services times what each one measurably needs against the memory, CPUs, process slots and
open files this host grants. A deployment that does not fit is refused in one line giving the
figures and the flag that forces it (`--force-capacity`); thousands of services started anyway
once took the host's memory, got the CLI itself OOM-killed and left its services behind.

The per-service figures are constants measured on this project's services (below), not
guesses; `read_host()` is the only I/O here, `shortfalls()` the arithmetic, testable alone."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from testbed.core.errors import UserError
from testbed.deploy.base import BackendError

FORCE_FLAG = "--force-capacity"
MB = 1 << 20

# Memory of one service (`testbed serve`, node or router: the same interpreter and imports).
# Measured from /proc/PID/smaps_rollup of a paper-prfaas run on the local backend: a node right
# after /health answers, alone on the host, 66 MB PSS / 68 MB RSS; during a 200-request replay
# at 8 req/s, nodes 66-68 MB RSS (45 MB PSS beside their siblings) and the router up to 78 MB
# RSS. RSS is what a service needs once the pages it shares are not shared (a lone run, another
# interpreter build): 80 MB is that maximum with a margin.
SERVICE_BYTES = 80 * MB
# What the CLI itself (replayer, records, teardown) and the rest of the host keep.
RESERVE_BYTES = 512 * MB
# CPU time a service takes to start (its interpreter's imports and app set-up, up to /health):
# 0.54-0.55 s measured from /proc/PID/stat (utime + stime) of a node and of the router on an
# idle host; 0.6 s with a margin. Services start together and must all answer /health within
# the backend's health timeout, so N services on C CPUs need N x 0.6 / C seconds of it.
STARTUP_CPU_S = 0.6
# Kernel tasks (threads) of one service: 3 measured (main loop, aiohttp's resolver and signal
# threads) during a replay; the pids controller and RLIMIT_NPROC count threads.
TASKS_PER_SERVICE = 4
# How long a backend waits for every service it started to answer /health: the start-up time
# the CPU check above budgets against. Processes (local, netns); containers (compose), whose
# start includes the engine's.
PROCESS_HEALTH_TIMEOUT_S = 60.0
CONTAINER_HEALTH_TIMEOUT_S = 300.0
# Files a service holds besides its connections: its log, the interpreter's, the listeners.
BASE_FDS = 64


@dataclass(frozen=True)
class Need:
    services: int
    startup_budget_s: float  # the backend's health timeout: every service must start within it
    fds_per_service: int  # the most descriptors one service may hold (the busiest service)
    backend: str


@dataclass(frozen=True)
class Limit:
    value: int
    source: str  # what grants it, as the refusal names it


@dataclass(frozen=True)
class Host:
    memory: Limit  # bytes this host can still give (MemAvailable or a cgroup's headroom)
    cpus: int  # CPUs this process may run on (sched_getaffinity)
    tasks: Limit | None  # task slots left (RLIMIT_NPROC, pids.max); None: no limit applies
    nofile: int  # RLIMIT_NOFILE soft limit, inherited by every service


def need_of(services: int, decode: int, prefill: int, connections: int, startup_budget_s: float, backend: str) -> Need:
    """A deployment of `services` processes: a prefill node keeps `connections` KV sockets to
    each decode node (a decode node as many from each prefill node); the router one to each."""
    busiest = max(decode * connections, prefill * connections, services)
    return Need(services, startup_budget_s, BASE_FDS + busiest, backend)


def shortfalls(need: Need, host: Host) -> list[str]:
    """What does not fit, one clause each (empty: it fits)."""
    out: list[str] = []
    n = need.services
    mem = n * SERVICE_BYTES + RESERVE_BYTES
    if mem > host.memory.value:
        fit = max(0, (host.memory.value - RESERVE_BYTES) // SERVICE_BYTES)
        out.append(
            f"memory: {n} services x {SERVICE_BYTES // MB} MB + {RESERVE_BYTES // MB} MB reserve = "
            f"{mem // MB} MB needed, {host.memory.value // MB} MB available ({host.memory.source}); "
            f"{fit} services fit"
        )
    cpu_s = n * STARTUP_CPU_S / max(1, host.cpus)
    if cpu_s > need.startup_budget_s:
        fit = int(need.startup_budget_s * max(1, host.cpus) / STARTUP_CPU_S)
        out.append(
            f"CPUs: {n} services x {STARTUP_CPU_S:g} CPU-s to start over {host.cpus} CPU(s) = {cpu_s:.0f} s, "
            f"past the {need.startup_budget_s:g} s the {need.backend} backend waits for them to answer; "
            f"{fit} services fit"
        )
    if host.tasks is not None and n * TASKS_PER_SERVICE > host.tasks.value:
        out.append(
            f"processes: {n} services x {TASKS_PER_SERVICE} tasks = {n * TASKS_PER_SERVICE} needed, "
            f"{host.tasks.value} left under {host.tasks.source}"
        )
    if need.fds_per_service > host.nofile:
        out.append(
            f"open files: the busiest service may hold {need.fds_per_service} descriptors, "
            f"RLIMIT_NOFILE is {host.nofile} (raise it with `ulimit -n`)"
        )
    return out


def refusal(need: Need, host: Host) -> str | None:
    """The one line that refuses `need` on `host`, or None when it fits."""
    short = shortfalls(need, host)
    if not short:
        return None
    return (
        f"this host cannot hold {need.services} services on the {need.backend} backend: "
        + "; ".join(short)
        + f"; nothing was started (reduce the instance counts, or give {FORCE_FLAG} to start them anyway)"
    )


# -- reading the host ----------------------------------------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_int(p: Path) -> int | None:
    try:
        text = p.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_dirs(controller: str, membership: str | None = None, root: Path = CGROUP_ROOT) -> list[Path]:
    """This process's cgroup directory for `controller` and its ancestors up to the mount (a
    limit may sit on any of them): v1's hierarchy of that controller where there is one, else
    v2's unified one. `membership`: /proc/self/cgroup's text."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            return []
    found: dict[str, Path] = {}
    for line in membership.splitlines():
        num, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if controller in ctrls.split(","):
            found["v1"] = root / controller / path.lstrip("/")
        elif num == "0" and ctrls == "" and (root / "cgroup.controllers").exists():
            found["v2"] = root / path.lstrip("/")
    start = found.get("v1") or found.get("v2")
    if start is None:
        return []
    base = root / controller if "v1" in found else root
    out = []
    d = start
    while True:
        out.append(d)
        if d == base or base not in d.parents:
            return out
        d = d.parent


def memory_headroom(d: Path) -> tuple[int, str] | None:
    """Limit minus usage of one cgroup (v2 memory.max/current; v1 limit/usage less reclaimable
    page cache), or None without a limit there."""
    limit = _read_int(d / "memory.max")
    if limit is not None:
        used = _read_int(d / "memory.current") or 0
        return limit - used, f"cgroup {d}: memory.max {limit // MB} MB, memory.current {used // MB} MB"
    limit = _read_int(d / "memory.limit_in_bytes")
    if limit is None or limit >= 1 << 60:  # v1 says "no limit" with a huge number
        return None
    used = _read_int(d / "memory.usage_in_bytes") or 0
    try:
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        used -= int(stat.get("total_inactive_file", stat.get("inactive_file", "0")))
    except (OSError, ValueError):
        pass
    return limit - used, f"cgroup {d}: memory.limit_in_bytes {limit // MB} MB, in use {used // MB} MB"


def _memory() -> Limit:
    avail = _meminfo("MemAvailable")
    best = Limit(avail if avail is not None else 1 << 62, "MemAvailable")
    for d in cgroup_dirs("memory"):
        h = memory_headroom(d)
        if h is not None and h[0] < best.value:
            best = Limit(max(0, h[0]), h[1])
    return best


def _user_tasks(uid: int) -> int:
    """Tasks (threads) of processes whose real uid is `uid`: what RLIMIT_NPROC counts."""
    n = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in (p / "status").read_text().splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            pass
    return n


def _tasks() -> Limit | None:
    best: Limit | None = None
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    # Not enforced for root (CAP_SYS_RESOURCE, CAP_SYS_ADMIN).
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
        used = _user_tasks(os.getuid())
        best = Limit(soft - used, f"RLIMIT_NPROC {soft} ({used} in use by this user)")
    for d in cgroup_dirs("pids"):
        limit = _read_int(d / "pids.max")
        if limit is None:
            continue
        used = _read_int(d / "pids.current") or 0
        if best is None or limit - used < best.value:
            best = Limit(limit - used, f"cgroup {d}: pids.max {limit} ({used} in use)")
    return best


def read_host() -> Host:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = soft if soft != resource.RLIM_INFINITY else 1 << 30
    return Host(_memory(), len(os.sched_getaffinity(0)), _tasks(), nofile)


def check(need: Need, force: bool = False, host: Host | None = None) -> None:
    """UserError with the figures unless `need` fits this host (or `force`)."""
    if force:
        return
    why = refusal(need, host or read_host())
    if why is not None:
        raise UserError(why)


# -- while services start ------------------------------------------------------------------

# How often the start-up looks at the memory again (every this many services): each look reads
# every started service's resident size, so looking at every spawn would cost N^2 /proc reads.
GUARD_EVERY = 8


def resident_bytes(pid: int) -> int | None:
    """Resident set of a running process (/proc/PID/statm), or None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def still_to_grow(pids: list[int], read: Callable[[int], int | None] = resident_bytes) -> int:
    """Memory the started services will still take: each one up to SERVICE_BYTES from what it
    holds now (a service just spawned holds little, and takes its 70 MB within a second)."""
    return sum(max(0, SERVICE_BYTES - (read(p) or SERVICE_BYTES)) for p in pids)


def start_shortfall(started: int, total: int, available: Limit, growing: int, next_batch: int) -> str | None:
    """Why the start-up must stop before the next `next_batch` services (None: it may go on): what
    is available now, less what the started ones will still take and the next ones need, must
    leave the reserve. Checked even with --force-capacity: this is the host's memory as it is,
    not an estimate, and past it the kernel kills a service or the runner itself."""
    need = growing + next_batch * SERVICE_BYTES + RESERVE_BYTES
    if need <= available.value:
        return None
    return (
        f"memory ran short while starting services: {started} of {total} started, {available.value // MB} MB "
        f"available ({available.source}), {growing // MB} MB still to be taken by those starting, "
        f"{next_batch} more x {SERVICE_BYTES // MB} MB and {RESERVE_BYTES // MB} MB reserve needed; "
        "the services started were stopped"
    )


class StartGuard:
    """Looked at before each service a backend spawns; BackendError when memory runs short."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.pids: list[int] = []

    def before(self) -> None:
        n = len(self.pids)
        if n % GUARD_EVERY:
            return
        why = start_shortfall(n, self.total, _memory(), still_to_grow(self.pids), min(GUARD_EVERY, self.total - n))
        if why is not None:
            raise BackendError(why)

    def started(self, pid: int) -> None:
        self.pids.append(pid)
