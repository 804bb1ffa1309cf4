"""The router's state: the books routing reads (`testbed.core.router_books.RouterBooks`) with the
router's sessions and writers, and what one request's attempt carries (`Progress`, `RequestFailed`)."""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from testbed.core.failures import Failure, FailureKind
from testbed.core.lifecycle import Event, Lifecycle
from testbed.core.record import RequestRecord
from testbed.core.router.health import HealthChange, Outcome
from testbed.core.router.request_ids import RequestIds
from testbed.core.router.router_books import RouterBooks, health_line
from testbed.live.common import ServiceConfig
from testbed.live.held import HeldRecords
from testbed.live.router.vllm_metrics import RouterMetrics
from testbed.metrics.series_format import Sample, SeriesWriter

log = logging.getLogger("testbed.router")


@dataclass(kw_only=True)
class RouterState(RouterBooks):
    """The books (`testbed.core.router.router_books`) and what the live router keeps beside them."""

    cfg: ServiceConfig
    session: aiohttp.ClientSession
    metrics: RouterMetrics
    decisions: SeriesWriter
    transfer_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(random.getrandbits(24) << 32))
    held: HeldRecords | None = None  # the deployment is held: the router writes the records
    ids: RequestIds = field(default_factory=RequestIds)

    def note_health(
        self, node: str, outcome: Outcome, now: float, reason: str = "", probe: bool = False
    ) -> HealthChange | None:
        change = super().note_health(node, outcome, now, reason, probe)
        if change is not None:
            log.warning("instance %s is %s: %s", change.node, change.new, change.reason)
            self.decisions.write([Sample(*health_line(change))])
        return change


def new_state(
    cfg: ServiceConfig,
    session: aiohttp.ClientSession,
    metrics: RouterMetrics,
    decisions: SeriesWriter,
    held: HeldRecords | None = None,
) -> RouterState:
    """The state a router starts with for `cfg`'s deployment and scenario."""
    dep = cfg.deployment
    return RouterState.for_scenario(
        dep.scenario,
        dep.threshold,
        dep.resolved.intra_dc,
        dep.inter_dc,
        dep.nodes,
        cfg=cfg,
        session=session,
        metrics=metrics,
        decisions=decisions,
        held=held,
    )


STATE = web.AppKey("router_state", RouterState)


class RequestFailed(Exception):
    """A request attempt that failed: why (for people), what kind of failure it is, which instance
    is to blame if one is, and what that says about it (`refused`: nothing answers there; `failed`:
    it answered badly or broke off). `at` is the instance it happened at, for the record: the one
    to blame unless told (a node that refused the request itself is not to blame)."""

    def __init__(
        self,
        reason: str,
        kind: FailureKind,
        node: str = "",
        outcome: Outcome = "failed",
        retryable: bool = True,
        at: str | None = None,
    ) -> None:
        super().__init__(reason)
        self.kind, self.node, self.outcome, self.retryable = kind, node, outcome, retryable
        self.at = node if at is None else at

    @property
    def failure(self) -> Failure:
        return Failure(self.kind, self.at, str(self))


def outcome_of(e: BaseException) -> Outcome:
    """A connection that cannot be made (refused, no route) proves nothing answers there; a
    timeout or a broken reply may be passing."""
    return "refused" if isinstance(e, aiohttp.ClientConnectorError) else "failed"


@dataclass
class Progress:
    """One request as the router sees it: its lifecycle and the record the final chunk carries.
    Over an engine protocol (`testbed.live.router.engines`) the nodes report no stamps: the
    lifecycle runs on the events the router `observed`, and `node_request_id` is the id the
    nodes logged the attempt's stamps under (`testbed.live.stage_log`)."""

    life: Lifecycle
    rec: RequestRecord
    observed: list[tuple[float, Event]] | None = None
    node_request_id: str = ""
