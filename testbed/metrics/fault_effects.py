"""What each fault of a run did to its requests (`faults.jsonl` against `records.csv`), for the
report's Faults section, and the bands that mark faults on the time-series plots.

A request *touches* a fault's target when its prefill or decode node is the faulted instance,
or its failed attempt there was retried elsewhere (its `retry_node`: node faults), or when its KV crossed
the faulted WAN link (link faults and resets: every inter-DC link, or the two datacenters named). It is
*affected* when it also was in flight during the fault: it arrived before the fault ended and, if it
completed, it still needed the target after the fault began (its last token; on a prefill instance, the
end of its prefill) (a failed record has no end time, so a failed request that touches the target and
arrived before the end counts). *Failed* and *retried* count the affected ones (records' `retries`:
routed again after a failed attempt). *Time to recover* runs from the fault's end (a kill: the kill) to
the first token of the first request routed after it that touches the target (after a kill: one served by
another instance of the killed one's role) and completed: service is back, whatever the output length.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypedDict

from testbed.core.fault_timeline import NODE_KINDS, FaultEvent, Phase
from testbed.core.finite_json import dumps as finite_dumps
from testbed.core.json_types import JSONObject
from testbed.core.record import RequestRecord
from testbed.metrics.markdown_table import table_lines
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.timeseries import counter_total, group_series, select

if TYPE_CHECKING:
    from matplotlib.axes import Axes

BAND_COLOURS = {
    "kill": "black",
    "pause": "tab:orange",
    "restart": "tab:purple",
    "slow": "tab:olive",
    "outage": "tab:red",
    "rate_drop": "tab:brown",
    "partition": "tab:pink",
    "tcp_reset": "tab:cyan",
}


class FaultLogFile:
    """Appends the steps of a run's faults to `faults.jsonl`, one JSON object a line, flushing
    each (an interrupted run keeps what happened). The live fault scheduler
    (`testbed.deploy.fault_injection`) and the simulator (`testbed.sim.fault_runner`) both write with it."""

    def __init__(self, path: Path, speedup: float) -> None:
        self.path = path
        self.speedup = speedup
        self._fh: IO[str] = path.open("a")

    def write(self, ev: FaultEvent, phase: Phase, outcome: str, detail: JSONObject | None, t_wire: float) -> JSONObject:
        """One step, `t_wire` wire seconds after t0; returns the line written."""
        line: JSONObject = {
            "t": round(t_wire * self.speedup, 4),
            "t_wire": round(t_wire, 6),
            "fault": ev.index,
            "kind": ev.kind,
            "phase": phase,
            "target": ev.target,
            "at_s": ev.start_s if phase == "start" else ev.end_s,
            "detail": detail or {},
            "outcome": outcome,
        }
        if not self._fh.closed:
            self._fh.write(finite_dumps(line) + "\n")
            self._fh.flush()
        return line

    def close(self) -> None:
        self._fh.close()


class FaultEffect(TypedDict):
    """One fault's effects on the requests (`fault_effects`); paper seconds."""

    fault: int
    kind: str
    target: str
    start_s: float | None
    end_s: float | None
    outcome: str
    affected: int
    failed: int
    retried: int
    recover_s: float | None  # None: never recovered (or never started)


@dataclass(frozen=True)
class FaultWindow:
    """One fault as it happened: paper seconds after t0."""

    index: int
    kind: str
    target: str
    start_s: float | None  # None: never started (skipped, unsupported before it acted)
    end_s: float | None  # None: lasted to the end of the run
    outcome: str  # "ok", or what went otherwise
    detail: JSONObject = field(default_factory=dict)


def load_fault_steps(run_dir: Path) -> list[JSONObject]:
    """The steps in `faults.jsonl`, in the order they were written (empty when the run had no
    faults; a line that is not a step, e.g. cut by a full disk, is passed over)."""
    path = Path(run_dir) / "faults.jsonl"
    if not path.is_file():
        return []
    out: list[JSONObject] = []
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("fault"), int):
            out.append(obj)
    return out


def load_faults(run_dir: Path) -> list[FaultWindow]:
    """The faults in `faults.jsonl` (empty when the run had none), in scenario order."""
    steps: dict[int, dict[str, JSONObject]] = {}
    for obj in load_fault_steps(run_dir):
        fault = obj["fault"]
        assert isinstance(fault, int)
        steps.setdefault(fault, {})[str(obj.get("phase"))] = obj
    out = []
    for i in sorted(steps):
        st, en = steps[i].get("start"), steps[i].get("end")
        first = st or en or {}
        ok_start = st is not None and st.get("outcome") == "ok"
        outcome = str((st or en or {}).get("outcome", "?"))
        if outcome == "ok" and en is not None and en.get("outcome") != "ok":
            cut = str(en.get("outcome", "?")).startswith("skipped")
            outcome = "ok (cut short by the end of the run)" if cut else f"end {en.get('outcome')}"
        end_t = en.get("t") if en is not None and en.get("outcome") == "ok" else None
        detail = {**_detail(st), **_detail(en)}
        t_start = st.get("t") if ok_start and st is not None else None
        out.append(
            FaultWindow(
                i,
                str(first.get("kind", "?")),
                str(first.get("target", "?")),
                float(t_start) if isinstance(t_start, (int, float)) else None,
                float(end_t) if isinstance(end_t, (int, float)) else None,
                outcome,
                detail,
            )
        )
    return out


