"""Processes the testbed starts: services with a log file each (stopped in order), helper
children, and scripts whose output is streamed. The only module that spawns processes."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
from pathlib import Path
from typing import Callable, Sequence


def log_tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ProcessGroup:
    """Each service in a session of its own: Ctrl-C reaches only the runner, which stops
    services in order (router first, so no new work starts) and SIGKILLs stragglers."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, key: str, argv: list[str], append_log: bool = False) -> None:
        """Start `key` (again, after it died, with `append_log`: its earlier log stays)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{key}.log").open("ab" if append_log else "wb") as fh:
            self.procs[key] = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, "PYTHONUNBUFFERED": "1"})

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


def run_streamed(argv: Sequence[str], cwd: Path, on_line: Callable[[str], None],
                 env: dict[str, str] | None = None, tail_lines: int = 20) -> tuple[int, list[str]]:
    """Run a script to the end, passing each output line to `on_line`; (exit code, last lines).
    OSError if it cannot start; killed if this process is interrupted meanwhile."""
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    proc = subprocess.Popen(list(argv), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1,
                            env={**os.environ, **(env or {})})
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


async def start_reporting_child(argv: Sequence[str], stderr: Path) -> "asyncio.subprocess.Process":
    """A helper process (its own session) whose stdout the caller reads line by line as it goes
    (the TCP reset injector reports each connection it touched); stderr to a log file."""
    stderr.parent.mkdir(parents=True, exist_ok=True)
    with stderr.open("wb") as err:
        return await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=err,
                                                    start_new_session=True)
