"""The testbed's simulator beside a peer simulator on one workload: TTFT, ITL, throughput and
prefix-cache figures side by side, and every difference above `EXPLAIN_ABOVE` explained from
the two runs' records (paired by trace index, TTFT split by stage as `crosscheck_stages` does).

The bar (issue: a peer in the loop): with the same timing tables, mean TTFT and mean ITL within
`BAR` of the peer's, or the difference explained. Both sides are run directories of the
testbed's form, so every figure comes from the same summary code.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from testbed.core.engine.servicetime import DecodeStepTime, PrefillTime
from testbed.core.record import RequestRecord
from testbed.core.schema.hardware import HardwareSpec
from testbed.metrics.markdown_table import Align, table_lines
from testbed.studies.crosscheck import crosscheck_stages as st
from testbed.studies.crosscheck.crosscheck_explain import Side, finite, rel
from testbed.studies.crosscheck.peer_attribution import (
    WAITED_S,
    attribute,
    describe,
    instances,
    placed_waits,
    placement,
    prefill_load,
)

EXPLAIN_ABOVE = 0.05
BAR = 0.10


def cache_hit(s: Side) -> float | None:
    """Share of the completed requests' input tokens found in a prefix cache."""
    done = [r for r in s.records if r.outcome == "completed"]
    total = sum(r.input_tokens for r in done)
    return sum(r.cached_tokens for r in done) / total if total else None


def _stage(key: str) -> Callable[[Side], float | None]:
    return lambda s: finite(getattr(s.summary.ttft_breakdown_s, key))


@dataclass(frozen=True)
class PeerMetric:
    key: str
    label: str
    scale: float
    fmt: str
    measure: Callable[[Side], float | None]
    judged: bool = False  # held to the bar
    floor: float = 0.0  # below this absolute difference (own units): noise, not explained


METRICS: tuple[PeerMetric, ...] = (
    PeerMetric(
        "throughput",
        "throughput, completed (req/s)",
        1,
        "{:.3f}",
        lambda s: finite(s.summary.throughput.completed_rps_paper),
    ),
    PeerMetric(
        "output_tps", "output tokens/s", 1, "{:,.0f}", lambda s: finite(s.summary.throughput.output_tokens_per_s_paper)
    ),
    PeerMetric("ttft_mean", "TTFT mean (s)", 1, "{:.3f}", lambda s: finite(s.summary.ttft_s.mean), True, 0.005),
    PeerMetric("ttft_p50", "TTFT P50 (s)", 1, "{:.3f}", lambda s: finite(s.summary.ttft_s.p50), floor=0.005),
    PeerMetric("ttft_p90", "TTFT P90 (s)", 1, "{:.3f}", lambda s: finite(s.summary.ttft_s.p90), floor=0.005),
    PeerMetric("itl_mean", "ITL mean (ms)", 1e3, "{:.2f}", lambda s: finite(s.summary.tpot_s.mean), True, 1e-4),
    PeerMetric("itl_p90", "ITL P90 (ms)", 1e3, "{:.2f}", lambda s: finite(s.summary.tpot_s.p90), floor=1e-4),
    PeerMetric("cache_hit", "prefix cache hit (input tokens)", 100, "{:.1f}%", cache_hit, floor=0.005),
    PeerMetric("prefill_queue", "prefill queue wait mean (s)", 1, "{:.3f}", _stage("prefill_queue"), floor=0.005),
    PeerMetric("prefill_compute", "prefill compute mean (s)", 1, "{:.3f}", _stage("prefill_compute"), floor=0.005),
    PeerMetric("transfer_tail", "KV transfer tail mean (s)", 1, "{:.3f}", _stage("transfer_tail"), floor=0.005),
    PeerMetric("decode_queue", "decode admission wait mean (s)", 1, "{:.3f}", _stage("decode_queue"), floor=0.005),
)


@dataclass
class PeerRow:
    key: str
    label: str
    testbed: float | None
    peer: float | None
    rel: float | None
    verdict: str  # within | explained | n/a | - (not held to the bar)
    explanation: str = ""
    cells: dict[str, str] = field(default_factory=dict)


