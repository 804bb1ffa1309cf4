"""The global KV cache manager's bookkeeping: what each step of a request does to the pools
(I/O-free; the live router and any other driver call these in the request's order).

- routed: the prefix the prefill reuses is pinned in its cluster (it is being read), and so is
  the source of a cache move;
- moved: the moved prefix now sits in the destination's pool; the source is free again;
- prefilled: the prompt's full blocks and a linear state at its last block boundary enter the
  prefill cluster's pool; if the KV crosses to another cluster, those blocks stay pinned and
  the tail (partial block and final linear state) is held as transfer-cache;
- kv_complete: the transfer ended, so its hold is freed; the decode cluster's pool gains the
  prompt too (the decode instance holds that KV and writes it to its cluster's pool);
- finished: whatever the request still pins or holds is released (also on failure).
"""

from __future__ import annotations

from collections.abc import Sequence

from testbed.core.engine.kvsize import KVModel
from testbed.core.routing.policy import Decision
from testbed.core.routing.prefix_cache import CacheIndex, PrefixPool, new_pool
from testbed.core.schema.scenario import Scenario, node_id
from testbed.core.schema.topology import role_slots


class CacheBook:
    """`move_src`: the node sending a moved prefix (its pool, where its cluster keeps one per
    prefill instance; `cache_scope: instance`, where the prefill node's own pool is the one read
    and filled, and a decode cluster has none its instances read)."""

    def __init__(self, index: CacheIndex) -> None:
        self.index = index
        # The pools that keep a prefix cache at all, by cluster (an index's pools are fixed).
        self._caching = {name: p for name, p in index.pools.items() if p.capacity_bytes > 0}
        self._pool = self._caching.get
        self._instance = {
            c: {n: p for n, p in by_node.items() if p.capacity_bytes > 0} for c, by_node in index.instance_pools.items()
        }

    def _at(self, cluster: str, node: str | None) -> PrefixPool | None:
        if self._instance and (by_node := self._instance.get(cluster)) is not None:
            return by_node.get(node) if node is not None else None
        return self._pool(cluster)

    def routed(self, rid: str, hash_ids: Sequence[int], d: Decision, move_src: str | None = None) -> None:
        mv = d.cache_move
        own = mv.from_tokens if mv is not None else d.cached_tokens
        if own and (pool := self._at(d.prefill_cluster, d.prefill_node)):
            pool.touch_and_pin(f"{rid}:read", hash_ids, own)
        if mv is not None and (src := self._at(mv.src_cluster, move_src)):
            src.touch_and_pin(f"{rid}:move", hash_ids, mv.tokens)

    def moved(self, rid: str, hash_ids: Sequence[int], d: Decision, move_src: str | None = None) -> None:
        mv = d.cache_move
        if mv is None:
            return
        if src := self._at(mv.src_cluster, move_src):
            src.unpin(f"{rid}:move")
        if dst := self._at(mv.dst_cluster, d.prefill_node):
            dst.insert(hash_ids, mv.tokens)
            dst.pin(f"{rid}:read", hash_ids, mv.tokens)

    def prefilled(self, rid: str, hash_ids: Sequence[int], input_tokens: int, d: Decision) -> None:
        pool = self._at(d.prefill_cluster, d.prefill_node)
        if pool is None:
            return
        pool.unpin(f"{rid}:read")
        pool.insert(hash_ids, input_tokens)
        if d.crossed_wan:
            pool.pin(f"{rid}:xfer", hash_ids, input_tokens)
            pool.hold(f"{rid}:xfer", pool.tail_bytes(input_tokens))

    def kv_complete(self, rid: str, hash_ids: Sequence[int], input_tokens: int, d: Decision) -> None:
        if pool := self._at(d.prefill_cluster, d.prefill_node):
            pool.release(f"{rid}:xfer")
        if d.decode_cluster != d.prefill_cluster and (dec := self._at(d.decode_cluster, None)):
            dec.insert(hash_ids, input_tokens)

    def finished(self, rid: str, d: Decision, move_src: str | None = None) -> None:
        owners = (f"{rid}:read", f"{rid}:move", f"{rid}:xfer")
        where = {(d.prefill_cluster, d.prefill_node), (d.decode_cluster, None)}
        if d.cache_move is not None:
            where.add((d.cache_move.src_cluster, move_src))
        for cluster, node in where:
            if pool := self._at(cluster, node):
                for owner in owners:
                    pool.release(owner)


def cache_book_for(sc: Scenario, kv: KVModel) -> CacheBook | None:
    """The book over the pools of every cluster that keeps a prefix cache (one per prefill
    instance where `cache_scope: instance`); None when none does."""
    bt = sc.model.block_tokens
    pools = {
        c.name: new_pool(kv, bt, c.cache_bytes) for c in sc.clusters if c.cache_bytes > 0 and c.cache_scope == "cluster"
    }
    own = {
        c.name: {node_id(c.name, "prefill", i): new_pool(kv, bt, c.instance_pool_bytes()) for i in range(n_p)}
        for c in sc.clusters
        if c.cache_scope == "instance" and c.instance_pool_bytes() > 0 and (n_p := role_slots(sc, c)[0])
    }
    return CacheBook(CacheIndex(pools, own)) if pools or own else None
