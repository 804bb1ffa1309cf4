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

from typing import Sequence

from testbed.core.policy import Decision
from testbed.core.prefix_cache import CacheIndex


class CacheBook:
    def __init__(self, index: CacheIndex) -> None:
        self.index = index

    def _pool_ops(self, cluster: str) -> bool:
        p = self.index.pool(cluster)
        return p is not None and p.capacity_bytes > 0

    def routed(self, rid: str, hash_ids: Sequence[int], d: Decision) -> None:
        mv = d.cache_move
        own = mv.from_tokens if mv is not None else d.cached_tokens
        if own and self._pool_ops(d.prefill_cluster):
            pool = self.index.pools[d.prefill_cluster]
            pool.touch(hash_ids, own)
            pool.pin(f"{rid}:read", hash_ids, own)
        if mv is not None and self._pool_ops(mv.src_cluster):
            src = self.index.pools[mv.src_cluster]
            src.touch(hash_ids, mv.tokens)
            src.pin(f"{rid}:move", hash_ids, mv.tokens)

    def moved(self, rid: str, hash_ids: Sequence[int], d: Decision) -> None:
        mv = d.cache_move
        if mv is None:
            return
        if self._pool_ops(mv.src_cluster):
            self.index.pools[mv.src_cluster].unpin(f"{rid}:move")
        if self._pool_ops(mv.dst_cluster):
            dst = self.index.pools[mv.dst_cluster]
            dst.insert(hash_ids, mv.tokens)
            dst.pin(f"{rid}:read", hash_ids, mv.tokens)

    def prefilled(self, rid: str, hash_ids: Sequence[int], input_tokens: int, d: Decision) -> None:
        if not self._pool_ops(d.prefill_cluster):
            return
        pool = self.index.pools[d.prefill_cluster]
        pool.unpin(f"{rid}:read")
        pool.insert(hash_ids, input_tokens)
        if d.crossed_wan:
            pool.pin(f"{rid}:xfer", hash_ids, input_tokens)
            pool.hold(f"{rid}:xfer", pool.tail_bytes(input_tokens))

    def kv_complete(self, rid: str, hash_ids: Sequence[int], input_tokens: int, d: Decision) -> None:
        if self._pool_ops(d.prefill_cluster):
            self.index.pools[d.prefill_cluster].release(f"{rid}:xfer")
        if d.decode_cluster != d.prefill_cluster and self._pool_ops(d.decode_cluster):
            self.index.pools[d.decode_cluster].insert(hash_ids, input_tokens)

    def finished(self, rid: str, d: Decision) -> None:
        for cluster in {d.prefill_cluster, d.decode_cluster} | (
                {d.cache_move.src_cluster} if d.cache_move else set()):
            if self._pool_ops(cluster):
                pool = self.index.pools[cluster]
                for tag in ("read", "move", "xfer"):
                    pool.release(f"{rid}:{tag}")
