"""The discrete-event simulator end to end: deterministic, a lone request's TTFT is exactly its
stages, decode batching matches the live batch loop stepped one step at a time, and a replay
through the runner writes a run directory like a live one."""

from __future__ import annotations

import dataclasses

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import pytest

from testbed.core.decode_batch import DecodeBatch, DecodeSeq
from testbed.core.kvsize import KVModel
from testbed.core.lifecycle import Event
from testbed.core.scenario import DecodeSpec
from testbed.core.servicetime import DecodeStepTime, PrefillTime
from testbed.core.topology import NodeSpec
from testbed.metrics.records import read_records
from testbed.sim import simulate
from testbed.sim.decode import DecodeSim
from testbed.sim.events import KV_ARRIVAL, EventLoop
from testbed.sim.host import Host
from testbed.sim.request import SimRequest
from testbed.sim.simulator import START_LEAD_S
from testbed.studies.load import load
from testbed.studies.runner import run_replay_async
from testbed.traces.loader import trace_from_workload
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.pure


def _small(name: str = "paper-prfaas", n: int = 60, out: int = 64) -> Any:
    return load(name, {"workload": {"requests": n, "output_tokens": out, "rate": 1.6, "seed": 3}})


def _fields(recs: list[Any]) -> list[tuple[Any, ...]]:
    return [tuple(sorted(dataclasses.asdict(r).items(), key=lambda kv: kv[0])) for r in recs]


def test_a_run_is_deterministic_for_a_seed() -> None:
    rs = _small(n=80)
    a = simulate(rs, trace_from_workload(rs.spec.workload))
    b = simulate(rs, trace_from_workload(rs.spec.workload))
    assert a.completed == 80 and a.events == b.events
    assert repr(_fields(a.records)) == repr(_fields(b.records))
    other = _small(n=80).at_rate(2.0)
    c = simulate(other, trace_from_workload(other.spec.workload))
    assert repr(_fields(c.records)) != repr(_fields(a.records))


@pytest.mark.parametrize("tokens, crosses", [(60000, True), (8000, False)])
def test_a_lone_request_pays_prefill_transfer_tail_and_first_step(tokens: int, crosses: bool) -> None:
    rs = _small()
    sc = rs.spec
    trace = Trace([TraceRequest("only", 0.0, tokens, 16)], "one request")
    st = simulate(rs, trace)
    (rec,) = st.records
    s = sc.scale.speedup
    hw = sc.hardware["h200" if crosses else "h20"]
    prefill = PrefillTime.from_spec(hw.prefill)(tokens)
    kv = KVModel.from_spec(sc.model)
    _, last = kv.shipped(tokens, 0, sc.scale.byte_scale)
    lan, wan = rs.intra_dc, rs.inter_dc
    share = 1460 / 1500
    # The last layer's bytes alone on the path at the tightest link's payload rate, then the path's delay.
    rate = min(wan.rate, lan.rate) if crosses else lan.rate
    tail = last * sc.scale.byte_scale / (rate / 8 * share) + (wan.delay if crosses else 0.0) + lan.delay
    step = sc.hardware["h20"].decode.base_s  # type: ignore[union-attr]
    assert rec.crossed_wan is crosses and rec.outcome == "completed"
    assert rec.times.arrival * s == pytest.approx(START_LEAD_S * s)
    assert rec.times.prefill_start == rec.times.prefill_queued == rec.times.arrival
    assert (rec.times.prefill_end - rec.times.prefill_start) * s == pytest.approx(prefill)
    assert (rec.times.transfer_end - rec.times.prefill_end) * s == pytest.approx(tail)
    assert rec.times.decode_admitted == rec.times.transfer_end
    assert rec.ttft * s == pytest.approx(prefill + tail + step)
    assert rec.tpot * s == pytest.approx(step)


