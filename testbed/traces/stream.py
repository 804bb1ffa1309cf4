"""A trace read from its file as a replay needs it, for the simulator's open-loop runs.

`load_trace` holds every request as an object before the first event: about a kilobyte each
with its prefix hashes, a gigabyte for a million requests. `open_trace_file` reads the file
once up front without keeping its requests (to refuse a bad line before any run begins, as
`load_trace` does, and to know what a run records at its start: how many requests, over what
span), then each pass over the result reads the file again, one request at a time.

A trace whose source states sessions is loaded whole (`TraceFile.load`): the session plan
(`testbed.traces.sessions`) maps each turn to its parent by request id over the whole trace.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from testbed.core.gc_pause import paused_gc
from testbed.traces.csvutil import LoadStats, Window
from testbed.traces.formats import FormatName
from testbed.traces.loader import block_tokens_of, iter_trace, notes_for, resolve_format, source_of
from testbed.traces.mooncake import scan_mooncake
from testbed.traces.types import Trace, TraceRequest

HOLD_REQUESTS = 20_000  # a trace of at most this many requests is held once read


@dataclass(frozen=True)
class TraceFile:
    """A trace file's requests with `Trace`'s read-only interface (`len`, iteration in arrival
    order, `duration`, `rate`, `offered_rate`, `is_burst`, `last_timestamp`), each iteration a
    new pass over the file. Built by `open_trace_file`, which checked every request."""

    path: Path
    format: str
    window: Window | None
    limit: int | None
    keep_failed: bool
    models: tuple[str, ...] | None
    source: str
    block_tokens: int
    notes: tuple[str, ...]
    count: int
    last_timestamp: float  # the last request's (the first's is 0)
    stated_sessions: bool  # some request names a session or a parent
    # The requests themselves when there were at most `HOLD_REQUESTS` (a short trace is read once
    # and held: a second pass would cost more than holding it); None: read again at each pass.
    held: list[TraceRequest] | None = None

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter_trace(
            self.path,
            self.format,
            window=self.window,
            limit=self.limit,
            keep_failed=self.keep_failed,
            models=self.models,
        )

    @property
    def duration(self) -> float:
        return self.last_timestamp if self.count > 1 else 0.0

    @property
    def rate(self) -> float:
        """As `Trace.rate`: (n - 1) / duration."""
        if self.count < 2:
            return 0.0
        d = self.duration
        return (self.count - 1) / d if d > 0 else math.inf

    @property
    def offered_rate(self) -> float | None:
        r = self.rate
        return r if self.count > 1 and math.isfinite(r) else None

    @property
    def is_burst(self) -> bool:
        return self.count > 1 and self.duration == 0

    def load(self) -> Trace:
        """The requests held, as `load_trace` returns them."""
        if self.held is not None:
            return Trace(self.held, source=self.source, block_tokens=self.block_tokens, notes=self.notes)
        with paused_gc():
            requests = list(self)
        return Trace(requests, source=self.source, block_tokens=self.block_tokens, notes=self.notes)


def open_trace_file(
    path: str | Path,
    format: str = "auto",
    *,
    window: Window | None = None,
    limit: int | None = None,
    keep_failed: bool = False,
    models: Collection[str] | None = None,
) -> TraceFile:
    """The trace `load_trace` would load with the same arguments (the same errors, the same
    `source` and `notes`), read once through and not held."""
    fmt = resolve_format(path, format)
    source = source_of(path, window, limit, models)
    stats = LoadStats()
    # A long plain trace is counted without making its requests; anything else (a short trace,
    # which is held, one with sessions, a line to complain of) is read through.
    plain = fmt == "mooncake" and window is None and limit is None and models is None
    scanned = scan_mooncake(path) if plain else None
    if scanned is not None and scanned[0] > HOLD_REQUESTS:
        (count, last), stated, held = scanned, False, None
    else:
        count, last, stated, held = _read_through(path, fmt, source, window, limit, keep_failed, models, stats)
    return TraceFile(
        path=Path(path),
        format=fmt,
        window=window,
        limit=limit,
        keep_failed=keep_failed,
        models=None if models is None else tuple(models),
        source=source,
        block_tokens=block_tokens_of(fmt),
        notes=tuple(notes_for(fmt, stats)),
        count=count,
        last_timestamp=last,
        stated_sessions=stated,
        held=held,
    )


def _read_through(
    path: str | Path,
    fmt: FormatName,
    source: str,
    window: Window | None,
    limit: int | None,
    keep_failed: bool,
    models: Collection[str] | None,
    stats: LoadStats,
) -> tuple[int, float, bool, list[TraceRequest] | None]:
    """Every request checked as `load_trace` checks them: how many, the last one's timestamp,
    whether any states a session, and the requests themselves if at most `HOLD_REQUESTS`."""
    count = 0
    prev = -math.inf
    stated = False
    held: list[TraceRequest] | None = []
    # The collector paused: a short trace's requests are held (and the lines' objects freed by
    # reference counting), so its collections would find nothing.
    with paused_gc():
        for r in iter_trace(path, fmt, window=window, limit=limit, keep_failed=keep_failed, models=models, stats=stats):
            t = r.timestamp
            # `Trace`'s own check, which `load_trace` makes of the requests it holds.
            if not t >= prev or t == math.inf:
                raise ValueError(f"{source}: request {r.request_id!r} at {t} s is out of order or not finite")
            prev = t
            count += 1
            stated = stated or bool(r.parent_id or r.session_id)
            if held is not None:
                held = held if count <= HOLD_REQUESTS else None
                if held is not None:
                    held.append(r)
    return count, prev if count else 0.0, stated, held
