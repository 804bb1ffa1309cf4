"""A peer in the loop: the testbed's profile as Dynamo's mocker's timing tables, the mocker's
report as the testbed's records, the refusals, and (where the `peer` extra is installed) both
simulators side by side on one trace; `bench peers`' launcher measures each run's own memory."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testbed.cli import main
from testbed.core.engine.servicetime import DecodeStepTime, PrefillTime
from testbed.core.schema.hardware import DecodeSpec, HardwareSpec, PolynomialPrefill, TablePrefill
from testbed.run.load import load
from testbed.studies.crosscheck import peer_dynamo
from testbed.studies.crosscheck.peer_bench import Sample, _run, outside_s
from testbed.studies.crosscheck.peer_timing import DECODE_TOL, PREFILL_TOL, mocker_timing
from testbed.traces.types import Trace, TraceRequest

pure = pytest.mark.pure
HAVE_DYNAMO = peer_dynamo.missing() is None


def _linear(xs: np.ndarray, ys: np.ndarray, x: float) -> float:
    """The mocker's prefill lookup: linear, extrapolated from the end segments."""
    i = min(max(int(np.searchsorted(xs, x)) - 1, 0), len(xs) - 2)
    return float(ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i]))


def _bilinear(kv: np.ndarray, ctx: np.ndarray, grid: np.ndarray, x: float, y: float) -> float:
    """The mocker's decode lookup: bilinear over (KV tokens, mean context)."""
    i = min(max(int(np.searchsorted(kv, x)) - 1, 0), len(kv) - 2)
    j = min(max(int(np.searchsorted(ctx, y)) - 1, 0), len(ctx) - 2)
    fx = (x - kv[i]) / (kv[i + 1] - kv[i])
    fy = (y - ctx[j]) / (ctx[j + 1] - ctx[j])
    top = grid[i, j] * (1 - fy) + grid[i, j + 1] * fy
    bot = grid[i + 1, j] * (1 - fy) + grid[i + 1, j + 1] * fy
    return float(top * (1 - fx) + bot * fx)


DECODE = DecodeSpec(base_s=0.012, per_seq_s=0.0004, per_context_token_s=2e-8, bs_max=32, kv_capacity_bytes=2**37)


@pure
@pytest.mark.parametrize(
    "prefill",
    [
        PolynomialPrefill(kind="polynomial", coefficients=[0.4678, 1.3004e-4, 2.979e-10]),
        TablePrefill(kind="table", points=[(1024, 0.44), (8192, 0.72), (32768, 1.84), (131072, 7.40)]),
    ],
)
def test_the_exported_tables_give_the_testbeds_service_times(prefill: Any) -> None:
    hw = HardwareSpec(prefill=prefill, decode=DECODE)
    t = mocker_timing(hw, 100_000, 120_000)
    want = PrefillTime.from_spec(prefill)
    # Up to the longest prompt exported; a table extrapolates beyond as the testbed's does.
    beyond = (130_000,) if isinstance(prefill, TablePrefill) else ()
    for n in (1, 7, 600, 1024, 5000, 8192, 20_000, 77_777, 100_000, *beyond):
        got = _linear(t.prefill_isl, t.prefill_ttft_ms, n) / 1e3
        assert got == pytest.approx(want.uncached_time(n), rel=PREFILL_TOL * 1.01), n
    assert t.max_prefill_err <= PREFILL_TOL * 1.01
    step = DecodeStepTime.from_spec(DECODE)
    for batch in (1, 3, 8, 20, 32):
        for ctx in (200, 1500, 9000, 60_000, 120_000):
            got = _bilinear(t.decode_active_kv_tokens, t.decode_context_length, t.decode_itl, batch * ctx, ctx) / 1e3
            assert got == pytest.approx(step(batch, batch * ctx), rel=DECODE_TOL * 1.5), (batch, ctx)
    path = t.write(Path(__import__("tempfile").mkdtemp()) / "t.npz")
    with np.load(path) as z:
        assert sorted(z.files) == [
            "decode_active_kv_tokens",
            "decode_context_length",
            "decode_itl",
            "prefill_isl",
            "prefill_ttft_ms",
        ]
        assert z["decode_itl"].shape == (z["decode_active_kv_tokens"].size, z["decode_context_length"].size)


