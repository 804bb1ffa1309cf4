"""The summary's record figures (`testbed.metrics.summary.RecordFigures`) from records.parquet, a
column at a time.

A simulated week of traffic is tens of millions of records. Read back as rows (`RecordTable`), a
summary held a view object per record and every column it touched (about 40 bytes a record a
column), so its memory grew past what the simulation itself needed. Here each figure reads the
few columns it needs as flat arrays and lets them go: what stays through the summary is a handful
of arrays (the completed requests' TTFT and TPOT, which percentiles need whole, and a few masks).
The figures are those `record_figures` computes from the same records (a test holds them
alike); only the order of floating-point sums may differ.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from testbed.metrics.columnar import _DEFAULTS, RECORD_SCHEMA, STAMP, _check_schema, _open
from testbed.metrics.control import CacheSums, _kv_link_rates, cache_figures, link_phases_of
from testbed.metrics.fidelity import TimingErrors, fidelity, median
from testbed.metrics.record_figures import (
    BREAKDOWN_SPANS,
    BREAKDOWN_STAGES,
    SLO_TIMING_TOLERANCE,
    TIME_FIELDS,
    RecordFigures,
    RunMeta,
    stats_of,
    wire_stats,
)
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.sessions import sessions_summary
from testbed.metrics.stats import percentiles_in_place
from testbed.metrics.wanlink import link_usage_of

Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]


# Rows a batch: what a pass holds besides its result (a few MB of a few columns).
BATCH_ROWS = 1 << 16


class _Columns:
    """records.parquet's columns, read in batches of rows: numbers and stamps as numpy arrays
    (stamps in seconds, NaN where a stage never happened, as `RecordTable` reads them), texts as
    Arrow arrays. A column the file predates reads as its default on every row."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = _open(path)  # the errors `iter_parquet_records` gives, naming the file
        _check_schema(path, self._file.schema_arrow, RECORD_SCHEMA)
        self.rows = int(self._file.metadata.num_rows)
        self._names = set(self._file.schema_arrow.names)

    def batches(self, *names: str) -> Iterator[tuple[slice, dict[str, Any]]]:
        """(the rows it holds, the batch) for every batch of rows, in order."""
        have = [n for n in names if n in self._names]
        if not have:  # none stored: one batch of defaults
            yield slice(0, self.rows), {n: self._default(n, self.rows) for n in names}
            return
        row = 0
        groups = self._file.metadata.num_row_groups
        step = max(1, BATCH_ROWS // max(1, self._file.metadata.row_group(0).num_rows)) if groups else 1
        # Row groups read a few at a time: `iter_batches` kept every page it had read until the
        # file was closed (200 MB of eight stamps over ten million records).
        for g in range(0, groups, step):
            b = self._file.read_row_groups(list(range(g, min(g + step, groups))), columns=have, use_threads=False)
            out: dict[str, Any] = {n: self._default(n, b.num_rows) for n in names if n not in self._names}
            for n in have:
                data = b.column(n)
                if data.type == STAMP:
                    out[n] = data.cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6
                elif data.type == pa.string():
                    out[n] = data
                else:
                    out[n] = data.to_numpy(zero_copy_only=False)
            yield slice(row, row + b.num_rows), out
            row += b.num_rows

    def _default(self, name: str, rows: int) -> Any:
        t = RECORD_SCHEMA.field(name).type
        if t == pa.string():
            return pa.array([_DEFAULTS[name]] * rows, type=t)
        return np.full(rows, _DEFAULTS[name], dtype=np.float64 if t == STAMP else t.to_pandas_dtype())

    def gather(self, names: tuple[str, ...], pick: Callable[[slice, dict[str, Any]], Floats]) -> Floats:
        """`pick`'s values of every batch, in record order, in one array (filled in place: no
        list of pieces and no concatenation, which would hold them twice)."""
        out = np.empty(self.rows, dtype=np.float64)
        k = 0
        for sl, b in self.batches(*names):
            v = pick(sl, b)
            out[k : k + v.size] = v
            k += v.size
        return out[:k]

    def mask(self, names: tuple[str, ...], test: Callable[[dict[str, Any]], Mask]) -> Mask:
        """`test` of every row, as one array of flags."""
        out = np.empty(self.rows, dtype=np.bool_)
        for sl, b in self.batches(*names):
            out[sl] = test(b)
        return out


def _is(value: str) -> Callable[[dict[str, Any]], Mask]:
    def test(b: dict[str, Any]) -> Mask:
        hit: Mask = pc.equal(b["outcome"], value).to_numpy(zero_copy_only=False)
        return hit

    return test


def _ttft(b: dict[str, Any]) -> Floats:
    d: Floats = b["first_token"] - b["arrival"]
    return d


def _tpot(b: dict[str, Any]) -> Floats:
    received = b["tokens_received"]
    with np.errstate(divide="ignore", invalid="ignore"):
        t: Floats = np.where(received < 2, math.nan, (b["last_token"] - b["first_token"]) / (received - 1))
    return t


def column_figures(path: Path, meta: RunMeta, samples: Sequence[SeriesPoint]) -> RecordFigures:
    """`record_figures` of the records in records.parquet at `path`. Each figure is a pass over
    the few columns it reads; what a pass keeps is one array at most (a figure's values, which a
    percentile needs whole) and the three flags a record (completed, failed, offloaded)."""
    cols = _Columns(path)
    scale, s = meta.scale, meta.scale.speedup
    done = cols.mask(("outcome",), _is("completed"))
    failed = cols.mask(("outcome",), _is("failed"))
    crossed = cols.mask(("crossed_wan",), lambda b: b["crossed_wan"].astype(np.bool_))
    offloaded = done & crossed

    # TTFT, its halves by arrival and the breakdown, over the completed requests with one.
    lo, hi, known = math.inf, -math.inf, 0
    for _, b in cols.batches("arrival"):
        a = b["arrival"][np.isfinite(b["arrival"])]
        if a.size:
            lo, hi, known = min(lo, float(a.min())), max(hi, float(a.max())), known + a.size
    window = (lo, hi) if known > 1 else None

    def ttft_where(keep: Callable[[dict[str, Any], Floats], Mask]) -> Callable[[slice, dict[str, Any]], Floats]:
        def pick(sl: slice, b: dict[str, Any]) -> Floats:
            t = _ttft(b)
            return t[done[sl] & np.isfinite(t) & keep(b, t)]

        return pick

    arr = ("arrival", "first_token")
    ttft_w = wire_stats(cols.gather(arr, ttft_where(lambda b, t: np.ones(t.size, np.bool_))), mine=True)
    halves: dict[str, object] = {"split_s": None, "first": stats_of([], s), "last": stats_of([], s)}
    if known:
        mid = (lo + hi) / 2
        first = cols.gather(arr, ttft_where(lambda b, t: np.isfinite(b["arrival"]) & (b["arrival"] < mid)))
        halves["first"] = stats_of(first, s, mine=True)
        del first
        last = cols.gather(arr, ttft_where(lambda b, t: np.isfinite(b["arrival"]) & (b["arrival"] >= mid)))
        halves["last"] = stats_of(last, s, mine=True)
        del last
        halves["split_s"] = (mid - lo) * s

    # TPOT, the SLO and the tokens.
    tp = ("first_token", "last_token", "tokens_received")
    tpot_w = wire_stats(cols.gather(tp, lambda sl, b: (t := _tpot(b))[done[sl] & np.isfinite(t)]), mine=True)
    slo_met: int | None = None
    tokens = 0
    if meta.slo_ttft_s is not None and meta.slo_tpot_s is not None:
        slack = 1.0 + SLO_TIMING_TOLERANCE
        slo_met = 0
        for sl, b in cols.batches("arrival", *tp):
            ttft, tpot = _ttft(b), _tpot(b)
            ok = np.isfinite(ttft) & (ttft * s <= meta.slo_ttft_s * slack)
            ok &= ~np.isfinite(tpot) | (tpot * s <= meta.slo_tpot_s * slack)
            slo_met += int((ok & done[sl]).sum())
    for sl, b in cols.batches("tokens_received"):
        tokens += int(b["tokens_received"][done[sl]].sum())

    # Bytes, and where the offloaded KV came from.
    kv = {"kv_p": 0.0, "kv_w": 0.0, "wan_p": 0.0, "wan_w": 0.0, "move_p": 0.0, "move_w": 0.0, "counted": 0.0}
    wan_sources: set[str] = set()
    names = ("kv_bytes_paper", "kv_bytes_wire", "cache_move_bytes_paper", "cache_move_bytes_wire", "prefill_node")
    for sl, b in cols.batches(*names):
        paper, wire = _kv_bytes(b["kv_bytes_paper"], b["kv_bytes_wire"], scale.byte_scale)
        d, o = done[sl], offloaded[sl]
        kv["kv_p"] += float(paper[d].sum())
        kv["kv_w"] += float(wire[d].sum())
        kv["wan_p"] += float(paper[o].sum())
        kv["wan_w"] += float(wire[o].sum())
        kv["move_p"] += float(b["cache_move_bytes_paper"][d].sum())
        kv["move_w"] += float(b["cache_move_bytes_wire"][d].sum())
        kv["counted"] += float(b["kv_bytes_wire"][o].sum())  # as recorded: what `link_usage` holds the counters to
        nodes = b["prefill_node"]
        sent = crossed[sl] & pc.not_equal(nodes, "").to_numpy(zero_copy_only=False)
        wan_sources.update(nodes.filter(pa.array(sent)).unique().to_pylist())

    phases: list[dict[str, float | None]] = []
    if len(_kv_link_rates(samples)) >= 2:
        stamps = ("arrival", "first_token", "transfer_end", "prefill_end")
        got = {
            "arrival": cols.gather(stamps, lambda sl, b: b["arrival"][done[sl]]),
            "ttft": cols.gather(stamps, lambda sl, b: _ttft(b)[done[sl]]),
            "tail": cols.gather(stamps, lambda sl, b: (b["transfer_end"] - b["prefill_end"])[done[sl]]),
        }
        phases = link_phases_of(got["arrival"], got["ttft"], crossed[done], got["tail"], samples, scale)
        del got
    sessions = None
    if any(pc.any(pc.not_equal(b["session_id"], "")).as_py() for _, b in cols.batches("session_id")):
        # Sessions are grouped a record at a time; their records are read as rows.
        from testbed.metrics.record_table import RecordTable

        sessions = sessions_summary(RecordTable(path), s, meta.arrivals)
    dur = _duration_wire(meta, cols)
    return RecordFigures(
        total=cols.rows,
        completed=int(done.sum()),
        failed=int(failed.sum()),
        reasons=Counter(r or "unknown" for r in _texts(cols, "reason", failed)),
        kinds=Counter(k or "unknown" for k in _texts(cols, "failure_kind", failed)),
        at_nodes=Counter(x for x in _texts(cols, "failure_node", failed) if x),
        dur=dur,
        ttft_w=ttft_w,
        halves=halves,
        breakdown_w=_breakdown_means(cols, done),
        tpot_w=tpot_w,
        slo_met=slo_met,
        tokens=tokens,
        offloaded=int(offloaded.sum()),
        kv_p=kv["kv_p"],
        kv_w=kv["kv_w"],
        wan_p=kv["wan_p"],
        wan_w=kv["wan_w"],
        move_p=kv["move_p"],
        move_w=kv["move_w"],
        wan_sources=wan_sources,
        fidelity=fidelity(_timing_errors(cols, done, s), samples, s, meta.slo_ttft_s, meta.slo_tpot_s),
        sessions=sessions,
        cache=_cache(cols, done, s),
        link_phases=phases,
        wan_link=link_usage_of(samples, window, int(offloaded.sum()), kv["counted"], scale, dur),
    )


def _texts(cols: _Columns, name: str, rows: Mask) -> list[str]:
    """The column's texts at `rows`, in record order (a failed request's reason: few)."""
    out: list[str] = []
    for sl, b in cols.batches(name):
        sel = rows[sl]
        if sel.any():
            out += b[name].filter(pa.array(sel)).to_pylist()
    return out


def _kv_bytes(paper: npt.NDArray[np.int64], wire: npt.NDArray[np.int64], byte_scale: float) -> tuple[Floats, Floats]:
    """Each record's KV bytes, paper and wire: as `summary._kv_paper` and `_kv_wire`, a count the
    record lacks comes from the other one."""
    as_paper = np.where(paper > 0, paper.astype(np.float64), wire * byte_scale)
    as_wire = np.where(wire > 0, wire.astype(np.float64), np.maximum(np.round(paper / byte_scale), 0.0))
    return as_paper, as_wire


def _breakdown_means(cols: _Columns, done: Mask) -> dict[str, float | None]:
    """`summary._breakdown_means` of the columns: each stage's mean over the completed requests
    with a TTFT, a stage's sum at a time (summed in `breakdown_wire`'s order, so `other` is the
    same)."""
    names = tuple(sorted({n for pair in BREAKDOWN_SPANS.values() for n in pair}))
    sums = dict.fromkeys((*BREAKDOWN_SPANS, "other"), 0.0)
    n = 0
    for sl, b in cols.batches(*names):
        timed = done[sl] & np.isfinite(b["first_token"] - b["arrival"])
        if not timed.any():
            continue
        n += int(timed.sum())
        total: Any = 0.0
        for k, (end, start) in BREAKDOWN_SPANS.items():
            d = b[end][timed] - b[start][timed]
            part = np.where(np.isfinite(d), d, 0.0)
            total = total + part
            sums[k] += float(part.sum())
        sums["other"] += float(((b["first_token"][timed] - b["arrival"][timed]) - total).sum())
    if not n:
        return {k: None for k in BREAKDOWN_STAGES}
    return {k: sums[k] / n for k in BREAKDOWN_STAGES}


def _timing_errors(cols: _Columns, done: Mask, speedup: float) -> TimingErrors:
    """`fidelity.timing_errors` of the columns."""

    def err(b: dict[str, Any]) -> tuple[Floats, Floats]:
        measured, modelled = b["prefill_end"] - b["prefill_start"], b["prefill_modelled"]
        ok = np.isfinite(measured) & np.isfinite(modelled)
        return np.abs(measured[ok] - modelled[ok]), modelled[ok]

    # One array at a time: each is every request's, which its median or percentile needs whole.
    pre = ("prefill_end", "prefill_start", "prefill_modelled")
    abs_err = cols.gather(pre, lambda sl, b: err(b)[0])
    n, abs_median = abs_err.size, median(abs_err, mine=True)
    del abs_err
    rel_median = median(cols.gather(pre, lambda sl, b: (e := err(b))[0][e[1] > 0] / e[1][e[1] > 0]), mine=True)

    def finite(x: Floats) -> Floats:
        return x[np.isfinite(x)] * speedup

    lag = cols.gather(
        ("last_token", "decode_last_token"), lambda sl, b: finite((b["last_token"] - b["decode_last_token"])[done[sl]])
    )
    lag_p90 = _p90(lag)
    del lag
    over = cols.gather(("routed", "router_arrival"), lambda sl, b: finite(b["routed"] - b["router_arrival"]))
    return TimingErrors(n, abs_median, rel_median, lag_p90, _p90(over))


def _p90(values: Floats) -> float | None:
    return percentiles_in_place(values, (90,))[0] if values.size else None


def _cache(cols: _Columns, done: Mask, speedup: float) -> dict[str, object]:
    """`control.cache_summary` of the columns."""
    names = ("input_tokens", "cached_tokens", "decode_cached_tokens", "cache_move_tokens", "cache_move_bytes_paper")
    stamps = ("prefill_start", "prefill_queued", "cache_move_start")
    got = dict.fromkeys(("inp", "hit", "cached", "dec", "moves", "move_tokens", "move_bytes"), 0)
    waits: list[Floats] = []
    for sl, b in cols.batches(*names, *stamps):
        d = done[sl]
        cached = b["cached_tokens"][d]
        moves = d & (b["cache_move_tokens"] > 0)
        got["inp"] += int(b["input_tokens"][d].sum())
        got["hit"] += int((cached > 0).sum())
        got["cached"] += int(cached.sum())
        got["dec"] += int(b["decode_cached_tokens"][d].sum())
        got["moves"] += int(moves.sum())
        got["move_tokens"] += int(b["cache_move_tokens"][moves].sum())
        got["move_bytes"] += int(b["cache_move_bytes_paper"][moves].sum())
        if moves.any():
            start, queued, move = (b[n][moves] for n in stamps)
            ok = np.isfinite(start) & np.isfinite(move)
            ready = np.where(move > queued, move, queued)[ok]  # max(queued, move) as Python takes it
            w = start[ok] - ready
            waits.append(np.where(0.0 > w, 0.0, w) * speedup)
    sums = CacheSums(
        input_tokens=got["inp"],
        with_hit=got["hit"],
        cached=got["cached"],
        decode_cached=got["dec"],
        moves=got["moves"],
        move_tokens=got["move_tokens"],
        move_bytes_paper=got["move_bytes"],
    )
    return cache_figures(sums, np.concatenate(waits) if waits else np.empty(0))


def _duration_wire(meta: RunMeta, cols: _Columns) -> float | None:
    """`summary._duration_wire` of the columns."""
    if meta.t0 is not None and meta.t_end is not None and meta.t_end > meta.t0:
        return meta.t_end - meta.t0
    latest = 0.0
    for _, b in cols.batches(*TIME_FIELDS):
        for v in b.values():
            v = v[np.isfinite(v)]
            if v.size:
                latest = max(latest, float(v.max()))
    return latest if latest > 0 else None
