"""One simulated replay: the trace's requests through router, prefill, KV transfer and decode in
virtual (paper) time, writing what a live run writes (records, time series, decisions).

Every request goes through the same core code the live services run, in the live order:
`testbed.core.routing.route` (prefix lookup, policy, load tracker, cache book, recent
arrivals), the prefill queue and service times, layer-wise KV into the flow-level network
(`testbed.sim.network`), decode continuous batching with KV admission, and the short-term
bandwidth controller fed from the network's own byte accounting. Requests arrive open loop at
their trace times (after the same start lead as the live replayer) and nothing in the
simulator adds time of its own: no HTTP hops, no timer lateness (the live runs' "other" TTFT
share is 0 here).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from testbed.config.resolved import ResolvedScenario
from testbed.core.control import controller_for
from testbed.core.longterm import RoleMeter, controller_for as longterm_for
from testbed.model.retune import role_planner
from testbed.core.lifecycle import Event
from testbed.core.policy import NoCapacity
from testbed.core.routing import route
from testbed.core.scaling import Scale
from testbed.core.topology import node_specs
from testbed.core.record import RequestRecord
from testbed.metrics.records import RecordWriter
from testbed.sim.control import ControlLoop
from testbed.sim.longterm import RoleLoop
from testbed.sim.decode import DecodeSim
from testbed.sim.events import ARRIVAL, KV_ARRIVAL, SAMPLE, EventLoop
from testbed.sim.network import Network, Path as NetPath
from testbed.sim.prefill import PrefillSim
from testbed.sim.request import SimRequest
from testbed.sim.router import SimRouter
from testbed.metrics.series_format import BatchSeriesFile as SeriesFile, RawSample as Sample
from testbed.traces.types import Trace, TraceRequest
from testbed.core.kvsize import KVModel
from testbed.core.servicetime import PrefillTime

START_LEAD_S = 0.5          # wire seconds before the first request, as the live replayer waits
NODE_SAMPLE_S = 0.1         # wire seconds between node samples, as live services sample
WAN_SAMPLE_S = 0.05         # wire seconds between link-counter samples, as the netns link monitor
PAPER_TIME = Scale()        # the simulator's clock is paper time: routing books paper seconds


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C (and the CLI's SIGTERM, which becomes one) raises at once inside the event loop.

    The simulation runs synchronously, and under `asyncio.run` the first Ctrl-C only cancels the
    main task, which happens when the loop next gets control: after the whole simulation. The
    default handler raises KeyboardInterrupt between two events; the caller keeps the records."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@dataclass(frozen=True)
class SimOptions:
    """How much the run writes. Series are sampled at the live intervals, coarsened so that a
    long or large run writes at most about `series_lines` node and router samples and
    `link_lines` link-counter samples; `decisions` False leaves out the per-request routing
    decisions (threshold changes are always written)."""

    series_lines: int = 100_000
    link_lines: int = 20_000
    decisions: bool = True


@dataclass
class SimStats:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    events: int = 0
    rebalances: int = 0
    t_end: float = 0.0              # paper seconds, the last request's end
    wall_s: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)   # without a run directory


class Simulation:
    def __init__(self, rs: ResolvedScenario, trace: Trace, run_dir: Path | None = None,
                 options: SimOptions = SimOptions()) -> None:
        sc = rs.spec
        self.rs = rs
        self.sc = sc
        self.scale = rs.scale
        self.trace = trace
        self.options = options
        self.loop = EventLoop()
        nodes = node_specs(sc)
        self.net = Network(self.loop, {n.id: n.datacenter for n in nodes}, rs.intra_dc, rs.inter_dc,
                           sc.transfer, self.scale.byte_scale)
        kv = KVModel.from_spec(sc.model)
        self.kv = kv
        self.prefill: dict[str, PrefillSim] = {}
        self.decode: dict[str, DecodeSim] = {}
        for n in nodes:
            hw = sc.hardware[n.hardware]
            if n.role == "prefill":
                self.prefill[n.id] = PrefillSim(n, PrefillTime.from_spec(hw.prefill), kv, self.scale.byte_scale, self)
            else:
                assert hw.decode is not None
                self.decode[n.id] = DecodeSim(n, hw.decode, kv, self)
        self.router = SimRouter.for_scenario(sc, rs.threshold, rs.intra_dc, rs.inter_dc)
        ctl = controller_for(sc, rs.threshold, rs.inter_dc.rate)
        self.control = None if ctl is None else ControlLoop(
            self.loop, self.net, self.router, self.prefill, ctl, sc.policy.control.interval_s,
            sc.policy.bandwidth_aware, sc.policy.bandwidth_state == "auto", lambda: self.busy,
            lambda t, samples: self._write("router", t, samples), self._write_decisions)
        lt = longterm_for(sc, rs.threshold, role_planner(sc, rs.inter_dc.rate))
        self.roles = None if lt is None else RoleLoop(
            self.loop, self.router, self.decode, lt, RoleMeter(sc, self.router.tracker, lt.roles),
            lambda: None if self.control is None else self.control.ctl, lambda: self.busy,
            lambda t, samples: self._write("router", t, samples), self._write_decisions)
        self.stats = SimStats(requests=len(trace))
        self.open = len(trace)        # requests not finished yet
        self.run_dir = run_dir
        self.writer: RecordWriter | None = None
        self.series: dict[str, SeriesFile] = {}
        self.decisions: SeriesFile | None = None
        lead = START_LEAD_S * self.scale.speedup
        self._arrivals: Iterator[tuple[int, TraceRequest]] = iter(enumerate(trace))
        self._lead = lead
        span = (trace.requests[-1].timestamp if len(trace) else 0.0) + lead + 60.0
        per_sample = len(self.prefill) * 4 + len(self.decode) * 4 + len(self.prefill) + 16
        self.node_interval = max(NODE_SAMPLE_S * self.scale.speedup, span * per_sample / options.series_lines)
        self.wan_interval = max(WAN_SAMPLE_S * self.scale.speedup, span * len(self.net.wan) / options.link_lines)

    # -- running -------------------------------------------------------------------------------

    def run(self) -> SimStats:
        wall = time.perf_counter()
        if self.run_dir is not None:
            ts = self.run_dir / "timeseries"
            self.writer = RecordWriter(self.run_dir / "records.csv")
            s = self.scale.speedup
            self.series = {name: SeriesFile(ts / f"{name}.jsonl", name, s) for name in ("router", "wan")}
            self.series["nodes"] = SeriesFile(ts / "nodes.jsonl", "nodes", s)
            self.decisions = SeriesFile(self.run_dir / "decisions.jsonl", "router", s, repeated_labels=False)
            self._write_link_rates(0.0)
        try:
            self.net.schedule_changes()
            for c in self.rs.inter_dc.schedule:
                self.loop.at(c.at, SAMPLE, lambda _: self._write_link_rates(self.loop.now))
            self._next_arrival()
            if self.run_dir is not None:
                self.loop.at(0.0, SAMPLE, self._sample_nodes)
                self.loop.at(0.0, SAMPLE, self._sample_wan)
            if self.control is not None:
                self.control.start()
            if self.roles is not None:
                self.roles.start()
            # A run makes millions of short-lived acyclic objects beside long-lived pools of cache
            # entries: the cyclic collector would rescan the pools again and again (two thirds of
            # the time of an hour-long trace) for garbage that reference counting frees anyway.
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                with _interruptible():
                    self.loop.run()
            finally:
                if was_enabled:
                    gc.enable()
            self.stats.t_end = self.stats.t_end or self.loop.now
            if self.run_dir is not None:
                self._sample_nodes_now(self.stats.t_end)
                self._sample_wan_now(self.stats.t_end)
        finally:
            if self.writer is not None:
                self.writer.close()
            for f in self.series.values():
                f.close()
            if self.decisions is not None:
                self.decisions.close()
        self.stats.events = self.loop.processed
        self.stats.rebalances = self.net.rebalances
        self.stats.wall_s = time.perf_counter() - wall
        return self.stats

    @property
    def busy(self) -> bool:
        return self.open > 0

    def _next_arrival(self) -> None:
        nxt = next(self._arrivals, None)
        if nxt is not None:
            i, tr = nxt
            self.loop.at(self._lead + tr.timestamp, ARRIVAL, self._arrive, (i, tr))

    # -- a request's way through -------------------------------------------------------------

    def _arrive(self, arg: tuple[int, TraceRequest]) -> None:
        i, tr = arg
        t = self.loop.now
        self._next_arrival()
        req = SimRequest(i, tr, t)
        r = self.router
        try:
            plan = route(r, self.sc, req.rid, tr.input_tokens, tr.hash_ids, t, PAPER_TIME, r.unroutable,
                         output_tokens=tr.output_tokens)
        except NoCapacity as e:
            self.fail(req, f"router answered 503: {e}", t)
            return
        req.plan = plan
        d = plan.d
        req.routed = t
        req.life.apply(Event.ROUTE, t)
        req.life.apply(Event.ENQUEUE_PREFILL, t)
        if self.decisions is not None and self.options.decisions:
            self.decisions.write(t, [("decision", float(d.incremental_tokens),
                                      {"request_id": req.rid, "prefill": d.prefill_node, "decode": d.decode_node,
                                       "cached": str(d.cached_tokens), "bandwidth": r.bandwidth,
                                       "threshold": "" if d.threshold is None else f"{d.threshold:g}",
                                       "reason": d.reason})])
        # What the request moves: the KV the decode side lacks (paper bytes).
        req.kv_paper = self.kv.incremental(tr.input_tokens, d.decode_cached_tokens)
        r.inflight += 1
        if d.cache_move is not None and plan.move_src is not None:
            r.cache_moves += 1
            req.move_start = t
            req.move_wire = max(self.scale.wire_bytes(plan.move_bytes_paper), 1)
            path = self.net.path(plan.move_src, d.prefill_node)
            self.net.push(path, t, req.move_wire * self.scale.byte_scale)
            self.net.mark(path, self.net.position(path), self._move_sent, (req, path))
        self.prefill[d.prefill_node].submit(req, t)

    def _move_sent(self, arg: tuple[SimRequest, NetPath], t: float) -> None:
        req, path = arg
        self.loop.at(t + path.delay, KV_ARRIVAL, self._move_arrived, req)

    def _move_arrived(self, req: SimRequest) -> None:
        assert req.plan is not None
        self.prefill[req.plan.d.prefill_node].move_arrived(req, self.loop.now)

    def transfer_handed(self, req: SimRequest, path: NetPath, pos: float) -> None:
        """The prefill's compute ended with its KV up to `pos` in `path`: the prefill node answers
        the router once the rest fits in its sockets' buffers; the decode node holds the KV once
        the last byte has crossed."""
        sockets = path.tcp.send_buffer * path.conns
        self.net.mark(path, pos - sockets, self._prefill_answered, req)
        self.net.mark(path, pos, self._kv_sent, (req, path))

    def _prefill_answered(self, req: SimRequest, t: float) -> None:
        plan = req.plan
        assert plan is not None
        r = self.router
        req.prefill_seen = True
        r.tracker.prefill_done(plan.d, plan.work)
        if r.book is not None:
            if plan.d.cache_move is not None:
                r.book.moved(req.rid, plan.hashes, plan.d)
            r.book.prefilled(req.rid, plan.hashes, req.tr.input_tokens, plan.d)
        self._note_tail(req)

    def _kv_sent(self, arg: tuple[SimRequest, NetPath], t: float) -> None:
        req, path = arg
        self.loop.at(t + path.delay, KV_ARRIVAL, self._kv_arrived, req)

    def _kv_arrived(self, req: SimRequest) -> None:
        t = self.loop.now
        plan = req.plan
        assert plan is not None
        req.transfer_end = t
        req.life.apply(Event.KV_COMPLETE, t)
        self._note_tail(req)
        if self.router.book is not None:
            self.router.book.kv_complete(req.rid, plan.hashes, req.tr.input_tokens, plan.d)
        self.decode[plan.d.decode_node].kv_arrived(req, t)

    def _note_tail(self, req: SimRequest) -> None:
        plan = req.plan
        if plan is not None and plan.d.crossed_wan and req.prefill_seen and not math.isnan(req.transfer_end):
            self.router.tails.append(max(req.transfer_end - req.end, 0.0))

    def finished(self, req: SimRequest, t: float) -> None:
        req.life.apply(Event.FIRST_TOKEN, req.first)
        req.life.apply(Event.FINISH, t)
        req.outcome = "completed"
        self.stats.completed += 1
        self._close(req, t)

    def fail(self, req: SimRequest, reason: str, t: float) -> None:
        if not req.life.done:
            req.life.apply(Event.FAIL, t, reason)
        req.outcome, req.reason = "failed", reason
        self.stats.failed += 1
        plan = req.plan
        if plan is not None and not req.prefill_seen:
            self.router.tracker.prefill_done(plan.d, plan.work)
        self._close(req, t)

    def _close(self, req: SimRequest, t: float) -> None:
        plan = req.plan
        r = self.router
        if plan is not None:
            r.inflight -= 1
            r.tracker.decode_done(plan.d)
            if r.book is not None:
                r.book.finished(req.rid, plan.d)
        rec = req.record(self.scale)
        if self.writer is not None:
            self.writer.write(rec)
        else:
            self.stats.records.append(rec)
        self.open -= 1
        if self.open == 0:
            self.stats.t_end = t

    # -- time series ---------------------------------------------------------------------------

    def _write_link_rates(self, t: float) -> None:
        f = self.series.get("wan")
        if f is None:
            return
        f.write(t, [("link_rate_bps_wire", self.scale.wire_rate_bps(lk.rate_bps), {"link": lk.name})
                    for lk in self.net.wan.values()])

    def _sample_wan(self, _: Any) -> None:
        t = self.loop.now
        self._sample_wan_now(t)
        if self.busy:
            self.loop.at(t + self.wan_interval, SAMPLE, self._sample_wan)

    def _sample_wan_now(self, t: float) -> None:
        b = self.scale.byte_scale
        # Interface counters count TCP/IP headers too.
        self.series["wan"].write(t, [("link_bytes", lk.counter.at(t) / lk.tcp.payload_share / b,
                                      {"link": lk.name, "ifname": lk.name})
                                     for lk in self.net.wan.values()])

    def _sample_nodes(self, _: Any) -> None:
        t = self.loop.now
        self._sample_nodes_now(t)
        if self.busy:
            self.loop.at(t + self.node_interval, SAMPLE, self._sample_nodes)

    def _sample_nodes_now(self, t: float) -> None:
        b = self.scale.byte_scale
        net = self.net
        out = self.series["nodes"]
        for nid, p in self.prefill.items():
            backlog = sum(path.queued(t) for path in net.greedy_of[nid])
            out.source_write(t, nid, [
                ("queue_depth", float(p.queue.depth), {}),
                ("running", 1.0 if p.running else 0.0, {}),
                ("kv_backlog_bytes", backlog / b, {}),
                ("kv_bytes_sent", net.sent[nid].at(t) / b, {}),
            ])
        for nid, dn in self.decode.items():
            bt = dn.batch
            out.source_write(t, nid, [
                ("running_batch", float(len(bt.running)), {}),
                ("queue_depth", float(len(bt.waiting)), {}),
                ("kv_usage_bytes", float(bt.kv_used), {}),
                ("kv_bytes_received", net.received[nid].at(t) / b, {}),
            ])
        self.series["router"].write(t, self.router.samples())

    def _write(self, name: str, t: float, samples: list[Sample]) -> None:
        f = self.series.get(name)
        if f is not None:
            f.write(t, samples)

    def _write_decisions(self, t: float, samples: list[Sample]) -> None:
        if self.decisions is not None:
            self.decisions.write(t, samples)


def simulate(rs: ResolvedScenario, trace: Trace, run_dir: Path | None = None,
             options: SimOptions = SimOptions()) -> SimStats:
    """Simulate `trace` on the scenario; with `run_dir`, write records.csv, timeseries/ and
    decisions.jsonl into it (run.json, summary and report are the caller's)."""
    return Simulation(rs, trace, run_dir, options).run()


def shaping(rs: ResolvedScenario) -> dict[str, Any]:
    """run.json's `shaping` for a simulated run: the link model and its parameters."""
    sc = rs.spec
    scale = rs.scale
    inter, intra = rs.inter_dc, rs.intra_dc
    dcs = list(dict.fromkeys(c.datacenter for c in sc.clusters))
    links = {f"{a}->{b}": {"rate_bps_wire": scale.wire_rate_bps(inter.rate), "rate_bps_paper": inter.rate,
                           "delay_s_wire": scale.wire_seconds(inter.delay), "jitter_s_wire": 0.0,
                           "loss": inter.loss, "loss_correlation": inter.loss_correlation}
             for a in dcs for b in dcs if a != b}
    return {
        "method": "sim", "backend": "sim", "profile": inter.name, "intra_profile": intra.name,
        "links": links, "tcp": json.loads(inter.tcp.model_dump_json()),
        "schedule": [json.loads(c.model_dump_json()) for c in inter.schedule],
        "detail": ("flow-level model (testbed.sim.network): rate in force with its schedule, one-way delay, loss "
                   "as TCP goodput (Mathis for loss-based congestion control), max-min fair sharing per "
                   "connection, window/RTT per connection, layer-wise KV streaming; no jitter"),
    }
