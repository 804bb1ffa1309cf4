"""The router's load book-keeping (`LoadTracker`): what it assigned to each instance and what has
finished. The router sees every assignment, so this is exact without polling nodes. The live
router and the simulator both hold one (`testbed.core.router.router_books`).

`view()` lists, per cluster, just the least-loaded prefill instance (by backlog, then requests
assigned, then name) and the least-loaded decode instance (by requests assigned, then name),
among those not `down`. That is all any policy reads: every rule in `testbed.core.routing.policy` and
`testbed.core.routing.load_aware` takes minima over instances with those keys, so a policy decides
exactly as on the full listing (`full_view`, kept for the test that shows it), and a view costs
O(clusters) instead of O(instances), which a 10,000-GPU deployment needs. Heaps with lazy
deletion keep the minima: every change pushes the instance's new key, and a query drops the
stale tops. Instances out of service (`down`) leave the heaps while that set stays the same; a
new set rebuilds them once (faults and retries change it rarely).
"""

from __future__ import annotations

import heapq

from testbed.core.routing.placement import PrefillLoad, reads_held_blocks
from testbed.core.routing.policy import BandwidthState, ClusterView, Decision, InstanceLoad, View
from testbed.core.schema.scenario import Scenario
from testbed.core.schema.topology import role_slots

# Rebuild a heap once stale entries outnumber live ones this many times over.
_COMPACT = 4


