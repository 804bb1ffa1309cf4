"""Single entry points: a trace from a file (format by name, suffix or CSV header) or from a
scenario workload."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from testbed.core.gc_pause import paused_gc
from testbed.core.schema.scenario import WorkloadSpec
from testbed.traces.csvutil import LoadStats, Window
from testbed.traces.formats import (
    FORMATS,
    SUPPORTED_FORMATS,
    FormatName,
    ReadOptions,
    TraceFormat,
    detect_format,
    trace_format,
)
from testbed.traces.synthetic import synthetic_trace
from testbed.traces.types import Trace, TraceError, TraceRequest

__all__ = [
    "SUPPORTED_FORMATS",
    "block_tokens_of",
    "check_window",
    "detect_format",
    "iter_trace",
    "load_trace",
    "notes_for",
    "resolve_format",
    "source_of",
    "trace_from_workload",
]


def check_window(window: Window) -> Window:
    start, end = window
    if math.isnan(start) or math.isnan(end) or start > end or start == math.inf:
        raise ValueError(f"window must be (start, end) with start <= end, got ({start}, {end})")
    return (float(start), float(end))


def _resolve(path: str | Path, format: str) -> TraceFormat:
    return FORMATS[detect_format(path)] if format == "auto" else trace_format(format, path)


def resolve_format(path: str | Path, format: str = "auto") -> FormatName:
    """The format `format` names for `path` ("auto": detected from the file)."""
    return _resolve(path, format).name


def iter_trace(
    path: str | Path,
    format: str = "auto",
    *,
    window: Window | None = None,
    limit: int | None = None,
    keep_failed: bool = False,
    models: Collection[str] | None = None,
    stats: LoadStats | None = None,
    on_error: Callable[[TraceError], None] | None = None,
) -> Iterator[TraceRequest]:
    """Stream a trace file's requests without holding them (see `load_trace`). A bad line
    raises TraceError; with `on_error` it is passed to it instead and the line left out, so
    one pass finds every bad line. Errors that end the reading (no such file, a bad header)
    still raise."""
    fmt = _resolve(path, format)
    if window is not None:
        window = check_window(window)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if models is not None and not fmt.filters_models:
        with_models = ", ".join(f.name for f in FORMATS.values() if f.filters_models)
        raise TraceError(
            f"a model filter needs a format with a Model column ({with_models}), not {fmt.name}", path=path
        )
    return fmt.read(
        path,
        ReadOptions(window=window, limit=limit, keep_failed=keep_failed, models=models, stats=stats, on_error=on_error),
    )


def load_trace(
    path: str | Path,
    format: str = "auto",
    *,
    window: Window | None = None,
    limit: int | None = None,
    keep_failed: bool = False,
    models: Collection[str] | None = None,
) -> Trace:
    """Load a trace file.

    `format`: "auto" (`.jsonl` = mooncake; `.csv` = azure or burstgpt by header), "mooncake",
    "azure" or "burstgpt". `window=(start_s, end_s)`: only arrivals in [start_s, end_s) seconds
    of the file's own time axis (0 = its first row), pushed down into the reader; `limit`: at
    most that many requests (after the window). The result is the same as loading everything
    and applying `transforms.window` then `transforms.head`, when the file's first row is kept.
    BurstGPT only: `keep_failed` replays failed requests (0 response tokens) with 1 output token
    instead of skipping them; `models` keeps only those models. The Trace's `notes` count what
    was skipped or changed.
    """
    fmt = resolve_format(path, format)
    stats = LoadStats()
    reqs = iter_trace(path, fmt, window=window, limit=limit, keep_failed=keep_failed, models=models, stats=stats)
    with paused_gc():
        requests = list(reqs)
    return Trace(
        requests,
        source=source_of(path, window, limit, models),
        block_tokens=block_tokens_of(fmt),
        notes=tuple(notes_for(fmt, stats)),
    )


def source_of(path: str | Path, window: Window | None, limit: int | None, models: Collection[str] | None) -> str:
    """A loaded trace's `source`: the file and what was kept of it."""
    source = str(path)
    if window is not None:
        source += f" | window({window[0]:g}, {window[1]:g})"
    if limit is not None:
        source += f" | head({limit})"
    if models is not None:
        source += f" | models({', '.join(sorted(models))})"
    return source


def block_tokens_of(fmt: FormatName) -> int:
    return FORMATS[fmt].block_tokens


def notes_for(fmt: FormatName, stats: LoadStats) -> list[str]:
    """What `stats` says a loader of `fmt` skipped or changed, in that format's column names."""
    columns = FORMATS[fmt].token_columns
    return stats.summary(*columns) if columns is not None else []


def trace_from_workload(spec: WorkloadSpec) -> Trace:
    """The scenario's synthetic workload as a Trace (see `synthetic.synthetic_trace`)."""
    return synthetic_trace(spec)
