"""Run summary: `summarize(run_dir)` reads `run.json`, `records.csv` and `timeseries/`, and
`write_summary(run_dir)` also writes the result to `summary.json`.

Records hold wire seconds and bytes; every figure here is given in paper units (wire seconds x
speedup, wire bytes x byte_scale, wire rates / speedup) and, under keys ending in `_wire` or
in the `wire` section, in wire units. TTFT, TPOT, breakdown, offload and KV bytes count completed
requests only. Figures over an empty set are `null`, never NaN. Every `summary.json` key is
documented where it is typed, `testbed.metrics.artefacts.summary_file`; the docs' reference
(docs/reference/run-directory) is generated from there.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from testbed.core.record import RequestRecord
from testbed.core.schema.scaling import Scale
from testbed.metrics.artefacts import LAYOUT, SUMMARY_VERSION, RunInfo, read_artefact, write_artefact
from testbed.metrics.artefacts import RunDirError as RunDirError  # re-exported
from testbed.metrics.artefacts import Summary as Summary
from testbed.metrics.artefacts.run_file import Slo, was_cut_short
from testbed.metrics.control import cache_summary, control_summary, link_phases
from testbed.metrics.fault_effects import load_fault_steps
from testbed.metrics.fidelity import delay_line_timing, fault_timing, fidelity, validity, with_fault_timing
from testbed.metrics.record_figures import BREAKDOWN_SPANS as BREAKDOWN_SPANS
from testbed.metrics.record_figures import BREAKDOWN_STAGES as BREAKDOWN_STAGES
from testbed.metrics.record_figures import BREAKDOWN_TIMES as BREAKDOWN_TIMES
from testbed.metrics.record_figures import SLO_TIMING_TOLERANCE as SLO_TIMING_TOLERANCE
from testbed.metrics.record_figures import TIME_FIELDS as TIME_FIELDS
from testbed.metrics.record_figures import RecordFigures, RunMeta, scaled, stats_of, wire_stats
from testbed.metrics.roles import long_term_summary
from testbed.metrics.run_files import read_records_file, records_file
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.sessions import sessions_summary
from testbed.metrics.timeseries import (
    IndexedPoints,
    counter_rate,
    counter_total,
    group_series,
    load_timeseries,
    metrics_of,
    resample,
)
from testbed.metrics.wanlink import link_usage

log = logging.getLogger("testbed.metrics")

SCHEMA_VERSION = LAYOUT  # `schema`; the file's model version is `schema_version` (artefacts.SUMMARY_VERSION)
BYTE_COUNTERS: frozenset[str] = frozenset({"bytes_sent", "kv_bytes_sent"})


def load_run_meta(run_dir: Path) -> RunMeta:
    """RunDirError (a UserError naming the file and field) when `run.json` is missing or malformed."""
    info = read_run_info(run_dir)
    slo = info.slo or Slo()
    cut = was_cut_short(info)
    return RunMeta(
        name=info.name or Path(run_dir).name,
        scenario=info.scenario,
        policy=info.policy,
        t0=_finite_or_none(info.t0),
        t_end=_finite_or_none(info.t_end),
        scale=Scale(info.scale.speedup, info.scale.byte_scale),
        shaping_method=info.shaping.method,
        slo_ttft_s=_finite_or_none(slo.ttft_s),
        slo_tpot_s=_finite_or_none(slo.tpot_s),
        offered_rate_rps=_finite_or_none(info.offered_rate),
        threshold=_finite_or_none(info.threshold),
        interrupted=info.interrupted or cut,
        cut_short=cut,
        trace_requests=info.trace.requests if info.trace else None,
        pid=info.pid,
        arrivals=info.trace.arrivals if info.trace else None,
        wan_delay_s_wire=min(
            (d for link in info.shaping.links.values() if (d := link.delay_s_wire) is not None and d > 0), default=None
        ),
    )


def read_run_info(run_dir: Path) -> RunInfo:
    return read_artefact(Path(run_dir) / "run.json", RunInfo)


def _finite_or_none(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def read_summary(path: Path) -> Summary:
    """`summary.json` (the file, or a run directory holding it) as a typed Summary."""
    path = Path(path)
    return read_artefact(path / "summary.json" if path.is_dir() else path, Summary)


def load_records(run_dir: Path) -> list[RequestRecord]:
    p = records_file(Path(run_dir))
    if not p.is_file():
        raise RunDirError(f"{Path(run_dir) / 'records.csv'}: missing; is {run_dir} a run directory?")
    return read_records_file(p)


def load_run_timeseries(run_dir: Path, meta: RunMeta) -> list[SeriesPoint]:
    if meta.t0 is None:
        if (Path(run_dir) / "timeseries").is_dir():
            log.warning("%s: run.json has no t0; ignoring its time series", run_dir)
        return []
    return load_timeseries(run_dir, t0=meta.t0)


# The C function itself, not a wrapper: called once or twice per record.
_finite: Callable[[float], bool] = math.isfinite


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def completed_ttfts_wire(records: Sequence[RequestRecord]) -> list[float]:
    return [t for r in records if r.outcome == "completed" and _finite(t := r.ttft)]


def ttft_halves(records: Sequence[RequestRecord], mult: float) -> dict[str, object]:
    """TTFT of the completed requests that arrived in the first and in the last half of the
    arrival span (paper s with `mult` = speedup): whether a run settled, and where."""
    arr = [r.times.arrival for r in records if _finite(r.times.arrival)]
    if not arr:
        return {"split_s": None, "first": stats_of([], mult), "last": stats_of([], mult)}
    mid = (min(arr) + max(arr)) / 2
    ok = [r for r in records if r.outcome == "completed" and _finite(r.ttft) and _finite(r.times.arrival)]
    return {
        "split_s": (mid - min(arr)) * mult,
        "first": stats_of([r.ttft for r in ok if r.times.arrival < mid], mult),
        "last": stats_of([r.ttft for r in ok if r.times.arrival >= mid], mult),
    }


def breakdown_wire(r: RequestRecord) -> dict[str, float]:
    """One request's TTFT split into stages (wire s); missing stages count 0, the rest is `other`."""
    parts = {
        "routing": r.times.routed - r.times.arrival,
        "prefill_queue": r.times.prefill_start - r.times.prefill_queued,
        "prefill_compute": r.times.prefill_end - r.times.prefill_start,
        "transfer_tail": r.times.transfer_end - r.times.prefill_end,
        "decode_queue": r.times.decode_admitted - r.times.transfer_end,
        "first_step": r.times.first_token - r.times.decode_admitted,
    }
    parts = {k: v if _finite(v) else 0.0 for k, v in parts.items()}
    parts["other"] = r.ttft - sum(parts.values())
    return parts