def _req(arrival: float, n_in: int, n_out: int, **kw: Any) -> dict[str, Any]:
    base = {
        "arrival_time_ms": arrival,
        "input_length": n_in,
        "output_length": n_out,
        "terminal_status": "completed",
        "prefill_admit_ms": arrival + 5,
        "source_held_ms": arrival + 705,
        "destination_activated_ms": arrival + 710,
        "decode_admit_ms": arrival + 710,
        "first_token_ms": arrival + 735,
        "last_token_ms": arrival + 735 + 25 * (n_out - 1),
        "reused_input_tokens": 512,
        "prefill_worker_idx": 3,
        "decode_worker_idx": 1,
        "routing_history": [{"pool": "prefill", "released_at_ms": arrival + 2}],
    }
    return base | kw


@pure
def test_the_mockers_report_becomes_records_paired_with_the_trace() -> None:
    trace = Trace(
        [TraceRequest("a", 0.0, 3000, 10), TraceRequest("b", 1.0, 4000, 5), TraceRequest("c", 1.0, 1000, 2)], "t"
    )
    report = [_req(1000.0, 4000, 5), _req(0.0, 3000, 10), _req(1000.0, 1000, 2, terminal_status="rejected")]
    recs = peer_dynamo.records(report, trace, "pd")
    assert [r.request_id for r in recs] == ["a", "b", "c"] and [r.trace_index for r in recs] == [0, 1, 2]
    a = recs[0]
    assert a.ttft == pytest.approx(0.735) and a.tpot == pytest.approx(0.025) and a.cached_tokens == 512
    assert (a.times.routed, a.times.prefill_start, a.times.prefill_end) == pytest.approx((0.002, 0.005, 0.705))
    # The mocker moves KV instantly: it is on the decode side when the prefill holds it; the
    # wait for the decode worker's next step is admission wait.
    assert a.times.transfer_end == a.times.prefill_end and a.times.decode_admitted == pytest.approx(0.710)
    assert a.prefill_node == "pd-mocker-prefill-3" and a.decode_node == "pd-mocker-decode-1"
    assert recs[2].outcome == "failed" and recs[2].reason == "rejected" and recs[2].tokens_received == 0
    with pytest.raises(peer_dynamo.PeerError, match="3000 input tokens|4000 input tokens|not the same trace"):
        peer_dynamo.records([_req(0.0, 3001, 10), _req(1000.0, 4000, 5), _req(1000.0, 1000, 2)], trace, "pd")
    with pytest.raises(peer_dynamo.PeerError, match="reported 2 requests of the 3"):
        peer_dynamo.records(report[:2], trace, "pd")


