"""The emulator's own timing measures and the validity verdict (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from summaries import make_summary

from testbed.core.record import RequestRecord, StageTimes
from testbed.live.hostload import busy_share, cpu_times
from testbed.metrics.fidelity import (
    FAULT_LATE_BOUND_S_PAPER,
    LINE_LATE_S,
    delay_line_timing,
    fault_timing,
    fidelity,
    validity,
    with_fault_timing,
)
from testbed.metrics.regress import Baseline, TakenFrom, check
from testbed.metrics.series_format import SeriesPoint
from testbed.net.delayline import LATE_S

pytestmark = pytest.mark.pure


def _rec(i: int, prefill: float = 1.0, modelled: float = 1.0, lag: float = 0.001) -> RequestRecord:
    t = StageTimes(
        arrival=0.0,
        router_arrival=0.0,
        routed=0.001,
        prefill_start=0.01,
        prefill_end=0.01 + prefill,
        first_token=1.1,
        last_token=2.0,
        decode_last_token=2.0 - lag,
    )
    return RequestRecord(
        f"r{i}", i, 1000, 10, prefill_modelled=modelled, outcome="completed", tokens_received=10, times=t
    )


def _steps(modelled: float, late: float) -> list[SeriesPoint]:
    return [
        SeriesPoint(0.0, "pd-d0", "decode_step_modelled_s", 0.0),
        SeriesPoint(1.0, "pd-d0", "decode_step_modelled_s", modelled),
        SeriesPoint(0.0, "pd-d0", "decode_step_late_s", 0.0),
        SeriesPoint(1.0, "pd-d0", "decode_step_late_s", late),
    ]


def test_a_faithful_run_is_valid() -> None:
    fid = fidelity([_rec(i) for i in range(20)], _steps(10.0, 0.05), 4.0, 10.0, 0.025)
    assert fid["decode_step_late_share"] == pytest.approx(0.005)
    assert fid["token_lag_p90_s_paper"] == pytest.approx(0.004)
    assert fid["router_overhead_p90_s_paper"] == pytest.approx(0.004)
    assert validity(fid) == {"valid": True, "reasons": []}


def test_late_decode_steps_make_a_run_invalid_and_name_the_reason() -> None:
    # TPOT 69 ms where 25 ms was modelled: steps 176% late.
    samples = _steps(10.0, 17.6) + [SeriesPoint(float(t), "host", "cpu_busy", 1.0) for t in range(10)]
    val = validity(fidelity([_rec(i) for i in range(20)], samples, 4.0, 10.0, 0.025))
    assert not val["valid"]
    assert any("decode steps 176.0% late" in r for r in val["reasons"])
    assert any("saturated 100% of the run" in r for r in val["reasons"])


def test_slow_prefill_and_token_lag_are_judged_against_their_bounds() -> None:
    recs = [_rec(i, prefill=1.1, lag=0.01) for i in range(20)]
    val = validity(fidelity(recs, [], 4.0, 10.0, 0.025))
    assert len(val["reasons"]) == 2 and "prefill durations off the model by 10.0%" in val["reasons"][0]
    assert "token delivery lag P90 0.04 s paper" in val["reasons"][1]


def _step(fault: int, kind: str, phase: str, t: float, at: float, outcome: str = "ok", **detail: Any) -> dict[str, Any]:
    return {"fault": fault, "kind": kind, "phase": phase, "t": t, "at_s": at, "outcome": outcome, "detail": detail}


def test_fault_steps_are_judged_by_when_they_took_effect() -> None:
    speedup = 10.0
    on_time = [
        _step(0, "outage", "start", 20.01, 20.0, took_s_wire=0.002),
        _step(1, "tcp_reset", "start", 20.2, 20.0),
        _step(0, "outage", "end", 30.0, 30.0, took_s_wire=0.002),
        _step(1, "tcp_reset", "end", 30.5, 30.0),
        _step(2, "restart", "end", 41.0, 34.0),  # answered /health 7 s on: not a schedule
        _step(3, "kill", "start", 0.0, 1000.0, "skipped: the run ended first"),
    ]
    ft = fault_timing(on_time, speedup)
    assert ft.late_max_s_paper == pytest.approx(0.5) and ft.failed == ()
    base = fidelity([_rec(i) for i in range(20)], [], speedup, 10.0, 0.025)
    assert validity(with_fault_timing(base, ft))["valid"]
    # A reset window that closed 1.8 s wire late; a link change whose call took 0.2 s wire.
    late = fault_timing([*on_time[:3], _step(1, "tcp_reset", "end", 47.9, 30.0)], speedup)
    assert late.late_max_s_paper == pytest.approx(17.9)
    slow_call = fault_timing([_step(0, "outage", "end", 30.0, 30.0, took_s_wire=0.2)], speedup)
    assert slow_call.late_max_s_paper == pytest.approx(2.0) and 2.0 > FAULT_LATE_BOUND_S_PAPER
    for ft_bad in (late, slow_call):
        val = validity(with_fault_timing(base, ft_bad))
        assert not val["valid"] and "after its schedule (bound 1 s)" in val["reasons"][0], val
    # A step that failed: the run did not do what its scenario says.
    failed = fault_timing([_step(0, "outage", "end", 30.0, 30.0, "failed: TimeoutError: timed out")], speedup)
    val = validity(with_fault_timing(base, failed))
    assert val["reasons"] == [
        "fault #0 (outage end) failed: TimeoutError: timed out (the run did not carry out its scenario's faults)"
    ]
    # No faults: nothing judged.
    assert fault_timing([], speedup) == type(ft)(None, ())


def test_the_delay_lines_lateness_is_reported_from_its_counters_and_not_judged() -> None:
    def line(direction: str, t: float, out: float, late: float, late_packets: float) -> list[SeriesPoint]:
        labels = {"direction": direction}
        return [
            SeriesPoint(t, "delayline", "packets_out", out, labels),
            SeriesPoint(t, "delayline", "late_s", late, labels),
            SeriesPoint(t, "delayline", "late_packets", late_packets, labels),
        ]

    # Two directions; 1000 packets written over the run, 0.2 s late in all, 30 by more than LATE_S.
    samples = [*line("a->b", 0.0, 100, 0.01, 0), *line("a->b", 5.0, 700, 0.15, 20)]
    samples += [*line("b->a", 0.0, 0, 0.0, 0), *line("b->a", 5.0, 400, 0.06, 10)]
    got = delay_line_timing(samples, one_way_delay_s_wire=0.002)
    assert got["wan_line_late_mean_s_wire"] == pytest.approx(0.2 / 1000)
    assert got["wan_line_late_share_of_delay"] == pytest.approx(0.1)
    assert got["wan_line_late_packets"] == pytest.approx(0.03)
    fid = {**fidelity([_rec(i) for i in range(20)], samples, 4.0, 10.0, 0.025), **got}
    assert validity(fid)["valid"]  # reported, not judged
    assert delay_line_timing(samples, None)["wan_line_late_share_of_delay"] is None
    assert set(delay_line_timing([], 0.002).values()) == {None}  # no line
    assert LINE_LATE_S == LATE_S  # the report's threshold is the line's


def test_regress_fails_an_invalid_run_whatever_its_figures() -> None:
    base = Baseline.model_validate(
        {"schema": 1, "taken_from": {}, "metrics": {"requests.failed": {"baseline": 0, "direction": "lower_is_better"}}}
    )
    summary = make_summary(validity={"valid": False, "reasons": ["decode steps 176% late"]})
    v = check(base, summary, TakenFrom())
    assert not v.passed and [r.key for r in v.failed] == ["validity.valid"]
    assert check(base, make_summary(), TakenFrom()).passed


def test_proc_stat_cpu_share() -> None:
    a = cpu_times("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    b = cpu_times("cpu  150 0 150 900 0 0 0 0 0 0\n")
    assert a == (200, 1000) and b == (300, 1200)
    assert busy_share(a, b) == pytest.approx(0.5)
    assert cpu_times("nothing") is None


async def test_speedup_auto_takes_the_highest_faithful_speedup(tmp_path: Path) -> None:
    from testbed.live.replayer import ReplayStats
    from testbed.run.load import load
    from testbed.run.runner import RunResult
    from testbed.run.speedup import pick_speedup
    from testbed.traces.loader import trace_from_workload

    seen: list[float] = []

    async def fake_run(rs: Any, trace: Any, out: Path, backend: str, name: str = "") -> RunResult:
        s = rs.spec.scale.speedup
        seen.append(s)
        assert 120 <= len(trace) <= 160  # ~90 s of arrivals at the trace's own rate (1.6 req/s)
        ok = s <= 2
        return RunResult(
            out, ReplayStats(), False, make_summary(validity={"valid": ok, "reasons": [] if ok else ["late"]})
        )

    rs = load("paper-prfaas")
    s, tried = await pick_speedup(rs, trace_from_workload(rs.spec.workload), "inproc", tmp_path, run=fake_run)
    assert s == 2 and seen == [8, 4, 2]
    assert [t.valid for t in tried] == [False, False, True] and tried[0].reasons == ["late"]


async def test_speedup_auto_slows_time_down_when_real_time_is_not_faithful(tmp_path: Path) -> None:
    from testbed.live.replayer import ReplayStats
    from testbed.run.load import load
    from testbed.run.runner import RunResult
    from testbed.run.speedup import pick_speedup
    from testbed.traces.loader import trace_from_workload

    seen: list[float] = []

    async def fake_run(rs: Any, trace: Any, out: Path, backend: str, name: str = "") -> RunResult:
        seen.append(rs.spec.scale.speedup)
        ok = rs.spec.scale.speedup <= 0.5  # too many streams for one router at real time
        return RunResult(
            out, ReplayStats(), False, make_summary(validity={"valid": ok, "reasons": [] if ok else ["lag"]})
        )

    rs = load("paper-prfaas")
    s, _ = await pick_speedup(rs, trace_from_workload(rs.spec.workload), "inproc", tmp_path, run=fake_run)
    assert s == 0.5 and seen == [8, 4, 2, 1, 0.5]
