"""The one percentile definition every summary, capacity probe and table uses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def percentile(values: Sequence[float] | npt.NDArray[np.float64], q: float) -> float | None:
    """The `q`-th percentile (0..100), interpolated linearly between the two closest ranks
    (numpy's default method); None when there are no values. NaNs are the caller's to drop."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return None
    return float(np.percentile(a, q))


def percentiles_in_place(a: npt.NDArray[np.float64], qs: Sequence[float]) -> list[float]:
    """`percentile` of a non-empty array at each of `qs`, partly sorting `a` in place (no copy)."""
    return [float(x) for x in np.percentile(a, qs, overwrite_input=True)]
