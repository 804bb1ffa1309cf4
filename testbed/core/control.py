"""What any driver of the router's short-term loop needs around `BandwidthController` (I/O-free):
the recent arrivals it plans on, the per-stage service model of a deployment, the controller a
scenario asks for (if any), and the time-series samples of one update. The live loop
(`testbed.live.link_control`) and the simulator (`testbed.sim`) both use these.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from testbed.core.bandwidth import BandwidthController, ControlSample, LinkSignals, StageModel, ThresholdChange
from testbed.core.kvsize import KVModel
from testbed.core.scenario import Scenario
from testbed.core.servicetime import PrefillTime

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
    return StageModel(n_pf, n_pd, t_pf.uncached_time, t_pd.uncached_time, lambda l: float(kv.total(round(l))))


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
