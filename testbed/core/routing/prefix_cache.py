"""Hybrid prefix cache pool of one cluster, and the global index over every cluster's pool.

A hybrid model's KV has two parts (docs/paper.md, "System"):
- full-attention KV grows with the prompt and is kept in blocks of `block_tokens`, one entry per
  prefix block hash; a prompt matches the longest run of its leading blocks that are present
  (a partial prefix match);
- linear-attention (or SWA) state has a fixed size and is only valid at the exact length it was
  taken at. The pool snapshots it at a prompt's last full-block boundary, so a later prompt
  that extends this one (the next turn of a conversation) finds a state at exactly its match.

The usable cached prefix is the longest block-aligned length L such that every block below L
is present and (when the model has linear layers) a state taken at exactly L is present.

One capacity is shared by both kinds and by transfer-cache holds (the tail KV of a prefill
that waits to cross to another cluster, freed when the transfer ends). Eviction is LRU over
entries nobody pins. A prompt's entries are refreshed leaf first, so within a prefix the deeper
blocks and the state (useless without every block below them) go before the blocks they hang
from. Block keys include the position: the trace formats say "equal hash at equal position is
an equal prefix block".

Everything is in paper bytes and tokens; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from testbed.core import native
from testbed.core.engine.kvsize import KVModel

# ("b", block index, hash) for a full-attention block, ("s", blocks, hash of the last block)
# for a linear state taken after that many blocks.
Key = tuple[str, int, int]


@dataclass(frozen=True)
class Match:
    """What a cluster's pool holds of a prompt."""

    tokens: int  # usable prefix (tokens), block-aligned; 0 when nothing is usable
    full_tokens: int  # leading full-attention blocks present, in tokens (>= tokens)


@dataclass(slots=True)
class _Entry:
    nbytes: int
    pins: int = 0


@dataclass
class PoolStats:
    lookups: int = 0
    hit_tokens: int = 0
    inserted_bytes: int = 0
    evicted_bytes: int = 0
    evictions: int = 0
    refused_bytes: int = 0  # inserts or holds that could not fit (everything else pinned)