class _Host:
    """Just what a decode instance uses: the clock, and where finished requests go."""

    def __init__(self) -> None:
        self.loop = EventLoop()
        self.net: Any = None
        self.done: dict[str, SimRequest] = {}

    def transfer_handed(self, req: SimRequest, path: Any, pos: float) -> None:
        raise AssertionError("no transfers here")

    def finished(self, req: SimRequest, t: float) -> None:
        self.done[req.rid] = req

    def fail(self, req: SimRequest, reason: str, t: float) -> None:
        raise AssertionError(reason)


Stamps = dict[str, tuple[float, float, float]]


def _stepped(spec: DecodeSpec, arrivals: list[tuple[float, DecodeSeq]]) -> tuple[Stamps, int]:
    """The live batch loop (`testbed.live.decode_node._batch_loop`) one step at a time, in
    virtual time: admitted, first and last token of each sequence, and the steps run."""
    b = DecodeBatch(DecodeStepTime.from_spec(spec), spec.bs_max, spec.kv_capacity_bytes)
    out: dict[str, list[float]] = {}
    steps = 0
    pending = sorted(arrivals, key=lambda a: a[0])
    t = 0.0
    while pending or not b.idle:
        if b.idle or not b.running:
            t = max(t, pending[0][0])
        while pending and pending[0][0] <= t:
            b.submit(pending.pop(0)[1])
        for s in b.admit(t):
            out[s.request_id] = [t]
        if not b.running:
            continue
        t += b.step_duration()
        steps += 1
        while pending and pending[0][0] <= t:
            b.submit(pending.pop(0)[1])
        for r in b.complete_step():
            if r.seq.generated == 1:
                out[r.seq.request_id].append(t)
            if r.finished:
                out[r.seq.request_id].append(t)
    return {k: (v[0], v[1], v[-1]) for k, v in out.items()}, steps


def test_decode_batching_matches_the_step_by_step_loop() -> None:
    spec = DecodeSpec(base_s=0.025, per_seq_s=0.0007, per_context_token_s=3e-8, bs_max=3,
                      kv_capacity_bytes=10_000)
    node = NodeSpec("pd-d0", "pd", "dc", "pd", "decode", 0, "h20")
    kv = KVModel(0, 0.0, ("full",))
    host = _Host()
    dec = DecodeSim(node, spec, kv, cast(Host, host))
    arrivals: list[tuple[float, DecodeSeq]] = []
    times = [0.0, 0.001, 0.0124, 0.03, 0.0301, 0.031, 0.2, 0.2, 0.26, 0.9, 0.9005, 0.95]
    outs = [5, 40, 3, 17, 1, 9, 30, 2, 12, 7, 25, 4]
    for i, (t, n) in enumerate(zip(times, outs)):
        req = SimRequest(i, TraceRequest(f"r{i}", t, 1000 + 700 * i, n), t)
        for ev in (Event.ROUTE, Event.ENQUEUE_PREFILL, Event.START_PREFILL, Event.END_PREFILL):
            req.life.apply(ev, t)
        host.loop.at(t, KV_ARRIVAL, lambda r: (r.life.apply(Event.KV_COMPLETE, host.loop.now),
                                               dec.kv_arrived(r, host.loop.now)), req)
        arrivals.append((t, DecodeSeq(f"r{i}", 1000 + 700 * i, n, 0)))
    host.loop.run()
    want, steps = _stepped(spec, arrivals)
    got = {rid: (r.admitted, r.first, r.last) for rid, r in host.done.items()}
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid] == pytest.approx(want[rid], abs=1e-9), rid
    assert dec.steps == steps


def test_a_replay_through_the_runner_writes_a_run_directory(tmp_path: Path) -> None:
    rs = _small(n=30, out=32)
    res = asyncio.run(run_replay_async(rs, trace_from_workload(rs.spec.workload), tmp_path, backend="sim"))
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["backend"] == "sim" and meta["shaping"]["method"] == "sim" and meta["t0"] == 0.0
    assert meta["t_end"] > 0
    assert len(read_records(tmp_path / "records.csv")) == 30
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == res.summary
    assert summary["requests"]["completed"] == 30 and summary["run"]["shaping_method"] == "sim"
    assert summary["wan_link"]["link"] == "dc-remote->dc-local"
    assert summary["wan_egress"]["bytes_paper"] == pytest.approx(summary["bytes"]["wan_total_paper"], rel=1e-6)
    assert "queue_depth" in summary["timeseries"]["metrics"]
    report = (tmp_path / "report.md").read_text()
    assert "Shaping method **sim**" in report and (tmp_path / "ttft_cdf.png").is_file()


