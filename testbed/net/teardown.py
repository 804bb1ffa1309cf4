"""Idempotent teardown of everything a run created, found by namespace name prefix.

Every kernel object of a run lives inside a namespace named `{prefix}-...` (veths, bridges, TUNs
and qdiscs included), so removing those namespaces removes the run, once no process holds them:
processes running inside are stopped first (SIGTERM, up to 3 s, then SIGKILL).

A process counts as "inside" when its main thread's network namespace is one of ours; a process
that merely has a thread in one (the caller's own NetnsLoop, say) is left alone.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import asdict, dataclass

from pyroute2 import netns  # type: ignore[import-untyped]

from testbed.core.errors import UserError
from testbed.net.nsthread import NETNS_DIR

TERM_GRACE_S = 3.0


@dataclass(frozen=True)
class NsProcess:
    pid: int
    netns: str
    comm: str
    signal: str = ""  # the last signal teardown sent ("SIGTERM"/"SIGKILL"); "" when only listed


@dataclass(frozen=True)
class TeardownReport:
    prefix: str
    namespaces: tuple[str, ...]
    processes: tuple[NsProcess, ...]
    errors: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.namespaces and not self.processes

    def to_dict(self) -> dict[str, object]:
        return {
            "prefix": self.prefix,
            "namespaces": list(self.namespaces),
            "processes": [asdict(p) for p in self.processes],
            "errors": list(self.errors),
        }

    def summary(self) -> str:
        if self.empty and not self.errors:
            return f"nothing to remove for prefix {self.prefix!r}"
        lines = [
            f"removed {len(self.namespaces)} namespace(s), stopped {len(self.processes)} process(es) "
            f"for prefix {self.prefix!r}"
        ]
        lines += [f"  netns {n}" for n in self.namespaces]
        lines += [f"  pid {p.pid} ({p.comm}) in {p.netns}: {p.signal}" for p in self.processes]
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


class PrefixError(UserError, ValueError):
    """A prefix that is not a testbed one (`testbed down --prefix P`)."""


def _check_prefix(prefix: str) -> None:
    # A bare or foreign prefix could match namespaces this project never created.
    if not prefix.startswith("ptb"):
        raise PrefixError(
            f"--prefix {prefix!r}: must start with 'ptb' (every testbed name does; the default ptb removes every run's)"
        )


def namespaces(prefix: str = "ptb") -> list[str]:
    _check_prefix(prefix)
    return sorted(n for n in netns.listnetns() if n.startswith(prefix))


def _ns_inodes(names: list[str]) -> dict[tuple[int, int], str]:
    out: dict[tuple[int, int], str] = {}
    for n in names:
        try:
            st = os.stat(os.path.join(NETNS_DIR, n))
        except FileNotFoundError:
            continue  # removed meanwhile
        out[(st.st_dev, st.st_ino)] = n
    return out


def _proc_identity(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, start time) or None when gone; start time tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm is parenthesised and may contain spaces or ')': split at the last ')'.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    rest = stat[stat.rindex(")") + 2 :].split()
    return comm, rest[0], int(rest[19])


def _processes_in(names: list[str]) -> list[tuple[NsProcess, int]]:
    """Processes whose network namespace is one of `names`, with their start times."""
    inodes = _ns_inodes(names)
    me = os.getpid()
    found: list[tuple[NsProcess, int]] = []
    if not inodes:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            continue  # gone, a zombie, or a kernel thread
        ns = inodes.get((st.st_dev, st.st_ino))
        if ns is None:
            continue
        ident = _proc_identity(pid)
        if ident is not None and ident[1] != "Z":
            found.append((NsProcess(pid, ns, ident[0]), ident[2]))
    return found


def _alive(pid: int, start: int) -> bool:
    ident = _proc_identity(pid)
    return ident is not None and ident[1] != "Z" and ident[2] == start


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop(procs: list[tuple[NsProcess, int]]) -> list[NsProcess]:
    for p, _ in procs:
        _signal(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    left = procs
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [(p, s) for p, s in left if _alive(p.pid, s)]
    stubborn = {p.pid for p, s in left if _alive(p.pid, s)}
    for pid in stubborn:
        _signal(pid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously; give the kernel a moment so the namespaces empty.
    deadline = time.monotonic() + 1.0
    while any(_alive(p.pid, s) for p, s in left) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [NsProcess(p.pid, p.netns, p.comm, "SIGKILL" if p.pid in stubborn else "SIGTERM") for p, _ in procs]


def teardown(prefix: str = "ptb") -> TeardownReport:
    """Stop every process inside and delete every namespace whose name starts with `prefix`.
    A second call finds nothing and reports nothing."""
    return remove_namespaces(namespaces(prefix), label=prefix)


def remove_namespaces(names: list[str], label: str = "") -> TeardownReport:
    """Teardown of exactly these namespaces (missing ones are skipped)."""
    names = [n for n in names if os.path.lexists(os.path.join(NETNS_DIR, n))]
    stopped = _stop(_processes_in(names))
    # Processes started meanwhile (e.g. by a dying supervisor) get the same treatment once.
    seen = {p.pid for p in stopped}
    stopped += _stop([(p, s) for p, s in _processes_in(names) if p.pid not in seen])
    removed: list[str] = []
    errors: list[str] = []
    for n in names:
        try:
            netns.remove(n)
            removed.append(n)
        except FileNotFoundError:
            pass  # another teardown got there first
        except OSError as e:
            errors.append(f"netns {n}: {e.strerror or os.strerror(e.errno or errno.EIO)} (errno {e.errno})")
    return TeardownReport(label, tuple(removed), tuple(stopped), tuple(errors))


def leftovers(prefix: str = "ptb") -> list[str]:
    """What teardown would still find: namespaces and the processes inside them."""
    names = namespaces(prefix)
    return [f"netns {n}" for n in names] + [f"process {p.pid} ({p.comm}) in {p.netns}" for p, _ in _processes_in(names)]
