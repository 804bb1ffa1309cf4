"""The router's background loops, wired to its state: time-series sampling, health probes, the
short-term bandwidth control loop (`testbed.live.link_control`: threshold and bandwidth state
follow the measured WAN) and the long-term role loop (`testbed.live.role_control`), each when
the scenario asks for it."""

from __future__ import annotations

import asyncio

from testbed.core.control.bandwidth import ControlSample, ThresholdChange
from testbed.core.control.longterm import RoleMeter
from testbed.core.control.longterm import controller_for as longterm_for
from testbed.core.control.short_term import controller_for
from testbed.live.link_control import LinkControl
from testbed.live.role_control import RoleControl
from testbed.live.router.probes import probe_forever
from testbed.live.router.state import RouterState
from testbed.live.series import sample_forever
from testbed.metrics.series_format import Sample, SeriesWriter
from testbed.model.retune import role_planner


def collect(st: RouterState) -> list[Sample]:
    """What the router samples into its time series (`RouterBooks.samples`)."""
    return [Sample(*x) for x in st.samples()]


def start_loops(st: RouterState, series: SeriesWriter, decisions: SeriesWriter) -> list[asyncio.Task[None]]:
    """Start every loop the scenario has; the caller cancels the tasks at shutdown."""
    cfg = st.cfg
    sc = cfg.deployment.scenario
    pol = sc.policy
    tasks = [
        asyncio.create_task(sample_forever(series, lambda: collect(st), cfg.sample_interval)),
        asyncio.create_task(probe_forever(st)),
    ]
    ctl = controller_for(sc, st.threshold, cfg.deployment.inter_dc.rate)
    if ctl is not None:

        def applied(sample: ControlSample, change: ThresholdChange | None) -> None:
            st.bandwidth_bps = sample.bandwidth_bps
            if pol.bandwidth_state == "auto":
                st.bandwidth = sample.state
            if change is not None:
                st.threshold = change.new

        def tails() -> list[float]:
            out, st.tails = st.tails, []
            return out

        st.keep_tails = True

        loop = LinkControl(
            cfg.deployment,
            ctl,
            st.session,
            st.recent,
            series,
            decisions,
            pol.bandwidth_aware,
            applied,
            tails,
            lambda: st.unroutable,
        )
        tasks.append(asyncio.create_task(loop.run()))
    lt = longterm_for(sc, st.threshold, role_planner(sc, cfg.deployment.inter_dc.rate))
    if lt is not None:
        assert st.history is not None  # the books keep it when the long-term loop is on
        st.unroutable = lt.roles.unroutable()

        def roles_applied(unroutable: frozenset[str], threshold: float | None) -> None:
            st.unroutable = unroutable
            if threshold is not None:
                st.threshold = threshold

        roles = RoleControl(
            cfg.deployment,
            lt,
            RoleMeter(sc, st.tracker, lt.roles, cfg.scale.speedup),
            st.session,
            st.history,
            series,
            decisions,
            st.health.down,
            roles_applied,
            ctl,
        )
        tasks.append(asyncio.create_task(roles.run()))
    return tasks