@dataclass
class PeerCheck:
    scenario: str
    peer: str
    testbed_dir: str
    peer_dir: str
    rows: list[PeerRow]
    notes: list[str]
    speed: dict[str, Any] = field(default_factory=dict)

    @property
    def outside(self) -> list[PeerRow]:
        """Judged metrics beyond the bar (explained or not)."""
        return [r for r in self.rows if r.verdict in ("explained", "n/a")]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"outside_bar": [r.key for r in self.outside]}


@dataclass(frozen=True)
class Ctx:
    tb: Side
    peer: Side
    pairs: list[tuple[RequestRecord, RequestRecord]]
    hw: HardwareSpec
    peer_name: str
    own_caches: bool = False  # the testbed's prefill instances keep a prefix cache each (cache_scope instance)
    placement: str = "least_loaded"  # the testbed's placement of prompts on prefill instances
    linear_state: bool = True  # the model keeps a linear state, reusable only at exactly its length

    @property
    def tb_pool(self) -> str:
        return "per-instance caches" if self.own_caches else "cluster pool"

    @property
    def a(self) -> st.RunRecords:
        return self.tb.runrecords()

    @property
    def b(self) -> st.RunRecords:
        return self.peer.runrecords()


def _dt(x: float) -> str:
    return f"{x * 1e3:+.1f} ms" if abs(x) < 1 else f"{x:+.3f} s"


def _prefill_effect(c: Ctx) -> tuple[float, int, int]:
    """Mean over the pairs of the modelled prefill time the two runs' different cached prefixes
    make (testbed minus peer, paper s), and how many requests found more cached on each side."""
    t = PrefillTime.from_spec(c.hw.prefill)
    d = [
        t(x.input_tokens - x.cached_tokens, x.cached_tokens) - t(y.input_tokens - y.cached_tokens, y.cached_tokens)
        for x, y in c.pairs
    ]
    more_tb = sum(x.cached_tokens > y.cached_tokens for x, y in c.pairs)
    more_peer = sum(x.cached_tokens < y.cached_tokens for x, y in c.pairs)
    return (statistics.fmean(d) if d else 0.0), more_tb, more_peer


def _compute_vs_table(side: Side, hw: HardwareSpec) -> tuple[float, float]:
    """Mean measured prefill compute over the table's time for the tokens computed (paper s), and
    the share of requests off it by more than 1%: a scheduler that chunks or batches prompts."""
    t = PrefillTime.from_spec(hw.prefill)
    s = side.speedup
    ratios = []
    for r in side.records:
        if r.outcome != "completed":
            continue
        got = (r.times.prefill_end - r.times.prefill_start) * s
        want = t(r.input_tokens - r.cached_tokens, r.cached_tokens)
        if math.isfinite(got) and want > 0:
            ratios.append(got / want)
    if not ratios:
        return math.nan, 0.0
    return statistics.fmean(ratios), sum(abs(x - 1) > 0.01 for x in ratios) / len(ratios)


@dataclass(frozen=True)
class Queueing:
    """Who waited for a prefill instance, and whether another one was idle meanwhile."""

    instances: int
    waited: int  # completed requests that queued more than `WAITED_S`
    idle_elsewhere: int  # ... while another instance computed nothing when they were queued
    wait_idle_s: float  # their mean wait, paper s
    wait_all_s: float  # mean wait over every completed request


def queueing(side: Side) -> Queueing:
    """From the records: each prefill instance's busy spans, and for every request that waited,
    whether some other instance was idle when it was queued (then it was placed, not forced, to
    wait: by routing)."""
    s = side.speedup
    done = [r for r in side.records if r.outcome == "completed" and r.prefill_node]
    waits = [(r.times.prefill_start - r.times.prefill_queued) * s for r in done]
    waits = [w for w in waits if math.isfinite(w)]
    idle = list(placed_waits(side).values())
    return Queueing(
        instances(side),
        sum(w > WAITED_S for w in waits),
        len(idle),
        statistics.fmean(idle) if idle else 0.0,
        statistics.fmean(waits) if waits else 0.0,
    )