def test_a_cached_prefix_moves_across_before_the_prefill_that_needs_it() -> None:
    rs = load("paper-prfaas-cache", {"policy": {"bandwidth_state": "abundant"}})
    first = TraceRequest("turn1", 0.0, 10240, 8, tuple(range(20)))
    second = TraceRequest("turn2", 30.0, 81920, 8, tuple(range(20)) + tuple(range(1000, 1140)))
    st = simulate(rs, Trace([first, second], "two turns"))
    a, b = sorted(st.records, key=lambda r: r.trace_index)
    assert a.prefill_cluster == "pd" and a.cache_move_tokens == 0
    # The second turn goes to PrfaaS and takes turn 1's prefix along from the PD cluster's pool.
    assert b.outcome == "completed" and b.prefill_cluster == "prfaas" and b.crossed_wan
    assert b.cache_move_tokens > 0 and b.cached_tokens == b.cache_move_tokens
    assert b.cache_move_bytes_wire > 0 and b.times.cache_move_start == b.times.routed
    assert b.times.cache_move_start < b.times.cache_move_end <= b.times.prefill_start
    assert b.decode_cached_tokens == b.cached_tokens    # the decode cluster holds that prefix already


def test_the_control_loop_sees_the_link_drop_from_the_simulated_bytes(tmp_path: Path) -> None:
    rs = load("paper-prfaas-bw", {"links": {"inter_dc": "cross-region-100g-fluctuating"},
                                  "workload": {"rate": 3.0, "requests": 240, "output_tokens": 32, "seed": 45}})
    simulate(rs, trace_from_workload(rs.spec.workload), tmp_path)
    samples = [json.loads(line) for line in (tmp_path / "timeseries" / "router.jsonl").read_text().splitlines()]
    est = [(s["ts"] * rs.spec.scale.speedup, s["value"]) for s in samples
           if s["metric"] == "wan_bandwidth_estimate_bps_paper"]
    assert est and est[0][1] == rs.inter_dc.rate
    # ~14 Gbit/s of KV at this load: the drop to 10 Gbit/s at 40 s saturates the link, and the
    # estimate follows what it delivers.
    during = [v for t, v in est if 45 <= t <= 100]
    assert during and min(during) < 0.5 * rs.inter_dc.rate


def test_a_capacity_search_runs_on_the_simulator_without_probe_plots(tmp_path: Path) -> None:
    from testbed.studies.capacity import search

    rs = load("paper-prfaas", {"workload": {"requests": 60, "output_tokens": 32, "seed": 45}})
    res = asyncio.run(search(rs, tmp_path, "sim", 1.0, 8.0, 3, 0.25, 30.0, verbose=False, growth_s=2.5))
    assert [p.rate for p in res.probes] == [1.0, 8.0, 4.5]
    assert res.lambda_max is not None and res.lambda_max >= 1.0
    for p in res.probes:
        run = Path(p.run_dir)
        assert (run / "summary.json").is_file() and not (run / "report.md").exists()
        assert json.loads((run / "run.json").read_text())["backend"] == "sim"


def test_the_10000_gpu_deployment_keeps_the_paper_proportions() -> None:
    from testbed.studies.sim_bench import scaled

    base = load("paper-prfaas")
    rs, k = scaled(base, 1250)
    counts = {c.name: (c.prefill, c.decode, c.cache_bytes) for c in rs.spec.clusters}
    assert counts == {"prfaas": (417, 0, 0), "pd": (312, 521, 0)}
    assert k == pytest.approx(1250 / 12) and rs.inter_dc.rate == pytest.approx(base.inter_dc.rate * k)
    assert rs.threshold == base.threshold
