"""Why the simulation and the emulation of one workload differ on a metric, in words computed
from their summaries and records (`crosscheck_stages`): a TTFT difference by stage, an offload
or WAN-bytes difference by the requests routed or shipped differently, a TPOT difference
against the emulation's decode timing, and so on."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from testbed.core.record import RequestRecord
from testbed.metrics.artefacts import Summary
from testbed.studies.crosscheck import crosscheck_stages as st


@dataclass(frozen=True)
class Side:
    """One run of the comparison: its directory, summary.json and records."""

    label: str
    run_dir: str
    summary: Summary
    records: Sequence[RequestRecord]

    @property
    def speedup(self) -> float:
        return self.summary.run.speedup

    def runrecords(self) -> st.RunRecords:
        return st.RunRecords(self.label, self.records, self.speedup)

    def wan_total(self) -> float | None:
        """Every byte completed requests put on the WAN by the records: KV and cached-prefix moves."""
        return finite(self.summary.bytes.wan_total_paper + self.summary.bytes.cache_move_paper)

    def link_bytes(self) -> float | None:
        """Bytes the KV direction's interface counters saw (None without a shaped link)."""
        w = self.summary.wan_link
        usage = w.links.get(w.link) if w.link is not None else None
        return None if usage is None else finite(usage.bytes_paper)

    def invalid(self) -> bool:
        return not self.summary.valid


def finite(v: float | None) -> float | None:
    """A summary figure for comparison: None unless a finite number."""
    return v if v is not None and math.isfinite(v) else None


@dataclass(frozen=True)
class Context:
    sim: Side
    emu: Side
    pairing: st.Pairing

    @property
    def a(self) -> st.RunRecords:
        return self.sim.runrecords()

    @property
    def b(self) -> st.RunRecords:
        return self.emu.runrecords()


def rel(a: float | None, b: float | None) -> float | None:
    """(a - b) / |b|; 0 when both are 0, inf when only b is."""
    if a is None or b is None:
        return None
    if b == 0:
        return 0.0 if a == 0 else math.inf
    return (a - b) / abs(b)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else ("inf" if math.isinf(v) else f"{v * 100:+.1f}%")


def _opt(v: Any, fmt: str) -> str:
    return "n/a" if not isinstance(v, (int, float)) else fmt.format(v)


def _dt(x: float) -> str:
    return f"{x * 1e3:+.0f} ms" if abs(x) < 1 else f"{x:+.2f} s"


def _gb(x: float) -> str:
    return f"{x / 1e9:+.2f} GB"


def fidelity_text(side: Side) -> str:
    f = side.summary.fidelity
    return (
        f"prefill timing error {_opt(f.prefill_rel_err_median, '{:.1%}')} (median), decode steps late "
        f"{_opt(f.decode_step_late_share, '{:.1%}')}, token delivery lag P90 "
        f"{_opt(f.token_lag_p90_s_paper, '{:.3f} s')}, router overhead P90 "
        f"{_opt(f.router_overhead_p90_s_paper, '{:.3f} s')}, host CPU busy "
        f"{_opt(f.cpu_busy_mean, '{:.0%}')} (saturated {_opt(f.cpu_saturated_share, '{:.0%}')} "
        "of the run)"
    )


def ttft_text(d: st.Decomposition | None, over: str) -> str:
    if d is None:
        return f"No request completed in both runs to decompose {over}."
    ranked = sorted(d.stages, key=lambda s: -abs(s.diff))
    parts = ", ".join(f"{st.STAGE_NAMES[s.stage]} {_dt(s.diff)}" for s in ranked if abs(s.diff) >= 5e-4)
    lead = "; ".join(
        f"{st.STAGE_NAMES[s.stage]} ({d.share(s):.0%}: {s.a:.3f} s simulated, {s.b:.3f} s emulated)"
        for s in d.leading()
    )
    return (
        f"Over {over} ({d.n} requests), simulated minus emulated TTFT is {_dt(d.total)} per request; by stage "
        f"{parts or 'none above 0.5 ms'}. Most of it: {lead}."
    )


