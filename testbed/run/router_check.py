"""Whether a live run's router outlived its replay.

A router that dies mid-run (OOM-killed, SIGKILLed) leaves the replayer to fail every later
request as refused: without this check the run ended "finished" with exit 0 and 0/N completed,
naming nothing. The check asks the router's /health once the replay ends, and a backend that
runs the router as a process of its own (`exit_code`) adds how it ended.
"""

from __future__ import annotations

import signal

from testbed.core.errors import UserError

PROBE_TIMEOUT_S = 3.0
PROBES = 3


class RouterLost(UserError, RuntimeError):
    """The router stopped answering during a live run; the run is recorded as failed (exit 1, as
    any failed run: not a usage error)."""

    exit_status = 1


def _ended(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


async def _answers(url: str) -> bool:
    import asyncio  # here: the runner imports this module, and a simulated run needs no asyncio

    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as s:
        for i in range(PROBES):
            try:
                async with s.get(f"{url}/health") as r:
                    if r.status < 500:
                        return True
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.2 * (i + 1))
    return False


async def router_lost(url: str, exit_code: int | None) -> str | None:
    """None when the router at `url` answers; else a sentence saying it is gone and, with its
    process's `exit_code` (None: unknown or still running), how it ended."""
    if exit_code is None and await _answers(url):
        return None
    return f"the router {_ended(exit_code)} during the run; the requests after that failed"
