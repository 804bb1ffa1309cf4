"""Request traces: types, the Mooncake JSONL, Azure and BurstGPT CSV formats, generated workloads
and transforms. May import core and config; never live, net, sim, deploy or studies."""

from testbed.traces.azure import iter_azure, write_azure
from testbed.traces.burstgpt import iter_burstgpt, write_burstgpt
from testbed.traces.loader import detect_format, iter_trace, load_trace, trace_from_workload
from testbed.traces.mooncake import iter_mooncake, load_mooncake, write_mooncake
from testbed.traces.synthetic import synth_with_prefixes, synthetic_trace
from testbed.traces.types import Trace, TraceError, TraceRequest

__all__ = [
    "Trace",
    "TraceError",
    "TraceRequest",
    "detect_format",
    "iter_azure",
    "iter_burstgpt",
    "iter_mooncake",
    "iter_trace",
    "load_mooncake",
    "load_trace",
    "synth_with_prefixes",
    "synthetic_trace",
    "trace_from_workload",
    "write_azure",
    "write_burstgpt",
    "write_mooncake",
]