class LoadTracker:
    """`assigned_work` adds up each prefill instance's routed work for good (the long-term loop
    reads stage loads from it). `inflight_tokens` and `inflight_blocks` count, per prefill
    instance, the uncached tokens and the blocks of the prompts routed there and not done (what
    `kv_overlap` placement weighs).

    Where placement reads blocks (`kv_overlap`, or a cluster whose prefill instances keep their own
    pools) the tracker also knows which blocks those prompts hold, by prefix hash: a block shared
    by several of them counts once in `inflight_blocks`, as Dynamo's router counts active blocks,
    and `held_prefix` tells how far a new prompt extends into blocks that prompts in flight on an
    instance will have computed when they end (`testbed.core.routing.placement`)."""

    def __init__(self, sc: Scenario) -> None:
        self._clusters = sc.clusters
        self._where = [(c.name, c.kind, c.datacenter) for c in sc.clusters]  # what a view names of each
        self._block = sc.model.block_tokens
        self._by_hash = reads_held_blocks(sc)
        # Per prefill instance: block hash -> the prompts in flight there holding it (oldest first);
        # and per prompt in flight, how many of its leading blocks are full (what its instance
        # caches when it ends).
        self._held: dict[str, dict[int, list[str]]] = {}
        self._full_blocks: dict[str, int] = {}
        self.inflight_tokens: dict[str, int] = {}
        self.inflight_blocks: dict[str, int] = {}
        self.prefill_backlog: dict[str, float] = {}
        self.assigned_work: dict[str, float] = {}
        self.active: dict[str, int] = {}
        self._ids: dict[str, tuple[list[str], list[str]]] = {}
        self._cluster_of: dict[str, str] = {}
        for c in sc.clusters:
            n_p, n_d = role_slots(sc, c)
            pn = [f"{c.name}-p{i}" for i in range(n_p)]
            dn = [f"{c.name}-d{i}" for i in range(n_d)]
            self._ids[c.name] = (pn, dn)
            for n in pn:
                self.inflight_tokens[n] = self.inflight_blocks[n] = 0
                self._held[n] = {}
                self.prefill_backlog[n] = 0.0
                self.assigned_work[n] = 0.0
                self.active[n] = 0
            for n in dn:
                self.active[n] = 0
            for n in pn + dn:
                self._cluster_of[n] = c.name
        self._down: frozenset[str] = frozenset()
        self._pheap: dict[str, list[tuple[float, int, str]]] = {}
        self._dheap: dict[str, list[tuple[int, str]]] = {}
        self._size: dict[str, int] = {}
        self._rebuild(frozenset())

    def node_ids(self, cluster: str) -> tuple[list[str], list[str]]:
        """The cluster's prefill and decode node ids."""
        return self._ids[cluster]

    # -- book-keeping --------------------------------------------------------------------------

    def assign(self, d: Decision, prefill_work: float, rid: str = "", hashes: tuple[int, ...] = ()) -> None:
        """Book request `rid` (its prompt's block `hashes`, where it has them) on its instances."""
        n, dn, inc = d.prefill_node, d.decode_node, d.incremental_tokens
        self.inflight_tokens[n] += inc
        self.inflight_blocks[n] += self._hold(n, rid, hashes, inc + d.cached_tokens)
        self.prefill_backlog[n] += prefill_work
        self.assigned_work[n] += prefill_work
        active = self.active
        active[n] += 1
        active[dn] += 1
        self._push_prefill(n)
        self._push_decode(dn)

    def prefill_done(self, d: Decision, prefill_work: float, rid: str = "", hashes: tuple[int, ...] = ()) -> None:
        """Request `rid`'s prefill answered or was given up (the arguments `assign` had)."""
        n, inc = d.prefill_node, d.incremental_tokens
        self.inflight_tokens[n] -= inc
        self.inflight_blocks[n] -= self._release(n, rid, hashes, inc + d.cached_tokens)
        left = self.prefill_backlog[n] - prefill_work
        self.active[n] -= 1
        # max(left, 0.0) without the call; none left in flight is none, not the float residue of
        # adding and taking the same works in another order (which then broke ties by backlog).
        self.prefill_backlog[n] = 0.0 if 0.0 > left or not self.active[n] else left
        self._push_prefill(n)

    def decode_done(self, d: Decision) -> None:
        self.active[d.decode_node] -= 1
        self._push_decode(d.decode_node)

    def _hold(self, node: str, rid: str, hashes: tuple[int, ...], tokens: int) -> int:
        """Book the prompt's blocks as held on `node`: the blocks no other prompt there held."""
        blocks = -(-tokens // self._block)
        if not self._by_hash or not hashes:
            return blocks
        held = self._held[node]
        ids = hashes[:blocks]
        new = blocks - len(ids)  # blocks without a hash are the prompt's own
        for h in ids:
            who = held.get(h)
            if who is None:
                held[h] = [rid]
                new += 1
            else:
                who.append(rid)
        self._full_blocks[rid] = tokens // self._block
        return new

    def _release(self, node: str, rid: str, hashes: tuple[int, ...], tokens: int) -> int:
        """Undo `_hold`: the blocks no prompt there holds any more."""
        blocks = -(-tokens // self._block)
        if not self._by_hash or not hashes:
            return blocks
        held = self._held[node]
        ids = hashes[:blocks]
        gone = blocks - len(ids)
        for h in ids:
            who = held[h]
            who.remove(rid)
            if not who:
                del held[h]
                gone += 1
        del self._full_blocks[rid]
        return gone

    def new_blocks(self, node: str, hashes: tuple[int, ...], input_tokens: int) -> int:
        """The prompt's blocks that no prompt in flight on `node` holds (Dynamo's new blocks)."""
        blocks = -(-input_tokens // self._block)
        if not self._by_hash or not hashes:
            return blocks
        held = self._held[node]
        ids = hashes[:blocks]
        return blocks - len(ids) + sum(1 for h in ids if h not in held)

    def held_prefix(self, node: str, hashes: tuple[int, ...], input_tokens: int, cached: int) -> tuple[int, str]:
        """How far past `cached` (tokens, whole blocks) the prompt's leading blocks are full blocks
        of prompts in flight on `node`, and the one of them the last such block waits for (the
        oldest holding it; "" when none extends the prefix). At most every block but the one with
        the prompt's last token, as a pool lookup gives."""
        held = self._held.get(node)
        if not held or not hashes:
            return cached, ""
        bt, full = self._block, self._full_blocks
        limit = min(max(input_tokens - 1, 0) // bt, len(hashes))
        i, holder = cached // bt, ""
        while i < limit:
            # The oldest prompt holding this block as one of its full blocks.
            r = next((r for r in held.get(hashes[i], ()) if full[r] > i), None)
            if r is None:
                break
            holder = r
            i += 1
        return (i * bt, holder) if holder else (cached, "")

    # -- views ---------------------------------------------------------------------------------

    def prefill_loads(
        self, cluster: str, down: frozenset[str], hashes: tuple[int, ...] = (), input_tokens: int = 0
    ) -> list[PrefillLoad]:
        """Every prefill instance of `cluster` not `down`, with what placement weighs (for a
        prompt of `input_tokens` with block `hashes`: its blocks new to each instance)."""
        return [
            PrefillLoad(
                n,
                self.prefill_backlog[n],
                self.active[n],
                self.inflight_tokens[n],
                self.inflight_blocks[n],
                self.new_blocks(n, hashes, input_tokens) if input_tokens else -1,
            )
            for n in self._ids[cluster][0]
            if n not in down
        ]

    def view(
        self,
        threshold: float | None,
        now: float = 0.0,
        down: frozenset[str] = frozenset(),
        bandwidth: BandwidthState = "scarce",
        bandwidth_bps: float | None = None,
        backlog_scale: float = 1.0,
    ) -> View:
        """What routing reads: the least-loaded instances of each cluster not `down`."""
        if down is not self._down and down != self._down:
            self._rebuild(down)
        best_p, best_d = self._best_prefill, self._best_decode
        cvs = tuple(ClusterView(name, kind, dc, best_p(name), best_d(name)) for name, kind, dc in self._where)
        return View(cvs, threshold, now, bandwidth, bandwidth_bps, backlog_scale)

    def full_view(
        self,
        threshold: float | None,
        now: float = 0.0,
        down: frozenset[str] = frozenset(),
        bandwidth: BandwidthState = "scarce",
        bandwidth_bps: float | None = None,
        backlog_scale: float = 1.0,
    ) -> View:
        """Every instance not `down` (what `view` stands for)."""
        cvs = []
        for c in self._clusters:
            pn, dn = self._ids[c.name]
            p = tuple(InstanceLoad(n, self.prefill_backlog[n], self.active[n]) for n in pn if n not in down)
            d = tuple(InstanceLoad(n, 0.0, self.active[n]) for n in dn if n not in down)
            cvs.append(ClusterView(c.name, c.kind, c.datacenter, p, d))
        return View(tuple(cvs), threshold, now, bandwidth, bandwidth_bps, backlog_scale)

    # -- the index -------------------------------------------------------------------------------

    def _rebuild(self, down: frozenset[str]) -> None:
        self._down = down
        for c in self._clusters:
            pn, dn = self._ids[c.name]
            self._size[c.name] = len(pn) + len(dn)
            self._pheap[c.name] = [self._pkey(n) for n in pn if n not in down]
            self._dheap[c.name] = [self._dkey(n) for n in dn if n not in down]
            heapq.heapify(self._pheap[c.name])
            heapq.heapify(self._dheap[c.name])

    def _pkey(self, node: str) -> tuple[float, int, str]:
        return (self.prefill_backlog[node], self.active[node], node)

    def _dkey(self, node: str) -> tuple[int, str]:
        return (self.active[node], node)

    def _push_prefill(self, node: str) -> None:
        if node in self._down:
            return
        c = self._cluster_of[node]
        h = self._pheap[c]
        heapq.heappush(h, self._pkey(node))
        if len(h) > _COMPACT * self._size[c] + 16:
            live = {e[2] for e in h}
            self._pheap[c] = h = [self._pkey(n) for n in live]
            heapq.heapify(h)

    def _push_decode(self, node: str) -> None:
        if node in self._down:
            return
        c = self._cluster_of[node]
        h = self._dheap[c]
        heapq.heappush(h, self._dkey(node))
        if len(h) > _COMPACT * self._size[c] + 16:
            live = {e[1] for e in h}
            self._dheap[c] = h = [self._dkey(n) for n in live]
            heapq.heapify(h)

    def _best_prefill(self, cluster: str) -> tuple[InstanceLoad, ...]:
        h = self._pheap[cluster]
        backlog, active = self.prefill_backlog, self.active
        while h:
            b, a, node = h[0]
            if b == backlog[node] and a == active[node]:  # the entry is the node's present key
                return (InstanceLoad(node, b, a),)
            heapq.heappop(h)
        return ()

    def _best_decode(self, cluster: str) -> tuple[InstanceLoad, ...]:
        h = self._dheap[cluster]
        active = self.active
        while h:
            a, node = h[0]
            if a == active[node]:
                return (InstanceLoad(node, 0.0, a),)
            heapq.heappop(h)
        return ()
