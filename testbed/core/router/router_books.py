"""The router's books (I/O-free): everything routing reads and updates, the instances' health,
and the counters its gauges and time series show. Built once for a scenario
(`RouterBooks.for_scenario`); the live router's state (`testbed.live.router.state.RouterState`)
extends it with its sessions and writers, and the simulator holds one as it is, so both route
from the same books with the same health rules.

Times in the books are the driver's clock: wire seconds for the live router, paper seconds for
the simulator. `per_wire_s` says how many of the driver's seconds one wire second is (1 live,
the speedup in the simulator), so the health book probes every `PROBE_INTERVAL_S` wire seconds
in both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Self

from testbed.core.control.short_term import Recent, SeriesSample
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.router.health import PROBE_INTERVAL_S, STARTUP_GRACE_S, HealthBook, HealthChange, Outcome
from testbed.core.routing.cache_book import CacheBook, cache_book_for
from testbed.core.routing.load_aware import router_policy
from testbed.core.routing.load_tracker import LoadTracker
from testbed.core.routing.placement import Placement, placement_for
from testbed.core.routing.policy import BandwidthState, Decision, Policy
from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scenario import Scenario


@dataclass
class RoutePlan:
    """A routed request: the decision and what carrying it out needs."""

    d: Decision
    work: float  # modelled prefill in the driver's time unit (the tracker's backlog)
    hashes: tuple[int, ...]
    move_src: str | None = None  # prefill node that sends the moved cached prefix
    move_bytes_paper: int = 0
    rid: str = ""  # the request's id as the tracker booked it


@dataclass(kw_only=True)
class RouterBooks:
    policy: Policy
    tracker: LoadTracker
    kv: KVModel
    prefill_time: dict[str, PrefillTime]
    threshold: float | None
    health: HealthBook = field(default_factory=lambda: HealthBook(()))
    book: CacheBook | None = None
    placement: Placement | None = None  # None: least-loaded placement over cluster-wide pools
    recent: Recent = field(default_factory=lambda: Recent(200))
    cache_aware: bool = False
    bandwidth: BandwidthState = "scarce"
    bandwidth_bps: float | None = None  # the control loop's estimate of the inter-DC link (paper bit/s)
    history: Recent | None = None  # the long-term loop's window of arrivals
    unroutable: frozenset[str] = frozenset()  # role slots' nodes not in service (the long-term loop)
    inflight: int = 0
    cache_moves: int = 0
    retries: int = 0
    # KV transfer tails of offloaded requests (the driver's seconds), for the short-term loop,
    # which drains them each step; without that loop none is kept (a long run grew by a float
    # per offloaded request).
    tails: list[float] = field(default_factory=list)
    keep_tails: bool = False
    # Per cluster, its prefill time model and whether it is a PD cluster (`route_step`: filled
    # on the first request routed).
    per_cluster: dict[str, tuple[PrefillTime, bool]] = field(default_factory=dict, repr=False)

    def note_tail(self, seconds: float) -> None:
        """An offloaded request's KV transfer tail, for the short-term loop if one reads them."""
        if self.keep_tails:
            self.tails.append(seconds)

    @classmethod
    def for_scenario(
        cls,
        sc: Scenario,
        threshold: float | None,
        intra: LinkProfile,
        inter: LinkProfile,
        nodes: Iterable[str],
        per_wire_s: float = 1.0,
        **extra: Any,
    ) -> Self:
        """The books a router starts with for `sc`'s deployment of `nodes`; `extra`: the fields
        of a subclass."""
        pol = sc.policy
        kv = KVModel.from_spec(sc.model)
        return cls(
            policy=router_policy(sc, intra, inter),
            tracker=LoadTracker(sc),
            kv=kv,
            prefill_time={name: PrefillTime.from_spec(hw.prefill) for name, hw in sc.hardware.items()},
            threshold=threshold,
            book=cache_book_for(sc, kv),
            placement=placement_for(sc),
            recent=Recent(pol.control.window),
            cache_aware=pol.cache_aware,
            bandwidth="scarce" if pol.bandwidth_state == "auto" else pol.bandwidth_state,
            health=HealthBook(
                nodes, probe_interval_s=PROBE_INTERVAL_S * per_wire_s, startup_grace_s=STARTUP_GRACE_S * per_wire_s
            ),
            history=Recent(pol.control.long_term.window) if pol.control.long_term.enabled else None,
            **extra,
        )

    def down(self) -> frozenset[str]:
        """Instances routing avoids: those the health book took out and role slots not in service."""
        down = self.health.down()
        return down | self.unroutable if self.unroutable else down

    def note_health(
        self, node: str, outcome: Outcome, now: float, reason: str = "", probe: bool = False
    ) -> HealthChange | None:
        return self.health.report(node, outcome, now, reason, probe=probe)

    # -- what each step of a request does to the books (both drivers, in the request's order) --

    def prefilled(self, rid: str, plan: RoutePlan, input_tokens: int, moved: bool) -> None:
        """The prefill answered with its KV delivered (`moved`: a cached prefix moved in for it)."""
        if self.book is not None:
            if moved:
                self.book.moved(rid, plan.hashes, plan.d, plan.move_src)
            self.book.prefilled(rid, plan.hashes, input_tokens, plan.d)

    def kv_complete(self, rid: str, plan: RoutePlan, input_tokens: int) -> None:
        if self.book is not None:
            self.book.kv_complete(rid, plan.hashes, input_tokens, plan.d)

    def attempt_over(self, rid: str, plan: RoutePlan, prefill_seen: bool) -> None:
        """An attempt ended (done, failed or given up): its prefill's work if it never answered,
        and what it pinned in the cache pools, are released (its decode slot: `decode_done`)."""
        if not prefill_seen:
            self.tracker.prefill_done(plan.d, plan.work, plan.rid, plan.hashes)
        if self.book is not None:
            self.book.finished(rid, plan.d, plan.move_src)

    def samples(self) -> list[SeriesSample]:
        """What the router samples into its time series."""
        out: list[SeriesSample] = [("inflight", float(self.inflight), {})]
        if self.threshold is not None:
            out.append(("threshold", float(self.threshold), {}))
        active = self.tracker.active
        for node in self.tracker.prefill_backlog:
            out.append(("prefill_assigned", float(active[node]), {"node": node}))
        if self.book is not None:
            for name, pool in self.book.index.pools.items():
                lab = {"cluster": name}
                out += [
                    ("cache_used_bytes_paper", float(pool.used_bytes), lab),
                    ("cache_pinned_bytes_paper", float(pool.pinned_bytes), lab),
                    ("cache_hit_tokens", float(pool.stats.hit_tokens), lab),
                    ("cache_evicted_bytes_paper", float(pool.stats.evicted_bytes), lab),
                ]
            for name, by_node in self.book.index.instance_pools.items():
                for node, pool in by_node.items():
                    lab = {"cluster": name, "node": node}
                    out += [
                        ("cache_used_bytes_paper", float(pool.used_bytes), lab),
                        ("cache_hit_tokens", float(pool.stats.hit_tokens), lab),
                    ]
        return out


def decision_line(rid: str, d: Decision, bandwidth: BandwidthState) -> SeriesSample:
    """The `decisions.jsonl` sample of a routing decision."""
    return (
        "decision",
        float(d.incremental_tokens),
        {
            "request_id": rid,
            "prefill": d.prefill_node,
            "decode": d.decode_node,
            "cached": str(d.cached_tokens),
            "bandwidth": bandwidth,
            "threshold": "" if d.threshold is None else f"{d.threshold:g}",
            "reason": d.reason,
        },
    )


def health_line(ch: HealthChange) -> SeriesSample:
    """The `decisions.jsonl` sample of a health change."""
    return ("health", 1.0 if ch.new == "up" else 0.0, {"node": ch.node, "state": ch.new, "reason": ch.reason})
