"""The router in virtual time: each request's attempts through prefill, KV transfer and decode,
with the live router's rules (`testbed.live.router`).

The books are the live router's (`testbed.core.router_books.RouterBooks`: the load tracker, the
cache book, the health book), routing is `testbed.core.routing.route`, and the attempts follow
`testbed.core.router.retries`: an attempt that fails before the client saw a token is routed once more,
away from the instance to blame; a request past its deadline fails whatever it was doing. What
fails an attempt, and which `testbed.core.failures.FailureKind` and instance it names (the live
router's for the same event, so the report's Faults section reads both alike; the words are the
simulator's own):

- its decode instance is gone (refused at dispatch, or the stream broke when it was killed);
- its prefill instance is gone before it answered (refused, or the call broke);
- its KV transfer could not resume (`testbed.sim.wan`), or its KV did not arrive in time;
- the decode instance cannot ever hold it (KV memory).

A paused instance answers nothing: what is sent to it waits until it resumes; one across a dark
WAN (the router sits in the decode cluster's datacenter) gets nothing until the link is back.
The prefill node answers once the decode node confirmed its KV (END's answer back, then a hop);
without faults that answer is taken with the KV's arrival (milliseconds early, an event less per
request). The live path's own costs (`testbed.core.schema.live_path`) sit where the live router pays
them: routing, dispatching the prefill (with the network's delay to it), relaying tokens.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Mapping

from testbed.config.resolved import ResolvedScenario
from testbed.core.engine.decode_loop import KV_TIMEOUT_S
from testbed.core.engine.prefill_loop import CACHE_IN_TIMEOUT_S
from testbed.core.failures import NODE_KINDS, Failure
from testbed.core.failures import FailureKind as K
from testbed.core.lifecycle import Event
from testbed.core.router.health import Outcome
from testbed.core.router.retries import avoid_after, deadline_paper_s, deadline_reason, may_retry
from testbed.core.router.route_step import route
from testbed.core.router.router_books import RouterBooks, decision_line, health_line
from testbed.core.routing.policy import NoCapacity
from testbed.core.schema.live_path import LivePathCosts
from testbed.core.schema.scaling import Scale
from testbed.core.schema.topology import node_specs
from testbed.metrics.series_format import RawSample
from testbed.sim.events import ARRIVAL, KV_ARRIVAL, PREFILL, Loop
from testbed.sim.host import DecodePort, PrefillPort
from testbed.sim.net_view import Net
from testbed.sim.net_view import PathHandle as NetPath
from testbed.sim.reach import Reach
from testbed.sim.request import SimRequest
from testbed.sim.transfer import EngineTransfers, KvDiscipline
from testbed.traces.types import TraceRequest

PAPER_TIME = Scale()  # the simulator's clock is paper time: routing books paper seconds


# Where the router's decision lines go (decisions.jsonl: per-request decisions, health changes).
DecisionSink = Callable[[float, list[RawSample]], None]


class SimRouter:
    """The router of a simulated run, and the host its instances call back
    (`testbed.sim.host.Host`): a request's path reads top-down from `arrive` (route, dispatch)
    through the prefill instance (`transfer_handed`), its KV's arrival at the decode instance
    (`_kv_arrived`) and its last token (`finished`) to `closed`, where the simulation takes its
    record."""

    def __init__(
        self,
        rs: ResolvedScenario,
        costs: LivePathCosts,
        loop: Loop,
        net: Net,
        prefill: Mapping[str, PrefillPort],
        decode: Mapping[str, DecodePort],
        reach: Reach,
        decisions: DecisionSink,
        keep_decisions: bool,
        closed: Callable[[SimRequest, float], None],
    ) -> None:
        self.loop = loop
        self.net = net
        self.prefill = prefill  # the instances, by node id (filled by the caller: they call back here)
        self.decode = decode
        self.reach = reach
        self.scale = rs.scale
        self.sc = sc = rs.spec
        self.speedup = s = rs.scale.speedup
        node_ids = [n.id for n in node_specs(sc)]
        self.books = RouterBooks.for_scenario(sc, rs.threshold, rs.intra_dc, rs.inter_dc, node_ids, per_wire_s=s)
        c = self.costs = costs
        self.routing = c.routing_s * s
        self.dispatch = c.dispatch_s * s
        self.relay = c.relay_s * s
        self.relay_last = c.relay_last_s * s
        self.relays = (self.relay, self.relay_last)
        self.hop = c.relay_s * s / 2  # one HTTP hop back to the router
        self.hops = c.any  # the router's calls pay their network delay too (across the WAN: its delay)
        self.xfer = KvDiscipline.of(sc.node_protocol)  # how the KV moves (`testbed.sim.transfer`)
        self.engine = EngineTransfers(rs, loop, net, reach, self.hop, self._prefill_answered, self._kv_sent)
        # With their distributions, each request draws its own costs (a seeded stream, in event order).
        self.rng = random.Random(20260518) if c.quantiles else None
        self.write_decision = decisions
        self.decisions = keep_decisions  # per-request decisions go to decisions.jsonl
        self.closed = closed
        # Instances can be down, paused or out of reach only with faults, or a link that goes dark.
        self.watch = bool(sc.faults) or any(c.loss is not None and c.loss >= 1.0 for c in rs.inter_dc.schedule)
        self.active: dict[str, SimRequest] = {}  # attempts in flight, by the id the nodes know
        self._deadlines: list[tuple[float, int]] = []  # (deadline, request index), a heap
        self._sweep_at = math.inf
        self._sweeps = 0
        self.current: dict[int, SimRequest] = {}  # each open request's present attempt
        self._deadline_by_len: dict[int, float] = {}

    # -- arrival and routing ---------------------------------------------------------------------

    def _cost(self, name: str, mean: float) -> float:
        """One draw of a live-path cost (paper s), or its mean without a distribution."""
        if self.rng is None or name not in self.costs.quantiles:
            return mean
        return self.costs.draw(name, self.rng.random()) * self.speedup

    def arrive(self, i: int, tr: TraceRequest, t: float) -> None:
        if self.rng is None:  # the costs' means (no draws): what `_cost` gives, without its calls
            relay, routing = self.relays, self.routing
        else:
            relay = (self._cost("relay_s", self.relay), self._cost("relay_last_s", self.relay_last))
            routing = self._cost("routing_s", self.routing)
        req = SimRequest(i, tr, t, relay=relay)
        self.current[i] = req
        self._deadline_at(t + self._deadline_s(tr.output_tokens), i)
        if routing > 0:
            self.loop.at(t + routing, ARRIVAL, self._route_first, req)
        else:
            self._route_first(req)

    def _deadline_s(self, output_tokens: int) -> float:
        """`deadline_paper_s`, remembered by output length (a trace has few distinct ones)."""
        dl = self._deadline_by_len.get(output_tokens)
        if dl is None:
            dl = self._deadline_by_len[output_tokens] = deadline_paper_s(self.sc, output_tokens)
        return dl

    def _route_first(self, req: SimRequest) -> None:
        t = self.loop.now
        try:
            self._route(req, t)
        except NoCapacity as e:
            self._fail(req, Failure(K.NO_CAPACITY, "", f"router answered 503: {e}"), t)
            return
        self.books.inflight += 1

    def _route(self, req: SimRequest, t: float, avoid: frozenset[str] = frozenset()) -> None:
        b = self.books
        tr = req.tr
        plan = route(
            b,
            self.sc,
            tr.request_id,
            tr.input_tokens,
            tr.hash_ids,
            t,
            PAPER_TIME,
            b.down(),
            avoid,
            output_tokens=tr.output_tokens,
        )
        req.plan = plan
        d = plan.d
        req.routed = t
        req.life.apply(Event.ROUTE, t)
        if self.decisions:
            self.write_decision(t, [decision_line(tr.request_id, d, b.bandwidth)])
        # What the request moves: the KV the decode side lacks (paper bytes).
        req.kv_bytes_paper = b.kv.incremental(tr.input_tokens, d.decode_cached_tokens)
        self.active[req.rid] = req
        dispatch = self.dispatch if self.rng is None else self._cost("dispatch_s", self.dispatch)
        if dispatch > 0:
            self.loop.at(t + dispatch, ARRIVAL, self._dispatch, req)
        else:
            self._dispatch(req)

    def _dispatch(self, req: SimRequest) -> None:
        """The router calls the decode node, then the prefill node (and a cache move's source)."""
        if req.gone:
            return
        reach = self.reach
        t = self.loop.now
        plan = req.plan
        assert plan is not None
        d = plan.d
        for node in (d.decode_node, d.prefill_node) if self.watch else ():
            role = "decode" if node == d.decode_node else "prefill"
            match reach.life[node]:
                case "down":
                    f = Failure(
                        NODE_KINDS[role, False],
                        node,
                        f"{role} node {node} unreachable: the instance is down (connection refused)",
                    )
                    self.attempt_failed(req, f, t, node, "refused")
                    return
                case "paused":
                    reach.when_resumed(node, lambda _: self._dispatch(req))
                    return
                case _:
                    pass
            if not reach.reachable(node):
                reach.when_reachable(node, lambda _: self._dispatch(req))
                return
        kv_by = t + KV_TIMEOUT_S * self.speedup
        if req.arrival + self._deadline_s(req.tr.output_tokens) > kv_by:
            self.loop.at(kv_by, PREFILL, self._kv_timeout, req)
        if d.cache_move is not None and plan.move_src is not None:
            self._move(req, plan.move_src, t)
        # With the live path's costs, the call reaches a prefill node elsewhere a WAN delay later
        # (its queue takes it then).
        at = t + reach.http_delay(d.prefill_node) if self.hops else t
        if self.xfer.bootstrap:  # and not before the decode node's registration (`testbed.sim.transfer`)
            at = max(at, self.engine.register(d.decode_node, d.prefill_node, t + reach.http_delay(d.decode_node)))
        self.prefill[d.prefill_node].submit(req, at)

    def _move(self, req: SimRequest, src: str, t: float) -> None:
        assert req.plan is not None
        if self.reach.life[src] != "up":
            # Nothing starts the transfer: the prefill waits for it until its timeout.
            self.loop.at(t + CACHE_IN_TIMEOUT_S * self.speedup, PREFILL, self._move_lost, req)
            return
        self.books.cache_moves += 1
        req.cache_move_start = t
        req.cache_move_bytes_wire = max(self.scale.wire_bytes(req.plan.move_bytes_paper), 1)
        net = self.net
        path = net.path(src, req.plan.d.prefill_node)
        lo = net.position(path)
        nbytes = req.cache_move_bytes_wire * self.scale.byte_scale
        req.move_range = (lo, lo + nbytes)
        net.push(path, t, nbytes)
        net.mark(path, net.position(path), self._move_sent, (req, path))

    def _move_lost(self, req: SimRequest) -> None:
        if not req.gone and not req.moved:
            self.attempt_failed(
                req,
                Failure(K.CACHE_MOVE, "", f"moved cached prefix did not arrive within {CACHE_IN_TIMEOUT_S:g} s"),
                self.loop.now,
            )

    def _move_sent(self, arg: tuple[SimRequest, NetPath], t: float) -> None:
        req, path = arg
        self.loop.at(t + path.delay, KV_ARRIVAL, self._move_arrived, req)

    def _move_arrived(self, req: SimRequest) -> None:
        if req.gone:
            return
        assert req.plan is not None
        node = req.plan.d.prefill_node
        self.prefill[node].move_arrived(req, self.loop.now)

    # -- the KV and the prefill's answer -----------------------------------------------------------

    def transfer_handed(self, req: SimRequest, path: NetPath, pos: float) -> None:
        """The prefill's compute ended with its KV up to `pos` in `path`: the decode node holds the
        KV once the last byte has crossed; the prefill node answers the router once the receiver
        has confirmed it (END's answer back over the path)."""
        self.net.mark(path, pos, self._kv_sent, (req, path))

    def kv_held(self, req: SimRequest, path: NetPath, t: float) -> None:
        """The prefill ended at `t` holding its KV for the decode node to pull (`testbed.sim.transfer`)."""
        self.engine.held(req, path, t)

    def _kv_sent(self, arg: tuple[SimRequest, NetPath], t: float) -> None:
        req, path = arg
        if req.gone:
            return
        self.loop.at(t + path.delay, KV_ARRIVAL, self._kv_arrived, (req, path.delay))

    def _kv_arrived(self, arg: tuple[SimRequest, float]) -> None:
        req, back = arg
        if req.gone:
            return
        plan = req.plan
        assert plan is not None
        node = plan.d.decode_node
        if self.reach.life[node] == "paused":
            self.reach.when_resumed(node, lambda _: self._kv_arrived(arg))
            return
        t = self.loop.now
        req.transfer_end = t
        req.life.apply(Event.KV_COMPLETE, t)
        if plan.d.crossed_wan:
            self._note_tail(req)
        self.books.kv_complete(req.tr.request_id, plan, req.tr.input_tokens)
        if self.watch:
            away = self.reach.http_delay(plan.d.prefill_node) if self.hops else 0.0
            self.loop.at(t + back + self.hop + away, KV_ARRIVAL, self._prefill_answered, req)
        else:
            # Without faults the answer's way back (END's, then an HTTP hop: milliseconds) changes
            # nothing but when the tracker sees it: taken with the KV, an event less per request.
            self._prefill_answered(req)
        self.decode[node].kv_arrived(req, t)

    def _prefill_answered(self, req: SimRequest, now: bool = False) -> None:
        """The prefill node's answer is at the router (`now`: take it as arrived, the request is
        done and its books are closed)."""
        if req.gone or req.prefill_seen:
            return
        plan = req.plan
        assert plan is not None
        if not now and self.watch and not self.reach.reachable(plan.d.prefill_node):
            self.reach.when_reachable(plan.d.prefill_node, lambda _: self._prefill_answered(req))
            return
        t = self.loop.now
        b = self.books
        req.prefill_seen = True
        b.tracker.prefill_done(plan.d, plan.work, plan.rid, plan.hashes)
        if self.watch:  # else an answer changes no instance's health (`note_health`)
            self.note_health(plan.d.prefill_node, "ok", t)
        b.prefilled(req.tr.request_id, plan, req.tr.input_tokens, moved=plan.d.cache_move is not None)
        if plan.d.crossed_wan:
            self._note_tail(req)

    def _note_tail(self, req: SimRequest) -> None:
        plan = req.plan
        if plan is not None and plan.d.crossed_wan and req.prefill_seen and not math.isnan(req.transfer_end):
            self.books.note_tail(max(req.transfer_end - req.prefill_end, 0.0))

    # -- the end of an attempt, of a request -------------------------------------------------------

    def finished(self, req: SimRequest, t: float) -> None:
        """The decode node produced the last token at `t`. The router completes the request
        once it has the prefill's answer too (it waits for it, as live)."""
        if req.gone or req.outcome != "pending":
            return
        plan = req.plan
        assert plan is not None
        if not req.prefill_seen:
            node = plan.d.prefill_node
            if self.watch and not self.reach.reachable(node):
                self.reach.when_reachable(node, lambda _: self.finished(req, t))
                return
            self._prefill_answered(req, now=True)
        req.life.apply(Event.FIRST_TOKEN, req.decode_first_token)
        req.life.apply(Event.FINISH, t)
        if self.watch:
            self.note_health(plan.d.decode_node, "ok", t)
        req.outcome = "completed"
        self.active.pop(req.rid, None)
        self._close(req, max(t + req.relay_last, self.loop.now))

    def attempt_failed(
        self, req: SimRequest, f: Failure, t: float, node: str = "", outcome: Outcome = "failed", retryable: bool = True
    ) -> None:
        """One attempt failed with `f` (`node`: the instance to blame): clean up after it, tell the
        health book, then retry elsewhere or give the request up."""
        if req.gone or req.outcome != "pending":
            return
        self._drop(req, t)
        if node:
            self.note_health(node, outcome, t, f.detail)
        plan = req.plan
        if plan is None or not may_retry(retryable, 1 if req.tokens_sent(t) else 0, req.retries):
            self._fail(req, f, t)
            return
        new = req.retry(f)
        self.current[req.index] = new
        try:
            self._route(new, t, avoid_after(node, plan))
        except NoCapacity as nc:
            # The request dies of the attempt's failure: its kind and instance stay.
            self._fail(new, Failure(f.kind, f.node, f"{f.detail}; no instance left to retry on: {nc}"), t)
            return
        self.books.retries += 1

    def _drop(self, req: SimRequest, t: float) -> None:
        """What a failed or abandoned attempt leaves: its work on the nodes, its bytes not yet
        sent, its place in the router's books."""
        req.gone = True
        self.active.pop(req.rid, None)
        plan = req.plan
        if plan is None:
            return
        d = plan.d
        net = self.net
        if not req.prefill_seen:
            self.prefill[d.prefill_node].abort(req, t)
            if req.kv_range is not None and math.isnan(req.transfer_end):
                net.withdraw(net.path(d.prefill_node, d.decode_node), *req.kv_range)
            if req.move_range is not None and not req.moved and plan.move_src is not None:
                net.withdraw(net.path(plan.move_src, d.prefill_node), *req.move_range)
        self.decode[d.decode_node].leave(req, t)
        self.books.attempt_over(req.tr.request_id, plan, req.prefill_seen)
        self.books.tracker.decode_done(d)

    def _fail(self, req: SimRequest, f: Failure, t: float) -> None:
        """The request fails for good."""
        if not req.gone:
            self._drop(req, t)
        if not req.life.done:
            req.life.apply(Event.FAIL, t, f.detail)
        req.outcome, req.reason, req.failure = "failed", f.detail, f
        if req.plan is not None or req.retries:  # it was routed once
            self.books.inflight -= 1
        self._close(req, t)

    def _close(self, req: SimRequest, t: float) -> None:
        self.current.pop(req.index, None)
        if req.outcome == "completed":
            self.books.inflight -= 1
            plan = req.plan
            assert plan is not None
            self.books.attempt_over(req.tr.request_id, plan, req.prefill_seen)
            self.books.tracker.decode_done(plan.d)
        self.closed(req, t)

    # Deadlines are kept in a heap of their own and swept when the earliest one of a request
    # still open is due: most requests end long before theirs, so the event loop's heap does
    # not carry one event per request for minutes (a long heap slows every event).

    def _deadline_at(self, t: float, index: int) -> None:
        heapq.heappush(self._deadlines, (t, index))
        if t < self._sweep_at:
            self._arm_sweep(t)

    def _arm_sweep(self, t: float) -> None:
        self._sweep_at = t
        self._sweeps += 1
        self.loop.at(t, PREFILL, self._sweep, self._sweeps)

    def _sweep(self, version: int) -> None:
        if version != self._sweeps:
            return
        now = self.loop.now
        h = self._deadlines
        while h:
            t, index = h[0]
            req = self.current.get(index)
            if req is None or req.outcome != "pending":
                heapq.heappop(h)  # done before its deadline
            elif t <= now:
                heapq.heappop(h)
                self._fail(req, Failure(K.DEADLINE, "", deadline_reason(self.sc, req.tr.output_tokens)), now)
            else:
                break
        self._sweep_at = math.inf
        if h:
            self._arm_sweep(h[0][0])

    def _kv_timeout(self, req: SimRequest) -> None:
        if not req.gone and math.isnan(req.transfer_end):
            f = Failure(K.KV_TRANSFER, "", f"kv transfer did not complete within {KV_TIMEOUT_S:g} s")
            self.attempt_failed(req, f, self.loop.now)

    # -- faults ----------------------------------------------------------------------------------

    def node_lost(self, node: str, role: str, t: float) -> None:
        """The instance was killed: what the router was waiting for there breaks."""
        for req in list(self.active.values()):
            plan = req.plan
            if plan is None or req.gone:
                continue
            d = plan.d
            if role == "decode" and d.decode_node == node:
                f = Failure(K.DECODE_DOWN, node, f"decode node {node} stream broke: the instance was killed")
                self.attempt_failed(req, f, t, node)
            elif role == "prefill" and d.prefill_node == node and not req.prefill_seen:
                f = Failure(K.PREFILL_DOWN, node, f"prefill node {node} unreachable: the instance was killed")
                self.attempt_failed(req, f, t, node)
            elif role == "prefill" and plan.move_src == node and not req.moved and d.cache_move is not None:
                self.loop.at(t + CACHE_IN_TIMEOUT_S * self.speedup, PREFILL, self._move_lost, req)

    def transfers_failed(self, src: str, dst: str, reason: str, t: float) -> None:
        """The pair's KV transfers could not resume: the prefill node reports them failed."""
        for req in list(self.active.values()):
            plan = req.plan
            if plan is None or req.gone:
                continue
            d = plan.d
            kv = (
                d.prefill_node == src
                and d.decode_node == dst
                and math.isnan(req.transfer_end)
                and req.kv_range is not None
            )
            move = plan.move_src == src and d.prefill_node == dst and not req.moved and req.move_range is not None
            if kv or move:
                self.attempt_failed(req, Failure(K.KV_TRANSFER, "", f"kv transfer failed: {reason}"), t)

    def note_health(self, node: str, outcome: Outcome, t: float, reason: str = "", probe: bool = False) -> None:
        if outcome == "ok" and not self.watch:
            return  # nothing is ever out: an answer changes nothing
        ch = self.books.note_health(node, outcome, t, reason, probe)
        if ch is not None:
            self.write_decision(t, [health_line(ch)])
