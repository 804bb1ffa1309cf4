"""The split of a peer comparison's mean TTFT difference into cache, router placement, batching,
other queueing and the other stages, from paired records: terms by hand, an exact sum, and a
batching instance's overlapping prompts counted as one busy span."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.core.record import RequestRecord, StageTimes
from testbed.core.schema.hardware import HardwareSpec, PolynomialPrefill
from testbed.metrics.records import read_records, write_records
from testbed.metrics.summary import summarize
from testbed.studies.crosscheck import crosscheck_stages as st
from testbed.studies.crosscheck.crosscheck_explain import Side
from testbed.studies.crosscheck.peer_attribution import (
    Placement,
    attribute,
    describe,
    placed_waits,
    placement,
    prefill_load,
)

pure = pytest.mark.pure

# One prompt of n uncached tokens takes 0.5 s + 0.1 ms a token, alone in its pass.
HW = HardwareSpec(prefill=PolynomialPrefill(kind="polynomial", coefficients=[0.5, 1e-4]))


def rec(i: int, node: str, arrival: float, start: float, end: float, n_in: int, cached: int = 0) -> RequestRecord:
    t = StageTimes()
    t.arrival = t.routed = t.prefill_queued = arrival
    t.prefill_start, t.prefill_end = start, end
    t.transfer_start = t.transfer_end = t.decode_admitted = end
    t.first_token = t.decode_first_token = end + 0.05
    t.last_token = t.first_token + 0.025
    r = RequestRecord(f"r{i}", i, n_in, 2, tokens_received=2, outcome="completed", times=t)
    r.cached_tokens, r.prefill_node, r.prefill_cluster = cached, node, "pd"
    return r


def side(tmp: Path, label: str, records: list[RequestRecord]) -> Side:
    d = tmp / label
    d.mkdir()
    (d / "run.json").write_text(
        json.dumps(
            {
                "name": label,
                "scenario": "paper-homogeneous",
                "policy": "homogeneous",
                "t0": 0.0,
                "t_end": max(r.times.last_token for r in records),
                "scale": {"speedup": 1, "byte_scale": 1},
                "shaping": {"method": "none"},
                "slo": {"ttft_s": 10.0, "tpot_s": 0.025},
            }
        )
    )
    write_records(d / "records.csv", records)
    return Side(label, str(d), summarize(d), read_records(d / "records.csv"))


@pure
def test_the_mean_ttft_difference_splits_into_terms_that_sum_to_it(tmp_path: Path) -> None:
    tb = side(
        tmp_path,
        "testbed",
        [
            rec(0, "p0", 0.0, 0.0, 0.9, 4000),
            rec(1, "p1", 0.1, 0.1, 0.8, 4000, cached=2000),  # a shared pool held half of it
            rec(2, "p1", 0.2, 0.8, 1.3, 2000),  # waits 0.6 s while both instances compute
        ],
    )
    peer = side(
        tmp_path,
        "peer",
        [
            rec(0, "p0", 0.0, 0.0, 0.9, 4000),
            rec(1, "p0", 0.1, 0.9, 1.9, 4000),  # queued behind p0 while p1 idles; 1.0 s for a 0.9 s prompt
            rec(2, "p1", 0.2, 0.2, 0.9, 2000),
        ],
    )
    pairs = st.pair(tb.runrecords(), peer.runrecords()).pairs
    a = attribute(tb, peer, pairs, HW)
    assert a is not None and a.n == 3
    # r1: cached 0.7 - 0.9 s; batching 0 - 0.1; placed 0 - 0.8. r2: queue +0.6; batching -0.2.
    assert a.cache == pytest.approx(-0.2 / 3)
    assert a.batching == pytest.approx(-0.3 / 3)
    assert a.placed == pytest.approx(-0.8 / 3)
    assert a.queue == pytest.approx(0.6 / 3)
    assert a.other == pytest.approx(0.0, abs=1e-9)
    ttft = [(x.ttft - y.ttft) for x, y in pairs]
    assert a.total == pytest.approx(sum(ttft) / 3)
    assert a.without("cache", "placed") == pytest.approx(a.batching + a.queue + a.other)
    assert placed_waits(tb) == {} and placed_waits(peer) == {1: pytest.approx(0.8)}
    loads = (prefill_load(tb, HW), prefill_load(peer, HW))
    text = describe(a, "peer", 1.0, (0, 1), loads, (placement(tb), placement(peer)))
    assert "router placement -266.7 ms" in text and "0 requests in the testbed, 1 in peer" in text
    # r2 went to p1 while r1 computed there (no instance idle); r1 to p0 while r0 computed, p1 idle.
    assert placement(tb) == Placement(1, 0, 0) and placement(peer) == Placement(1, 1, 0)
    assert "difference is +100.0 ms (+10.0% of peer's mean TTFT)" in text


@pure
def test_a_batching_instance_is_busy_while_any_of_its_prompts_computes(tmp_path: Path) -> None:
    # p0 computes r0 over [0, 2] and, in shared passes, r1 over [0.5, 1.0]: at 1.5 it is still busy,
    # so r2 queued on p1 at 1.5 waited with no instance idle (not placed by the router).
    s = side(
        tmp_path,
        "batched",
        [
            rec(0, "p0", 0.0, 0.0, 2.0, 8000),
            rec(1, "p0", 0.5, 0.5, 1.0, 1000),
            rec(3, "p1", 1.0, 1.0, 3.0, 8000),
            rec(2, "p1", 1.5, 3.0, 3.6, 1000),
            rec(4, "p1", 2.5, 3.6, 4.0, 1000),  # p0 idle from 2.0: placed behind p1
        ],
    )
    assert placed_waits(s) == {4: pytest.approx(1.1)}
    # r1 (p0 busy with r0; p1 idle), r2 (p1 busy, p0 too) and r4 (p1 busy, p0 idle); r0 and r1 share passes
    assert placement(s) == Placement(3, 2, 2)
    mean, busiest = prefill_load(s, HW)
    assert busiest > mean > 0
