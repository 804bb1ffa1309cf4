"""The compiled prefix pool (`testbed_native.PrefixPool`) against the Python one it twins
(`testbed.core.routing.prefix_cache.HybridPrefixCache`): every answer, every entry in LRU order, every
figure, after every step of generated sequences (whole runs: `test_native_runs.py`).

Skipped where the extension is not built (no Rust toolchain), unless TESTBED_REQUIRE_NATIVE=1
(CI sets it: there a missing build is a failure, not a skip)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_ext import required

from testbed.core import native
from testbed.core.engine.kvsize import KVModel
from testbed.core.routing.prefix_cache import HybridPrefixCache, new_pool

ext = required()

B = 4  # tokens per block
BIG = 2**80  # a hash id beyond 64 bits
# Prompts sharing prefixes, a deep prefix without its root (as evictions leave), hash ids beyond 64
# bits and below zero, and one id repeated at two positions.
PREFIXES: list[list[int]] = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 9],
    [1, 2],
    [7, 8, 9, 10, 11],
    [30, 2, 3, 4, 5, 6],
    [BIG, BIG + 1, 3],
    [-5, 2**63 - 1, -(2**63)],
    [1, 1, 1, 1],
    [7, 8],
]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "touch_and_pin", "pin", "unpin", "hold", "release"]),
        st.integers(0, len(PREFIXES) - 1),
        st.integers(0, 8),
        st.sampled_from(["list", "tuple", "iter"]),
    ),
    max_size=60,
)


def _py_entries(p: HybridPrefixCache) -> list[tuple[str, int, int, int, int]]:
    return [(k[0], k[1], k[2], e.nbytes, e.pins) for k, e in p._entries.items()]


def _stats(p: Any) -> tuple[int, ...]:
    s = p.stats
    return (s.lookups, s.hit_tokens, s.inserted_bytes, s.evicted_bytes, s.evictions, s.refused_bytes)


def _shaped(ids: list[int], shape: str) -> Iterable[int]:
    return tuple(ids) if shape == "tuple" else iter(ids) if shape == "iter" else list(ids)


def _step(p: Any, op: str, ids: list[int], shape: str, owner: str, n: int) -> Any:
    if op == "insert":
        return p.insert(_shaped(ids, shape), n * B + n % 3)
    if op == "touch":
        return p.touch(_shaped(ids, shape), n * B)
    if op == "touch_and_pin":
        return p.touch_and_pin(owner, _shaped(ids, shape), n * B + 1)
    if op == "pin":
        return p.pin(owner, _shaped(ids, shape), n * B)
    if op == "unpin":
        return p.unpin(owner)
    if op == "hold":
        return p.hold(owner, n * 3)
    return p.release(owner)


def _same(py: HybridPrefixCache, nat: Any) -> None:
    py.check()
    nat.check()
    assert nat.entries() == _py_entries(py)
    assert _stats(nat) == _stats(py)
    assert (nat.used_bytes, nat.pinned_bytes) == (py.used_bytes, py.pinned_bytes)
    assert nat.state_lengths() == py.state_lengths()
    for ids in PREFIXES:
        for tokens in (0, 1, B, len(ids) * B, len(ids) * B + 1):
            m, n = py.match(ids, tokens), nat.match(ids, tokens)
            assert (n.tokens, n.full_tokens) == (m.tokens, m.full_tokens), (ids, tokens)
            assert nat.usable_tokens(tuple(ids), tokens) == m.tokens
        for i, h in enumerate(ids):
            assert nat.holds(("b", i, h)) == py.holds(("b", i, h))
            assert nat.holds(("s", i + 1, h)) == py.holds(("s", i + 1, h))


@pytest.mark.pure
@settings(max_examples=400, deadline=None)
@given(capacity=st.integers(0, 240), ops=OPS, block=st.sampled_from([0, 10]), state=st.sampled_from([0, 7, 25]))
def test_every_step_leaves_both_pools_alike(
    capacity: int, ops: list[tuple[str, int, int, str]], block: int, state: int
) -> None:
    """Whatever the sequence of inserts, touches, pins, holds and releases, on any capacity (none,
    scarce, ample) and any model (full blocks only, linear states only, both), the compiled pool
    returns what the Python one returns and holds the same entries in the same LRU order, pins and
    figures included."""
    py = HybridPrefixCache(capacity, B, block, state)
    nat = ext.PrefixPool(capacity, B, block, state)
    for op, k, n, shape in ops:
        owner = f"r{k % 3}:{op[-4:]}"
        assert _step(nat, op, PREFIXES[k], shape, owner, n) == _step(py, op, PREFIXES[k], shape, owner, n), op
        _same(py, nat)


@pytest.mark.pure
@given(
    tokens=st.integers(0, 10**7),
    block=st.sampled_from([0, 1, 3, 4096, 10**6 + 7]),
    state=st.sampled_from([0, 123]),
    bt=st.sampled_from([1, 3, 16, 512]),
)
def test_tail_bytes_round_alike(tokens: int, block: int, state: int, bt: int) -> None:
    """The transfer-cache tail: a partial block's bytes rounded half to even, as Python rounds."""
    assert ext.PrefixPool(1, bt, block, state).tail_bytes(tokens) == HybridPrefixCache(1, bt, block, state).tail_bytes(
        tokens
    )


