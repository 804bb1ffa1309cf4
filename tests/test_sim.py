"""The discrete-event simulator end to end: deterministic, a lone request's TTFT is exactly its
stages, decode batching matches the shared batch loop (the live node's) stepped one step at a
time, with and without a slowdown, and a replay through the runner writes a run directory like
a live one."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import pytest

from testbed.core.engine.decode_batch import DecodeBatch, DecodeSeq
from testbed.core.engine.decode_loop import DecodeLoop, decode_seq
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import DecodeStepTime, PrefillTime
from testbed.core.fault_timeline import SlowDown
from testbed.core.lifecycle import Event
from testbed.core.schema.hardware import DecodeSpec, HardwareSpec, TablePrefill
from testbed.core.schema.live_path import LivePathCosts
from testbed.core.schema.topology import NodeSpec
from testbed.metrics.records import read_records
from testbed.run.load import load
from testbed.run.runner import run_replay_async
from testbed.sim import simulate
from testbed.sim.decode import DecodeSim
from testbed.sim.events import KV_ARRIVAL, EventLoop
from testbed.sim.host import Host
from testbed.sim.request import SimRequest
from testbed.sim.simulator import START_LEAD_S
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

    def kv_held(self, req: SimRequest, path: Any, t: float) -> None:
        raise AssertionError("no transfers here")

    def finished(self, req: SimRequest, t: float) -> None:
        self.done[req.rid] = req

    def attempt_failed(self, req: SimRequest, reason: str, t: float) -> None:
        raise AssertionError(reason)


Stamps = dict[str, tuple[float, float, float]]


def _stepped(
    spec: DecodeSpec, arrivals: list[tuple[float, DecodeSeq]], slow: SlowDown | None = None
) -> tuple[Stamps, int]:
    """The shared batch loop (`testbed.core.engine.decode_loop.DecodeLoop`) driven one step at a time, as
    the live node drives it (`testbed.live.decode_node._batch_loop`: wait when idle or when
    nothing can run, sleep until each step's end), in virtual time: admitted, first and last
    token of each sequence, and the steps run."""
    loop = DecodeLoop(DecodeBatch(DecodeStepTime.from_spec(spec), spec.bs_max, spec.kv_capacity_bytes), slow)
    out: dict[str, list[float]] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    t = 0.0

    def arrive_until(at: float) -> None:
        while pending and pending[0][0] <= at:
            loop.submit(pending.pop(0)[1])

    while pending or not loop.idle:
        if loop.idle:  # asleep until a sequence comes
            t = max(t, pending[0][0])
            loop.rest()
        arrive_until(t)
        admitted, end = loop.begin(t)
        for s in admitted:
            out[s.request_id] = [t]
        if end is None:  # asleep until a sequence comes (no finish can come)
            loop.rest()
            t = pending[0][0]
            continue
        arrive_until(end)
        t = end
        for r in loop.end_step():
            if r.seq.generated == 1:
                out[r.seq.request_id].append(t)
            if r.finished:
                out[r.seq.request_id].append(t)
    return {k: (v[0], v[1], v[-1]) for k, v in out.items()}, loop.steps


def _decode_run(
    spec: DecodeSpec, times: list[float], outs: list[int], slow: tuple[float, float, float] | None = None
) -> tuple[Stamps, Stamps, int, int]:
    node = NodeSpec("pd-d0", "pd", "dc", "pd", "decode", 0, "h20")
    kv = KVModel(0, 0.0, ("full",))
    host = _Host()
    hw = HardwareSpec(prefill=TablePrefill(kind="table", points=[(1.0, 1.0), (2.0, 2.0)]), decode=spec)
    dec = DecodeSim(node, hw, kv, cast(Host, host))
    arrivals: list[tuple[float, DecodeSeq]] = []
    for i, (t, n) in enumerate(zip(times, outs)):
        req = SimRequest(i, TraceRequest(f"r{i}", t, 1000 + 700 * i, n), t)
        for ev in (Event.ROUTE, Event.ENQUEUE_PREFILL, Event.START_PREFILL, Event.END_PREFILL):
            req.life.apply(ev, t)
        host.loop.at(
            t,
            KV_ARRIVAL,
            lambda r: (r.life.apply(Event.KV_COMPLETE, host.loop.now), dec.kv_arrived(r, host.loop.now)),
            req,
        )
        arrivals.append((t, decode_seq(kv, f"r{i}", 1000 + 700 * i, n)))
    ref = None
    if slow is not None:
        factor, start, end = slow
        ref = SlowDown()
        host.loop.at(start, KV_ARRIVAL, lambda _: (dec.slow.set(factor, end), dec.slow_changed(host.loop.now)))
        host.loop.at(end, KV_ARRIVAL, lambda _: dec.slow_changed(host.loop.now))
        ref.set(factor, end)
        # The stepped loop sees the factor from the window's start on.
        ref = _Window(factor, start, end)
    host.loop.run()
    want, steps = _stepped(spec, arrivals, ref)
    got = {rid: (r.decode_admitted, r.decode_first_token, r.decode_last_token) for rid, r in host.done.items()}
    return want, got, steps, dec.steps


class _Window(SlowDown):
    """A slowdown in force from `start` to `end` (the stepped loop reads it by time)."""

    def __init__(self, factor: float, start: float, end: float) -> None:
        super().__init__()
        self.factor_in, self.start, self.end = factor, start, end

    def at(self, now: float) -> float:
        return self.factor_in if self.start <= now < self.end else 1.0


SPEC = DecodeSpec(base_s=0.025, per_seq_s=0.0007, per_context_token_s=3e-8, bs_max=3, kv_capacity_bytes=10_000)
TIMES = [0.0, 0.001, 0.0124, 0.03, 0.0301, 0.031, 0.2, 0.2, 0.26, 0.9, 0.9005, 0.95]
OUTS = [5, 40, 3, 17, 1, 9, 30, 2, 12, 7, 25, 4]


def test_decode_batching_matches_the_shared_loop_stepped() -> None:
    want, got, steps, sim_steps = _decode_run(SPEC, TIMES, OUTS)
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid] == pytest.approx(want[rid], abs=1e-9), rid
    assert sim_steps == steps


def test_a_slowdown_stretches_the_steps_that_start_in_its_window_as_the_stepped_loop() -> None:
    want, got, steps, sim_steps = _decode_run(SPEC, TIMES, OUTS, slow=(3.0, 0.1, 0.5))
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid] == pytest.approx(want[rid], abs=1e-9), rid
    assert sim_steps == steps
    plain, _, _, _ = _decode_run(SPEC, TIMES, OUTS)
    assert max(want[r][2] - plain[r][2] for r in want) > 0.1  # the window cost time


def test_a_replay_through_the_runner_writes_a_run_directory(tmp_path: Path) -> None:
    rs = _small(n=30, out=32)
    res = asyncio.run(run_replay_async(rs, trace_from_workload(rs.spec.workload), tmp_path, backend="sim"))
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["backend"] == "sim" and meta["shaping"]["method"] == "sim" and meta["t0"] == 0.0
    assert meta["t_end"] > 0
    assert len(read_records(tmp_path / "records.csv")) == 30
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == res.summary.to_json_dict()
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
    assert b.decode_cached_tokens == b.cached_tokens  # the decode cluster holds that prefix already


def test_the_control_loop_sees_the_link_drop_from_the_simulated_bytes(tmp_path: Path) -> None:
    rs = load(
        "paper-prfaas-bw",
        {
            "links": {"inter_dc": "cross-region-100g-fluctuating"},
            "workload": {"rate": 3.0, "requests": 240, "output_tokens": 32, "seed": 45},
        },
    )
    simulate(rs, trace_from_workload(rs.spec.workload), tmp_path)
    samples = [json.loads(line) for line in (tmp_path / "timeseries" / "router.jsonl").read_text().splitlines()]
    est = [
        (s["ts"] * rs.spec.scale.speedup, s["value"])
        for s in samples
        if s["metric"] == "wan_bandwidth_estimate_bps_paper"
    ]
    assert est and est[0][1] == rs.inter_dc.rate
    # ~14 Gbit/s of KV at this load: the drop to 10 Gbit/s at 40 s saturates the link, and the
    # estimate follows what it delivers.
    during = [v for t, v in est if 45 <= t <= 100]
    assert during and min(during) < 0.5 * rs.inter_dc.rate


def test_a_capacity_search_runs_on_the_simulator_without_probe_plots(tmp_path: Path) -> None:
    from testbed.studies.capacity.capacity import search

    rs = load("paper-prfaas", {"workload": {"requests": 60, "output_tokens": 32, "seed": 45}})
    res = asyncio.run(search(rs, tmp_path, "sim", 1.0, 8.0, 3, 0.25, 30.0, verbose=False, growth_s=2.5))
    assert [p.rate for p in res.probes] == [1.0, 8.0, 4.5]
    assert res.lambda_max is not None and res.lambda_max >= 1.0
    for p in res.probes:
        run = Path(p.run_dir)
        assert (run / "summary.json").is_file() and not (run / "report.md").exists()
        assert json.loads((run / "run.json").read_text())["backend"] == "sim"


def test_the_10000_gpu_deployment_keeps_the_paper_proportions() -> None:
    from testbed.studies.bench.sim_bench import scaled

    base = load("paper-prfaas")
    rs, k = scaled(base, 1250)
    counts = {c.name: (c.prefill, c.decode, c.cache_bytes) for c in rs.spec.clusters}
    assert counts == {"prfaas": (417, 0, 0), "pd": (312, 521, 0)}
    assert k == pytest.approx(1250 / 12) and rs.inter_dc.rate == pytest.approx(base.inter_dc.rate * k)
    assert rs.threshold == base.threshold


def test_the_live_paths_costs_sit_where_the_live_router_pays_them() -> None:
    """Routing, dispatching the prefill and relaying tokens cost wire seconds: the speedup's
    worth of paper time each, at their stages."""
    costs = {"routing_s": 0.010, "dispatch_s": 0.020, "relay_s": 0.030, "relay_last_s": 0.006}
    base = _small()
    rs = _small().model_copy(update={"live_path": LivePathCosts(**costs, source="test")})
    s = base.spec.scale.speedup
    for tokens in (8000, 60000):  # prefilled by the router's side, and across the WAN
        trace = Trace([TraceRequest("only", 0.0, tokens, 16)], "one request")
        (a,) = simulate(base, trace).records
        (b,) = simulate(rs, trace).records
        # The router sits in the decode cluster's datacenter: a remote prefill gets its call a WAN delay later.
        away = base.inter_dc.delay if b.crossed_wan else 0.0
        assert (b.times.routed - b.times.arrival) * s == pytest.approx(0.010 * s)
        assert (b.times.prefill_queued - b.times.routed) * s == pytest.approx(0.020 * s + away)
        assert (b.times.first_token - b.times.decode_first_token) * s == pytest.approx(0.030 * s)
        assert (b.times.last_token - b.times.decode_last_token) * s == pytest.approx(0.006 * s)
        assert b.ttft * s == pytest.approx(a.ttft * s + 0.060 * s + away)
        # The last token's relay is the first's less 24 ms: over the 15 token gaps, TPOT 1.6 ms less.
        assert b.tpot == pytest.approx(a.tpot - 0.024 / 15)


def test_decode_loop_stalls_stretch_tpot_for_some_requests() -> None:
    """Stalls of the batch loop (a whole step late) at the measured rate: TPOT is above the
    modelled step for the requests they hit, and the same for a seed (per-instance streams)."""
    rs = _small(n=80, out=256)
    stalled = rs.model_copy(update={"live_path": LivePathCosts(stall_rate_per_s=1.0, stall_s=0.02, source="test")})
    trace = trace_from_workload(rs.spec.workload)
    step = rs.spec.hardware["h20"].decode.base_s  # type: ignore[union-attr]
    plain = simulate(rs, trace).records
    a, b = simulate(stalled, trace).records, simulate(stalled, trace).records
    assert all(r.tpot * 4 == pytest.approx(step) for r in plain)
    over = [r for r in a if r.tpot * 4 > step * 1.01]
    assert 0 < len(over) < len(a)
    assert [r.tpot for r in a] == [r.tpot for r in b]
