"""The flow-level network's parts (`testbed.sim.network`): byte counters integrated lazily, links
with their limited paths, and paths with their state (idle, limited, greedy), queue and marks."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from testbed.core.schema.linkprofile import LinkProfile
from testbed.sim.tcp import TcpModel

IDLE, LIMITED, GREEDY = 0, 1, 2
_COMPACT = 4

MarkFn = Callable[[Any, float], None]


class Counter:
    """Cumulative bytes of a fluid whose rate changes at events: `at(t)` is exact."""

    __slots__ = ("acc", "rate", "t")

    def __init__(self) -> None:
        self.acc = 0.0
        self.rate = 0.0
        self.t = 0.0

    def change(self, t: float, delta: float) -> None:
        self.acc += self.rate * (t - self.t)
        self.t = t
        self.rate += delta
        if self.rate < 1e-6:
            self.rate = 0.0

    def at(self, t: float) -> float:
        return self.acc + self.rate * (t - self.t)


class Link:
    __slots__ = (
        "name",
        "kind",
        "tcp",
        "rate_bps",
        "delay",
        "loss",
        "loss_correlation",
        "capacity",
        "counter",
        "lim_sum",
        "limited",
        "_heap",
        "greedy",
    )

    def __init__(self, name: str, kind: str, profile: LinkProfile, tcp: TcpModel, delay_share: float = 1.0) -> None:
        self.name = name
        self.kind = kind  # "wan" or "nic"
        self.tcp = tcp
        self.rate_bps = profile.rate
        self.delay = profile.delay * delay_share
        self.loss = profile.loss
        self.loss_correlation = profile.loss_correlation
        self.capacity = tcp.link_payload(self.rate_bps, self.loss)
        self.counter = Counter()
        self.lim_sum = 0.0  # streams of the limited paths on it
        self.limited = 0
        self._heap: list[tuple[float, int, Path]] = []  # (-stream rate, token, path) of limited paths
        self.greedy = 0

    def add_limited(self, p: Path) -> None:
        self.lim_sum += p.inflow
        self.limited += 1
        heapq.heappush(self._heap, (-p.inflow, p.token, p))
        if len(self._heap) > _COMPACT * self.limited + 16:
            self._heap = [e for e in self._heap if e[2].state == LIMITED and e[2].token == e[1]]
            heapq.heapify(self._heap)

    def remove_limited(self, p: Path) -> None:
        self.lim_sum -= p.inflow
        self.limited -= 1
        if self.limited == 0:
            self.lim_sum = 0.0
            self._heap.clear()

    def top_limited(self) -> Path | None:
        """The limited path with the fastest stream."""
        h = self._heap
        while h:
            _, token, p = h[0]
            if p.state == LIMITED and p.token == token:
                return p
            heapq.heappop(h)
        return None


@dataclass(frozen=True, slots=True)
class Mark:
    pos: float
    seq: int
    fn: MarkFn
    arg: Any

    def __lt__(self, other: Mark) -> bool:
        return (self.pos, self.seq) < (other.pos, other.seq)


class Path:
    __slots__ = (
        "src",
        "dst",
        "links",
        "counters",
        "conns",
        "chunk",
        "tcp",
        "delay",
        "conn_rate",
        "released",
        "sent",
        "t",
        "inflow",
        "rate",
        "state",
        "k",
        "marks",
        "version",
        "token",
        "crosses",
        "due",
        "gate",
        "parked",
    )

    def __init__(
        self,
        src: str,
        dst: str,
        links: tuple[Link, ...],
        counters: tuple[Counter, ...],
        conns: int,
        chunk: float,
        tcp: TcpModel,
        crosses: bool,
        known: tuple[float, float] | None = None,
    ) -> None:
        self.src, self.dst = src, dst
        self.links = links
        self.counters = counters
        self.conns = conns
        self.chunk = chunk
        self.tcp = tcp
        self.crosses = crosses
        self.delay = 0.0
        self.conn_rate = math.inf
        self.released = 0.0  # bytes that entered the path so far
        self.sent = 0.0  # bytes that left the sender so far
        self.t = 0.0
        self.inflow = 0.0
        self.rate = 0.0
        self.state = IDLE
        self.k = 1
        self.marks: list[Mark] = []
        self.version = 0
        self.token = 0
        self.due = math.inf  # when its scheduled event (if greedy) is
        self.gate = 0.0  # its connections carry nothing before (testbed.sim.wan)
        self.parked = False  # greedy but carrying nothing (a dark link, a gate): left out of the fill
        if known is None:
            self.refresh()
        else:
            self.delay, self.conn_rate = known

    def refresh(self) -> None:
        """Delay and per-connection rate from the links' parameters in force."""
        self.delay = sum(lk.delay for lk in self.links)
        keep = 1.0
        corr = 0.0
        for lk in self.links:
            keep *= 1.0 - lk.loss
            corr = max(corr, lk.loss_correlation)
        self.conn_rate = self.tcp.connection_rate(2.0 * self.delay, 1.0 - keep, corr)

    @property
    def cap(self) -> float:
        return self.k * self.conn_rate

    def queued(self, t: float) -> float:
        if self.state != GREEDY:
            return 0.0
        return max(self.released + self.inflow * (t - self.t) - self.sent - self.rate * (t - self.t), 0.0)

    def _advance(self, t: float) -> None:
        dt = t - self.t
        if dt > 0:
            self.released += self.inflow * dt
            self.sent += self.rate * dt
            if self.sent > self.released:
                self.sent = self.released
            self.t = t
        elif dt < 0:
            raise RuntimeError(f"path {self.src}->{self.dst}: time went back ({t} < {self.t})")
