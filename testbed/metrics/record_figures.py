"""What a run's summary takes from its records, whichever way they are read: `RecordFigures` (from
records as objects in `testbed.metrics.summary`, or a column at a time from records.parquet in
`testbed.metrics.summary_columns`), the run.json fields it needs (`RunMeta`), and the statistics
both take the same way."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from testbed.core.schema.scaling import Scale
from testbed.metrics.artefacts.summary_file import Sessions
from testbed.metrics.stats import percentiles_in_place

BREAKDOWN_STAGES: tuple[str, ...] = (
    "routing",
    "prefill_queue",
    "prefill_compute",
    "transfer_tail",
    "decode_queue",
    "first_step",
    "other",
)
TIME_FIELDS: tuple[str, ...] = (
    "arrival",
    "routed",
    "prefill_queued",
    "prefill_start",
    "prefill_end",
    "transfer_start",
    "transfer_end",
    "decode_admitted",
    "first_token",
    "last_token",
)

# breakdown_wire's stages as (end, start) stamps, in its order.
BREAKDOWN_SPANS: dict[str, tuple[str, str]] = {
    "routing": ("routed", "arrival"),
    "prefill_queue": ("prefill_start", "prefill_queued"),
    "prefill_compute": ("prefill_end", "prefill_start"),
    "transfer_tail": ("transfer_end", "prefill_end"),
    "decode_queue": ("decode_admitted", "transfer_end"),
    "first_step": ("first_token", "decode_admitted"),
}
BREAKDOWN_TIMES = sorted({n for pair in BREAKDOWN_SPANS.values() for n in pair})

# Slack on SLO checks for the testbed's own timing error: the paper's decode instance runs
# exactly at the 40 tokens/s SLO, and sub-millisecond timer lateness must not flip it.
SLO_TIMING_TOLERANCE = 0.01


@dataclass(frozen=True)
class RunMeta:
    """What the summary needs from `run.json`."""

    name: str
    scenario: str
    policy: str
    t0: float | None  # None: the run died before it started sending (no time base for series)
    t_end: float | None
    scale: Scale
    shaping_method: str
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    offered_rate_rps: float | None
    threshold: float | None
    interrupted: bool = False
    cut_short: bool = False  # run.json says `running` and its process is gone
    trace_requests: int | None = None
    pid: int | None = None
    arrivals: str | None = None  # open | closed; None: run.json predates it
    wan_delay_s_wire: float | None = None  # the least one-way delay configured on a shaped WAN direction


def stats_of(values: Sequence[float] | npt.NDArray[np.float64], mult: float, mine: bool = False) -> dict[str, object]:
    """n, mean and percentiles of `values` (wire s), times `mult`. The figures are taken on the
    values and then scaled, so one pass serves both units; `mine`: an array the caller gives up
    (it is partly sorted in place instead of copied: ten million TTFTs are 80 MB)."""
    return scaled(wire_stats(values, mine), mult)


def wire_stats(values: Sequence[float] | npt.NDArray[np.float64], mine: bool = False) -> dict[str, float | None]:
    if len(values) == 0:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    if a is values and not mine:
        a = a.copy()
    mean = float(a.mean())  # before the partition reorders it
    p50, p90, p99 = percentiles_in_place(a, (50, 90, 99))
    return {"n": int(a.size), "mean": mean, "p50": p50, "p90": p90, "p99": p99}


def scaled(stats: dict[str, float | None], mult: float) -> dict[str, object]:
    return {k: v if k == "n" or v is None else v * mult for k, v in stats.items()}


@dataclass
class RecordFigures:
    """Everything the summary takes from the records (wire units unless named), from records as
    objects (`record_figures`) or from records.parquet a column at a time
    (`testbed.metrics.summary_columns`): the same figures either way."""

    total: int
    completed: int
    failed: int
    reasons: Counter[str]
    kinds: Counter[str]
    at_nodes: Counter[str]
    dur: float | None
    ttft_w: dict[str, float | None]  # `_wire_stats` of the completed requests' TTFT
    halves: dict[str, object]
    breakdown_w: dict[str, float | None]
    tpot_w: dict[str, float | None]  # and of their TPOT
    slo_met: int | None
    tokens: int
    offloaded: int
    kv_p: float
    kv_w: float
    wan_p: float
    wan_w: float
    move_p: float
    move_w: float
    wan_sources: set[str]
    fidelity: dict[str, object]
    sessions: Sessions | None
    cache: dict[str, object]
    link_phases: list[dict[str, float | None]]
    wan_link: dict[str, object]