def _breakdown_means(done: Sequence[RequestRecord], mult: float) -> dict[str, float | None]:
    """Mean of each stage of `breakdown_wire` over `done` (those with a TTFT), times `mult`:
    the same figures, computed a column at a time."""
    ok = [r.times for r in done if _finite(r.ttft)]
    if not ok:
        return {k: None for k in BREAKDOWN_STAGES}
    # A column at a time: a tuple of stamps per record took ~400 bytes each over a million.
    col = {n: np.fromiter(map(attrgetter(n), ok), np.float64, len(ok)) for n in BREAKDOWN_TIMES}
    parts: dict[str, npt.NDArray[np.float64]] = {}
    for k, (end, start) in BREAKDOWN_SPANS.items():
        d = col[end] - col[start]
        parts[k] = np.where(np.isfinite(d), d, 0.0)
    total: Any = 0.0
    for v in parts.values():  # summed in breakdown_wire's order, so `other` is the same
        total = total + v
    parts["other"] = (col["first_token"] - col["arrival"]) - total
    return {k: float(np.mean(parts[k])) * mult for k in BREAKDOWN_STAGES}


def _kv_paper(r: RequestRecord, scale: Scale) -> float:
    return float(r.kv_bytes_paper) if r.kv_bytes_paper > 0 else scale.paper_bytes(r.kv_bytes_wire)


def _kv_wire(r: RequestRecord, scale: Scale) -> float:
    return float(r.kv_bytes_wire) if r.kv_bytes_wire > 0 else float(scale.wire_bytes(r.kv_bytes_paper))


