"""Bandwidth-aware control loop (pure): bandwidth estimate, threshold planning, recorded reasons."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.control.bandwidth import BandwidthController, LinkSignals
from testbed.core.control.short_term import Recent, stage_model
from testbed.core.schema.scenario import ControlSpec
from testbed.traces.synthetic import sample_lengths

NOMINAL = 100e9
SC = load_scenario("paper-prfaas")
LENGTHS = tuple(float(x) for x in sample_lengths(np.random.default_rng(3), 400, SC.workload.input))


def controller(**kw: float) -> BandwidthController:
    return BandwidthController(19400, NOMINAL, stage_model(SC), ControlSpec(**kw), 131072)  # type: ignore[arg-type]


def signals(
    delivered_gbps: float,
    undelivered_gb: float = 0.0,
    rate: float = 2.4,
    retrans: float = 0.0,
    prfaas_q: float = 0.0,
    pdp_q: float = 0.0,
    at: float = 0.0,
) -> LinkSignals:
    return LinkSignals(
        at, 2.0, delivered_gbps * 1e9 / 8 * 2.0, undelivered_gb * 1e9, retrans, prfaas_q, pdp_q, rate, LENGTHS
    )


@pytest.mark.pure
def test_holds_the_base_threshold_when_every_load_is_fine() -> None:
    c = controller()
    for i in range(5):
        sample, change = c.update(signals(9.0, 0.01, at=2.0 * i), adjust=True)
        assert change is None
    assert c.threshold == 19400 and sample.loads.peak <= 0.85 and sample.state == "abundant"


@pytest.mark.pure
def test_a_saturated_link_raises_the_threshold_with_a_reason_and_recovery_lowers_it() -> None:
    c = controller()
    # The link delivers 10 Gbit/s with 3 GB waiting: saturated, the estimate drops to 10 Gbit/s.
    sample, change = c.update(signals(10.0, 3.0), adjust=True)
    assert sample.saturated and sample.bandwidth_bps == pytest.approx(10e9)
    assert change is not None and change.new > 19400 and sample.state == "scarce"
    assert "saturated" in change.reason and "10.0 of 100 Gbit/s" in change.reason
    raised = c.threshold
    # Predicted link load at the new threshold is lower than at the base one.
    s2 = signals(10.0, 3.0)
    assert c.loads(raised, s2).link < c.loads(19400, s2).link
    # The backlog drains and nothing waits: the estimate grows back and t returns to the base.
    # No growth during the hold after a saturation: the estimate stays, so t stays above the base
    # (it may step back toward it as far as the estimated 10 Gbit/s allows).
    c.update(signals(8.0, 0.0, at=2.0), adjust=True)
    assert c.bandwidth_bps == pytest.approx(10e9) and 19400 < c.threshold <= raised
    for i in range(40):
        c.update(signals(8.0, 0.0, at=4.0 + 2.0 * i), adjust=True)
    assert c.threshold == 19400 and c.bandwidth_bps == NOMINAL
    assert [ch.new for ch in c.changes][-1] == 19400


@pytest.mark.pure
def test_a_pd_prefill_queue_lowers_the_threshold() -> None:
    c = controller()
    sample, change = c.update(signals(9.0, 0.0, rate=2.6, pdp_q=30.0), adjust=True)
    assert change is not None and change.new < 19400
    assert (
        c.loads(change.new, signals(9.0, 0.0, rate=2.6, pdp_q=30.0)).pdp
        < c.loads(19400, signals(9.0, 0.0, rate=2.6, pdp_q=30.0)).pdp
    )


@pytest.mark.pure
def test_long_transfer_tails_count_as_saturation() -> None:
    c = controller()
    sig = signals(8.0, 0.0)
    sample, _ = c.update(LinkSignals(**{**sig.__dict__, "tail_s": 2.5}), adjust=True)
    assert sample.saturated and sample.bandwidth_bps == pytest.approx(8e9)
    assert c.changes and "KV tail 2.50 s" in c.changes[-1].reason


@pytest.mark.pure
def test_retransmissions_count_as_congestion_and_no_adjust_only_judges() -> None:
    c = controller()
    sample, change = c.update(signals(9.0, 0.0, retrans=0.05), adjust=False)
    assert sample.saturated and change is None and c.threshold == 19400 and sample.state == "scarce"


@pytest.mark.pure
def test_small_changes_are_not_made() -> None:
    c = controller(min_change=10.0)  # any change is "small"
    _, change = c.update(signals(10.0, 3.0), adjust=True)
    assert change is None and c.threshold == 19400


@pytest.mark.pure
def test_recent_window_rate() -> None:
    r = Recent(3)
    for t, n in ((0.0, 1), (1.0, 2), (2.0, 3), (3.0, 4)):
        r.add(t, n)
    assert list(r.lengths) == [2, 3, 4]
    assert r.rate(3.0) == pytest.approx(1.0)
    assert r.rate(5.0) == pytest.approx(0.5)  # quiet since: the rate falls


@pytest.mark.pure
def test_stage_costs_are_kept_per_length_and_equal_the_models() -> None:
    """A control update looks each recent length's costs up: the same figures as the stage
    model's own functions, computed once per length, and the store stays bounded."""
    from testbed.core.control import bandwidth

    calls: list[float] = []

    def wan(x: float) -> float:
        calls.append(x)
        return x * 3.0

    m = bandwidth.StageModel(2, 2, lambda x: x / 7.0, lambda x: x / 11.0, wan)
    for x in (100.0, 2048.0, 100.0, 5e4, 2048.0):
        assert m.costs(x) == (x * 3.0, x / 7.0, x / 11.0)
    assert calls == [100.0, 2048.0, 5e4]
    for i in range(bandwidth._COSTS_KEPT + 10):
        m.costs(float(i))
    assert len(m._costs) <= bandwidth._COSTS_KEPT
