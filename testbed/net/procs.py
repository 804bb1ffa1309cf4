"""Processes the testbed starts: services with a log file each (stopped in order), helper
children, and scripts whose output is streamed. The only module that spawns processes."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Where a ProcessGroup that outlives its owner can be found again: one file per group, naming
# the owner and every service (pid and start time, so a reused pid is never taken for one).
# Written as services start and removed when they are stopped; a file whose owner is gone is
# what `testbed down` clears (`sweep_orphans`).
JOURNAL_DIR = Path(tempfile.gettempdir()) / f"prfaas-testbed-{os.getuid()}" / "procs"


def log_tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ProcessGroup:
    """Each service in a session of its own: Ctrl-C reaches only the runner, which stops
    services in order (router first, so no new work starts) and SIGKILLs stragglers."""

    def __init__(self, log_dir: Path, journal: Path | None = None) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.journal = journal  # None: not findable after a kill -9 of this process
        # Added to every service's environment (a deployment's credentials: not on the command line)
        self.env: dict[str, str] = {}
        # Start times by pid, read once: the journal is rewritten at every spawn, and reading
        # every service's again each time made starting N services cost N^2 /proc reads.
        self._starts: dict[int, int | None] = {}

    def _start_of(self, pid: int) -> int | None:
        if pid not in self._starts:
            self._starts[pid] = start_time(pid)
        return self._starts[pid]

    def _write_journal(self) -> None:
        if self.journal is None:
            return
        me = os.getpid()
        entry = {
            "owner": {"pid": me, "start": start_time(me)},
            "log_dir": str(self.log_dir),
            "procs": {k: {"pid": p.pid, "start": self._start_of(p.pid)} for k, p in self.procs.items()},
        }
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.journal.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        tmp.replace(self.journal)

    def spawn(self, key: str, argv: list[str], append_log: bool = False) -> None:
        """Start `key` (again, after it died, with `append_log`: its earlier log stays)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{key}.log").open("ab" if append_log else "wb") as fh:
            self.procs[key] = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"},
            )
        self._write_journal()

    def log(self, key: str) -> str:
        return log_tail(self.log_dir / f"{key}.log")

    def send_signal(self, key: str, sig: int) -> int:
        """Signal service `key` (its whole session); returns its pid."""
        p = self.procs[key]
        _signal(p, sig)
        return p.pid

    def dead(self) -> tuple[str, int] | None:
        """The first service that has exited, with its code."""
        for key, p in self.procs.items():
            rc = p.poll()
            if rc is not None:
                return key, rc
        return None

    def stop(self, first: tuple[str, ...] = ("router",), last: tuple[str, ...] = (), grace: float = 5.0) -> None:
        middle = [k for k in self.procs if k not in first and k not in last]
        order = [k for k in first if k in self.procs] + middle + [k for k in last if k in self.procs]
        for key in order:
            _signal(self.procs[key], signal.SIGTERM)
        for key in order:
            p = self.procs[key]
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.wait()
        self.procs.clear()
        self._starts.clear()
        if self.journal is not None:
            self.journal.unlink(missing_ok=True)


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None when
    it is gone: with the pid it names one process, never a later one given the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its closing one.
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _alive(entry: object) -> int | None:
    """The pid of a journal entry `{"pid", "start"}` if that very process still runs."""
    if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int):
        return None
    pid: int = entry["pid"]
    started = start_time(pid)
    return pid if started is not None and started == entry.get("start") else None


@dataclass
class Orphans:
    """What `sweep_orphans` stopped: service keys with their pids, per group file; and the groups
    it left to their live owners."""

    stopped: dict[str, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    spared: dict[str, str] = field(default_factory=dict)  # group -> its owner ("pid N")


def sweep_orphans(
    journal_dir: Path = JOURNAL_DIR, name: str | None = None, grace: float = 5.0, force: Collection[str] = ()
) -> Orphans:
    """Stop the services of every group (the one called `name`, when given) whose owner is gone
    (SIGTERM to each session, SIGKILL after `grace`), then forget the group. A live owner's group
    is left alone (it stops its own) unless `force` names it."""
    out = Orphans()
    files = sorted(journal_dir.glob("*.json")) if name is None else [journal_dir / f"{name}.json"]
    for f in (f for f in files if f.is_file()):
        try:
            entry = json.loads(f.read_text())
            procs = entry["procs"]
            owner = entry["owner"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            out.errors.append(f"{f}: unreadable ({e}); left in place")
            continue
        if (pid := _alive(owner)) is not None and f.stem not in force:
            out.spared[f.stem] = f"runner pid {pid}, logs in {entry.get('log_dir', '?')}"
            continue
        live = {k: pid for k, e in procs.items() if (pid := _alive(e)) is not None}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in live.values():
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
                except PermissionError as e:
                    out.errors.append(f"{f.name}: pid {pid}: {e}")
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(start_time(p) is not None for p in live.values()):
                time.sleep(0.05)
            live = {k: p for k, p in live.items() if start_time(p) is not None}
            if not live:
                break
        out.stopped[f.stem] = [f"{k} (pid {e['pid']})" for k, e in procs.items() if isinstance(e, dict)]
        f.unlink(missing_ok=True)
    return out


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


Child = subprocess.Popen[bytes]


def start_child(argv: Sequence[str]) -> Child:
    """A helper process sharing this one's output (the delay line beside a container's agent)."""
    return subprocess.Popen(list(argv))


def run_streamed(
    argv: Sequence[str],
    cwd: Path,
    on_line: Callable[[str], None],
    env: dict[str, str] | None = None,
    tail_lines: int = 20,
) -> tuple[int, list[str]]:
    """Run a script to the end, passing each output line to `on_line`; (exit code, last lines).
    OSError if it cannot start; killed if this process is interrupted meanwhile."""
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        env={**os.environ, **(env or {})},
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return rc, list(tail)


async def start_reporting_child(argv: Sequence[str], stderr: Path) -> asyncio.subprocess.Process:
    """A helper process (its own session) whose stdout the caller reads line by line as it goes
    (the TCP reset injector reports each connection it touched); stderr to a log file."""
    stderr.parent.mkdir(parents=True, exist_ok=True)
    with stderr.open("wb") as err:
        return await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=err, start_new_session=True
        )
