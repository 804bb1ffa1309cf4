"""The flow-level network: links, paths and a fluid of KV bytes, with max-min fair sharing.

Links. Every node has a NIC in each direction (`nic-out:<node>`, `nic-in:<node>`) at the
intra-DC profile's rate and half its delay; each ordered pair of datacenters has a WAN link
(`<dc>-><dc>`) with the inter-DC profile's rate, delay and loss. Each profile's schedule of
changes applies at its times (the inter-DC one to every WAN link, as the emulator changes both
directions). A link carries payload at rate x MSS/MTU x (1 - loss) (`testbed.sim.tcp`); jitter
is not modelled.

Paths. A sender node keeps one path per destination node, as the KV transport keeps one set
of `transfer.connections` TCP connections per destination: a FIFO of bytes that crosses the
sender's NIC, the WAN link when the two nodes are in different datacenters, and the
receiver's NIC. Bytes enter a path as a steady stream (`stream`: the KV a prefill produces
layer after layer, see `testbed.sim.prefill`) or at once (`push`: the last layer, a cache move).

Sharing. A path is idle, limited (nothing queued: it sends exactly what streams in) or greedy
(bytes queued: it sends as fast as it may). A greedy path uses k = ceil(queued / chunk)
connections, at most `transfer.connections` (a chunk goes to one connection; the k is taken
when the path becomes greedy and grows with its queue), and each connection is capped by
`TcpModel.connection_rate` (window per round trip, loss). Rates are weighted max-min fair per
connection: limited paths get their stream's rate while it is below their fair share, and the
greedy ones share what is left by progressive filling. A limited path whose stream exceeds its
share becomes greedy (its queue grows). Rates change only when a path changes state, a
stream starts or stops, or a link changes, so between those events every path's bytes are
linear in time and nothing is simulated: an event is due only when a queue empties, a byte
position someone waits for (`mark`) is reached, or a queue grows by a chunk.

Accounting. Each link and node has a byte counter integrated lazily (bytes so far at any time,
exact for the fluid): the simulator samples them into the same time series the live link
monitor and nodes write. Everything is in paper units (seconds, bytes); the time a path's last
byte leaves the sender plus the path's one-way delay is when the receiver holds it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

from testbed.core.fault_timeline import FaultEvent, faulted_links
from testbed.core.schema.linkprofile import LinkParams, LinkProfile
from testbed.core.schema.scaling import Scale
from testbed.core.schema.scenario import TransferSpec
from testbed.sim.events import LINK_CHANGE, NET, Loop
from testbed.sim.net_links import GREEDY, IDLE, LIMITED, Counter, Link, Mark, MarkFn, Path
from testbed.sim.tcp import TcpModel
from testbed.sim.wan import WanFaults

EPS_BYTES = 1.0  # a byte position within this is reached (float error on cumulative counts)
PAPER = Scale()  # link parameters in paper units (`LinkParams` are built for a scale)


class Network:
    def __init__(
        self,
        loop: Loop,
        node_dc: dict[str, str],
        intra: LinkProfile,
        inter: LinkProfile,
        transfer: TransferSpec,
        byte_scale: float,
        speedup: float = 1.0,
    ) -> None:
        self.loop = loop
        self.node_dc = node_dc
        self.transfer = transfer
        self.chunk = transfer.chunk_bytes * byte_scale
        self.intra_tcp = TcpModel.of(intra, transfer, byte_scale)
        self.inter_tcp = TcpModel.of(inter, transfer, byte_scale)
        self.inter = inter
        self.intra = intra
        self.nic_out = {n: Link(f"nic-out:{n}", "nic", intra, self.intra_tcp, 0.5) for n in node_dc}
        self.nic_in = {n: Link(f"nic-in:{n}", "nic", intra, self.intra_tcp, 0.5) for n in node_dc}
        dcs = list(dict.fromkeys(node_dc.values()))
        self.wan = {(a, b): Link(f"{a}->{b}", "wan", inter, self.inter_tcp) for a in dcs for b in dcs if a != b}
        self.sent = {n: Counter() for n in node_dc}  # bytes each node's sender put on the wire
        self.received = {n: Counter() for n in node_dc}
        self.paths: dict[tuple[str, str], Path] = {}
        # Paths come and go with their transfers; every NIC has the same parameters, so a path's
        # delay and per-connection rate depend only on its datacenters (until a link changes).
        self._route: dict[tuple[str, str], tuple[float, float]] = {}
        self.greedy: dict[Path, None] = {}  # insertion-ordered: a deterministic fill
        self.greedy_of: dict[str, dict[Path, None]] = {n: {} for n in node_dc}
        self._tokens = 0
        self._seq = 0
        self.rebalances = 0
        # Faults on the WAN: each direction's parameters from the profile and its schedule, the
        # link faults in force on top (`testbed.core.fault_timeline.faulted_links`), and what they do to
        # the transport's connections (`testbed.sim.wan`).
        self.wan_base = {pair: LinkParams.from_profile(inter, PAPER) for pair in self.wan}
        self.link_faults: list[FaultEvent] = []
        self.faults = WanFaults(self, speedup, transfer.resume_timeout_s, list(node_dc))
        self.faulted = False  # a fault has acted: the paths' hooks are on
        self.on_back: Callable[[float], None] = lambda t: None  # a dark WAN link is back

    # -- what the simulator samples ------------------------------------------------------------

    def sent_at(self, node: str, t: float) -> float:
        """Bytes the node's sender has put on the wire by `t`."""
        return self.sent[node].at(t)

    def sent_rate(self, node: str) -> float:
        return self.sent[node].rate

    def received_at(self, node: str, t: float) -> float:
        return self.received[node].at(t)

    def backlog(self, node: str, t: float) -> float:
        """Bytes queued at `t` on the node's greedy paths, summed in the order they became greedy
        (a plain running sum, as the compiled network adds them)."""
        total = 0.0
        for p in self.greedy_of[node]:
            total += p.queued(t)
        return total

    # -- topology --------------------------------------------------------------------------

    def path(self, src: str, dst: str) -> Path:
        p = self.paths.get((src, dst))
        if p is None:
            a, b = self.node_dc[src], self.node_dc[dst]
            crosses = a != b
            links = (
                (self.nic_out[src], self.wan[(a, b)], self.nic_in[dst])
                if crosses
                else (self.nic_out[src], self.nic_in[dst])
            )
            counters = tuple(lk.counter for lk in links) + (self.sent[src], self.received[dst])
            p = Path(
                src,
                dst,
                links,
                counters,
                self.transfer.connections,
                self.chunk,
                self.inter_tcp if crosses else self.intra_tcp,
                crosses,
                self._route.get((a, b)),
            )
            self._route[(a, b)] = (p.delay, p.conn_rate)
            p.t = self.loop.now
            self.paths[(src, dst)] = p
            if self.faulted and crosses:
                p.gate = self.faults.gate(src, dst)
                if p.gate > p.t:
                    p.conn_rate = 0.0
        return p

    def wan_link(self, src: str, dst: str) -> Link | None:
        a, b = self.node_dc[src], self.node_dc[dst]
        return self.wan.get((a, b)) if a != b else None

    def route_delay(self, src: str, dst: str) -> float:
        """One-way delay from `src` to `dst` with the links' parameters in force."""
        lk = self.wan_link(src, dst)
        return self.nic_out[src].delay + self.nic_in[dst].delay + (lk.delay if lk is not None else 0.0)

    def schedule_changes(self) -> None:
        """Apply each profile's schedule at its times: the inter-DC one to every WAN link, the
        intra-DC one to every NIC."""
        nics = list(self.nic_out.values()) + list(self.nic_in.values())
        for profile, links, share in ((self.inter, list(self.wan.values()), 1.0), (self.intra, nics, 0.5)):
            for c in profile.schedule:
                self.loop.at(c.at, LINK_CHANGE, self._apply_change, (c, links, share))

    def _apply_change(self, arg: tuple[Any, list[Link], float]) -> None:
        c, links, share = arg
        t = self.loop.now
        if links and links[0].kind == "wan":
            self.wan_base = {pair: p.with_change(c, self.inter, PAPER) for pair, p in self.wan_base.items()}
            self._set_wan(t)
            return
        for lk in links:
            if c.rate is not None:
                lk.rate_bps = c.rate
            if c.delay is not None:
                lk.delay = c.delay * share
            if c.loss is not None:
                lk.loss = c.loss
            lk.capacity = lk.tcp.link_payload(lk.rate_bps, lk.loss)
        self._route.clear()
        changed = set(links)
        for p in list(self.paths.values()):
            if changed.intersection(p.links):
                p._advance(t)
                self._refresh(p, t)
        self._rebalance(t, links, force=True)

    # -- faults ------------------------------------------------------------------------------

    def set_link_faults(self, active: list[FaultEvent]) -> None:
        """The link faults in force from now on (and no others)."""
        self.faulted = True
        self.link_faults = list(active)
        self._set_wan(self.loop.now)

    def _set_wan(self, t: float) -> None:
        eff = faulted_links(self.wan_base, self.link_faults)
        dark, back = [], []
        for pair, lk in self.wan.items():
            par = eff[pair]
            was = lk.loss >= 1.0
            lk.rate_bps, lk.delay, lk.loss, lk.loss_correlation = (
                par.rate_bps,
                par.delay_s,
                par.loss,
                par.loss_correlation,
            )
            lk.capacity = lk.tcp.link_payload(lk.rate_bps, lk.loss)
            if lk.loss >= 1.0 and not was:
                dark.append(lk)
            elif was and lk.loss < 1.0:
                back.append(lk)
        if dark or back:
            self.faulted = True
        for lk in dark:
            self.faults.went_dark(lk, t)  # before the rates drop: what was in flight
        self._route.clear()
        links = list(self.wan.values())
        for p in list(self.paths.values()):
            if p.crosses:
                p._advance(t)
                self._refresh(p, t)
        for lk in back:
            self.faults.came_back(lk, t)
        self._rebalance(t, links, force=True)
        if back:
            self.on_back(t)

    def dark(self, a: str, b: str) -> bool:
        """Nothing gets through between datacenters `a` and `b` (either way: a request needs both)."""
        if a == b:
            return False
        return self.wan[(a, b)].loss >= 1.0 or self.wan[(b, a)].loss >= 1.0

    def _refresh(self, p: Path, t: float) -> None:
        p.refresh()
        if p.gate > t:
            p.conn_rate = 0.0
        if p.state == LIMITED and p.inflow > p.conn_rate:
            self._to_greedy(p, t)
        elif p.state == GREEDY:
            if p.conn_rate <= 0.0 and not p.parked:
                self._park(p, t)
            elif p.conn_rate > 0.0 and p.parked:
                self._unpark(p, t)

    def _park(self, p: Path, t: float) -> None:
        """A greedy path that can carry nothing leaves the fill (the fill stays as cheap as the
        paths that do carry; an outage parks hundreds at scale)."""
        if p in self.greedy:
            del self.greedy[p]
            for lk in p.links:
                lk.greedy -= 1
        p.parked = True
        p.version += 1
        p.due = math.inf
        self._set_rate(p, t, 0.0)

    def _unpark(self, p: Path, t: float) -> None:
        p.parked = False
        p.k = self._k(p, t)
        self.greedy[p] = None
        for lk in p.links:
            lk.greedy += 1

    def regate(self, src: str, dst: str, t: float) -> None:
        """The pair's connections may carry from `faults.gate(src, dst)` on."""
        p = self.paths.get((src, dst))
        if p is None:
            return
        p._advance(t)
        p.gate = self.faults.gate(src, dst)
        self._refresh(p, t)
        self._rebalance(t, p.links, force=True)

    def resend(self, src: str, dst: str, t: float, nbytes: float) -> None:
        """What a lost connection had in flight goes again (no request waits on these bytes)."""
        p = self.paths.get((src, dst))
        if p is not None:
            self.push(p, t, nbytes)

    def unacked(self, src: str, dst: str) -> float:
        """Bytes queued on the pair's path now (not yet on the wire)."""
        p = self.paths.get((src, dst))
        return p.queued(self.loop.now) if p is not None else 0.0

    def socket_bytes(self, src: str, dst: str) -> float:
        """What one of the pair's connections' socket holds ahead of the wire."""
        return (self.inter_tcp if self.node_dc[src] != self.node_dc[dst] else self.intra_tcp).send_buffer

    def withdraw(self, p: Path, lo: float, hi: float) -> None:
        """The bytes at positions [lo, hi) of `p` not yet sent are dropped (their transfer was
        given up: the sender drops its queued chunks); later positions move down."""
        t = self.loop.now
        p._advance(t)
        lo = max(lo, p.sent)
        hi = min(hi, p.released)
        if hi <= lo:
            return
        gone = hi - lo
        p.released -= gone
        if p.marks:
            kept = []
            for mk in p.marks:
                if mk.pos <= lo:
                    kept.append(mk)
                elif mk.pos > hi:
                    kept.append(Mark(mk.pos - gone, mk.seq, mk.fn, mk.arg))
                else:
                    kept.append(Mark(lo, mk.seq, mk.fn, mk.arg))
            heapq.heapify(kept)
            p.marks = kept
        if p.state == GREEDY:
            if p.released - p.sent <= EPS_BYTES and p.inflow == 0:
                p.sent = p.released
                self._fire_marks(p, t)
                self._leave_greedy(p, t)
                self._rebalance(t, p.links, force=True)
            else:
                self._schedule(p, t)
        else:
            self._fire_marks(p, t)

    # -- bytes in --------------------------------------------------------------------------

    def stream(self, p: Path, t: float, rate: float) -> None:
        """Bytes enter `p` at `rate` from now on (0 stops the stream)."""
        p._advance(t)
        if self.faulted and p.crosses and rate > 0:
            self.faults.touch(p, t)
        if p.state == GREEDY:
            p.inflow = rate
            self._schedule(p, t)
            return
        old = p.inflow
        if p.state == LIMITED:
            for lk in p.links:
                lk.remove_limited(p)
            p.state = IDLE
        p.inflow = rate
        if rate <= 0:
            self._set_rate(p, t, 0.0)
            self._forget_if_idle(p)
        elif rate > p.conn_rate:
            self._set_rate(p, t, 0.0)
            self._to_greedy(p, t)
            self._rebalance(t, p.links, force=True)
            return
        else:
            p.state = LIMITED
            self._tokens += 1
            p.token = self._tokens
            for lk in p.links:
                lk.add_limited(p)
            self._set_rate(p, t, rate)
        if old != rate:
            self._rebalance(t, p.links)

    def push(self, p: Path, t: float, nbytes: float) -> None:
        """`nbytes` enter `p` at once."""
        p._advance(t)
        if self.faulted and p.crosses and nbytes > EPS_BYTES:
            self.faults.touch(p, t)
        p.released += nbytes
        if nbytes <= EPS_BYTES and p.state != GREEDY:
            p.sent = p.released
            self._fire_marks(p, t)
            return
        if p.state == GREEDY:
            k = self._k(p, t)
            if p.parked:
                p.k = k
            elif k != p.k:
                p.k = k
                self._rebalance(t, p.links, force=True)
            else:
                self._schedule(p, t)
            return
        self._to_greedy(p, t)
        self._rebalance(t, p.links, force=True)

    def end_stream(self, p: Path, t: float, nbytes: float) -> None:
        """The stream stops and its last `nbytes` enter at once (a prefill's last layer)."""
        p._advance(t)
        if self.faulted and p.crosses and nbytes > EPS_BYTES:
            self.faults.touch(p, t)
        if p.state == GREEDY:
            p.inflow = 0.0
            self.push(p, t, nbytes)
            return
        if p.state == LIMITED:
            for lk in p.links:
                lk.remove_limited(p)
            self._set_rate(p, t, 0.0)
        p.inflow = 0.0
        p.state = IDLE
        if nbytes <= EPS_BYTES:
            p.released += nbytes
            p.sent = p.released
            self._fire_marks(p, t)
            self._forget_if_idle(p)
            self._rebalance(t, p.links)
            return
        p.released += nbytes
        self._to_greedy(p, t)
        self._rebalance(t, p.links, force=True)

    def mark(self, p: Path, pos: float, fn: MarkFn, arg: Any) -> None:
        """Call `fn(arg, t)` at the time t the path's sender has sent `pos` bytes (cumulative)."""
        t = self.loop.now
        p._advance(t)
        if pos <= p.sent + EPS_BYTES:
            fn(arg, t)
            return
        self._seq += 1
        heapq.heappush(p.marks, Mark(pos, self._seq, fn, arg))
        if p.state == GREEDY and p.rate > 0 and t + (pos - p.sent) / p.rate < p.due:
            self._schedule(p, t)

    def position(self, p: Path) -> float:
        """Cumulative bytes that entered `p` (now): the position a new byte gets."""
        p._advance(self.loop.now)
        return p.released

    # -- internals ---------------------------------------------------------------------------

    def _advance(self, p: Path, t: float) -> None:
        p._advance(t)

    def _k(self, p: Path, t: float) -> int:
        q = p.released - p.sent
        return max(1, min(p.conns, math.ceil(q / p.chunk - 1e-9))) if self.chunk > 0 else p.conns

    def _to_greedy(self, p: Path, t: float) -> None:
        if p.state == LIMITED:
            for lk in p.links:
                lk.remove_limited(p)
        p.state = GREEDY
        p.k = self._k(p, t)
        self.greedy_of[p.src][p] = None
        if p.conn_rate <= 0.0:
            self._park(p, t)
            return
        self.greedy[p] = None
        for lk in p.links:
            lk.greedy += 1

    def _leave_greedy(self, p: Path, t: float) -> None:
        del self.greedy_of[p.src][p]
        if p.parked:
            p.parked = False
        else:
            del self.greedy[p]
            for lk in p.links:
                lk.greedy -= 1
        p.version += 1
        p.due = math.inf
        if p.inflow > 0 and p.inflow <= p.conn_rate:
            p.state = LIMITED
            self._tokens += 1
            p.token = self._tokens
            for lk in p.links:
                lk.add_limited(p)
            self._set_rate(p, t, p.inflow)
        else:
            p.state = IDLE
            self._set_rate(p, t, 0.0)
            self._forget_if_idle(p)

    def _forget_if_idle(self, p: Path) -> None:
        if p.state == IDLE and not p.marks and p.inflow == 0 and self.paths.get((p.src, p.dst)) is p:
            del self.paths[(p.src, p.dst)]

    def _set_rate(self, p: Path, t: float, rate: float) -> None:
        if rate != p.rate:
            d = rate - p.rate
            for c in p.counters:
                # `Counter.change`, inlined: a rate change touches four or five counters.
                c.acc += c.rate * (t - c.t)
                c.t = t
                c.rate += d
                if c.rate < 1e-6:
                    c.rate = 0.0
            p.rate = rate

    def _fire_marks(self, p: Path, t: float) -> None:
        m = p.marks
        while m and m[0].pos <= p.sent + EPS_BYTES:
            mk = heapq.heappop(m)
            mk.fn(mk.arg, t)

    def _schedule(self, p: Path, t: float) -> None:
        """The next event of a greedy path at its present rate."""
        p.version += 1
        if p.parked:
            p.due = math.inf
            return
        q = p.released - p.sent
        due = math.inf
        if p.rate > p.inflow:
            due = t + q / (p.rate - p.inflow)
        if p.marks and p.rate > 0:
            due = min(due, t + max(p.marks[0].pos - p.sent, 0.0) / p.rate)
        if p.inflow > p.rate and p.k < p.conns:
            # When the queue holds one chunk more than k connections carry (a byte past the boundary).
            due = min(due, t + max(p.k * p.chunk + 2 * EPS_BYTES - q, EPS_BYTES) / (p.inflow - p.rate))
        if due <= t:
            # Far into a run (days of virtual time) a step shorter than half the float spacing of
            # t rounds to t itself: the event would find nothing moved and schedule itself again,
            # forever. One spacing later the path always moves on.
            due = math.nextafter(t, math.inf)
        p.due = due
        if due < math.inf:
            self.loop.at(due, NET, self._due, (p, p.version))

    def _due(self, arg: tuple[Path, int]) -> None:
        p, version = arg
        if version != p.version or p.state != GREEDY:
            return
        t = self.loop.now
        p.due = math.inf
        p._advance(t)
        q = p.released - p.sent
        if q <= EPS_BYTES:
            p.sent = p.released
            self._fire_marks(p, t)
            self._leave_greedy(p, t)
            self._rebalance(t, p.links, force=True)
            return
        self._fire_marks(p, t)
        k = self._k(p, t)
        if k > p.k:
            p.k = k
            self._rebalance(t, p.links, force=True)
        else:
            self._schedule(p, t)

    def _rebalance(self, t: float, touched: Sequence[Link], force: bool = False) -> None:
        """Max-min rates for the greedy paths; limited paths whose stream no longer fits their
        share become greedy. Skipped when nothing greedy shares a touched link and no touched
        link is oversubscribed."""
        if not force:
            for lk in touched:
                if lk.greedy or lk.lim_sum > lk.capacity * (1 + 1e-9):
                    break
            else:
                return
        self.rebalances += 1
        if not self.greedy:
            # Nothing to fill (a transfer just ended, say): only an oversubscribed touched link
            # has limited paths to turn greedy.
            for lk in touched:
                if lk.lim_sum > lk.capacity * (1 + 1e-9):
                    break
            else:
                return
        check = list(touched)
        while True:
            rates, levels = self._fill()
            moved = False
            for lk, level in list(levels.items()) + [(lk, -1.0) for lk in check]:
                if level < 0 and lk.lim_sum <= lk.capacity * (1 + 1e-9):
                    continue
                while True:
                    top = lk.top_limited()
                    if top is None:
                        break
                    over = lk.lim_sum > lk.capacity * (1 + 1e-9)
                    if not over and (level < 0 or top.inflow <= level * (1 + 1e-9)):
                        break
                    top._advance(t)
                    self._set_rate(top, t, 0.0)
                    self._to_greedy(top, t)
                    moved = True
                    if not over:
                        break
            if not moved:
                break
            check = []
        for p, r in rates.items():
            p._advance(t)
            self._set_rate(p, t, r)
            self._schedule(p, t)

    def _fill(self) -> tuple[dict[Path, float], dict[Link, float]]:
        """Weighted progressive filling of the greedy paths over the capacity the limited paths
        leave; returns their rates and the level (per connection) of every saturated link."""
        rates: dict[Path, float] = {}
        levels: dict[Link, float] = {}
        if len(self.greedy) == 1:
            # One greedy path (the usual case): its cap or the tightest link's room.
            one = next(iter(self.greedy))
            tight = one.links[0]
            room = tight.capacity - tight.lim_sum
            for lk in one.links[1:]:
                r = lk.capacity - lk.lim_sum
                if r < room:
                    tight, room = lk, r
            room = max(room, 0.0) / one.k
            if one.conn_rate < room:
                rates[one] = one.k * one.conn_rate
            else:
                rates[one] = one.k * room
                levels[tight] = room
            return rates, levels
        res: dict[Link, float] = {}
        wsum: dict[Link, float] = {}
        on: dict[Link, list[Path]] = {}
        for p in self.greedy:
            for lk in p.links:
                if lk not in res:
                    res[lk] = max(lk.capacity - lk.lim_sum, 0.0)
                    wsum[lk] = 0.0
                    on[lk] = []
                wsum[lk] += p.k
                on[lk].append(p)
        left: dict[Path, None] = dict.fromkeys(self.greedy)
        while left:
            lvl = math.inf
            bl: Link | None = None
            bf: Path | None = None
            for lk, w in wsum.items():
                if w > 0.5:
                    x = res[lk] / w
                    if x < lvl:
                        lvl, bl = x, lk
            for p in left:
                x = p.conn_rate
                if x < lvl:
                    lvl, bl, bf = x, None, p
            if bf is not None:
                freeze = [bf]
            elif bl is not None:
                freeze = [p for p in on[bl] if p in left]
                levels[bl] = lvl
            else:
                freeze = list(left)
            for p in freeze:
                r = p.k * lvl if lvl < math.inf else math.inf
                if r == math.inf:
                    r = 0.0 if not p.links else min(lk.capacity for lk in p.links)
                rates[p] = max(r, 0.0)
                del left[p]
                for lk in p.links:
                    res[lk] = max(res[lk] - r, 0.0)
                    wsum[lk] -= p.k
        return rates, levels
