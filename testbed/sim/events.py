"""The simulator's event loop: one heap of `(t, priority, seq)` entries in virtual (paper) time.

`seq` is a counter, so events at the same time and priority run in the order they were
scheduled and a run is deterministic. Priorities order simultaneous events of different kinds
(a link change before the transfers it affects, a finishing decode step before a fault or an
arrival that could use the freed slot). An event is a callback and one argument; cancelling is left to
the owner (a version number in the argument, checked by the callback), which keeps the heap
free of handles.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any, Protocol

from testbed.core import native

# Priorities of simultaneous events (lower first).
LINK_CHANGE = 0
NET = 1
PREFILL = 2
KV_ARRIVAL = 3
DECODE = 4
FAULT = 5
ARRIVAL = 6
CONTROL = 7
SAMPLE = 8

Callback = Callable[[Any], None]
_push = heapq.heappush


class EventLoop:
    __slots__ = ("now", "_heap", "_seq", "processed")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callback, Any]] = []
        self._seq = 0
        self.processed = 0

    def at(self, t: float, priority: int, fn: Callback, arg: Any = None) -> None:
        """Run `fn(arg)` at virtual time `t` (never before now)."""
        if t < self.now:
            t = self.now
        self._seq += 1
        _push(self._heap, (t, priority, self._seq, fn, arg))

    def run(self, until: float = math.inf) -> None:
        """Run events in order until none is left (or the next is after `until`)."""
        heap = self._heap
        pop = heapq.heappop
        n = 0
        while heap:
            if heap[0][0] > until:
                break
            t, _, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            n += 1
        self.processed += n

    @property
    def pending(self) -> int:
        return len(self._heap)


class Loop(Protocol):
    """The event loop as the simulator's parts see it: `EventLoop`, or its compiled twin
    (`testbed_native.EventLoop`: the same order of events; `new_loop` picks). The twin refuses
    a NaN time, which this class would file in no defined order."""

    @property
    def now(self) -> float: ...
    @property
    def processed(self) -> int: ...
    @property
    def pending(self) -> int: ...
    def at(self, t: float, priority: int, fn: Callback, arg: Any = None) -> None: ...
    def run(self, until: float = math.inf) -> None: ...


def new_loop() -> Loop:
    """The compiled twin where it is built (`testbed.core.native`), else `EventLoop`."""
    ext = native.module()
    if ext is None:
        return EventLoop()
    loop: Loop = ext.EventLoop()
    return loop
