"""Faults in the simulator, in virtual time, with the live router's rules: a killed decode
instance breaks the streams it held (those without a token yet are retried elsewhere), a killed
prefill instance's requests are retried, health probes take an instance out and bring a resumed
or restarted one back, a slowed one computes slower, an outage stalls the KV until TCP's
retransmission after it, resets resume from what was acknowledged, one that cannot resume fails
its transfers and the requests are retried, and a request past its deadline fails. The run
directory has the live run's `faults.jsonl` and report Faults section."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from testbed.core.record import RequestRecord
from testbed.core.router.retries import deadline_paper_s
from testbed.metrics.fault_effects import fault_effects, load_faults
from testbed.metrics.records import read_records
from testbed.run.load import load
from testbed.run.runner import run_sim
from testbed.sim import simulate
from testbed.sim.simulator import START_LEAD_S
from testbed.sim.wan import CONNECT_TIMEOUT_S, dial_instant, rto_instant
from testbed.traces.loader import trace_from_workload
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure

S = 4.0  # the paper scenarios' speedup: wire seconds are paper seconds / 4


def _rs(faults: list[dict[str, Any]], base: str = "paper-prfaas", **more: Any) -> Any:
    over: dict[str, Any] = {
        "faults": faults,
        "workload": {"requests": 120, "rate": 1.6, "output_tokens": 512, "seed": 7},
    }
    over.update(more)
    return load(base, over)


def _run(rs: Any, tmp_path: Path, trace: Trace | None = None, report: bool = False) -> list[RequestRecord]:
    run_sim(rs, trace or trace_from_workload(rs.spec.workload), tmp_path, report=report)
    return read_records(tmp_path / "records.csv")


def _health(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "decisions.jsonl").read_text().splitlines():
        obj = json.loads(line)
        if obj["metric"] == "health":
            out.append({"t": obj["ts"] * S, **obj["labels"]})
    return out


def test_a_decode_kill_breaks_its_streams_and_retries_what_had_no_token(tmp_path: Path) -> None:
    rs = _rs([{"kind": "kill", "at_s": 30, "node": "pd-d0"}])
    recs = _run(rs, tmp_path, report=True)
    kill = 30.0
    on_it = [r for r in recs if r.decode_node == "pd-d0" or r.retry_node == "pd-d0"]
    failed = [r for r in recs if r.outcome != "completed"]
    # What failed, as data: the kind and the killed instance on every failed record.
    assert failed and all((r.failure_kind, r.failure_node) == ("decode_node_down", "pd-d0") for r in failed)
    assert all(r.reason.startswith("decode node pd-d0 stream broke: the instance was killed") for r in failed)
    # Failed: it had streamed a token before the kill; retried: it had not.
    assert all(r.times.first_token * S < kill for r in failed)
    retried = [r for r in recs if r.retries]
    assert retried and all(
        (r.retry_kind, r.retry_node) == ("decode_node_down", "pd-d0") and r.decode_node != "pd-d0" for r in retried
    )
    assert all(r.outcome == "completed" for r in retried)
    # Nothing is served there after the kill.
    assert not [
        r for r in on_it if r.outcome == "completed" and r.decode_node == "pd-d0" and r.times.last_token * S > kill
    ]
    assert [h["state"] for h in _health(tmp_path) if h["node"] == "pd-d0"] == ["down"]
    (f,) = load_faults(tmp_path)
    assert (f.kind, f.target, f.start_s, f.end_s, f.outcome) == ("kill", "pd-d0", 30.0, None, "ok")
    (e,) = fault_effects(tmp_path, recs, S)
    assert e["failed"] == len(failed) and e["retried"] == len(retried) and e["recover_s"] is not None
    report = (tmp_path / "report.md").read_text()
    assert "## Faults" in report and f"| decode_node_down | {len(failed)} |" in report
    summary = json.loads((tmp_path / "summary.json").read_text())["requests"]
    assert summary["failure_kinds"] == {"decode_node_down": len(failed)} and summary["failure_nodes"] == {
        "pd-d0": len(failed)
    }
    print(
        f"decode kill (sim): {len(recs)} records, {len(failed)} failed, {len(retried)} retried; failed by "
        f"(kind, node): {sorted({(r.failure_kind, r.failure_node) for r in failed})}"
    )


def test_a_prefill_kill_retries_its_prefills_elsewhere_and_the_probe_takes_it_out(tmp_path: Path) -> None:
    rs = load("scenarios/faults/prefill-kill.yaml", {"workload": {"output_tokens": 256}})
    recs = _run(rs, tmp_path)
    assert all(r.outcome == "completed" for r in recs)
    retried = [r for r in recs if r.retries]
    assert retried and all((r.retry_kind, r.retry_node) == ("prefill_node_down", "prfaas-p0") for r in retried)
    assert all(r.prefill_node != "prfaas-p0" for r in retried)
    (down,) = [h for h in _health(tmp_path) if h["node"] == "prfaas-p0"]
    # Within one probe interval (0.5 wire s) of the kill, or at once if a request found it first.
    assert 37.0 <= down["t"] <= 37.0 + 0.5 * S + 1e-6 and down["state"] == "down"
    assert not [r for r in recs if r.prefill_node == "prfaas-p0" and r.times.routed * S > down["t"]]


def test_a_paused_decode_holds_its_requests_and_comes_back(tmp_path: Path) -> None:
    rs = _rs([{"kind": "pause", "at_s": 30, "duration_s": 20, "node": "pd-d1"}])
    recs = _run(rs, tmp_path)
    assert all(r.outcome == "completed" for r in recs)
    held = [r for r in recs if r.decode_node == "pd-d1" and r.times.first_token * S < 30 < r.times.last_token * S]
    assert held
    for r in held:  # its tokens stopped for the pause: 20 s more than its steps
        assert (r.times.last_token - r.times.first_token) * S > 20.0
    h = [x for x in _health(tmp_path) if x["node"] == "pd-d1"]
    assert [x["state"] for x in h] == ["down", "up"]
    # A paused instance answers no probe: out after three unanswered (2 wire s each), back after the end.
    assert 30 + 2 * S <= h[0]["t"] <= 30 + (2 + 3 * 0.5 + 0.5) * S
    assert 50 <= h[1]["t"] <= 50 + 0.5 * S + 1e-6


def test_a_restarted_instance_is_back_empty_after_its_down_time_and_start(tmp_path: Path) -> None:
    rs = _rs([{"kind": "restart", "at_s": 30, "down_s": 10, "node": "pd-p0"}], sim={"live_path": {"restart_s": 1.5}})
    recs = _run(rs, tmp_path)
    (f,) = load_faults(tmp_path)
    assert f.start_s == 30.0 and f.end_s == pytest.approx(40.0 + 1.5 * S)
    served_after = [r for r in recs if r.prefill_node == "pd-p0" and r.times.prefill_start * S > f.end_s]
    assert served_after and all(r.outcome == "completed" for r in served_after)
    assert [h["state"] for h in _health(tmp_path) if h["node"] == "pd-p0"] == ["down", "up"]


def test_a_slowed_prefill_computes_factor_times_longer_in_its_window(tmp_path: Path) -> None:
    rs = _rs([{"kind": "slow", "at_s": 20, "duration_s": 30, "factor": 3, "node": "pd-p1"}])
    plain = {r.trace_index: r for r in simulate(_rs([]), trace_from_workload(rs.spec.workload)).records}
    recs = _run(rs, tmp_path)
    inside = [r for r in recs if r.prefill_node == "pd-p1" and 20 <= r.times.prefill_start * S < 50]
    assert inside
    for r in inside:
        assert r.prefill_modelled == pytest.approx(3 * plain[r.trace_index].prefill_modelled)


def _two(tokens: int = 60000) -> Trace:
    # Long prompts: offloaded, so their KV crosses the WAN.
    return Trace([TraceRequest("a", 20.0, tokens, 16), TraceRequest("b", 60.0, tokens, 16)], "two")


def test_an_outage_stalls_the_kv_until_tcp_retransmits_after_it(tmp_path: Path) -> None:
    base = _rs([])
    lead = START_LEAD_S * S
    start = lead + 20.0 + 1.0  # the first request's prefill is under way, its KV crossing
    rs = _rs([{"kind": "outage", "at_s": start, "duration_s": 6.0}])
    plain = {r.request_id: r for r in simulate(base, _two()).records}
    recs = {r.request_id: r for r in _run(rs, tmp_path, _two())}
    a = recs["a"]
    assert a.outcome == "completed" and a.crossed_wan
    rtt = 2 * (base.inter_dc.delay + base.intra_dc.delay)
    back = rto_instant(start, start + 6.0, rtt, S)
    assert back > start + 6.0
    assert a.times.transfer_end * S > back and a.ttft > plain["a"].ttft
    assert recs["b"].ttft == pytest.approx(plain["b"].ttft)  # after it: untouched


def test_resets_in_an_outage_resume_and_count_what_they_resent(tmp_path: Path) -> None:
    start = START_LEAD_S * S + 21.0
    rs = _rs(
        [
            {"kind": "outage", "at_s": start, "duration_s": 6.0},
            {"kind": "tcp_reset", "at_s": start, "duration_s": 6.0, "count": "all", "ends": "both"},
        ]
    )
    recs = _run(rs, tmp_path, _two(), report=True)
    assert all(r.outcome == "completed" for r in recs)
    faults = load_faults(tmp_path)
    reset = next(f for f in faults if f.kind == "tcp_reset")
    assert reset.detail["connections_targeted"] >= 1 and reset.detail["modelled"]
    report = (tmp_path / "report.md").read_text()
    assert "connection losses resumed from the last acknowledged chunk" in report
    # Dialing again after the resets: the first SYN that finds the link back, a round trip on.
    base = _rs([])
    rtt = 2 * (base.inter_dc.delay + base.intra_dc.delay)
    assert dial_instant(start, start + 6.0, rtt, S) >= start + 6.0 + rtt


def test_transfers_that_cannot_resume_fail_and_their_requests_are_retried(tmp_path: Path) -> None:
    start = START_LEAD_S * S + 21.0
    # Resets, then the link stays dark past the sender's resume budget (5 wire s here).
    rs = _rs(
        [
            {"kind": "outage", "at_s": start, "duration_s": 40.0},
            {"kind": "tcp_reset", "at_s": start, "duration_s": 5.0, "count": "all"},
        ],
        transfer={"resume_timeout_s": 5.0},
    )
    recs = {r.request_id: r for r in _run(rs, tmp_path, _two())}
    a = recs["a"]
    assert a.retries == 1 and a.retry_reason == (
        "kv transfer failed: the connection was reset (tcp_reset fault) (not resumed within 5 s)"
    )
    assert (a.retry_kind, a.retry_node) == ("kv_transfer_failed", "")  # between two instances: neither named
    # Failed at the budget's end. By then the router's probes across the dark link went unanswered
    # and took the remote instances out: the retry is prefilled locally and completes.
    assert a.times.routed * S == pytest.approx(start + 5.0 * S)
    assert a.outcome == "completed" and not a.crossed_wan and a.prefill_cluster == "pd"


def test_a_partition_cuts_one_direction_only(tmp_path: Path) -> None:
    start = START_LEAD_S * S + 21.0
    rs = _rs([{"kind": "partition", "at_s": start, "duration_s": 6.0, "src": "dc-local", "dst": "dc-remote"}])
    base = _rs([])
    plain = {r.request_id: r for r in simulate(base, _two()).records}
    recs = {r.request_id: r for r in _run(rs, tmp_path, _two())}
    # KV flows remote -> local: a cut the other way leaves it alone.
    assert recs["a"].ttft == pytest.approx(plain["a"].ttft)


def test_a_rate_drop_slows_the_transfer(tmp_path: Path) -> None:
    start = START_LEAD_S * S + 20.5
    rs = _rs([{"kind": "rate_drop", "at_s": start, "duration_s": 20.0, "factor": 0.01}])
    plain = {r.request_id: r for r in simulate(_rs([]), _two()).records}
    recs = {r.request_id: r for r in _run(rs, tmp_path, _two())}
    assert recs["a"].ttft > plain["a"].ttft + 1.0 / S


def test_a_request_past_its_deadline_fails_with_the_reason(tmp_path: Path) -> None:
    # One decode instance and a long queue for it: the last ones wait past their deadline.
    rs = load("paper-prfaas", {"serving": {"deadline_s": 30.0}, "workload": {"requests": 2, "output_tokens": 2000}})
    assert deadline_paper_s(rs.spec, 2000) == max(30.0, rs.spec.serving.deadline_floor_wire_s * S)
    trace = Trace([TraceRequest("long", 0.0, 2000, 8000)], "one")
    (r,) = simulate(rs, trace).records
    assert r.outcome == "failed" and r.reason.startswith("deadline exceeded: no answer within 30 s (paper)")
    assert (r.failure_kind, r.failure_node) == ("deadline_exceeded", "")
    assert r.times.first_token * S < deadline_paper_s(rs.spec, 8000) + START_LEAD_S * S


def test_backoff_instants() -> None:
    # RTO: 200 ms + the round trip, doubling, in wire seconds scaled to paper by the speedup.
    assert rto_instant(10.0, 10.5, 0.04, 4.0) == pytest.approx(10.0 + 0.84)
    assert rto_instant(10.0, 12.0, 0.04, 4.0) == pytest.approx(10.0 + 0.84 * 3)
    # A dial's SYNs at 0, 1, 3, 7 wire s; none before the connect timeout (10 s): back off, dial again.
    assert dial_instant(0.0, 0.0, 0.1, 1.0) == pytest.approx(0.1)
    assert dial_instant(0.0, 2.5, 0.1, 1.0) == pytest.approx(3.1)
    assert dial_instant(0.0, 8.0, 0.1, 1.0) == pytest.approx(CONNECT_TIMEOUT_S + 0.05 + 0.1)
    assert math.isclose(dial_instant(0.0, 32.0, 0.4, 4.0), (CONNECT_TIMEOUT_S + 0.05) * 4 + 0.4)


def test_the_shipped_fault_scenarios_simulate_with_every_figure_of_the_faults_section(tmp_path: Path) -> None:
    for name in ("decode-kill", "prefill-kill", "wan-outage-resets"):
        rs = load(f"scenarios/faults/{name}.yaml", {"workload": {"output_tokens": 256}})
        recs = _run(rs, tmp_path / name)
        effects = fault_effects(tmp_path / name, recs, S)
        # Every failure and every retry names its kind (a node fault: the instance too).
        assert all(r.failure_kind for r in recs if r.outcome != "completed"), name
        assert all(r.retry_kind for r in recs if r.retries), name
        assert all(r.retry_node for r in recs if r.retries and r.retry_kind.endswith("_down")), name
        assert effects and all(e["affected"] > 0 and e["recover_s"] is not None for e in effects), (name, effects)
        lines = [json.loads(x) for x in (tmp_path / name / "faults.jsonl").read_text().splitlines()]
        assert all(
            set(x) == {"t", "t_wire", "fault", "kind", "phase", "target", "at_s", "detail", "outcome"} for x in lines
        )
