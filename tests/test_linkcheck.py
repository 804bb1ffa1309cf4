"""`testbed linkcheck` on a real shaped link (short measurements, so loose bounds: the bars
themselves are shown by `make linkcheck`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]


def test_linkcheck_measures_rtt_goodput_loss_and_rate_change() -> None:
    r = subprocess.run([sys.executable, "-m", "testbed", "linkcheck", "cross-region-100g-halving", "--speedup", "4",
                        "--wire-rate", "400mbit", "--duration", "1.5", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    out = json.loads(r.stdout)
    cfg = out["configured"]
    assert cfg["rate_bps_wire"] == pytest.approx(400e6)
    assert cfg["rtt_s_wire"] == pytest.approx(2 * 0.015 / 4)
    assert abs(out["rtt"]["median_s"] - cfg["rtt_s_wire"]) < 0.003
    multi, single, limited = out["goodput"]
    assert multi["ok"] and 0.7 * cfg["rate_bps_wire"] < multi["bps"] <= 1.02 * cfg["rate_bps_wire"]
    # A small receive buffer holds one connection near window / RTT, well under the link rate.
    assert limited["bps"] < 0.8 * cfg["rate_bps_wire"]
    assert 0.6 < limited["bps"] / limited["predicted_bps"] < 1.3
    assert out["loss"]["measured"] == 0.0
    assert out["rate_change"]["new_bps"] == pytest.approx(200e6)
    assert out["rate_change"]["follow_s"] is not None and out["rate_change"]["follow_s"] < 1.0
