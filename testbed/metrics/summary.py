"""Run summary: `summarize(run_dir)` reads `run.json`, `records.csv` and `timeseries/`, and
`write_summary(run_dir)` also writes the result to `summary.json`.

Records hold wire seconds and bytes; every figure here is given in paper units (wire seconds x
speedup, wire bytes x byte_scale, wire rates / speedup) and, under keys ending in `_wire` or
in the `wire` section, in wire units. TTFT, TPOT, breakdown, offload and KV bytes count completed
requests only. Figures over an empty set are `null`, never NaN. `summary.json` keys:

| Key | Meaning |
|---|---|
| `schema` | Layout version of this file (1). |
| `run.name`, `run.scenario`, `run.policy` | From `run.json`. |
| `run.threshold` | Routing threshold in force (tokens), `null` if none. |
| `run.speedup`, `run.byte_scale` | Scale factors: wire time = paper time / speedup; wire KV bytes = paper bytes / byte_scale. |
| `run.shaping_method` | How the WAN link was shaped (`run.json` `shaping.method`). |
| `run.offered_rate_rps` | Offered arrival rate, paper req/s. |
| `run.slo_ttft_s`, `run.slo_tpot_s` | SLOs, paper seconds (`null` if `run.json` has none). |
| `run.duration_s_paper` | Run length (`t_end - t0`, else the latest record time) in paper seconds. |
| `run.interrupted` | `run.json` says the run was stopped early (its figures cover what finished). |
| `requests.total` | Records in `records.csv`. |
| `requests.completed`, `requests.failed` | Records with outcome `completed` / `failed`. |
| `requests.pending` | Records with any other outcome (the run stopped before they finished). |
| `requests.failure_reasons` | `{reason: count}` over failed records (`unknown` when empty). |
| `throughput.completed_rps_paper`, `_wire` | Completed requests / run duration. |
| `throughput.output_tokens_per_s_paper`, `_wire` | Tokens received by completed requests / run duration. |
| `throughput.goodput_rps_paper`, `_wire` | Completed requests meeting both SLOs / run duration. A request with fewer than 2 tokens has no TPOT and meets the TPOT SLO. |
| `throughput.slo_met` | Number of requests meeting both SLOs (`null`, like goodput, when `run.json` has no SLO). |
| `throughput.slo_attainment` | `slo_met / requests.total` (failed and pending requests miss). |
| `ttft_s.n`, `.mean`, `.p50`, `.p90`, `.p99` | TTFT (first token - arrival) of completed requests, paper s. Percentiles linear-interpolated (numpy). |
| `ttft_halves_s.first`, `.last` | The same statistics for the requests that arrived in the first / last half of the arrival span (`split_s`: paper s from the first arrival to the middle): whether a run (a control loop) settled. |
| `ttft_breakdown_s.routing` | Mean `routed - arrival`, paper s. |
| `ttft_breakdown_s.prefill_queue` | Mean `prefill_start - prefill_queued`. |
| `ttft_breakdown_s.prefill_compute` | Mean `prefill_end - prefill_start`. |
| `ttft_breakdown_s.transfer_tail` | Mean `transfer_end - prefill_end`: the KV transfer TTFT pays after layer-wise pipelining. |
| `ttft_breakdown_s.decode_queue` | Mean `decode_admitted - transfer_end`. |
| `ttft_breakdown_s.first_step` | Mean `first_token - decode_admitted`. |
| `ttft_breakdown_s.other` | Mean of the rest of each TTFT (HTTP hops, e.g. `prefill_queued - routed`, token streaming back). A stage a request did not record counts 0 and its time lands here, so the parts sum to `ttft_s.mean`. |
| `tpot_s.n`, `.mean`, `.p50`, `.p90`, `.p99` | TPOT `(last_token - first_token) / (tokens - 1)` of completed requests with >= 2 tokens, paper s. |
| `offload.ratio` | Share of completed requests whose KV crossed the WAN. |
| `offload.requests` | Number of those requests. |
| `bytes.kv_total_paper`, `_wire` | KV bytes of completed requests. Paper bytes are the recorded `kv_bytes_paper` (wire x byte_scale where not recorded). |
| `bytes.kv_per_request_paper`, `_wire` | `kv_total / requests.completed`. |
| `bytes.wan_total_paper`, `_wire` | KV bytes of completed requests that crossed the WAN. |
| `bytes.wan_per_offloaded_request_paper`, `_wire` | `wan_total / offload.requests`. |
| `bytes.cache_move_paper`, `_wire` | Cached-prefix KV that cross-cluster cache moves of completed requests carried over the WAN. |
| `bytes.wan_per_request_paper`, `_wire` | `(wan_total + cache_move) / requests.completed`: every byte a request put on the WAN. |
| `cache.*`, `control.*` | Prefix-cache reuse and cache moves; the control loop's threshold changes and bandwidth estimates (`testbed.metrics.control`). |
| `long_term` | The long-term loop's role conversions, threshold retunes and the PD split over time (`testbed.metrics.roles`); null when it did not run. |
| `wan_egress.bytes_paper`, `_wire` | Growth of the byte counters (`bytes_sent`, `kv_bytes_sent` series) of sources that sent KV across the WAN (prefill nodes of offloaded requests). |
| `wan_egress.mean_Bps_paper`, `_wire` | That growth / the span of those series, bytes/s (paper rate = wire rate x byte_scale / speedup). Divide by the link's rate for utilisation. |
| `wan_egress.peak_Bps_paper`, `_wire` | Highest rate of their summed counters, held on a common grid at the median sampling interval. |
| `links.<series>.{metric, wan, bytes_paper, bytes_wire, mean_Bps_paper, peak_Bps_paper, mean_Bps_wire, peak_Bps_wire}` | The same per byte-counter series (`source` or `source{label=value}`); `wan` tells whether the source sent KV across the WAN. |
| `fidelity.n` | Records with measured and modelled prefill durations (any outcome). |
| `fidelity.prefill_abs_err_median_s` | Median abs(measured prefill - `prefill_modelled`), wire s: the testbed's own timing error. |
| `fidelity.prefill_rel_err_median` | Median of that error / modelled duration. |
| `fidelity.warn` | `prefill_rel_err_median` > 3%: service-time emulation is off, distrust fine differences. |
| `fidelity.decode_step_late_share` | Time decode steps fell behind their modelled schedule for good (what stretches TPOT), summed over decode nodes / modelled step time. |
| `fidelity.token_lag_p90_s_paper` | P90 of (client received the last token - decode node emitted it), paper s. |
| `fidelity.router_overhead_p90_s_paper` | P90 of (routed - router received the request), paper s. |
| `fidelity.cpu_busy_mean`, `.cpu_saturated_share` | Host CPU busy share over the run, and the share of samples at >= 95%. |
| `fidelity.bounds` | The bound each timing measure is held to (`testbed.metrics.fidelity`). |
| `validity.valid`, `.reasons` | False when a timing measure exceeds its bound: the run's figures are not faithful to the scenario; `testbed regress` fails it. |
| `wire.duration_s` | Run length in wire seconds. |
| `wire.ttft_s`, `wire.ttft_breakdown_s`, `wire.tpot_s` | The paper-unit sections above, in wire seconds. |
| `wan_link.link` | The shaped WAN direction that carried the most bytes (the KV direction), e.g. `dc-remote->dc-local`; absent without shaped links. |
| `wan_link.mean_bps_paper`, `.mean_bps_wire` | Bits/s through that link from its interface counters, over the arrival window (first to last request sent). |
| `wan_link.run_mean_bps_paper` | The same over the whole run, including ramp-up and the drain after the last arrival. |
| `wan_link.peak_bps_paper` | Highest rate over 100 ms (wire) windows. |
| `wan_link.configured_bps_paper` | The link's configured rate at the start (schedules may change it; utilisation uses the rate in force). |
| `wan_link.mean_utilisation`, `.peak_utilisation` | Measured rate / configured rate in force: mean over the arrival window, and the highest 100 ms window. |
| `wan_link.records_bps_paper` | The same traffic from the records: offloaded requests per second x mean KV bytes per offloaded request, over the arrival window; compare with `wan_link.mean_bps_paper`. |
| `wan_link.bytes_per_offloaded_request_paper` | Interface-counter bytes / offloaded requests. |
| `wan_link.counters_over_records` | Interface-counter bytes / KV bytes the records say crossed: a check of both (headers make it slightly above 1). |
| `wan_link.links.<src->dst>` | The same figures for every shaped direction. |
| `timeseries.samples`, `timeseries.metrics` | Number of time-series samples and the metric names present. |
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from testbed.core.record import RequestRecord
from testbed.core.scaling import Scale
from testbed.metrics.control import cache_summary, control_summary, link_phases
from testbed.metrics.roles import long_term_summary
from testbed.metrics.fidelity import fidelity, validity
from testbed.metrics.records import read_records
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.stats import percentile
from testbed.metrics.wanlink import link_usage
from testbed.metrics.timeseries import (
    counter_rate,
    counter_total,
    group_series,
    load_timeseries,
    metrics_of,
    resample,
)

log = logging.getLogger("testbed.metrics")

SCHEMA_VERSION = 2       # 2: `validity`, and the fidelity section's decode, lag, router and CPU measures
BREAKDOWN_STAGES: tuple[str, ...] = (
    "routing",
    "prefill_queue",
    "prefill_compute",
    "transfer_tail",
    "decode_queue",
    "first_step",
    "other",
)
BYTE_COUNTERS: frozenset[str] = frozenset({"bytes_sent", "kv_bytes_sent"})
_TIME_FIELDS: tuple[str, ...] = (
    "arrival", "routed", "prefill_queued", "prefill_start", "prefill_end", "transfer_start",
    "transfer_end", "decode_admitted", "first_token", "last_token",
)


class RunDirError(ValueError):
    """The directory is not a readable run directory (missing or malformed `run.json`)."""


@dataclass(frozen=True)
class RunMeta:
    """What the summary needs from `run.json`."""

    name: str
    scenario: str
    policy: str
    t0: float | None   # None: the run died before it started sending (no time base for series)
    t_end: float | None
    scale: Scale
    shaping_method: str
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    offered_rate_rps: float | None
    threshold: float | None
    interrupted: bool = False


def load_run_meta(run_dir: Path) -> RunMeta:
    p = Path(run_dir) / "run.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{p}: missing; is {run_dir} a run directory?") from None
    except json.JSONDecodeError as e:
        raise RunDirError(f"{p}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise RunDirError(f"{p}: expected a JSON object")
    scale = raw.get("scale")
    if not isinstance(scale, dict):
        # Guessing 1/1 would silently print wire figures as paper figures.
        raise RunDirError(f"{p}: 'scale' with 'speedup' and 'byte_scale' is required")
    speedup, byte_scale = _finite_number(scale, "speedup"), _finite_number(scale, "byte_scale")
    if speedup is None or speedup <= 0 or byte_scale is None or byte_scale <= 0:
        raise RunDirError(f"{p}: scale.speedup and scale.byte_scale must be positive numbers, got {scale!r}")
    shaping = raw.get("shaping")
    slo_raw = raw.get("slo")
    slo: dict[str, Any] = slo_raw if isinstance(slo_raw, dict) else {}
    return RunMeta(
        name=str(raw.get("name") or Path(run_dir).name),
        scenario=str(raw.get("scenario") or ""),
        policy=str(raw.get("policy") or ""),
        t0=_finite_number(raw, "t0"),
        t_end=_finite_number(raw, "t_end"),
        scale=Scale(speedup, byte_scale),
        shaping_method=str(shaping.get("method", "unknown")) if isinstance(shaping, dict) else "unknown",
        slo_ttft_s=_finite_number(slo, "ttft_s"),
        slo_tpot_s=_finite_number(slo, "tpot_s"),
        offered_rate_rps=_finite_number(raw, "offered_rate"),
        threshold=_finite_number(raw, "threshold"),
        interrupted=raw.get("interrupted") is True,
    )


def _finite_number(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def load_records(run_dir: Path) -> list[RequestRecord]:
    p = Path(run_dir) / "records.csv"
    if not p.is_file():
        raise RunDirError(f"{p}: missing; is {run_dir} a run directory?")
    return read_records(p)


def load_run_timeseries(run_dir: Path, meta: RunMeta) -> list[SeriesPoint]:
    if meta.t0 is None:
        if (Path(run_dir) / "timeseries").is_dir():
            log.warning("%s: run.json has no t0; ignoring its time series", run_dir)
        return []
    return load_timeseries(run_dir, t0=meta.t0)


def _finite(x: float) -> bool:
    return math.isfinite(x)


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def completed_ttfts_wire(records: Sequence[RequestRecord]) -> list[float]:
    return [r.ttft for r in records if r.outcome == "completed" and _finite(r.ttft)]


def ttft_halves(records: Sequence[RequestRecord], mult: float) -> dict[str, Any]:
    """TTFT of the completed requests that arrived in the first and in the last half of the
    arrival span (paper s with `mult` = speedup): whether a run settled, and where."""
    arr = [r.times.arrival for r in records if _finite(r.times.arrival)]
    if not arr:
        return {"split_s": None, "first": _stats([], mult), "last": _stats([], mult)}
    mid = (min(arr) + max(arr)) / 2
    ok = [r for r in records if r.outcome == "completed" and _finite(r.ttft) and _finite(r.times.arrival)]
    return {"split_s": (mid - min(arr)) * mult,
            "first": _stats([r.ttft for r in ok if r.times.arrival < mid], mult),
            "last": _stats([r.ttft for r in ok if r.times.arrival >= mid], mult)}


def _stats(values: Sequence[float], mult: float) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * mult
    return {"n": int(a.size), "mean": float(a.mean()), "p50": percentile(a, 50), "p90": percentile(a, 90),
            "p99": percentile(a, 99)}


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
    rows = [breakdown_wire(r) for r in done if _finite(r.ttft)]
    if not rows:
        return {k: None for k in BREAKDOWN_STAGES}
    return {k: float(np.mean([row[k] for row in rows])) * mult for k in BREAKDOWN_STAGES}


def _kv_paper(r: RequestRecord, scale: Scale) -> float:
    return float(r.kv_bytes_paper) if r.kv_bytes_paper > 0 else scale.paper_bytes(r.kv_bytes_wire)


def _kv_wire(r: RequestRecord, scale: Scale) -> float:
    return float(r.kv_bytes_wire) if r.kv_bytes_wire > 0 else float(scale.wire_bytes(r.kv_bytes_paper))


def _duration_wire(meta: RunMeta, records: Sequence[RequestRecord]) -> float | None:
    if meta.t0 is not None and meta.t_end is not None and meta.t_end > meta.t0:
        return meta.t_end - meta.t0
    # An interrupted run may lack t_end: the latest thing any record saw bounds it.
    times = [v for r in records for f in _TIME_FIELDS if _finite(v := getattr(r.times, f))]
    latest = max(times, default=0.0)
    return latest if latest > 0 else None


# Slack on SLO checks for the testbed's own timing error: the paper's decode instance runs
# exactly at the 40 tokens/s SLO, and sub-millisecond timer lateness must not flip it.
SLO_TIMING_TOLERANCE = 0.01


def _meets_slo(r: RequestRecord, meta: RunMeta) -> bool:
    assert meta.slo_ttft_s is not None and meta.slo_tpot_s is not None
    s = meta.scale.speedup
    slack = 1.0 + SLO_TIMING_TOLERANCE
    if not _finite(r.ttft) or r.ttft * s > meta.slo_ttft_s * slack:
        return False
    return not _finite(r.tpot) or r.tpot * s <= meta.slo_tpot_s * slack


def _rates(t: Sequence[SeriesPoint]) -> tuple[float, float | None, float | None]:
    """(bytes, mean B/s, peak B/s) of one cumulative byte counter, wire units."""
    total = counter_total(t)
    span = t[-1].t - t[0].t if len(t) > 1 else 0.0
    _, rates = counter_rate(t)
    return total, (total / span if span > 0 else None), (float(rates.max()) if rates.size else None)


def _egress(samples: Sequence[SeriesPoint], wan_sources: set[str], scale: Scale) -> tuple[dict[str, Any], dict[str, Any]]:
    def both(total: float, mean: float | None, peak: float | None) -> dict[str, Any]:
        return {
            "bytes_paper": scale.paper_bytes(total),
            "bytes_wire": total,
            "mean_Bps_paper": None if mean is None else scale.paper_rate_bps(mean),
            "peak_Bps_paper": None if peak is None else scale.paper_rate_bps(peak),
            "mean_Bps_wire": mean,
            "peak_Bps_wire": peak,
        }

    links: dict[str, Any] = {}
    wan: list[list[SeriesPoint]] = []
    for key, series in group_series(s for s in samples if s.metric in BYTE_COUNTERS).items():
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


def summarize(run_dir: Path) -> dict[str, Any]:
    """The summary of one run directory (see the module docstring for every key)."""
    run_dir = Path(run_dir)
    meta = load_run_meta(run_dir)
    records = load_records(run_dir)
    samples = load_run_timeseries(run_dir, meta)
    scale, s = meta.scale, meta.scale.speedup

    done = [r for r in records if r.outcome == "completed"]
    failed = [r for r in records if r.outcome == "failed"]
    reasons = Counter(r.reason or "unknown" for r in failed)
    dur = _duration_wire(meta, records)

    ttft_w = completed_ttfts_wire(records)
    tpot_w = [r.tpot for r in done if _finite(r.tpot)]
    slo_met: int | None = None
    if meta.slo_ttft_s is not None and meta.slo_tpot_s is not None:
        slo_met = sum(1 for r in done if _meets_slo(r, meta))
    tokens = sum(r.tokens_received for r in done)

    offloaded = [r for r in done if r.crossed_wan]
    kv_p = sum(_kv_paper(r, scale) for r in done)
    kv_w = sum(_kv_wire(r, scale) for r in done)
    wan_p = sum(_kv_paper(r, scale) for r in offloaded)
    wan_w = sum(_kv_wire(r, scale) for r in offloaded)
    move_p = float(sum(r.cache_move_bytes_paper for r in done))
    move_w = float(sum(r.cache_move_bytes_wire for r in done))
    wan_sources = {r.prefill_node for r in records if r.crossed_wan and r.prefill_node}
    links, wan_egress = _egress(samples, wan_sources, scale)

    def per_s(n: float | None) -> float | None:
        return None if n is None or not dur else n / dur

    fid = fidelity(records, samples, s, meta.slo_ttft_s, meta.slo_tpot_s)

    def paper_rate(wire: float | None) -> float | None:
        return None if wire is None else wire / s

    out: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
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
        },
        "requests": {
            "total": len(records),
            "completed": len(done),
            "failed": len(failed),
            "pending": len(records) - len(done) - len(failed),
            "failure_reasons": dict(reasons.most_common()),
        },
        "throughput": {
            "completed_rps_paper": paper_rate(per_s(len(done))),
            "completed_rps_wire": per_s(len(done)),
            "output_tokens_per_s_paper": paper_rate(per_s(tokens)),
            "output_tokens_per_s_wire": per_s(tokens),
            "goodput_rps_paper": paper_rate(per_s(slo_met)),
            "goodput_rps_wire": per_s(slo_met),
            "slo_met": slo_met,
            "slo_attainment": None if slo_met is None else _ratio(slo_met, len(records)),
        },
        "ttft_s": _stats(ttft_w, s),
        "ttft_halves_s": ttft_halves(records, s),
        "ttft_breakdown_s": _breakdown_means(done, s),
        "tpot_s": _stats(tpot_w, s),
        "offload": {"ratio": _ratio(len(offloaded), len(done)), "requests": len(offloaded)},
        "bytes": {
            "kv_total_paper": kv_p,
            "kv_total_wire": kv_w,
            "kv_per_request_paper": _ratio(kv_p, len(done)),
            "kv_per_request_wire": _ratio(kv_w, len(done)),
            "wan_total_paper": wan_p,
            "wan_total_wire": wan_w,
            "wan_per_offloaded_request_paper": _ratio(wan_p, len(offloaded)),
            "wan_per_offloaded_request_wire": _ratio(wan_w, len(offloaded)),
            "cache_move_paper": move_p,
            "cache_move_wire": move_w,
            "wan_per_request_paper": _ratio(wan_p + move_p, len(done)),
            "wan_per_request_wire": _ratio(wan_w + move_w, len(done)),
        },
        "cache": cache_summary(done, scale),
        "control": control_summary(run_dir, meta.t0, samples, scale),
        "long_term": long_term_summary(run_dir, meta.t0, samples, scale),
        "link_phases": link_phases(done, samples, scale),
        "wan_egress": wan_egress,
        "wan_link": link_usage(samples, records, scale, dur),
        "links": links,
        "fidelity": fid,
        "validity": validity(fid),
        "wire": {
            "duration_s": dur,
            "ttft_s": _stats(ttft_w, 1.0),
            "ttft_breakdown_s": _breakdown_means(done, 1.0),
            "tpot_s": _stats(tpot_w, 1.0),
        },
        "timeseries": {"samples": len(samples), "metrics": metrics_of(samples)},
    }
    safe: dict[str, Any] = _json_safe(out)
    return safe


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


def write_summary(run_dir: Path) -> dict[str, Any]:
    """Recompute the summary and write `summary.json` into the run directory."""
    summary = summarize(run_dir)
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    # Write-then-rename: a reader never sees a half-written summary.
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    tmp.replace(path)
    return summary
