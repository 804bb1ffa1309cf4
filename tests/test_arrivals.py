"""Bursty arrivals: the synthesiser's arrival processes (`traces.synthetic.arrival_times`), what
the model measures of a trace's arrivals (`model.arrivals`) and the G/G/c wait it feeds."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

from testbed.core.schema.scenario import WorkloadSpec
from testbed.model.arrivals import Arrivals, GapLaw
from testbed.model.queueing import gim_wait, mgc_wait, split_scv, windowed_wait
from testbed.traces.loader import load_trace
from testbed.traces.synthetic import arrival_times, poisson_arrivals, synth_with_prefixes, synthetic_trace
from testbed.traces.trace_command import register

pytestmark = pytest.mark.pure


def _gaps_cv(t: np.ndarray) -> float:
    g = np.diff(t)
    return float(g.std() / g.mean())


def test_cv_one_is_the_poisson_process_draw_for_draw() -> None:
    a = arrival_times(np.random.default_rng(3), 500, 2.0, 1.0)
    b = poisson_arrivals(np.random.default_rng(3), 500, 2.0)
    assert np.array_equal(a, b)
    # So traces written before the option stay the same.
    assert (
        synthetic_trace(WorkloadSpec(requests=50, seed=4)).requests
        == synthetic_trace(WorkloadSpec(requests=50, seed=4), arrival_cv=1.0).requests
    )


@pytest.mark.parametrize("cv, peak", [(0.5, 4.0), (3.0, 4.0), (3.0, 12.0), (8.0, 4.0)])
def test_arrival_times_have_the_asked_rate_and_cv(cv: float, peak: float) -> None:
    t = arrival_times(np.random.default_rng(1), 100_000, 3.0, cv, peak)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0) and t.size == 100_000
    assert (t.size - 1) / t[-1] == pytest.approx(3.0, rel=0.04)
    assert _gaps_cv(t) == pytest.approx(cv, rel=0.06)


def test_bursts_are_longer_at_higher_cv() -> None:
    """At the same peak, a higher CV stretches the on/off cycle: the busiest 10 s run hotter."""
    lo = Arrivals(arrival_times(np.random.default_rng(2), 40_000, 3.0, 2.0))
    hi = Arrivals(arrival_times(np.random.default_rng(2), 40_000, 3.0, 8.0))
    assert 1.0 < lo.busiest(10.0) < hi.busiest(10.0) <= 4.0 * 1.5


def test_bad_arrival_parameters() -> None:
    rng = np.random.default_rng(0)
    for cv, peak in ((0.0, 4.0), (math.inf, 4.0), (2.0, 1.0), (2.0, math.nan)):
        with pytest.raises(ValueError):
            arrival_times(rng, 10, 1.0, cv, peak)
    assert arrival_times(rng, 0, 1.0, 3.0).size == 0


def test_synth_command_writes_a_bursty_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    out = tmp_path / "bursty.jsonl"
    args = ap.parse_args(
        [
            "trace",
            "synth",
            "--prefix-reuse",
            "chat",
            "--requests",
            "4000",
            "--rate",
            "2",
            "--arrival-cv",
            "3",
            "--out",
            str(out),
        ]
    )
    assert args.func(args) == 0
    tr = load_trace(out)
    arr = Arrivals(np.array([r.timestamp for r in tr]))
    assert arr.gap_cv == pytest.approx(3.0, rel=0.1)
    for bad in (["--arrival-cv", "0"], ["--burst-peak", "1"]):
        args = ap.parse_args(["trace", "synth", "--requests", "10", "--rate", "1", "--out", str(tmp_path / "x"), *bad])
        assert args.func(args) == 2
        assert "trace synth:" in capsys.readouterr().err


def test_prefix_sessions_keep_their_shape_under_bursts() -> None:
    """Only the arrival times change: the same seed gives the same sessions, lengths and hashes."""
    a = synth_with_prefixes(300, 2.0, 5)
    b = synth_with_prefixes(300, 2.0, 5, arrival_cv=3.0)
    assert [(r.request_id, r.input_tokens, r.hash_ids) for r in a] == [
        (r.request_id, r.input_tokens, r.hash_ids) for r in b
    ]
    assert [r.timestamp for r in a] != [r.timestamp for r in b]
    assert "arrival_cv=3" in b.source and "arrival_cv" not in a.source


# ---------------------------------------------------------------------------------------------
# What the model measures


def test_arrivals_hand_made() -> None:
    even = Arrivals(np.arange(0.0, 100.0, 0.5) + 7.0)  # one every 0.5 s, from 7 s
    assert even.times[0] == 0.0 and even.rate == pytest.approx(2.0)
    assert even.gap_scv == pytest.approx(0.0) and even.gap_cv == 0.0
    assert even.busiest(10.0) == pytest.approx(1.0)
    assert even.dispersion(2.0) == pytest.approx(0.0)
    assert even.dispersion(10.0) is None  # fewer than 20 windows fit
    # 20 arrivals in the first second, then one a second: the first 10 s hold 29 of 119.
    rush = Arrivals(np.concatenate((np.linspace(0, 0.95, 20), np.arange(1.0, 100.0))))
    assert rush.busiest(10.0) == pytest.approx(29 / (rush.rate * 10.0))
    # Ten arrivals 10 ms apart every 10 s: gaps of 0.01 s nine times in ten, then 9.91 s.
    bursts = Arrivals(np.array([10.0 * k + 0.01 * j for k in range(30) for j in range(10)]))
    g = np.array([0.01] * 9 + [9.91])
    assert bursts.gap_scv == pytest.approx(float(g.var() / g.mean() ** 2), rel=0.05)
    assert bursts.dispersion(1.0) == pytest.approx(9.0, rel=0.15)  # 10 or 0 in each second
    s = bursts.summary()
    assert s["busiest_10s_over_mean"] == bursts.busiest(10.0) and s["dispersion_60s"] is None
    assert s["gap_cv"] == pytest.approx(math.sqrt(bursts.gap_scv))
    assert Arrivals(np.array([5.0])).rate == 0.0 and Arrivals(np.array([5.0])).gap_scv == 1.0
    with pytest.raises(ValueError):
        Arrivals(np.array([2.0, 1.0]))


def test_dispersion_of_a_renewal_process_tends_to_its_gap_scv() -> None:
    for cv in (1.0, 3.0):
        a = Arrivals(arrival_times(np.random.default_rng(9), 200_000, 3.0, cv))
        assert a.gap_scv == pytest.approx(cv * cv, rel=0.1)
        disp = a.dispersion(60.0)
        assert disp is not None and disp == pytest.approx(cv * cv, rel=0.25)


def test_ggc_wait_is_kingman_on_one_server() -> None:
    """Allen-Cunneen with one server: E[W] = rho / (1 - rho) E[S] (ca^2 + cs^2) / 2."""
    lam, s = 0.5, 1.2
    rho = lam * s
    for ca2, cs2 in ((1.0, 1.0), (9.0, 0.0), (4.0, 2.5)):
        w = mgc_wait(lam, s, (1 + cs2) * s * s, 1, ca2)
        assert float(w.mean) == pytest.approx(rho / (1 - rho) * s * (ca2 + cs2) / 2)
    # Burstier arrivals wait longer on any number of servers, in proportion to (ca^2 + cs^2).
    poisson, bursty = mgc_wait(3.0, 1.0, 1.5, 4, 1.0), mgc_wait(3.0, 1.0, 1.5, 4, 9.0)
    assert float(bursty.mean) == pytest.approx(float(poisson.mean) * (9.0 + 0.5) / (1.0 + 0.5))
    assert float(bursty.p_wait) == float(poisson.p_wait)


def test_split_scv_moves_a_thinned_stream_toward_poisson() -> None:
    assert split_scv(9.0, 1.0) == pytest.approx(9.0) and split_scv(9.0, 0.0) == pytest.approx(1.0)
    assert split_scv(9.0, 0.25) == pytest.approx(3.0)
    # Measured: a random quarter of a CV-3 renewal stream.
    t = arrival_times(np.random.default_rng(4), 200_000, 3.0, 3.0)
    keep = np.random.default_rng(5).random(t.size) < 0.25
    assert Arrivals(t[keep]).gap_scv == pytest.approx(float(split_scv(9.0, 0.25)), rel=0.1)


def test_windows_cut_the_trace_into_spans() -> None:
    t = np.concatenate((np.arange(0.0, 300.0, 1.0), np.arange(300.0, 600.0, 0.25), [700.0]))
    w = Arrivals(t).windows(300.0)
    # 700 s: two whole spans and a last 100 s (under half a span) joined to the second.
    assert list(w.counts) == [300, 1201] and list(w.span_s) == [300.0, 400.0]
    assert w.rates == pytest.approx([1.0, 1201 / 400])
    assert w.share.sum() == pytest.approx(1.0) and w.scv[0] == pytest.approx(0.0)
    one = Arrivals(np.arange(0.0, 100.0)).windows(300.0)
    assert list(one.counts) == [100] and list(one.span_s) == [99.0]


def test_windowed_wait_is_the_stationary_wait_below_capacity() -> None:
    w, fluid = windowed_wait([2.0, 2.0], [600.0, 600.0], 1.0, 1.5, 4, [1.0, 1.0])
    ref = mgc_wait(2.0, 1.0, 1.5, 4)
    assert w.mean == pytest.approx([float(ref.mean)] * 2) and list(fluid) == [0.0, 0.0]


def test_windowed_wait_carries_a_busy_spans_backlog() -> None:
    """Capacity 4/s (4 servers, 1 s each). 100 s at 5/s leave 100 requests queued; the next 100 s
    at 3/s drain them at 1/s, so the backlog falls from 100 to 0 over that span."""
    w, fluid = windowed_wait([5.0, 3.0, 3.0], [100.0, 100.0, 100.0], 1.0, 1.0, 4, [1.0, 1.0, 1.0])
    # Mean backlog over the spans: 50, 50 and 0 requests, served at 4/s.
    assert fluid == pytest.approx([50 / 4, 50 / 4, 0.0])
    # The overloaded span waits what a queue at critical load builds in 100 s, not forever.
    sigma2 = 5.0 * (1.0 + 0.0)
    assert float(w.mean[0]) == pytest.approx((2 / 3) * math.sqrt(2 * sigma2 * 100 / math.pi) / 4)
    assert float(w.mean[1]) == pytest.approx(float(mgc_wait(3.0, 1.0, 1.0, 4).mean))
    # Half of the second span drains it when the spare capacity is double.
    _, f2 = windowed_wait([5.0, 2.0], [100.0, 100.0], 1.0, 1.0, 4, [1.0, 1.0])
    assert f2[1] == pytest.approx(0.5 * 100 * 50 / 100 / 4)


def test_a_modulated_stream_waits_longer_than_its_mean_rate_says() -> None:
    rates = np.array([1.5, 3.5] * 6)
    spans = np.full(rates.size, 300.0)
    w, fluid = windowed_wait(rates, spans, 1.0, 1.5, 4, np.ones(rates.size))
    share = rates / rates.sum()
    assert float(np.dot(share, w.mean + fluid)) > 2 * float(mgc_wait(2.5, 1.0, 1.5, 4).mean)


# ---------------------------------------------------------------------------------------------
# The whole gap law and the GI/M/c skeleton


def test_gap_law_of_poisson_arrivals_gives_sigma_rho() -> None:
    law = GapLaw.from_gaps(np.diff(arrival_times(np.random.default_rng(6), 200_000, 2.0)))
    assert law is not None and law.scv == pytest.approx(1.0, rel=0.02)
    # M/M/c: sigma = rho, at any share of the stream (a thinned Poisson stream is Poisson).
    for cmu, q, rho in ((4.0, 1.0, 0.5), (2.5, 1.0, 0.8), (4.0, 0.5, 0.25), (8.0, 0.3, 0.075)):
        assert float(law.sigma(cmu, q)) == pytest.approx(rho, abs=0.01)
    assert float(law.sigma(1.9, 1.0)) == 1.0 and float(law.sigma(4.0, 0.0)) == 0.0  # saturated; nothing comes
    # Then the GI/M/c skeleton is Allen-Cunneen's M/G/c exactly.
    for c, es, es2 in ((1, 0.4, 0.2), (4, 1.5, 3.0), (12, 2.0, 4.0)):
        rho = 2.0 * es / c
        a, b = gim_wait(2.0, es, es2, c, rho, 1.0), mgc_wait(2.0, es, es2, c, 1.0)
        assert float(a.mean) == pytest.approx(float(b.mean)) and float(a.p_wait) == pytest.approx(float(b.p_wait))


def test_gap_law_of_even_arrivals_is_d_m_1() -> None:
    """D/M/1: sigma = exp(-mu (1 - sigma) / lambda), and the mean wait sigma / (mu (1 - sigma))."""
    law = GapLaw.from_gaps(np.full(1000, 0.5))
    assert law is not None and law.scv == pytest.approx(0.0, abs=1e-12)
    mu, lam = 3.0, 2.0
    s = 0.5
    for _ in range(200):
        s = math.exp(-mu * (1 - s) / lam)
    sig = float(law.sigma(mu, 1.0))
    assert sig == pytest.approx(s, rel=1e-3)
    w = gim_wait(lam, 1 / mu, 2 / mu**2, 1, sig, 0.0)
    assert float(w.mean) == pytest.approx(s / (mu * (1 - s)), rel=3e-3)


def test_bunched_arrivals_find_the_servers_busy() -> None:
    """A CV-3 stream at the load a CV-1 one meets with sigma = rho meets a much higher sigma; a
    random share of it is its thinning (sigma of the thinned law = that of the thinned stream)."""
    t = arrival_times(np.random.default_rng(7), 200_000, 3.0, 3.0)
    law = GapLaw.from_gaps(np.diff(t))
    assert law is not None
    assert float(law.sigma(6.0, 1.0)) > 0.8 > 0.5
    keep = np.random.default_rng(8).random(t.size) < 0.4
    part = GapLaw.from_gaps(np.diff(t[keep]))
    assert part is not None
    assert float(law.sigma(4.0, 0.4)) == pytest.approx(float(part.sigma(4.0, 1.0)), abs=0.02)
    # Waits grow with sigma at equal load: burstier arrivals wait longer.
    calm, bunched = gim_wait(3.0, 1.0, 1.5, 6, 0.5, 1.0), gim_wait(3.0, 1.0, 1.5, 6, 0.85, 9.0)
    assert float(bunched.mean) > 5 * float(calm.mean)
    assert GapLaw.from_gaps([1.0, 2.0]) is None
