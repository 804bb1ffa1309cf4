"""One simulated replay: the trace's requests through router, prefill, KV transfer and decode in
virtual (paper) time, writing what a live run writes (records, time series, decisions, and with
faults `faults.jsonl`).

Every request goes through the same core code the live services run, in the live order: the
router's books and `testbed.core.routing.route` (prefix lookup, policy, load tracker, cache
book, recent arrivals, health), its attempts, retries and deadlines (`testbed.sim.router`), the
prefill queue and service times, the KV into the flow-level network (`testbed.sim.network`) as
the nodes' protocol moves it (layer-wise push, pull after the prefill, or push once the decode
node registered: `testbed.sim.transfer`), the decode batch loop with KV admission (`testbed.core.engine.decode_loop`),
and the short-term bandwidth controller fed from the network's own byte accounting. Requests
arrive open loop at their trace times (after the same start lead as the live replayer). The
scenario's faults act at their times (`testbed.sim.fault_runner`). What the live path itself costs
(HTTP hops, routing, decode loop stalls) is added when given (`testbed.core.schema.live_path`);
without it nothing in the simulator adds time of its own.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.config.resolved import ResolvedScenario
from testbed.core.control.longterm import RoleMeter
from testbed.core.control.longterm import controller_for as longterm_for
from testbed.core.control.short_term import controller_for
from testbed.core.engine.decode_blocks import BlockBatch, Preemption
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.prefill_batch import PassStats
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.gc_pause import paused_gc
from testbed.core.json_types import JSONObject
from testbed.core.record import RequestRecord
from testbed.core.schema.live_path import LivePathCosts
from testbed.core.schema.topology import local_dc, node_specs
from testbed.core.sessions import ArrivalMode, ClosedLoop
from testbed.metrics.plot_only import PLOT_ONLY
from testbed.metrics.preemptions import PREEMPTIONS_CSV, write_preemptions
from testbed.metrics.records import RecordWriter
from testbed.metrics.run_files import DECISIONS_FILE, RECORDS_FILE
from testbed.metrics.series_batch import BatchSeriesFile as SeriesFile
from testbed.metrics.series_format import RawSample as Sample
from testbed.metrics.series_format import SeriesPoint, by_time
from testbed.model.retune import role_planner
from testbed.sim.control import ControlLoop
from testbed.sim.decode import DecodeSim
from testbed.sim.events import ARRIVAL, FAULT, SAMPLE, new_loop
from testbed.sim.fault_runner import FaultRunner, Prober
from testbed.sim.longterm import RoleLoop
from testbed.sim.net_view import new_network
from testbed.sim.network import Network
from testbed.sim.prefill import PrefillSim
from testbed.sim.reach import Reach
from testbed.sim.request import SimRequest
from testbed.sim.router import SimRouter
from testbed.sim.transfer import KvDiscipline
from testbed.traces.sessions import run_sessions
from testbed.traces.stream import TraceFile
from testbed.traces.types import Trace, TraceRequest

if TYPE_CHECKING:  # pyarrow is imported only by a run that writes Parquet
    from testbed.metrics.columnar import ParquetRecordWriter, ParquetSeriesFile

START_LEAD_S = 0.5  # wire seconds before the first request, as the live replayer waits
NODE_SAMPLE_S = 0.1  # wire seconds between node samples, as live services sample
WAN_SAMPLE_S = 0.05  # wire seconds between link-counter samples, as the netns link monitor


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
    decisions (threshold changes are always written). `settle_records` makes the records the
    run returns what records.csv reads back (`testbed.metrics.records.as_written`) as they are
    written, for a caller that summarises them (with a run directory only); `keep_records` False
    leaves them out of `SimStats.records` once written (memory then follows the requests in flight,
    and the caller reads records.parquet back), and then none is settled (the files hold the same).
    Records and decisions go to records.csv and decisions.jsonl, and to records.parquet and
    decisions.parquet too unless the trace has at most `text_requests` requests (None: no limit,
    both forms always). The text files are what survives a
    run killed outright (a Parquet file is readable only once its footer is written at the end), so
    they are written as the run goes; a run that ends with more than `text_requests` requests
    removes them then, as the Parquet files hold the same (`testbed export RUN` writes them from
    those). A short run writes the text files alone: the Parquet writers (and importing pyarrow)
    cost a tenth of its whole process, and every reader takes the text."""

    series_lines: int = 100_000
    link_lines: int = 20_000
    decisions: bool = True
    settle_records: bool = False
    text_requests: int | None = None
    keep_records: bool = True
    arrivals: ArrivalMode = "open"  # closed: each turn waits for its parent (`testbed.core.sessions`)


