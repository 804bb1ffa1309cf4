"""`testbed calibrate` (pure): measurements generated from KNOWN profiles, fed through every input
format, must give the profiles back.

Known profiles: the paper's H200 prefill table and H20 prefill polynomial (scenarios/base/paper.yaml)
and a decode step with the paper's 25 ms base plus per-sequence and per-context terms (the paper
gives only the base; the two terms are ours, so that all three must be recovered). Noise: 1%
multiplicative, seeded. The aiperf and vllm files come from a small event-driven server (one FIFO
prefill instance, one continuous decode batch from `testbed.core.engine.decode_batch`, closed-loop
clients), so batch sizes move as they do on a real server and the reader has to estimate them.

Bars: prefill within 3% at the profile's points, decode step within 2% across (batch, context).
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from testbed.cli import main
from testbed.config.scenarios import SCENARIO_DIR, load_scenario
from testbed.core.engine.decode_batch import DecodeBatch, DecodeSeq
from testbed.core.engine.servicetime import DecodeStepTime, PrefillTime
from testbed.core.schema.hardware import PolynomialPrefill, TablePrefill
from testbed.hardware.calibrate import (
    CalibrationError,
    DecodePoint,
    PrefillPoint,
    analyse_requests,
    fit_decode,
    fit_prefill_polynomial,
    fit_prefill_table,
    hat_basis,
    holdout_mask,
)
from testbed.hardware.measurements import MeasurementError, read_aiperf, read_decode_csv, read_prefill_csv, read_vllm

pytestmark = pytest.mark.pure

PAPER = load_scenario("paper-prfaas")
H200 = PAPER.hardware["h200"].prefill
H20 = PAPER.hardware["h20"].prefill
assert isinstance(H200, TablePrefill) and isinstance(H20, PolynomialPrefill)
H200_POINTS = [p[0] for p in H200.points]  # 1K, 8K, 32K, 128K
CHECK_LENGTHS = [1024.0, 8192.0, 32768.0, 131072.0]
DECODE = DecodeStepTime(base_s=0.025, per_seq_s=4e-4, per_context_token_s=2e-8)
# (batch, total context) where the fitted step is scored: 1..32 sequences of 1K..64K tokens each.
DECODE_CHECKS = [(b, b * per) for b in (1, 4, 12, 20, 32) for per in (1024, 8192, 32768, 65536)]
NOISE = 0.01


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b


def worst_prefill(fitted: PrefillTime, true: PrefillTime, lengths: list[float], cached: float = 0.0) -> float:
    return max(_rel(fitted(u, cached), true(u, cached)) for u in lengths)


def worst_decode(fitted: DecodeStepTime) -> float:
    return max(_rel(fitted(b, c), DECODE(b, c)) for b, c in DECODE_CHECKS)


# ---- a server to measure -----------------------------------------------------------------------


@dataclass
class Served:
    prompt: int
    cached: int
    output: int
    start: float
    tokens: list[float] = field(default_factory=list)  # when each output token came out

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.start

    @property
    def latency(self) -> float:
        return self.tokens[-1] - self.start


def serve(prefill: PrefillTime, concurrency: int, jobs: list[tuple[int, int, int]], seed: int) -> list[Served]:
    """Closed-loop clients (each sends its next job when the last one ends) against one prefill
    instance (FIFO) and one decode batch; the first token comes out of the first decode step a
    request is in (as in the testbed). Every prefill and every step is off by 1% noise."""
    rng = random.Random(seed)
    batch = DecodeBatch(DECODE, bs_max=1024, kv_capacity=1 << 60)
    todo = deque(jobs)
    served: list[Served] = []
    queue: deque[int] = deque()
    prefilling: int | None = None
    prefill_end = step_end = math.inf

    def arrive(now: float) -> None:
        if todo:
            prompt, cached, output = todo.popleft()
            served.append(Served(prompt, cached, output, now))
            queue.append(len(served) - 1)

    def next_prefill(now: float) -> None:
        nonlocal prefilling, prefill_end
        if prefilling is None and queue:
            prefilling = queue.popleft()
            r = served[prefilling]
            prefill_end = now + prefill(r.prompt - r.cached, r.cached) * (1 + rng.gauss(0, NOISE))

    def next_step(now: float) -> None:
        nonlocal step_end
        batch.admit(now)
        step_end = now + batch.step_duration() * (1 + rng.gauss(0, NOISE)) if batch.running else math.inf

    for _ in range(concurrency):
        arrive(0.0)
    next_prefill(0.0)
    while prefilling is not None or batch.running or batch.waiting:
        if prefill_end <= step_end:
            now = prefill_end
            assert prefilling is not None
            r = served[prefilling]
            batch.submit(DecodeSeq(str(prefilling), r.prompt, r.output, kv_bytes=1))
            prefilling, prefill_end = None, math.inf
            next_prefill(now)
            if step_end == math.inf:
                next_step(now)
        else:
            now = step_end
            for res in batch.complete_step():
                r = served[int(res.seq.request_id)]
                r.tokens.append(now)
                if res.finished:
                    arrive(now)
            next_prefill(now)
            next_step(now)
    assert all(len(r.tokens) == r.output for r in served)
    return served


def prefill_sweep(repeats: int = 3, seed: int = 1, output: int = 16) -> list[tuple[int, int, int]]:
    """Concurrency-1 jobs at 1K * 2^(k/2) tokens, 1K..128K (the profile's points among them)."""
    lengths = [round(1024 * 2 ** (k / 2)) for k in range(15)]
    jobs = [(n, 0, output) for n in lengths for _ in range(repeats)]
    random.Random(seed).shuffle(jobs)
    return jobs


def decode_jobs(n: int, seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.choice([1024, 4096, 16384, 32768, 65536]), 0, rng.randint(128, 256)) for _ in range(n)]


