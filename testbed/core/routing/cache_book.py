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
from testbed.core.routing.prefix_cache import CacheIndex, new_pool
from testbed.core.schema.scenario import Scenario


class CacheBook:
    def __init__(self, index: CacheIndex) -> None:
        self.index = index
        # The pools that keep a prefix cache at all, by cluster (an index's pools are fixed).
        self._caching = {name: p for name, p in index.pools.items() if p.capacity_bytes > 0}
        self._pool = self._caching.get

    def routed(self, rid: str, hash_ids: Sequence[int], d: Decision) -> None:
        mv = d.cache_move
        own = mv.from_tokens if mv is not None else d.cached_tokens
        if own and (pool := self._pool(d.prefill_cluster)):
            pool.touch_and_pin(f"{rid}:read", hash_ids, own)
        if mv is not None and (src := self._pool(mv.src_cluster)):
            src.touch_and_pin(f"{rid}:move", hash_ids, mv.tokens)

    def moved(self, rid: str, hash_ids: Sequence[int], d: Decision) -> None:
        mv = d.cache_move
        if mv is None:
            return
        if src := self._pool(mv.src_cluster):
            src.unpin(f"{rid}:move")
        if dst := self._pool(mv.dst_cluster):
            dst.insert(hash_ids, mv.tokens)
            dst.pin(f"{rid}:read", hash_ids, mv.tokens)

    def prefilled(self, rid: str, hash_ids: Sequence[int], input_tokens: int, d: Decision) -> None:
        pool = self._pool(d.prefill_cluster)
        if pool is None:
            return
        pool.unpin(f"{rid}:read")
        pool.insert(hash_ids, input_tokens)
        if d.crossed_wan:
            pool.pin(f"{rid}:xfer", hash_ids, input_tokens)
            pool.hold(f"{rid}:xfer", pool.tail_bytes(input_tokens))

    def kv_complete(self, rid: str, hash_ids: Sequence[int], input_tokens: int, d: Decision) -> None:
        if pool := self._pool(d.prefill_cluster):
            pool.release(f"{rid}:xfer")
        if d.decode_cluster != d.prefill_cluster and (dec := self._pool(d.decode_cluster)):
            dec.insert(hash_ids, input_tokens)

    def finished(self, rid: str, d: Decision) -> None:
        owners = (f"{rid}:read", f"{rid}:move", f"{rid}:xfer")
        for cluster in {d.prefill_cluster, d.decode_cluster} | ({d.cache_move.src_cluster} if d.cache_move else set()):
            if pool := self._pool(cluster):
                for owner in owners:
                    pool.release(owner)


def cache_book_for(sc: Scenario, kv: KVModel) -> CacheBook | None:
    """The book over the pools of every cluster that keeps a prefix cache; None when none does."""
    pools = {c.name: new_pool(kv, sc.model.block_tokens, c.cache_bytes) for c in sc.clusters if c.cache_bytes > 0}
    return CacheBook(CacheIndex(pools)) if pools else None
