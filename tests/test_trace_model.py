"""The model driven by a trace: the empirical length distribution, the cached prefix from
hash_ids, and `testbed model --trace`."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.engine.kvsize import KVModel
from testbed.core.routing.prefix_cache import HybridPrefixCache
from testbed.model.analytical import LengthDistribution, Workload, evaluate
from testbed.model.model_command import register, run
from testbed.model.optimise import optimise
from testbed.model.workload import EmpiricalDistribution, Routing, TraceWorkload, replay_cache, usable_cached_tokens
from testbed.traces.mooncake import write_mooncake
from testbed.traces.synthetic import sample_lengths, synth_with_prefixes
from testbed.traces.trace_command import prefix_reuse_share
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure

B = 512


def rel(a: float | None, b: float) -> float:
    assert a is not None
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------------------------------------
# Empirical distribution


@pytest.fixture(scope="module")
def lognormal_sample() -> EmpiricalDistribution:
    spec = load_scenario("paper-prfaas").workload.input
    return EmpiricalDistribution(sample_lengths(np.random.default_rng(5), 400_000, spec))


def test_empirical_atoms_and_split() -> None:
    d = EmpiricalDistribution([100, 300, 300, 700])
    assert list(d.values) == [100, 300, 700] and list(d.mass) == [0.25, 0.5, 0.25]
    # An atom at exactly t is below (L <= t stays local).
    assert d.tail(300) == pytest.approx(0.25) and d.tail(299.9) == pytest.approx(0.75)
    assert d.tail(50) == 1.0 and d.tail(700) == 0.0
    p, l_long, l_short = d.split_means(300)
    assert (p, l_long, l_short) == (pytest.approx(0.25), pytest.approx(700), pytest.approx(700 / 3))
    assert d.split_means(1000)[1] is None and d.split_means(10)[2] is None
    assert d.quantile(0.25) == 100 and d.quantile(0.5) == 300 and d.quantile(0.9) == 700
    assert d.mean() == pytest.approx(350)
    with pytest.raises(ValueError):
        EmpiricalDistribution([])
    with pytest.raises(ValueError):
        EmpiricalDistribution([1.0, -2.0])


def test_empirical_reproduces_lognormal_figures(lognormal_sample: EmpiricalDistribution) -> None:
    exact = LengthDistribution.from_spec(load_scenario("paper-prfaas").workload.input)
    for t in (4000.0, 19400.0, 60000.0):
        pe, le, se = exact.split_means(t)
        ps, ls, ss = lognormal_sample.split_means(t)
        assert abs(ps - pe) <= 0.01 and rel(ls, le or 0) <= 0.02 and rel(ss, se or 0) <= 0.02
    for q in (0.5, 0.9):
        assert rel(lognormal_sample.quantile(q), exact.quantile(q)) <= 0.02
    assert rel(lognormal_sample.mean(), exact.mean()) <= 0.02


@pytest.mark.parametrize("name", ["prfaas", "homogeneous", "naive"])
def test_empirical_model_matches_lognormal_model(lognormal_sample: EmpiricalDistribution, name: str) -> None:
    sc = load_scenario(f"paper-{name}")
    base = evaluate(sc)
    emp = evaluate(sc, workload=Workload(lognormal_sample, sc.workload.output_tokens, sc.workload.rate))
    assert rel(emp.lambda_max, base.lambda_max) <= 0.02
    for a, b in ((emp.theta_prfaas, base.theta_prfaas), (emp.theta_pdp, base.theta_pdp)):
        assert (a is None) == (b is None)
        if b is not None:
            assert rel(a, b) <= 0.02
    assert emp.theta_pdd == pytest.approx(base.theta_pdd)
    assert rel(emp.ttft_mean_s, base.ttft_mean_s) <= 0.02 and rel(emp.ttft_p90_s, base.ttft_p90_s) <= 0.02
    assert abs(emp.p - base.p) <= 0.01
    assert rel(emp.egress_bps or 1.0, base.egress_bps or 1.0) <= 0.03


def test_empirical_optimiser_matches_lognormal(lognormal_sample: EmpiricalDistribution) -> None:
    sc = load_scenario("paper-prfaas")
    a = optimise(sc)
    b = optimise(sc, workload=Workload(lognormal_sample, sc.workload.output_tokens, sc.workload.rate))
    assert (b.n_p, b.n_d) == (a.n_p, a.n_d)
    assert rel(b.lambda_max, a.lambda_max) <= 0.02 and rel(b.threshold, a.threshold) <= 0.05


def test_output_length_drives_decode_capacity(lognormal_sample: EmpiricalDistribution) -> None:
    sc = load_scenario("paper-homogeneous")
    long_ = evaluate(sc, workload=Workload(lognormal_sample, 1024, 1.0))
    short = evaluate(sc, workload=Workload(lognormal_sample, 256, 1.0))
    assert short.theta_pdd == pytest.approx(4 * long_.theta_pdd)


# ---------------------------------------------------------------------------------------------
# Cached prefix from hash_ids


def _req(i: int, tokens: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(f"r{i}", float(i), tokens, 10, tuple(ids))


HAND = [
    _req(0, 4 * B, [1, 2, 3, 4]),  # cold
    _req(1, 4 * B + 300, [1, 2, 3, 4, 5]),  # extends request 0: its 4 full blocks and its state
    _req(2, 4 * B, [1, 2, 9, 10]),  # shares 2 leading blocks; no state was taken at 2 blocks
    _req(3, 4 * B, [1, 2, 3, 4]),  # repeats request 0: one token must be computed, so 3 blocks
    _req(4, 2 * B, [7, 1]),  # hash 1 at another position is another block
    _req(5, 5 * B, [1, 2, 3, 9, 11]),  # 3 leading blocks, but no state was taken at 3 blocks
]


def test_cached_prefix_hand_made() -> None:
    plain = usable_cached_tokens(HAND, B, linear_state=False)
    assert list(plain) == [0, 4 * B, 2 * B, 3 * B, 0, 3 * B]
    hybrid = usable_cached_tokens(HAND, B, linear_state=True)
    assert list(hybrid) == [0, 4 * B, 0, 0, 0, 0]


def test_replay_cache_follows_when_prefills_end_and_where_they_run() -> None:
    plain = replay_cache(HAND, B, True)
    assert list(plain.cached) == list(usable_cached_tokens(HAND, B, True)) and not plain.offloaded.any()
    # A prompt is in the pools only 1.5 s after its arrival: request 1 (1 s after request 0)
    # finds nothing, request 3 (3 s) finds request 0's prefix.
    late = replay_cache(HAND, B, False, ready_after=lambda off, tokens, at: 1.5)
    assert list(late.cached) == [0, 0, 2 * B, 3 * B, 0, 3 * B]
    # Cache-aware at t = 1000: requests computing more than 1000 tokens after the best prefix
    # anywhere go to PrfaaS; only what the PD pool lacks is shipped.
    aware = replay_cache(HAND, B, False, Routing(threshold=1000))
    unc = [r.input_tokens - c for r, c in zip(HAND, aware.cached)]
    assert list(aware.offloaded) == [u > 1000 for u in unc]
    assert list(aware.shipped) == unc
    # Length-only at t = 2100: the whole prompt decides; PrfaaS reuses only what PrfaaS prefilled
    # (request 1 finds nothing there: request 0 ran on PD-P; request 5 finds request 1's blocks),
    # PD-P what anyone did, and an offloaded request ships its whole KV.
    blind = replay_cache(HAND, B, False, Routing(threshold=2100, cache_aware=False))
    assert list(blind.offloaded) == [r.input_tokens > 2100 for r in HAND] == [False, True, False, False, False, True]
    assert list(blind.cached) == [0, 0, 2 * B, 3 * B, 0, 3 * B]
    assert list(blind.shipped[blind.offloaded]) == [4 * B + 300, 5 * B]
    cache_aware = replay_cache(HAND, B, False, Routing(threshold=2100))
    assert list(cache_aware.cached) == list(usable_cached_tokens(HAND, B, False))
    naive = replay_cache(HAND, B, False, Routing(offload_all=True))
    assert naive.offloaded.all() and list(naive.cached) == list(usable_cached_tokens(HAND, B, False))


def test_trace_workload_under_a_routing(tmp_path: Path) -> None:
    trace = synth_with_prefixes(400, 4.0, 3)
    kv = KVModel.from_spec(load_scenario("paper-prfaas").model)
    at_once = TraceWorkload.from_trace(trace, kv)
    slow = TraceWorkload.from_trace(trace, kv, Routing(), lambda off, tokens, at: 5.0)
    assert slow.replay is not None and at_once.replay is None
    assert slow.cached_share < at_once.cached_share
    assert at_once.arrivals is not None and at_once.arrivals.rate == pytest.approx(at_once.rate)
    assert at_once.model_workload().arrival_scv == pytest.approx(at_once.arrivals.gap_scv)
    assert at_once.summary()["arrivals"]["gap_cv"] == pytest.approx(at_once.arrivals.gap_cv)


def _pool_reference(trace: Trace, kv: KVModel) -> list[int]:
    """What the testbed's own cache pool gives each request when nothing is ever evicted."""
    pool = HybridPrefixCache.for_model(kv, trace.block_tokens, 1 << 62)
    out = []
    for r in trace.requests:
        out.append(pool.match(r.hash_ids, r.input_tokens).tokens)
        pool.insert(r.hash_ids, r.input_tokens)
    return out


