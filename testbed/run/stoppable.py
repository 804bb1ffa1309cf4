"""`asyncio.run` for a run that starts services: Ctrl-C is taken once.

asyncio's own SIGINT handler cancels the main task on the first Ctrl-C and raises
KeyboardInterrupt on the next one wherever the loop stands. A second Ctrl-C (or the SIGTERM the
CLI turns into one) that comes before the main task has reached its teardown, which is common on
a loaded machine where the cancellation takes a while to unwind, then escaped the loop, and a
third signal during the clean-up of the loop's remaining tasks left the run's containers,
networks and run.json ("running") behind. Here the first one cancels the main task and later
ones only say that the teardown is under way; SIGKILL still forces an exit."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

ALREADY_STOPPING = (
    b"stopping: the teardown is under way and runs to its end "
    b"(kill -9 forces an exit; `testbed down` then removes what is left)\n"
)


def default_in_forked_child(owner_pid: int, signum: int) -> bool:
    """In a child forked without exec (pyroute2's namespace helpers), which inherits its parent's
    handlers, give the signal its default meaning and say so; False in the owner itself."""
    if os.getpid() == owner_pid:
        return False
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return True


def run_stoppable(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end; Ctrl-C cancels it (once) and then raises KeyboardInterrupt here."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return asyncio.run(main)
    pid = os.getpid()
    stopping = False
    runner = asyncio.Runner()
    loop = runner.get_loop()
    task = loop.create_task(main)

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if default_in_forked_child(pid, signum):
            return
        if stopping:
            os.write(2, ALREADY_STOPPING)  # not print: a handler may interrupt a write to stderr
            return
        stopping = True
        if not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        return loop.run_until_complete(task)
    except asyncio.CancelledError:
        if stopping:
            raise KeyboardInterrupt from None
        raise
    finally:
        # Still ours while the runner closes and cancels what is left: a late signal must not
        # cut that short either.
        runner.close()
        signal.signal(signal.SIGINT, previous)
