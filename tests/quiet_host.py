"""A pause before a live run is tried again after the testbed marked it invalid: while the host's
other work (in CI the netns tier and the image build run beside the app tier) keeps every core
busy, an immediate rerun meets the same load and is invalid again."""

from __future__ import annotations

import time

from testbed.live.hostload import PROC_STAT, busy_share, cpu_times

BUSY_BELOW = 0.6  # share of all cores busy under which a rerun is tried
WINDOW_S = 1.0


def wait_for_quiet_host(max_s: float = 60.0, windows: int = 1) -> float | None:
    """Sample /proc/stat every `WINDOW_S` until the share of all cores busy stays below
    `BUSY_BELOW` for `windows` windows in a row, for at most `max_s`; the last share (None where
    /proc/stat says nothing)."""
    end = time.monotonic() + max_s
    share: float | None = None
    quiet = 0
    prev = cpu_times(PROC_STAT.read_text())
    while prev is not None and time.monotonic() < end:
        time.sleep(WINDOW_S)
        cur = cpu_times(PROC_STAT.read_text())
        if cur is None:
            return None
        share = busy_share(prev, cur)
        quiet = quiet + 1 if share is not None and share < BUSY_BELOW else 0
        if quiet >= windows:
            break
        prev = cur
    return share