def _duration_wire(meta: RunMeta, records: Sequence[RequestRecord]) -> float | None:
    if meta.t0 is not None and meta.t_end is not None and meta.t_end > meta.t0:
        return meta.t_end - meta.t0
    # An interrupted run may lack t_end: the latest thing any record saw bounds it.
    times = [v for r in records for f in TIME_FIELDS if _finite(v := getattr(r.times, f))]
    latest = max(times, default=0.0)
    return latest if latest > 0 else None


def _slo_met(done: Sequence[RequestRecord], meta: RunMeta) -> int:
    """How many of `done` met both SLOs (within `SLO_TIMING_TOLERANCE`; a TPOT of a single token
    meets it), the bounds taken once for the run."""
    assert meta.slo_ttft_s is not None and meta.slo_tpot_s is not None
    s = meta.scale.speedup
    slack = 1.0 + SLO_TIMING_TOLERANCE
    ttft_bound, tpot_bound = meta.slo_ttft_s * slack, meta.slo_tpot_s * slack
    met = 0
    for r in done:
        ttft = r.ttft
        if not _finite(ttft) or ttft * s > ttft_bound:
            continue
        tpot = r.tpot
        if not _finite(tpot) or tpot * s <= tpot_bound:
            met += 1
    return met


def _rates(t: Sequence[SeriesPoint]) -> tuple[float, float | None, float | None]:
    """(bytes, mean B/s, peak B/s) of one cumulative byte counter, wire units."""
    total = counter_total(t)
    span = t[-1].t - t[0].t if len(t) > 1 else 0.0
    _, rates = counter_rate(t)
    return total, (total / span if span > 0 else None), (float(rates.max()) if rates.size else None)


def _byte_counters(samples: Sequence[SeriesPoint]) -> list[SeriesPoint]:
    """The points of the byte counters, in the samples' order: from the index where only one of
    them was sampled (the usual run: a scan of every point took a tenth of the summary)."""
    if isinstance(samples, IndexedPoints):
        by_metric = samples.metrics()
        present = [m for m in BYTE_COUNTERS if m in by_metric]
        if len(present) <= 1:
            return list(by_metric[present[0]]) if present else []
    return [s for s in samples if s.metric in BYTE_COUNTERS]


def _egress(
    samples: Sequence[SeriesPoint], wan_sources: set[str], scale: Scale
) -> tuple[dict[str, object], dict[str, object]]:
    def both(total: float, mean: float | None, peak: float | None) -> dict[str, object]:
        return {
            "bytes_paper": scale.paper_bytes(total),
            "bytes_wire": total,
            "mean_Bps_paper": None if mean is None else scale.paper_rate_bps(mean),
            "peak_Bps_paper": None if peak is None else scale.paper_rate_bps(peak),
            "mean_Bps_wire": mean,
            "peak_Bps_wire": peak,
        }

    links: dict[str, object] = {}
    wan: list[list[SeriesPoint]] = []
    for key, series in group_series(_byte_counters(samples)).items():
        is_wan = series[0].source in wan_sources
        links[key] = {"metric": series[0].metric, "wan": is_wan, **both(*_rates(series))}
        if is_wan:
            wan.append(series)
    if not wan:
        return links, both(0.0, None, None)
    total = sum(counter_total(s) for s in wan)
    lo, hi = min(s[0].t for s in wan), max(s[-1].t for s in wan)
    # Peak of the sum: hold each counter on a common grid at the typical sampling interval.
    gaps = np.concatenate([np.diff([x.t for x in s]) for s in wan])
    gaps = gaps[gaps > 0]
    peak: float | None = None
    if gaps.size and hi > lo:
        step = float(np.median(gaps))
        summed: Any = 0.0
        for s in wan:
            grid, held = resample(s, step, start=lo, end=hi, how="last")
            # Before its first sample a counter stands at its first value (no bytes yet counted).
            summed = summed + np.where(np.isnan(held), s[0].value, held)
        diffs = np.diff(summed) / step
        peak = float(np.clip(diffs, 0, None).max()) if diffs.size else None
    return links, both(total, total / (hi - lo) if hi > lo else None, peak)