def mean_batch(side: Side) -> float:
    """Time-weighted mean of the sequences decoding on a busy decode instance (from the records:
    each completed request decodes from admission to its last token)."""
    by_node: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in side.records:
        a, b = r.times.decode_admitted, r.times.last_token
        if r.outcome == "completed" and r.decode_node and math.isfinite(a) and math.isfinite(b) and b > a:
            by_node[r.decode_node] += [(a, 1), (b, -1)]
    area = busy = 0.0
    for ev in by_node.values():
        ev.sort()
        n, last = 0, ev[0][0]
        for t, d in ev:
            if n > 0:
                area += n * (t - last)
                busy += t - last
            n += d
            last = t
    return area / busy if busy > 0 else math.nan


def _ttft(band: tuple[float, float] | None, over: str) -> Callable[[Ctx], str]:
    def text(c: Ctx) -> str:
        d = st.decompose_ttft(c.a, c.b, c.pairs, band)
        if d is None:
            return f"No request completed on both sides to decompose {over}."
        ranked = sorted(d.stages, key=lambda s: -abs(s.diff))
        parts = ", ".join(
            f"{st.STAGE_NAMES[s.stage]} {_dt(s.diff)} ({s.a:.3f} vs {s.b:.3f} s)" for s in ranked if abs(s.diff) >= 5e-4
        )
        out = (
            f"Over {over} ({d.n} requests), the testbed minus {c.peer_name} is {_dt(d.total)} per request; by "
            f"stage: {parts or 'none above 0.5 ms'}."
        )
        out += " " + _why_prefill(c) + " " + _why_queue(c)
        return out if band is not None else out + " " + _split(c)

    return text


def _split(c: Ctx) -> str:
    a = attribute(c.tb, c.peer, c.pairs, c.hw)
    if a is None:
        return ""
    peer_ttft = finite(c.peer.summary.ttft_s.mean) or 0.0
    placed = (len(placed_waits(c.tb)), len(placed_waits(c.peer)))
    return describe(
        a,
        c.peer_name,
        peer_ttft,
        placed,
        (prefill_load(c.tb, c.hw), prefill_load(c.peer, c.hw)),
        (placement(c.tb), placement(c.peer)),
    )


def _why_prefill(c: Ctx) -> str:
    eff, more_tb, more_peer = _prefill_effect(c)
    ratio, off = _compute_vs_table(c.peer, c.hw)
    out = (
        f"Cache: the two found different cached prefixes for {more_tb + more_peer} requests (more in the testbed's "
        f"{c.tb_pool} for {more_tb}, more in {c.peer_name}'s per-worker caches for {more_peer}); by the timing "
        f"table that alone makes the testbed's prefill compute {_dt(eff)} per request."
    )
    if math.isfinite(ratio):
        out += (
            f" Scheduler: {c.peer_name}'s prefill compute is {ratio:.3f}x the table's time for the tokens it "
            f"computed ({off:.0%} of requests off by more than 1%"
            + (
                ": chunked prefill pays a forward pass per chunk, batching shares one among prompts)."
                if off > 0.01
                else ": one whole prompt per forward pass, as the testbed)."
            )
        )
    return out


def _why_queue(c: Ctx) -> str:
    qa, qb = queueing(c.tb), queueing(c.peer)

    def one(q: Queueing, who: str) -> str:
        return (
            f"{who}: {q.waited} requests waited for a prefill instance, {q.idle_elsewhere} of them while another "
            f"was idle (mean wait {q.wait_idle_s:.3f} s)"
        )

    how = (
        f"the testbed places by {c.placement} over its instances' own caches"
        + (" (the same cost, ties by load where Dynamo draws at random)" if c.placement == "kv_overlap" else "")
        if c.own_caches or c.placement != "least_loaded"
        else "the testbed routes to the least-loaded instance (any of them reads the cluster's prefix pool)"
    )
    return (
        f"Router: {one(qa, 'testbed')}; {one(qb, c.peer_name)}. A request that waits while another instance is "
        f"idle was placed there: {how}, {c.peer_name}'s KV router credits a worker for the prefix blocks it holds "
        "and may queue a request behind it."
    )


