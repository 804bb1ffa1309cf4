"""The metrics of a run's time series that only its plots read.

A simulated run hands its summary the points it wrote instead of reading its files back; the
points of these metrics (the instances' and the router's gauges, sampled every few seconds of a
run: two thirds of the one-hour surrogate's 85,000) are written but not held, only counted, as
no figure of the summary reads them. `tests/test_sim_summary.py` holds the summary of a simulated
run to the one its files give: a figure that comes to read one of these fails it until it is
taken out of this set.
"""

from __future__ import annotations

PLOT_ONLY: frozenset[str] = frozenset(
    {
        # the instances' (`testbed.core.engine`'s samples)
        "queue_depth",
        "running",
        "running_batch",
        "kv_backlog_bytes",
        "kv_usage_bytes",
        "kv_bytes_received",
        # the router's (`testbed.core.router.router_books`)
        "inflight",
        "prefill_assigned",
        "cache_used_bytes_paper",
        "cache_pinned_bytes_paper",
        "cache_hit_tokens",
        "cache_evicted_bytes_paper",
    }
)
