"""Run summary, reports and comparison, on synthetic run directories with hand-computed figures."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from testbed.core.record import TIME_NAMES, RequestRecord, StageTimes
from testbed.metrics.records import write_records
from testbed.metrics.report import write_comparison, write_report
from testbed.metrics.report_command import print_summary_table, register
from testbed.metrics.report_format import fmt, fmt_bytes, fmt_change
from testbed.metrics.series_format import SeriesPoint, TimeseriesError
from testbed.metrics.summary import RunDirError, summarize, write_summary
from testbed.metrics.timeseries import (
    counter_rate,
    group_series,
    load_timeseries,
    resample,
    select,
)

pytestmark = pytest.mark.pure

NAN = math.nan
T0 = 1_000_000.0
S, B = 4.0, 256.0  # speedup, byte_scale


def run_json(run_dir: Path, **over: Any) -> None:
    meta: dict[str, Any] = {
        "name": "paper-prfaas",
        "scenario": "paper-prfaas",
        "policy": "prfaas",
        "t0": T0,
        "t_end": T0 + 10.0,
        "scale": {"speedup": S, "byte_scale": B},
        "shaping": {"method": "htb+tun-delay", "rate_bps": 1e9},
        "slo": {"ttft_s": 2.5, "tpot_s": 0.5},
        "offered_rate": 0.5,
        "versions": {"python": "3.11"},
        "threshold": 19400,
    }
    meta.update(over)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps(meta))


def rec(i: int, **kw: Any) -> RequestRecord:
    """A record; keyword arguments name record fields or stage times."""
    times = StageTimes(**{k: kw.pop(k) for k in TIME_NAMES if k in kw})
    base: dict[str, Any] = dict(request_id=f"r{i}", trace_index=i, input_tokens=1000, output_tokens=16, times=times)
    base.update(kw)
    return RequestRecord(**base)


def known_records() -> list[RequestRecord]:
    return [
        # Offloaded, every stage recorded. TTFT 0.7 wire; TPOT 1.0 / 10 = 0.1 wire.
        rec(
            1,
            arrival=1.0,
            routed=1.01,
            prefill_queued=1.02,
            prefill_start=1.1,
            prefill_end=1.5,
            prefill_modelled=0.38,
            transfer_start=1.2,
            transfer_end=1.6,
            decode_admitted=1.65,
            first_token=1.7,
            last_token=2.7,
            tokens_received=11,
            crossed_wan=True,
            prefill_node="prfaas-p0",
            kv_bytes_wire=1000,
            kv_bytes_paper=256_000,
            outcome="completed",
        ),
        # Local; kv_bytes_paper not recorded -> wire x byte_scale. TTFT 0.3, TPOT 0.2 / 2 = 0.1.
        rec(
            2,
            arrival=2.0,
            routed=2.0,
            prefill_queued=2.0,
            prefill_start=2.0,
            prefill_end=2.2,
            prefill_modelled=0.2,
            transfer_end=2.25,
            decode_admitted=2.25,
            first_token=2.3,
            last_token=2.5,
            tokens_received=3,
            prefill_node="pd-p0",
            kv_bytes_wire=500,
            outcome="completed",
        ),
        # Offloaded, no decode_admitted: decode_queue and first_step count 0, their 0.2 s go to other.
        # One token: no TPOT. TTFT 0.6.
        rec(
            3,
            arrival=3.0,
            routed=3.05,
            prefill_queued=3.05,
            prefill_start=3.1,
            prefill_end=3.3,
            prefill_modelled=0.19,
            transfer_end=3.4,
            first_token=3.6,
            last_token=3.6,
            tokens_received=1,
            crossed_wan=True,
            prefill_node="prfaas-p0",
            kv_bytes_wire=2000,
            kv_bytes_paper=512_000,
            outcome="completed",
        ),
        rec(
            4,
            arrival=4.0,
            outcome="failed",
            reason="transfer_timeout",
            kv_bytes_wire=999,
            failure_kind="kv_transfer_failed",
        ),
        rec(5, arrival=4.5, outcome="failed", reason="transfer_timeout", failure_kind="kv_transfer_failed"),
        rec(
            6,
            arrival=5.0,
            outcome="failed",
            reason="decode_oom",
            failure_kind="decode_node_error",
            failure_node="pd-d0",
        ),
        rec(7, arrival=9.0),  # still pending when the run stopped
    ]


def series_line(t: float, source: str, metric: str, value: float, **labels: str) -> str:
    return json.dumps({"ts": T0 + t, "source": source, "metric": metric, "value": value, "labels": labels})


def write_timeseries(run_dir: Path, truncated: bool = False) -> None:
    d = run_dir / "timeseries"
    d.mkdir(parents=True, exist_ok=True)
    p0 = [series_line(t, "prfaas-p0", "queue_depth", q) for t, q in ((0.0, 0), (1.0, 2), (2.0, 1))]
    # Cumulative counter: 1000 B in the first second, 2000 B in the next.
    p0 += [series_line(t, "prfaas-p0", "kv_bytes_sent", v) for t, v in ((0.0, 0), (1.0, 1000), (2.0, 3000))]
    p0 += [series_line(0.5, "prfaas-p0", "tcp_rtt_us", 40_000, dest="pd-d0", conn="0")]
    d0 = [series_line(t, "pd-d0", "running_batch", b) for t, b in ((0.5, 1), (1.5, 3))]
    (d / "prfaas-p0.jsonl").write_text("\n".join(p0) + "\n")
    tail = '{"ts": 1000002.5, "source": "pd-d0", "metr' if truncated else ""
    (d / "pd-d0.jsonl").write_text("\n".join(d0) + "\n" + tail)


def make_run(run_dir: Path, records: list[RequestRecord], timeseries: bool = True, **meta: Any) -> Path:
    run_json(run_dir, **meta)
    write_records(run_dir / "records.csv", records)
    if timeseries:
        write_timeseries(run_dir)
    return run_dir


# ---------------------------------------------------------------- summary


def test_summary_figures_by_hand(tmp_path: Path) -> None:
    s = summarize(make_run(tmp_path / "run", known_records()))
    ap = pytest.approx

    assert s.run.model_dump() == {
        "name": "paper-prfaas",
        "scenario": "paper-prfaas",
        "policy": "prfaas",
        "threshold": 19400.0,
        "speedup": 4.0,
        "byte_scale": 256.0,
        "shaping_method": "htb+tun-delay",
        "offered_rate_rps": 0.5,
        "slo_ttft_s": 2.5,
        "slo_tpot_s": 0.5,
        "duration_s_paper": 40.0,
        "interrupted": False,
        "cut_short": False,
        "trace_requests": None,
    }
    assert s.requests.model_dump() == {
        "total": 7,
        "completed": 3,
        "failed": 3,
        "pending": 1,
        "failure_reasons": {"transfer_timeout": 2, "decode_oom": 1},
        "failure_kinds": {"kv_transfer_failed": 2, "decode_node_error": 1},
        "failure_nodes": {"pd-d0": 1},
    }

    # TTFT wire 0.7, 0.3, 0.6 -> paper x4.
    assert s.wire.ttft_s.mean == ap((0.7 + 0.3 + 0.6) / 3)
    assert s.ttft_s.mean == ap(4 * (0.7 + 0.3 + 0.6) / 3)
    assert s.ttft_s.p50 == ap(2.4)
    assert s.ttft_s.p90 == ap(4 * (0.6 + 0.8 * 0.1))  # linear between 0.6 and 0.7
    assert s.ttft_s.n == 3
    # TPOT from requests 1 and 2 only (request 3 has one token).
    assert s.tpot_s.model_dump() == ap({"n": 2, "mean": 0.4, "p50": 0.4, "p90": 0.4, "p99": 0.4})

    bd = s.ttft_breakdown_s
    expect_wire = {
        "routing": (0.01 + 0.0 + 0.05) / 3,
        "prefill_queue": (0.08 + 0.0 + 0.05) / 3,
        "prefill_compute": (0.4 + 0.2 + 0.2) / 3,
        "transfer_tail": (0.1 + 0.05 + 0.1) / 3,
        "decode_queue": (0.05 + 0.0 + 0.0) / 3,
        "first_step": (0.05 + 0.05 + 0.0) / 3,
        "other": (0.01 + 0.0 + 0.2) / 3,
    }
    assert s.wire.ttft_breakdown_s.model_dump() == ap(expect_wire)
    assert bd.model_dump() == ap({k: 4 * v for k, v in expect_wire.items()})
    assert sum(bd.model_dump().values()) == ap(s.ttft_s.mean)

    # 10 wire s = 40 paper s; 3 completed, 15 tokens.
    th = s.throughput
    assert th.completed_rps_wire == ap(0.3)
    assert th.completed_rps_paper == ap(0.075)
    assert th.output_tokens_per_s_paper == ap(15 / 40)
    # SLO TTFT 2.5 paper s: request 1 (2.8 s) misses; 2 (1.2 s) and 3 (2.4 s, no TPOT) meet.
    assert th.slo_met == 2
    assert th.goodput_rps_paper == ap(2 / 40)
    assert th.slo_attainment == ap(2 / 7)

    assert s.offload.model_dump() == ap({"ratio": 2 / 3, "requests": 2})
    by = s.bytes
    assert by.kv_total_paper == ap(256_000 + 500 * 256 + 512_000)
    assert by.kv_total_wire == ap(3500)
    assert by.kv_per_request_paper == ap(896_000 / 3)
    assert by.wan_total_paper == ap(768_000)
    assert by.wan_per_offloaded_request_paper == ap(384_000)
    assert by.wan_per_offloaded_request_wire == ap(1500)

    # |0.4-0.38|, 0, |0.2-0.19| -> median 0.01 s; relative 0.0526, 0, 0.0526 -> invalid (bound 3%).
    fid = s.fidelity
    assert fid.n == 3
    assert fid.prefill_abs_err_median_s == ap(0.01)
    assert fid.prefill_rel_err_median == ap(0.01 / 0.19)
    assert fid.warn is None and "warn" not in s.to_json_dict()["fidelity"]  # validity is the one verdict
    assert (
        s.validity is not None
        and s.validity.valid is False
        and "prefill durations off the model by 5.3%" in s.validity.reasons[0]
    )

    # prfaas-p0 sent KV over the WAN: 3000 wire B in 2 wire s, peak 2000 B/s.
    eg = s.wan_egress
    assert eg.bytes_wire == ap(3000)
    assert eg.bytes_paper == ap(3000 * 256)
    assert eg.mean_Bps_wire == ap(1500)
    assert eg.peak_Bps_wire == ap(2000)
    assert eg.peak_Bps_paper == ap(2000 * 256 / 4)
    assert s.links["prfaas-p0"].wan is True
    assert s.timeseries.metrics == ["kv_bytes_sent", "queue_depth", "running_batch", "tcp_rtt_us"]


def test_summary_json_is_strict(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", known_records())
    s = write_summary(run)
    text = (run / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == s.to_json_dict()


@pytest.mark.parametrize(
    "records", [[], [rec(1, arrival=0.1, outcome="failed", reason="refused")]], ids=["empty", "failed-only"]
)
def test_empty_and_failed_only_runs(tmp_path: Path, records: list[RequestRecord]) -> None:
    # As an interrupted run leaves it: no t_end; and no SLO.
    run = make_run(tmp_path / "run", records, timeseries=False, t_end=None, slo=None, interrupted=True)
    s = write_summary(run)
    assert s.run.interrupted is True
    assert s.requests.completed == 0
    assert s.ttft_s.model_dump() == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert set(s.ttft_breakdown_s.model_dump().values()) == {None}
    assert s.offload.ratio is None
    assert s.bytes.kv_per_request_paper is None
    assert s.throughput.goodput_rps_paper is None
    fid = s.fidelity
    assert (fid.n, fid.prefill_abs_err_median_s, fid.prefill_rel_err_median) == (0, None, None)
    assert fid.decode_step_late_share is None and fid.token_lag_p90_s_paper is None
    assert s.validity is not None and s.validity.model_dump() == {
        "valid": True,
        "reasons": [],
    }  # nothing measured, nothing judged
    assert s.wan_egress.mean_Bps_paper is None
    report = write_report(run).read_text()
    assert "Run report" in report and "interrupted" in report
    assert (run / "ttft_cdf.png").stat().st_size > 0
    assert not (run / "queues.png").exists()


def test_missing_run_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="run.json: missing"):
        summarize(tmp_path)
    run_json(tmp_path, scale=None)
    with pytest.raises(RunDirError, match="scale"):
        summarize(tmp_path)


def test_run_without_t0_ignores_timeseries(tmp_path: Path) -> None:
    # A run killed before it started sending: run.json still has t0 = null.
    run = make_run(tmp_path / "run", [], t0=None)
    s = summarize(run)
    assert s.timeseries.samples == 0 and s.wire.duration_s is None


# ---------------------------------------------------------------- time series


def test_truncated_last_line_tolerated(tmp_path: Path) -> None:
    run_json(tmp_path)
    write_timeseries(tmp_path, truncated=True)
    samples = load_timeseries(tmp_path)
    assert len(samples) == 9
    assert [s.t for s in samples] == sorted(s.t for s in samples)
    first = select(samples, metric="queue_depth")[1]
    assert (first.t, first.source, first.value) == (1.0, "prfaas-p0", 2.0)
    assert select(samples, labels={"conn": "0"})[0].labels == {"dest": "pd-d0", "conn": "0"}


def test_malformed_middle_line_names_file_and_line(tmp_path: Path) -> None:
    run_json(tmp_path)
    d = tmp_path / "timeseries"
    d.mkdir()
    good = series_line(0.0, "router", "threshold", 19400)
    (d / "router.jsonl").write_text(f"{good}\nnot json\n{good}\n")
    with pytest.raises(TimeseriesError, match=r"router\.jsonl:2: invalid JSON"):
        load_timeseries(tmp_path)
    (d / "router.jsonl").write_text(
        f"{good}\n" + json.dumps({"ts": "x", "source": "r", "metric": "m", "value": 1}) + f"\n{good}\n"
    )
    with pytest.raises(TimeseriesError, match=r"router\.jsonl:2: 'ts' must be a number"):
        load_timeseries(tmp_path)


def test_no_timeseries_dir_means_no_samples(tmp_path: Path) -> None:
    assert load_timeseries(tmp_path, t0=0.0) == []


def test_resample_and_rates() -> None:
    pts = [SeriesPoint(t, "n", "queue_depth", v) for t, v in ((0.0, 1.0), (0.4, 3.0), (1.2, 5.0))]
    grid, held = resample(pts, 0.5, start=-0.5, end=1.5)
    assert grid.tolist() == pytest.approx([-0.5, 0.0, 0.5, 1.0, 1.5])
    assert [None if math.isnan(v) else v for v in held.tolist()] == [None, 1.0, 3.0, 3.0, 5.0]
    _, mean = resample(pts, 1.0, how="mean")
    assert mean.tolist() == [2.0, 5.0]
    counter = [SeriesPoint(t, "n", "bytes_sent", v) for t, v in ((0.0, 0.0), (1.0, 100.0), (2.0, 10.0), (3.0, 30.0))]
    t, r = counter_rate(counter)  # the drop at t=2 is a restart, skipped
    assert t.tolist() == [1.0, 3.0] and r.tolist() == [100.0, 20.0]
    keys = group_series([SeriesPoint(0, "a", "m", 1, {"conn": "1"}), SeriesPoint(0, "a", "m", 1)])
    assert list(keys) == ["a", "a{conn=1}"]


# ---------------------------------------------------------------- reports


def test_report_and_plots_written(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", known_records())
    path = write_report(run)
    text = path.read_text()
    assert path == run / "report.md"
    for needle in (
        "# Run report: paper-prfaas",
        "speedup s = 4",
        "byte_scale b = 256",
        "htb+tun-delay",
        "| TTFT mean | 2.13 s | 0.533 s |",
        "KV transfer tail",
        "| transfer_timeout | 2 |",
        "| kv_transfer_failed | 2 |",
        "| pd-d0 | 1 |",
        "INVALID RUN",
        "prefill durations off the model by 5.3%",
        "![TTFT CDF](ttft_cdf.png)",
        "![Queues](queues.png)",
    ):
        assert needle in text, needle
    for png in ("ttft_cdf.png", "queues.png", "links.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert (run / "summary.json").is_file()


def _three_runs(tmp_path: Path) -> list[Path]:
    slow = [
        rec(i, arrival=float(i), first_token=i + 1.0, last_token=i + 2.0, tokens_received=11, outcome="completed")
        for i in range(1, 5)
    ]
    fast = [
        rec(
            i,
            arrival=float(i),
            first_token=i + 0.5,
            last_token=i + 1.5,
            tokens_received=11,
            crossed_wan=True,
            outcome="completed",
        )
        for i in range(1, 5)
    ]
    return [
        make_run(tmp_path / "homo", slow, timeseries=False, name="paper-homogeneous", policy="homogeneous"),
        make_run(tmp_path / "prfaas", fast, name="paper-prfaas", policy="prfaas"),
        make_run(tmp_path / "naive", [], timeseries=False, name="paper-naive", policy="naive"),
    ]


def test_comparison_of_three_runs(tmp_path: Path) -> None:
    path = write_comparison(_three_runs(tmp_path), tmp_path / "cmp")
    text = path.read_text()
    assert path == tmp_path / "cmp" / "comparison.md"
    assert "| Metric | paper-homogeneous | paper-prfaas | paper-naive |" in text
    assert "- paper-prfaas: -50% mean TTFT, -50% P90 TTFT vs paper-homogeneous" in text
    assert "- paper-naive: n/a mean TTFT" in text
    assert "| TTFT mean (s) | 4.00 | 2.00 | n/a |" in text
    assert "| Offload ratio | 0% | 100% | n/a |" in text
    assert (tmp_path / "cmp" / "ttft_cdf.png").stat().st_size > 0
    assert not (tmp_path / "homo" / "summary.json").exists()  # comparing only reads runs


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="testbed")
    register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_cli_report_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = _three_runs(tmp_path)
    assert _cli(["report", str(runs[1]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"]["completed"] == 4
    assert _cli(["report", str(runs[0])]) == 0
    assert "TTFT mean" in capsys.readouterr().out
    assert _cli(["compare", *map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "paper-prfaas: -50% mean TTFT" in out and (tmp_path / "cmp" / "comparison.md").is_file()
    assert _cli(["compare", *map(str, runs[:2]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["baseline"] == "paper-homogeneous"
    print_summary_table(summarize(runs[1]), title="custom title")
    assert "custom title" in capsys.readouterr().out
    from testbed.cli import main

    assert main(["report", str(tmp_path / "nope")]) == 2  # a UserError: the CLI prints it
    assert "run.json: missing" in capsys.readouterr().err


def test_formatting() -> None:
    values = (0.0, 2.1333, 0.02512, 0.000872, 9.9996, 123.4, 12345.6, 1e-5)
    assert [fmt(x) for x in values] == ["0", "2.13", "0.0251", "0.000872", "10.0", "123", "12,300", "1.00e-05"]
    assert fmt(3) == "3" and fmt(None) == "n/a"
    assert fmt_bytes(896_000 / 3) == "299 kB" and fmt_bytes(1.5e9) == "1.50 GB"
    assert fmt_change(2.0, 4.0) == "-50%" and fmt_change(1.03, 1.0) == "+3.0%" and fmt_change(1.0, None) == "n/a"


def test_only_connections_that_sent_since_their_last_sample_are_sampled() -> None:
    from testbed.live.kv_sender import ConnectionStats
    from testbed.live.prefill_node import sending_connections

    def conn(i: int, sent: int, retrans: int = 0) -> ConnectionStats:
        return ConnectionStats(("10.0.0.2", 9000), i, 40_000, 100, 10, retrans, 0, sent, sent)

    seen: dict[tuple[tuple[str, int], int], tuple[int, int]] = {}
    assert [c.conn for c in sending_connections([conn(0, 0), conn(1, 0)], seen)] == [0, 1]  # new: always
    assert sending_connections([conn(0, 0), conn(1, 0)], seen) == []  # idle pool
    assert [c.conn for c in sending_connections([conn(0, 0), conn(1, 500)], seen)] == [1]
    assert [c.conn for c in sending_connections([conn(0, 0, retrans=1), conn(1, 500)], seen)] == [0]
