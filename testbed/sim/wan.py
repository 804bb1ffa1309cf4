"""What faults on the WAN do to the KV transport's connections, in virtual time.

The flow-level network (`testbed.sim.network`) carries nothing on a dark link (an outage or a
partition: every packet lost) and everything again once it is back. Real connections are slower
to notice, and the emulator's runs show it; each sender -> receiver pair across the WAN keeps a
`Conns`, what its connections are doing:

- stalled: its data met a dark link. TCP retransmits on its timer, doubling each time (RTO =
  the round trip + 200 ms, Linux's minimum, in wire seconds), so the data goes again at the
  first retransmission after the link is back, not at once;
- lost: the connections are gone, reset by a middlebox (`tcp_reset`) or declared lost by the
  sender after `ack_timeout` wire seconds without an acknowledgment. The sender dials again:
  each dial sends SYNs at 0, 1, 3 and 7 wire seconds and gives up at its connect timeout
  (10 s), then backs off (50 ms doubling to 1 s) and dials again; the data goes a round trip
  after the first SYN that finds the link up. What was in flight is sent again (counted as
  resent bytes; a connection loss as a resume). A pair that has not got through within
  `resume_timeout` wire seconds of the loss fails its transfers, and one whose progress losses
  interrupted more than `max_resumes` times fails them too (`testbed.core.kv.kv_send`'s budget).

A `tcp_reset` window resets the connections of the pairs carrying KV across the WAN when it
opens and those that start carrying it while it lasts (the injector resets what it sees), up to
`count` connections; a connection re-established while the window lasts and the link is up is
reset again.

All times here are paper seconds; `wire_s` is paper seconds per wire second (the speedup).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from testbed.core.json_types import JSONObject
from testbed.core.kv.kv_send import ACK_TIMEOUT_S, MAX_RESUMES
from testbed.sim.events import LINK_CHANGE, Loop

IDLE = 0  # a path state (testbed.sim.network)


class Link(Protocol):
    @property
    def loss(self) -> float: ...


class Path(Protocol):
    """What this module reads of a `testbed.sim.net_links.Path`."""

    @property
    def src(self) -> str: ...
    @property
    def dst(self) -> str: ...
    @property
    def crosses(self) -> bool: ...
    @property
    def links(self) -> Sequence[Link]: ...
    @property
    def state(self) -> int: ...
    @property
    def k(self) -> int: ...
    @property
    def conns(self) -> int: ...
    @property
    def rate(self) -> float: ...
    @property
    def delay(self) -> float: ...


class Network(Protocol):
    """What this module needs of `testbed.sim.network.Network`."""

    faulted: bool

    @property
    def loop(self) -> Loop: ...
    @property
    def paths(self) -> Mapping[tuple[str, str], Path]: ...
    def resend(self, src: str, dst: str, t: float, nbytes: float) -> None: ...
    def unacked(self, src: str, dst: str) -> float: ...
    def socket_bytes(self, src: str, dst: str) -> float: ...
    def regate(self, src: str, dst: str, t: float) -> None: ...
    def wan_link(self, src: str, dst: str) -> Link | None: ...
    def route_delay(self, src: str, dst: str) -> float: ...


RTO_MIN_S = 0.2  # Linux's minimum retransmission timeout (wire s)
RTO_MAX_S = 120.0
SYN_AT_S = (0.0, 1.0, 3.0, 7.0)  # SYNs of one dial, wire s after it began (initial SYN RTO 1 s)
CONNECT_TIMEOUT_S = 10.0  # the KV sender's dial gives up (testbed.live.kv_sender.KVSender)
DIAL_BACKOFF_S = (0.05, 1.0)  # between dials that got nothing through: from, doubling up to


@dataclass
class Conns:
    """The KV connections of one sender -> receiver pair across the WAN."""

    stall: float | None = None  # its data has waited on a dark link since
    lost: float | None = None  # its connections were lost then: it is dialing
    gate: float = 0.0  # nothing gets through before this
    inflight: float = 0.0  # paper bytes in flight when it stalled (resent after a loss)
    interrupted: int = 0  # losses that interrupted its progress (since it last went idle)
    version: int = 0  # of its timers


def rto_instant(stall: float, up: float, rtt: float, wire_s: float) -> float:
    """When a connection whose data stalled at `stall` retransmits after its link is back at `up`."""
    rto = RTO_MIN_S * wire_s + rtt
    t, k = stall + rto, 1
    while t < up:
        k += 1
        t += min(rto * 2 ** (k - 1), RTO_MAX_S * wire_s)
    return t


def dial_instant(lost: float, up: float, rtt: float, wire_s: float) -> float:
    """When a pair that lost its connections at `lost` has one again, its link being back at `up`
    (the handshake's round trip included)."""
    d = lost
    backoff = DIAL_BACKOFF_S[0]
    while True:
        for at in SYN_AT_S:
            s = d + at * wire_s
            if s >= up:
                return s + rtt
        d += (CONNECT_TIMEOUT_S + backoff) * wire_s
        backoff = min(2 * backoff, DIAL_BACKOFF_S[1])


class ResetWindow:
    """A `tcp_reset` fault's window: which pairs it reset, for `faults.jsonl`."""

    def __init__(self, index: int, start: float, end: float, count: int | None) -> None:
        self.index = index
        self.start, self.end = start, end
        self.left = count  # connections still to reset (None: all)
        self.seen: set[tuple[str, str]] = set()
        self.connections = 0  # connections reset
        self.resets = 0  # losses caused (a pair re-established in the window is reset again)

    def open(self, t: float) -> bool:
        return self.start <= t < self.end

    def summary(self) -> JSONObject:
        return {
            "pairs_seen": len(self.seen),
            "connections_targeted": self.connections,
            "connections_seen": self.connections,
            "connection_losses": self.resets,
            "modelled": True,
        }


FailFn = Callable[[str, str, str, float], None]


class WanFaults:
    """The `Conns` of every pair that met a fault, the reset windows, and the senders' counters
    of what losses cost (resumes, bytes resent, transfers failed), for the node samples."""

    def __init__(self, net: Network, wire_s: float, resume_timeout_wire: float, nodes: list[str]) -> None:
        self.net = net
        self.wire_s = wire_s
        self.resume_timeout = resume_timeout_wire * wire_s
        self.conns: dict[tuple[str, str], Conns] = {}
        self.windows: list[ResetWindow] = []
        self.resumes = dict.fromkeys(nodes, 0)
        self.resent = dict.fromkeys(nodes, 0.0)  # paper bytes
        self.failed = dict.fromkeys(nodes, 0)
        self.on_fail: FailFn = lambda src, dst, reason, t: None
        self.busy: Callable[[], bool] = lambda: True  # requests still open: timers keep running

    # -- what the network asks -------------------------------------------------------------------

    def gate(self, src: str, dst: str) -> float:
        c = self.conns.get((src, dst))
        return c.gate if c is not None else 0.0

    def _conn(self, p: Path) -> Conns:
        c = self.conns.get((p.src, p.dst))
        if c is None:
            c = self.conns[(p.src, p.dst)] = Conns()
        return c

    def _wan(self, p: Path) -> Link | None:
        return p.links[1] if p.crosses else None

    def touch(self, p: Path, t: float) -> None:
        """KV entered a path across the WAN: on a dark link it stalls; in a reset window its
        established connections are reset."""
        lk = self._wan(p)
        if lk is None:
            return
        c = self.conns.get((p.src, p.dst))
        if lk.loss >= 1.0 and (c is None or (c.stall is None and c.lost is None)):
            self._stall(p, t)
            c = self.conns[(p.src, p.dst)]
        if self.windows and (c is None or (c.lost is None and c.gate <= t)):
            for w in self.windows:
                if w.open(t):
                    self._reset(p, t, w)
                    break

    def went_dark(self, lk: Link, t: float) -> None:
        for p in list(self.net.paths.values()):
            if p.crosses and p.links[1] is lk and p.state != IDLE:
                c = self.conns.get((p.src, p.dst))
                if c is None or (c.stall is None and c.lost is None):
                    self._stall(p, t)

    def came_back(self, lk: Link, t: float) -> None:
        for (src, dst), c in self.conns.items():
            if self.net.wan_link(src, dst) is not lk:
                continue
            rtt = 2.0 * self.net.route_delay(src, dst)
            if c.lost is not None:
                c.gate = dial_instant(c.lost, t, rtt, self.wire_s)
            elif c.stall is not None:
                c.gate = rto_instant(c.stall, t, rtt, self.wire_s)
                c.stall = None
            else:
                continue
            self._arm_gate(src, dst, c)

    # -- losses ----------------------------------------------------------------------------------

    def _stall(self, p: Path, t: float) -> None:
        c = self._conn(p)
        c.stall = t
        c.inflight = p.rate * 2.0 * p.delay
        c.version += 1
        self.net.loop.at(t + ACK_TIMEOUT_S * self.wire_s, LINK_CHANGE, self._ack_timeout, ((p.src, p.dst), c.version))

    def _ack_timeout(self, arg: tuple[tuple[str, str], int]) -> None:
        pair, version = arg
        c = self.conns[pair]
        if c.version != version or c.stall is None:
            return
        self._lose(pair, c, self.net.loop.now, f"no acknowledgment for {ACK_TIMEOUT_S:g} s")

    def _reset(self, p: Path, t: float, w: ResetWindow) -> None:
        if w.left is not None and w.left <= 0:
            return
        k = p.conns  # a pair's chunks stripe over all its connections: each one carries
        if w.left is not None:
            w.left -= k
        w.seen.add((p.src, p.dst))
        w.connections += k
        w.resets += 1
        c = self._conn(p)
        if c.stall is None and c.lost is None:
            c.inflight = p.rate * 2.0 * p.delay
        self._lose((p.src, p.dst), c, t, "the connection was reset (tcp_reset fault)", k)

    def _lose(self, pair: tuple[str, str], c: Conns, t: float, reason: str, k: int = 1) -> None:
        """The pair's connections are gone: what was in flight goes again, it dials."""
        src, dst = pair
        p = self.net.paths.get(pair)
        if p is not None and p.state != IDLE:
            k = max(k, p.conns)
        c.lost, c.stall = t, None
        c.interrupted += 1
        c.version += 1
        self.resumes[src] += k
        # Resent: what was in flight, and what the sockets held unacknowledged (sent once here: in
        # the fluid those bytes had not left yet).
        self.resent[src] += c.inflight + min(self.net.unacked(src, dst), k * self.net.socket_bytes(src, dst))
        if c.inflight > 0:
            self.net.resend(src, dst, t, c.inflight)
            c.inflight = 0.0
        if c.interrupted > MAX_RESUMES:
            c.interrupted = 0
            self._fail(pair, f"{reason} (progress interrupted {MAX_RESUMES + 1} times: giving up)", t)
        self.net.loop.at(t + self.resume_timeout, LINK_CHANGE, self._resume_timeout, (pair, c.version, reason))
        lk = self.net.wan_link(src, dst)
        if lk is not None and lk.loss < 1.0:
            c.gate = dial_instant(t, t, 2.0 * self.net.route_delay(src, dst), self.wire_s)
        else:
            c.gate = float("inf")  # until the link is back (`came_back`)
        self._arm_gate(src, dst, c)

    def _resume_timeout(self, arg: tuple[tuple[str, str], int, str]) -> None:
        pair, version, reason = arg
        c = self.conns[pair]
        t = self.net.loop.now
        if c.version != version or c.gate <= t:
            return
        self._fail(pair, f"{reason} (not resumed within {self.resume_timeout / self.wire_s:g} s)", t)
        c.version += 1
        if self.busy() and self.net.unacked(*pair) > 0:
            # Transfers that came after the failed ones wait on the same dialing pair: their budget.
            self.net.loop.at(t + self.resume_timeout, LINK_CHANGE, self._resume_timeout, (pair, c.version, reason))

    def _fail(self, pair: tuple[str, str], reason: str, t: float) -> None:
        self.failed[pair[0]] += 1
        self.on_fail(pair[0], pair[1], reason, t)

    def _arm_gate(self, src: str, dst: str, c: Conns) -> None:
        t = self.net.loop.now
        self.net.regate(src, dst, t)
        if t < c.gate < float("inf"):
            self.net.loop.at(c.gate, LINK_CHANGE, self._open, ((src, dst), c.version))

    def _open(self, arg: tuple[tuple[str, str], int]) -> None:
        pair, version = arg
        c = self.conns[pair]
        if c.version != version:
            return
        t = self.net.loop.now
        c.lost = None
        c.version += 1
        self.net.regate(pair[0], pair[1], t)
        p = self.net.paths.get(pair)
        if p is None or p.state == IDLE:
            c.interrupted = 0
        elif self.windows:
            # Re-established inside a reset window: the injector sees it again.
            for w in self.windows:
                if w.open(t):
                    self._reset(p, t, w)
                    break

    # -- reset windows ----------------------------------------------------------------------------

    def open_window(self, index: int, start: float, end: float, count: int | None) -> ResetWindow:
        w = ResetWindow(index, start, end, count)
        self.windows.append(w)
        self.net.faulted = True
        t = self.net.loop.now
        for p in list(self.net.paths.values()):
            if p.crosses and p.state != IDLE:
                self._reset(p, t, w)
        return w

    def close_window(self, w: ResetWindow) -> JSONObject:
        if w in self.windows:
            self.windows.remove(w)
        return w.summary()
