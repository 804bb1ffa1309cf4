"""The crosscheck table: model, simulation and emulation of one workload, metric by metric, the
simulation's difference from the emulation against a tolerance, and for every difference that
matters an explanation from the two runs' records (`crosscheck_explain`).

Tolerances (sim against emulation) are the bar the simulator is held to on `make replay`'s
workload: mean and P90 TTFT 5%, TPOT 2%, offload ratio 1 percentage point, WAN bytes 3%. A
metric without one is shown, not judged. A difference is explained when it is outside its
tolerance or above 5% either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from testbed.studies.crosscheck import crosscheck_stages as st
from testbed.studies.crosscheck.crosscheck_explain import Context, Side, explain, finite, notes, rel
from testbed.studies.crosscheck.crosscheck_faults import FaultRow, fault_rows

EXPLAIN_ABOVE = 0.05


@dataclass(frozen=True)
class Tolerance:
    value: float
    absolute: bool = False  # an absolute difference of a ratio (percentage points), not a relative one

    def text(self) -> str:
        return f"±{self.value * 100:g} pp" if self.absolute else f"±{self.value * 100:g}%"


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    scale: float  # printed value = value x scale
    fmt: str
    measure: Callable[[Side], float | None]
    tolerance: Tolerance | None = None
    on_link: bool = False  # judged only when both runs measured a WAN link that KV crossed
    floor: float = 0.0  # a difference below this (its own units) is noise, not explained unless judged


TTFT_TOL = Tolerance(0.05)
WAN_TOL = Tolerance(0.03)
METRICS: tuple[Metric, ...] = (
    Metric(
        "throughput",
        "throughput, completed (req/s)",
        1,
        "{:.3f}",
        lambda s: finite(s.summary.throughput.completed_rps_paper),
    ),
    Metric("ttft_mean", "TTFT mean (s)", 1, "{:.3f}", lambda s: finite(s.summary.ttft_s.mean), TTFT_TOL, floor=0.01),
    Metric("ttft_p50", "TTFT P50 (s)", 1, "{:.3f}", lambda s: finite(s.summary.ttft_s.p50), floor=0.01),
    Metric("ttft_p90", "TTFT P90 (s)", 1, "{:.3f}", lambda s: finite(s.summary.ttft_s.p90), TTFT_TOL, floor=0.01),
    Metric("tpot_mean", "TPOT mean (ms)", 1e3, "{:.2f}", lambda s: finite(s.summary.tpot_s.mean), Tolerance(0.02)),
    Metric(
        "offload_ratio",
        "offload ratio",
        100,
        "{:.1f}%",
        lambda s: finite(s.summary.offload.ratio),
        Tolerance(0.01, absolute=True),
    ),
    Metric("wan_bytes_total", "WAN bytes, total (GB)", 1e-9, "{:.2f}", Side.wan_total, WAN_TOL),
    Metric(
        "wan_bytes_per_request",
        "WAN bytes per request (MB)",
        1e-6,
        "{:.1f}",
        lambda s: finite(s.summary.bytes.wan_per_request_paper),
        WAN_TOL,
    ),
    Metric("wan_link_bytes", "WAN link bytes, counters (GB)", 1e-9, "{:.2f}", Side.link_bytes, WAN_TOL, on_link=True),
    Metric(
        "prefill_queue",
        "prefill queue wait mean (s)",
        1,
        "{:.3f}",
        lambda s: finite(s.summary.ttft_breakdown_s.prefill_queue),
        floor=0.01,
    ),
    Metric(
        "transfer_time",
        "KV transfer time mean (s)",
        1,
        "{:.3f}",
        lambda s: st.mean_paper(s.runrecords(), st.transfer_duration),
        floor=0.01,
    ),
    Metric(
        "transfer_tail",
        "KV transfer tail mean (s)",
        1,
        "{:.3f}",
        lambda s: finite(s.summary.ttft_breakdown_s.transfer_tail),
        floor=0.01,
    ),
)


@dataclass
class Row:
    key: str
    label: str
    model: float | None
    sim: float | None
    emulation: float | None
    diff: float | None  # sim against emulation: relative, or absolute for an absolute tolerance
    rel: float | None  # relative difference (for the 5% rule)
    tolerance: str
    verdict: str  # ok | FAIL | - (not judged) | n/a (a side has no figure)
    explanation: str = ""
    cells: dict[str, str] = field(default_factory=dict)


@dataclass
class Crosscheck:
    scenario: str
    sim_dir: str
    emulation_dir: str | None
    rows: list[Row]
    notes: list[str]  # about the runs as a whole (the emulation's validity, routing)
    model_note: str = ""
    faults: list[FaultRow] = field(default_factory=list)  # a fault scenario's effects, fault by fault

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.verdict in ("FAIL", "n/a")]

    @property
    def faults_failed(self) -> list[FaultRow]:
        return [r for r in self.faults if r.verdict in ("FAIL", "n/a")]

    def failed_labels(self) -> list[str]:
        return [r.label for r in self.failed] + [f"fault #{r.fault} {r.metric}" for r in self.faults_failed]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "failed": [r.key for r in self.failed] + [f"fault{r.fault}.{r.metric}" for r in self.faults_failed]
        }


def _cell(m: Metric, v: float | None) -> str:
    return "" if v is None else m.fmt.format(v * m.scale)


def _diff_text(tol: Tolerance | None, diff: float | None) -> str:
    if diff is None:
        return ""
    if math.isinf(diff):
        return "inf"
    return f"{diff * 100:+.1f} pp" if tol is not None and tol.absolute else f"{diff * 100:+.1f}%"


def _verdict(m: Metric, diff: float | None, judged: bool) -> str:
    if not judged or m.tolerance is None:
        return "-"
    if diff is None:
        return "n/a"
    return "ok" if abs(diff) <= m.tolerance.value + 1e-12 else "FAIL"


def compare(
    scenario: str, sim: Side, emu: Side | None, model: Mapping[str, float | None], model_note: str = ""
) -> Crosscheck:
    """The table of one scenario; `emu` None sets model and simulation side by side, judging nothing."""
    ctx = None if emu is None else Context(sim, emu, st.pair(sim.runrecords(), emu.runrecords()))
    # A backend without shaped links (local, inproc) has no WAN counters; nothing crossed, nothing to count.
    link = emu is not None and emu.link_bytes() is not None and bool(sim.wan_total() or emu.wan_total())
    rows = []
    for m in METRICS:
        a = m.measure(sim)
        b = m.measure(emu) if emu is not None else None
        r = rel(a, b)
        diff = a - b if m.tolerance is not None and m.tolerance.absolute and a is not None and b is not None else r
        row = Row(
            m.key,
            m.label,
            model.get(m.key),
            a,
            b,
            diff,
            r,
            m.tolerance.text() if m.tolerance else "",
            _verdict(m, diff, emu is not None and (link or not m.on_link)),
        )
        row.cells = {
            "model": _cell(m, row.model),
            "sim": _cell(m, a),
            "emulation": _cell(m, b),
            "diff": _diff_text(m.tolerance, diff),
        }
        noise = a is None or b is None or abs(a - b) < m.floor
        if ctx is not None and (row.verdict == "FAIL" or (r is not None and abs(r) > EXPLAIN_ABOVE and not noise)):
            row.explanation = explain(m.key, ctx)
        rows.append(row)
    return Crosscheck(
        scenario,
        sim.run_dir,
        None if emu is None else emu.run_dir,
        rows,
        [] if ctx is None else notes(ctx),
        model_note,
        [] if emu is None else fault_rows(sim, emu),
    )
