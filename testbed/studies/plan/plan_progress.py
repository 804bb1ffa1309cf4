"""What `testbed plan` is doing, on stderr: a long trace (a million rows) takes minutes to load,
measure and search, and a command silent that long looks hung. A step that goes on says so every
`HEARTBEAT_S` (the model's passes over the trace report nothing themselves), and the step in
progress names where a Ctrl-C or SIGTERM stopped the command."""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

HEARTBEAT_S = 30.0


class PlanProgress:
    def __init__(self, out: TextIO | None = None, quiet: bool = False, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.out = out if out is not None else sys.stderr
        self.quiet = quiet
        self.heartbeat_s = heartbeat_s
        self.t0 = time.monotonic()
        self.step = "starting"
        self._since = self.t0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._beat: threading.Thread | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(f"plan: [{self.elapsed():6.1f} s] {text}", file=self.out, flush=True)

    def __call__(self, step: str) -> None:
        """Start `step` (a phrase: "loading the trace"), printed with the time so far."""
        with self._lock:
            self.step, self._since = step, time.monotonic()
            self._say(step)

    def _heartbeat(self) -> None:
        while not self._done.wait(self.heartbeat_s / 3):
            with self._lock:
                if time.monotonic() - self._since >= self.heartbeat_s:
                    self._since = time.monotonic()
                    self._say(f"still {self.step}")

    def __enter__(self) -> PlanProgress:
        if not self.quiet and self.heartbeat_s > 0:
            self._beat = threading.Thread(target=self._heartbeat, name="plan-progress", daemon=True)
            self._beat.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        if self._beat is not None:
            self._beat.join()

    def interrupted(self) -> str:
        return (
            f"plan: interrupted while {self.step}, after {self.elapsed():.1f} s; plan.md and plan.json were not written"
        )
