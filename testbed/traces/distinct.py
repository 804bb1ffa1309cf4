"""Counting the distinct prefix block hashes of a trace in bounded memory.

A block is reused when its hash appeared earlier in the trace, so reused blocks = blocks -
distinct hashes, and only the distinct count need be kept. A set of millions of Python ints
costs ~80 bytes a hash (4.5 GB for a million Mooncake requests); here:

- dense ids (Mooncake's are small ints counted up from 0): one byte per id up to the largest,
  exact, at most DENSE_IDS bytes;
- otherwise the distinct ids sorted in an int64 array, exact, up to EXACT_IDS of them;
- beyond that a HyperLogLog sketch of 2^HLL_BITS registers: an estimate within about 1%.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

DENSE_IDS = 1 << 27
EXACT_IDS = 1 << 22
HLL_BITS = 14
_SLICE = 1 << 20

Ids = npt.NDArray[np.int64]


class DistinctCounter:
    """Distinct non-negative int64 ids, fed in batches (`add`); `count` and whether it is `exact`."""

    def __init__(self, dense_ids: int = DENSE_IDS, exact_ids: int = EXACT_IDS, hll_bits: int = HLL_BITS) -> None:
        self._dense_ids = dense_ids
        self._exact_ids = exact_ids
        self._hll_bits = hll_bits
        self._seen: npt.NDArray[np.bool_] | None = np.zeros(0, dtype=np.bool_)
        self._sorted: Ids | None = None
        self._registers: npt.NDArray[np.uint8] | None = None

    @property
    def exact(self) -> bool:
        return self._registers is None

    def add(self, ids: Ids) -> None:
        if ids.size == 0:
            return
        if self._seen is not None:
            top = int(ids.max())
            if top < self._dense_ids and int(ids.min()) >= 0:
                if top >= self._seen.size:
                    # Grow geometrically so a rising maximum costs amortised O(1) per id.
                    grown = np.zeros(min(self._dense_ids, max(top + 1, 2 * self._seen.size)), dtype=np.bool_)
                    grown[: self._seen.size] = self._seen
                    self._seen = grown
                self._seen[ids] = True
                return
            self._leave_dense()
        if self._sorted is not None:
            self._add_sorted(np.unique(ids))
            return
        self._add_sketch(ids)

    def _leave_dense(self) -> None:
        """An id too big for the dense array came: go on with the ids seen so far held sorted,
        or sketched if they are too many (read in slices, so no temporary holds them all)."""
        seen = self._seen
        assert seen is not None
        self._seen = None
        if np.count_nonzero(seen) <= self._exact_ids:
            self._sorted = np.flatnonzero(seen).astype(np.int64)
            return
        self._registers = np.zeros(1 << self._hll_bits, dtype=np.uint8)
        for lo in range(0, seen.size, _SLICE):
            self._add_sketch(np.flatnonzero(seen[lo : lo + _SLICE]).astype(np.int64) + lo)

    def _add_sorted(self, unique: Ids) -> None:
        assert self._sorted is not None
        have = self._sorted
        at = np.searchsorted(have, unique)
        known = np.zeros(unique.size, dtype=np.bool_)
        inside = at < have.size
        known[inside] = have[at[inside]] == unique[inside]
        new = unique[~known]
        if new.size == 0:
            return
        # Two sorted runs: the stable sort merges them in linear time.
        merged = np.sort(np.concatenate([have, new]), kind="stable")
        if merged.size <= self._exact_ids:
            self._sorted = merged
            return
        self._sorted = None
        self._registers = np.zeros(1 << self._hll_bits, dtype=np.uint8)
        self._add_sketch(merged)

    def _add_sketch(self, ids: Ids) -> None:
        assert self._registers is not None
        p = self._hll_bits
        x = _mix(ids.astype(np.uint64))
        index = (x >> np.uint64(64 - p)).astype(np.intp)
        rest = x & np.uint64((1 << (64 - p)) - 1)
        # Rank = leading zeros of the remaining 64-p bits + 1; frexp's exponent is the bit length
        # (exact: 64-p <= 53 bits fit a double), and 0 for 0, giving the maximum 64-p+1.
        _, bits = np.frexp(rest.astype(np.float64))
        rank = (64 - p + 1 - bits).astype(np.uint8)
        np.maximum.at(self._registers, index, rank)

    @property
    def count(self) -> int:
        if self._seen is not None:
            return int(np.count_nonzero(self._seen))
        if self._sorted is not None:
            return int(self._sorted.size)
        assert self._registers is not None
        m = float(self._registers.size)
        alpha = 0.7213 / (1.0 + 1.079 / m)
        estimate = alpha * m * m / float(np.sum(np.ldexp(1.0, -self._registers.astype(np.int32))))
        zeros = int(np.count_nonzero(self._registers == 0))
        if estimate <= 2.5 * m and zeros:
            estimate = m * np.log(m / zeros)  # small-range correction: linear counting
        return round(estimate)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser: spreads ids that are not hashes (counters, multiples) over all bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