def _itl(c: Ctx) -> str:
    ba, bb = mean_batch(c.tb), mean_batch(c.peer)
    dec = c.hw.decode
    model = ""
    if dec is not None:
        step = DecodeStepTime.from_spec(dec)
        model = (
            f" The profile's step is {dec.base_s * 1e3:g} ms + {dec.per_seq_s * 1e3:g} ms a sequence + "
            f"{dec.per_context_token_s * 1e9:g} ns a context token (one sequence of 10K tokens: "
            f"{step(1, 10_000) * 1e3:.2f} ms; BS_max {dec.bs_max}); {c.peer_name} reads it from the exported "
            "table by the batch's KV tokens (rounded to its blocks) and mean context."
        )
    return (
        f"Mean decode batch while busy, from the records: {ba:.2f} sequences in the testbed, {bb:.2f} in "
        f"{c.peer_name}.{model}"
    )


def _cache(c: Ctx) -> str:
    _, more_tb, more_peer = _prefill_effect(c)
    tok_tb = sum(max(x.cached_tokens - y.cached_tokens, 0) for x, y in c.pairs)
    tok_peer = sum(max(y.cached_tokens - x.cached_tokens, 0) for x, y in c.pairs)
    reuse = (
        "but its hybrid model reuses a prefix only up to a linear state taken at exactly that length (a prefix "
        "shared by prompts that end elsewhere, e.g. a common system prompt, is not reusable; the mocker reuses "
        "any matching block), in blocks of the model's block_tokens"
        if c.linear_state
        else "and its model (full attention alone) reuses any matching prefix, in blocks of the model's block_tokens"
    )
    tb = (
        f"The testbed's prefill instances keep a prefix cache each, as the mocker's workers do, {reuse}"
        if c.own_caches
        else "The testbed's cluster holds one prefix pool every prefill instance reads"
    )
    return (
        f"Of {len(c.pairs)} requests completed on both sides, {more_tb} found more cached in the testbed "
        f"({tok_tb:,} tokens more in all) and {more_peer} in {c.peer_name} ({tok_peer:,}). {tb}; {c.peer_name} "
        "keeps a block cache per worker and its router sends a request where its prefix is cached unless that "
        "worker is loaded, so a prefix cached on another worker is computed again."
    )


def _throughput(c: Ctx) -> str:
    da, db = finite(c.tb.summary.run.duration_s_paper), finite(c.peer.summary.run.duration_s_paper)
    return (
        f"Completed {len(c.a.completed())} in the testbed and {len(c.b.completed())} in {c.peer_name}, over "
        f"{da or float('nan'):.1f} and {db or float('nan'):.1f} paper s to the last token (the testbed starts its "
        "arrivals after the live replayer's 0.5 s lead): the duration differs by "
        f"{(rel(da, db) or 0) * 100:+.2f}%."
    )


def _decode_queue(c: Ctx) -> str:
    return (
        _itl(c) + " A request joins the decode batch at the next step boundary once a slot (BS_max) and its KV "
        "memory are free; the testbed reserves the prompt's and the output's KV, including the model's linear "
        f"state, {c.peer_name} counts blocks of full-attention tokens."
    )


def _transfer(c: Ctx) -> str:
    return (
        f"{c.peer_name} moves KV from prefill to decode instantly (no bandwidth set); the testbed streams it "
        "layer by layer over the scenario's intra-datacenter link and pays the tail after the prefill ends."
    )


EXPLAINERS: dict[str, Callable[[Ctx], str]] = {
    "throughput": _throughput,
    "output_tps": _throughput,
    "ttft_mean": _ttft(None, "every request both completed"),
    "ttft_p50": _ttft((0.4, 0.6), "the requests ranked 40-60% by the peer's TTFT"),
    "ttft_p90": _ttft((0.8, 1.0), "the slowest fifth by the peer's TTFT, which sets the P90"),
    "itl_mean": _itl,
    "itl_p90": _itl,
    "cache_hit": _cache,
    "prefill_queue": lambda c: _why_queue(c),
    "prefill_compute": lambda c: _why_prefill(c),
    "transfer_tail": _transfer,
    "decode_queue": _decode_queue,
}