@dataclass
class SimStats:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    events: int = 0
    rebalances: int = 0
    retries: int = 0
    t_end: float = 0.0  # paper seconds, the last request's end
    wall_s: float = 0.0
    write_s: float = 0.0  # of wall_s, writing records and series in batches while the loop ran
    records: list[RequestRecord] = field(default_factory=list)
    # timeseries/ as read back, by time, but for the points of the metrics only plots read
    # (`testbed.metrics.plot_only`): written, and counted here by metric.
    series: list[SeriesPoint] = field(default_factory=list)
    series_unheld: dict[str, int] = field(default_factory=dict)
    prefill_passes: list[PassStats] = field(default_factory=list)  # each batching prefill instance's
    preemptions: list[tuple[str, Preemption]] = field(default_factory=list)  # (decode node, what happened)


class Simulation:
    def __init__(
        self,
        rs: ResolvedScenario,
        trace: Trace | TraceFile,
        run_dir: Path | None = None,
        options: SimOptions = SimOptions(),
        costs: LivePathCosts | None = None,
    ) -> None:
        sc = rs.spec
        if isinstance(trace, TraceFile) and (trace.stated_sessions or options.arrivals == "closed"):
            trace = trace.load()  # the session plan maps parents over the whole trace
        self.rs = rs
        self.sc = sc
        self.scale = rs.scale
        self.trace = trace
        self.options = options
        self.run_dir = run_dir
        self.costs = rs.live_path if costs is None else costs
        self.loop = new_loop()
        nodes = node_specs(sc)
        self.roles = {n.id: n.role for n in nodes}
        self.net = new_network(
            self.loop,
            {n.id: n.datacenter for n in nodes},
            rs.intra_dc,
            rs.inter_dc,
            sc.transfer,
            self.scale.byte_scale,
            self.scale.speedup,
            bool(sc.faults),
        )
        kv = KVModel.from_spec(sc.model)
        self.kv = kv
        xfer = KvDiscipline.for_scenario(sc)
        c, s = self.costs, self.scale.speedup
        stalls = (c.stall_rate_per_s / s, c.stall_s * s) if c.stall_rate_per_s > 0 and c.stall_s > 0 else (0.0, 0.0)
        # What the router's calls meet at each instance: its process (up, paused or down: the
        # faults') and the way to it (the router sits in the decode cluster's datacenter).
        self.reach = Reach(self.loop, self.net, {n.id: n.datacenter for n in nodes}, local_dc(sc), s)
        self.prefill: dict[str, PrefillSim] = {}
        self.decode: dict[str, DecodeSim] = {}
        # The router drives each request through the instances, which call it back; a request's
        # record comes back here when it closes.
        self.router = SimRouter(
            rs,
            self.costs,
            self.loop,
            self.net,
            self.prefill,
            self.decode,
            self.reach,
            self._write_decisions,
            run_dir is not None and options.decisions,
            self.closed,
        )
        for n in nodes:
            hw = sc.hardware[n.hardware]
            if n.role == "prefill":
                self.prefill[n.id] = PrefillSim(
                    n,
                    PrefillTime.from_spec(hw.prefill),
                    kv,
                    self.scale.byte_scale,
                    self.router,
                    hw.scheduler,
                    xfer.layerwise,
                )
            else:
                assert hw.decode is not None
                self.decode[n.id] = DecodeSim(n, hw, kv, self.router, stalls)
        books = self.router.books
        if isinstance(self.net, Network):  # what a fault does to the transport and the links
            self.net.faults.on_fail = self.router.transfers_failed
            self.net.faults.busy = lambda: self.busy
            self.net.on_back = self.reach.links_back
        ctl = controller_for(sc, rs.threshold, rs.inter_dc.rate)
        self.control = (
            None
            if ctl is None
            else ControlLoop(
                self.loop,
                self.net,
                books,
                self.prefill,
                ctl,
                sc.policy.control.interval_s,
                sc.policy.bandwidth_aware,
                sc.policy.bandwidth_state == "auto",
                lambda: self.busy,
                self.reach.answers,
                lambda t, samples: self._write("router", t, samples),
                self._write_decisions,
            )
        )
        lt = longterm_for(sc, rs.threshold, role_planner(sc, rs.inter_dc.rate))
        self.role_loop = (
            None
            if lt is None
            else RoleLoop(
                self.loop,
                books,
                self.decode,
                lt,
                RoleMeter(sc, books.tracker, lt.roles),
                lambda: None if self.control is None else self.control.ctl,
                lambda: self.busy,
                self.reach.answers,
                lambda t, samples: self._write("router", t, samples),
                self._write_decisions,
            )
        )
        self.faults = FaultRunner(self, run_dir) if sc.faults else None
        self.prober = Prober(self) if sc.faults else None
        self.stats = SimStats(requests=len(trace))
        self.open = len(trace)  # requests not finished yet
        self.run_dir = run_dir
        self.writer: RecordWriter | None = None
        self.columns: ParquetRecordWriter | None = None
        self.series: dict[str, SeriesFile] = {}
        self.decisions: list[SeriesFile | ParquetSeriesFile] = []
        lead = START_LEAD_S * self.scale.speedup
        # Sessions: the trace's stated ones; inferred from hash_ids only for a closed-loop run.
        # A streamed trace (`TraceFile`) has neither (its arrivals are read as the run goes).
        self.sessions = run_sessions(trace, options.arrivals) if isinstance(trace, Trace) else None
        self.closed_loop = ClosedLoop(self.sessions) if options.arrivals == "closed" and self.sessions else None
        if self.closed_loop is not None:
            assert isinstance(trace, Trace)
            self._turns = reqs = trace.requests
            firsts = self.closed_loop.first_turns()
            self._arrivals: Iterator[tuple[int, TraceRequest]] = ((i, reqs[i]) for i in firsts)
        else:
            self._arrivals = iter(enumerate(trace))
        self._lead = lead
        cap = options.text_requests
        self.parquet = cap is None or len(trace) > cap
        span = trace.last_timestamp + lead + 60.0
        per_sample = len(self.prefill) * (7 if sc.faults else 4) + len(self.decode) * 6 + len(self.prefill) + 16
        self.node_interval = max(NODE_SAMPLE_S * self.scale.speedup, span * per_sample / options.series_lines)
        self.wan_interval = max(WAN_SAMPLE_S * self.scale.speedup, span * len(self.net.wan) / options.link_lines)

    # -- running -------------------------------------------------------------------------------

    def run(self) -> SimStats:
        with paused_gc():  # through the writing of the run directory too
            return self._run()

    def _run(self) -> SimStats:
        wall = time.perf_counter()
        if self.run_dir is not None:
            ts = self.run_dir / "timeseries"
            # Records and samples are held while the run goes and written when it ends (however it
            # ends: the files are closed below); formatted one by one they cost a quarter of it.
            # Records the run does not return are written as settling would make them, not settled.
            settle = self.options.settle_records and self.options.keep_records
            s = self.scale.speedup
            self.writer = RecordWriter(self.run_dir / "records.csv", deferred=True, settle=settle)
            text = SeriesFile(self.run_dir / "decisions.jsonl", "router", s, repeated_labels=False, deferred=True)
            if self.parquet:
                from testbed.metrics.columnar import ParquetRecordWriter, ParquetSeriesFile

                self.decisions = [ParquetSeriesFile(self.run_dir / DECISIONS_FILE, "router", s), text]
                self.columns = ParquetRecordWriter(self.run_dir / RECORDS_FILE, settle=settle, settled_by=self.writer)
            else:
                self.decisions = [text]
            self.series = {
                name: SeriesFile(ts / f"{name}.jsonl", name, s, keep=True, deferred=True, unheld=PLOT_ONLY)
                for name in ("router", "wan", "nodes")
            }
            self._write_link_rates(0.0)
        try:
            self.net.schedule_changes()
            for c in self.rs.inter_dc.schedule:
                self.loop.at(c.at, SAMPLE, lambda _: self._write_link_rates(self.loop.now))
            self._next_arrival()
            if self.run_dir is not None:
                self.loop.at(0.0, SAMPLE, self._sample_nodes)
                if self.net.wan:
                    self.loop.at(0.0, SAMPLE, self._sample_wan)
            if self.control is not None:
                self.control.start()
            if self.role_loop is not None:
                self.role_loop.start()
            if self.faults is not None:
                self.faults.start()
            if self.prober is not None:
                self.prober.start()
            # The collector is paused (`run`): a run makes millions of short-lived acyclic objects
            # beside long-lived pools of cache entries, which it would rescan again and again (two
            # thirds of the time of an hour-long trace) for garbage that reference counting frees.
            with _interruptible():
                self.loop.run()
            self.stats.t_end = self.stats.t_end or self.loop.now
            if self.run_dir is not None:
                self._sample_nodes_now(self.stats.t_end)
                self._sample_wan_now(self.stats.t_end)
            # The simulation's own time, as a peer simulator reports its own: writing what it
            # held into the run directory follows (a whole `replay` process is timed as such).
            self.stats.wall_s = time.perf_counter() - wall
            self.stats.write_s = sum(
                f.write_s for f in (self.writer, self.columns, *self.series.values(), *self.decisions) if f is not None
            )
        finally:
            if self.faults is not None:
                self.faults.finish(self.stats.t_end or self.loop.now)
            if self.writer is not None:
                self.writer.close()
            if self.columns is not None:
                self.columns.close()
            for f in self.series.values():
                f.close()
            for d in self.decisions:
                d.close()
        self._drop_text()
        # As `load_timeseries` reads them back: the files in name order, then by time.
        self.stats.series = sorted(
            (p for name in sorted(self.series) for p in self.series[name].points or ()), key=by_time
        )
        for f in self.series.values():
            for metric, n in f.unheld_counts.items():
                self.stats.series_unheld[metric] = self.stats.series_unheld.get(metric, 0) + n
        self.stats.events = self.loop.processed
        self.stats.rebalances = self.net.rebalances
        self.stats.retries = self.router.books.retries
        self.stats.prefill_passes = [p.loop.stats for p in self.prefill.values() if p.loop.batching]
        self.stats.preemptions = [
            (node, e) for node, d in self.decode.items() if isinstance(d.batch, BlockBatch) for e in d.batch.preemptions
        ]
        if self.run_dir is not None and self.stats.preemptions:
            write_preemptions(self.run_dir / PREEMPTIONS_CSV, self.stats.preemptions, self.scale.wire_seconds)
        self.stats.wall_s = self.stats.wall_s or time.perf_counter() - wall
        return self.stats

    def _drop_text(self) -> None:
        """A run that ended (not one stopped) above `text_requests` keeps the Parquet files alone."""
        cap = self.options.text_requests
        if self.run_dir is None or cap is None or self.columns is None or self.columns.count <= cap:
            return
        for name in ("records.csv", "decisions.jsonl"):
            (self.run_dir / name).unlink(missing_ok=True)

    @property
    def busy(self) -> bool:
        return self.open > 0

    def _next_arrival(self) -> None:
        nxt = next(self._arrivals, None)
        if nxt is not None:
            i, tr = nxt
            self.loop.at(self._lead + tr.timestamp, ARRIVAL, self._arrive, (i, tr))

    def _arrive(self, arg: tuple[int, TraceRequest]) -> None:
        i, tr = arg
        self._next_arrival()
        self._send(i, tr)

    def _send(self, i: int, tr: TraceRequest) -> None:
        if self.closed_loop is not None:
            self.closed_loop.sent(i, self.loop.now - self._lead)
        self.router.arrive(i, tr, self.loop.now)

    def _turn(self, arg: tuple[int, TraceRequest]) -> None:
        self._send(*arg)

    # -- the end of a request ------------------------------------------------------------------

    def closed(self, req: SimRequest, t: float) -> None:
        """The request is done, completed or failed: its record is written."""
        if req.outcome == "completed":
            self.stats.completed += 1
        else:
            self.stats.failed += 1
        rec = req.record(self.scale)
        plan = self.sessions
        if plan is not None:
            i = req.index
            rec.session_id, rec.turn, rec.parent_index = plan.session[i], plan.turn[i], plan.parent[i]
        if self.closed_loop is not None:
            reqs, lead = self._turns, self._lead
            for c, d in self.closed_loop.done(req.index, t - lead):
                self.loop.at(lead + d, ARRIVAL, self._turn, (c, reqs[c]))
        if self.writer is not None:
            self.writer.write(rec)
        if self.columns is not None:
            self.columns.write(rec)
        if self.options.keep_records:
            self.stats.records.append(rec)  # the summary's, without reading records.csv again
        self.open -= 1
        if self.open == 0:
            self.stats.t_end = t

    # -- the instances' processes (faults) --------------------------------------------------------

    def kill(self, node: str, t: float) -> None:
        if self.reach.life[node] == "down":
            return
        self.reach.killed(node)
        net = self.net
        assert isinstance(net, Network)  # a run with faults has the Python network
        if self.roles[node] == "prefill":
            self.prefill[node].kill(t)
            self.router.node_lost(node, "prefill", t)
            for (src, _), p in list(net.paths.items()):
                if src == node:
                    net.withdraw(p, 0.0, math.inf)
        else:
            self.decode[node].kill()
            self.router.node_lost(node, "decode", t)
            for (_, dst), p in list(net.paths.items()):
                if dst == node:
                    net.withdraw(p, 0.0, math.inf)

    def start(self, node: str, t: float) -> None:
        """A killed instance runs again, empty."""
        if self.reach.life[node] == "down":
            self.reach.life[node] = "up"

    def pause(self, node: str, t: float) -> None:
        if self.reach.life[node] != "up":
            return
        self.reach.life[node] = "paused"
        if self.roles[node] == "prefill":
            self.prefill[node].pause(t)
        else:
            self.decode[node].pause(t)

    def resume(self, node: str, t: float) -> None:
        if self.reach.life[node] != "paused":
            return
        self.reach.life[node] = "up"
        if self.roles[node] == "prefill":
            self.prefill[node].resume(t)
        else:
            self.decode[node].resume(t)
        self.reach.resumed(node)

    def slow(self, node: str, factor: float, until: float | None, t: float) -> None:
        if self.roles[node] == "prefill":
            self.prefill[node].slow.set(factor, until)
            return
        dn = self.decode[node]
        dn.slow.set(factor, until)
        dn.slow_changed(t)
        if until is not None:
            self.loop.at(until, FAULT, lambda _: dn.slow_changed(self.loop.now))

    # -- time series ---------------------------------------------------------------------------

    def _write_link_rates(self, t: float) -> None:
        f = self.series.get("wan")
        if f is None:
            return
        f.write(
            t,
            [
                ("link_rate_bps_wire", self.scale.wire_rate_bps(lk.rate_bps), {"link": lk.name})
                for lk in self.net.wan.values()
            ],
        )

    def _sample_wan(self, _: Any) -> None:
        t = self.loop.now
        self._sample_wan_now(t)
        if self.busy:
            self.loop.at(t + self.wan_interval, SAMPLE, self._sample_wan)

    def _sample_wan_now(self, t: float) -> None:
        b = self.scale.byte_scale
        # Interface counters count TCP/IP headers too.
        self.series["wan"].write(
            t,
            [
                ("link_bytes", lk.counter.at(t) / lk.tcp.payload_share / b, {"link": lk.name, "ifname": lk.name})
                for lk in self.net.wan.values()
            ],
        )

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
            samples = p.queue.samples(net.backlog(nid, t) / b, net.sent_at(nid, t) / b)
            if self.faults is not None:
                assert isinstance(net, Network)
                wan = net.faults
                # What connection losses cost, as the live senders count it (the report's Faults section).
                samples += [
                    ("kv_resumes", float(wan.resumes[nid]), {}),
                    ("kv_bytes_resent", wan.resent[nid] / b, {}),
                    ("kv_transfers_failed", float(wan.failed[nid]), {}),
                ]
            out.source_write(t, nid, samples)
        for nid, dn in self.decode.items():
            out.source_write(t, nid, dn.loop.samples(net.received_at(nid, t) / b))
        self.series["router"].write(t, self.router.books.samples())

    def _write(self, name: str, t: float, samples: list[Sample]) -> None:
        f = self.series.get(name)
        if f is not None:
            f.write(t, samples)

    def _write_decisions(self, t: float, samples: list[Sample]) -> None:
        """A line of `decisions.jsonl` (the router writes per-request decisions only when the
        options keep them)."""
        for d in self.decisions:
            d.write(t, samples)


