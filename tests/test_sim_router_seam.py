"""The simulated router's seam: what it is given (the clock, the network, the instances, what the
router's calls meet at each instance, where decisions and closed requests go) is all it uses, so
a request's path reads through fakes of the instances; `Reach` keeps the instances' processes
and the way to them; a simulated attempt's stamps carry their record names."""

from __future__ import annotations

import math
from typing import Any, cast

import pytest

from testbed.core.lifecycle import Event
from testbed.core.record import FIELD_TYPES, TIME_NAMES
from testbed.core.schema.scaling import Scale
from testbed.core.schema.topology import node_specs
from testbed.metrics.series_format import RawSample
from testbed.run.load import load
from testbed.sim.decode import DecodeSim
from testbed.sim.events import ARRIVAL, KV_ARRIVAL, EventLoop
from testbed.sim.net_view import Net
from testbed.sim.prefill import PrefillSim
from testbed.sim.reach import Reach
from testbed.sim.request import SimRequest
from testbed.sim.router import SimRouter
from testbed.sim.wan import rto_instant
from testbed.traces.types import TraceRequest

pytestmark = pytest.mark.pure


class _Path:
    delay = 0.25


class _Net:
    """The network as the router and `Reach` use it without faults: KV marks and the WAN."""

    def __init__(self) -> None:
        self.marks: list[tuple[Any, Any, float]] = []  # (callback, its argument, byte position)
        self.dark_pairs: set[tuple[str, str]] = set()
        self.wan = {("dc-a", "dc-b"): _Path(), ("dc-b", "dc-a"): _Path()}

    def mark(self, path: Any, pos: float, fn: Any, arg: Any) -> None:
        self.marks.append((fn, arg, pos))

    def dark(self, a: str, b: str) -> bool:
        return (a, b) in self.dark_pairs


class _Prefill:
    def __init__(self) -> None:
        self.got: list[tuple[SimRequest, float]] = []

    def submit(self, req: SimRequest, t: float) -> None:
        req.prefill_queued = t
        req.life.apply(Event.ENQUEUE_PREFILL, t)
        self.got.append((req, t))


class _Decode:
    def __init__(self) -> None:
        self.got: list[tuple[SimRequest, float]] = []

    def kv_arrived(self, req: SimRequest, t: float) -> None:
        self.got.append((req, t))


def test_a_request_goes_arrive_route_prefill_transfer_decode_close_through_fakes() -> None:
    rs = load("paper-homogeneous")
    nodes = node_specs(rs.spec)
    loop = EventLoop()
    net = _Net()
    prefill = {n.id: _Prefill() for n in nodes if n.role == "prefill"}
    decode = {n.id: _Decode() for n in nodes if n.role == "decode"}
    reach = Reach(loop, cast(Net, net), {n.id: n.datacenter for n in nodes}, nodes[0].datacenter, rs.scale.speedup)
    lines: list[tuple[float, list[RawSample]]] = []
    closed: list[tuple[SimRequest, float]] = []
    router = SimRouter(
        rs,
        rs.live_path,
        loop,
        cast(Net, net),
        cast(dict[str, PrefillSim], prefill),
        cast(dict[str, DecodeSim], decode),
        reach,
        lambda t, samples: lines.append((t, samples)),
        True,
        lambda req, t: closed.append((req, t)),
    )

    tr = TraceRequest("r0", 0.0, 4000, 8)
    loop.at(1.0, ARRIVAL, lambda _: router.arrive(0, tr, loop.now))  # routed and dispatched at once
    loop.run(until=1.0)  # (its deadline, minutes on, is armed too)
    [(req, queued)] = [g for p in prefill.values() for g in p.got]
    assert queued == 1.0 and req.routed == 1.0 and req.plan is not None
    assert req.plan.d.prefill_node in prefill and [s[0][2]["request_id"] for _, s in lines] == ["r0"]

    # The prefill computes and hands its KV to the path; the decode node holds it a delay later.
    for ev, t in ((Event.START_PREFILL, 1.5), (Event.TRANSFER_START, 1.5), (Event.END_PREFILL, 2.0)):
        req.life.apply(ev, t)
    req.prefill_start, req.transfer_start, req.prefill_end = 1.5, 1.5, 2.0
    router.transfer_handed(req, _Path(), 123.0)
    [(sent, arg, pos)] = net.marks
    assert pos == 123.0
    loop.at(2.0, KV_ARRIVAL, lambda _: sent(arg, loop.now))  # its last byte is sent at 2.0
    loop.run(until=2.25)
    assert decode[req.plan.d.decode_node].got == [(req, 2.25)] and req.transfer_end == 2.25
    assert req.prefill_seen and not closed  # the prefill's answer is in: the decode runs

    req.life.apply(Event.ADMIT, 2.25)
    req.decode_admitted, req.decode_first_token, req.decode_last_token = 2.25, 2.5, 3.0
    loop.at(3.0, KV_ARRIVAL, lambda _: router.finished(req, loop.now))
    loop.run()  # its deadline's sweep finds it closed
    assert closed == [(req, 3.0)] and req.outcome == "completed" and not router.active
    assert router.books.inflight == 0 and not router.current
    rec = req.record(rs.scale)
    s = rs.scale.speedup
    assert rec.times.transfer_end * s == 2.25 and rec.times.last_token * s == 3.0 and rec.outcome == "completed"


