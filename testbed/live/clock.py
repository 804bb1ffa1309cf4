"""Timing helpers for the live drivers: absolute deadlines, so lateness never accumulates."""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    """Wall-clock seconds: shared by every process, namespace and container on a host."""
    return time.time()


async def sleep_until(deadline: float) -> None:
    """Sleep until wall-clock `deadline`. asyncio timers are monotonic; convert once per call."""
    delay = deadline - time.time()
    # Yield even when late, so transport writers sharing the loop are never starved.
    await asyncio.sleep(max(delay, 0.0))