def simulate(
    rs: ResolvedScenario,
    trace: Trace | TraceFile,
    run_dir: Path | None = None,
    options: SimOptions = SimOptions(),
    costs: LivePathCosts | None = None,
) -> SimStats:
    """Simulate `trace` on the scenario; with `run_dir`, write records.csv and decisions.jsonl (up
    to `options.text_requests` requests), records.parquet and decisions.parquet (above it, or with
    no limit), timeseries/ and (with
    faults) faults.jsonl into it (run.json, summary and report are the
    caller's). `costs`: the live path's, default the scenario's (`sim.live_path`)."""
    return Simulation(rs, trace, run_dir, options, costs).run()


def shaping(rs: ResolvedScenario) -> JSONObject:
    """run.json's `shaping` for a simulated run: the link model and its parameters."""
    sc = rs.spec
    scale = rs.scale
    inter, intra = rs.inter_dc, rs.intra_dc
    dcs = list(dict.fromkeys(c.datacenter for c in sc.clusters))
    links = {
        f"{a}->{b}": {
            "rate_bps_wire": scale.wire_rate_bps(inter.rate),
            "rate_bps_paper": inter.rate,
            "delay_s_wire": scale.wire_seconds(inter.delay),
            "jitter_s_wire": 0.0,
            "loss": inter.loss,
            "loss_correlation": inter.loss_correlation,
        }
        for a in dcs
        for b in dcs
        if a != b
    }
    return {
        "method": "sim",
        "backend": "sim",
        "profile": inter.name,
        "intra_profile": intra.name,
        "links": links,
        "tcp": json.loads(inter.tcp.model_dump_json()),
        "schedule": [json.loads(c.model_dump_json()) for c in inter.schedule],
        "detail": (
            "flow-level model (testbed.sim.network): rate in force with its schedule, one-way delay, loss "
            "as TCP goodput (Mathis for loss-based congestion control), max-min fair sharing per "
            "connection, window/RTT per connection, layer-wise KV streaming; no jitter"
        ),
    }
