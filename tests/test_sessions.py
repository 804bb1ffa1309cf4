"""Sessions: stated by the synthesiser and Bailian-style fields, inferred from hash_ids, the
closed-loop rule, and `trace info`'s account of them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.core.sessions import ROOT, ClosedLoop, early_turns, plan_sessions
from testbed.traces.mooncake import load_mooncake, write_mooncake
from testbed.traces.sessions import infer_parents, session_plan, session_stats
from testbed.traces.synthetic import synth_profile
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure


def _truth(trace: Trace) -> dict[str, set[str]]:
    """The synthesiser's sessions as sets of request ids, by its session names."""
    out: dict[str, set[str]] = {}
    for r in trace.requests:
        out.setdefault(r.session_id, set()).add(r.request_id)
    return out


def _sessions(trace: Trace) -> dict[str, set[str]]:
    plan, _ = session_plan(trace)
    out: dict[str, set[str]] = {}
    for r, s in zip(trace.requests, plan.session):
        out.setdefault(s, set()).add(r.request_id)
    return out


@pytest.mark.parametrize("profile", ["chat", "agent"])
def test_synthesised_sessions_survive_the_file_exactly(tmp_path: Path, profile: str) -> None:
    tr = synth_profile(profile, 600, 4.0, 3)
    f = tmp_path / "t.jsonl"
    write_mooncake(f, tr)
    back = load_mooncake(f)
    # Request ids change on reading (file stem + line); the partition of requests must not.
    line_of = {r.request_id: f"t-{i + 1}" for i, r in enumerate(tr.requests)}
    want = sorted(sorted(line_of[x] for x in s) for s in _truth(tr).values())
    got = sorted(sorted(s) for s in _sessions(back).values())
    assert got == want
    if profile == "agent":
        thinks = [r.think_s for r in back.requests if r.parent_id]
        assert thinks and all(0 < t < 1 for t in thinks)


