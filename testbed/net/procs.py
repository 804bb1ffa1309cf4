"""Service processes of a backend: spawn with a log file, stop in order, show a log's tail."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


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