@pytest.mark.parametrize("model", ["paper-prfaas", "paper-prfaas-dense"])
def test_cached_prefix_matches_the_prefix_cache_pool(model: str) -> None:
    trace = synth_with_prefixes(600, 2.0, 3)
    kv = KVModel.from_spec(load_scenario(model).model)
    got = usable_cached_tokens(trace.requests, trace.block_tokens, "linear" in kv.kinds)
    assert list(got) == _pool_reference(trace, kv)
    assert got.sum() > 0


def test_trace_workload_figures() -> None:
    trace = Trace(HAND, source="hand", block_tokens=B)
    kv = KVModel.from_spec(load_scenario("paper-prfaas-dense").model)
    assert "linear" not in kv.kinds
    tw = TraceWorkload.from_trace(trace, kv)
    assert tw.requests == 6 and tw.rate == pytest.approx(1.0) and tw.duration_s == 5.0
    assert list(tw.uncached_tokens) == [4 * B, 300, 2 * B, B, 2 * B, 2 * B]
    assert tw.cached_share == pytest.approx(12 * B / (23 * B + 300))
    assert tw.reuse_share == pytest.approx(prefix_reuse_share(trace)[0])
    assert tw.dist.mean() == pytest.approx(float(np.mean(tw.uncached_tokens)))
    wl = tw.model_workload()
    assert wl.output_tokens == 10 and wl.rate == tw.rate and wl.output_sq_tokens == 100
    s = tw.summary()
    assert s["cache_rule"] == "leading blocks" and s["requests"] == 6


