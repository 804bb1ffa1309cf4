"""The router's short-term loop in virtual time: every `policy.control.interval_s` the status of
each prefill instance, taken from the simulator's own accounting, goes through the same
`SignalMeter` as the live loop's polls (`testbed.live.link_control`) into the same
`BandwidthController`.

What the simulator reports for an instance, in paper units:
- acknowledged bytes: what its sender put on the wire (the live loop reads TCP-acknowledged
  bytes; in the fluid they differ by what is in flight, a round trip's worth);
- undelivered: its queued KV plus a round trip of in-flight bytes at the present rate;
- retransmissions: loss-based TCP retransmits what the link drops, so for `d` bytes delivered
  at loss L it sent d L / (1 - L) again; a dark link with KV waiting retransmits and delivers
  nothing (a share of 1);
- queued work: its prefill queue's modelled work waiting.
An instance that is down or paused does not answer (no status).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from testbed.core.control.bandwidth import BandwidthController
from testbed.core.control.short_term import SenderStatus, SignalMeter, change_line, control_series
from testbed.core.router.router_books import RouterBooks
from testbed.core.schema.scaling import Scale
from testbed.metrics.series_format import RawSample as Sample
from testbed.sim.events import CONTROL, Loop
from testbed.sim.net_view import Net
from testbed.sim.prefill import PrefillSim

Write = Callable[[float, list[Sample]], None]


class ControlLoop:
    def __init__(
        self,
        loop: Loop,
        net: Net,
        router: RouterBooks,
        prefill: dict[str, PrefillSim],
        controller: BandwidthController,
        interval_s: float,
        adjust: bool,
        follow_state: bool,
        busy: Callable[[], bool],
        answers: Callable[[str], bool],
        series: Write,
        decisions: Write,
    ) -> None:
        self.loop = loop
        self.net = net
        self.router = router
        router.keep_tails = True  # the tails this loop drains each step
        self.prefill = prefill
        self.ctl = controller
        self.interval = interval_s
        self.adjust = adjust
        self.follow_state = follow_state
        self.busy = busy
        self.answers = answers  # the instance answers a poll (up, not paused)
        self.series = series
        self.decisions = decisions
        self.meter = SignalMeter({nid: p.node.kind for nid, p in prefill.items()}, Scale())
        self.prfaas = [nid for nid, p in prefill.items() if p.node.kind == "prfaas"]
        # Per PrfaaS sender: (t, bytes sent) at the last poll, and its retransmitted segments so far.
        self._seen: dict[str, tuple[float, float]] = {}
        self._retrans: dict[str, float] = dict.fromkeys(self.prfaas, 0.0)
        self.updates = 0

    def start(self) -> None:
        self.loop.at(0.0, CONTROL, self._step)

    def _status(self, nid: str, t: float) -> SenderStatus | None:
        if not self.answers(nid):
            return None
        p = self.prefill[nid]
        queued_s = p.queue.waiting_work()
        if p.node.kind != "prfaas":
            return SenderStatus(0.0, 0.0, 0.0, 0.0, queued_s)
        net = self.net
        sent = net.sent_at(nid, t)
        queued = net.backlog(nid, t)
        wan = next(iter(net.wan.values()), None)
        rtt = 2.0 * wan.delay if wan is not None else 0.0
        mss = wan.tcp.mss_bytes if wan is not None else 1.0
        loss = max((lk.loss for lk in net.wan.values()), default=0.0)
        _, before = self._seen.get(nid, (t, sent))
        self._seen[nid] = (t, sent)
        delivered = max(sent - before, 0.0)
        if loss >= 1.0:
            self._retrans[nid] += 1.0 if queued > 0 else 0.0
        elif loss > 0:
            self._retrans[nid] += delivered / mss * loss / (1.0 - loss)
        return SenderStatus(sent, self._retrans[nid], sent / mss, queued + net.sent_rate(nid) * rtt, queued_s)

    def _step(self, _: Any) -> None:
        t = self.loop.now
        if self.busy():
            self.loop.at(t + self.interval, CONTROL, self._step)
        r = self.router

        def tails() -> list[float]:
            out, r.tails = r.tails, []
            return out

        sig = self.meter.signals(t, {nid: self._status(nid, t) for nid in self.prefill}, r.recent, tails, r.unroutable)
        if sig is None:
            return
        sample, change = self.ctl.update(sig, self.adjust)
        self.updates += 1
        self.series(t, control_series(sig, sample))
        r.bandwidth_bps = sample.bandwidth_bps
        if self.follow_state:
            r.bandwidth = sample.state
        if change is not None:
            self.decisions(t, [change_line(change)])
            r.threshold = change.new
