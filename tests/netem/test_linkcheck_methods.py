"""linkcheck's method comparison where it cannot run, its probe budget, and its table (the
measurement itself runs where both methods exist: `make test-netem`'s guest)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed.config.profiles import load_profile
from testbed.core.schema.scaling import Scale
from testbed.studies.linkcheck.linkcheck import LOSS_BAR, loss_probes_for
from testbed.studies.linkcheck.linkcheck_compare import compare_markdown


@pytest.mark.pure
def test_loss_probes_cover_the_bar_at_the_profiles_loss_and_correlation() -> None:
    lossy = load_profile("cross-region-100g-lossy").wire(Scale(1.0, 100.0))
    n = loss_probes_for(lossy)
    # Three standard deviations of the estimate fit in the bar, runs of losses included.
    sd = (0.01 * 0.99 * (1.25 / 0.75) / n) ** 0.5
    assert 3 * sd <= LOSS_BAR < 3.1 * sd
    assert loss_probes_for(load_profile("lan").wire(Scale(1.0, 100.0))) == 2000


def _method(rtt: float, loss: float, corr: float | None, reordered: float, bps: float) -> dict[str, object]:
    """One method's result; a negative `loss` stands for an INVALID figure of abs(loss)."""
    return {
        "scale": {"speedup": 1.0, "byte_scale": 2000.0},
        "mtu": 1500,
        "configured": {
            "rtt_s_wire": 0.03,
            "jitter_s_wire": 0.0002,
            "loss": 0.01,
            "loss_correlation": 0.25,
            "rate_bps_wire": 50e6,
        },
        "rtt": {"median_s": rtt, "sd_s": 0.0004, "base_median_s": 0.0005, "base_sd_s": 0.0001},
        "loss": {
            "valid": loss >= 0,
            "link": loss if loss >= 0 else None,
            "reasons": ["netem's queue may have overflowed"],
        },
        "probes": {
            "loss": abs(loss),
            "sent": 16501,
            "loss_correlation": corr,
            "reordered": reordered,
            "delay_sd_s": 0.0002,
        },
        "goodput": [{"connections": 4, "bps": bps, "reason": ""}, {"connections": 1, "bps": None, "reason": "timeout"}],
        "verdicts": {"rtt": True, "loss": loss < 0.013 if loss >= 0 else None, "goodput_multi": bps >= 45e6},
    }


@pytest.mark.pure
def test_compare_markdown_puts_the_methods_side_by_side() -> None:
    md = compare_markdown(
        [
            {
                "profile": "cross-region-100g-lossy",
                "methods": {
                    "netem": _method(0.0306, 0.0102, 0.24, 0.0, 47.1e6),
                    "fallback": _method(0.0311, 0.0161, 0.26, 0.0, 44.0e6),
                },
            }
        ]
    )
    lines = md.splitlines()
    assert "| profile | measure | configured | netem | fallback |" in lines
    assert (
        "| cross-region-100g-lossy | RTT median | 30.00 ms | 30.60 ms (unshaped 0.50 ms) | "
        "31.10 ms (unshaped 0.50 ms) |" in lines
    )
    assert "|  | loss | 1.00% | 1.02% of 16501 | 1.61% of 16501 FAIL |" in lines
    assert "|  | loss correlation (lag 1) | 0.25 | 0.240 | 0.260 |" in lines
    assert "|  | goodput, 4 conn | 50.0 Mbit/s | 47.1 Mbit/s | 44.0 Mbit/s FAIL |" in lines
    assert "|  | goodput, 1 conn | 50.0 Mbit/s | failed: timeout | failed: timeout |" in lines


@pytest.mark.pure
def test_compare_markdown_shows_an_invalid_loss_figure_as_such() -> None:
    md = compare_markdown(
        [
            {
                "profile": "cross-region-100g-lossy",
                "methods": {
                    "netem": _method(0.0306, -0.0395, None, 0.0, 47.1e6),
                    "fallback": _method(0.0311, 0.0102, 0.26, 0.0, 44.0e6),
                },
            }
        ]
    )
    assert (
        "|  | loss | 1.00% | INVALID (3.95% of 16501: netem's queue may have overflowed) | 1.02% of 16501 |"
        in md.splitlines()
    )


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_compare_methods_without_netem_says_so_in_one_line() -> None:
    from testbed.net.capabilities import probe_shaping

    if probe_shaping().netem:
        pytest.skip("this kernel has netem: the comparison would run")
    r = subprocess.run(
        [sys.executable, "-m", "testbed", "linkcheck", "--compare-methods", "lan"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs both netem and the delay line" in lines[0] and "netem=False" in lines[0]


@pytest.mark.pure
def test_goodput_past_the_ramp_leaves_out_the_slow_start() -> None:
    from testbed.studies.linkcheck.linkcheck import multi_goodput_bps, steady_rate

    # 1 MB at 1 MB/s after a ramp that moved 0.2 MB in its first second: the whole transfer
    # averages 0.5 MB/s, the stretch from 25% to 95% received runs at the link's 1 MB/s.
    samples = [(0.05 * i, int(0.2e6 * 0.05 * i)) for i in range(21)]
    samples += [(1.0 + 0.05 * i, int(0.2e6 + 1e6 * 0.05 * i)) for i in range(1, 17)]
    assert steady_rate(samples, 1_000_000) == pytest.approx(8e6, rel=0.02)
    assert steady_rate(samples[:24], 1_000_000) is None  # under half a second inside the stretch
    assert multi_goodput_bps({"bps": 4e6, "steady_bps": 8e6}) == 8e6
    assert multi_goodput_bps({"bps": 4e6, "steady_bps": None}) == 4e6
