"""`run_stoppable`: the first Ctrl-C cancels the run's main task; later ones, even before the
cancellation has reached the teardown, cannot cut that teardown short."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from testbed.run.stoppable import run_stoppable

pytestmark = pytest.mark.pure


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_later_ctrl_cs_wait_for_the_teardown(capfd: pytest.CaptureFixture[str]) -> None:
    steps: list[str] = []

    async def run() -> None:
        try:
            _ctrl_c()
            await asyncio.sleep(30)
            steps.append("not stopped")
        finally:
            # Still unwinding the cancellation: asyncio's own handler raised KeyboardInterrupt
            # out of the loop at the next one and this teardown never ran.
            _ctrl_c()
            await asyncio.sleep(0)
            _ctrl_c()
            await asyncio.sleep(0.01)
            steps.append("torn down")

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        run_stoppable(run())
    assert steps == ["torn down"]
    assert signal.getsignal(signal.SIGINT) is before
    assert capfd.readouterr().err.count("stopping: the teardown is under way") == 2


def test_a_run_left_alone_returns_its_result() -> None:
    async def run() -> int:
        await asyncio.sleep(0)
        return 7

    assert run_stoppable(run()) == 7


def test_a_cancellation_swallowed_by_the_run_is_its_result() -> None:
    async def run() -> str:
        try:
            _ctrl_c()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "stopped early, and said so"
        return "ran"

    assert run_stoppable(run()) == "stopped early, and said so"