def test_reach_holds_what_waits_for_a_paused_instance_or_a_dark_link() -> None:
    loop = EventLoop()
    net = _Net()
    reach = Reach(loop, cast(Net, net), {"a0": "dc-a", "b0": "dc-b"}, "dc-a", 4.0)
    assert reach.http_delay("a0") == 0.0 and reach.http_delay("b0") == 0.25
    ran: list[str] = []
    reach.life["b0"] = "paused"
    assert not reach.answers("b0")
    reach.when_resumed("b0", lambda _: ran.append("resumed"))
    reach.life["b0"] = "up"
    reach.resumed("b0")
    reach.resumed("b0")  # once
    assert ran == ["resumed"]

    reach.when_resumed("a0", lambda _: ran.append("never"))
    reach.killed("a0")
    assert reach.life["a0"] == "down"
    reach.life["a0"] = "up"
    reach.resumed("a0")
    assert ran == ["resumed"]  # a killed instance's waiters are dropped

    net.dark_pairs.add(("dc-a", "dc-b"))
    assert not reach.reachable("b0") and reach.reachable("a0")
    reach.when_reachable("b0", lambda _: ran.append(f"through at {loop.now}"))
    reach.links_back(5.0)  # still dark: nothing goes
    loop.run()
    assert ran == ["resumed"]
    net.dark_pairs.clear()
    reach.links_back(5.0)
    loop.run()
    assert ran == ["resumed", f"through at {rto_instant(0.0, 5.0, 0.5, 4.0)}"]


def test_a_simulated_attempt_names_its_stamps_as_the_record_does() -> None:
    # Its attributes as an instance has them: a compiled class (`testbed.compiled`) has no __slots__.
    attempt = SimRequest(0, TraceRequest("r", 0.0, 10, 2), 0.0)
    stamps = {n for n in TIME_NAMES if hasattr(attempt, n)}
    assert stamps == {
        "arrival",
        "routed",
        "prefill_queued",
        "prefill_start",
        "prefill_end",
        "transfer_start",
        "transfer_end",
        "decode_admitted",
        "decode_first_token",
        "decode_last_token",
        "cache_move_start",
        "cache_move_end",
    }
    moved = {"prefill_modelled", "kv_bytes_paper", "kv_bytes_wire", "cache_move_bytes_wire"}
    assert moved <= {n for n in FIELD_TYPES if hasattr(attempt, n)}
    # Each stamp reaches the record under its own name, in wire seconds.
    req = SimRequest(3, TraceRequest("r3", 0.0, 1000, 4), 8.0, relay=(0.5, 1.0))
    copied = sorted(stamps - {"arrival", "cache_move_start", "cache_move_end"})  # the move's need a plan
    for i, n in enumerate(copied):
        setattr(req, n, 10.0 + 2.0 * i)
    req.prefill_modelled, req.kv_bytes_paper, req.kv_bytes_wire = 6.0, 4096, 16
    rec = req.record(Scale(speedup=2.0))
    for i, n in enumerate(copied):
        assert getattr(rec.times, n) == (10.0 + 2.0 * i) / 2.0, n
    assert rec.times.arrival == rec.times.router_arrival == 4.0
    assert rec.times.first_token == (req.decode_first_token + 0.5) / 2.0
    assert rec.times.last_token == (req.decode_last_token + 1.0) / 2.0
    assert (rec.prefill_modelled, rec.kv_bytes_paper, rec.kv_bytes_wire) == (3.0, 4096, 16)
    assert math.isnan(rec.times.cache_move_start)
