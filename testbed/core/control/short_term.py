"""What any driver of the router's short-term loop needs around `BandwidthController` (I/O-free):
the recent arrivals it plans on, the per-stage service model of a deployment, the controller a
scenario asks for (if any), the link signals assembled from the prefill instances' status
(`SignalMeter`), and the time-series samples of one update. The live loop
(`testbed.live.link_control`) and the simulator (`testbed.sim.control`) both use these.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from testbed.core.control.bandwidth import BandwidthController, ControlSample, LinkSignals, StageModel, ThresholdChange
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.scaling import Scale
from testbed.core.schema.scenario import Scenario

# metric, value, labels: one time-series sample
SeriesSample = tuple[str, float, dict[str, str]]


@dataclass
class Recent:
    """Recent arrivals (paper seconds), their incremental lengths and output lengths, for the planners."""

    window: int
    times: deque[float] = field(default_factory=deque)
    lengths: deque[float] = field(default_factory=deque)
    outputs: deque[float] = field(default_factory=deque)

    def add(self, t: float, length: float, output: float = 0.0) -> None:
        self.times.append(t)
        self.lengths.append(length)
        self.outputs.append(output)
        while len(self.times) > self.window:
            self.times.popleft()
            self.lengths.popleft()
            self.outputs.popleft()

    def rate(self, at: float) -> float:
        """Arrivals per second over the window, up to `at` (a quiet spell lowers it)."""
        if len(self.times) < 2:
            return 0.0
        span = max(at, self.times[-1]) - self.times[0]
        return (len(self.times) - 1) / span if span > 0 else 0.0


def stage_model(sc: Scenario) -> StageModel:
    """Per-stage service model of the deployment: the first PrfaaS and PD prefill hardware."""
    kv = KVModel.from_spec(sc.model)

    def first(kind: str) -> tuple[int, PrefillTime]:
        cs = [c for c in sc.clusters if c.kind == kind and c.prefill > 0]
        n = sum(c.prefill for c in cs)
        pt = PrefillTime.from_spec(sc.hardware[cs[0].hardware].prefill) if cs else PrefillTime((), (), (0.0,), 0.0)
        return n, pt

    n_pf, t_pf = first("prfaas")
    n_pd, t_pd = first("pd")
    return StageModel(n_pf, n_pd, t_pf.uncached_time, t_pd.uncached_time, lambda length: float(kv.total(round(length))))


def controller_for(sc: Scenario, threshold: float | None, nominal_bps: float) -> BandwidthController | None:
    """The short-term loop runs under the prfaas policy when it may move the threshold, or when
    the cache-aware rules need the measured bandwidth state; `nominal_bps` is the inter-DC
    link's configured rate (paper bit/s)."""
    pol = sc.policy
    if pol.name != "prfaas" or threshold is None or threshold <= 0:
        return None
    if not (pol.bandwidth_aware or (pol.cache_aware and pol.bandwidth_state == "auto")):
        return None
    return BandwidthController(threshold, nominal_bps, stage_model(sc), pol.control, float(sc.workload.input.max))


def control_series(sig: LinkSignals, sample: ControlSample) -> list[SeriesSample]:
    """The router's time-series samples of one update (paper units, as their names say)."""
    return [
        ("wan_delivered_bps_paper", sample.delivered_bps, {}),
        ("wan_bandwidth_estimate_bps_paper", sample.bandwidth_bps, {}),
        ("wan_undelivered_bytes_paper", sig.undelivered_bytes, {}),
        ("wan_retrans_share", sig.retrans_share, {}),
        ("wan_saturated", 1.0 if sample.saturated else 0.0, {}),
        *([("kv_tail_s_paper", sig.tail_s, {})] if sig.tail_s is not None else []),
        ("bandwidth_abundant", 1.0 if sample.state == "abundant" else 0.0, {}),
        ("planned_load", sample.loads.link, {"stage": "link"}),
        ("planned_load", sample.loads.prfaas, {"stage": "prfaas"}),
        ("planned_load", sample.loads.pdp, {"stage": "pdp"}),
        ("prefill_queued_s_paper", sig.prfaas_backlog_s, {"stage": "prfaas"}),
        ("prefill_queued_s_paper", sig.pdp_backlog_s, {"stage": "pdp"}),
    ]


def change_line(change: ThresholdChange) -> SeriesSample:
    """The `decisions.jsonl` sample of a threshold change."""
    return ("threshold_change", change.new, {"old": f"{change.old:.0f}", "reason": change.reason})


@dataclass(frozen=True)
class SenderStatus:
    """What the short-term loop reads of one prefill instance, in its driver's units (the live
    node's `/status`: wire seconds and bytes; the simulator's model: paper)."""

    acked_bytes: float  # cumulative: KV bytes the network delivered (TCP-acknowledged)
    retrans_segments: float  # cumulative
    acked_segments: float  # cumulative
    undelivered_bytes: float  # now: queued in the sender, unsent in sockets or in flight
    queued_s: float  # now: modelled prefill work waiting


class SignalMeter:
    """`LinkSignals` from successive polls of the prefill instances (`kinds`: node -> its
    cluster's kind). The PrfaaS senders' egress is all WAN traffic: their delivered, undelivered
    and retransmitted bytes are the link's; every instance in service counts for its stage's
    backlog (one that did not answer adds no work but counts). `scale` turns the driver's units
    into paper units."""

    def __init__(self, kinds: Mapping[str, str], scale: Scale) -> None:
        self.kinds = dict(kinds)
        self.scale = scale
        self._prev: tuple[float, float, float, float] | None = None  # t, acked, retrans, segments

    def signals(
        self,
        t: float,
        status: Mapping[str, SenderStatus | None],
        recent: Recent,
        take_tails: Callable[[], list[float]],
        unroutable: frozenset[str] = frozenset(),
    ) -> LinkSignals | None:
        """The signals of the interval since the previous poll (None at the first); `take_tails`
        hands over the KV transfer tails noted since the last call (driver's seconds)."""
        acked = retrans = segments = undelivered = 0.0
        queued = {"prfaas": 0.0, "pd": 0.0}
        count = {"prfaas": 0, "pd": 0}
        for nid, kind in self.kinds.items():
            if nid not in unroutable:
                count[kind] += 1
            st = status.get(nid)
            if st is None:
                continue
            if nid not in unroutable:
                queued[kind] += st.queued_s
            if kind == "prfaas":
                acked += st.acked_bytes
                retrans += st.retrans_segments
                segments += st.acked_segments
                undelivered += st.undelivered_bytes
        prev, self._prev = self._prev, (t, acked, retrans, segments)
        if prev is None:
            return None
        sc = self.scale
        paper_now = sc.paper_seconds(t)
        tails = take_tails()
        d_retrans = max(retrans - prev[2], 0.0)
        return LinkSignals(
            now=paper_now,
            interval_s=sc.paper_seconds(t - prev[0]),
            delivered_bytes=sc.paper_bytes(max(acked - prev[1], 0.0)),
            undelivered_bytes=sc.paper_bytes(undelivered),
            # Retransmitted share of the segments put on the wire in the interval.
            retrans_share=d_retrans / max(segments - prev[3] + d_retrans, 1.0),
            prfaas_backlog_s=sc.paper_seconds(queued["prfaas"]) / max(count["prfaas"], 1),
            pdp_backlog_s=sc.paper_seconds(queued["pd"]) / max(count["pd"], 1),
            arrival_rate=recent.rate(paper_now),
            lengths=tuple(recent.lengths),
            tail_s=sc.paper_seconds(sum(tails) / len(tails)) if tails else None,
        )
