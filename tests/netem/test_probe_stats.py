"""What a probe stream says about a link: loss, lag-1 loss correlation, reordering, delay spread."""

from __future__ import annotations

import pytest

from testbed.net.delayline_model import DelayLineModel
from testbed.net.probe_stats import loss_correlation, probe_stats, reordered_fraction

pytestmark = pytest.mark.pure


def test_loss_and_order_of_a_small_stream() -> None:
    # 0..9 sent; 3 and 4 lost; 7 overtaken by 8.
    arrivals = [
        (0, 0.010),
        (1, 0.011),
        (2, 0.010),
        (5, 0.012),
        (6, 0.010),
        (8, 0.009),
        (7, 0.013),
        (9, 0.010),
        (9, 0.010),
    ]  # a duplicate counts once
    st = probe_stats(10, arrivals)
    assert (st.sent, st.received, st.loss) == (10, 8, 0.2)
    assert st.reordered == pytest.approx(1 / 8)
    assert st.delay_median_s == pytest.approx(0.010)
    assert st.delay_sd_s is not None and 0 < st.delay_sd_s < 0.002


def test_reordering_counts_arrivals_below_the_highest_seen() -> None:
    assert reordered_fraction([0, 1, 2, 3]) == 0.0
    assert reordered_fraction([1, 0, 3, 2]) == 0.5
    assert reordered_fraction([3, 0, 1, 2]) == 0.75  # one early packet makes three late ones
    assert reordered_fraction([]) is None


def test_loss_correlation_of_independent_and_bursty_loss() -> None:
    assert loss_correlation([False] * 100) is None  # no loss: nothing to condition on
    alternating = [i % 2 == 0 for i in range(1000)]  # never two in a row
    c = loss_correlation(alternating)
    assert c is not None and c == pytest.approx(-1.0)
    bursts = ([True] * 5 + [False] * 95) * 20  # 5% loss in runs of 5
    c = loss_correlation(bursts)
    assert c is not None and c == pytest.approx((0.8 - 0.05) / 0.95, abs=0.01)


def test_the_delay_lines_gilbert_chain_measures_as_configured() -> None:
    m = DelayLineModel(0.0, loss=0.05, loss_correlation=0.5, seed=3)
    lost = [m.admit(0.0, 100) is None for _ in range(200_000)]
    st = probe_stats(len(lost), [(i, 0.0) for i, gone in enumerate(lost) if not gone])
    assert st.loss == pytest.approx(0.05, abs=0.003)
    assert st.loss_correlation == pytest.approx(0.5, abs=0.03)
    assert st.reordered == 0.0
