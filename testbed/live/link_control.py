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
from collections.abc import Callable

import aiohttp

from testbed.core.control.bandwidth import BandwidthController, ControlSample, ThresholdChange
from testbed.core.control.short_term import Recent, SenderStatus, SignalMeter, change_line, control_series
from testbed.core.json_types import JSONObject
from testbed.core.schema.scaling import Scale
from testbed.live.clock import now
from testbed.live.common import fetch_status, status_number
from testbed.live.deployment import Deployment
from testbed.metrics.series_format import Sample, SeriesWriter

log = logging.getLogger("testbed.router.control")


class LinkControl:
    def __init__(
        self,
        dep: Deployment,
        controller: BandwidthController,
        session: aiohttp.ClientSession,
        recent: Recent,
        series: SeriesWriter,
        decisions: SeriesWriter,
        adjust: bool,
        on_sample: Callable[[ControlSample, ThresholdChange | None], None],
        tails: Callable[[], list[float]] = list,
        unroutable: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        sc = dep.scenario
        self.scale = Scale.from_spec(sc.scale)
        self.ctl = controller
        self.session = session
        self.recent = recent
        self.series = series
        self.decisions = decisions
        self.adjust = adjust
        self.on_sample = on_sample
        self.tails = tails  # KV transfer tails (wire s) since the last call
        self.unroutable = unroutable  # role slots not serving as prefill (the long-term loop)
        self.interval_wire = self.scale.wire_seconds(sc.policy.control.interval_s)
        kinds = {c.name: c.kind for c in sc.clusters}
        self.nodes = {nid: (kinds[n.cluster], n.http.url) for nid, n in dep.nodes.items() if n.role == "prefill"}
        self.meter = SignalMeter({nid: kind for nid, (kind, _) in self.nodes.items()}, self.scale)

    async def _status(self, url: str) -> JSONObject | None:
        return await fetch_status(self.session, url, max(self.interval_wire, 1.0))

    async def step(self) -> tuple[ControlSample, ThresholdChange | None] | None:
        ids = list(self.nodes)
        got = await asyncio.gather(*(self._status(self.nodes[i][1]) for i in ids))
        t = now()
        status = {
            nid: None
            if st is None
            else SenderStatus(
                status_number(st, "acked_bytes"),
                status_number(st, "retrans_segments"),
                status_number(st, "acked_segments"),
                status_number(st, "undelivered_bytes"),
                status_number(st, "queued_s", 0.0),
            )
            for nid, st in zip(ids, got)
        }
        sig = self.meter.signals(t, status, self.recent, self.tails, self.unroutable())
        if sig is None:
            return None
        sample, change = self.ctl.update(sig, self.adjust)
        self.series.write([Sample(*x) for x in control_series(sig, sample)], ts=t)
        if change is not None:
            self.decisions.write([Sample(*change_line(change))], ts=t)
            log.info("threshold %.0f -> %.0f: %s", change.old, change.new, change.reason)
        self.on_sample(sample, change)
        return sample, change

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad poll must not end the loop for the rest of the run
                log.exception("control step failed")
            await asyncio.sleep(self.interval_wire)
