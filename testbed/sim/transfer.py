"""How a prefill's KV reaches its decode node in virtual time, per the nodes' PD protocol
(`nodes.protocol`), as the mock nodes run each one (`testbed.live.prefill_node`,
`testbed.live.vllm_pd`, `testbed.live.sglang_pd`):

- `testbed`, layer-wise push: the router opens the decode stream and calls the prefill node,
  which streams each layer's KV to the decode node as it is computed (`testbed.sim.prefill`);
  only the last layer is left when its compute ends.
- `vllm`, pull after the prefill: the prefill node computes, holds the KV and answers the
  router; the router sends the request on to the decode node, which asks the prefill node for
  the KV (a pull: one HTTP call back to it), and only then does the prefill node hand all of it
  to its KV transport at once. The transfer starts when the pull reaches the prefill node:
  its end plus the answer's way to the router, the router's call to the decode node and the
  pull's way to the prefill node.
- `sglang`, push arranged before: the router calls both nodes at once; the decode node
  registers with the prefill node's bootstrap service for the request's room, and the prefill
  node takes the request into its queue only once that registration has arrived; from there it
  computes and pushes layer by layer, as `testbed`.

What each message costs: the network's one-way delay between its two ends (the KV path's
delay, which is the same both ways; the router sits in the decode cluster's datacenter), a
round trip more where it opens a connection (`Connections`: the first contact of a pair, or
after its keep-alive connection was closed idle), and, with the live path's costs, host
time: one HTTP hop each for the pull's three calls
(`SimRouter.hop`), the dispatch cost for the registration's two (`dispatch_s`). The router's
first call to the prefill node stays as for every protocol (its WAN delay with the live path's
costs only, `testbed.sim.router`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from testbed.config.resolved import ResolvedScenario
from testbed.core.errors import UserError
from testbed.core.lifecycle import Event
from testbed.core.schema.scenario import Scenario
from testbed.sim.events import KV_ARRIVAL, Loop
from testbed.sim.net_view import Net
from testbed.sim.net_view import PathHandle as NetPath
from testbed.sim.reach import Reach
from testbed.sim.request import SimRequest
from testbed.sim.tcp import TcpModel

NodeProtocol = Literal["testbed", "vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class KvDiscipline:
    protocol: NodeProtocol = "testbed"

    @classmethod
    def for_scenario(cls, sc: Scenario) -> KvDiscipline:
        """The scenario's (`nodes.protocol`); a UserError for what the simulator does not model."""
        d = cls.of(sc.node_protocol)
        if sc.faults and d.protocol != "testbed":
            raise UserError(
                f"scenario {sc.name!r}: faults with nodes.protocol {d.protocol!r}: the simulator models "
                "faults for the testbed's protocol only so far (a pull or a registration meeting a fault is not)"
            )
        return d

    @classmethod
    def of(cls, protocol: str) -> KvDiscipline:
        if protocol not in ("testbed", "vllm", "sglang"):
            raise ValueError(f"unknown node protocol {protocol!r}")
        return cls(protocol)  # type: ignore[arg-type]

    @property
    def layerwise(self) -> bool:
        """The KV streams to the decode node while the prefill computes."""
        return self.protocol != "vllm"

    @property
    def bootstrap(self) -> bool:
        """The prefill waits for the decode node's registration before it queues the request."""
        return self.protocol == "sglang"


# Wire seconds aiohttp's client keeps an idle keep-alive connection (TCPConnector's default
# keepalive_timeout): the decode node's session to the prefill nodes (the pull, the registration).
HTTP_KEEPALIVE_S = 15.0


INITIAL_WINDOW_SEGMENTS = 10  # Linux's initial congestion window (RFC 6928)


def slow_start(nbytes: float, conns: int, cwnd: float, window: float, rtt: float) -> tuple[float, float]:
    """A transfer of `nbytes` striped over `conns` connections whose congestion windows are `cwnd`
    bytes, doubling each round trip up to `window`: how long after its start its last byte can
    leave (the link's rate aside: the network model has it), and the windows then."""
    c = min(cwnd, window)
    sent, rounds = conns * c, 0
    while sent < nbytes:
        rounds += 1
        c = min(2.0 * c, window)
        sent += conns * c
    return rounds * rtt, c


