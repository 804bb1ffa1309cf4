"""The analytical model against the paper's Table 6 (docs/paper.md) and closed forms."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from testbed.cli import main
from testbed.config.scenarios import load_scenario
from testbed.core.engine.servicetime import PrefillTime
from testbed.model.analytical import LengthDistribution, ModelResult, evaluate, prefill_seconds
from testbed.model.model_command import register, resolve_threshold, run
from testbed.model.optimise import optimise, optimise_threshold

pytestmark = pytest.mark.pure


def rel(a: float | None, b: float) -> float:
    assert a is not None
    return abs(a - b) / b


@pytest.fixture(scope="module")
def results() -> dict[str, ModelResult]:
    return {n: evaluate(load_scenario(f"paper-{n}")) for n in ("prfaas", "homogeneous", "naive")}


# Table 6: (Theta_prfaas, Theta_pdp, Theta_pdd, Lambda_max, mean TTFT, P90 TTFT)
TABLE6 = {
    "prfaas": (1.61, 1.64, 3.91, 3.24, 2.22, 3.51),
    "homogeneous": (None, 2.11, 2.35, 2.11, 4.44, 9.73),
    "naive": (2.45, None, 6.25, 2.45, 1.74, 3.51),
}


@pytest.mark.parametrize("name", sorted(TABLE6))
def test_table6_thetas(results: dict[str, ModelResult], name: str) -> None:
    r = results[name]
    th_prfaas, th_pdp, th_pdd, lam, _, _ = TABLE6[name]
    for got, want in ((r.theta_prfaas, th_prfaas), (r.theta_pdp, th_pdp)):
        if want is None:
            assert got is None
        else:
            assert rel(got, want) <= 0.03
    assert rel(r.theta_pdd, th_pdd) <= 0.03
    assert rel(r.lambda_max, lam) <= 0.03


@pytest.mark.parametrize("name", sorted(TABLE6))
def test_table6_ttft(results: dict[str, ModelResult], name: str) -> None:
    r = results[name]
    *_, mean, p90 = TABLE6[name]
    assert rel(r.ttft_mean_s, mean) <= 0.05
    assert rel(r.ttft_p90_s, p90) <= 0.05
    # The layer-wise KV tail is milliseconds, not part of the paper's TTFT.
    assert 0.0 <= r.kv_tail_mean_s < 0.01


def test_table6_shape(results: dict[str, ModelResult]) -> None:
    r = results["prfaas"]
    assert (r.n_prfaas, r.n_p, r.n_d) == (4, 3, 5)
    assert r.threshold == 19400
    assert abs(r.p - 0.496) < 0.005  # "49.6% of requests go to PrfaaS"
    assert r.bottleneck == "prfaas" and r.prfaas_bound == "compute"
    assert results["homogeneous"].bottleneck == "pdp"
    speedup = r.lambda_max / results["homogeneous"].lambda_max
    assert rel(speedup, 1.54) <= 0.05


def test_egress(results: dict[str, ModelResult]) -> None:
    r = results["prfaas"]
    assert rel(r.egress_bps, 13e9) <= 0.15
    assert rel(r.egress_fraction, 0.13) <= 0.15
    assert r.egress_at(r.lambda_max) == pytest.approx(r.egress_bps)
    assert r.egress_at(1.0) == pytest.approx(r.p * r.kv_long_bytes * 8)
    # PrfaaS cannot emit KV faster than it prefills.
    assert r.egress_at(1e6) == pytest.approx(r.theta_prfaas * r.kv_long_bytes * 8)  # type: ignore[operator]
    assert results["homogeneous"].egress_bps == 0.0


def test_link_bound() -> None:
    r = evaluate(load_scenario("paper-prfaas"), link_bps=5e9)
    assert r.prfaas_bound == "link"
    assert r.theta_prfaas == pytest.approx(5e9 / (8 * (180355072 + 17143 * r.l_long)))  # type: ignore[operator]


def test_optimiser_finds_paper_point() -> None:
    o = optimise(load_scenario("paper-prfaas"))
    assert (o.n_p, o.n_d) == (3, 5)
    assert rel(o.threshold, 19400) <= 0.05
    assert o.balanced


def test_optimiser_flat_top_breaks_ties_at_balance() -> None:
    # With 4/4 PD-D binds (3.125 req/s) over a range of t; the pick is the balance point.
    o = optimise_threshold(load_scenario("paper-prfaas"), split=(4, 4))
    assert o.lambda_max == pytest.approx(o.theta_pdd)
    assert o.theta_prfaas / o.p == pytest.approx(o.theta_pdp / (1 - o.p), rel=1e-3)


def test_resolve_threshold() -> None:
    assert resolve_threshold(load_scenario("paper-prfaas")) == 19400
    auto = load_scenario("paper-prfaas", {"policy": {"threshold": "auto"}})
    t = resolve_threshold(auto)
    assert rel(t, 19400) <= 0.05
    with pytest.raises(ValueError):
        evaluate(auto)
    assert evaluate(auto, threshold=t).threshold == t
    with pytest.raises(ValueError):
        resolve_threshold(load_scenario("paper-homogeneous"))


def test_length_distribution_closed_form() -> None:
    mu, sigma = 9.9, 1.0
    d = LengthDistribution(mu, sigma, 1e-3, 1e12)
    assert rel(d.mean(), math.exp(mu + sigma**2 / 2)) <= 1e-4
    assert rel(d.quantile(0.5), math.exp(mu)) <= 1e-4
    assert rel(d.quantile(0.9), math.exp(mu + 1.2815515655 * sigma)) <= 1e-4
    assert rel(d.expect(lambda v: v**2), math.exp(2 * mu + 2 * sigma**2)) <= 1e-3
    # P(L > t) and E[L | L > t] from the log-normal's partial expectation.
    t = 19400.0
    z = (math.log(t) - mu) / sigma

    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    p, l_long, l_short = d.split_means(t)
    assert p == pytest.approx(1 - phi(z), rel=1e-4)
    mean = math.exp(mu + sigma**2 / 2)
    assert l_long == pytest.approx(mean * (1 - phi(z - sigma)) / (1 - phi(z)), rel=1e-4)
    assert l_short == pytest.approx(mean * phi(z - sigma) / phi(z), rel=1e-4)


def test_paper_distribution_figures() -> None:
    d = LengthDistribution.from_spec(load_scenario("paper-prfaas").workload.input)
    p, l_long, l_short = d.split_means(19400)
    assert p == pytest.approx(0.4957, abs=5e-4)
    assert rel(l_long, 45.0e3) <= 0.01 and rel(l_short, 10.2e3) <= 0.01
    assert rel(d.quantile(0.5), 19.2e3) <= 0.01 and rel(d.quantile(0.9), 62.3e3) <= 0.01
    assert d.tail(0) == pytest.approx(1.0) and d.tail(1e9) == pytest.approx(0.0)


def test_vector_prefill_matches_scalar() -> None:
    sc = load_scenario("paper-prfaas")
    xs = np.array([1.0, 500.0, 1024.0, 5000.0, 32768.0, 100000.0, 131072.0, 200000.0])
    for hw in ("h200", "h20"):
        pt = PrefillTime.from_spec(sc.hardware[hw].prefill)
        assert prefill_seconds(pt, xs) == pytest.approx([pt(x) for x in xs])


def _cli(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    return ap.parse_args(["model", *argv])


def test_run_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = _cli("--scenario", "paper-prfaas", "--scenario", "paper-homogeneous", "--optimise", "--json")
    assert args.func is run
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["baseline"] == "paper-homogeneous"
    first, second = out["scenarios"]
    for key in (
        "threshold", "n_prfaas", "n_p", "n_d", "p", "l_long", "l_short", "theta_prfaas", "theta_pdp",
        "theta_pdd", "lambda_max", "bottleneck", "ttft_mean_s", "ttft_p90_s", "kv_tail_mean_s",
        "egress_bps", "egress_fraction", "link_bps", "relative", "optimised",
    ):  # fmt: skip
        assert key in first
    assert first["optimised"]["n_p"] == 3 and second["optimised"] is None
    assert second["relative"] == 1.0 and first["theta_prfaas"] is not None and second["theta_prfaas"] is None


def test_run_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_cli("--scenario", "paper-naive", "--link-gbps", "50")) == 0
    assert "paper-naive" in capsys.readouterr().out
    assert main(["model", "--scenario", "no-such-scenario"]) == 2  # a UserError: the CLI prints it
    assert "not found" in capsys.readouterr().err