@dataclass
class HybridPrefixCache:
    """One cluster's pool. `capacity_bytes` 0 means the cluster keeps no prefix cache."""

    capacity_bytes: int
    block_tokens: int
    block_bytes: int  # full-attention bytes of one block (0: a model with no full layers)
    state_bytes: int  # one linear-state snapshot (0: a model with no linear layers)
    used_bytes: int = 0
    stats: PoolStats = field(default_factory=PoolStats)
    _entries: OrderedDict[Key, _Entry] = field(default_factory=OrderedDict)
    # What each owner pins: the entries themselves (a pinned entry is never evicted, so it stays
    # the one in the pool until unpinned).
    _pins: dict[str, list[_Entry]] = field(default_factory=dict)
    _holds: dict[str, int] = field(default_factory=dict)
    # Running totals, so making room costs what it evicts rather than a pass over the pool.
    _pinned_entry_bytes: int = 0
    _held_bytes: int = 0

    @classmethod
    def for_model(cls, kv: KVModel, block_tokens: int, capacity_bytes: int) -> HybridPrefixCache:
        has_linear = "linear" in kv.kinds
        return cls(
            capacity_bytes,
            block_tokens,
            round(kv.full_bytes_per_token * block_tokens),
            kv.max_state_bytes if has_linear else 0,
        )

    # -- queries (no LRU change) ---------------------------------------------------------------

    def match(self, hash_ids: Iterable[int], input_tokens: int) -> Match:
        """Longest usable cached prefix of a prompt. At least one token is always left to
        compute (the first output token needs the last prompt token's logits)."""
        bt = self.block_tokens
        full, usable = self._match_blocks(hash_ids, max(input_tokens - 1, 0) // bt)
        return Match(usable * bt, full * bt)

    def usable_tokens(self, hash_ids: Iterable[int], input_tokens: int) -> int:
        """`match(...).tokens`, without building the `Match` (the router asks per request)."""
        bt = self.block_tokens
        return self._match_blocks(hash_ids, max(input_tokens - 1, 0) // bt)[1] * bt

    def _match_blocks(self, hash_ids: Iterable[int], limit: int) -> tuple[int, int]:
        """(leading blocks present, usable blocks) among the first `limit` blocks."""
        ids = hash_ids[:limit] if isinstance(hash_ids, (tuple, list)) else list(hash_ids)[:limit]
        entries = self._entries
        full = 0
        for h in ids:
            if ("b", full, h) not in entries:
                break
            full += 1
        if self.state_bytes == 0:
            return full, full
        for k in range(full, 0, -1):
            if ("s", k, ids[k - 1]) in entries:
                return full, k
        return full, 0

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_entry_bytes + self._held_bytes

    def holds(self, key: Key) -> bool:
        return key in self._entries

    def state_lengths(self) -> list[int]:
        """Token lengths of every cached linear state (for tests and reports)."""
        return sorted(k[1] * self.block_tokens for k in self._entries if k[0] == "s")

    # -- updates -------------------------------------------------------------------------------

    def _keys(self, ids: list[int], blocks: int) -> list[Key]:
        """Keys of a prefix of `blocks` blocks in eviction order: the state, then leaf to root."""
        keys: list[Key] = []
        if self.state_bytes and blocks > 0:
            keys.append(("s", blocks, ids[blocks - 1]))
        if self.block_bytes:
            keys.extend(("b", i, ids[i]) for i in range(blocks - 1, -1, -1))
        return keys

    def _size(self, key: Key) -> int:
        return self.state_bytes if key[0] == "s" else self.block_bytes

    def _make_room(self, nbytes: int) -> bool:
        """Evict LRU unpinned entries until `nbytes` fit; False (and nothing evicted) if they
        cannot fit even then."""
        free = self.capacity_bytes - self.used_bytes
        if nbytes <= free:
            return True
        evictable = self.used_bytes - self._held_bytes - self._pinned_entry_bytes
        if nbytes > free + evictable:
            return False
        victims: list[Key] = []
        for key, e in self._entries.items():  # oldest first
            if free >= nbytes:
                break
            if e.pins:
                continue
            victims.append(key)
            free += e.nbytes
        for key in victims:
            e = self._entries.pop(key)
            self.used_bytes -= e.nbytes
            self.stats.evicted_bytes += e.nbytes
            self.stats.evictions += 1
        return True

    def _refresh(self, ids: list[int], blocks: int) -> None:
        # Oldest first in the dict: move the state, then leaf..root, to the end, so the root is
        # the most recent and the state the least (the order of `_keys`).
        entries = self._entries
        to_end = entries.move_to_end
        if self.state_bytes and blocks > 0:
            key: Key = ("s", blocks, ids[blocks - 1])
            if key in entries:
                to_end(key)
        if self.block_bytes:
            for i in range(blocks - 1, -1, -1):
                key = ("b", i, ids[i])
                if key in entries:
                    to_end(key)

    def touch(self, hash_ids: Iterable[int], tokens: int) -> None:
        """A prefill reuses a prefix of `tokens` tokens: mark its entries as just used."""
        ids = list(hash_ids)
        blocks = min(tokens // self.block_tokens, len(ids))
        self.stats.lookups += 1
        self.stats.hit_tokens += blocks * self.block_tokens
        self._refresh(ids, blocks)

    def insert(self, hash_ids: Iterable[int], input_tokens: int) -> int:
        """Cache the full blocks of a prompt and a linear state at its last full-block boundary.
        Blocks go in from the root; where the pool is full of pinned entries the rest is left out
        (and with it the state, which needs every block below it). Returns the bytes added."""
        ids = list(hash_ids)
        blocks = min(input_tokens // self.block_tokens, len(ids))
        if self.capacity_bytes <= 0 or blocks == 0:
            return 0
        if self.capacity_bytes - self.used_bytes >= blocks * self.block_bytes + self.state_bytes:
            return self._insert_fitting(ids, blocks)
        # Refresh what is already there first, so making room for the rest never evicts it.
        self._refresh(ids, blocks)
        added = 0
        present = 0
        entries = self._entries
        bb, sb = self.block_bytes, self.state_bytes
        if bb:
            # Room for every missing entry at once where older entries can give it: the same
            # victims as making room block by block and then for the state (oldest first: this
            # prompt's entries, just refreshed, and what it adds on the way are newer than all of
            # them), with one pass over the pool's pinned old end instead of one per block; what
            # is left is then `_insert_fitting`'s. Otherwise block by block below, as far as it
            # goes (it may then evict this prompt's own entries).
            missing = 0
            own = 0  # this prompt's evictable bytes: the newest, not to be reached
            for i in range(blocks):
                e = entries.get(("b", i, ids[i]))
                if e is None:
                    missing += 1
                elif not e.pins:
                    own += e.nbytes
            need = missing * bb
            if sb:
                st = entries.get(("s", blocks, ids[blocks - 1]))
                if st is None:
                    need += sb
                elif not st.pins:
                    own += st.nbytes
            free = self.capacity_bytes - self.used_bytes
            older = self.used_bytes - self._held_bytes - self._pinned_entry_bytes - own
            if free >= need or (need <= free + older and self._make_room(need)):
                return self._insert_fitting(ids, blocks)
        for i in range(blocks):
            key: Key = ("b", i, ids[i])
            if not bb or key in entries:
                present = i + 1
                continue
            if self.capacity_bytes - self.used_bytes < bb and not self._make_room(bb):
                self.stats.refused_bytes += bb * (blocks - i)
                break
            entries[key] = _Entry(bb)
            self.used_bytes += bb
            added += bb
            present = i + 1
        if sb and present == blocks:
            skey: Key = ("s", blocks, ids[blocks - 1])
            if skey not in self._entries:
                if self._make_room(self.state_bytes):
                    self._entries[skey] = _Entry(self.state_bytes)
                    self.used_bytes += self.state_bytes
                    added += self.state_bytes
                else:
                    self.stats.refused_bytes += self.state_bytes
        self.stats.inserted_bytes += added
        self._refresh(ids, present)
        return added

    def _insert_fitting(self, ids: list[int], blocks: int) -> int:
        """`insert` when every entry fits (room made already): one pass, in `_refresh`'s order (the
        state, then leaf to root, each moved or added to the most recent end), which is the
        order adding from the root and refreshing afterwards leaves."""
        entries = self._entries
        to_end = entries.move_to_end
        added = 0
        sb, bb = self.state_bytes, self.block_bytes
        if sb:
            key: Key = ("s", blocks, ids[blocks - 1])
            if key in entries:
                to_end(key)
            else:
                entries[key] = _Entry(sb)
                added += sb
        if bb:
            for i in range(blocks - 1, -1, -1):
                key = ("b", i, ids[i])
                if key in entries:
                    to_end(key)
                else:
                    entries[key] = _Entry(bb)
                    added += bb
        self.used_bytes += added
        self.stats.inserted_bytes += added
        return added

    def touch_and_pin(self, owner: str, hash_ids: Iterable[int], tokens: int) -> None:
        """`touch` then `pin` of the same prefix, in one pass over its entries (the order `touch`
        refreshes them in is the order `pin` lists them in)."""
        ids = list(hash_ids)
        blocks = min(tokens // self.block_tokens, len(ids))
        self.stats.lookups += 1
        self.stats.hit_tokens += blocks * self.block_tokens
        entries = self._entries
        get = entries.get
        to_end = entries.move_to_end
        held: list[_Entry] = []
        added = 0
        for key in self._keys(ids, blocks):
            e = get(key)
            if e is None:
                continue
            to_end(key)
            if e.pins == 0:
                added += e.nbytes
            e.pins += 1
            held.append(e)
        self._hold(owner, held, added)

    def pin(self, owner: str, hash_ids: Iterable[int], tokens: int) -> None:
        """Keep a prefix of `tokens` tokens (its blocks and the state at exactly that length)
        from eviction until `unpin(owner)`: it is being read (a prefill, a cache move)."""
        ids = list(hash_ids)
        blocks = min(tokens // self.block_tokens, len(ids))
        get = self._entries.get
        held = [e for e in map(get, self._keys(ids, blocks)) if e is not None]
        added = 0
        for e in held:
            if e.pins == 0:
                added += e.nbytes
            e.pins += 1
        self._hold(owner, held, added)

    def _hold(self, owner: str, held: list[_Entry], added: int) -> None:
        """Record `held` (already pinned once more; `added` bytes newly pinned) under `owner`."""
        self._pinned_entry_bytes += added
        mine = self._pins.get(owner)
        if mine is None:
            self._pins[owner] = held
        else:
            mine.extend(held)

    def unpin(self, owner: str) -> None:
        held = self._pins.pop(owner, None)
        if held is None:
            return
        freed = 0
        for e in held:
            if e.pins > 0:
                e.pins -= 1
                if e.pins == 0:
                    freed += e.nbytes
        self._pinned_entry_bytes -= freed

    def hold(self, owner: str, nbytes: int) -> bool:
        """Transfer-cache: reserve `nbytes` for a prefill's tail KV until `release(owner)`.
        False when it cannot fit (the prefill still runs; its tail stays in GPU memory)."""
        if nbytes <= 0 or owner in self._holds:
            return True
        if not self._make_room(nbytes):
            self.stats.refused_bytes += nbytes
            return False
        self._holds[owner] = nbytes
        self._held_bytes += nbytes
        self.used_bytes += nbytes
        return True

    def release(self, owner: str) -> None:
        """End of a transfer: free its transfer-cache hold and unpin what it read."""
        held = self._holds.pop(owner, 0)
        self._held_bytes -= held
        self.used_bytes -= held
        self.unpin(owner)

    def tail_bytes(self, input_tokens: int) -> int:
        """What a finished prefill holds beyond its full prefix blocks: the partial last block
        and the linear state at the prompt's own length (the transfer-cache of a crossing)."""
        partial = input_tokens % self.block_tokens
        per_token = self.block_bytes / self.block_tokens
        return round(partial * per_token) + self.state_bytes

    def check(self) -> None:
        """Accounting invariants (tests call this after every step)."""
        total = sum(e.nbytes for e in self._entries.values()) + sum(self._holds.values())
        assert total == self.used_bytes, (total, self.used_bytes)
        pinned = sum(e.nbytes for e in self._entries.values() if e.pins)
        assert pinned == self._pinned_entry_bytes, (pinned, self._pinned_entry_bytes)
        assert sum(self._holds.values()) == self._held_bytes, (self._holds, self._held_bytes)
        assert 0 <= self.used_bytes <= max(self.capacity_bytes, 0), (self.used_bytes, self.capacity_bytes)


class MatchView(Protocol):
    @property
    def tokens(self) -> int: ...
    @property
    def full_tokens(self) -> int: ...


class StatsView(Protocol):
    @property
    def lookups(self) -> int: ...
    @property
    def hit_tokens(self) -> int: ...
    @property
    def inserted_bytes(self) -> int: ...
    @property
    def evicted_bytes(self) -> int: ...
    @property
    def evictions(self) -> int: ...
    @property
    def refused_bytes(self) -> int: ...


class PrefixPool(Protocol):
    """A cluster's pool as its users see it: `HybridPrefixCache`, or its compiled twin
    (`testbed_native.PrefixPool`, the same decisions; `new_pool` picks)."""

    @property
    def capacity_bytes(self) -> int: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def pinned_bytes(self) -> int: ...
    @property
    def stats(self) -> StatsView: ...
    def match(self, hash_ids: Iterable[int], input_tokens: int) -> MatchView: ...
    def usable_tokens(self, hash_ids: Iterable[int], input_tokens: int) -> int: ...
    def touch(self, hash_ids: Iterable[int], tokens: int) -> None: ...
    def insert(self, hash_ids: Iterable[int], input_tokens: int) -> int: ...
    def touch_and_pin(self, owner: str, hash_ids: Iterable[int], tokens: int) -> None: ...
    def pin(self, owner: str, hash_ids: Iterable[int], tokens: int) -> None: ...
    def unpin(self, owner: str) -> None: ...
    def hold(self, owner: str, nbytes: int) -> bool: ...
    def release(self, owner: str) -> None: ...
    def tail_bytes(self, input_tokens: int) -> int: ...
    def check(self) -> None: ...


def new_pool(kv: KVModel, block_tokens: int, capacity_bytes: int) -> PrefixPool:
    """A cluster's pool for `kv`: the compiled twin where it is built (`testbed.core.native`),
    else `HybridPrefixCache`."""
    py = HybridPrefixCache.for_model(kv, block_tokens, capacity_bytes)
    ext = native.module()
    if ext is None:
        return py
    pool: PrefixPool = ext.PrefixPool(py.capacity_bytes, py.block_tokens, py.block_bytes, py.state_bytes)
    return pool


class CacheIndex:
    """The global KV cache manager's view: every cluster's pool, answering "longest usable
    cached prefix per cluster" for the router. A cluster with `cache_scope: instance` has a pool
    per prefill instance (`instance_pools`) instead: it answers with the longest of them, and
    `usable_at` with each."""

    def __init__(
        self, pools: Mapping[str, PrefixPool], instance_pools: Mapping[str, Mapping[str, PrefixPool]] | None = None
    ) -> None:
        self.pools = dict(pools)
        self.instance_pools = {c: dict(by_node) for c, by_node in (instance_pools or {}).items()}

    def lookup(self, hash_ids: Iterable[int], input_tokens: int) -> dict[str, MatchView]:
        ids = list(hash_ids)
        return {name: p.match(ids, input_tokens) for name, p in self.pools.items()}

    def usable(self, hash_ids: Iterable[int], input_tokens: int) -> dict[str, int]:
        ids = hash_ids if isinstance(hash_ids, (tuple, list)) else list(hash_ids)
        out = {name: p.usable_tokens(ids, input_tokens) for name, p in self.pools.items()}
        for c, by_node in self.instance_pools.items():
            out[c] = max((p.usable_tokens(ids, input_tokens) for p in by_node.values()), default=0)
        return out

    def usable_at(self, cluster: str, hash_ids: Sequence[int], input_tokens: int) -> dict[str, int]:
        """Per prefill instance of an instance-scoped cluster, its own pool's usable prefix."""
        return {n: p.usable_tokens(hash_ids, input_tokens) for n, p in self.instance_pools.get(cluster, {}).items()}

    def pool(self, cluster: str, node: str | None = None) -> PrefixPool | None:
        """The pool a node of `cluster` reads (`node` matters for instance-scoped clusters only)."""
        by_node = self.instance_pools.get(cluster)
        if by_node is not None:
            return by_node.get(node) if node is not None else None
        return self.pools.get(cluster)
