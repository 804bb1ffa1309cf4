"""A start-up that runs in a worker thread (netns's network, compose's `up`) stops at its halt
flag when cancelled, and the cancellation returns only once the thread has: the teardown after
it must not race a thread still creating what it removes."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
from procinfo import pids_naming

from testbed.deploy.base import BackendError, in_thread_halting
from testbed.deploy.dockercli import run

pytestmark = pytest.mark.pure


def test_a_cancelled_start_waits_for_its_thread_to_stop() -> None:
    halt = threading.Event()
    steps: list[int] = []
    done = threading.Event()

    def build() -> None:
        try:
            for i in range(10_000):
                if halt.is_set():
                    return
                steps.append(i)
                time.sleep(0.01)
        finally:
            done.set()

    async def main() -> None:
        task = asyncio.ensure_future(in_thread_halting(build, halt))
        while len(steps) < 5:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done.is_set(), "the cancellation returned while the thread still ran"

    asyncio.run(main())
    n = len(steps)
    time.sleep(0.1)
    assert len(steps) == n < 10_000


def test_a_finished_thread_returns_its_value() -> None:
    assert asyncio.run(in_thread_halting(lambda: 42, threading.Event())) == 42


def test_a_halted_command_is_stopped_at_once() -> None:
    halt = threading.Event()
    marker = "import time; time.sleep(60)  # halted-command-marker"
    threading.Timer(0.3, halt.set).start()
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="stopped"):
        run([sys.executable, "-c", marker], timeout=120, halt=halt)
    assert time.monotonic() - t0 < 30
    assert pids_naming("halted-command-marker") == []


def test_an_unhalted_command_runs_as_before() -> None:
    r = run([sys.executable, "-c", "print('ok')"], halt=threading.Event())
    assert r.returncode == 0 and r.stdout.strip() == "ok"
    with pytest.raises(BackendError, match="failed"):
        run([sys.executable, "-c", "raise SystemExit(3)"], halt=threading.Event())