def _ttft(band: tuple[float, float] | None, over: str) -> Callable[[Context], str]:
    return lambda c: ttft_text(st.decompose_ttft(c.a, c.b, c.pairing.pairs, band), over)


def _tpot(c: Context) -> str:
    med = st.median_paired(c.pairing.pairs, lambda r: r.tpot, c.a.speedup, c.b.speedup)
    f = c.emu.summary.fidelity
    return (
        "Per request, simulated minus emulated TPOT has median "
        f"{_opt(None if med is None else med * 1e3, '{:+.2f} ms')}"
        f"; the simulator's TPOT is the modelled decode step, while the emulation's decode steps fell "
        f"{_opt(f.decode_step_late_share, '{:.1%}')} behind the model and its token delivery lag P90 "
        f"was {_opt(f.token_lag_p90_s_paper, '{:.3f} s')}."
    )


def _lengths(recs: Sequence[RequestRecord]) -> str:
    if not recs:
        return ""
    lens = sorted(r.input_tokens for r in recs)
    return f" (input {lens[0]:,} to {lens[-1]:,} tokens)"


def _thresholds(run: st.RunRecords) -> str:
    ts = sorted({r.threshold for r in run.completed().values() if math.isfinite(r.threshold)})
    if not ts:
        return "none"
    return f"{ts[0]:,.0f}" if len(ts) == 1 else f"{ts[0]:,.0f} to {ts[-1]:,.0f} ({len(ts)} values)"


def _offload(c: Context) -> str:
    ch = st.routing_changes(c.pairing.pairs)
    return (
        f"Of {len(c.pairing.pairs)} requests both completed, {len(ch.crossed_only_a)} crossed the WAN only in "
        f"the simulation{_lengths(ch.crossed_only_a)} and {len(ch.crossed_only_b)} only in the emulation"
        f"{_lengths(ch.crossed_only_b)}; {c.pairing.only_a} completed only in the simulation, {c.pairing.only_b} "
        f"only in the emulation. Thresholds in force: {_thresholds(c.a)} simulated, {_thresholds(c.b)} emulated."
    )


def _wan_bytes(c: Context) -> str:
    w = st.wan_bytes(c.a, c.b)
    return (
        f"Simulated minus emulated WAN bytes {_gb(w.total)}: {_gb(w.crossed_only_a)} from requests offloaded "
        f"only in the simulation, {_gb(-w.crossed_only_b)} only in the emulation, {_gb(w.both_kv_diff)} in the "
        f"KV size of requests offloaded in both, {_gb(w.completed_only_a - w.completed_only_b)} from requests "
        f"completed in one run only, {_gb(w.cache_move_diff)} in cached-prefix moves; completed requests "
        f"{len(c.a.completed())} simulated, {len(c.b.completed())} emulated."
    )


def _link(c: Context) -> str:
    ra, rb = finite(c.sim.summary.wan_link.counters_over_records), finite(c.emu.summary.wan_link.counters_over_records)
    return (
        f"Interface counters over the KV bytes the records say crossed: {_opt(ra, '{:.4f}')} simulated (headers "
        f"at the link profile's MTU), {_opt(rb, '{:.4f}')} emulated (headers of the emulator's own links); the "
        f"records' WAN bytes differ by {_pct(rel(c.sim.wan_total(), c.emu.wan_total()))}."
    )


def _throughput(c: Context) -> str:
    da, db = finite(c.sim.summary.run.duration_s_paper), finite(c.emu.summary.run.duration_s_paper)
    return (
        f"Completed {len(c.a.completed())} simulated and {len(c.b.completed())} emulated requests over "
        f"{_opt(da, '{:.1f}')} and {_opt(db, '{:.1f}')} paper s: the run's duration (to its last completion) "
        f"differs by {_pct(rel(da, db))}."
    )


