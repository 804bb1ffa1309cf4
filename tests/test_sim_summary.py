"""A simulated run summarises what it holds instead of reading its own files back: the summary it
writes must be the one a later reader computes from the run directory, figure for figure; and
what a simulated replay leaves out unless asked (the report and its plots) can be had later."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import COMMAND_MODULE, COMMAND_MODULES, build_parser, main
from testbed.metrics.control import control_summary, link_phases
from testbed.metrics.fidelity import fidelity
from testbed.metrics.records import COLUMNS, as_written, format_row, parse_row
from testbed.metrics.roles import long_term_summary
from testbed.metrics.run_files import read_run_records
from testbed.metrics.summary import load_run_meta, load_run_timeseries, summarize
from testbed.metrics.timeseries import IndexedPoints, metrics_of, select
from testbed.metrics.wanlink import link_usage
from testbed.run.load import load
from testbed.run.runner import run_sim
from testbed.sim import simulate
from testbed.traces.loader import trace_from_workload
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure


def _trace(n: int) -> Trace:
    # Conversations: each turn extends the one before, so prefix caches are hit and counted.
    reqs = [
        TraceRequest(f"r{i}", 0.4 * i, 1024 * (1 + i % 5) + 37, 24 + i % 7, tuple(range(2 * (1 + i % 5))))
        for i in range(n)
    ]
    return Trace(reqs, "conversations")


@pytest.mark.parametrize(
    "scenario, overrides, trace",
    [
        ("paper-homogeneous", {}, _trace(80)),
        ("paper-prfaas-bw", {"workload": {"requests": 60, "output_tokens": 32, "seed": 4}}, None),
        ("paper-prfaas-adaptive", {}, _trace(60)),
    ],
)
def test_the_summary_of_a_simulated_run_is_the_one_its_files_give(
    tmp_path: Path, scenario: str, overrides: dict[str, object], trace: Trace | None
) -> None:
    rs = load(scenario, overrides)
    res = run_sim(rs, trace or trace_from_workload(rs.spec.workload), tmp_path, report=False)
    again = summarize(tmp_path).to_json_dict()
    assert res.summary.to_json_dict() == again
    assert again["timeseries"]["samples"] > 0 and again["requests"]["completed"] == again["requests"]["total"]
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "ttft_cdf.png").exists()


def test_a_record_as_written_is_the_row_read_back() -> None:
    st = simulate(load("paper-homogeneous"), _trace(20))
    assert len(st.records) == 20
    for rec in st.records:
        back = parse_row(dict(zip(COLUMNS, format_row(rec))))
        mine = as_written(rec)
        assert format_row(mine) == format_row(back)
        assert [getattr(mine.times, c) for c in ("arrival", "first_token", "last_token")] == [
            getattr(back.times, c) for c in ("arrival", "first_token", "last_token")
        ]
        assert mine.prefill_modelled == back.prefill_modelled


def test_a_simulated_replay_writes_its_report_only_when_asked_and_later_on_demand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {i * 500}, "input_length": 2000, "output_length": 20, '
            f'"hash_ids": [{i}, {i + 100}, {i + 200}, {i + 300}]}}\n'
            for i in range(12)
        )
    )
    base = ["replay", "--scenario", "paper-homogeneous", "--backend", "sim", "--trace", str(trace)]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    assert f"no report: `testbed report {tmp_path / 'a'}` writes report.md and its plots" in capsys.readouterr().out
    assert (tmp_path / "a" / "summary.json").is_file() and not (tmp_path / "a" / "report.md").exists()
    assert main(["report", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "report.md").is_file() and (tmp_path / "a" / "ttft_cdf.png").is_file()
    assert main([*base, "--out", str(tmp_path / "b"), "--report"]) == 0
    assert (tmp_path / "b" / "report.md").is_file()


def test_each_command_is_registered_by_the_module_the_cli_imports_for_it() -> None:
    assert set(COMMAND_MODULE.values()) <= set(COMMAND_MODULES)
    for command in COMMAND_MODULE:
        parser = build_parser([command])
        sub = next(a for a in parser._actions if a.dest == "command")
        assert command in sub.choices, command  # type: ignore[operator]
    # Without a command (--help) every module registers its own.
    every = next(a for a in build_parser([])._actions if a.dest == "command")
    # One map: every command the modules register is in it (so running it imports only its module).
    assert set(COMMAND_MODULE) == set(every.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "scenario, overrides",
    [
        ("paper-prfaas-adaptive", {}),
        ("paper-prfaas-bw", {"workload": {"requests": 60, "output_tokens": 32, "seed": 4}}),
    ],
)
def test_the_indexed_points_answer_every_question_as_the_plain_list(
    tmp_path: Path, scenario: str, overrides: dict[str, object]
) -> None:
    rs = load(scenario, overrides)
    res = run_sim(rs, trace_from_workload(rs.spec.workload) if overrides else _trace(60), tmp_path, report=False)
    meta = load_run_meta(tmp_path)
    plain = load_run_timeseries(tmp_path, meta)
    indexed = IndexedPoints(plain)
    assert metrics_of(indexed) == metrics_of(plain) and len(metrics_of(plain)) > 3
    sources = sorted({p.source for p in plain})
    assert "wan" in sources
    for m in [*metrics_of(plain), "none such"]:
        assert select(indexed, m) == select(plain, m)
        for src in sources:
            assert select(indexed, m, source=src) == select(plain, m, source=src)
    for src in [*sources, "none such"]:
        assert select(indexed, source=src) == select(plain, source=src)
    labelled = next(p for p in plain if p.labels)
    assert select(indexed, labelled.metric, labels=labelled.labels) == select(
        plain, labelled.metric, labels=labelled.labels
    )
    assert select(indexed, labels=labelled.labels) == select(plain, labels=labelled.labels)
    records = read_run_records(tmp_path)
    done = [r for r in records if r.outcome == "completed"]
    for figures in (
        lambda pts: control_summary(tmp_path, meta.t0, pts, meta.scale),
        lambda pts: long_term_summary(tmp_path, meta.t0, pts, meta.scale),
        lambda pts: link_phases(done, pts, meta.scale),
        lambda pts: link_usage(pts, records, meta.scale, None),
        lambda pts: fidelity(records, pts, meta.scale.speedup, 1.0, 0.1),
    ):
        assert figures(indexed) == figures(plain)
    assert res.summary.to_json_dict()["timeseries"]["metrics"] == metrics_of(plain)