CONCURRENCIES = (4, 12, 24)


def runs(prefill: PrefillTime, seed: int) -> list[tuple[int, list[Served]]]:
    """One concurrency-1 prefill sweep, then decode runs at 4, 12 and 24 requests in flight."""
    out = [(1, serve(prefill, 1, prefill_sweep(seed=seed), seed))]
    for k, c in enumerate(CONCURRENCIES):
        out.append((c, serve(prefill, c, decode_jobs(4 * c, seed + k), seed + 10 + k)))
    return out


# ---- the export formats ------------------------------------------------------------------------


def aiperf_records(served: list[Served], t0_ns: int, cache_counts: bool) -> list[dict[str, Any]]:
    """Lines of aiperf 0.13's profile_export.jsonl: `MetricRecordInfo` (aiperf/common/models/
    record_models.py) dumped with exclude_none (post_processors/record_export_jsonl_writer.py and
    the buffered JSONL writer), record metrics in their display units (ms, tokens). ITL is
    (request_latency - TTFT) / (OSL - 1), inter_chunk_latency the gaps between streamed tokens."""
    out = []
    for i, r in enumerate(served):
        start = t0_ns + round(r.start * 1e9)
        end = t0_ns + round(r.tokens[-1] * 1e9)
        metrics: dict[str, Any] = {
            "input_sequence_length": {"value": r.prompt, "unit": "tokens"},
            "time_to_first_token": {"value": r.ttft * 1e3, "unit": "ms"},
            "request_latency": {"value": r.latency * 1e3, "unit": "ms"},
            "output_token_count": {"value": r.output, "unit": "tokens"},
            "output_sequence_length": {"value": r.output, "unit": "tokens"},
        }
        if r.output >= 2:
            itl = (r.latency - r.ttft) / (r.output - 1)
            metrics["time_to_second_token"] = {"value": (r.tokens[1] - r.tokens[0]) * 1e3, "unit": "ms"}
            metrics["inter_chunk_latency"] = {
                "value": [(b - a) * 1e3 for a, b in zip(r.tokens, r.tokens[1:])],
                "unit": "ms",
            }
            metrics["inter_token_latency"] = {"value": itl * 1e3, "unit": "ms"}
            metrics["output_token_throughput_per_user"] = {"value": 1 / itl, "unit": "tokens/sec/user"}
        if cache_counts:
            metrics["usage_prompt_cache_read_tokens"] = {"value": r.cached, "unit": "tokens"}
        out.append(
            {
                "metadata": {
                    "session_num": i,
                    "x_request_id": f"00000000-0000-4000-8000-{i:012d}",
                    "x_correlation_id": f"00000000-0000-4000-9000-{i:012d}",
                    "conversation_id": f"conv-{i}",
                    "turn_index": 0,
                    "request_start_ns": start,
                    "request_ack_ns": start + 2_000_000,
                    "request_end_ns": end,
                    "worker_id": "worker_359d423a",
                    "record_processor_id": "record_processor_1fa47cd7",
                    "benchmark_phase": "profiling",
                    "was_cancelled": False,
                    "agent_depth": 0,
                },
                "metrics": metrics,
            }
        )
    return out


