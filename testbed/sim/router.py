"""The router's state in the simulator: the same books as the live router's (`RouterState`),
driven through `testbed.core.routing.route` and the core tracker, cache book and controller."""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.core.cache_book import CacheBook, cache_book_for
from testbed.core.control import Recent
from testbed.core.kvsize import KVModel
from testbed.core.linkprofile import LinkProfile
from testbed.core.load_aware import router_policy
from testbed.core.load_index import IndexedLoadTracker
from testbed.core.policy import BandwidthState, LoadTracker, Policy
from testbed.core.scenario import Scenario
from testbed.core.servicetime import PrefillTime
from testbed.metrics.series_format import RawSample as Sample


@dataclass
class SimRouter:
    policy: Policy
    tracker: LoadTracker
    kv: KVModel
    prefill_time: dict[str, PrefillTime]
    book: CacheBook | None
    recent: Recent
    cache_aware: bool
    threshold: float | None
    bandwidth: BandwidthState
    bandwidth_bps: float | None = None     # the control loop's estimate of the inter-DC link (paper bit/s)
    inflight: int = 0
    cache_moves: int = 0
    tails: list[float] = field(default_factory=list)   # KV transfer tails of offloaded requests (paper s)
    history: Recent | None = None      # the long-term loop's window of arrivals
    unroutable: frozenset[str] = frozenset()   # role slots' nodes not in service (the long-term loop)

    @classmethod
    def for_scenario(cls, sc: Scenario, threshold: float | None, intra: LinkProfile,
                     inter: LinkProfile) -> "SimRouter":
        pol = sc.policy
        kv = KVModel.from_spec(sc.model)
        return cls(
            policy=router_policy(sc, intra, inter), tracker=IndexedLoadTracker(sc), kv=kv,
            prefill_time={name: PrefillTime.from_spec(hw.prefill) for name, hw in sc.hardware.items()},
            book=cache_book_for(sc, kv), recent=Recent(pol.control.window), cache_aware=pol.cache_aware,
            threshold=threshold, bandwidth="scarce" if pol.bandwidth_state == "auto" else pol.bandwidth_state,
            history=Recent(pol.control.long_term.window) if pol.control.long_term.enabled else None,
        )

    def samples(self) -> list[Sample]:
        """What the live router samples (`testbed.live.router._collect`)."""
        out: list[Sample] = [("inflight", float(self.inflight), {})]
        if self.threshold is not None:
            out.append(("threshold", float(self.threshold), {}))
        active = self.tracker.active
        for node in self.tracker.prefill_backlog:
            out.append(("prefill_assigned", float(active[node]), {"node": node}))
        if self.book is not None:
            for name, pool in self.book.index.pools.items():
                lab = {"cluster": name}
                out += [("cache_used_bytes_paper", float(pool.used_bytes), lab),
                        ("cache_pinned_bytes_paper", float(pool.pinned_bytes), lab),
                        ("cache_hit_tokens", float(pool.stats.hit_tokens), lab),
                        ("cache_evicted_bytes_paper", float(pool.stats.evicted_bytes), lab)]
        return out