def _queue(c: Context) -> str:
    qa = st.mean_by(c.a, st.queue_wait, lambda r: r.prefill_cluster)
    qb = st.mean_by(c.b, st.queue_wait, lambda r: r.prefill_cluster)
    out = (
        "Mean prefill queue wait by cluster, simulated vs emulated: "
        + ", ".join(
            f"{k} {_opt(qa.get(k), '{:.3f}')} vs {_opt(qb.get(k), '{:.3f}')} s" for k in sorted(qa.keys() | qb.keys())
        )
        + "."
    )
    d = st.decompose_ttft(c.a, c.b, c.pairing.pairs)
    if d is not None:
        q = next(s for s in d.stages if s.stage == "prefill_queue")
        out += f" It makes {d.share(q):.0%} of the per-stage TTFT differences."
    return out


def _by_path(value: Callable[[RequestRecord], float]) -> Callable[[Context], str]:
    def text(c: Context) -> str:
        ta, tb = (
            st.mean_by(x, value, lambda r: "across the WAN" if r.crossed_wan else "within a datacenter")
            for x in (c.a, c.b)
        )
        out = (
            "By path, simulated vs emulated: "
            + ", ".join(
                f"{k} {_opt(ta.get(k), '{:.3f}')} vs {_opt(tb.get(k), '{:.3f}')} s"
                for k in sorted(ta.keys() | tb.keys())
            )
            + ". The simulator's links are fluid flows (no slow start, queueing delay or jitter)"
        )
        if _unshaped(c.emu):
            return out + "; the emulation's links were not shaped (shaping none): its WAN is loopback."
        return out + "."

    return text


def _unshaped(side: Side) -> bool:
    return side.summary.run.shaping_method == "none"


EXPLAINERS: dict[str, Callable[[Context], str]] = {
    "throughput": _throughput,
    "ttft_mean": _ttft(None, "every request both completed"),
    "ttft_p50": _ttft((0.4, 0.6), "the requests ranked 40-60% by emulated TTFT"),
    "ttft_p90": _ttft((0.8, 1.0), "the slowest fifth by emulated TTFT, which sets the P90"),
    "tpot_mean": _tpot,
    "offload_ratio": _offload,
    "wan_bytes_total": _wan_bytes,
    "wan_bytes_per_request": _wan_bytes,
    "wan_link_bytes": _link,
    "prefill_queue": _queue,
    "transfer_time": _by_path(st.transfer_duration),
    "transfer_tail": _by_path(lambda r: r.times.transfer_end - r.times.prefill_end),
}


def explain(key: str, c: Context) -> str:
    """Why simulation and emulation differ on metric `key`."""
    out = EXPLAINERS[key](c)
    if c.emu.invalid():
        out += " The emulation was marked invalid (see its fidelity figures above)."
    return out


def notes(c: Context) -> list[str]:
    """What holds for every metric: the emulation's validity, requests completed or routed differently."""
    out = []
    if c.emu.invalid():
        val = c.emu.summary.validity
        reasons = (val.reasons if val else None) or ["no reason recorded"]
        out.append(
            "The emulation was marked invalid, its timing not faithful to the scenario: "
            + "; ".join(reasons)
            + ". Its fidelity figures: "
            + fidelity_text(c.emu)
            + "."
        )
    if _unshaped(c.emu):
        out.append(
            "The emulation's links were not shaped (shaping none, a loopback backend): WAN delay and rate "
            "are not emulated there, so transfer times and the TTFT they feed are not the scenario's."
        )
    if c.pairing.only_a or c.pairing.only_b:
        # By kind; a summary written before records had kinds: by reason.
        failed = c.emu.summary.requests.failure_kinds or c.emu.summary.requests.failure_reasons
        out.append(
            f"Completed in one run only: {c.pairing.only_a} in the simulation, {c.pairing.only_b} in the "
            "emulation (the emulation's failures: "
            + (", ".join(f"{k} x{v}" for k, v in failed.items()) or "none")
            + ")."
        )
    moved = st.routing_changes(c.pairing.pairs).other_cluster
    if moved:
        out.append(
            f"{moved} of {len(c.pairing.pairs)} requests were prefilled in another cluster in the simulation "
            "than in the emulation."
        )
    return out