def write_aiperf(path: Path, served: list[Served], cache_counts: bool = False) -> Path:
    recs = aiperf_records(served, 1_759_813_207_532_900_363, cache_counts)
    warm = json.loads(json.dumps(recs[0]))
    warm["metadata"]["benchmark_phase"] = "warmup"
    failed = {
        "metadata": {
            **recs[0]["metadata"],
            "session_num": len(recs),
            "was_cancelled": True,
            "cancellation_time_ns": recs[0]["metadata"]["request_start_ns"] + 1000,
        },
        "metrics": {"error_isl": {"value": 550, "unit": "tokens"}},
        "error": {
            "code": 499,
            "type": "RequestCancellationError",
            "message": "Request was cancelled after 0.000 seconds",
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in [warm, *recs, failed]))
    return path


def vllm_result(served: list[Served], concurrency: int | None, start_times: bool = True) -> dict[str, Any]:
    """`vllm bench serve --save-result --save-detailed` (vllm/benchmarks/serve.py, main branch as
    stored at commit 009e6d4a): setup and traffic fields, then the benchmark's result dict with its
    per-request lists (seconds; start_times on the client's perf_counter clock) and percentiles."""
    dur = max(r.tokens[-1] for r in served)
    ttfts = [r.ttft for r in served]
    doc: dict[str, Any] = {
        "date": "20260101-120000",
        "endpoint_type": "vllm",
        "backend": "vllm",
        "label": None,
        "model_id": "test/model",
        "tokenizer_id": "test/model",
        "num_prompts": len(served),
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": concurrency,
        "duration": dur,
        "completed": len(served),
        "failed": 0,
        "total_input_tokens": sum(r.prompt for r in served),
        "total_output_tokens": sum(r.output for r in served),
        "request_throughput": len(served) / dur,
        "request_goodput": None,
        "output_throughput": sum(r.output for r in served) / dur,
        "total_token_throughput": sum(r.prompt + r.output for r in served) / dur,
        "input_lens": [r.prompt for r in served],
        "output_lens": [r.output for r in served],
        "ttfts": ttfts,
        "itls": [[b - a for a, b in zip(r.tokens, r.tokens[1:])] for r in served],
        "latencies": [r.latency for r in served],
        "start_times": [81234.5 + r.start for r in served],
        "queue_times": [0.0 for _ in served],
        "generated_texts": ["x" * r.output for r in served],
        "errors": ["" for _ in served],
        "max_output_tokens_per_s": 0.0,
        "max_concurrent_requests": concurrency or len(served),
        "rtfx": 0.0,
        "mean_ttft_ms": 1e3 * float(np.mean(ttfts)),
        "median_ttft_ms": 1e3 * float(np.median(ttfts)),
        "std_ttft_ms": 1e3 * float(np.std(ttfts)),
        "p99_ttft_ms": 1e3 * float(np.percentile(ttfts, 99)),
    }
    if not start_times:
        del doc["start_times"]
    return doc


