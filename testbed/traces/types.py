"""Trace data types: one request per arrival, in paper time, with optional prefix block hashes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from testbed.core.errors import UserError


class TraceError(UserError, ValueError):
    """An unusable trace. The message names the file, the 1-based line and the field when known:
    `traces/x.jsonl:17: field 'input_length': expected a non-negative integer, got "abc"`."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.line = line
        self.field = field
        self.detail = message
        where = ""
        if self.path is not None:
            where = self.path if line is None else f"{self.path}:{line}"
            where += ": "
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{where}{what}{message}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request. `timestamp` is seconds since the trace's first request (paper time);
    `hash_ids` are the prefix block hashes (block size = the trace's `block_tokens`);
    equal hash at equal position = equal prefix block. Empty when the source has none.

    Sessions, where the source states them: `session_id` names the conversation, `parent_id` the
    request_id of the turn this one follows (empty: a first turn), `think_s` the paper seconds the
    user (or agent) takes between the parent's answer and this turn (NaN: the source gives none;
    `testbed.core.sessions` says what closed-loop replay does then)."""

    request_id: str
    timestamp: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    session_id: str = ""
    parent_id: str = ""
    think_s: float = math.nan


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order (timestamps non-decreasing). Loaders and transforms put the
    first request at 0; `duration` and `rate` do not rely on it. `notes` say what a loader
    skipped or changed to make the requests replayable (e.g. failed requests left out)."""

    requests: list[TraceRequest]
    source: str
    block_tokens: int = 512
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {self.block_tokens}")
        prev, inf = -math.inf, math.inf
        for r in self.requests:
            t = r.timestamp
            # `not t >= prev` also catches NaN.
            if not t >= prev or t == inf:
                raise ValueError(f"{self.source}: request {r.request_id!r} at {t} s is out of order or not finite")
            prev = t

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival (0 for fewer than two requests)."""
        if not self.requests:
            return 0.0
        return self.requests[-1].timestamp - self.requests[0].timestamp

    @property
    def last_timestamp(self) -> float:
        """The last request's timestamp (0 for none)."""
        return self.requests[-1].timestamp if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests/s, i.e. 1 / mean inter-arrival gap: (n - 1) / duration.
        0 for fewer than two requests; inf when they all arrive at once."""
        n = len(self.requests)
        if n < 2:
            return 0.0
        d = self.duration
        return (n - 1) / d if d > 0 else math.inf

    @property
    def offered_rate(self) -> float | None:
        """The rate a run records as offered: `rate` where it is a figure, None (JSON null) where
        it is none: fewer than two requests, or all arriving at one instant (a burst, such as the
        first rows of a trace that stamps a whole batch with one timestamp)."""
        r = self.rate
        return r if len(self.requests) > 1 and math.isfinite(r) else None

    @property
    def is_burst(self) -> bool:
        """More than one request, all at one instant."""
        return len(self.requests) > 1 and self.duration == 0
