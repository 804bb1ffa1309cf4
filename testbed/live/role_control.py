"""The router's long-term loop, live: every `long_term.sample_s` (paper seconds) read the decode
batches of the PD-D instances in service (each node's `/status`), take the prefill stages' loads
from the router's own books (`RoleMeter`), feed the I/O-free `LongTermController` and carry out
what it decides.

A conversion changes nothing on the nodes (`testbed.core.control.roles`): the router stops picking the
draining instance (its slot's nodes join the set routing avoids, beside the instances the health
book took out), the requests already there run to the end, and once the router's books show
nothing left on it the slot's node of the other role is picked again. A retuned threshold is the
router's at once and the short-term loop's new base. Every decision is a line in
`decisions.jsonl` (a retune also a threshold change); instance counts per role and the stage
loads it judged are router time-series samples.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from testbed.core.control.bandwidth import BandwidthController
from testbed.core.control.longterm import DecodeSignals, LongTermController, RoleMeter, apply, role_series
from testbed.core.control.short_term import Recent
from testbed.core.json_types import JSONObject
from testbed.core.schema.scaling import Scale
from testbed.live.clock import now
from testbed.live.common import fetch_status, status_number
from testbed.live.deployment import Deployment
from testbed.metrics.series_format import Sample, SeriesWriter

log = logging.getLogger("testbed.router.longterm")


class RoleControl:
    def __init__(
        self,
        dep: Deployment,
        ctl: LongTermController,
        meter: RoleMeter,
        session: aiohttp.ClientSession,
        recent: Recent,
        series: SeriesWriter,
        decisions: SeriesWriter,
        down: Callable[[], frozenset[str]],
        applied: Callable[[frozenset[str], float | None], None],
        bandwidth: BandwidthController | None = None,
    ) -> None:
        self.scale = Scale.from_spec(dep.scenario.scale)
        self.dep = dep
        self.ctl = ctl
        self.meter = meter
        self.session = session
        self.recent = recent
        self.series = series
        self.decisions = decisions
        self.down = down  # instances the health book took out
        self.applied = applied  # (nodes not to route to, new threshold or None)
        self.bandwidth = bandwidth
        self.interval_wire = self.scale.wire_seconds(ctl.cfg.sample_s)
        self._prev: float | None = None
        sc = dep.scenario
        decode = sc.hardware[sc.cluster(ctl.roles.cluster).hardware].decode
        self.bs_max = decode.bs_max if decode is not None else 1

    async def _status(self, node: str) -> JSONObject | None:
        return await fetch_status(self.session, self.dep.nodes[node].http.url, max(self.interval_wire, 1.0))

    async def _decode(self, down: frozenset[str]) -> DecodeSignals:
        nodes = [n for n in self.ctl.roles.routable("decode") if n not in down]
        got = [g for g in await asyncio.gather(*(self._status(n) for n in nodes)) if g is not None]
        # An instance that did not answer counts as no capacity: it is not serving either.
        return DecodeSignals(
            len(got),
            float(sum(int(status_number(g, "running")) for g in got)),
            float(sum(int(status_number(g, "waiting")) for g in got)),
            self.bs_max,
        )

    async def step(self) -> None:
        down = self.down()
        dec = await self._decode(down)
        t = now()
        prev, self._prev = self._prev, t
        if prev is None:
            return
        ctl = self.ctl
        judged = len(ctl.assessments)
        k = self.scale.speedup
        sig = self.meter.signals(t * k, (t - prev) * k, dec, down, self.recent)
        made = ctl.update(sig)
        done = apply(ctl, made, self.bandwidth)
        self.applied(ctl.roles.unroutable(), done.threshold)
        for d in made:
            log.info("long-term %s %s: %s", d.action, d.node, d.reason)
        if done.lines:
            self.decisions.write([Sample(*x) for x in done.lines], ts=t)
        self.series.write([Sample(*x) for x in role_series(ctl, len(ctl.assessments) > judged)], ts=t)

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad poll must not end the loop for the rest of the run
                log.exception("long-term step failed")
            await asyncio.sleep(self.interval_wire)