@pure
@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("paper-prfaas", {}, "one PD cluster"),
        ("paper-prfaas-adaptive", {}, "one PD cluster"),
    ],
)
def test_what_the_mocker_cannot_model_is_refused_in_one_line(name: str, overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(peer_dynamo.PeerError, match=match) as e:
        peer_dynamo.peer_cluster(load(name, overrides))
    assert "\n" not in str(e.value)


@pure
def test_a_trace_without_prefix_hashes_gets_blocks_of_its_own(tmp_path: Path) -> None:
    trace = Trace(
        [TraceRequest("a", 0.0, 1000, 3), TraceRequest("b", 0.5, 1500, 3, (7, 8, 9)), TraceRequest("c", 1.25, 600, 3)],
        "t",
    )
    lines = [json.loads(x) for x in peer_dynamo.write_trace(tmp_path / "t.jsonl", trace).read_text().splitlines()]
    assert [x["timestamp"] for x in lines] == [0.0, 500.0, 1250.0]
    assert lines[1]["hash_ids"] == [7, 8, 9]
    assert len(lines[0]["hash_ids"]) == 2 and len(lines[2]["hash_ids"]) == 2
    assert not set(lines[0]["hash_ids"]) & set(lines[2]["hash_ids"]) and min(lines[0]["hash_ids"]) > 9


@pure
def test_without_the_extra_crosscheck_peer_says_how_to_install_it(capsys: pytest.CaptureFixture[str]) -> None:
    if HAVE_DYNAMO:
        assert peer_dynamo.missing() is None
        pytest.skip("the peer extra is installed here: the refusal is not reachable")
    rc = main(["crosscheck", "--peer", "dynamo", "--scenario", "paper-homogeneous", "--requests", "5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "prfaas-testbed[peer]" in err and len(err.splitlines()) == 1


@pure
@pytest.mark.skipif(not HAVE_DYNAMO, reason="the peer extra (ai-dynamo-runtime) is not installed")
def test_both_simulators_on_one_trace_side_by_side(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {i * 700}, "input_length": {1500 + 400 * (i % 6)}, "output_length": {20 + i % 9}, '
            f'"hash_ids": {json.dumps(list(range(i % 3 * 10, i % 3 * 10 + 3 + i % 6)))}}}\n'
            for i in range(60)
        )
    )
    out = tmp_path / "cc"
    rc = main(
        [
            "crosscheck",
            "--peer",
            "dynamo",
            "--scenario",
            "paper-homogeneous",
            "--set",
            "clusters.0.prefill=2",
            "--set",
            "clusters.0.decode=1",
            "--trace",
            str(trace),
            "--out",
            str(out),
            "--json",
        ]
    )
    assert rc == 0
    got = json.loads((out / "peer-crosscheck.json").read_text())
    rows = {r["key"]: r for r in got["rows"]}
    mocker = json.loads((out / "dynamo" / "dynamo-summary.json").read_text())
    # The records made of the mocker's report give back its own figures.
    assert rows["ttft_mean"]["peer"] == pytest.approx(mocker["mean_ttft_ms"] / 1e3, rel=1e-6)
    assert rows["itl_mean"]["peer"] == pytest.approx(mocker["mean_tpot_ms"] / 1e3, rel=1e-6)
    assert rows["throughput"]["peer"] == pytest.approx(mocker["request_throughput_rps"], rel=0.02)
    # Same timing tables, one prompt a pass: the decode step is the profile's 25 ms on both sides.
    assert rows["itl_mean"]["testbed"] == pytest.approx(0.025) and rows["itl_mean"]["verdict"] == "within"
    for key in ("ttft_mean", "itl_mean"):
        assert rows[key]["verdict"] in ("within", "explained")
        if rows[key]["verdict"] == "explained":
            assert rows[key]["explanation"]
    for r in got["rows"]:
        if r["rel"] is not None and abs(r["rel"]) > 0.05 and r["explanation"] == "":
            assert abs(r["testbed"] - r["peer"]) < 0.01, r  # only noise goes unexplained
    assert (out / "sim" / "summary.json").is_file() and (out / "dynamo" / "records.csv").is_file()
    assert (out / "peer-crosscheck.md").read_text().startswith("# paper-homogeneous: the testbed's simulator beside")


@pytest.mark.app
def test_the_bench_launcher_measures_each_runs_own_peak_memory() -> None:
    ballast = bytearray(300 * 2**20)  # this process is large; a run spawned from it is not
    ballast[::4096] = b"x" * len(ballast[::4096])
    wall, rss, out = _run(
        [sys.executable, "-c", "x = bytearray(64 * 2**20); x[::4096] = b'y' * len(x[::4096]); print('ok')"]
    )
    assert out.strip() == "ok" and wall > 0
    assert 64 <= rss < 200, rss
    assert math.isfinite(wall)


@pytest.mark.pure
def test_outside_the_engine_is_the_whole_less_the_engine_and_its_writing() -> None:
    """The testbed's engine is run.json's whole `sim.wall_s` (its writing included); the mocker's is its own
    `wall_time_ms` (it writes nothing)."""
    testbed = Sample(1.25, 0.5, 110.0, {"sim_wall_s": 0.625, "write_s": 0.125})
    mocker = Sample(4.0, 3.5, 680.0, {"import_s": 0.3})
    assert outside_s(testbed) == pytest.approx(0.625)
    assert outside_s(mocker) == pytest.approx(0.5)
