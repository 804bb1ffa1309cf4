"""The netem codec the executor registers with pyroute2: what reaches the kernel (pure: messages
are encoded and decoded, nothing is sent)."""

from __future__ import annotations

from typing import Any

import pytest

from testbed.net import executor  # executor: registers the codec
from testbed.net import netem_codec as C
from testbed.net.delayline_model import DelayLineModel
from testbed.net.plan import NetemLeaf

pytestmark = pytest.mark.pure


def roundtrip(opts: dict[str, Any]) -> Any:
    from pyroute2.netlink.rtnl.tcmsg import tcmsg  # type: ignore[import-untyped]

    m = tcmsg()
    m["attrs"] = [["TCA_KIND", "netem"], ["TCA_OPTIONS", opts]]
    m.encode()
    d = tcmsg(m.data)
    d.decode()
    return d.get_attr("TCA_OPTIONS")


def test_the_executor_registers_this_codec_for_netem() -> None:
    from pyroute2.netlink.rtnl.tcmsg import plugins  # type: ignore[import-untyped]

    assert executor.netem_codec is C and plugins["netem"] is C


def test_rate_is_an_option_and_never_a_top_level_attribute() -> None:
    # The request pyroute2's TC filter builds: our keywords must all leave it, `rate` above all
    # (sent as TCA_RATE, a rate estimator, the kernel answers ERANGE).
    req = {
        "kind": "netem",
        "index": 3,
        "handle": 0x100000,
        "parent": 0x10010,
        "delay_us": 15000,
        "jitter_us": 200,
        "loss": 0.01,
        "loss_corr": 0.0,
        "limit": 1000,
        "rate_bytes": 125_000_000,
    }
    req["options"] = C.get_parameters(dict(req))
    C.fix_request(req)
    assert set(req) == {"kind", "index", "handle", "parent", "options"}
    opts = roundtrip(req["options"])
    assert opts.get_attr("TCA_NETEM_RATE")["rate"] == 125_000_000
    assert opts.get_attr("TCA_NETEM_RATE64") is None
    assert opts["limit"] == 1000 and opts["loss"] == round(0.01 * (2**32 - 1))


def test_rates_past_32_bits_go_as_rate64() -> None:
    opts = roundtrip(C.get_parameters({"delay_us": 1000, "rate_bytes": 100 * 10**9 // 8}))
    assert opts.get_attr("TCA_NETEM_RATE")["rate"] == 2**32 - 1
    assert opts.get_attr("TCA_NETEM_RATE64") == 12_500_000_000


def test_no_rate_sends_no_rate_attribute() -> None:
    assert roundtrip(C.get_parameters({"delay_us": 1000})).get_attr("TCA_NETEM_RATE") is None


def test_correlation_is_sent_even_when_zero_so_a_change_resets_it() -> None:
    opts = roundtrip(C.get_parameters({"delay_us": 1000, "loss": 0.01}))
    assert opts.get_attr("TCA_NETEM_CORR") == {"delay_corr": 0, "loss_corr": 0, "dup_corr": 0}
    assert opts.get_attr("TCA_NETEM_LOSS") is None  # independent loss: the kernel's default model


def test_correlated_loss_is_the_delay_lines_gilbert_chain() -> None:
    p, c = 0.01, 0.25
    ge = roundtrip(C.get_parameters({"loss": p, "loss_corr": c})).get_attr("TCA_NETEM_LOSS").get_attr("NETEM_LOSS_GE")
    u32 = 2**32 - 1
    good_to_bad, bad_to_good = ge["p"] / u32, ge["r"] / u32
    assert (ge["h"], ge["k1"]) == (0, 0)  # every packet lost in the bad state, none in the good
    # Stationary loss p and lag-1 correlation c, as the delay line's chain has.
    assert good_to_bad / (good_to_bad + bad_to_good) == pytest.approx(p, rel=1e-6)
    m = DelayLineModel(0.0, loss=p, loss_correlation=c)
    assert good_to_bad == pytest.approx(m._p_after_keep, rel=1e-6)
    assert 1 - bad_to_good == pytest.approx(m._p_after_drop, rel=1e-6)


def test_probabilities_outside_0_1_are_refused() -> None:
    with pytest.raises(ValueError, match="not in"):
        C.fraction_to_u32(1.5)
    assert C.fraction_to_u32(1.0) == 2**32 - 1 and C.fraction_to_u32(0.0) == 0


def test_the_leaf_describes_what_is_sent() -> None:
    leaf = NetemLeaf("w", "dc1", 0x10010, 0.015, 0.0002, 0.01, 0.25, 2923, 100_000_000)
    assert leaf.describe() == (
        "w: tc qdisc add dev dc1 parent 1:10 handle 10: netem delay 15ms 0.2ms "
        "loss gemodel 0.75% 74.25% 100% 0% limit 2923 rate 100Mbit"
    )
    assert "loss 1% limit 10 " in NetemLeaf("w", "dc1", 0x10010, 0.0, 0.0, 0.01, 0.0, 10, 10**9).describe()