def _cell(m: PeerMetric, v: float | None) -> str:
    return "" if v is None else m.fmt.format(v * m.scale)


def compare(
    scenario: str,
    peer_name: str,
    tb: Side,
    peer: Side,
    hw: HardwareSpec,
    notes: Sequence[str] = (),
    own_caches: bool = False,
    placement: str = "least_loaded",
    linear_state: bool = True,
) -> PeerCheck:
    pairing = st.pair(tb.runrecords(), peer.runrecords())
    c = Ctx(tb, peer, pairing.pairs, hw, peer_name, own_caches, placement, linear_state)
    rows: list[PeerRow] = []
    for m in METRICS:
        a, b = m.measure(tb), m.measure(peer)
        r = rel(a, b)
        noise = a is None or b is None or abs(a - b) < m.floor
        big = r is not None and abs(r) > EXPLAIN_ABOVE and not noise
        row = PeerRow(m.key, m.label, a, b, r, "-")
        if big:
            row.explanation = EXPLAINERS[m.key](c)
        if m.judged:
            row.verdict = (
                "n/a"
                if r is None
                else "within"
                if abs(r) <= BAR or noise
                else "explained"
                if row.explanation
                else "n/a"
            )
        diff = "" if r is None else ("-" if noise and math.isinf(r) else "inf" if math.isinf(r) else f"{r * 100:+.1f}%")
        row.cells = {"testbed": _cell(m, a), "peer": _cell(m, b), "diff": diff}
        rows.append(row)
    out = list(notes)
    if pairing.only_a or pairing.only_b:
        out.append(f"Completed on one side only: {pairing.only_a} in the testbed, {pairing.only_b} in {peer_name}.")
    return PeerCheck(scenario, peer_name, tb.run_dir, peer.run_dir, rows, out)


COLUMNS = ("metric", "testbed sim", "peer", "testbed vs peer", "bar")
FIGURES: list[Align] = ["right"] * (len(COLUMNS) - 2)  # the label and the bar stay left


def _cells(c: PeerCheck) -> list[list[str]]:
    return [
        [
            r.label,
            r.cells["testbed"],
            r.cells["peer"],
            r.cells["diff"],
            {"-": "", "within": f"within ±{BAR:.0%}"}.get(r.verdict, f"outside ±{BAR:.0%}, {r.verdict}"),
        ]
        for r in c.rows
    ]


def markdown(c: PeerCheck) -> list[str]:
    lines = [
        f"# {c.scenario}: the testbed's simulator beside {c.peer}",
        "",
        f"Testbed simulation `{c.testbed_dir}`; {c.peer} `{c.peer_dir}`. Paper units; the difference is the "
        f"testbed's against {c.peer}'s. Mean TTFT and ITL are held to ±{BAR:.0%} (or explained); every "
        f"difference above {EXPLAIN_ABOVE:.0%} is explained from the records below.",
        "",
        *table_lines(COLUMNS, _cells(c), ["", *FIGURES]),
    ]
    if c.notes:
        lines += ["", "## What each side was given", ""] + [f"- {n}" for n in c.notes]
    explained = [r for r in c.rows if r.explanation]
    if explained:
        lines += ["", "## Where they differ", ""]
        lines += [f"- **{r.label}** ({r.cells['diff']}): {r.explanation}" for r in explained]
    judged = [r for r in c.rows if r.verdict != "-"]
    lines += [
        "",
        "Verdict: "
        + "; ".join(
            f"{r.label} {r.cells['diff']}, "
            + (
                "within the bar"
                if r.verdict == "within"
                else "outside the bar, explained above"
                if r.verdict == "explained"
                else "not measured on both sides"
            )
            for r in judged
        )
        + ".",
    ]
    return lines