def test_trace_info_reports_the_synthesisers_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "chat.jsonl"
    assert main(["trace", "synth", "--prefix-reuse", "chat", "--requests", "900", "--rate", "3", "--out", str(f)]) == 0
    capsys.readouterr()
    assert main(["trace", "info", str(f), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["sessions"]
    truth = _truth(synth_profile("chat", 900, 3.0, 1))
    assert info["source"] == "stated"
    assert info["sessions"] == len(truth)
    assert info["multi_turn_sessions"] == sum(1 for s in truth.values() if len(s) > 1)
    assert info["turns_per_session"][3] == max(len(s) for s in truth.values())


def test_trace_info_summarises_a_long_traces_sessions_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from testbed.traces import trace_command

    monkeypatch.setattr(trace_command, "SESSION_REQUESTS", 500)  # 900 requests: a "long" trace here
    f = tmp_path / "chat.jsonl"
    assert main(["trace", "synth", "--prefix-reuse", "chat", "--requests", "900", "--rate", "3", "--out", str(f)]) == 0
    capsys.readouterr()
    assert main(["trace", "info", str(f), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "sessions" not in info
    assert any("sessions not summarised: 900 requests, more than 500" in n for n in info["notes"])
    assert main(["trace", "info", str(f), "--json", "--sessions"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sessions"]["source"] == "stated" and not any("sessions not" in n for n in info["notes"])


def test_sessions_inferred_from_hash_ids_match_the_synthesisers(tmp_path: Path) -> None:
    for profile, least in (("chat", 0.99), ("agent", 0.99)):
        tr = synth_profile(profile, 2000, 5.0, 2)
        bare = Trace(
            [TraceRequest(r.request_id, r.timestamp, r.input_tokens, r.output_tokens, r.hash_ids) for r in tr.requests],
            "bare",
        )
        at = {r.request_id: i for i, r in enumerate(tr.requests)}
        truth = [at[r.parent_id] if r.parent_id else ROOT for r in tr.requests]
        got = infer_parents(bare.requests)
        agree = sum(a == b for a, b in zip(truth, got)) / len(truth)
        assert agree >= least, (profile, agree)
        st = session_stats(bare)
        assert st.source == "inferred" and st.sessions > 0


def test_inference_ties_branches_and_shared_prompts() -> None:
    sys_prompt = (1, 2)
    reqs = [
        TraceRequest("a1", 0.0, 2000, 10, (*sys_prompt, 10, 11)),
        TraceRequest("b1", 1.0, 2000, 10, (*sys_prompt, 20, 21)),
        TraceRequest("c1", 1.5, 2000, 10, (*sys_prompt, 30, 31)),
        TraceRequest("d1", 1.7, 2000, 10, (*sys_prompt, 40, 41)),
        # extends a1's reusable prefix (all but its partial last block): a1's follow-up, whose own
        # reusable prefix is a1's again (its one new block is partial)
        TraceRequest("a2", 2.0, 2100, 10, (*sys_prompt, 10, 12)),
        # extends that prefix too: a1 and a2 tie on it and the latest, a2, wins
        TraceRequest("a3", 3.0, 3000, 10, (*sys_prompt, 10, 16, 17)),
        # only the shared system prompt (five requests continue it differently): a first turn
        TraceRequest("e1", 4.0, 2000, 10, (*sys_prompt, 50, 51)),
    ]
    got = infer_parents(reqs)
    assert got == [ROOT, ROOT, ROOT, ROOT, 0, 4, ROOT]
    # a branch: a3 and a3' both extend a2 (two follow-ups of one turn)
    branch = TraceRequest("a3b", 5.0, 3000, 10, (*sys_prompt, 10, 12, 18))
    assert infer_parents([*reqs, branch])[-1] == 4
    # a fourth different continuation of (1, 2, 10) makes it a shared prompt: nothing follows through it
    many = TraceRequest("x", 5.0, 3000, 10, (*sys_prompt, 10, 18, 19))
    assert infer_parents([*reqs, many])[4:] == [ROOT, ROOT, ROOT, ROOT]


def _plan(parents: list[str], ts: list[float], think: list[float]):  # type: ignore[no-untyped-def]
    ids = [f"r{i}" for i in range(len(ts))]
    return plan_sessions(ids, ts, parents, [""] * len(ts), think)


def test_closed_loop_rule() -> None:
    nan = math.nan
    plan = _plan(["", "r0", "r1", ""], [0.0, 5.0, 6.0, 1.0], [nan, nan, 0.5, nan])
    assert plan.turn == (1, 2, 3, 1) and plan.session == ("r0", "r0", "r0", "r3")
    loop = ClosedLoop(plan)
    assert loop.first_turns() == [0, 3]
    loop.sent(0, 0.0)
    # answered fast: the turn keeps the trace's pacing (parent sent + gap)
    assert loop.done(0, 2.0) == [(1, 5.0)]
    loop.sent(1, 5.0)
    # answered late (or failed late): the turn waits for the answer plus its think time
    assert loop.done(1, 20.0) == [(2, 20.5)]
    assert loop.done(3, 2.0) == []


def test_a_parent_missing_from_the_trace_makes_a_first_turn() -> None:
    plan = _plan(["gone", "r0"], [0.0, 1.0], [math.nan, math.nan])
    assert plan.parent == (ROOT, 0)


def test_early_turns_count_follow_ups_sent_before_their_parent_finished() -> None:
    nan = math.nan
    parent = [ROOT, 0, 0, 2]
    assert early_turns(parent, [0.0, 1.0, 3.0, 4.0], [2.0, 3.0, 5.0, 6.0]) == 2  # r1 (1 < 2), r3 (4 < 5)
    assert early_turns(parent, [0.0, 1.0, 3.0, 4.0], [nan, 3.0, 5.0, 6.0]) == 3  # r0 never finished


def _sim_records(arrivals: str, trace: Trace):  # type: ignore[no-untyped-def]
    from testbed.run.load import load
    from testbed.sim import SimOptions, simulate

    rs = load("paper-prfaas-cache")
    st = simulate(rs, trace, options=SimOptions(arrivals=arrivals))  # type: ignore[arg-type]
    return sorted(st.records, key=lambda r: r.trace_index)


def _early(records) -> int:  # type: ignore[no-untyped-def]
    done = [r.times.last_token if r.outcome == "completed" else math.nan for r in records]
    return early_turns([r.parent_index for r in records], [r.times.arrival for r in records], done)


def test_closed_loop_in_the_simulator_never_sends_a_turn_before_its_parent_finished() -> None:
    # Overloaded on purpose: open loop sends follow-ups before their answers exist.
    tr = synth_profile("chat", 400, 6.0, 4)
    opened = _sim_records("open", tr)
    closed = _sim_records("closed", tr)
    assert len(opened) == len(closed) == 400
    assert [r.parent_index for r in closed] == [r.parent_index for r in opened]
    assert sum(r.parent_index != ROOT for r in closed) > 200
    assert _early(closed) == 0
    assert _early(opened) > 0
    # each turn leaves at max(parent done + think, parent sent + trace gap): never before its timestamp's pacing
    by = {r.trace_index: r for r in closed}
    for r in closed:
        if r.parent_index != ROOT:
            p = by[r.parent_index]
            assert r.times.arrival >= p.times.last_token - 1e-9
    # what closed loop restores: the prefix the follow-up reuses is cached by the time it leaves
    share = [sum(r.cached_tokens for r in rs) / sum(r.input_tokens for r in rs) for rs in (opened, closed)]
    assert share[1] > share[0]


def test_a_closed_loop_run_reports_sessions_by_turn(tmp_path: Path) -> None:
    import asyncio

    from testbed.metrics.artefacts import Summary
    from testbed.metrics.artefacts.io import read_artefact
    from testbed.metrics.report import write_report
    from testbed.run.load import load
    from testbed.run.runner import run_replay_async

    rs = load("paper-prfaas-cache", {"workload": {"arrivals": "closed"}})
    tr = synth_profile("chat", 300, 4.0, 6)
    asyncio.run(run_replay_async(rs, tr, tmp_path, backend="sim"))
    s = read_artefact(tmp_path / "summary.json", Summary)
    ss = s.sessions
    assert ss is not None and ss.arrivals == "closed" and ss.early_turns == 0
    assert ss.sessions == len(_truth(tr))
    assert ss.follow_ups == sum(1 for r in tr.requests if r.parent_id)
    assert sum(t.requests for t in ss.by_turn) == 300
    assert ss.by_turn[0].turn == 1 and ss.by_turn[0].requests == ss.sessions
    # follow-ups reuse their parent's prefix: far more of their prompt is cached than a first turn's
    first, second = ss.by_turn[0].cached_token_share, ss.by_turn[1].cached_token_share
    assert first is not None and second is not None and second > first + 0.3
    write_report(tmp_path, s)
    assert (tmp_path / "turns.png").exists()
    assert "## Sessions" in (tmp_path / "report.md").read_text()
