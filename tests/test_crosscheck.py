"""`testbed crosscheck`: verdicts against the tolerances, explanations computed from the records
(pure, on synthetic run directories), reuse of a recorded run and `--check` (pure: simulated
runs), and one tiny crosscheck against the inproc backend (app)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testbed.cli import main
from testbed.core.record import RequestRecord, StageTimes
from testbed.metrics.artefacts.summary_file import Validity
from testbed.metrics.records import read_records, write_records
from testbed.metrics.summary import summarize
from testbed.studies.crosscheck import crosscheck_stages as st
from testbed.studies.crosscheck.crosscheck_explain import Side
from testbed.studies.crosscheck.crosscheck_table import METRICS, Crosscheck, compare

pure = pytest.mark.pure


def rec(
    i: int,
    queue: float = 0.1,
    prefill: float = 1.0,
    tail: float = 0.01,
    step: float = 0.025,
    other: float = 0.0,
    crossed: bool = False,
    kv: int = 0,
    tokens: int = 16,
    tpot: float = 0.025,
) -> RequestRecord:
    """A completed request whose TTFT is exactly its stages (wire s; the runs below use speedup 1);
    `other` is an HTTP hop between routing and the prefill queue."""
    t = StageTimes()
    t.arrival = t.routed = 2.0 * i
    t.prefill_queued = t.routed + other
    t.prefill_start = t.prefill_queued + queue
    t.transfer_start = t.prefill_start
    t.prefill_end = t.prefill_start + prefill
    t.transfer_end = t.prefill_end + tail
    t.decode_admitted = t.transfer_end
    t.decode_first_token = t.decode_admitted + step
    t.first_token = t.decode_first_token
    t.last_token = t.first_token + (tokens - 1) * tpot
    return RequestRecord(
        f"r{i}",
        i,
        10000 + 1000 * i,
        tokens,
        prefill_cluster="prfaas" if crossed else "pd",
        crossed_wan=crossed,
        kv_bytes_paper=kv,
        kv_bytes_wire=kv,
        tokens_received=tokens,
        outcome="completed",
        threshold=19400.0,
        times=t,
    )


def side(tmp: Path, label: str, records: list[RequestRecord], valid: bool = True) -> Side:
    d = tmp / label
    d.mkdir(parents=True)
    end = max(r.times.last_token for r in records)
    (d / "run.json").write_text(
        json.dumps(
            {
                "name": label,
                "scenario": "paper-prfaas",
                "policy": "prfaas",
                "t0": 0.0,
                "t_end": end,
                "scale": {"speedup": 1, "byte_scale": 1},
                "shaping": {"method": "tbf"},
                "slo": {"ttft_s": 10.0, "tpot_s": 0.025},
            }
        )
    )
    write_records(d / "records.csv", records)
    s = summarize(d)
    if not valid:
        s.validity = Validity(valid=False, reasons=["prefill durations off the model by 9.0% (median; bound 3%)"])
        s.fidelity.prefill_rel_err_median = 0.09
    return Side(label, str(d), s, read_records(d / "records.csv"))


def row(c: Crosscheck, key: str) -> Any:
    return next(r for r in c.rows if r.key == key)


def base(n: int = 20, **kw: Any) -> list[RequestRecord]:
    return [rec(i, **kw) for i in range(n)]


@pure
def test_only_a_longer_queue_wait_is_named_as_the_ttft_difference(tmp_path: Path) -> None:
    sim = side(tmp_path, "sim", base())
    emu = side(tmp_path, "emu", base(queue=0.4))
    c = compare("paper-prfaas", sim, emu, {})
    ttft = row(c, "ttft_mean")
    assert ttft.verdict == "FAIL" and ttft.diff == pytest.approx(-0.3 / 1.435, rel=1e-6)
    assert "Most of it: prefill queue wait (100%: 0.100 s simulated, 0.400 s emulated)" in ttft.explanation
    assert "prefill compute" not in ttft.explanation and "-300 ms per request" in ttft.explanation
    # The P90 is decomposed over the slowest fifth, which names the same stage.
    assert "Most of it: prefill queue wait" in row(c, "ttft_p90").explanation
    assert row(c, "prefill_queue").explanation.startswith(
        "Mean prefill queue wait by cluster, simulated vs emulated: pd 0.100 vs 0.400 s."
    )
    # Nothing else differs: TPOT, offload and bytes agree and are not explained.
    for key in ("tpot_mean", "offload_ratio", "wan_bytes_total"):
        assert row(c, key).verdict == "ok" and row(c, key).explanation == ""
    assert c.notes == [] and [r.key for r in c.failed] == ["ttft_mean", "ttft_p90"]


@pure
def test_decomposition_ranks_stages_and_names_the_few_that_make_most_of_it() -> None:
    a = st.RunRecords("sim", base(5, other=0.0, tail=0.01), 1.0)
    b = st.RunRecords("emu", base(5, other=0.05, tail=0.04, step=0.026), 1.0)
    d = st.decompose_ttft(a, b, st.pair(a, b).pairs)
    assert d is not None and d.n == 5
    assert d.total == pytest.approx(-0.081)
    # other (62% of the absolute differences) and the tail (37%) make 70%; the first step is left out.
    assert [s.stage for s in d.leading()] == ["other", "transfer_tail"]
    assert d.share(d.leading()[0]) == pytest.approx(0.05 / 0.081)
    assert [s.stage for s in d.stages if abs(s.diff) > 1e-9] == ["transfer_tail", "first_step", "other"]


@pure
def test_tolerances_judge_each_metric_on_its_own_scale(tmp_path: Path) -> None:
    # TTFT +4% (inside 5%), TPOT +2.5% (outside 2%), one request of 20 offloaded in the
    # simulation only: offload +5 pp and WAN bytes far apart.
    emu_recs = base(20)
    faster = dict(prefill=1.0 + 0.04 * 1.135, tpot=0.025 * 1.025)
    sim_recs = [rec(i, crossed=i == 3, kv=10**9 if i == 3 else 0, **faster) for i in range(20)]
    c = compare("paper-prfaas", side(tmp_path, "sim", sim_recs), side(tmp_path, "emu", emu_recs), {"ttft_mean": 2.0})
    ttft = row(c, "ttft_mean")
    assert ttft.verdict == "ok" and ttft.cells["diff"] == "+4.0%" and ttft.explanation == ""
    assert ttft.cells["model"] == "2.000"
    tpot = row(c, "tpot_mean")
    assert tpot.verdict == "FAIL" and tpot.cells["diff"] == "+2.5%" and tpot.tolerance == "±2%"
    assert "TPOT has median +0.6" in tpot.explanation
    off = row(c, "offload_ratio")
    assert off.verdict == "FAIL" and off.cells["diff"] == "+5.0 pp" and off.tolerance == "±1 pp"
    assert (
        "1 crossed the WAN only in the simulation (input 13,000 to 13,000 tokens) and 0 only in the emulation"
        in off.explanation
    )
    wan = row(c, "wan_bytes_total")
    assert wan.verdict == "FAIL" and wan.cells["diff"] == "inf"
    assert "+1.00 GB from requests offloaded only in the simulation" in wan.explanation
    # No link counters in these runs: the counter row is shown, not judged.
    assert row(c, "wan_link_bytes").verdict == "-"
    assert "1 of 20 requests were prefilled in another cluster" in " ".join(c.notes)


@pure
def test_an_invalid_emulation_brings_its_validity_and_fidelity_figures(tmp_path: Path) -> None:
    c = compare(
        "paper-prfaas", side(tmp_path, "sim", base()), side(tmp_path, "emu", base(prefill=1.2), valid=False), {}
    )
    note = c.notes[0]
    assert note.startswith("The emulation was marked invalid") and "prefill durations off the model by 9.0%" in note
    assert "prefill timing error 9.0% (median)" in note
    assert row(c, "ttft_mean").explanation.endswith(
        "The emulation was marked invalid (see its fidelity figures above)."
    )


@pure
def test_without_an_emulation_nothing_is_judged(tmp_path: Path) -> None:
    c = compare("paper-prfaas", side(tmp_path, "sim", base()), None, {"offload_ratio": 0.5})
    assert [r.key for r in c.rows] == [m.key for m in METRICS]
    assert {r.verdict for r in c.rows} == {"-"} and not c.failed
    assert row(c, "offload_ratio").cells == {"model": "50.0%", "sim": "0.0%", "emulation": "", "diff": ""}


SIM_FAST = ["--scenario", "paper-prfaas", "--requests", "30", "--set", "workload.output_tokens=64"]


@pure
def test_a_reused_run_is_checked_for_the_same_workload_and_check_gates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same, slow = tmp_path / "same", tmp_path / "slow"
    assert main(["replay", *SIM_FAST, "--backend", "sim", "--out", str(same)]) == 0
    assert (
        main(["replay", *SIM_FAST, "--backend", "sim", "--out", str(slow), "--set", "hardware.h20.decode.base_s=0.03"])
        == 0
    )
    capsys.readouterr()
    # The simulation against a simulated run of the same workload: every judged metric agrees.
    assert (
        main(["crosscheck", *SIM_FAST, "--emulated", str(same), "--check", "--out", str(tmp_path / "a"), "--json"]) == 0
    )
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["failed"] == [] and {r["verdict"] for r in data["rows"] if r["tolerance"]} == {"ok"}
    assert data["emulation_dir"] == str(same) and "was simulated (backend sim)" in err
    assert not (tmp_path / "a" / "emulation").exists() and (tmp_path / "a" / "sim" / "summary.json").is_file()
    # A 20% slower decode step in the "emulation": TPOT fails, and --check says so.
    assert main(["crosscheck", *SIM_FAST, "--emulated", str(slow), "--check", "--out", str(tmp_path / "b")]) == 1
    out, err = capsys.readouterr()
    assert "TPOT mean (ms) (-16.7%)" in out and "1 outside tolerance: paper-prfaas: TPOT mean (ms)" in err
    # Without --check it is a report: exit 0 (the same --out again: replaced as told).
    assert main(["crosscheck", *SIM_FAST, "--emulated", str(slow), "--out", str(tmp_path / "b"), "--overwrite"]) == 0
    md = (tmp_path / "b" / "crosscheck.md").read_text()
    assert "| TPOT mean (ms) |  | 25.00 | 30.00 | -16.7% | ±2% | FAIL |" in md
    # Another workload than the recorded one is refused, naming the file.
    rc = main(
        [
            "crosscheck",
            "--scenario",
            "paper-prfaas",
            "--requests",
            "20",
            "--set",
            "workload.output_tokens=64",
            "--emulated",
            str(same),
            "--out",
            str(tmp_path / "c"),
        ]
    )
    assert rc == 2 and f"{same / 'records.csv'}: 30 requests, this workload has 20" in capsys.readouterr().err


@pure
def test_several_scenarios_reuse_a_comparison_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = ["--requests", "20", "--set", "workload.output_tokens=64"]
    assert (
        main(
            [
                "replay",
                "--compare",
                "paper-homogeneous",
                "paper-naive",
                "--backend",
                "sim",
                *wl,
                "--out",
                str(tmp_path / "cmp"),
                "--json",
            ]
        )
        == 0
    )
    capsys.readouterr()
    out = tmp_path / "cc"
    assert (
        main(
            [
                "crosscheck",
                "--scenario",
                "paper-homogeneous",
                "--scenario",
                "paper-naive",
                *wl,
                "--emulated",
                str(tmp_path / "cmp"),
                "--out",
                str(out),
                "--check",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert [c["scenario"] for c in data] == ["paper-homogeneous", "paper-naive"]
    assert [c["emulation_dir"] for c in data] == [
        str(tmp_path / "cmp" / n) for n in ("paper-homogeneous", "paper-naive")
    ]
    rows = [{r["key"]: r for r in c["rows"]} for c in data]
    # No KV crosses in homogeneous PD, so its link counters are not judged; naive offloads all.
    assert rows[0]["wan_link_bytes"]["verdict"] == "-" and rows[0]["offload_ratio"]["sim"] == 0.0
    assert rows[1]["wan_link_bytes"]["verdict"] == "ok" and rows[1]["offload_ratio"]["sim"] == 1.0
    md = (out / "crosscheck.md").read_text()
    assert md.count("## Crosscheck of ") == 2 and (out / "paper-naive" / "crosscheck.md").is_file()


@pure
def test_netns_without_root_and_conflicting_flags_are_user_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], is_root: bool
) -> None:
    assert main(["crosscheck", *SIM_FAST, "--skip-emulation", "--check", "--out", str(tmp_path)]) == 2
    assert "takes neither --emulated nor --check" in capsys.readouterr().err
    if not is_root:
        assert main(["crosscheck", *SIM_FAST, "--backend", "netns", "--out", str(tmp_path)]) == 2
        assert "--backend netns needs root" in capsys.readouterr().err


@pytest.mark.app
def test_tiny_crosscheck_against_the_inproc_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "crosscheck",
            "--scenario",
            "paper-prfaas",
            "--backend",
            "inproc",
            "--requests",
            "8",
            "--set",
            "scale.speedup=20",
            "--set",
            "workload.output_tokens=16",
            "--set",
            "serving.stream_interval=4",
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    for col in ("model", "sim", "emulation", "tolerance", "verdict"):
        assert col in out
    sim, emu = (read_records(tmp_path / d / "records.csv") for d in ("sim", "emulation"))
    # One seeded workload: the same requests, by index and length, in both runs.
    assert sorted((r.trace_index, r.input_tokens, r.output_tokens) for r in sim) == sorted(
        (r.trace_index, r.input_tokens, r.output_tokens) for r in emu
    )
    assert json.loads((tmp_path / "emulation" / "run.json").read_text())["backend"] == "inproc"
    data = json.loads((tmp_path / "crosscheck.json").read_text())
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == [m.key for m in METRICS]
    assert rows["ttft_mean"]["tolerance"] == "±5%" and rows["tpot_mean"]["tolerance"] == "±2%"
    assert rows["offload_ratio"]["tolerance"] == "±1 pp" and rows["wan_bytes_total"]["tolerance"] == "±3%"
    assert rows["ttft_mean"]["model"] > 0 and rows["offload_ratio"]["model"] > 0
    # Loopback has no WAN counters: that row is not judged; the others are, and every
    # difference outside its tolerance, or above 5% and the metric's noise floor, is explained.
    assert rows["wan_link_bytes"]["verdict"] == "-"
    assert {rows[k]["verdict"] for k in ("ttft_mean", "ttft_p90", "tpot_mean", "offload_ratio")} <= {"ok", "FAIL"}
    for m in METRICS:
        r = rows[m.key]
        big = r["rel"] is not None and abs(r["rel"]) > 0.05 and abs(r["sim"] - r["emulation"]) >= m.floor
        assert bool(r["explanation"]) == (big or r["verdict"] == "FAIL"), m.key
    assert any("not shaped" in n for n in data["notes"])
    assert (tmp_path / "crosscheck.md").read_text().startswith("# Crosscheck of paper-prfaas")


@pure
def test_a_fault_scenario_is_judged_fault_by_fault_and_failed_and_retried_differences_explained(tmp_path: Path) -> None:
    """Two simulated runs of a decode kill stand for simulation and emulation: the same workload
    with the kill at 37 s and at 40 s, so different requests are caught; every fault row is
    judged and the differences in failed and retried requests are explained from the records
    and the health lines of `decisions.jsonl`."""
    from testbed.run.load import load
    from testbed.run.runner import run_sim
    from testbed.studies.crosscheck.crosscheck import _side
    from testbed.traces.loader import trace_from_workload

    sides = []
    for label, at in (("sim", 37.0), ("emu", 40.0)):
        rs = load("scenarios/faults/decode-kill.yaml", {"faults": [{"kind": "kill", "at_s": at, "node": "pd-d0"}]})
        run_sim(rs, trace_from_workload(rs.spec.workload), tmp_path / label, report=False)
        sides.append(_side(label, tmp_path / label))
    c = compare("faults-decode-kill", sides[0], sides[1], {})
    metrics = [r.metric for r in c.faults]
    assert metrics == ["affected", "failed", "retried", "recover_s", "ttft_after"]
    assert all(r.verdict in ("ok", "FAIL") for r in c.faults)
    failed = next(r for r in c.faults if r.metric == "failed")
    assert failed.sim != failed.emulation and failed.explanation.startswith("Simulation: failed: decode_node_down x")
    assert "the router took pd-d0 out 0.00 s after the fault began" in failed.explanation
    assert "Requests that failed in one run only:" in failed.explanation
    from testbed.studies.crosscheck.crosscheck_report import markdown

    md = "\n".join(markdown(c))
    assert "## Faults" in md and "| #0 kill pd-d0 | affected, failed |" in md
    assert c.to_dict()["faults"][0]["metric"] == "affected"
