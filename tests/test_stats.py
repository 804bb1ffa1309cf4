"""The one percentile definition: linear interpolation between closest ranks."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.metrics.stats import percentile

pytestmark = pytest.mark.pure


def test_linear_interpolation_between_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 90) is None
    # Not nearest-rank, which would give 4.0 for the P90 of these four.
    assert percentile(xs, 90) != 4.0


def test_same_figures_summaries_published_before() -> None:
    """summary.json took P50/P90/P99 from one np.percentile call; each figure is bit-identical."""
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 101, 1000):
        a = rng.lognormal(0.0, 1.0, n) * 4.0
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        assert (percentile(a, 50), percentile(a, 90), percentile(a, 99)) == (float(p50), float(p90), float(p99))
        assert percentile(list(a), 90) == float(p90)