@pytest.mark.pure
def test_the_compiled_pool_refuses_what_it_cannot_key() -> None:
    """Input the Python pool would take silently and wrongly is refused by name."""
    nat = ext.PrefixPool(100, B, 10, 0)
    with pytest.raises(TypeError, match="hash id must be an integer"):
        nat.insert(["a", "b"], 8)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        nat.touch([1, 2], -4)
    with pytest.raises(ValueError, match="block_tokens must be > 0"):
        ext.PrefixPool(100, 0, 10, 0)


@pytest.mark.pure
def test_new_pool_is_the_compiled_one_where_built() -> None:
    from testbed.config.scenarios import load_scenario

    sc = load_scenario("paper-prfaas-cache")
    pool = new_pool(KVModel.from_spec(sc.model), sc.model.block_tokens, 10**12)
    assert type(pool).__module__ == "testbed_native"
    assert native.implementation() == "native"


@pytest.mark.pure
def test_a_position_beyond_32_bits_is_no_entry() -> None:
    """The compiled pool keys positions in 32 bits: one past them (or below zero) names no entry,
    rather than the entry at its low 32 bits."""
    py, nat = HybridPrefixCache(1000, B, 10, 7), ext.PrefixPool(1000, B, 10, 7)
    for p in (py, nat):
        p.insert([5, 6], 2 * B)
    for pos in (2**32, 2**32 + 1, 2**40 + 2, -1, -(2**32)):
        for kind, h in (("b", 5), ("b", 6), ("s", 6)):
            assert nat.holds((kind, pos, h)) is py.holds((kind, pos, h)) is False
    assert nat.holds(("b", 0, 5)) and nat.holds(("s", 2, 6))


@pytest.mark.pure
def test_a_full_pool_keeps_the_prompts_own_entries_while_it_evicts_for_the_rest() -> None:
    """A prompt half in a full pool: its entries there are refreshed and kept, the oldest others
    go for its missing ones (the compiled pool looks each entry up once, before evicting)."""
    py, nat = HybridPrefixCache(120, B, 10, 0), ext.PrefixPool(120, B, 10, 0)
    for p in (py, nat):
        p.insert([1, 2, 3, 4], 4 * B)  # the prompt's first half, oldest
        p.insert([20, 21, 22, 23], 4 * B)
        p.insert([30, 31, 32, 33], 4 * B)  # full: 12 blocks of 10 bytes
        p.insert([1, 2, 3, 4, 5, 6, 7, 8], 8 * B)
    _same(py, nat)
    held = {e[2] for e in nat.entries()}
    assert {1, 2, 3, 4, 5, 6, 7, 8} <= held and not held & {20, 21, 22, 23}


@pytest.mark.pure
def test_ids_the_index_places_by_number_collide_and_grow_alike() -> None:
    """The compiled index takes a key's bucket from its hash id's number (`Key::spread`): thousands
    of prompts whose ids run on, stride by powers of two (the folds' widths among them), repeat at
    other positions or share prefixes, through the index's growth and a full pool's evictions, leave
    both pools alike."""
    import random

    rng = random.Random(7)
    py = HybridPrefixCache(60_000, B, 10, 7)  # some 5,000 entries held: the index grows
    nat = ext.PrefixPool(60_000, B, 10, 7)
    prompts: list[list[int]] = []
    fresh = 0
    for i in range(3000):
        kind = i % 5
        n = rng.randint(1, 12)
        if kind == 0:  # numbered one past the last, as traces number new blocks
            ids = list(range(fresh, fresh + n))
            fresh += n
        elif kind == 1:
            stride = rng.choice([2**21, 2**42, 2**20, 2**41, 2**63 // 3])
            base = rng.randint(-4, 4)
            ids = [base + stride * j for j in range(n)]
        elif kind == 2 and prompts:  # a shared prefix, then new blocks
            old = rng.choice(prompts)
            ids = old[: rng.randint(1, len(old))] + list(range(fresh, fresh + n))
            fresh += n
        elif kind == 3 and prompts:  # the same ids one position on
            ids = [rng.randint(0, 5), *rng.choice(prompts)]
        else:
            ids = [rng.getrandbits(64) - 2**63 for _ in range(n)]
        prompts.append(ids)
        tokens = len(ids) * B + rng.randint(0, B)
        assert nat.insert(ids, tokens) == py.insert(ids, tokens)
        if i % 7 == 0:
            owner = f"r{i}"
            nat.touch_and_pin(owner, ids, tokens)
            py.touch_and_pin(owner, ids, tokens)
        if i % 7 == 3:
            nat.unpin(f"r{i - 3}")
            py.unpin(f"r{i - 3}")
        if i % 500 == 499:
            _same(py, nat)
            for ids in rng.sample(prompts, 50):
                m, got = py.match(ids, len(ids) * B), nat.match(ids, len(ids) * B)
                assert (got.tokens, got.full_tokens) == (m.tokens, m.full_tokens)
    _same(py, nat)
    assert nat.stats.evictions > 1000
