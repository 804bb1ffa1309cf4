"""`LoadTracker` with an index for deployments of many instances.

The same book-keeping as `LoadTracker` (it only adds to it), but `view()` lists, per cluster,
just the least-loaded prefill instance (by backlog, then requests assigned, then name) and the
least-loaded decode instance (by requests assigned, then name). That is all any policy reads:
every rule in `testbed.core.policy` takes minima over instances with those keys, so a policy
decides exactly as on the full view, and a view costs O(clusters) instead of O(instances).
Heaps with lazy deletion keep the minima: every change pushes the instance's new key, and a
query drops the stale tops.
"""

from __future__ import annotations

import heapq

from testbed.core.policy import BandwidthState, ClusterView, Decision, InstanceLoad, LoadTracker, View
from testbed.core.scenario import Scenario

# Rebuild a heap once stale entries outnumber live ones this many times over.
_COMPACT = 4


class IndexedLoadTracker(LoadTracker):
    def __init__(self, sc: Scenario) -> None:
        super().__init__(sc)
        self._cluster_of: dict[str, str] = {}
        self._pheap: dict[str, list[tuple[float, int, str]]] = {}
        self._dheap: dict[str, list[tuple[int, str]]] = {}
        self._size: dict[str, int] = {}
        for c in sc.clusters:
            pn, dn = self.node_ids(c.name)
            self._size[c.name] = len(pn) + len(dn)
            for n in pn + dn:
                self._cluster_of[n] = c.name
            self._pheap[c.name] = [self._pkey(n) for n in pn]
            self._dheap[c.name] = [self._dkey(n) for n in dn]
            heapq.heapify(self._pheap[c.name])
            heapq.heapify(self._dheap[c.name])

    def _pkey(self, node: str) -> tuple[float, int, str]:
        return (self.prefill_backlog[node], self.active[node], node)

    def _dkey(self, node: str) -> tuple[int, str]:
        return (self.active[node], node)

    def _push_prefill(self, node: str) -> None:
        c = self._cluster_of[node]
        h = self._pheap[c]
        heapq.heappush(h, self._pkey(node))
        if len(h) > _COMPACT * self._size[c] + 16:
            live = {e[2] for e in h}
            self._pheap[c] = h = [self._pkey(n) for n in live]
            heapq.heapify(h)

    def _push_decode(self, node: str) -> None:
        c = self._cluster_of[node]
        h = self._dheap[c]
        heapq.heappush(h, self._dkey(node))
        if len(h) > _COMPACT * self._size[c] + 16:
            live = {e[1] for e in h}
            self._dheap[c] = h = [self._dkey(n) for n in live]
            heapq.heapify(h)

    def assign(self, d: Decision, prefill_work: float) -> None:
        super().assign(d, prefill_work)
        self._push_prefill(d.prefill_node)
        self._push_decode(d.decode_node)

    def prefill_done(self, d: Decision, prefill_work: float) -> None:
        super().prefill_done(d, prefill_work)
        self._push_prefill(d.prefill_node)

    def decode_done(self, d: Decision) -> None:
        super().decode_done(d)
        self._push_decode(d.decode_node)

    def _best_prefill(self, cluster: str) -> tuple[InstanceLoad, ...]:
        h = self._pheap[cluster]
        while h:
            key = h[0]
            if key == self._pkey(key[2]):
                return (InstanceLoad(key[2], key[0], key[1]),)
            heapq.heappop(h)
        return ()

    def _best_decode(self, cluster: str) -> tuple[InstanceLoad, ...]:
        h = self._dheap[cluster]
        while h:
            key = h[0]
            if key == self._dkey(key[1]):
                return (InstanceLoad(key[1], 0.0, key[0]),)
            heapq.heappop(h)
        return ()

    def view(self, threshold: float | None, now: float = 0.0, down: frozenset[str] = frozenset(),
             bandwidth: BandwidthState = "scarce", bandwidth_bps: float | None = None,
             backlog_scale: float = 1.0) -> View:
        if down:
            return super().view(threshold, now, down, bandwidth, bandwidth_bps, backlog_scale)
        cvs = tuple(ClusterView(c.name, c.kind, c.datacenter, self._best_prefill(c.name), self._best_decode(c.name))
                    for c in self._clusters)
        return View(cvs, threshold, now, bandwidth, bandwidth_bps, backlog_scale)