def test_zero_output_requests_decode_one_token() -> None:
    trace = Trace([TraceRequest("a", 0.0, 1000, 0), TraceRequest("b", 1.0, 2000, 0)], source="x")
    tw = TraceWorkload.from_trace(trace, KVModel.from_spec(load_scenario("paper-prfaas").model))
    assert tw.mean_output == 1.0 and tw.cached_share == 0.0


# ---------------------------------------------------------------------------------------------
# testbed model --trace


def _cli(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    return ap.parse_args(["model", *argv])


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("trace") / "conv.jsonl"
    write_mooncake(p, synth_with_prefixes(2000, 2.0, 11))
    return p


def test_model_command_with_trace(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            _cli(
                "--scenario",
                "paper-prfaas",
                "--scenario",
                "paper-homogeneous",
                "--trace",
                str(small_trace),
                "--optimise",
                "--json",
            )
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    (wl,) = out["workloads"]
    assert wl["requests"] == 2000 and 0 < wl["cached_share"] < 1
    assert wl["uncached_tokens"]["mean"] < wl["input_tokens"]["mean"]
    prf, hom = out["scenarios"]
    synthetic = evaluate(load_scenario("paper-prfaas"))
    assert not math.isclose(prf["lambda_max"], synthetic.lambda_max, rel_tol=0.05)
    # Mean output drives Θ_pdd: 3 decode instances at 800 tokens/s each.
    assert hom["theta_pdd"] == pytest.approx(3 * 800 / wl["output_tokens"]["mean"])
    assert prf["optimised"]["lambda_max"] >= prf["lambda_max"]

    assert run(_cli("--scenario", "paper-naive", "--trace", str(small_trace), "--window", "0:100")) == 0
    text = capsys.readouterr().out
    assert "workload:" in text and "window(0" in text


def test_model_command_trace_errors(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_cli("--scenario", "paper-naive", "--window", "0:10")) == 2
    assert "--window" in capsys.readouterr().err
    from testbed.cli import main

    # A TraceError is a UserError: the CLI prints it as one line, exit 2.
    assert main(["model", "--scenario", "paper-naive", "--trace", str(small_trace.parent / "missing.jsonl")]) == 2
    assert "cannot open" in capsys.readouterr().err
