"""Single entry points: a trace from a file (format by name, suffix or CSV header) or from a
scenario workload."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from testbed.core.scenario import WorkloadSpec
from testbed.traces import azure, burstgpt
from testbed.traces.csvutil import LoadStats, Window, sniff_columns
from testbed.traces.mooncake import MOONCAKE_BLOCK_TOKENS, iter_mooncake
from testbed.traces.synthetic import synthetic_trace
from testbed.traces.types import Trace, TraceError, TraceRequest

SUPPORTED_FORMATS = ("mooncake", "azure", "burstgpt")
# The (input, output) column names each CSV format's notes refer to.
_TOKEN_COLUMNS = {
    "azure": (azure.CONTEXT, azure.GENERATED),
    "burstgpt": (burstgpt.REQUEST, burstgpt.RESPONSE),
}
_BLOCK_TOKENS = {"mooncake": MOONCAKE_BLOCK_TOKENS, "azure": azure.BLOCK_TOKENS, "burstgpt": burstgpt.BLOCK_TOKENS}


def detect_format(path: str | Path) -> str:
    """`.jsonl` is Mooncake; a `.csv` is Azure or BurstGPT by its header's column names."""
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return "mooncake"
    if suffix == ".csv":
        columns = sniff_columns(path)
        if azure.is_azure_header(columns):
            return "azure"
        if burstgpt.is_burstgpt_header(columns):
            return "burstgpt"
        raise TraceError(
            f"unsupported format: the header ({', '.join(columns) or 'empty'}) has neither Azure's "
            f"columns ({', '.join(azure.COLUMNS)}) nor BurstGPT's ({', '.join(burstgpt.REQUIRED)})",
            path=path, line=1,
        )
    raise TraceError(
        f"unsupported format: cannot tell the format from suffix {suffix or '(none)'!r}; "
        f"pass format= one of {', '.join(SUPPORTED_FORMATS)}",
        path=path,
    )


def check_window(window: Window) -> Window:
    start, end = window
    if math.isnan(start) or math.isnan(end) or start > end or start == math.inf:
        raise ValueError(f"window must be (start, end) with start <= end, got ({start}, {end})")
    return (float(start), float(end))


def _windowed(reqs: Iterator[TraceRequest], window: Window | None, limit: int | None) -> Iterator[TraceRequest]:
    """Window and limit for a format without pushdown (Mooncake files are small), with the
    semantics of `transforms.window` then `transforms.head`."""
    start, end = window if window is not None else (-math.inf, math.inf)
    t0: float | None = None
    kept = 0
    if limit is not None and limit <= 0:
        return
    for r in reqs:
        if r.timestamp < start:
            continue
        if r.timestamp >= end:
            break
        if t0 is None:
            t0 = r.timestamp
        yield r if t0 == 0.0 else TraceRequest(r.request_id, r.timestamp - t0, r.input_tokens, r.output_tokens,
                                               r.hash_ids)
        kept += 1
        if kept == limit:
            break


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
    fmt = detect_format(path) if format == "auto" else format
    if fmt not in SUPPORTED_FORMATS:
        raise TraceError(f"unsupported format {fmt!r} (supported: {', '.join(SUPPORTED_FORMATS)})", path=path)
    if window is not None:
        window = check_window(window)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if models is not None and fmt != "burstgpt":
        raise TraceError(f"a model filter needs a format with a Model column (burstgpt), not {fmt}", path=path)
    if fmt == "mooncake":
        return _windowed(iter_mooncake(path, on_error=on_error), window, limit)
    if fmt == "azure":
        return azure.iter_azure(path, window=window, limit=limit, stats=stats, on_error=on_error)
    return burstgpt.iter_burstgpt(path, window=window, limit=limit, keep_failed=keep_failed, models=models,
                                  stats=stats, on_error=on_error)


@contextmanager
def _gc_paused() -> Iterator[None]:
    # Millions of new objects that all stay alive would trigger collections that find nothing.
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
    fmt = detect_format(path) if format == "auto" else format
    stats = LoadStats()
    reqs = iter_trace(path, fmt, window=window, limit=limit, keep_failed=keep_failed, models=models, stats=stats)
    with _gc_paused():
        requests = list(reqs)
    source = str(path)
    if window is not None:
        source += f" | window({window[0]:g}, {window[1]:g})"
    if limit is not None:
        source += f" | head({limit})"
    if models is not None:
        source += f" | models({', '.join(sorted(models))})"
    return Trace(requests, source=source, block_tokens=block_tokens_of(fmt), notes=tuple(notes_for(fmt, stats)))


def block_tokens_of(fmt: str) -> int:
    return _BLOCK_TOKENS[fmt]


def notes_for(fmt: str, stats: LoadStats) -> list[str]:
    """What `stats` says a loader of `fmt` skipped or changed, in that format's column names."""
    return stats.summary(*_TOKEN_COLUMNS[fmt]) if fmt in _TOKEN_COLUMNS else []


def trace_from_workload(spec: WorkloadSpec) -> Trace:
    """The scenario's synthetic workload as a Trace (see `synthetic.synthetic_trace`)."""
    return synthetic_trace(spec)
