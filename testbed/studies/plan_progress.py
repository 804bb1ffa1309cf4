"""What `testbed plan` is doing, on stderr: a long trace (a million rows) takes minutes to load,
measure and search, and a command silent that long looks hung. The step in progress also names
where a Ctrl-C or SIGTERM stopped it."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class PlanProgress:
    def __init__(self, out: TextIO | None = None, quiet: bool = False) -> None:
        self.out = out if out is not None else sys.stderr
        self.quiet = quiet
        self.t0 = time.monotonic()
        self.step = "starting"

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, step: str) -> None:
        """Start `step` (a phrase: "loading the trace"), printed with the time so far."""
        self.step = step
        if not self.quiet:
            print(f"plan: [{self.elapsed():6.1f} s] {step}", file=self.out, flush=True)

    def interrupted(self) -> str:
        return (f"plan: interrupted while {self.step}, after {self.elapsed():.1f} s; "
                "plan.md and plan.json were not written")
