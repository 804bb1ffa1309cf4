"""The router's short-term control loop, live: poll the prefill nodes, feed the I/O-free
`BandwidthController`, apply what it decides (threshold, bandwidth state) and record it.

Every `policy.control.interval_s` (paper seconds) it reads each prefill node's `/status`: the
PrfaaS senders' TCP-acknowledged bytes, retransmissions and undelivered KV (their egress is all
WAN traffic), and every node's queued prefill work; the router hands it the KV transfer tails
its offloaded requests paid since the last update. Signals go to the controller in paper units.
Each update is a sample in the router's time series; each threshold change is a line in
`decisions.jsonl` with its reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from testbed.core.bandwidth import BandwidthController, ControlSample, LinkSignals, StageModel, ThresholdChange
from testbed.core.kvsize import KVModel
from testbed.core.scaling import Scale
from testbed.core.scenario import Scenario
from testbed.core.servicetime import PrefillTime
from testbed.live.clock import now
from testbed.live.deployment import Deployment
from testbed.metrics.series_format import Sample, SeriesWriter

log = logging.getLogger("testbed.router.control")


@dataclass
class Recent:
    """Recent arrivals (paper seconds) and their incremental lengths, for the planner."""

    window: int
    times: deque[float] = field(default_factory=deque)
    lengths: deque[float] = field(default_factory=deque)

    def add(self, t: float, length: float) -> None:
        self.times.append(t)
        self.lengths.append(length)
        while len(self.times) > self.window:
            self.times.popleft()
            self.lengths.popleft()

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


@dataclass
class _Totals:
    acked: int = 0
    retrans: int = 0
    segments: int = 0


class LinkControl:
    def __init__(self, dep: Deployment, controller: BandwidthController, session: aiohttp.ClientSession,
                 recent: Recent, series: SeriesWriter, decisions: SeriesWriter, adjust: bool,
                 on_sample: Callable[[ControlSample, ThresholdChange | None], None],
                 tails: Callable[[], list[float]] = list) -> None:
        sc = dep.scenario
        self.scale = Scale.from_spec(sc.scale)
        self.ctl = controller
        self.session = session
        self.recent = recent
        self.series = series
        self.decisions = decisions
        self.adjust = adjust
        self.on_sample = on_sample
        self.tails = tails          # KV transfer tails (wire s) since the last call
        self.interval_wire = self.scale.wire_seconds(sc.policy.control.interval_s)
        kinds = {c.name: c.kind for c in sc.clusters}
        self.nodes = {nid: (kinds[n.cluster], n.http.url) for nid, n in dep.nodes.items() if n.role == "prefill"}
        self._prev: _Totals | None = None
        self._prev_t = 0.0

    async def _status(self, url: str) -> dict[str, Any] | None:
        try:
            async with self.session.get(f"{url}/status",
                                        timeout=aiohttp.ClientTimeout(total=max(self.interval_wire, 1.0))) as r:
                if r.status != 200:
                    return None
                body: dict[str, Any] = await r.json()
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def step(self) -> tuple[ControlSample, ThresholdChange | None] | None:
        ids = list(self.nodes)
        got = await asyncio.gather(*(self._status(self.nodes[i][1]) for i in ids))
        t = now()
        tot = _Totals()
        undelivered = 0.0
        queued = {"prfaas": 0.0, "pd": 0.0}
        count = {"prfaas": 0, "pd": 0}
        for nid, st in zip(ids, got):
            kind = self.nodes[nid][0]
            count[kind] += 1
            if st is None:
                continue
            queued[kind] += float(st.get("queued_s", 0.0))
            if kind == "prfaas":
                tot.acked += int(st["acked_bytes"])
                tot.retrans += int(st["retrans_segments"])
                tot.segments += int(st["acked_segments"])
                undelivered += float(st["undelivered_bytes"])
        prev, prev_t = self._prev, self._prev_t
        self._prev, self._prev_t = tot, t
        if prev is None:
            return None
        sc = self.scale
        paper_now = t * sc.speedup
        tails = self.tails()
        sig = LinkSignals(
            now=paper_now,
            interval_s=(t - prev_t) * sc.speedup,
            delivered_bytes=max(tot.acked - prev.acked, 0) * sc.byte_scale,
            undelivered_bytes=undelivered * sc.byte_scale,
            # Retransmitted share of the segments put on the wire in the interval.
            retrans_share=max(tot.retrans - prev.retrans, 0) / max(tot.segments - prev.segments
                                                                   + tot.retrans - prev.retrans, 1),
            prfaas_backlog_s=queued["prfaas"] * sc.speedup / max(count["prfaas"], 1),
            pdp_backlog_s=queued["pd"] * sc.speedup / max(count["pd"], 1),
            arrival_rate=self.recent.rate(paper_now),
            lengths=tuple(self.recent.lengths),
            tail_s=sum(tails) / len(tails) * sc.speedup if tails else None,
        )
        sample, change = self.ctl.update(sig, self.adjust)
        self.series.write([
            Sample("wan_delivered_bps_paper", sample.delivered_bps, {}),
            Sample("wan_bandwidth_estimate_bps_paper", sample.bandwidth_bps, {}),
            Sample("wan_undelivered_bytes_paper", sig.undelivered_bytes, {}),
            Sample("wan_retrans_share", sig.retrans_share, {}),
            Sample("wan_saturated", 1.0 if sample.saturated else 0.0, {}),
            *([Sample("kv_tail_s_paper", sig.tail_s, {})] if sig.tail_s is not None else []),
            Sample("bandwidth_abundant", 1.0 if sample.state == "abundant" else 0.0, {}),
            Sample("planned_load", sample.loads.link, {"stage": "link"}),
            Sample("planned_load", sample.loads.prfaas, {"stage": "prfaas"}),
            Sample("planned_load", sample.loads.pdp, {"stage": "pdp"}),
            Sample("prefill_queued_s_paper", sig.prfaas_backlog_s, {"stage": "prfaas"}),
            Sample("prefill_queued_s_paper", sig.pdp_backlog_s, {"stage": "pdp"}),
        ], ts=t)
        if change is not None:
            self.decisions.write([Sample("threshold_change", change.new,
                                         {"old": f"{change.old:.0f}", "reason": change.reason})], ts=t)
            log.info("threshold %.0f -> %.0f: %s", change.old, change.new, change.reason)
        self.on_sample(sample, change)
        return sample, change

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:     # a bad poll must not end the loop for the rest of the run
                log.exception("control step failed")
            await asyncio.sleep(self.interval_wire)
