"""Bandwidth-aware routing: the router's short-term control loop (I/O-free).

Every interval the router hands `BandwidthController.update` what it measured:
- the PrfaaS senders' KV bytes the WAN delivered (TCP-acknowledged) in the interval, and the KV
  still undelivered (queued in the sender, unsent in the socket, or in flight);
- their TCP retransmissions, and the KV transfer tails the offloaded requests paid;
- the prefill backlog (modelled work queued) per instance of each stage;
- the recent arrival rate and the recent requests' incremental lengths.

From these it keeps an estimate of the bandwidth the link gives now: when undelivered KV is
worth more than `saturated_s` of the delivered rate (or retransmissions exceed `retrans_limit`, or
the mean transfer tail exceeds `tail_limit_s`)
the link was the limit, so what it delivered is what it has; otherwise, once `hold_s` has passed
since the last saturation, the estimate grows by `probe_growth` per interval back toward the
nominal rate (a recovered link is only seen by trying it; the hold keeps the loop from
oscillating around a link that is still short). It judges the bandwidth abundant or scarce for the
cache-aware rules, and, when it may adjust, it plans the threshold: for candidate thresholds it predicts,
from the recent length sample, the load of the link and of both prefill stages, each with its existing
backlog spread over `horizon_s`, and takes the candidate closest to the base threshold whose loads all
stay at or below their targets (`link_target_utilisation`, `target_utilisation`), or the least loaded one
if none does. It moves only when that lowers the predicted peak load by at least `min_gain` (or, all
being fine, brings the threshold back toward the base by at most `recovery_step`), by more than
`min_change`, and once `min_requests` have been seen. Every change comes back with its reason, for the
run's records.

All figures are in paper units (seconds, bytes, bits/s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from testbed.core.routing.policy import BandwidthState
from testbed.core.schema.scenario import ControlSpec

_COSTS_KEPT = 1 << 16  # distinct lengths whose costs a stage model keeps


@dataclass(frozen=True)
class StageModel:
    """What the planner needs to predict each stage's load at a threshold."""

    prfaas_instances: int
    pdp_instances: int
    prfaas_time: Callable[[float], float]  # prefill seconds of l uncached tokens, PrfaaS hardware
    pdp_time: Callable[[float], float]  # the same on PD-P hardware
    wan_bytes: Callable[[float], float]  # KV bytes an offloaded request of l tokens sends
    # Each length's three costs once: every update re-plans over much the same recent lengths,
    # and interpolating them again took a third to a half of a bandwidth-aware simulation.
    _costs: dict[float, tuple[float, float, float]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def costs(self, length: float) -> tuple[float, float, float]:
        """(WAN bytes, PrfaaS time, PD-P time) of a request of `length` incremental tokens."""
        c = self._costs.get(length)
        if c is None:
            if len(self._costs) >= _COSTS_KEPT:
                self._costs.clear()
            c = self._costs[length] = (self.wan_bytes(length), self.prfaas_time(length), self.pdp_time(length))
        return c


@dataclass(frozen=True)
class LinkSignals:
    now: float
    interval_s: float  # since the previous signals
    delivered_bytes: float  # PrfaaS KV bytes the WAN delivered in the interval
    undelivered_bytes: float  # PrfaaS KV queued, unsent or in flight now
    retrans_share: float  # retransmitted share of the segments sent in the interval
    prfaas_backlog_s: float  # modelled prefill work queued per PrfaaS instance
    pdp_backlog_s: float  # the same per PD-P instance
    arrival_rate: float  # recent arrivals, req/s
    lengths: Sequence[float]  # recent requests' incremental lengths (tokens)
    tail_s: float | None = None  # mean KV transfer tail of the offloaded requests whose KV arrived in the interval


@dataclass(frozen=True)
class Loads:
    link: float
    prfaas: float
    pdp: float

    link_target: float = 1.0

    @property
    def peak(self) -> float:
        """The highest load, the link's scaled to the prefill stages' target (see ControlSpec)."""
        return max(self.link / self.link_target, self.prfaas, self.pdp)

    def text(self) -> str:
        return f"link {self.link:.2f}, prfaas {self.prfaas:.2f}, pd-p {self.pdp:.2f}"


@dataclass(frozen=True)
class ThresholdChange:
    at: float
    old: float
    new: float
    reason: str


@dataclass(frozen=True)
class ControlSample:
    """What one update saw and concluded (the router records every one)."""

    at: float
    delivered_bps: float
    bandwidth_bps: float  # the estimate after this update
    saturated: bool
    state: BandwidthState
    threshold: float
    loads: Loads  # predicted at the threshold in force after the update


class BandwidthController:
    def __init__(
        self,
        base_threshold: float,
        nominal_bps: float,
        model: StageModel,
        cfg: ControlSpec,
        max_length: float,
        candidates: int = 48,
    ) -> None:
        if base_threshold <= 0 or nominal_bps <= 0:
            raise ValueError("base threshold and nominal bandwidth must be > 0")
        self.nominal_bps = nominal_bps
        self.bandwidth_bps = nominal_bps
        self.model = model
        self.cfg = cfg
        self._max_length = max_length
        self._grid = candidates
        self._set_base(float(base_threshold))
        self.state: BandwidthState = "abundant"
        self._last_saturated = -math.inf
        self._delivered: list[float] = []
        self.changes: list[ThresholdChange] = []

    def _set_base(self, base: float) -> None:
        cfg = self.cfg
        self.base = base
        self.threshold = base
        lo = float(cfg.min_threshold) if cfg.min_threshold is not None else self.base / 4
        hi = float(cfg.max_threshold) if cfg.max_threshold is not None else max(self._max_length, self.base)
        self.t_min, self.t_max = max(lo, 1.0), max(hi, lo, 1.0)
        grid = np.geomspace(self.t_min, self.t_max, self._grid)
        self.candidates: list[float] = sorted({*map(float, grid), self.base})

    def rebase(self, base: float | None = None, pdp_instances: int | None = None) -> None:
        """The long-term loop moved: a new base threshold (the threshold returns to it at once and
        the candidates follow it) and/or a new number of PD-P instances."""
        if base is not None:
            if base <= 0:
                raise ValueError("base threshold must be > 0")
            self._set_base(float(base))
        if pdp_instances is not None:
            self.model = replace(self.model, pdp_instances=pdp_instances)

    def loads(self, t: float, s: LinkSignals, sample: _Sample | None = None) -> Loads:
        """Predicted utilisation of the link and both prefill stages with threshold t."""
        m = self.model
        smp = sample or _Sample.of(s.lengths, m)
        lam = s.arrival_rate
        horizon = self.cfg.horizon_s
        n_long, wan, t_pf, t_pd = smp.split(t)
        n = len(smp.lengths)
        p = n_long / n if n else 0.0
        bw = max(self.bandwidth_bps, 1.0)
        link = (lam * p * wan * 8.0 + s.undelivered_bytes * 8.0 / horizon) / bw
        prfaas = (
            lam * p * t_pf / m.prfaas_instances if m.prfaas_instances else (math.inf if p else 0.0)
        ) + s.prfaas_backlog_s / horizon
        pdp = (
            lam * (1 - p) * t_pd / m.pdp_instances if m.pdp_instances else (math.inf if p < 1 else 0.0)
        ) + s.pdp_backlog_s / horizon
        return Loads(link, prfaas, pdp, self.cfg.link_target_utilisation / self.cfg.target_utilisation)

    def _estimate(self, s: LinkSignals) -> tuple[float, bool]:
        delivered_bps = s.delivered_bytes * 8.0 / s.interval_s if s.interval_s > 0 else 0.0
        self._delivered.append(delivered_bps)
        del self._delivered[: -self.cfg.rate_window]
        # Undelivered KV worth seconds of link time, retransmissions, or the tails TTFT paid: the
        # link is the limit. The drain time is taken at no less than a quarter of the estimate: in a
        # quiet interval a single layer's KV in flight is no sign of a full link.
        drain_rate = max(delivered_bps, 0.25 * self.bandwidth_bps)
        drain_s = s.undelivered_bytes * 8.0 / drain_rate if drain_rate > 0 else 0.0
        saturated = (
            drain_s > self.cfg.saturated_s
            or s.retrans_share > self.cfg.retrans_limit
            or (s.tail_s is not None and s.tail_s > self.cfg.tail_limit_s)
        )
        if saturated:
            self._last_saturated = s.now
            # TCP's delivery dips after losses: the best of the last few intervals is what the link
            # gives (a windowed max, as BBR estimates bottleneck bandwidth).
            best = max(self._delivered)
            if best > 0:
                self.bandwidth_bps = min(best, self.nominal_bps)
        elif s.now - self._last_saturated >= self.cfg.hold_s:
            self.bandwidth_bps = min(self.nominal_bps, max(delivered_bps, self.bandwidth_bps * self.cfg.probe_growth))
        else:
            self.bandwidth_bps = min(self.nominal_bps, max(delivered_bps, self.bandwidth_bps))
        return delivered_bps, saturated

    def _plan(self, s: LinkSignals) -> tuple[float, Loads]:
        target = self.cfg.target_utilisation
        smp = _Sample.of(s.lengths, self.model)
        scored = [(t, self.loads(t, s, smp)) for t in self.candidates]
        ok = [(t, ld) for t, ld in scored if ld.peak <= target]
        if ok:
            return min(ok, key=lambda x: (abs(math.log(x[0] / self.base)), x[0]))
        return min(scored, key=lambda x: (round(x[1].peak, 3), abs(math.log(x[0] / self.base))))

    def update(self, s: LinkSignals, adjust: bool) -> tuple[ControlSample, ThresholdChange | None]:
        delivered_bps, saturated = self._estimate(s)
        change: ThresholdChange | None = None
        cfg = self.cfg
        if adjust and len(s.lengths) >= cfg.min_requests and s.arrival_rate > 0:
            new, planned = self._plan(s)
            now_loads = self.loads(self.threshold, s)
            if now_loads.peak <= cfg.target_utilisation:
                # Fine where it is: only go back toward the base threshold, to one that is fine too,
                # and a step at a time: the bandwidth estimate only grows by assumption, so offload
                # creeps back until the link shows where its limit is now.
                worth = planned.peak <= cfg.target_utilisation and abs(math.log(new / self.base)) < abs(
                    math.log(self.threshold / self.base)
                )
                step = cfg.recovery_step
                new = min(max(new, self.threshold / step), self.threshold * step)
                planned = self.loads(new, s)
            else:
                worth = planned.peak < now_loads.peak * (1 - cfg.min_gain)
                if new < self.threshold and self.bandwidth_bps < self.nominal_bps:
                    # More offload on a link believed short: a step at a time, as the estimate is a guess.
                    new = max(new, self.threshold / cfg.recovery_step)
                    planned = self.loads(new, s)
                    worth = planned.peak < now_loads.peak
            if abs(new - self.base) <= cfg.min_change * self.base:
                new = self.base  # close enough: land on the base, not a hair beside it
            if worth and (
                abs(new - self.threshold) > cfg.min_change * self.threshold
                or (new == self.base and self.threshold != self.base)
            ):
                tail = "" if s.tail_s is None else f", KV tail {s.tail_s:.2f} s"
                why = (
                    f"bandwidth {self.bandwidth_bps / 1e9:.1f} of {self.nominal_bps / 1e9:.0f} Gbit/s"
                    f"{' (saturated: ' if saturated else ' ('}{s.undelivered_bytes / 1e9:.2f} GB undelivered, "
                    f"{s.retrans_share:.2%} retransmitted{tail}); backlog prfaas {s.prfaas_backlog_s:.1f} s, "
                    f"pd-p {s.pdp_backlog_s:.1f} s per instance; predicted load at t={self.threshold:.0f}: "
                    f"{now_loads.text()} -> at t={new:.0f}: {planned.text()}"
                )
                change = ThresholdChange(s.now, self.threshold, new, why)
                self.changes.append(change)
                self.threshold = new
        loads = self.loads(self.threshold, s)
        self.state = "abundant" if not saturated and loads.link < cfg.abundant_utilisation else "scarce"
        return ControlSample(
            s.now, delivered_bps, self.bandwidth_bps, saturated, self.state, self.threshold, loads
        ), change


@dataclass(frozen=True)
class _Sample:
    """The recent lengths sorted, with running sums of each stage's per-request cost, so every
    candidate threshold costs a binary search."""

    lengths: np.ndarray
    wan: np.ndarray  # cumulative sums, with a leading 0
    prfaas: np.ndarray
    pdp: np.ndarray

    @classmethod
    def of(cls, lengths: Sequence[float], m: StageModel) -> _Sample:
        xs = np.sort(np.asarray(lengths, dtype=np.float64))
        costs = list(map(m.costs, xs.tolist()))

        def cum(i: int) -> np.ndarray:
            return np.concatenate(([0.0], np.cumsum([c[i] for c in costs])))

        return cls(xs, cum(0), cum(1), cum(2))

    def split(self, t: float) -> tuple[int, float, float, float]:
        """(requests above t, their mean WAN bytes, their mean PrfaaS time, mean PD-P time of the rest)."""
        n = len(self.lengths)
        k = int(np.searchsorted(self.lengths, t, side="right"))  # lengths <= t
        n_long = n - k
        wan = float(self.wan[-1] - self.wan[k]) / n_long if n_long else 0.0
        t_pf = float(self.prfaas[-1] - self.prfaas[k]) / n_long if n_long else 0.0
        t_pd = float(self.pdp[k]) / k if k else 0.0
        return n_long, wan, t_pf, t_pd
