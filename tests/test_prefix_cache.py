"""Hybrid prefix cache pool, global index and the per-request bookkeeping (pure)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.config.scenarios import load_scenario
from testbed.core.engine.kvsize import KVModel
from testbed.core.routing.cache_book import CacheBook
from testbed.core.routing.policy import CacheMove, Decision
from testbed.core.routing.prefix_cache import CacheIndex, HybridPrefixCache, Match, _Entry

B = 4  # tokens per block: small numbers keep the arithmetic readable
BLOCK = 10  # bytes per full-attention block
STATE = 25  # bytes per linear state


def pool(capacity: int, state: int = STATE, block: int = BLOCK) -> HybridPrefixCache:
    return HybridPrefixCache(capacity, B, block, state)


@pytest.mark.pure
def test_partial_prefix_match_walks_leading_blocks_only() -> None:
    p = pool(1000, state=0)  # no linear layers: full blocks alone decide
    p.insert([1, 2, 3, 4], 16)  # four full blocks
    assert p.match([1, 2, 3, 4, 5], 20) == Match(16, 16)
    assert p.match([1, 2, 9, 4], 20) == Match(8, 8)  # a different block 2 ends the match
    assert p.match([7, 2, 3, 4], 20) == Match(0, 0)  # nothing without the root
    # One token is always left to compute: a prompt equal to the cached one reuses all but its last block.
    assert p.match([1, 2, 3, 4], 16) == Match(12, 12)
    # Positions matter: block 2 at position 0 is another block.
    assert p.match([2, 3], 9) == Match(0, 0)


@pytest.mark.pure
def test_partial_last_block_is_never_cached() -> None:
    p = pool(1000, state=0)
    p.insert([1, 2, 3], 10)  # 2 full blocks + 2 tokens of block 3
    assert p.match([1, 2, 3, 4], 16).full_tokens == 8
    assert not p.holds(("b", 2, 3))


@pytest.mark.pure
def test_linear_state_only_reused_at_its_own_length() -> None:
    p = pool(1000)
    p.insert([1, 2, 3], 12)  # blocks 0..2 and a state at 12 tokens
    assert p.state_lengths() == [12]
    # A longer prompt sharing all three blocks resumes from the state at exactly 12.
    assert p.match([1, 2, 3, 4, 5], 20) == Match(12, 12)
    # A prompt sharing only two blocks: full-attention KV matches 8 tokens, but no state was
    # taken at 8, so nothing is usable (the state at 12 is for another length).
    m = p.match([1, 2, 9, 4], 16)
    assert m.full_tokens == 8 and m.tokens == 0
    # Once a state at 8 exists (a prompt of exactly two full blocks), that prompt's match uses it.
    p.insert([1, 2], 8)
    assert p.state_lengths() == [8, 12]
    assert p.match([1, 2, 9, 4], 16) == Match(8, 8)
    # The usable length is always one a state was taken at.
    for ids, n in (([1, 2, 3, 4, 5], 20), ([1, 2, 9], 12), ([1, 2, 3], 13), ([1], 5)):
        m = p.match(ids, n)
        assert m.tokens == 0 or m.tokens in p.state_lengths()


@pytest.mark.pure
def test_lru_eviction_takes_the_least_recently_used_prefix_leaf_first() -> None:
    # Room for exactly two prompts of two blocks and a state each (2 * (2*10 + 25) = 90).
    p = pool(90)
    p.insert([1, 2], 8)
    p.insert([5, 6], 8)
    p.touch([1, 2], 8)  # [1, 2] is now the more recent
    p.insert([7, 8], 8)  # needs 45 bytes: evicts all of [5, 6]
    p.check()
    assert p.match([1, 2, 0], 12).tokens == 8
    assert p.match([7, 8, 0], 12).tokens == 8
    assert p.match([5, 6, 0], 12) == Match(0, 0)
    assert p.stats.evictions == 3 and p.stats.evicted_bytes == 45
    # Leaf first: squeezing in another prompt takes the old prefix's state (useless alone),
    # then its deepest block, before its root.
    q = pool(45 + 10)
    q.insert([1, 2], 8)
    q.insert([3], 4)  # the block fits; its state (25) evicts [1, 2]'s state
    q.check()
    assert q.holds(("b", 0, 1)) and q.holds(("b", 1, 2)) and not q.holds(("s", 2, 2))
    assert q.hold("x", 10)  # 10 bytes more: the deeper block (1, 2) goes, the root stays
    q.check()
    assert q.holds(("b", 0, 1)) and not q.holds(("b", 1, 2))


@pytest.mark.pure
def test_pinned_entries_and_transfer_holds_are_not_evicted() -> None:
    p = pool(90)
    p.insert([1, 2], 8)
    p.pin("r1:read", [1, 2], 8)
    assert p.pinned_bytes == 45
    assert p.hold("r2:xfer", 40)  # fits beside the pinned prefix (45 + 40 <= 90)
    assert not p.hold("r3:xfer", 10)  # 95 > 90 and nothing is evictable
    p.insert([3, 4], 8)  # cannot fit: refused, nothing pinned evicted
    p.check()
    assert p.match([1, 2, 0], 12).tokens == 8 and p.match([3, 4, 0], 12).tokens == 0
    assert p.stats.refused_bytes > 0
    p.release("r2:xfer")
    p.unpin("r1:read")
    assert p.pinned_bytes == 0
    p.insert([3, 4], 8)
    p.check()
    assert p.match([3, 4, 0], 12).tokens == 8


@pytest.mark.pure
def test_zero_capacity_pool_caches_nothing() -> None:
    p = pool(0)
    assert p.insert([1, 2], 8) == 0
    assert not p.hold("x", 1)
    assert p.match([1, 2, 3], 12) == Match(0, 0)
    p.check()


@pytest.mark.pure
def test_pool_sizes_follow_the_model() -> None:
    sc = load_scenario("paper-prfaas")
    kv = KVModel.from_spec(sc.model)
    p = HybridPrefixCache.for_model(kv, 512, 1 << 40)
    assert p.block_bytes == round(17143 * 512) and p.state_bytes == 180355072
    dense = HybridPrefixCache.for_model(KVModel.from_spec(load_scenario("paper-prfaas-dense").model), 512, 1 << 40)
    assert dense.state_bytes == 0  # no linear layers: full blocks alone decide the match
    dense.insert(list(range(4)), 2048)
    assert dense.match(list(range(5)), 2600).tokens == 2048


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 5), st.integers(1, 6)),
        st.tuples(st.just("touch"), st.integers(0, 5), st.integers(1, 6)),
        st.tuples(st.just("pin"), st.integers(0, 5), st.integers(1, 6)),
        st.tuples(st.just("unpin"), st.integers(0, 5), st.integers(0, 0)),
        st.tuples(st.just("hold"), st.integers(0, 5), st.integers(1, 80)),
        st.tuples(st.just("release"), st.integers(0, 5), st.integers(0, 0)),
    ),
    max_size=60,
)


# Six conversation-like prefixes over a small hash space, sharing roots.
PREFIXES = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 7, 8, 9, 10],
    [11, 12, 13, 14, 15, 16],
    [1, 2, 3, 17, 18, 19],
    [20, 21, 22, 23, 24, 25],
    [11, 12, 26, 27, 28, 29],
]


def _apply(p: HybridPrefixCache, op: str, ids: list[int], owner: str, n: int) -> None:
    """One generated step (`OPS`) on a pool: n blocks of `ids`, or n bytes held."""
    if op == "insert":
        p.insert(ids, n * B)
    elif op == "touch":
        p.touch(ids, n * B)
    elif op == "pin":
        p.pin(owner, ids, n * B)
    elif op == "unpin":
        p.unpin(owner)
    elif op == "hold":
        p.hold(owner, n)
    else:
        p.release(owner)


@pytest.mark.pure
@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 200), ops=OPS, state=st.sampled_from([0, 7, 25]))
def test_accounting_never_exceeds_capacity(capacity: int, ops: list[tuple[str, int, int]], state: int) -> None:
    """Whatever the sequence of inserts, pins, holds and releases, the bytes accounted equal the
    entries held and never exceed the capacity; every usable match ends at a cached state."""
    p = pool(capacity, state=state)
    for op, k, n in ops:
        _apply(p, op, PREFIXES[k], f"o{k}", n)
        p.check()
        assert p.pinned_bytes <= p.used_bytes <= capacity
        for ids2 in PREFIXES:
            m = p.match(ids2, len(ids2) * B + 1)
            assert m.tokens <= m.full_tokens
            if state and m.tokens:
                assert m.tokens in p.state_lengths()


class _BlockByBlock(HybridPrefixCache):
    """The pool with the plain insert it is specified by: what is there refreshed, then each
    missing block added from the root, making room for that block alone, until one cannot fit;
    then the state, then everything present refreshed again."""

    def insert(self, hash_ids: Iterable[int], input_tokens: int) -> int:
        ids = list(hash_ids)
        blocks = min(input_tokens // self.block_tokens, len(ids))
        if self.capacity_bytes <= 0 or blocks == 0:
            return 0
        self._refresh(ids, blocks)
        added = present = 0
        bb, sb = self.block_bytes, self.state_bytes
        for i in range(blocks):
            if not bb or ("b", i, ids[i]) in self._entries:
                present = i + 1
                continue
            if self.capacity_bytes - self.used_bytes < bb and not self._make_room(bb):
                self.stats.refused_bytes += bb * (blocks - i)
                break
            self._entries[("b", i, ids[i])] = _Entry(bb)
            self.used_bytes += bb
            added += bb
            present = i + 1
        if sb and present == blocks and ("s", blocks, ids[blocks - 1]) not in self._entries:
            if self._make_room(sb):
                self._entries[("s", blocks, ids[blocks - 1])] = _Entry(sb)
                self.used_bytes += sb
                added += sb
            else:
                self.stats.refused_bytes += sb
        self.stats.inserted_bytes += added
        self._refresh(ids, present)
        return added


@pytest.mark.pure
@settings(max_examples=400, deadline=None)
@given(capacity=st.integers(0, 200), ops=OPS, state=st.sampled_from([0, 7, 25]), orphans=st.booleans())
def test_insert_evicts_exactly_as_block_by_block(
    capacity: int, ops: list[tuple[str, int, int]], state: int, orphans: bool
) -> None:
    """However full and pinned the pool, an insert leaves the same entries in the same order,
    with the same figures, as making room one block at a time."""
    fast, plain = pool(capacity, state=state), _BlockByBlock(capacity, B, BLOCK, state)
    prefixes = list(PREFIXES)
    if orphans:  # deep blocks cached without their roots, as evictions leave them
        prefixes[3] = [30, 2, 3, 4, 5, 6]
    for op, k, n in ops:
        for p in (fast, plain):
            _apply(p, op, prefixes[k], f"o{k}", n)
        fast.check()
        assert list(fast._entries) == list(plain._entries)
        assert fast.stats == plain.stats and fast.used_bytes == plain.used_bytes
        assert fast.pinned_bytes == plain.pinned_bytes


def _decision(
    prefill: str, decode: str, cached: int, crossed: bool, move: CacheMove | None = None, dec_cached: int = 0
) -> Decision:
    return Decision(
        prefill, f"{prefill}-p0", decode, f"{decode}-d0", cached, 100, crossed, 19400.0, "", dec_cached, move
    )


@pytest.mark.pure
def test_book_follows_a_request_through_both_pools() -> None:
    pf, pd = pool(1000), pool(1000)
    book = CacheBook(CacheIndex({"prfaas": pf, "pd": pd}))
    ids = [1, 2, 3]
    d = _decision("prfaas", "pd", 0, True)
    book.routed("r1", ids, d)
    book.prefilled("r1", ids, 12, d)
    # While the KV crosses, the prompt's blocks are pinned and its tail is held as transfer-cache.
    assert pf.pinned_bytes == 3 * BLOCK + STATE + pf.tail_bytes(12)
    assert pd.used_bytes == 0
    book.kv_complete("r1", ids, 12, d)
    assert pf.pinned_bytes == 0 and pf.used_bytes == 3 * BLOCK + STATE
    assert pd.match([1, 2, 3, 4], 16).tokens == 12  # the decode cluster's pool has it too
    book.finished("r1", d)
    pf.check()
    pd.check()
    # A move: the destination gains the moved prefix and reads it; the source is released.
    pd2 = pool(1000)
    book2 = CacheBook(CacheIndex({"prfaas": pf, "pd": pd2}))
    mv = CacheMove("prfaas", "pd", 12, 0)
    d2 = _decision("pd", "pd", 12, False, mv, 12)
    book2.routed("r2", [1, 2, 3, 4], d2)
    assert pf.pinned_bytes > 0
    book2.moved("r2", [1, 2, 3, 4], d2)
    assert pf.pinned_bytes == 0 and pd2.match([1, 2, 3, 4], 16).tokens == 12
    book2.prefilled("r2", [1, 2, 3, 4], 16, d2)
    book2.finished("r2", d2)
    assert pd2.pinned_bytes == 0
    pd2.check()
