"""The bandwidth-aware control loop over a real shaped link: when the WAN saturates, the router
raises the threshold and records why (netns tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from replay_exit import RAN

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]


PROFILE = """\
name: drop-to-4g
description: 100 Gbit/s cross-region that drops to 4 Gbit/s after 10 s
rate: 100gbit
delay: 15ms
tcp: {congestion: cubic, rmem_max: 64MiB, wmem_max: 64MiB}
schedule:
  - {at: 10s, rate: 4gbit, note: drop}
"""


def test_link_drop_raises_the_threshold_with_a_recorded_reason(tmp_path: Path) -> None:
    prof = tmp_path / "drop.yaml"
    prof.write_text(PROFILE)
    out = tmp_path / "run"
    # 1.2 offloaded req/s x ~0.95 GB of KV is ~9 Gbit/s of demand: fine at 100, saturating at 4.
    cmd = [
        sys.executable,
        "-m",
        "testbed",
        "replay",
        "--scenario",
        "paper-prfaas-bw",
        "--out",
        str(out),
        "--backend",
        "netns",
        "--requests",
        "90",
        "--rate",
        "2.4",
        "--json",
        "--set",
        f"links.inter_dc={prof}",
        "--set",
        "scale.speedup=8",
        "--set",
        "scale.byte_scale=512",
        "--set",
        "workload.output_tokens=64",
        "--set",
        "serving.stream_interval=8",
        "--set",
        "policy.control.interval_s=1.0",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode in RAN, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"]["completed"] == 90
    ctl = s["control"]
    raised = [c for c in ctl["changes"] if c["new"] > c["old"] and "saturated" in c["reason"]]
    assert raised, ctl["changes"]
    # The first raise comes after the drop (plus the seconds it takes KV to pile up), not before.
    assert raised[0]["t_s"] > 10, raised[0]
    assert all(c["t_s"] > 10 for c in ctl["changes"] if c["new"] > c["old"]), ctl["changes"]
    assert ctl["bandwidth_estimate_min_bps"] < 10e9
    assert ctl["threshold_max"] > 19400
    report = (out / "report.md").read_text()
    assert "## Control loop" in report and (out / "control.png").exists()
