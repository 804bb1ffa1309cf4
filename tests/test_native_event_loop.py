"""The compiled event loop (`testbed_native.EventLoop`) against the Python one it twins
(`testbed.sim.events.EventLoop`): the same events in the same order at the same times, events
scheduled from events and into the past included, a bounded run, a failing callback.

Skipped where the extension is not built, unless TESTBED_REQUIRE_NATIVE=1 (as CI sets)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_ext import required

from testbed.sim.events import EventLoop, new_loop

ext = required()

TIMES = st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.0, 2.5, -1.0, math.inf, 1e-300, 7.25])
EVENTS = st.lists(
    st.tuples(TIMES, st.integers(0, 8), st.lists(st.tuples(TIMES, st.integers(0, 8)), max_size=3)), max_size=40
)


def _drive(loop: Any, events: list[tuple[float, int, list[tuple[float, int]]]], until: float) -> list[Any]:
    """Schedule `events`; each, when it runs, logs itself and the loop's time and schedules its
    children (relative to now). Runs to `until`, then to the end."""
    log: list[Any] = []

    def fire(arg: tuple[str, list[tuple[float, int]]]) -> None:
        name, kids = arg
        log.append((name, loop.now.hex(), loop.pending))
        for j, (dt, prio) in enumerate(kids):
            loop.at(loop.now + dt, prio, fire, (f"{name}.{j}", []))

    for i, (t, prio, kids) in enumerate(events):
        loop.at(t, prio, fire, (f"e{i}", kids))
    loop.run(until)
    log.append(("paused", loop.now.hex(), loop.pending, loop.processed))
    loop.run()
    log.append(("end", loop.now.hex(), loop.pending, loop.processed))
    return log


@pytest.mark.pure
@settings(max_examples=300, deadline=None)
@given(events=EVENTS, until=st.sampled_from([-1.0, 0.0, 1.0, 3.0, math.inf]))
def test_both_loops_run_the_same_events_in_the_same_order(events: list[Any], until: float) -> None:
    """Ties in time broken by priority, then by the order of scheduling; an event for the past
    runs now; a bounded run stops before the first later event and resumes from it."""
    assert _drive(ext.EventLoop(), events, until) == _drive(EventLoop(), events, until)


@pytest.mark.pure
def test_a_failing_callback_leaves_the_rest_scheduled_alike() -> None:
    def boom(_: Any) -> None:
        raise KeyError("x")

    got = []
    for loop in (ext.EventLoop(), EventLoop()):
        seen: list[Any] = []
        loop.at(1.0, 0, seen.append, "a")
        loop.at(2.0, 0, boom)
        loop.at(3.0, 0, seen.append, "c")
        with pytest.raises(KeyError):
            loop.run()
        got.append((seen, loop.now, loop.pending, loop.processed))
        loop.run()
        got.append((seen, loop.now, loop.pending, loop.processed))
    assert got[:2] == got[2:]


@pytest.mark.pure
def test_the_compiled_loop_refuses_a_nan_time() -> None:
    with pytest.raises(ValueError, match="NaN"):
        ext.EventLoop().at(math.nan, 0, print)
    assert type(new_loop()).__module__ == "testbed_native"
