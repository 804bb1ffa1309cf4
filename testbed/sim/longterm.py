"""The router's long-term loop in virtual time: every `long_term.sample_s` the prefill stages'
signals from the router's books (`RoleMeter`), the decode batches of the routed PD-D instances
read directly, fed to the same `LongTermController` the live router runs
(`testbed.live.role_control`). Its decisions change what the router may route to (the slots'
roles), the threshold, and the short-term loop's base; each goes to `decisions.jsonl`, the
instance counts and stage loads to the router's time series.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from testbed.core.control.bandwidth import BandwidthController
from testbed.core.control.longterm import DecodeSignals, LongTermController, RoleMeter, apply, role_series
from testbed.core.router.router_books import RouterBooks
from testbed.metrics.series_format import RawSample as Sample
from testbed.sim.decode import DecodeSim
from testbed.sim.events import CONTROL, Loop

Write = Callable[[float, list[Sample]], None]


class RoleLoop:
    def __init__(
        self,
        loop: Loop,
        router: RouterBooks,
        decode: dict[str, DecodeSim],
        ctl: LongTermController,
        meter: RoleMeter,
        bandwidth: Callable[[], BandwidthController | None],
        busy: Callable[[], bool],
        answers: Callable[[str], bool],
        series: Write,
        decisions: Write,
    ) -> None:
        self.loop = loop
        self.router = router
        self.decode = decode
        self.ctl = ctl
        self.meter = meter
        self.bandwidth = bandwidth
        self.busy = busy
        self.answers = answers  # the instance answers a poll (up, not paused)
        self.series = series
        self.decisions = decisions
        self.interval = ctl.cfg.sample_s
        self._prev: float | None = None
        router.unroutable = ctl.roles.unroutable()

    def start(self) -> None:
        self.loop.at(0.0, CONTROL, self._step)

    def _decode_signals(self, down: frozenset[str]) -> DecodeSignals:
        # As the live loop: the instances in service that answer (one that does not is no capacity).
        nodes = [n for n in self.ctl.roles.routable("decode") if n not in down and self.answers(n)]
        batches = [self.decode[n].batch for n in nodes]
        bs_max = next(iter(self.decode.values())).batch.bs_max if self.decode else 1
        return DecodeSignals(
            len(nodes), float(sum(b.n_running for b in batches)), float(sum(b.n_waiting for b in batches)), bs_max
        )

    def _step(self, _: Any) -> None:
        t = self.loop.now
        if self.busy():
            self.loop.at(t + self.interval, CONTROL, self._step)
        prev, self._prev = self._prev, t
        if prev is None:
            return
        ctl = self.ctl
        judged = len(ctl.assessments)
        down = self.router.health.down()
        sig = self.meter.signals(t, t - prev, self._decode_signals(down), down, self.router.history)
        made = ctl.update(sig)
        r = self.router
        r.unroutable = ctl.roles.unroutable()
        done = apply(ctl, made, self.bandwidth())
        if done.threshold is not None:
            r.threshold = done.threshold
        if done.lines:
            self.decisions(t, done.lines)
        self.series(t, role_series(ctl, len(ctl.assessments) > judged))
