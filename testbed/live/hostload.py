"""The host's CPU load while a run goes on, from /proc/stat: when every core is busy, timers
fire late and the emulator's timing suffers, whatever the scenario asks."""

from __future__ import annotations

import asyncio
from pathlib import Path

from testbed.metrics.series_format import Sample, SeriesWriter

PROC_STAT = Path("/proc/stat")


def cpu_times(text: str) -> tuple[int, int] | None:
    """(busy, total) jiffies of the aggregate `cpu` line; None if the text has none."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            vals = [int(x) for x in parts[1:]]
            idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
            return sum(vals) - idle, sum(vals)
    return None


def busy_share(prev: tuple[int, int], cur: tuple[int, int]) -> float | None:
    dt = cur[1] - prev[1]
    return None if dt <= 0 else (cur[0] - prev[0]) / dt


async def sample_host(writer: SeriesWriter, interval_s: float = 0.5, stat: Path = PROC_STAT) -> None:
    """Write `cpu_busy` (share of all cores, 0-1) every `interval_s` until cancelled."""
    try:
        prev = cpu_times(stat.read_text())
    except OSError:
        return  # no /proc here: nothing to say about the host
    while prev is not None:
        await asyncio.sleep(interval_s)
        cur = cpu_times(stat.read_text())
        if cur is None:
            return
        share = busy_share(prev, cur)
        if share is not None:
            writer.write([Sample("cpu_busy", share, {})])
        prev = cur
