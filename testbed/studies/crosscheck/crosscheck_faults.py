"""The crosscheck of a fault scenario: what each fault did in the simulation against the emulation
(`testbed.metrics.fault_effects.fault_effects` on both runs), judged against the simulator's bar, and
every difference in failed and retried requests explained from the two runs' records and
decision logs.

Per fault: requests affected, failed and retried within 2 or 20% (whichever is larger), time to
recover within 1 paper second, and the mean TTFT of the requests that arrived once both runs had
recovered (the same requests in both, completed in both) within 5%.

The explanation says, for each run, how long after the fault the router took the instance out
(its health book: a refused call or probe at once, three failures in a row otherwise), how
many requests were routed to it in between, what the failed requests died of and why the
retried ones were retried, and what connection losses cost the KV senders.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from testbed.core.fault_timeline import NODE_KINDS
from testbed.core.record import RequestRecord
from testbed.metrics.fault_effects import FaultEffect, fault_effects
from testbed.metrics.markdown_table import table_lines
from testbed.metrics.summary import read_run_info
from testbed.metrics.timeseries import decision_points
from testbed.studies.crosscheck.crosscheck_explain import Side

COUNT_TOL = (2, 0.20)  # requests: within 2 or 20%, whichever is larger
RECOVER_TOL_S = 1.0  # paper seconds
TTFT_AFTER_TOL = 0.05


@dataclass
class FaultRow:
    fault: int
    kind: str
    target: str
    metric: str  # affected | failed | retried | recover_s | ttft_after
    sim: float | None
    emulation: float | None
    tolerance: str
    verdict: str  # ok | FAIL | n/a
    explanation: str = ""

    def cells(self) -> list[str]:
        digits = 0 if self.metric in ("affected", "failed", "retried") else 2

        def fmt(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.{digits}f}"

        return [
            f"#{self.fault} {self.kind} {self.target}",
            LABELS[self.metric],
            fmt(self.sim),
            fmt(self.emulation),
            self.tolerance,
            self.verdict,
        ]


LABELS = {
    "affected": "requests affected",
    "failed": "affected, failed",
    "retried": "affected, retried",
    "recover_s": "time to recover (s)",
    "ttft_after": "TTFT mean after recovery (s)",
}


def _count_ok(a: float, b: float) -> bool:
    return abs(a - b) <= max(COUNT_TOL[0], COUNT_TOL[1] * abs(b))


def _ttft_after(sim: Side, emu: Side, cut: float) -> tuple[float | None, float | None, int]:
    """Mean TTFT (paper s) of the requests arriving at or after `cut` (paper s) completed in both runs."""
    a = {r.trace_index: r for r in sim.records if r.outcome == "completed"}
    b = {r.trace_index: r for r in emu.records if r.outcome == "completed"}
    both = [
        i
        for i in a.keys() & b.keys()
        if a[i].times.arrival * sim.speedup >= cut and math.isfinite(a[i].ttft) and math.isfinite(b[i].ttft)
    ]
    if not both:
        return None, None, 0
    return (
        statistics.fmean(a[i].ttft * sim.speedup for i in both),
        statistics.fmean(b[i].ttft * emu.speedup for i in both),
        len(both),
    )


def fault_rows(sim: Side, emu: Side) -> list[FaultRow]:
    """The judged rows of every fault the runs have (none without `faults.jsonl`)."""
    ea = fault_effects(Path(sim.run_dir), sim.records, sim.speedup)
    eb = {e["fault"]: e for e in fault_effects(Path(emu.run_dir), emu.records, emu.speedup)}
    rows: list[FaultRow] = []
    for a in ea:
        b = eb.get(a["fault"])
        if b is None:
            continue
        head = (a["fault"], a["kind"], a["target"])
        for key in ("affected", "failed", "retried"):
            ok = _count_ok(a[key], b[key])
            rows.append(FaultRow(*head, key, a[key], b[key], "±2 or ±20%", "ok" if ok else "FAIL"))
        ra, rb = a["recover_s"], b["recover_s"]
        verdict = "n/a" if ra is None or rb is None else ("ok" if abs(ra - rb) <= RECOVER_TOL_S else "FAIL")
        rows.append(FaultRow(*head, "recover_s", ra, rb, f"±{RECOVER_TOL_S:g} s", verdict))
        ref = a["start_s"] if a["kind"] == "kill" else a["end_s"]
        if ref is not None and ra is not None and rb is not None:
            ta, tb, n = _ttft_after(sim, emu, ref + max(ra, rb))
            v = (
                "n/a"
                if ta is None or tb is None or tb == 0
                else ("ok" if abs(ta - tb) / tb <= TTFT_AFTER_TOL else "FAIL")
            )
            rows.append(FaultRow(*head, "ttft_after", ta, tb, f"±{TTFT_AFTER_TOL:.0%} ({n} requests)", v))
    by_fault: dict[int, list[FaultRow]] = {}
    for r in rows:
        by_fault.setdefault(r.fault, []).append(r)
    for fault, rs in by_fault.items():
        a = next(e for e in ea if e["fault"] == fault)
        text = explain_fault(sim, emu, a)
        for r in rs:
            if r.metric in ("failed", "retried") and (r.sim != r.emulation):
                r.explanation = text
    return rows


# -- explanation -------------------------------------------------------------------------------


def _counts(kinds: list[str]) -> str:
    """Failure kinds counted (a record written before records.csv had them: `unknown`)."""
    c = Counter(k or "unknown" for k in kinds)
    return ", ".join(f"{k} x{v}" for k, v in c.most_common()) or "none"


def _taken_out(side: Side, node: str, after: float) -> float | None:
    """When (paper s since t0) the router's health book took `node` out, at or after `after`."""
    t0 = read_run_info(Path(side.run_dir)).t0
    for p in decision_points(Path(side.run_dir), t0, side.speedup, "health"):
        if p.labels.get("node") == node and p.labels.get("state") == "down" and p.t >= after - 1e-6:
            return p.t
    return None


