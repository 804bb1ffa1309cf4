"""The simulator's KV transfer disciplines (`testbed.sim.transfer`), one per `nodes.protocol`:
vLLM's pull starts only after the prefill's answer went to the router and the decode node's pull
came back (a handshake more on a pair's first contact), and its whole KV then pays the new
connections' slow start; SGLang's prefill queues once the decode node's registration is there and
its KV streams during the compute; the testbed's layer-wise push is unchanged."""

from __future__ import annotations

import math
from typing import Any

import pytest

from testbed.core.errors import UserError
from testbed.core.record import StageTimes
from testbed.deploy import registry
from testbed.run.load import load
from testbed.sim import simulate
from testbed.sim.transfer import INITIAL_WINDOW_SEGMENTS, Connections, TcpStart, call_arrives, pull_sent, slow_start
from testbed.traces.loader import trace_from_workload
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure

# One prefill node per cluster and one decode node: every request of a run lands on the same pair.
ONE_PAIR = [
    {"name": "prfaas", "datacenter": "dc-remote", "kind": "prfaas", "hardware": "h200", "prefill": 1, "decode": 0},
    {"name": "pd", "datacenter": "dc-local", "kind": "pd", "hardware": "h20", "prefill": 1, "decode": 1},
]


def _rs(protocol: str, remote: bool = True) -> Any:
    threshold = 0 if remote else 10**6  # every request to the PrfaaS cluster, or none
    return load(
        "paper-prfaas", {"clusters": ONE_PAIR, "policy": {"threshold": threshold}, "nodes": {"protocol": protocol}}
    )


def _times(rs: Any, reqs: list[TraceRequest]) -> dict[str, StageTimes]:
    st = simulate(rs, Trace(reqs, "transfer disciplines"))
    assert st.completed == len(reqs)
    return {r.request_id: r.times for r in st.records}


def _paper(rs: Any, wire: float) -> float:
    return float(wire * rs.scale.speedup)


def test_a_vllm_pull_starts_after_the_answer_the_second_hop_and_the_pull() -> None:
    rs = _rs("vllm")
    wan, lan = rs.inter_dc.delay, rs.intra_dc.delay
    way = wan + lan  # the KV path's one-way delay, the pull's too
    t = _times(rs, [TraceRequest("a", 0.0, 30000, 8, (1,)), TraceRequest("b", 20.0, 30000, 8, (2,))])
    a, b = t["a"], t["b"]
    # First contact: the answer crosses to the router, the pull opens a connection (a round trip) and crosses.
    assert _paper(rs, a.transfer_start - a.prefill_end) == pytest.approx(wan + 3 * way, abs=1e-9)
    # The pair's keep-alive connection carries the next pull: no handshake.
    assert _paper(rs, b.transfer_start - b.prefill_end) == pytest.approx(wan + way, abs=1e-9)


def test_a_vllm_pull_pays_the_new_connections_handshake_and_slow_start() -> None:
    rs = _rs("vllm")
    way = rs.inter_dc.delay + rs.intra_dc.delay
    tokens = 30000
    (a,) = _times(rs, [TraceRequest("a", 0.0, tokens, 8, (1,))]).values()
    kv = simulate(rs, Trace([TraceRequest("a", 0.0, tokens, 8, (1,))], "x")).records[0].kv_bytes_wire
    tcp = TcpStart.of(rs, crosses=True)
    nbytes = kv * rs.scale.byte_scale
    conns = min(tcp.connections, math.ceil(nbytes / tcp.chunk))
    span, _ = slow_start(nbytes, conns, tcp.initial, tcp.window, 2 * way)
    assert span > 0  # several round trips for this KV
    # Handshake, slow start's rounds, then the last byte's way (the link itself is far faster).
    assert _paper(rs, a.transfer_end - a.transfer_start) == pytest.approx(2 * way + span + way, rel=1e-6)


def test_a_local_vllm_pull_waits_for_the_prefill_but_crosses_no_wan() -> None:
    rs = _rs("vllm", remote=False)
    lan = rs.intra_dc.delay
    (a,) = _times(rs, [TraceRequest("a", 0.0, 8000, 8, (1,))]).values()
    assert a.transfer_start > a.prefill_end
    assert _paper(rs, a.transfer_start - a.prefill_end) == pytest.approx(3 * lan, abs=1e-9)


def test_an_sglang_prefill_queues_once_registered_and_its_kv_overlaps_the_compute() -> None:
    rs = _rs("sglang")
    way = rs.inter_dc.delay + rs.intra_dc.delay
    t = _times(rs, [TraceRequest("a", 0.0, 30000, 8, (1,)), TraceRequest("b", 20.0, 30000, 8, (2,))])
    a, b = t["a"], t["b"]
    # The registration opens the pair's connection first (a round trip), then crosses.
    assert _paper(rs, a.prefill_queued - a.arrival) == pytest.approx(3 * way, abs=1e-9)
    assert _paper(rs, b.prefill_queued - b.arrival) == pytest.approx(way, abs=1e-9)
    for r in (a, b):
        assert r.prefill_start <= r.transfer_start < r.prefill_end  # layer-wise: during the compute
        assert r.transfer_end - r.prefill_end < (r.prefill_end - r.prefill_start) / 10