def _detail(step: JSONObject | None) -> JSONObject:
    d = step.get("detail") if step is not None else None
    return d if isinstance(d, dict) else {}


def _node_dcs(run_dir: Path) -> dict[str, tuple[str, str]]:
    """node id -> (datacenter, role), from deployment.json (empty without one)."""
    try:
        nodes = json.loads((Path(run_dir) / "deployment.json").read_text())["nodes"]
        return {k: (str(v["datacenter"]), str(v["role"])) for k, v in nodes.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _role(node: str, nodes: dict[str, tuple[str, str]]) -> str:
    if node in nodes:
        return nodes[node][1]
    return "decode" if node.rsplit("-", 1)[-1].startswith("d") else "prefill"


def _retried_from(r: RequestRecord) -> str:
    """The node whose failure made the router retry this request ("" if none): the record's
    `retry_node`."""
    return r.retry_node if r.retries else ""


def _touches(r: RequestRecord, w: FaultWindow, nodes: dict[str, tuple[str, str]]) -> bool:
    if w.kind in NODE_KINDS:
        return w.target in (r.prefill_node, r.decode_node, _retried_from(r))
    if not (r.crossed_wan or r.cache_move_tokens > 0):
        return False
    pair = w.target.replace("<->", "->").split("->")
    if w.target == "wan" or len(pair) != 2 or not nodes:
        return True
    dcs = {nodes.get(r.prefill_node, ("", ""))[0], nodes.get(r.decode_node, ("", ""))[0]}
    return dcs == set(pair)


def _busy_until(r: RequestRecord, w: FaultWindow) -> float:
    """When the request stopped needing the fault's target: a prefill instance is done with it
    at the end of its prefill (its decode elsewhere is untouched); a request retried away from
    the target was on it when the fault struck; otherwise its last token."""
    if w.kind in NODE_KINDS and _retried_from(r) == w.target:
        return math.inf
    if w.kind in NODE_KINDS and w.target == r.prefill_node and w.target != r.decode_node:
        return r.times.prefill_end if math.isfinite(r.times.prefill_end) else math.inf
    return r.times.last_token


def fault_effects(
    run_dir: Path, records: Sequence[RequestRecord], speedup: float, faults: Sequence[FaultWindow] | None = None
) -> list[FaultEffect]:
    """Per fault, what it did to the run's requests (paper seconds)."""
    faults = load_faults(run_dir) if faults is None else faults
    nodes = _node_dcs(run_dir)
    out = []
    for w in faults:
        row: FaultEffect = {
            "fault": w.index,
            "kind": w.kind,
            "target": w.target,
            "start_s": w.start_s,
            "end_s": w.end_s,
            "outcome": w.outcome,
            "affected": 0,
            "failed": 0,
            "retried": 0,
            "recover_s": None,
        }
        out.append(row)
        if w.start_s is None:
            continue
        start, end = w.start_s / speedup, (w.end_s / speedup if w.end_s is not None else math.inf)
        affected = [
            r
            for r in records
            if _touches(r, w, nodes)
            and r.times.arrival <= end
            and (r.outcome != "completed" or _busy_until(r, w) >= start)
        ]
        row["affected"] = len(affected)
        row["failed"] = sum(r.outcome != "completed" for r in affected)
        row["retried"] = sum(1 for r in affected if r.retries)
        ref = start if w.kind == "kill" else (end if math.isfinite(end) else None)
        if ref is None:
            continue
        if w.kind == "kill":
            role = _role(w.target, nodes)
            after = [
                r
                for r in records
                if r.times.routed >= ref
                and r.outcome == "completed"
                and (r.decode_node if role == "decode" else r.prefill_node) not in ("", w.target)
            ]
        else:
            after = [r for r in records if r.times.routed >= ref and r.outcome == "completed" and _touches(r, w, nodes)]
        done = [r.times.first_token for r in after if math.isfinite(r.times.first_token)]
        if done:
            row["recover_s"] = (min(done) - ref) * speedup
    return out


def _fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _kv_losses(samples: Sequence[SeriesPoint]) -> tuple[float, float, float] | None:
    """(resumes, bytes resent (wire), transfers failed) over every KV sender of the run; None when
    the run recorded none of these counters (the simulator, older runs)."""
    totals = [
        sum(counter_total(g) for g in group_series(select(samples, m)).values()) if select(samples, m) else None
        for m in ("kv_resumes", "kv_bytes_resent", "kv_transfers_failed")
    ]
    if any(t is None for t in totals):
        return None
    return float(totals[0] or 0), float(totals[1] or 0), float(totals[2] or 0)


def faults_section(
    run_dir: Path, records: Sequence[RequestRecord], speedup: float, samples: Sequence[SeriesPoint] = ()
) -> list[str]:
    """The report's Faults section (Markdown lines); empty when the run had no faults."""
    faults = load_faults(run_dir)
    if not faults:
        return []
    header = [
        "Fault",
        "Target",
        "Start / end (paper s)",
        "Affected",
        "Failed",
        "Retried",
        "Time to recover (paper s)",
        "Outcome",
    ]
    rows = []
    for e in fault_effects(run_dir, records, speedup, faults):
        end = "end of run" if e["end_s"] is None else _fmt_s(e["end_s"])
        span = "not reached" if e["start_s"] is None else f"{_fmt_s(e['start_s'])} / {end}"
        rows.append(
            [
                f"#{e['fault']} {e['kind']}",
                e["target"],
                span,
                str(e["affected"]),
                str(e["failed"]),
                str(e["retried"]),
                "not recovered" if e["recover_s"] is None and e["start_s"] is not None else _fmt_s(e["recover_s"]),
                e["outcome"],
            ]
        )

    out = [
        "## Faults",
        "",
        "Each fault executed (`faults.jsonl`). Affected: requests on the faulted instance, or whose KV crossed the "
        "faulted link, in flight during the fault; failed and retried count those. Time to recover: from the "
        "fault's end (a kill: the kill) to the first token of the first request routed after it to the target "
        "(after a kill: to another instance of its role) that completed. Bands on the time-series plots mark "
        "each fault.",
        "",
        *table_lines(header, rows),
    ]
    for w in faults:
        if w.kind == "tcp_reset" and w.detail.get("modelled") and w.detail.get("connections_targeted") is not None:
            d = w.detail
            out += [
                "",
                f"Fault #{w.index} (tcp_reset, simulated): {d['connections_targeted']} KV connections of "
                f"{d.get('pairs_seen', 0)} sender-receiver pairs reset ({d.get('connection_losses', 0)} "
                "losses: a pair re-established inside the window is reset again).",
            ]
    resets = [w for w in faults if w.kind == "tcp_reset" and w.detail.get("rsts_sent") is not None]
    for w in resets:
        d = w.detail
        out += [
            "",
            f"Fault #{w.index} (tcp_reset): {d.get('connections_targeted', 0)} of "
            f"{d.get('connections_seen', 0)} KV connections seen were reset with {d.get('rsts_sent', 0)} RSTs "
            f"({d.get('rsts_exact', 0)} at the end's own acknowledged sequence number; "
            f"{d.get('ends_answered', 0)} ends later answered with an RST of their own).",
        ]
    losses = _kv_losses(samples)
    if losses is not None and any(w.kind not in NODE_KINDS for w in faults):
        crossed = [r for r in records if r.crossed_wan]
        done = sum(r.outcome == "completed" for r in crossed)
        out += [
            "",
            f"KV transfers over the run: {losses[0]:.0f} connection losses resumed from the last "
            f"acknowledged chunk ({losses[1]:,.0f} wire bytes sent again), {losses[2]:.0f} transfers failed "
            f"(each with its reason in `records.csv`); {done} of {len(crossed)} requests whose KV crossed "
            f"the WAN completed.",
        ]
    return out + [""]


def draw_fault_bands(axes: Iterable[Axes], faults: Sequence[FaultWindow]) -> None:
    """A shaded band over each fault's duration (paper seconds, the plots' x axis) and a line at
    each kill; labels on the first axes only."""
    for k, ax in enumerate(axes):
        for j, w in enumerate(faults):
            if w.start_s is None:
                continue
            colour = BAND_COLOURS.get(w.kind, "gray")
            if w.end_s is None:
                ax.axvline(w.start_s, color=colour, linestyle="--", linewidth=1.0, alpha=0.7)
            else:
                ax.axvspan(w.start_s, w.end_s, color=colour, alpha=0.15, linewidth=0)
            if k == 0:
                # Staggered, so faults that start together stay legible.
                ax.text(
                    w.start_s,
                    0.98 - 0.05 * (j % 4),
                    f" #{w.index} {w.kind} {w.target}",
                    transform=ax.get_xaxis_transform(),
                    fontsize=6,
                    va="top",
                    ha="left",
                    color=colour,
                )