def _side_text(side: Side, e: FaultEffect) -> str:
    s = side.speedup
    start = e["start_s"]
    end = e["end_s"] if e["end_s"] is not None else math.inf
    recs: list[RequestRecord] = list(side.records)
    failed = [r for r in recs if r.outcome != "completed" and start is not None and r.times.arrival * s <= end]
    retried = [r for r in recs if r.retries and start is not None and r.times.arrival * s <= end]
    parts = [
        f"failed: {_counts([r.failure_kind for r in failed])}",
        f"retried after: {_counts([r.retry_kind for r in retried])}",
    ]
    if e["kind"] in NODE_KINDS and start is not None:
        out = _taken_out(side, e["target"], start)
        if out is None:
            parts.append(f"the router never took {e['target']} out")
        else:
            routed = [
                r
                for r in recs
                if (r.prefill_node == e["target"] or r.decode_node == e["target"] or r.retry_node == e["target"])
                and start <= r.times.routed * s < out
            ]
            parts.append(
                f"the router took {e['target']} out {out - start:.2f} s after the fault began, "
                f"{len(routed)} request(s) routed there in between"
            )
    return "; ".join(parts)


def explain_fault(sim: Side, emu: Side, e: FaultEffect) -> str:
    """Why the runs failed and retried different requests for fault `e` (the simulation's effects)."""
    return (
        f"Simulation: {_side_text(sim, e)}. Emulation: {_side_text(emu, e)}. Requests that failed in one run "
        f"only: {_only(sim, emu, 'failed')}; retried in one run only: {_only(sim, emu, 'retried')}."
    )


def _only(sim: Side, emu: Side, what: str) -> str:
    def ids(side: Side) -> set[int]:
        if what == "failed":
            return {r.trace_index for r in side.records if r.outcome != "completed"}
        return {r.trace_index for r in side.records if r.retries}

    a, b = ids(sim), ids(emu)
    return f"{len(a - b)} simulated, {len(b - a)} emulated"


def markdown(rows: list[FaultRow], h: str) -> list[str]:
    if not rows:
        return []
    cols = ("fault", "metric", "sim", "emulation", "tolerance", "verdict")
    out = [
        "",
        f"{h}# Faults",
        "",
        "What each fault did (`faults.jsonl` against the records, the report's Faults section) in both runs.",
        "",
        *table_lines(cols, (r.cells() for r in rows), ["", "", "right", "right"]),
    ]
    seen: set[str] = set()
    for r in rows:
        if r.explanation and r.explanation not in seen:
            seen.add(r.explanation)
            out += ["", f"- **#{r.fault} {r.kind} {r.target}**, failed and retried: {r.explanation}"]
    return out
