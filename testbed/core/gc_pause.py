"""The cyclic garbage collector paused for a block that allocates millions of objects that stay
alive (a trace read into memory, a simulated run's pools and records): each collection would
traverse them all again for garbage that reference counting frees anyway."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """The collector off for the block, as it was before after it.

    With the collector off, every object made in the block stays in the youngest generation;
    switched back on, the next young collection (a few hundred allocations later) would walk them
    all: seconds for a run's heap, paid by whatever comes next, a Ctrl-C's stop included. They go
    to the oldest generation first (`freeze` then `unfreeze` moves the lists, without walking
    them), where the collector visits them only when that generation has grown by a quarter."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


_heap_kept = False


def keep_heap_to_exit() -> None:
    """Say that what was built stays until the process ends (a simulated run's records, pools and
    trace): the CLI's `entry` then ends the process without freeing it object by object, which
    took 0.4 s for a one-hour trace and grows with it."""
    global _heap_kept
    _heap_kept = True


def heap_kept() -> bool:
    return _heap_kept


__all__ = ["heap_kept", "keep_heap_to_exit", "paused_gc"]
