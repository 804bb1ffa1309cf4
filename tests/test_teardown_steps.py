"""A backend's teardown runs every step even when one raised: a full disk fails the steps that
write (closing a series file flushes it), and the steps after them stop the services and
remove the network. The first error is raised once all have run."""

from __future__ import annotations

import asyncio

import pytest

from testbed.deploy.base import every_step

pytestmark = pytest.mark.pure


async def test_every_step_runs_after_a_failure_and_the_first_error_is_raised() -> None:
    ran: list[str] = []

    def close_series() -> None:
        ran.append("series")
        raise OSError(28, "No space left on device")

    async def stop_services() -> None:
        await asyncio.sleep(0)
        ran.append("services")

    def teardown_network() -> None:
        ran.append("network")
        raise RuntimeError("second")

    with pytest.raises(OSError, match="No space left"):
        await every_step(
            close_series, stop_services, lambda: asyncio.sleep(0), teardown_network, lambda: ran.append("last")
        )
    assert ran == ["series", "services", "network", "last"]


async def test_no_error_no_raise() -> None:
    ran: list[int] = []
    await every_step(lambda: ran.append(1), lambda: None)
    assert ran == [1]