def record_figures(records: Sequence[RequestRecord], meta: RunMeta, samples: Sequence[SeriesPoint]) -> RecordFigures:
    scale, s = meta.scale, meta.scale.speedup
    done = [r for r in records if r.outcome == "completed"]
    failed = [r for r in records if r.outcome == "failed"]
    dur = _duration_wire(meta, records)
    slo_met: int | None = None
    if meta.slo_ttft_s is not None and meta.slo_tpot_s is not None:
        slo_met = _slo_met(done, meta)
    offloaded = [r for r in done if r.crossed_wan]
    return RecordFigures(
        total=len(records),
        completed=len(done),
        failed=len(failed),
        reasons=Counter(r.reason or "unknown" for r in failed),
        kinds=Counter(r.failure_kind or "unknown" for r in failed),
        at_nodes=Counter(r.failure_node for r in failed if r.failure_node),
        dur=dur,
        ttft_w=wire_stats(completed_ttfts_wire(records)),
        halves=ttft_halves(records, s),
        breakdown_w=_breakdown_means(done, 1.0),
        tpot_w=wire_stats([t for r in done if _finite(t := r.tpot)]),
        slo_met=slo_met,
        tokens=sum(r.tokens_received for r in done),
        offloaded=len(offloaded),
        kv_p=sum(_kv_paper(r, scale) for r in done),
        kv_w=sum(_kv_wire(r, scale) for r in done),
        wan_p=sum(_kv_paper(r, scale) for r in offloaded),
        wan_w=sum(_kv_wire(r, scale) for r in offloaded),
        move_p=float(sum(r.cache_move_bytes_paper for r in done)),
        move_w=float(sum(r.cache_move_bytes_wire for r in done)),
        wan_sources={r.prefill_node for r in records if r.crossed_wan and r.prefill_node},
        fidelity=fidelity(records, samples, s, meta.slo_ttft_s, meta.slo_tpot_s),
        sessions=sessions_summary(records, s, meta.arrivals),
        cache=cache_summary(done, scale),
        link_phases=link_phases(done, samples, scale),
        wan_link=link_usage(samples, records, scale, dur),
    )


