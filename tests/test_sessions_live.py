"""Closed-loop replay against the live services: the replayer follows the same rule as the simulator."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from testbed.metrics.artefacts import Summary
from testbed.metrics.artefacts.io import read_artefact
from testbed.metrics.records import read_records
from testbed.metrics.sessions import count_early_turns
from testbed.run.load import load
from testbed.run.runner import run_replay_async
from testbed.traces.synthetic import synth_profile

pytestmark = pytest.mark.app


def test_closed_loop_live_sends_no_turn_before_its_parent_finished(tmp_path: Path) -> None:
    # Dense enough that open loop would send follow-ups early (the same trace on the simulator does).
    tr = synth_profile("chat", 60, 3.0, 8)
    rs = load("paper-prfaas-cache", {"scale": {"speedup": 4}, "workload": {"arrivals": "closed"}})
    res = asyncio.run(run_replay_async(rs, tr, tmp_path, backend="inproc", report=False))
    assert res.stats.completed == len(tr)
    recs = sorted(read_records(tmp_path / "records.csv"), key=lambda r: r.trace_index)
    assert [r.session_id != "" for r in recs] == [True] * len(tr)
    assert sum(r.parent_index >= 0 for r in recs) == sum(1 for r in tr.requests if r.parent_id)
    assert count_early_turns(recs) == 0
    for r in recs:
        if r.parent_index >= 0:
            assert r.times.arrival >= recs[r.parent_index].times.last_token
    s = read_artefact(tmp_path / "summary.json", Summary)
    assert s.sessions is not None and s.sessions.arrivals == "closed" and s.sessions.early_turns == 0