@dataclass(frozen=True, slots=True)
class TcpStart:
    """What a transfer on the KV transport's connections starts from (paper bytes and seconds)."""

    initial: float  # the initial congestion window
    window: float  # the most a connection has in flight (its socket buffers)
    connections: int  # the transport's connections per destination
    chunk: float  # a chunk goes to one connection: a transfer of n chunks uses at most n

    @classmethod
    def of(cls, rs: ResolvedScenario, crosses: bool) -> TcpStart:
        """For the WAN's paths (`crosses`) or the datacenter's, in the run's paper units."""
        profile = rs.inter_dc if crosses else rs.intra_dc
        transfer, b = rs.spec.transfer, rs.scale.byte_scale
        tcp = TcpModel.of(profile, transfer, b)
        return cls(
            INITIAL_WINDOW_SEGMENTS * tcp.mss_bytes,
            tcp.window_bytes,
            transfer.connections,
            transfer.chunk_bytes * b,
        )


class Connections:
    """The connections the engine protocols' node-to-node calls travel on, as the mock nodes keep
    them. A decode node's HTTP client keeps idle connections to each prefill node for `keepalive`
    (paper s) and reuses the one freed last: a call that finds none opens one, a TCP handshake (a
    round trip) before its request goes. A prefill node's KV transport opens its connections to a
    decode node at its first transfer there (a round trip before the first byte) and keeps them;
    a pulled KV goes at once onto them, so it pays their slow start from the initial window when
    they are new (the flow-level network has no slow start), and goes on from the window the last
    transfer left otherwise: the emulator's connections were measured to keep it across idle gaps
    (netns, vllm-router: a pull after 3.3 s idle took no longer than one after 0.3 s), though
    Linux's slow start after idle would restart it. Layer-wise push (`testbed`, `sglang`) is charged
    neither: its first layers' trickle opens and grows the connections while the prefill computes."""

    __slots__ = ("keepalive", "idle", "kv_up", "kv_cwnd")

    def __init__(self, keepalive: float) -> None:
        self.keepalive = keepalive
        self.idle: dict[tuple[str, str], list[float]] = {}  # per (client, server): when each idle one was freed
        self.kv_up: dict[tuple[str, str], float] = {}  # per (sender, receiver): when its connections are open
        self.kv_cwnd: dict[tuple[str, str], float] = {}  # their congestion window after the last transfer

    def reuse(self, client: str, server: str, t: float) -> bool:
        """A call from `client` to `server` at `t` takes an idle connection (True) or opens one."""
        idle = self.idle.get((client, server))
        if not idle:
            return False
        free = [x for x in idle if t - self.keepalive <= x]  # the others were closed idle
        for i in range(len(free) - 1, -1, -1):
            if free[i] <= t:
                del free[i]
                self.idle[(client, server)] = free
                return True
        self.idle[(client, server)] = free
        return False

    def free(self, client: str, server: str, t: float) -> None:
        """A call's connection is idle again from `t` (its answer is back)."""
        self.idle.setdefault((client, server), []).append(t)

    def kv_send(self, pair: tuple[str, str], t: float, nbytes: float, tcp: TcpStart, rtt: float) -> tuple[float, float]:
        """A held KV of `nbytes` handed to the transport at `t` (striped over as many connections as
        it has chunks, up to the transport's): when its first byte can go (the connections open),
        and the earliest its last byte can."""
        up = self.kv_up.get(pair)
        if up is None:
            up = self.kv_up[pair] = t + rtt
        cwnd = self.kv_cwnd.get(pair, tcp.initial)
        first = max(t, up)
        conns = max(1, min(tcp.connections, math.ceil(nbytes / tcp.chunk - 1e-9))) if tcp.chunk > 0 else tcp.connections
        span, self.kv_cwnd[pair] = slow_start(nbytes, conns, cwnd, tcp.window, rtt)
        return first, first + span


def pull_sent(end: float, to_router: float, to_decode: float, hop: float) -> float:
    """When a vLLM-style decode node sends its pull: the prefill ended at `end`, its answer crossed
    to the router (`to_router`) and the router called the decode node (`to_decode`), two HTTP hops
    of `hop` host time."""
    return end + to_router + to_decode + 2.0 * hop


def call_arrives(sent: float, way: float, reused: bool, hop: float = 0.0) -> float:
    """When a call sent at `sent` across a one-way delay `way` reaches its server: a new connection
    first takes a round trip (its handshake); `hop`: the call's host time."""
    return sent + (0.0 if reused else 2.0 * way) + way + hop


