"""The live path's costs: measured from an emulated run's records and decode series, kept per
host, named by a scenario's `sim.live_path` (nothing, this host's, a file, or the figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.config.live_path import host_file, save_host_costs
from testbed.config.scenarios import ScenarioError
from testbed.core.record import RequestRecord, StageTimes
from testbed.core.schema.live_path import LivePathCosts
from testbed.metrics.live_path import live_path_figures
from testbed.metrics.records import write_records
from testbed.metrics.series_format import Sample, encode_line
from testbed.run.load import load

pytestmark = pytest.mark.pure


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "timeseries").mkdir(parents=True)
    recs = []
    for i, (routing, dispatch, relay) in enumerate(
        [(0.002, 0.008, 0.003), (0.004, 0.010, 0.005), (0.003, 0.009, 0.004)]
    ):
        t = StageTimes(
            arrival=1.0,
            routed=1.0 + routing,
            prefill_queued=1.0 + routing + dispatch,
            decode_first_token=2.0,
            first_token=2.0 + relay,
            decode_last_token=3.0,
            last_token=3.0 + relay / 2,
        )
        r = RequestRecord(f"r{i}", i, 1000, 10, times=t)
        r.outcome = "completed"
        recs.append(r)
    write_records(run / "records.csv", recs)
    (run / "run.json").write_text(
        json.dumps(
            {"t0": 0.0, "scenario": "x", "name": "x", "backend": "netns", "scale": {"speedup": 4, "byte_scale": 1}}
        )
    )
    lines = []
    # Two decode nodes: late time grows by 10 ms twice and 30 ms once over 20 s of decoding.
    for node, late, busy in (
        ("pd-d0", [0.0, 0.0, 0.01, 0.01, 0.02], [0, 2, 4, 6, 10]),
        ("pd-d1", [0.0, 0.03, 0.03], [0, 5, 10]),
    ):
        for k, (lv, bv) in enumerate(zip(late, busy)):
            lines.append(encode_line(0.1 * k, node, Sample("decode_step_late_s", lv, {})))
            lines.append(encode_line(0.1 * k, node, Sample("decode_step_modelled_s", float(bv), {})))
    (run / "timeseries" / "nodes.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_figures_from_an_emulated_runs_records_and_decode_series(tmp_path: Path) -> None:
    f = live_path_figures(_run_dir(tmp_path))
    assert f["routing_s"] == pytest.approx(0.003) and f["dispatch_s"] == pytest.approx(0.009)
    assert f["relay_s"] == pytest.approx(0.004) and f["relay_last_s"] == pytest.approx(0.002)
    assert f["stall_rate_per_s"] == pytest.approx(3 / 20.0) and f["stall_s"] == pytest.approx(0.05 / 3)
    assert f["runs"][0]["stalls"] == 3


def test_figures_written_before_the_last_tokens_relay_was_measured_apart_use_the_first_tokens() -> None:
    old = LivePathCosts.from_dict({"relay_s": 0.004, "quantiles": {"relay_s": [0.001, 0.009]}}, "old.json")
    assert old.relay_last_s == 0.004 and old.quantiles["relay_last_s"] == (0.001, 0.009)
    new = LivePathCosts.from_dict({"relay_s": 0.004, "relay_last_s": 0.002}, "new.json")
    assert new.relay_last_s == 0.002


def test_a_scenario_names_its_live_path_costs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert not load("paper-prfaas").live_path.any
    given = load("paper-prfaas", {"sim": {"live_path": {"relay_s": 0.005}}}).live_path
    assert given.relay_s == given.relay_last_s == 0.005 and given.source == "scenario"
    both = load("paper-prfaas", {"sim": {"live_path": {"relay_s": 0.005, "relay_last_s": 0.001}}}).live_path
    assert both.relay_last_s == 0.001
    with pytest.raises(
        ScenarioError,
        match=r"field 'sim.live_path': 'host', but this host has no figures .*"
        r"testbed bench live-path",
    ):
        load("paper-prfaas", {"sim": {"live_path": "host"}})
    saved = save_host_costs({**live_path_figures(_run_dir(tmp_path)), "host": "h"})
    assert saved == host_file()
    lp = load("paper-prfaas", {"sim": {"live_path": "host"}}).live_path
    assert lp.dispatch_s == pytest.approx(0.009) and lp.source == str(saved)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"relay_s": -1}))
    with pytest.raises(ScenarioError, match=r"field 'sim.live_path': .*bad.json: field 'relay_s': -1 is not a number"):
        load("paper-prfaas", {"sim": {"live_path": str(bad)}})
