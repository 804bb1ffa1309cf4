"""What the runner needs from a deploy backend: start services, say how links are shaped,
run the client where the router is reachable, and stop everything it started."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from testbed.core.errors import UserError

if TYPE_CHECKING:
    # Types only: the registry imports this module, and a simulated run needs neither the live
    # deployment nor asyncio (a tenth of its fixed start-up cost).
    from testbed.live.deployment import Deployment

T = TypeVar("T")


class BackendError(UserError, RuntimeError):
    """A backend could not start or reach what it runs; the message names the service and why.
    The cause is the environment (no docker compose, no swarm, a service that would not start),
    so the CLI prints the message and exits 2 instead of showing a traceback."""


class Backend(Protocol):
    name: str
    deployment: Deployment

    def shaping(self) -> dict[str, object]:
        """Facts for run.json: method and parameters of every shaped link."""
        ...

    async def start(self) -> None:
        """Bring every service up and healthy; on failure, undo what was done and raise."""
        ...

    async def on_t0(self, t0: float) -> None:
        """The replay clock starts at t0 (unix seconds): start clock-relative tasks."""
        ...

    async def run_client(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run a client coroutine where the router's address is reachable."""
        ...

    async def host_url(self) -> str:
        """After start: the router's base URL as a client on this host reaches it, on the port the
        backend was given (`host_port`; 0: one it picked), opening the way there if needed."""
        ...

    async def stop(self) -> None:
        """Stop everything this backend started. Idempotent."""
        ...


async def every_step(*steps: Callable[[], object]) -> None:
    """Run each teardown step even when an earlier one raised (a full disk fails the steps that
    write, and the ones after them must still stop services and remove the network); then raise
    the first error. A step may return an awaitable, which is awaited."""
    import inspect

    first: Exception | None = None
    for step in steps:
        try:
            r = step()
            if inspect.isawaitable(r):
                await r
        except Exception as e:  # noqa: BLE001 - kept, raised after the other steps
            first = first or e
    if first is not None:
        raise first


async def in_thread_halting(fn: Callable[[], T], halt: threading.Event) -> T:
    """`fn()` in a worker thread, which checks `halt` between its steps. Cancelled (Ctrl-C,
    SIGTERM during a start-up), set `halt` and wait for the thread to return before raising: a
    thread left running would go on creating namespaces, processes or containers after the
    teardown had looked for them."""
    import asyncio

    work = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        halt.set()
        await asyncio.gather(work, return_exceptions=True)
        raise