class EngineTransfers:
    """The engine protocols' node-to-node steps for the router (`testbed.sim.router`): SGLang's
    registration before the prefill queues, vLLM's answer, second hop and pull after it ends.
    `answered(req)`: the prefill's answer is at the router; `sent((req, path), t)`: the KV's last
    byte left the prefill node at `t` (the router takes it from there as for any KV)."""

    def __init__(
        self,
        rs: ResolvedScenario,
        loop: Loop,
        net: Net,
        reach: Reach,
        hop: float,
        answered: Callable[[SimRequest], None],
        sent: Callable[[tuple[SimRequest, NetPath], float], None],
    ) -> None:
        self.loop, self.net, self.reach, self.hop = loop, net, reach, hop
        self.answered, self.sent = answered, sent
        self.byte_scale = rs.scale.byte_scale
        self.conns = Connections(HTTP_KEEPALIVE_S * rs.scale.speedup)
        self.tcp = {crosses: TcpStart.of(rs, crosses) for crosses in (False, True)}

    def register(self, decode: str, prefill: str, t: float) -> float:
        """SGLang: the decode node registers with the prefill node's bootstrap service at `t`;
        returns when the registration is there (its answer frees the connection a way later)."""
        way = self.net.path(prefill, decode).delay
        there = call_arrives(t, way, self.conns.reuse(decode, prefill, t))
        self.conns.free(decode, prefill, there + way)
        return there

    def held(self, req: SimRequest, path: NetPath, t: float) -> None:
        """vLLM: the prefill ended at `t` holding its KV. Its answer goes to the router, which sends
        the request on to the decode node, which pulls the KV from the prefill node."""
        assert req.plan is not None
        d = req.plan.d
        back = self.reach.http_delay(d.prefill_node)
        self.loop.at(t + back + self.hop, KV_ARRIVAL, self.answered, req)
        self.loop.at(
            pull_sent(t, back, self.reach.http_delay(d.decode_node), self.hop), KV_ARRIVAL, self._pull, (req, path)
        )

    def _pull(self, arg: tuple[SimRequest, NetPath]) -> None:
        req, path = arg
        if req.gone:
            return
        assert req.plan is not None
        d = req.plan.d
        t = self.loop.now
        there = call_arrives(t, path.delay, self.conns.reuse(d.decode_node, d.prefill_node, t), self.hop)
        self.loop.at(there, KV_ARRIVAL, self._pulled, (req, path))

    def _pulled(self, arg: tuple[SimRequest, NetPath]) -> None:
        """The pull is at the prefill node: the transfer starts; its transport sends the whole KV
        once its connections to the decode node are open."""
        req, path = arg
        if req.gone:
            return
        assert req.plan is not None
        d = req.plan.d
        t = self.loop.now
        req.transfer_start = t
        req.life.apply(Event.TRANSFER_START, t)
        pair = (d.prefill_node, d.decode_node)
        dc = self.reach.node_dc
        tcp = self.tcp[dc[pair[0]] != dc[pair[1]]]
        first, last = self.conns.kv_send(pair, t, req.kv_bytes_wire * self.byte_scale, tcp, 2.0 * path.delay)
        if first > t:
            self.loop.at(first, KV_ARRIVAL, self._push, (req, path, last))
        else:
            self._push((req, path, last))

    def _push(self, arg: tuple[SimRequest, NetPath, float]) -> None:
        req, path, last = arg
        if req.gone:
            return
        net = self.net
        lo = net.position(path)
        nbytes = req.kv_bytes_wire * self.byte_scale
        req.kv_range = (lo, lo + nbytes)
        net.push(path, self.loop.now, nbytes)
        net.mark(path, lo + nbytes, self._sent, (req, path, last))

    def _sent(self, arg: tuple[SimRequest, NetPath, float], t: float) -> None:
        """The pulled KV's last byte has left at `t` as the network has it, or later as slow start
        lets it (`last`). The pull is answered then: its connection is free a way later."""
        req, path, last = arg
        t = max(t, last)
        assert req.plan is not None
        d = req.plan.d
        self.conns.free(d.decode_node, d.prefill_node, t + path.delay)
        self.sent((req, path), t)
