"""Single entry points: a trace from a file (format by name or suffix) or from a scenario workload."""

from __future__ import annotations

from pathlib import Path

from testbed.core.scenario import WorkloadSpec
from testbed.traces.mooncake import load_mooncake
from testbed.traces.synthetic import synthetic_trace
from testbed.traces.types import Trace, TraceError

SUPPORTED_FORMATS = ("mooncake",)
# Known public formats without a reader yet; named so the error says "not yet", not "unknown".
PLANNED_FORMATS = ("azure", "burstgpt")
_BY_SUFFIX = {".jsonl": "mooncake"}


def detect_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    fmt = _BY_SUFFIX.get(suffix)
    if fmt is None:
        raise TraceError(
            f"unsupported format: cannot tell the format from suffix {suffix or '(none)'!r}; "
            f"pass format= one of {', '.join(SUPPORTED_FORMATS)}",
            path=path,
        )
    return fmt


def load_trace(path: str | Path, format: str = "auto") -> Trace:
    """Load a trace file. `format` is "auto" (by suffix: .jsonl = mooncake) or "mooncake"."""
    fmt = detect_format(path) if format == "auto" else format
    if fmt == "mooncake":
        return load_mooncake(path)
    if fmt in PLANNED_FORMATS:
        raise TraceError(
            f"unsupported format {fmt!r}: not implemented yet (supported: {', '.join(SUPPORTED_FORMATS)})", path=path
        )
    raise TraceError(f"unsupported format {fmt!r} (supported: {', '.join(SUPPORTED_FORMATS)})", path=path)


def trace_from_workload(spec: WorkloadSpec) -> Trace:
    """The scenario's synthetic workload as a Trace (see `synthetic.synthetic_trace`)."""
    return synthetic_trace(spec)
