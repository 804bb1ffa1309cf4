from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.record import RequestRecord, StageTimes
from testbed.run.load import resolve
from testbed.studies.capacity.capacity import judge, search, write_outputs


def _rec(
    i: int, arrival: float, ttft: float, tpot: float = 0.00625, modelled: float = 0.1, outcome: str = "completed"
) -> RequestRecord:
    times = StageTimes(arrival=arrival, first_token=arrival + ttft, last_token=arrival + ttft + 10 * tpot)
    r = RequestRecord(f"r{i}", i, 1000, 11, tokens_received=11, prefill_modelled=modelled, outcome=outcome, times=times)
    return r


@pytest.mark.pure
def test_judge_stable_run() -> None:
    recs = [_rec(i, i * 0.1, 0.5) for i in range(30)]
    ok, reasons, fig = judge(recs, speedup=4, ttft_slo=10, tpot_slo=0.025, growth_limit=0.25)
    assert ok and not reasons
    assert fig["ttft_p90_s"] == pytest.approx(2.0)
    assert fig["tpot_p90_s"] == pytest.approx(0.025)


@pytest.mark.pure
def test_judge_names_each_reason() -> None:
    growing = [_rec(i, i * 0.1, 0.1 + i * 0.05) for i in range(30)]
    ok, reasons, _ = judge(growing, 4, 10, 0.025, 0.25)
    assert not ok and any("waiting grows" in r for r in reasons)
    slow_decode = [_rec(i, i * 0.1, 0.5, tpot=0.008) for i in range(30)]
    ok, reasons, _ = judge(slow_decode, 4, 10, 0.025, 0.25)
    assert not ok and any("TPOT" in r for r in reasons)
    failed = [_rec(0, 0, 0.5)] + [_rec(i, i * 0.1, 0.5, outcome="failed") for i in range(1, 3)]
    ok, reasons, _ = judge(failed, 4, 10, 0.025, 0.25)
    assert not ok and reasons[0].startswith("2 of 3 requests failed")
    late = [_rec(i, i * 0.1, 3.0) for i in range(30)]
    ok, reasons, _ = judge(late, 4, 10, 0.025, 0.25)
    assert not ok and any("P90 TTFT" in r for r in reasons)


@pytest.mark.app
def test_search_brackets_capacity(tmp_path: Path) -> None:
    # One PD-P and one PD-D instance, short outputs: prefill is the bottleneck near 1 / E[T].
    sc = load_scenario(
        "paper-homogeneous",
        {
            "clusters": [
                {"name": "pd", "datacenter": "dc-local", "kind": "pd", "hardware": "h20", "prefill": 1, "decode": 1}
            ],
            # Speedup 20 keeps the decode step (1.25 ms wire) above the event loop's timer granularity.
            "scale": {"speedup": 20, "byte_scale": 4096},
            "serving": {"stream_interval": 8},
            "workload": {"requests": 24, "output_tokens": 16, "seed": 2},
            # This test is about the bisection: the queue's growth decides it. TPOT at a 1.25 ms step
            # is a timing the host's load moves (beside the docker tier a probe's P90 read 58 ms,
            # its run marked invalid, "decode steps 46% late"), so its SLO is out of the way.
            "slo": {"ttft_s": 60.0, "tpot_s": 0.5},
        },
    )
    res = asyncio.run(
        search(
            resolve(sc), tmp_path, "inproc", lo=0.12, hi=1.2, probes=4, growth_limit=0.25, ttft_slo=60.0, verbose=False
        )
    )
    write_outputs(res, tmp_path)
    assert len(res.probes) == 4
    rates = {round(p.rate, 3): p.stable for p in res.probes}
    assert rates.get(0.12) is True and rates.get(1.2) is False, res.probes
    assert res.lambda_max is not None and 0.12 <= res.lambda_max < 1.2
    assert res.model_lambda_max is not None and 0.1 < res.model_lambda_max < 0.5
    assert (tmp_path / "capacity.md").read_text().count("| ") > 4
