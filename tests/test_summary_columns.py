"""A long run's summary, taken a column at a time from records.parquet
(`testbed.metrics.summary_columns`), is the summary of the same records read as rows: every key,
counts exactly and floats to the last few bits (only the order of sums may differ). The runs cover
what the figures branch on: failures, cache moves, a link schedule's phases, SLOs, sessions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from summaries import alike

from testbed.metrics.columnar import iter_parquet_records
from testbed.metrics.record_table import RecordTable
from testbed.metrics.run_files import RECORDS_FILE
from testbed.metrics.summary import summarize
from testbed.run.load import load
from testbed.run.runner import run_sim
from testbed.traces.loader import trace_from_workload
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure


def _sessions(n: int) -> Trace:
    """Conversations of four turns, each extending its parent's prompt."""
    reqs = []
    for i in range(n):
        turn = i % 4
        reqs.append(
            TraceRequest(
                f"s{i // 4}t{turn}",
                0.9 * (i // 4) + 2.0 * turn,
                6144 * (turn + 1) + 100,
                64,
                tuple(range(1000 * (i // 4), 1000 * (i // 4) + 12 * (turn + 1))),
                parent_id=f"s{i // 4}t{turn - 1}" if turn else "",
            )
        )
    return Trace(sorted(reqs, key=lambda r: r.timestamp), "sessions", block_tokens=512)


CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "failures": ("scenarios/faults/decode-kill.yaml", {"workload": {"output_tokens": 256}}, 0),
    "cache moves, sessions": ("paper-prfaas-cache", {}, 160),
    "link phases": ("paper-prfaas-bw", {"links": {"inter_dc": "cross-region-100g-fluctuating"}}, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_column_summary_is_the_row_summary(case: str, tmp_path: Path) -> None:
    scenario, overrides, sessions = CASES[case]
    rs = load(scenario, overrides)
    trace = _sessions(sessions) if sessions else trace_from_workload(rs.spec.workload)
    run = run_sim(rs, trace, tmp_path, report=False, text_requests=0)  # Parquet alone, as a long run
    path = tmp_path / RECORDS_FILE
    assert path.is_file() and not (tmp_path / "records.csv").exists()
    columns = summarize(tmp_path, RecordTable(path)).to_json_dict()
    rows = summarize(tmp_path, list(iter_parquet_records(path))).to_json_dict()
    assert run.summary is not None and run.summary.to_json_dict() == columns
    differ = alike(columns, rows)
    assert not differ, "\n".join(differ)
    # What each case is there for reached the figures.
    if case == "failures":
        assert rows["requests"]["failed"] > 0 and rows["requests"]["failure_reasons"]
    elif case == "link phases":
        assert len(rows["link_phases"]) >= 2
    else:
        assert rows["sessions"] is not None and rows["cache"]["requests_with_hit"] > 0
    assert rows["offload"]["requests"] > 0 and rows["ttft_s"]["n"] > 0


@pytest.mark.parametrize(("scenario", "loop"), [("paper-prfaas", False), ("paper-prfaas-bw", True)])
def test_transfer_tails_are_kept_only_for_a_short_term_loop_to_read(scenario: str, loop: bool) -> None:
    """A run without the bandwidth loop held a float per offloaded request to its end (10M requests: ~300 MB)."""
    from testbed.sim.simulator import Simulation

    rs = load(scenario)
    sim = Simulation(rs, trace_from_workload(rs.spec.workload))
    st = sim.run()
    books = sim.router.books
    assert st.completed and books.keep_tails is loop
    if not loop:
        assert books.tails == []
    books.keep_tails = True
    books.note_tail(0.5)
    assert books.tails[-1] == 0.5
