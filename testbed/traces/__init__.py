"""Request traces: types, the Mooncake JSONL format, generated workloads and transforms."""

from testbed.traces.loader import load_trace, trace_from_workload
from testbed.traces.mooncake import iter_mooncake, load_mooncake, write_mooncake
from testbed.traces.synthetic import synth_with_prefixes, synthetic_trace
from testbed.traces.types import Trace, TraceError, TraceRequest

__all__ = [
    "Trace",
    "TraceError",
    "TraceRequest",
    "iter_mooncake",
    "load_mooncake",
    "load_trace",
    "synth_with_prefixes",
    "synthetic_trace",
    "trace_from_workload",
    "write_mooncake",
]