def write_vllm(path: Path, docs: list[dict[str, Any]]) -> Path:
    # --append-result: one json.dump per run, a newline between them.
    path.write_text("\n".join(json.dumps(d) for d in docs))
    return path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["calibrate", *argv, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def fitted_prefill(doc: dict[str, Any]) -> PrefillTime:
    spec = doc["prefill"]["spec"]
    return PrefillTime.from_spec(TablePrefill(**spec) if spec["kind"] == "table" else PolynomialPrefill(**spec))


def fitted_decode(doc: dict[str, Any]) -> DecodeStepTime:
    d = doc["decode"]
    return DecodeStepTime(d["base_s"], d["per_seq_s"], d["per_context_token_s"])


# ---- CSV ---------------------------------------------------------------------------------------


def _noisy(rng: np.random.Generator, t: float) -> float:
    return t * (1 + NOISE * rng.standard_normal())


def test_csv_polynomial_recovers_h20_with_a_cached_term(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(20)
    cached_s = 3e-6  # ours: the paper states no cached-token cost
    true = PrefillTime.from_spec(H20.model_copy(update={"cached_token_s": cached_s}))
    rows = ["prompt_tokens,cached_tokens,prefill_s"]
    for k in range(60):
        uncached = int(np.exp(rng.uniform(np.log(512), np.log(131072))))
        cached = int(rng.choice([0, 4096, 32768])) if k % 2 else 0
        rows.append(f"{uncached + cached},{cached},{_noisy(rng, true(uncached, cached)):.6f}")
    f = tmp_path / "prefill.csv"
    f.write_text("\n".join(rows) + "\n")
    doc = run_cli(["--prefill-csv", str(f), "--prefill", "polynomial"], capsys)
    fit = fitted_prefill(doc)
    assert worst_prefill(fit, true, CHECK_LENGTHS) < 0.03
    assert worst_prefill(fit, true, CHECK_LENGTHS, cached=32768) < 0.03
    assert doc["prefill"]["spec"]["cached_token_s"] > 0
    assert doc["prefill"]["held_out"]["n"] == 12 and doc["prefill"]["held_out"]["max_abs"] < 0.04


def test_csv_table_recovers_h200(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(200)
    true = PrefillTime.from_spec(H200)
    f = tmp_path / "prefill.csv"
    # No header: positional prompt_tokens, prefill_s.
    f.write_text(
        "".join(
            f"{n},{_noisy(rng, true(n)):.6f}\n"
            for n in (round(1024 * 2 ** (k / 4)) for k in range(29))
            for _ in range(2)
        )
    )
    doc = run_cli(["--prefill-csv", str(f)], capsys)
    assert doc["prefill"]["spec"]["kind"] == "table" and len(doc["prefill"]["spec"]["points"]) == 16
    assert doc["prefill"]["spec"]["cached_token_s"] == 0
    assert worst_prefill(fitted_prefill(doc), true, H200_POINTS) < 0.03


def _decode_csv(path: Path, step: DecodeStepTime, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    rows = ["# measured step times", "batch_size,context_tokens,step_s"]
    for b in (1, 2, 4, 8, 12, 16, 20, 24, 32):
        for per in (512, 2048, 8192, 32768, 65536):
            rows.append(f"{b},{b * per},{_noisy(rng, step(b, b * per)):.7f}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_csv_decode_recovers_the_step_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_cli(["--decode-csv", str(_decode_csv(tmp_path / "d.csv", DECODE, 3))], capsys)
    assert worst_decode(fitted_decode(doc)) < 0.02
    assert doc["decode"]["train"]["n"] == 36 and doc["decode"]["held_out"]["n"] == 9


def test_csv_decode_of_the_paper_constant_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paper = DecodeStepTime(0.025, 0.0, 0.0)  # scenarios/base/paper.yaml h20: 25 ms per step
    doc = run_cli(["--decode-csv", str(_decode_csv(tmp_path / "d.csv", paper, 4))], capsys)
    fit = fitted_decode(doc)
    assert max(_rel(fit(b, c), 0.025) for b, c in DECODE_CHECKS) < 0.02
    assert fit.per_seq_s >= 0 and fit.per_context_token_s >= 0


# ---- aiperf and vllm ---------------------------------------------------------------------------


def test_aiperf_exports_recover_h200_and_the_decode_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    true = PrefillTime.from_spec(H200)
    files = []
    for c, served in runs(true, seed=7):
        files += ["--aiperf", str(write_aiperf(tmp_path / f"c{c}" / "profile_export.jsonl", served))]
    files[1] = str(Path(files[1]).parent)  # an artifacts directory works too
    out = tmp_path / "h200-calibrated.yaml"
    doc = run_cli(
        [
            *files,
            "--scenario",
            "paper-prfaas",
            "--name",
            "h200",
            "--out",
            str(out),
            "--bs-max",
            "32",
            "--kv-capacity",
            "200GiB",
        ],
        capsys,
    )
    pre, dec = fitted_prefill(doc), fitted_decode(doc)
    assert worst_prefill(pre, true, H200_POINTS) < 0.03
    assert worst_decode(dec) < 0.02
    # The concurrency-1 sweep gives the prefill points (15 lengths, 3 requests each); the decode
    # runs' prefills overlapped, so they give none.
    assert len(doc["prefill"]["points"]) == 15
    assert {p["label"].split(", ")[0] for p in doc["prefill"]["points"]} == {"3 requests"}
    assert any("1 warmup left out" in n and "1 failed or cancelled" in n for n in doc["notes"])
    # The written scenario extends the base and replaces hardware.h200 only.
    sc = load_scenario(out)
    assert sc.name == "h200-calibrated"
    assert sc.hardware["h200"].decode is not None and sc.hardware["h200"].decode.bs_max == 32
    assert sc.hardware["h200"].decode.kv_capacity_bytes == 200 * 1024**3
    assert sc.hardware["h20"] == PAPER.hardware["h20"] and sc.clusters == PAPER.clusters
    head = out.read_text().splitlines()
    assert head[0] == "# Hardware profile 'h200' calibrated by `testbed calibrate` from:"
    assert any(ln.startswith("#   fit: ") and "held out (every 5th)" in ln for ln in head)
    # No tree in common with the base: an absolute path.
    assert yaml.safe_load(out.read_text())["extends"] == str(SCENARIO_DIR / "paper-prfaas.yaml")


def test_aiperf_cache_counts_give_a_cached_term(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cached_s = 4e-6
    true = PrefillTime.from_spec(H20.model_copy(update={"cached_token_s": cached_s}))
    jobs = [(u + c, c, 8) for u in (1024, 4096, 16384, 65536) for c in (0, 8192, 32768) for _ in range(3)]
    random.Random(5).shuffle(jobs)
    f = write_aiperf(tmp_path / "cache.jsonl", serve(true, 1, jobs, seed=5), cache_counts=True)
    doc = run_cli(["--aiperf", str(f), "--prefill", "polynomial", "--holdout-every", "6"], capsys)
    fit = fitted_prefill(doc)
    for c in (0.0, 32768.0):
        assert worst_prefill(fit, true, [1024.0, 16384.0, 65536.0], cached=c) < 0.03
    assert doc["prefill"]["spec"]["cached_token_s"] == pytest.approx(cached_s, rel=0.25)


def test_vllm_results_recover_h20_and_the_decode_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    true = PrefillTime.from_spec(H20)
    (c1, s1), *rest = runs(true, seed=11)
    single = write_vllm(tmp_path / "c1.json", [vllm_result(s1, c1)])
    appended = write_vllm(tmp_path / "sweep.json", [vllm_result(s, c) for c, s in rest])
    base = tmp_path / "bases" / "mine.yaml"
    base.parent.mkdir()
    base.write_text(yaml.safe_dump({"extends": str(SCENARIO_DIR / "paper-prfaas.yaml"), "name": "mine"}))
    out = tmp_path / "scen" / "h20.yaml"
    doc = run_cli(
        [
            "--vllm",
            str(single),
            "--vllm",
            str(appended),
            "--prefill",
            "polynomial",
            "--scenario",
            str(base),
            "--name",
            "h20",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert yaml.safe_load(out.read_text())["extends"] == "../bases/mine.yaml"
    assert worst_prefill(fitted_prefill(doc), true, CHECK_LENGTHS) < 0.03
    assert worst_decode(fitted_decode(doc)) < 0.02
    sc = load_scenario(out)
    got = sc.hardware["h20"]
    assert got.decode is not None and got.decode.bs_max == 20  # kept from the base
    assert got.decode.base_s == doc["block"]["decode"]["base_s"]
    assert isinstance(got.prefill, PolynomialPrefill)
    assert sc.hardware["h200"] == PAPER.hardware["h200"]


def test_vllm_without_start_times_uses_max_concurrency(tmp_path: Path) -> None:
    true = PrefillTime.from_spec(H20)
    (c1, s1), (c4, s4), *_ = runs(true, seed=13)
    f = write_vllm(
        tmp_path / "old.json", [vllm_result(s1, c1, start_times=False), vllm_result(s4, c4, start_times=False)]
    )
    a = analyse_requests(read_vllm(f))
    assert {p.batch for p in a.decode} == {1.0, 4.0}
    assert len(a.first_steps) == len(s1)  # only the concurrency-1 run is queue-free
    unknown = write_vllm(tmp_path / "none.json", [vllm_result(s4, None, start_times=False)])
    with pytest.raises(CalibrationError, match="--concurrency"):
        analyse_requests(read_vllm(unknown))
    assert {p.batch for p in analyse_requests(read_vllm(unknown), concurrency=4).decode} == {4.0}


def test_request_analysis_is_the_same_block_by_block(monkeypatch: pytest.MonkeyPatch) -> None:
    import testbed.hardware.calibrate as cal

    true = PrefillTime.from_spec(H20)
    recs = [
        cal.RequestRecord(f"r:{i}", "run", r.prompt, None, r.output, r.ttft, r.latency, r.start)
        for i, r in enumerate(serve(true, 12, decode_jobs(48, 3), seed=3))
    ]
    whole = analyse_requests(recs)
    monkeypatch.setattr(cal, "_BLOCK_CELLS", 7 * len(recs))  # blocks of 7 rows
    assert analyse_requests(recs) == whole


# ---- outputs -----------------------------------------------------------------------------------


def test_block_only_and_a_table_over_the_base_polynomial(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    true = PrefillTime.from_spec(H20)
    f = tmp_path / "p.csv"
    f.write_text(
        "prompt_tokens,prefill_s\n" + "".join(f"{n},{_noisy(rng, true(n)):.5f}\n" for n in range(1024, 131073, 4096))
    )
    block = tmp_path / "block.yaml"
    assert (
        main(
            [
                "calibrate",
                "--prefill-csv",
                str(f),
                "--decode-csv",
                str(_decode_csv(tmp_path / "d.csv", DECODE, 2)),
                "--name",
                "h20",
                "--scenario",
                "paper-prfaas",
                "--out",
                str(block),
                "--block-only",
            ]
        )
        == 0
    )
    text = block.read_text()
    assert text.startswith("# Hardware profile 'h20' calibrated") and "# prefill: table of 16 points" in text
    data = yaml.safe_load(text)
    assert list(data) == ["hardware"] and data["hardware"]["h20"]["decode"]["bs_max"] == 20
    # A table over the base's polynomial replaces it whole (list extends: the block last).
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump({"extends": [str(SCENARIO_DIR / "paper-prfaas.yaml"), str(block)], "name": "s"}))
    got = load_scenario(scen).hardware["h20"]
    assert isinstance(got.prefill, TablePrefill) and got.decode is not None
    assert worst_prefill(PrefillTime.from_spec(got.prefill), true, CHECK_LENGTHS) < 0.03
    # Without --out the block is printed after the report.
    capsys.readouterr()
    assert main(["calibrate", "--prefill-csv", str(f)]) == 0
    printed = capsys.readouterr().out
    assert "prefill: table of 16 points" in printed and "hardware:\n  calibrated:\n    prefill:" in printed


def test_report_prints_every_point_with_its_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _decode_csv(tmp_path / "d.csv", DECODE, 9)
    assert main(["calibrate", "--decode-csv", str(f), "--all-points"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("  d.csv:")]
    assert len(rows) == 45 and sum(ln.endswith("held out") for ln in rows) == 9
    assert "  fit: 36 points, mean |err|" in out and "  held out (every 5th): 9 points" in out


# ---- the fits themselves -----------------------------------------------------------------------


def test_holdout_is_every_kth_point() -> None:
    assert holdout_mask(7, 3).tolist() == [False, False, True, False, False, True, False]
    assert not holdout_mask(7, 0).any()
    with pytest.raises(CalibrationError):
        holdout_mask(7, 1)


def test_hat_basis_matches_prefill_time_including_extrapolation() -> None:
    xs = np.array([p[0] for p in H200.points])
    ys = np.array([p[1] for p in H200.points])
    t = PrefillTime.from_spec(H200)
    u = np.array([100.0, 1024.0, 5000.0, 131072.0, 200000.0])
    assert hat_basis(xs, u) @ ys == pytest.approx([t(x) for x in u])


def test_exact_data_is_fitted_exactly() -> None:
    t = PrefillTime.from_spec(H20)
    pts = [PrefillPoint(float(n), 0.0, t(n)) for n in range(1000, 130000, 7000)]
    fit = fit_prefill_polynomial(pts, 2, 0)
    # The constant is the fixed time per prefill: named as the overhead, the curve keeps the rest.
    assert fit.spec.overhead_s == pytest.approx(H20.coefficients[0], rel=1e-6)
    assert fit.spec.coefficients == pytest.approx([0.0, *H20.coefficients[1:]], rel=1e-6, abs=1e-12)
    tab = fit_prefill_table([PrefillPoint(x, 0.0, y) for x, y in H200.points for _ in range(2)], 8, 0)
    # Table 5's first segment extrapolates to 0.40 s at 0 tokens.
    assert tab.spec.overhead_s == pytest.approx(0.40, rel=1e-9)
    assert np.allclose([(x, y + tab.spec.overhead_s) for x, y in tab.spec.points], H200.points, rtol=1e-9)
    dec = fit_decode([DecodePoint(b, c, DECODE(b, c)) for b, c in DECODE_CHECKS], 0)
    assert (dec.base_s, dec.per_seq_s, dec.per_context_token_s) == pytest.approx((0.025, 4e-4, 2e-8), rel=1e-6)


def test_decode_terms_that_cannot_be_told_apart_are_fixed_at_zero() -> None:
    pts = [DecodePoint(8.0, float(c), DECODE(8, c)) for c in (10_000, 50_000, 200_000)]
    fit = fit_decode(pts, 0)
    assert fit.per_seq_s == 0 and any("batch size never varies" in n for n in fit.notes)
    assert fit.step(8, 5e4) == pytest.approx(DECODE(8, 50_000))
    # A negative slope is not a cost: the term is dropped, base stays positive.
    falling = [DecodePoint(float(b), 0.0, 0.05 - 0.001 * b) for b in (1, 2, 4, 8)]
    f2 = fit_decode(falling, 0)
    assert f2.per_seq_s == 0 and f2.base_s > 0


def test_too_few_points_say_so() -> None:
    with pytest.raises(CalibrationError, match="needs at least 3"):
        fit_prefill_polynomial([PrefillPoint(1000.0 * k, 0, 1.0 + k) for k in range(1, 4)], 2, 2)
    with pytest.raises(CalibrationError, match="two lengths"):
        fit_prefill_table([PrefillPoint(1000.0, 0, 1.0), PrefillPoint(1000.0, 0, 1.1)], 8, 0)


# ---- errors name file, line and field ----------------------------------------------------------


def test_csv_errors_name_file_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.csv"
    f.write_text("prompt_tokens,cached_tokens,prefill_s\n1024,0,0.44\n\n8192,0,fast\n")
    with pytest.raises(MeasurementError) as e:
        read_prefill_csv(f)
    assert str(e.value) == f"{f}:4: field 'prefill_s': expected a number, got 'fast'"
    f.write_text("prompt_tokens,cached_tokens,prefill_s\n1024,2048,0.44\n")
    with pytest.raises(MeasurementError, match=r"p\.csv:2: field 'cached_tokens': 2048 cached tokens is more"):
        read_prefill_csv(f)
    f.write_text("1024,0,fast\n")  # no header: a bad first row is data, not a header
    with pytest.raises(MeasurementError, match=r"p\.csv:1: field 'prefill_s': expected a number"):
        read_prefill_csv(f)
    d = tmp_path / "d.csv"
    d.write_text("batch,context_tokens,step_s\n1,100,0.02\n")
    with pytest.raises(MeasurementError, match=r"d\.csv:1: field 'batch_size': missing column"):
        read_decode_csv(d)
    d.write_text("4,100,0.02\n4,1e5.5,0.03\n")
    with pytest.raises(MeasurementError, match=r"d\.csv:2: field 'context_tokens': expected a number"):
        read_decode_csv(d)
    # Through the CLI: one line on stderr, exit code 2.
    assert main(["calibrate", "--decode-csv", str(d)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {d}:2: field 'context_tokens': expected a number, got '1e5.5'"


def test_aiperf_errors_name_file_line_and_field(tmp_path: Path) -> None:
    served = serve(PrefillTime.from_spec(H200), 1, [(1024, 0, 4), (8192, 0, 4)], seed=1)
    good = [json.dumps(r) for r in aiperf_records(served, 10**18, False)]
    f = tmp_path / "profile_export.jsonl"
    f.write_text(good[0] + "\n{not json\n")
    with pytest.raises(MeasurementError, match=r"profile_export\.jsonl:2: not valid JSON"):
        read_aiperf(f)
    bad = json.loads(good[1])
    bad["metrics"]["time_to_first_token"]["value"] = "soon"
    f.write_text(good[0] + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(MeasurementError) as e:
        read_aiperf(f)
    assert str(e.value) == f"{f}:2: field 'metrics.time_to_first_token.value': expected a number, got 'soon'"
    del bad["metrics"]["time_to_first_token"]
    f.write_text(json.dumps(bad) + "\n")
    with pytest.raises(MeasurementError, match=r":1: field 'metrics.time_to_first_token': missing .*--streaming"):
        read_aiperf(f)
    bad = json.loads(good[0])
    bad["metrics"]["request_latency"]["unit"] = "fortnights"
    f.write_text(json.dumps(bad) + "\n")
    with pytest.raises(MeasurementError, match=r":1: field 'metrics.request_latency.unit': unknown time unit"):
        read_aiperf(f)


def test_vllm_errors_name_file_line_and_field(tmp_path: Path) -> None:
    served = serve(PrefillTime.from_spec(H20), 1, [(1024, 0, 4)] * 5, seed=1)
    doc = vllm_result(served, 1)
    doc["ttfts"][3] = "x"
    f = write_vllm(tmp_path / "r.json", [vllm_result(served, 1), doc])
    with pytest.raises(MeasurementError) as e:
        read_vllm(f)
    assert str(e.value) == f"{f}:2: field 'ttfts[3]': expected a number, got 'x'"
    summary = vllm_result(served, 1)
    for k in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"):
        del summary[k]  # what --save-result writes without --save-detailed
    write_vllm(f, [summary])
    with pytest.raises(MeasurementError, match=r"r\.json:1: field 'input_lens': missing: .*--save-detailed"):
        read_vllm(f)
    doc = vllm_result(served, 1)
    doc["latencies"] = doc["latencies"][:-1]
    write_vllm(f, [doc])
    with pytest.raises(MeasurementError, match=r":1: field 'latencies': has 4 entries, input_lens has 5"):
        read_vllm(f)
