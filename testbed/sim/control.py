"""The router's short-term loop in virtual time: the inputs `testbed.live.link_control` polls
from the prefill nodes, taken from the simulator's own accounting, fed to the same
`BandwidthController` every `policy.control.interval_s`.

- delivered: bytes the PrfaaS senders put on the wire in the interval (the live loop reads
  TCP-acknowledged bytes; in the fluid they differ by what is in flight, a round trip's worth);
- undelivered: their queued KV plus a round trip of in-flight bytes at the present rate;
- retransmitted share: the WAN loss in force while they send (loss-based TCP retransmits
  what the link drops), else 0;
- backlogs: modelled prefill work waiting per instance of each stage;
- arrivals and lengths from the router's `Recent`, tails of the offloaded requests since the
  last update.
"""

from __future__ import annotations

from typing import Any, Callable

from testbed.core.bandwidth import BandwidthController, LinkSignals
from testbed.core.control import change_line, control_series
from testbed.sim.events import CONTROL, EventLoop
from testbed.sim.network import Network
from testbed.sim.prefill import PrefillSim
from testbed.sim.router import SimRouter
from testbed.metrics.series_format import RawSample as Sample

Write = Callable[[float, list[Sample]], None]


class ControlLoop:
    def __init__(self, loop: EventLoop, net: Network, router: SimRouter, prefill: dict[str, PrefillSim],
                 controller: BandwidthController, interval_s: float, adjust: bool, follow_state: bool,
                 busy: Callable[[], bool], series: Write, decisions: Write) -> None:
        self.loop = loop
        self.net = net
        self.router = router
        self.prefill = prefill
        self.ctl = controller
        self.interval = interval_s
        self.adjust = adjust
        self.follow_state = follow_state
        self.busy = busy
        self.series = series
        self.decisions = decisions
        self.prfaas = [nid for nid, p in prefill.items() if p.node.kind == "prfaas"]
        self._prev: tuple[float, float] | None = None     # (t, delivered bytes so far)
        self.updates = 0

    def start(self) -> None:
        self.loop.at(0.0, CONTROL, self._step)

    def _delivered(self, t: float) -> float:
        return sum(self.net.sent[n].at(t) for n in self.prfaas)

    def _queued(self, t: float) -> float:
        return sum(p.queued(t) for n in self.prfaas for p in self.net.greedy_of[n])

    def _step(self, _: Any) -> None:
        t = self.loop.now
        if self.busy():
            self.loop.at(t + self.interval, CONTROL, self._step)
        delivered = self._delivered(t)
        prev, self._prev = self._prev, (t, delivered)
        if prev is None:
            return
        net = self.net
        wan = next(iter(net.wan.values()), None)
        rtt = 2.0 * wan.delay if wan is not None else 0.0
        in_flight = sum(net.sent[n].rate for n in self.prfaas) * rtt
        queued = self._queued(t)
        sending = delivered > prev[1] or queued > 0
        loss = max((lk.loss for lk in net.wan.values()), default=0.0)
        r = self.router
        backlog = {"prfaas": 0.0, "pd": 0.0}
        count = {"prfaas": 0, "pd": 0}
        out = r.unroutable      # role slots not serving as prefill (the long-term loop)
        for nid, p in self.prefill.items():
            if nid in out:
                continue
            backlog[p.node.kind] += p.queue.waiting_work()
            count[p.node.kind] += 1
        tails, r.tails = r.tails, []
        sig = LinkSignals(
            now=t,
            interval_s=t - prev[0],
            delivered_bytes=max(delivered - prev[1], 0.0),
            undelivered_bytes=queued + in_flight,
            retrans_share=min(loss, 1.0) if sending else 0.0,
            prfaas_backlog_s=backlog["prfaas"] / max(count["prfaas"], 1),
            pdp_backlog_s=backlog["pd"] / max(count["pd"], 1),
            arrival_rate=r.recent.rate(t),
            lengths=tuple(r.recent.lengths),
            tail_s=sum(tails) / len(tails) if tails else None,
        )
        sample, change = self.ctl.update(sig, self.adjust)
        self.updates += 1
        self.series(t, control_series(sig, sample))
        r.bandwidth_bps = sample.bandwidth_bps
        if self.follow_state:
            r.bandwidth = sample.state
        if change is not None:
            self.decisions(t, [change_line(change)])
            r.threshold = change.new