def summarize(
    run_dir: Path,
    records: Sequence[RequestRecord] | None = None,
    samples: Sequence[SeriesPoint] | None = None,
    unheld: Mapping[str, int] | None = None,
) -> Summary:
    """The summary of one run directory (see the module docstring for every key). A writer that
    still holds what it wrote may pass it: `records` as `records.csv` reads back, `samples` as
    `timeseries/` reads back (`load_run_timeseries`: times since t0, sorted by time), where the
    points of metrics only plots read (`testbed.metrics.plot_only`) may be left out and counted
    in `unheld` (points by metric); the run's other files are read as always. Records read back
    from records.parquet (`RecordTable`) are summarised a column at a time, in memory that does
    not grow with a record's fields."""
    run_dir = Path(run_dir)
    meta = load_run_meta(run_dir)
    if records is None:
        records = load_records(run_dir)
    # Indexed by metric and source: the figures below ask for a few metrics each.
    samples = IndexedPoints(load_run_timeseries(run_dir, meta) if samples is None else samples)
    scale, s = meta.scale, meta.scale.speedup
    # Only a RecordTable has a path; its module (and pyarrow) stays unimported for the rest.
    table = sys.modules.get("testbed.metrics.record_table")
    if table is not None and isinstance(records, table.RecordTable):
        from testbed.metrics.summary_columns import column_figures

        f = column_figures(records.path, meta, samples)
    else:
        f = record_figures(records, meta, samples)
    dur = f.dur
    fid = {
        **with_fault_timing(f.fidelity, fault_timing(load_fault_steps(run_dir), s)),
        **delay_line_timing(samples, meta.wan_delay_s_wire),
    }
    links, wan_egress = _egress(samples, f.wan_sources, scale)

    def per_s(n: float | None) -> float | None:
        return None if n is None or not dur else n / dur

    def paper_rate(wire: float | None) -> float | None:
        return None if wire is None else wire / s

    out: dict[str, object] = {
        "schema_version": SUMMARY_VERSION,
        "schema": LAYOUT,
        "run": {
            "name": meta.name,
            "scenario": meta.scenario,
            "policy": meta.policy,
            "threshold": meta.threshold,
            "speedup": s,
            "byte_scale": scale.byte_scale,
            "shaping_method": meta.shaping_method,
            "offered_rate_rps": meta.offered_rate_rps,
            "slo_ttft_s": meta.slo_ttft_s,
            "slo_tpot_s": meta.slo_tpot_s,
            "duration_s_paper": None if dur is None else dur * s,
            "interrupted": meta.interrupted,
            "cut_short": meta.cut_short,
            "trace_requests": meta.trace_requests,
        },
        "requests": {
            "total": f.total,
            "completed": f.completed,
            "failed": f.failed,
            "pending": f.total - f.completed - f.failed,
            "failure_reasons": dict(f.reasons.most_common()),
            "failure_kinds": dict(f.kinds.most_common()),
            "failure_nodes": dict(f.at_nodes.most_common()),
        },
        "throughput": {
            "completed_rps_paper": paper_rate(per_s(f.completed)),
            "completed_rps_wire": per_s(f.completed),
            "output_tokens_per_s_paper": paper_rate(per_s(f.tokens)),
            "output_tokens_per_s_wire": per_s(f.tokens),
            "goodput_rps_paper": paper_rate(per_s(f.slo_met)),
            "goodput_rps_wire": per_s(f.slo_met),
            "slo_met": f.slo_met,
            "slo_attainment": None if f.slo_met is None else _ratio(f.slo_met, f.total),
        },
        "ttft_s": scaled(f.ttft_w, s),
        "ttft_halves_s": f.halves,
        "ttft_breakdown_s": {k: None if v is None else v * s for k, v in f.breakdown_w.items()},
        "tpot_s": scaled(f.tpot_w, s),
        "offload": {"ratio": _ratio(f.offloaded, f.completed), "requests": f.offloaded},
        "bytes": {
            "kv_total_paper": f.kv_p,
            "kv_total_wire": f.kv_w,
            "kv_per_request_paper": _ratio(f.kv_p, f.completed),
            "kv_per_request_wire": _ratio(f.kv_w, f.completed),
            "wan_total_paper": f.wan_p,
            "wan_total_wire": f.wan_w,
            "wan_per_offloaded_request_paper": _ratio(f.wan_p, f.offloaded),
            "wan_per_offloaded_request_wire": _ratio(f.wan_w, f.offloaded),
            "cache_move_paper": f.move_p,
            "cache_move_wire": f.move_w,
            "wan_per_request_paper": _ratio(f.wan_p + f.move_p, f.completed),
            "wan_per_request_wire": _ratio(f.wan_w + f.move_w, f.completed),
        },
        "cache": f.cache,
        "sessions": None if f.sessions is None else f.sessions.model_dump(),
        "control": control_summary(run_dir, meta.t0, samples, scale),
        "long_term": long_term_summary(run_dir, meta.t0, samples, scale),
        "link_phases": f.link_phases,
        "wan_egress": wan_egress,
        "wan_link": f.wan_link,
        "links": links,
        "fidelity": fid,
        "validity": validity(fid),
        "wire": {
            "duration_s": dur,
            "ttft_s": scaled(f.ttft_w, 1.0),
            "ttft_breakdown_s": f.breakdown_w,
            "tpot_s": scaled(f.tpot_w, 1.0),
        },
        "timeseries": {
            "samples": len(samples) + sum(unheld.values()) if unheld else len(samples),
            "metrics": sorted({*metrics_of(samples), *unheld}) if unheld else metrics_of(samples),
        },
    }
    # Validated against the model (unknown keys refused): a writer change that the model does
    # not follow fails here, not in a reader later.
    return Summary.model_validate(_json_safe(out))


def _json_safe(v: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python: summary.json stays strict JSON."""
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, np.integer):
        return int(v)
    return v


def write_summary(
    run_dir: Path,
    records: Sequence[RequestRecord] | None = None,
    samples: Sequence[SeriesPoint] | None = None,
    unheld: Mapping[str, int] | None = None,
) -> Summary:
    """Recompute the summary and write `summary.json` into the run directory (`records`,
    `samples` and `unheld` as `summarize` takes them)."""
    summary = summarize(run_dir, records, samples, unheld)
    # Write-then-rename: a reader never sees a half-written summary.
    write_artefact(Path(run_dir) / "summary.json", summary)
    return summary