def test_the_testbed_protocol_streams_from_the_first_layer_and_queues_at_once() -> None:
    rs = _rs("testbed")
    (a,) = _times(rs, [TraceRequest("a", 0.0, 30000, 8, (1,))]).values()
    assert a.prefill_queued == a.arrival
    assert a.prefill_start < a.transfer_start < a.prefill_end


def test_the_same_request_costs_least_layer_wise_and_most_pulled() -> None:
    ttft = {}
    for p in ("testbed", "sglang", "vllm"):
        (a,) = _times(_rs(p), [TraceRequest("a", 0.0, 30000, 8, (1,))]).values()
        ttft[p] = a.first_token - a.arrival
    assert ttft["testbed"] < ttft["sglang"] < ttft["vllm"]


def test_slow_start_doubles_per_round_trip_up_to_the_window() -> None:
    assert slow_start(10.0, 1, 10.0, 100.0, 1.0) == (0.0, 10.0)
    assert slow_start(30.0, 1, 10.0, 100.0, 1.0) == (1.0, 20.0)  # 10, then 20
    assert slow_start(71.0, 1, 10.0, 100.0, 1.0) == (3.0, 80.0)  # 10 + 20 + 40 + 80
    assert slow_start(71.0, 2, 10.0, 100.0, 1.0) == (2.0, 40.0)  # two connections: 20 + 40 + 80
    assert slow_start(500.0, 1, 10.0, 50.0, 1.0) == (11.0, 50.0)  # 10 20 40 (70), then 50 a round: 9 more
    assert INITIAL_WINDOW_SEGMENTS == 10


def test_an_http_connection_is_reused_while_idle_within_its_keep_alive() -> None:
    c = Connections(keepalive=15.0)
    assert not c.reuse("d", "p", 0.0)  # first contact: a new connection
    c.free("d", "p", 1.0)
    assert not c.reuse("d", "p", 0.5)  # still busy (its answer not back)
    assert c.reuse("d", "p", 2.0)
    assert not c.reuse("d", "p", 2.0)  # the one idle connection is taken
    c.free("d", "p", 3.0)
    assert not c.reuse("p", "d", 4.0)  # per direction of the call
    assert not c.reuse("d", "p", 18.5)  # closed idle after 15 s
    assert call_arrives(10.0, 2.0, reused=True) == 12.0
    assert call_arrives(10.0, 2.0, reused=False, hop=0.5) == 16.5
    assert pull_sent(1.0, 2.0, 0.0, 0.25) == 3.5


def test_the_kv_transport_opens_once_per_pair_and_keeps_its_window() -> None:
    tcp = TcpStart(initial=10.0, window=1000.0, connections=4, chunk=25.0)
    c = Connections(keepalive=15.0)
    first, last = c.kv_send(("p", "d"), 0.0, 100.0, tcp, 1.0)  # 4 chunks on 4 connections: 40, then 80
    assert (first, last) == (1.0, 2.0)  # a round trip to open, one round of slow start
    first, last = c.kv_send(("p", "d"), 10.0, 100.0, tcp, 1.0)  # open, window 20 each: 80, then 160
    assert (first, last) == (10.0, 11.0)
    first, last = c.kv_send(("p", "d"), 20.0, 100.0, tcp, 1.0)  # window 40 each: all in the first round
    assert (first, last) == (20.0, 20.0)


def test_the_simulator_runs_the_testbed_router_in_each_protocol() -> None:
    for p in ("testbed", "vllm", "sglang"):
        rs = load("paper-prfaas", {"nodes": {"protocol": p}, "workload": {"requests": 30, "seed": 3}})
        assert rs.spec.node_protocol == p and rs.spec.router.kind == "testbed"
        registry.refuse_unhonoured("sim", [rs])
        st = simulate(rs, trace_from_workload(rs.spec.workload))
        assert st.completed == 30
        for r in st.records:
            if p == "vllm":
                assert r.times.transfer_start > r.times.prefill_end
            else:
                assert r.times.transfer_start < r.times.prefill_end


def test_the_simulator_refuses_faults_with_an_engine_protocol() -> None:
    rs = load(
        "paper-prfaas",
        {"nodes": {"protocol": "vllm"}, "faults": [{"kind": "kill", "at_s": 5, "node": "prfaas-p0"}]},
    )
    with pytest.raises(UserError, match="faults with nodes.protocol 'vllm'"):
        simulate(rs, Trace([TraceRequest("a", 0.0, 1000, 8)], "x"))
